//! `sluice tpch gen` and `sluice tpch run`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Subcommand};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use sluice_engine::config::Sourced;
use sluice_engine::joins::JoinStrategy;
use sluice_engine::remote_tables::upload_directory;
use sluice_engine::{ExecutionMode, Result, SluiceConfig, SluiceError, SluiceSession};
use sluice_runtime::analyze::human_bytes;
use sluice_runtime::object_stores::{ObjectStores, StoreLimits, is_remote};
use sluice_tpch::bench::{
    BenchEvent, BenchOptions, BenchReport, QueryReport, QueryTarget, open_tpch_data, run_benchmark,
};
use sluice_tpch::{GenEvent, GenOptions, Manifest, QUERY_NUMBERS, generate};
use tokio::runtime::Runtime;

use crate::cancel::until_ctrl_c;
use crate::progress;
use crate::remote::{ProgressSource, Remote};

/// `sluice tpch …`.
#[derive(Debug, Subcommand)]
pub enum TpchCommand {
    /// Generate the 8 TPC-H tables as Parquet (re-running skips finished tables).
    Gen(GenArgs),
    /// Run TPC-H queries and print their timings.
    Run(RunArgs),
    /// Write the 22 queries as SQL files `qNN.sql` (to run them with other clients or engines).
    Queries(QueriesArgs),
}

/// Arguments of `sluice tpch queries`.
#[derive(Debug, Args)]
pub struct QueriesArgs {
    /// Scale factor the query parameters are for (q11's fraction depends on it).
    #[arg(long, allow_negative_numbers = true)]
    pub scale: f64,
    /// Directory to write `q01.sql` … `q22.sql` into (created if missing); a query of several
    /// statements has them separated by lines holding only `;`.
    #[arg(long, value_name = "DIR")]
    pub out: std::path::PathBuf,
}

/// Arguments of `sluice tpch gen`.
#[derive(Debug, Args)]
pub struct GenArgs {
    /// Scale factor (1 ≈ 1 GB of raw data, 6 million lineitem rows).
    #[arg(long, allow_negative_numbers = true)]
    pub scale: f64,
    /// Output directory (one sub-directory per table), or an object store's prefix (generated
    /// locally, then each file uploaded once; objects of the same names are replaced).
    #[arg(long, value_name = "DIR|URL")]
    pub out: PathBuf,
    /// Files per large table [default: max(4, 4 × SF)].
    #[arg(long, value_name = "N")]
    pub parts: Option<usize>,
    /// Replace data of another scale factor in DIR.
    #[arg(long)]
    pub force: bool,
    /// Generator threads [default: the number of CPUs].
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

/// Arguments of `sluice tpch run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Directory written by `sluice tpch gen` (with `--connect`: only read for its scale factor
    /// and for `--compare-local`).
    #[arg(long, value_name = "DIR", required_unless_present = "connect")]
    pub data: Option<PathBuf>,
    /// Run the queries on the `sluice server` at this address (`grpc://HOST:PORT`), on its tables,
    /// in a session of their own; needs `--scale` or `--data DIR` with the same data's `tpch.json`.
    #[arg(long, value_name = "URL")]
    pub connect: Option<String>,
    /// Query to run, 1 to 22 (repeatable) [default: all 22].
    #[arg(
        long = "query",
        short = 'q',
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub queries: Vec<i64>,
    /// Runs per query; the table shows min and median.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub iterations: usize,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Compare every result with the official TPC-H answers (scale factor 1 only).
    #[arg(long)]
    pub verify: bool,
    /// Compare every result with the answers in DIR (`q01.tbl` … `q22.tbl`: a `|`-separated
    /// header line, then one line per row, as the official answers; numbers with a decimal point
    /// within the TPC-H tolerances), at any scale factor: for example the answers another engine
    /// computed over the same files (`scripts/tpch-answers-duckdb.py`).
    #[arg(long, value_name = "DIR", conflicts_with = "verify")]
    pub answers: Option<PathBuf>,
    /// Also write every result to DIR as `q01.tbl` … `q22.tbl`, in the form `--answers` reads:
    /// keep one mode's (or one copy's) answers and compare a later run with them.
    #[arg(long, value_name = "DIR")]
    pub save_answers: Option<PathBuf>,
    /// Scale factor of the data [default: read from DIR/tpch.json].
    #[arg(long, allow_negative_numbers = true)]
    pub scale: Option<f64>,
    /// Also run every query in local mode (no memory limit, hash joins) and compare the rows (any
    /// scale factor).
    #[arg(long)]
    pub compare_local: bool,
}

