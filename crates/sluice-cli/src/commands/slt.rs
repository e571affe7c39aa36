//! `sluice slt`: DataFusion's SQL logic test files through the configured mode's job runner.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use sluice_engine::{Result, SluiceConfig, SluiceError};
use sluice_slt::{SltEvent, SltOptions, SltTarget, run_file, slt_config};
use tokio::runtime::Runtime;

use crate::cancel::until_ctrl_c;
use crate::progress;

/// Arguments of `sluice slt`.
#[derive(Debug, Args)]
pub struct SltArgs {
    /// The .slt files to run.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Stop at the first failed record.
    #[arg(long)]
    pub fail_fast: bool,
    /// Run every file on the `sluice server` at this address (`grpc://HOST:PORT`), each in a
    /// session of its own, instead of in this process.
    #[arg(long, value_name = "URL")]
    pub connect: Option<String>,
}

/// Runs the files one after another, each in a fresh session, and prints one line per file, every
/// failure, and the totals.
pub fn run(args: SltArgs, config: &SluiceConfig, runtime: &Runtime) -> Result<ExitCode> {
    let config = slt_config(config)?;
    let files = args
        .files
        .iter()
        .map(|path| std::fs::canonicalize(path).map_err(|e| SluiceError::io(path, e)))
        .collect::<Result<Vec<_>>>()?;
    // Test files write scratch output relative to the working directory: keep it out of the user's.
    let scratch = tempfile::tempdir().map_err(|e| SluiceError::io("<temp dir>", e))?;
    std::env::set_current_dir(scratch.path()).map_err(|e| SluiceError::io(scratch.path(), e))?;

    let target = match &args.connect {
        Some(url) => SltTarget::Remote(url.clone()),
        None => SltTarget::Local(crate::runners::runner_factory()),
    };
    let options = SltOptions {
        fail_fast: args.fail_fast,
    };
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for (path, shown) in files.iter().zip(&args.files) {
        let bar = progress::bar(0, "records");
        bar.set_message(shown.display().to_string());
        let mut on_event = |event| match event {
            SltEvent::Started { records } => bar.set_length(records as u64),
            SltEvent::Record => bar.inc(1),
        };
        let report = runtime.block_on(until_ctrl_c(async {
            Ok(run_file(path, &config, &target, options, &mut on_event).await)
        }));
        bar.finish_and_clear();
        let report = report?;
        println!(
            "{}  {} passed, {} failed, {} skipped ({:.2}s)",
            shown.display(),
            report.passed,
            report.failed,
            report.skipped,
            report.seconds
        );
        for failure in &report.failures {
            println!("\n{}\n", failure.message.trim_end());
        }
        passed += report.passed;
        failed += report.failed;
        skipped += report.skipped;
        if failed > 0 && args.fail_fast {
            break;
        }
    }
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