/// The scale factor of the data a server reads: `--scale`, else `--data DIR`'s `tpch.json`.
fn remote_scale_factor(given: Option<f64>, data: Option<&Path>) -> Result<f64> {
    let scale_factor = match (given, data) {
        (Some(given), _) => given,
        (None, Some(dir)) => sluice_tpch::read_manifest(dir)?
            .map(|manifest| manifest.scale_factor)
            .ok_or_else(|| {
                SluiceError::invalid(format!(
                    "{}: cannot tell the scale factor (no tpch.json); pass --scale",
                    dir.display()
                ))
            })?,
        (None, None) => {
            return Err(SluiceError::invalid(
                "--connect: pass --scale (the scale factor of the server's TPC-H tables) or \
                 --data DIR with their tpch.json",
            ));
        }
    };
    sluice_tpch::datagen::check_scale_factor(scale_factor)?;
    Ok(scale_factor)
}

/// Runs a `tpch` sub-command.
pub fn run(command: TpchCommand, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    match command {
        TpchCommand::Gen(args) => {
            let location = args.out.to_string_lossy().to_string();
            // To an object store: generated into a local staging directory, then each file
            // uploaded once, the manifest last.
            let staging = if is_remote(&location) {
                Some(tempfile::tempdir().map_err(|e| SluiceError::io(std::env::temp_dir(), e))?)
            } else {
                None
            };
            let options = GenOptions {
                scale_factor: args.scale,
                out: staging
                    .as_ref()
                    .map_or(args.out.clone(), |dir| dir.path().to_path_buf()),
                parts: args.parts,
                force: args.force,
                threads: args.threads.unwrap_or_else(default_threads),
            };
            let manifest = generate_with_progress(&options)?;
            if let Some(staging) = &staging {
                let stores = RuntimeEnvBuilder::new()
                    .with_object_store_registry(
                        ObjectStores::new(StoreLimits::default()).into_registry(),
                    )
                    .build()?;
                let files = runtime.block_on(upload_directory(
                    &stores,
                    staging.path(),
                    &location,
                    sluice_tpch::datagen::MANIFEST,
                ))?;
                eprintln!("uploaded {files} files to {location}");
            }
            print_manifest(&manifest);
            Ok(ExitCode::SUCCESS)
        }
        TpchCommand::Queries(args) => {
            write_queries(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        TpchCommand::Run(args) => {
            let queries = query_numbers(&args.queries)?;
            if args.iterations == 0 {
                return Err(SluiceError::invalid("--iterations must be at least 1"));
            }
            let reference = match (&args.data, args.compare_local) {
                (Some(data), true) => Some(local_reference(config, data, runtime)?),
                (None, true) => {
                    return Err(SluiceError::invalid(
                        "--compare-local needs --data DIR (the same data the server reads)",
                    ));
                }
                (_, false) => None,
            };
            let options = |scale_factor| BenchOptions {
                queries,
                iterations: args.iterations,
                verify: args.verify,
                answers: args.answers.clone(),
                save_answers: args.save_answers.clone(),
                scale_factor,
            };
            let json = args.json.as_deref();
            if let Some(url) = &args.connect {
                let scale_factor = remote_scale_factor(args.scale, args.data.as_deref())?;
                let remote = runtime.block_on(Remote::connect(url))?;
                let options = options(scale_factor);
                return run_and_report(
                    &remote,
                    &remote,
                    reference.as_ref(),
                    &options,
                    json,
                    runtime,
                );
            }
            let data = args
                .data
                .as_deref()
                .ok_or_else(|| SluiceError::invalid("--data DIR is needed"))?;
            let mut session = SluiceSession::new(config, crate::runners::runner_for(config))?;
            let scale_factor = runtime.block_on(open_tpch_data(&mut session, data, args.scale))?;
            let options = options(scale_factor);
            run_and_report(
                &session,
                session.runner(),
                reference.as_ref(),
                &options,
                json,
                runtime,
            )
        }
    }
}

/// A local-mode session over the TPC-H data in `data`, with `config`'s DataFusion settings: the
/// reference results are compared with. It runs without a memory limit and with hash joins, so
/// that a memory-limited run (sort-merge joins, spills) is checked against DataFusion's plain
/// plan, and a limit too small for one process cannot fail the reference.
pub fn local_reference(
    config: &SluiceConfig,
    data: &Path,
    runtime: &Runtime,
) -> Result<SluiceSession> {
    let mut local = config.clone();
    local.mode = Sourced::new(ExecutionMode::Local, "the local reference");
    local.memory_limit = Sourced::new(None, "the local reference");
    local.joins = Sourced::new(JoinStrategy::Hash, "the local reference");
    let mut reference = SluiceSession::new(&local, crate::runners::runner_for(&local))?;
    runtime.block_on(open_tpch_data(&mut reference, data, None))?;
    Ok(reference)
}

/// Threads for CPU-bound generation.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn query_numbers(given: &[i64]) -> Result<Vec<u8>> {
    if given.is_empty() {
        return Ok(QUERY_NUMBERS.collect());
    }
    given
        .iter()
        .map(|&n| {
            u8::try_from(n)
                .ok()
                .filter(|n| QUERY_NUMBERS.contains(n))
                .ok_or_else(|| {
                    SluiceError::invalid(format!(
                        "unknown TPC-H query {n}: queries are numbered 1 to 22"
                    ))
                })
        })
        .collect()
}

/// Generates data with a progress bar on a terminal and a summary line on stderr.
pub fn generate_with_progress(options: &GenOptions) -> Result<Manifest> {
    let start = Instant::now();
    let bar = progress::bar(0, "files");
    let manifest = generate(options, &|event| match event {
        GenEvent::Started { files, skipped } => {
            bar.set_length(files as u64);
            if !skipped.is_empty() {
                bar.suspend(|| eprintln!("already generated: {}", skipped.join(", ")));
            }
        }
        GenEvent::FileDone { table, .. } => {
            bar.set_message(table);
            bar.inc(1);
        }
        GenEvent::TableDone { .. } => {}
    })?;
    bar.finish_and_clear();
    eprintln!(
        "TPC-H scale {} in {} ({:.1}s)",
        manifest.scale_factor,
        options.out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(manifest)
}

fn print_manifest(manifest: &Manifest) {
    println!("{:<10} {:>6} {:>12}", "table", "files", "rows");
    for (name, table) in &manifest.tables {
        println!("{name:<10} {:>6} {:>12}", table.parts, table.rows);
    }
}

/// Writes `sluice tpch queries`' files.
fn write_queries(args: &QueriesArgs) -> Result<()> {
    std::fs::create_dir_all(&args.out).map_err(|e| SluiceError::io(&args.out, e))?;
    for number in 1..=22u8 {
        let query = sluice_tpch::tpch_query(number, args.scale)?;
        let path = args.out.join(format!("q{number:02}.sql"));
        let text = query.statements.join("\n;\n") + "\n";
        std::fs::write(&path, text).map_err(|e| SluiceError::io(&path, e))?;
    }
    eprintln!("wrote q01.sql … q22.sql to {}", args.out.display());
    Ok(())
}

/// Runs the benchmark, prints its table (and the pass/fail line when verifying), writes `--json`.
pub fn run_and_report(
    session: &dyn QueryTarget,
    source: &dyn ProgressSource,
    reference: Option<&SluiceSession>,
    options: &BenchOptions,
    json: Option<&Path>,
    runtime: &Runtime,
) -> Result<ExitCode> {
    let bar = progress::bar(options.queries.len() as u64, "queries");
    let label = std::sync::Mutex::new(String::new());
    let set_label = |text: String| {
        bar.set_message(text.clone());
        if let Ok(mut label) = label.lock() {
            *label = text;
        }
    };
    let mut on_event = |event: BenchEvent<'_>| match event {
        BenchEvent::Running { query, iteration } => {
            set_label(format!("q{query} (run {iteration}/{})", options.iterations));
        }
        BenchEvent::Finished(_) => bar.inc(1),
    };
    let show = |line: &str| {
        if let Ok(label) = label.lock() {
            bar.set_message(format!("{label} · {line}"));
        }
    };
    let say = |line: &str| bar.suspend(|| eprintln!("{line}"));
    let work = run_benchmark(session, reference, options, &mut on_event);
    let report = runtime.block_on(until_ctrl_c(progress::with_job_progress(
        source, &show, &say, work,
    )));
    bar.finish_and_clear();
    let report = report?;
    print_report(&report, options.verify || options.answers.is_some());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| SluiceError::invalid(format!("cannot encode report: {e}")))?;
        std::fs::write(path, text).map_err(|e| SluiceError::io(path, e))?;
    }
    let (_, failed) = report.counts();
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Per query that needed it, and in total, what recovering from failures took (nothing when no
/// worker was lost and no region retried).
fn print_recovery(report: &BenchReport) {
    let recovered = |q: &&QueryReport| q.workers_lost + q.regions_retried > 0;
    if !report.queries.iter().any(|q| recovered(&q)) {
        return;
    }
    let line = |lost: usize, regions: usize, tasks: usize| {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        format!(
            "{} lost, {} ({}) retried",
            plural(lost, "worker", "workers"),
            plural(regions, "region", "regions"),
            plural(tasks, "task", "tasks")
        )
    };
    for q in report.queries.iter().filter(recovered) {
        println!(
            "q{}: {}",
            q.query,
            line(q.workers_lost, q.regions_retried, q.tasks_retried)
        );
    }
    let sum = |f: fn(&QueryReport) -> usize| report.queries.iter().map(f).sum::<usize>();
    println!(
        "recovery: {}",
        line(
            sum(|q| q.workers_lost),
            sum(|q| q.regions_retried),
            sum(|q| q.tasks_retried)
        )
    );
}

fn print_report(report: &BenchReport, verify: bool) {
    println!(
        "TPC-H SF {} · mode {} · {} partitions · {} iteration(s)",
        report.scale_factor, report.mode, report.target_partitions, report.iterations
    );
    println!(
        "{:<6} {:>8} {:>10} {:>11}  result",
        "query", "rows", "min (s)", "median (s)"
    );
    for query in &report.queries {
        let result = match (&query.error, query.verified, query.matches_local) {
            (Some(_), Some(false), _) | (Some(_), _, Some(false)) => "WRONG",
            (Some(_), _, _) => "ERROR",
            (None, Some(true), _) => "verified",
            (None, _, Some(true)) => "same as local",
            (None, _, _) => "ok",
        };
        println!(
            "{:<6} {:>8} {:>10.3} {:>11.3}  {result}",
            format!("q{}", query.query),
            query.rows,
            query.min,
            query.median
        );
    }
    println!(
        "{:<6} {:>8} {:>10.3} {:>11.3}",
        "total", "", report.total_min, report.total_median
    );
    for query in &report.queries {
        if let Some(error) = &query.error {
            println!("q{}: {error}", query.query);
        }
    }
    let bytes = |f: fn(&QueryReport) -> u64| report.queries.iter().map(f).sum::<u64>();
    let (shuffled, spilled) = (bytes(|q| q.shuffled_bytes), bytes(|q| q.spilled_bytes));
    if shuffled + spilled > 0 {
        println!(
            "shuffled {}, spilled {} (summed over the jobs' tasks)",
            human_bytes(shuffled),
            human_bytes(spilled)
        );
    }
    let scanned = bytes(|q| q.scanned_bytes);
    if scanned > 0 {
        println!(
            "fetched {} by scans (every iteration; --json has it per query)",
            human_bytes(scanned)
        );
    }
    print_recovery(report);
    if verify || report.queries.iter().any(|q| q.matches_local.is_some()) {
        let (passed, failed) = report.counts();
        println!("{passed} passed, {failed} failed");
    }
}
