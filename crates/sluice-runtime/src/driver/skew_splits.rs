//! The driver's side of skew splits (`sluice_planner::job_graph::skew_joins`): once both inputs of
//! a partitioned hash join finished (blocking exchanges), the rows their producers wrote to each
//! channel are known exactly; a probe channel holding far more rows than the median is spread over
//! several of the join's tasks. Pure code over the job's entry.
//!
//! ```text
//!   probe rows per channel (4 producers q0..q3):   ch0 10   ch1 12   ch2 900   ch3 11
//!   median 12, factor 4, channel 2 is hot: its producers' pieces, largest first, go to the task
//!   with the fewest rows so far (task 2 first), over at most ceil(900 / 12) tasks:
//!     task 2 reads probe (q0,2)            + build channel 2
//!     task 0 reads probe ch0 + (q1,2)      + build channels 0, 2
//!     task 3 reads probe ch3 + (q2,2)      + build channels 3, 2     ...
//! ```
//!
//! Invariants: a job decides once per join stage, before any of its tasks is placed (its region
//! waits for both inputs), and every attempt of every task of that stage reads what was decided
//! (a retried task, or one run again after a lost worker, reads the same streams, so its rows and
//! the job output's resume checksum hold); every probe stream is read by exactly one task; a task
//! reading part of channel `h`'s probe rows reads all of channel `h`'s build rows; anything
//! missing (a producer task without row counts) leaves the stage as planned and says why.

use std::collections::BTreeSet;
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use sluice_planner::{InputKey, SkewJoin, StageId, TaskId};

use super::StageNote;
use super::job::JobEntry;
use crate::options::sluice_options_of;
use crate::task::TaskInput;

/// When a channel counts as skewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SkewThreshold {
    /// Its rows exceed this many times the median channel's ...
    pub factor: u64,
    /// ... and this many rows.
    pub min_rows: u64,
}

/// What one task of a split join stage reads in place of its own channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskShare {
    /// Probe streams: (producer partition, channel).
    pub probe: Vec<(usize, usize)>,
    /// Build channels, each read from every build producer.
    pub build_channels: Vec<usize>,
}

/// A join stage's decided split: per task partition, its share (`None`: its own channel, as
/// planned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SkewSplit {
    /// The join's build input (index into the stage's inputs).
    pub build_input: usize,
    /// Its probe input.
    pub probe_input: usize,
    pub shares: Vec<Option<TaskShare>>,
}

/// One hot channel and where its probe rows went, for the note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpreadChannel {
    pub channel: usize,
    /// Its probe rows.
    pub rows: u64,
    /// Its build rows (each extra task reads them again).
    pub build_rows: u64,
    /// The tasks that read part of it, with the probe rows of it each reads.
    pub tasks: Vec<(usize, u64)>,
}

/// One producer's part of a channel: (producer partition, rows).
type Piece = (usize, u64);

/// What a build row costs a task, in probe rows: it is read, hashed and inserted into the hash
/// table (measured: a hash join task builds 2.5 M rows in about the time it probes 4.5 M).
pub(super) const BUILD_ROW_COST: u64 = 2;

/// A hot channel is spread only if its busiest task then carries at most this share
/// (numerator, denominator) of what its one task would: the build rows every extra task reads
/// again, and the streams it reads from other workers, cost more than the model counts.
const MIN_GAIN: (u64, u64) = (3, 4);

/// How the probe rows of `probe[q][c]` (producer `q`, channel `c`) are spread over the join's
/// `probe[q].len()` tasks, given the build rows of each channel (`build[c]`, summed over the build
/// producers); `None` when no channel is skewed or none was worth splitting (one producer wrote all
/// of it, or its build rows are so many that reading them again in other tasks costs about what
/// spreading the probe rows saves).
///
/// A task's load is its probe rows plus [`BUILD_ROW_COST`] per build row. A hot channel's pieces
/// (one per producer), largest first, go to whichever receiver they load least, a receiver other
/// than the channel's own task paying for the channel's build rows with its first piece; at most
/// `rows / median` receivers, the least loaded first.
pub(crate) fn spread(
    probe: &[Vec<u64>],
    build: &[u64],
    threshold: SkewThreshold,
) -> Option<(Vec<Option<TaskShare>>, Vec<SpreadChannel>)> {
    let channels = probe.first().map_or(0, Vec::len);
    if channels < 2 || build.len() != channels || probe.iter().any(|r| r.len() != channels) {
        return None;
    }
    let totals: Vec<u64> = (0..channels)
        .map(|c| probe.iter().map(|r| r[c]).sum())
        .collect();
    let mut sorted = totals.clone();
    sorted.sort_unstable();
    let median = sorted[(channels - 1) / 2].max(1);
    let limit = median
        .saturating_mul(threshold.factor)
        .max(threshold.min_rows);
    let mut hot: Vec<usize> = (0..channels).filter(|c| totals[*c] > limit).collect();
    hot.sort_by_key(|c| (std::cmp::Reverse(totals[*c]), *c));
    let hot_set: BTreeSet<usize> = hot.iter().copied().collect();
    let build_cost = |c: usize| build[c].saturating_mul(BUILD_ROW_COST);
    // What each task carries so far; a hot channel's task starts with its build rows alone.
    let mut load: Vec<u64> = (0..channels)
        .map(|c| {
            let own = if hot_set.contains(&c) { 0 } else { totals[c] };
            own.saturating_add(build_cost(c))
        })
        .collect();
    let mut shares: Vec<Option<TaskShare>> = vec![None; channels];
    let mut spread = Vec::new();
    for h in hot {
        // A producer that wrote nothing to the channel still has its (empty) stream read, by the
        // channel's own task: every stream is read by exactly one task whatever a re-run writes.
        let (mut pieces, empty): (Vec<Piece>, Vec<Piece>) = probe
            .iter()
            .enumerate()
            .map(|(q, r)| (q, r[h]))
            .partition(|(_, n)| *n > 0);
        let unsplit = load[h].saturating_add(totals[h]);
        if pieces.len() < 2 {
            load[h] = unsplit;
            continue;
        }
        pieces.sort_by_key(|(q, n)| (std::cmp::Reverse(*n), *q));
        let wanted = totals[h].div_ceil(median) as usize;
        let mut others: Vec<usize> = (0..channels).filter(|c| !hot_set.contains(c)).collect();
        others.sort_by_key(|c| (load[*c], *c));
        let receivers: Vec<usize> = std::iter::once(h)
            .chain(others)
            .take(wanted.min(pieces.len()).min(channels))
            .collect();
        let mut tried = load.clone();
        let mut got: Vec<Vec<Piece>> = vec![Vec::new(); receivers.len()];
        for piece in pieces {
            let cost = |r: usize| {
                let reads_build = r == 0 || !got[r].is_empty();
                let extra = if reads_build { 0 } else { build_cost(h) };
                tried[receivers[r]]
                    .saturating_add(piece.1)
                    .saturating_add(extra)
            };
            // Receiver 0 is the channel's own task: there always is one.
            let r = (0..receivers.len())
                .min_by_key(|r| (cost(*r), *r))
                .unwrap_or(0);
            tried[receivers[r]] = cost(r);
            got[r].push(piece);
        }
        let busiest = receivers.iter().map(|r| tried[*r]).max().unwrap_or(unsplit);
        let worth_it = busiest.saturating_mul(MIN_GAIN.1) <= unsplit.saturating_mul(MIN_GAIN.0);
        if !worth_it || got.iter().filter(|g| !g.is_empty()).count() < 2 {
            load[h] = unsplit;
            continue;
        }
        load = tried;
        got[0].extend(empty);
        let mut tasks = Vec::new();
        for (r, pieces) in receivers.iter().zip(got) {
            if pieces.is_empty() {
                continue;
            }
            let share = shares[*r].get_or_insert_with(|| TaskShare {
                probe: if *r == h {
                    Vec::new()
                } else {
                    (0..probe.len()).map(|q| (q, *r)).collect()
                },
                build_channels: if *r == h { Vec::new() } else { vec![*r] },
            });
            share.probe.extend(pieces.iter().map(|(q, _)| (*q, h)));
            share.build_channels.push(h);
            tasks.push((*r, pieces.iter().map(|(_, n)| n).sum()));
        }
        spread.push(SpreadChannel {
            channel: h,
            rows: totals[h],
            build_rows: build[h],
            tasks,
        });
    }
    (!spread.is_empty()).then_some((shares, spread))
}

/// Whether the driver keeps `stage`'s rows per channel: only for the inputs of a join it may split
/// (a wide stage's counts cost its width times its channels).
pub(super) fn needs_channel_rows(graph: &sluice_planner::JobGraph, stage: StageId) -> bool {
    graph.skew_joins().iter().any(|join| {
        graph.stage(join.stage).is_some_and(|s| {
            [join.build_input, join.probe_input]
                .iter()
                .any(|i| s.inputs.get(*i).is_some_and(|input| input.stage == stage))
        })
    })
}

/// Decides the split of every join stage whose two inputs are now complete (`finished` is the
/// last of them); see the module docs.
pub(super) fn decide_ready(entry: &mut JobEntry, finished: StageId) -> Vec<StageNote> {
    let graph = Arc::clone(&entry.graph);
    let mut notes = Vec::new();
    for join in graph.skew_joins() {
        let Some((build, probe)) = producers(&graph, join) else {
            continue;
        };
        if (build != finished && probe != finished)
            || entry.skew_decided.contains(&join.stage)
            || !entry.stage_complete(build)
            || !entry.stage_complete(probe)
        {
            continue;
        }
        entry.skew_decided.insert(join.stage);
        match decide(entry, join, build, probe) {
            Ok(Some((split, note))) => {
                entry.skew_splits.insert(join.stage, split);
                notes.push(note);
            }
            Ok(None) => {}
            Err(e) => notes.push(StageNote {
                target: join.stage,
                text: format!("skew split: none, {e}"),
            }),
        }
    }
    notes
}

/// The join's build and probe producer stages.
pub(super) fn producers(
    graph: &sluice_planner::JobGraph,
    join: &SkewJoin,
) -> Option<(StageId, StageId)> {
    let inputs = &graph.stage(join.stage)?.inputs;
    Some((
        inputs.get(join.build_input)?.stage,
        inputs.get(join.probe_input)?.stage,
    ))
}

/// The rows each task of `stage` (its succeeded attempt) wrote to each channel, or which task
/// reported none.
fn channel_rows(entry: &JobEntry, stage: StageId) -> Result<Vec<Vec<u64>>, String> {
    let partitions = entry.graph.stage(stage).map_or(0, |s| s.partitions());
    (0..partitions)
        .map(|partition| {
            let task = TaskId { stage, partition };
            entry
                .metrics_of_success(task)
                .map(|m| m.channel_rows.clone())
                .filter(|rows| !rows.is_empty())
                .ok_or_else(|| format!("{task} reported no rows per channel"))
        })
        .collect()
}

fn decide(
    entry: &JobEntry,
    join: &SkewJoin,
    build: StageId,
    probe: StageId,
) -> Result<Option<(SkewSplit, StageNote)>, String> {
    let options = sluice_options_of(&entry.config).map_err(|e| e.strip_backtrace())?;
    if !options.skew_join_split {
        return Ok(None);
    }
    let probe_rows = channel_rows(entry, probe)?;
    let build_rows = channel_rows(entry, build)?;
    let channels = probe_rows.first().map_or(0, Vec::len);
    let build_totals: Vec<u64> = (0..channels)
        .map(|c| {
            build_rows
                .iter()
                .map(|r| r.get(c).copied().unwrap_or(0))
                .sum()
        })
        .collect();
    let threshold = SkewThreshold {
        factor: options.skew_join_factor,
        min_rows: options.skew_join_min_rows,
    };
    let Some((shares, spread)) = spread(&probe_rows, &build_totals, threshold) else {
        return Ok(None);
    };
    let channels: Vec<String> = spread
        .iter()
        .map(|c| {
            let tasks: Vec<String> = c
                .tasks
                .iter()
                .map(|(task, rows)| format!("{task} ({rows})"))
                .collect();
            format!(
                "partition {} ({} probe rows, {} build rows) over tasks {}",
                c.channel,
                c.rows,
                c.build_rows,
                tasks.join(", ")
            )
        })
        .collect();
    let note = StageNote {
        target: join.stage,
        text: format!(
            "skew split: {}, each reading its build rows too (over {} times the median partition \
             and {} rows), for {}",
            channels.join("; "),
            threshold.factor,
            threshold.min_rows,
            join.join
        ),
    };
    let split = SkewSplit {
        build_input: join.build_input,
        probe_input: join.probe_input,
        shares,
    };
    Ok(Some((split, note)))
}

/// `inputs` (task `partition`'s of a split stage) with its share's streams in place of its own
/// channel's; `build_partitions` is the build producer's partition count.
pub(super) fn reassign(
    inputs: &mut [TaskInput],
    split: &SkewSplit,
    partition: usize,
    build_partitions: usize,
) -> Result<()> {
    let Some(Some(share)) = split.shares.get(partition) else {
        return Ok(());
    };
    let key = |partition, channel| InputKey {
        partition,
        channel,
        replica: 0,
    };
    let probe: Vec<InputKey> = share.probe.iter().map(|(q, c)| key(*q, *c)).collect();
    let build: Vec<InputKey> = share
        .build_channels
        .iter()
        .flat_map(|c| (0..build_partitions).map(move |q| key(q, *c)))
        .collect();
    for (index, keys) in [(split.probe_input, probe), (split.build_input, build)] {
        let input = inputs.get_mut(index).ok_or_else(|| {
            DataFusionError::Internal(format!("a skew split names missing input {index}"))
        })?;
        let slot = partition
            .checked_sub(input.first)
            .and_then(|k| input.keys.get_mut(k))
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "a skew split's task {partition} does not read partition {partition} of input {index}"
                ))
            })?;
        *slot = keys;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use sluice_planner::TaskAttempt;

    use super::*;

    const LOW: SkewThreshold = SkewThreshold {
        factor: 4,
        min_rows: 0,
    };

    #[test]
    fn a_hot_channel_is_spread_by_producer_over_the_least_loaded_tasks() {
        // Four producers, four channels; channel 2 holds 900 rows in pieces of 400, 300, 150, 50.
        let rows = vec![
            vec![3, 3, 400, 2],
            vec![3, 4, 300, 3],
            vec![2, 3, 150, 3],
            vec![2, 2, 50, 3],
        ];
        let (shares, spread) = spread(&rows, &[0; 4], LOW).unwrap();
        // Median 11 (channels 10, 12, 11 and 900): all four pieces may go to separate tasks.
        assert_eq!(
            spread,
            [SpreadChannel {
                channel: 2,
                rows: 900,
                build_rows: 0,
                tasks: vec![(2, 400), (0, 300), (3, 150), (1, 50)],
            }]
        );
        assert_eq!(
            shares[2],
            Some(TaskShare {
                probe: vec![(0, 2)],
                build_channels: vec![2],
            })
        );
        assert_eq!(
            shares[0],
            Some(TaskShare {
                probe: vec![(0, 0), (1, 0), (2, 0), (3, 0), (1, 2)],
                build_channels: vec![0, 2],
            })
        );
        // Every probe stream is read by exactly one task.
        let mut read: Vec<(usize, usize)> = (0..4)
            .flat_map(|t| match &shares[t] {
                Some(share) => share.probe.clone(),
                None => (0..4).map(|q| (q, t)).collect(),
            })
            .collect();
        read.sort_unstable();
        let every: Vec<(usize, usize)> = (0..4).flat_map(|q| (0..4).map(move |c| (q, c))).collect();
        assert_eq!(read, every);
    }

    #[test]
    fn a_channel_spreads_over_no_more_tasks_than_its_rows_need() {
        // Channel 0 holds 5 times the median: at most 5 tasks, though 8 producers wrote it.
        let mut one = vec![5u64; 8];
        one[0] = 25;
        let rows = vec![one; 8];
        let (_, spread) = spread(&rows, &[0; 8], LOW).unwrap();
        assert_eq!(spread[0].rows, 200);
        assert_eq!(spread[0].tasks.len(), 5, "{spread:?}");
        assert_eq!(spread[0].tasks.iter().map(|t| t.1).sum::<u64>(), 200);
    }

    #[test]
    fn no_split_below_the_threshold_or_with_one_producer_or_one_channel() {
        let even = vec![vec![10, 12, 11, 9]; 3];
        assert_eq!(spread(&even, &[0; 4], LOW), None);
        // 900 rows is 75 times the median, but under the minimum rows.
        let hot = vec![vec![4, 4, 450, 4], vec![4, 4, 450, 4]];
        let high = SkewThreshold {
            factor: 4,
            min_rows: 1000,
        };
        assert_eq!(spread(&hot, &[0; 4], high), None);
        assert!(spread(&hot, &[0; 4], LOW).is_some());
        // One producer wrote the hot channel: nothing to split it by.
        let single = vec![vec![4, 4, 900, 4], vec![4, 4, 0, 4]];
        assert_eq!(spread(&single, &[0; 4], LOW), None);
        assert_eq!(spread(&[vec![900]], &[0], LOW), None);
        // Producers disagreeing on the channel count: no split rather than a guess.
        assert_eq!(spread(&[vec![1, 900], vec![1]], &[0; 2], LOW), None);
        assert_eq!(spread(&hot, &[0; 3], LOW), None);
    }

    #[test]
    fn a_hot_channel_whose_build_rows_cost_about_what_spreading_saves_stays_whole() {
        // Thousands of rows: channel 2's 18,200 probe rows in two pieces, 2,500 build rows in
        // every channel. A second task would read channel 2's build rows again: its busiest task
        // would carry 18,750 of the 23,200 one task carries, not enough of a gain.
        let probe = vec![
            vec![100, 100, 9_700, 100],
            vec![150, 150, 8_500, 150],
            vec![10, 10, 0, 10],
        ];
        assert_eq!(spread(&probe, &[2_500; 4], LOW), None);
        // So many build rows that every piece is cheapest on the channel's own task.
        assert_eq!(spread(&probe, &[20_000; 4], LOW), None);
        // Few build rows: the second piece goes to the least loaded other task.
        let (shares, spread) = spread(&probe, &[100; 4], LOW).unwrap();
        assert_eq!(
            spread,
            [SpreadChannel {
                channel: 2,
                rows: 18_200,
                build_rows: 100,
                tasks: vec![(2, 9_700), (0, 8_500)],
            }]
        );
        assert_eq!(shares[0].as_ref().unwrap().build_channels, [0, 2]);
        assert_eq!(shares[1], None);
        // The producer that wrote nothing to channel 2 still has its stream read, by task 2.
        assert_eq!(shares[2].as_ref().unwrap().probe, [(0, 2), (2, 2)]);
    }

    /// A job entry for `select big.b from small join big on small.a = big.a` with blocking
    /// exchanges and a partitioned join (`small` has 2 partitions, `big` 4, 4 channels), and the
    /// join's build and probe producer stages.
    pub(in crate::driver) async fn join_entry() -> (JobEntry, SkewJoin, StageId, StageId) {
        use datafusion::arrow::array::{Int64Array, RecordBatch};
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        use datafusion::datasource::MemTable;
        use datafusion::prelude::{SessionConfig, SessionContext};
        use sluice_planner::{JobGraph, JobGraphOptions, JobId, OutputMode};

        let mut config = SessionConfig::new().with_target_partitions(4);
        for (key, value) in sluice_planner::DISTRIBUTED_SETTINGS.iter().chain(&[
            (
                "datafusion.optimizer.hash_join_single_partition_threshold",
                "0",
            ),
            (
                "datafusion.optimizer.hash_join_single_partition_threshold_rows",
                "0",
            ),
        ]) {
            config.options_mut().set(key, value).unwrap();
        }
        let ctx = SessionContext::new_with_config(config);
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("b", DataType::Int64, false),
        ]));
        for (name, partitions) in [("big", 4), ("small", 2)] {
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from(vec![1, 2])),
                    Arc::new(Int64Array::from(vec![3, 4])),
                ],
            )
            .unwrap();
            let table =
                MemTable::try_new(Arc::clone(&schema), vec![vec![batch]; partitions]).unwrap();
            ctx.register_table(name, Arc::new(table)).unwrap();
        }
        let plan = ctx
            .sql("select big.b from small join big on small.a = big.a")
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let options = JobGraphOptions {
            exchange_mode: OutputMode::Blocking,
            ..JobGraphOptions::default()
        };
        let graph = Arc::new(JobGraph::try_new_with(plan, &options).unwrap());
        let [join] = graph.skew_joins() else {
            panic!("one candidate: {:?}", graph.skew_joins());
        };
        let join = join.clone();
        let inputs = &graph.stage(join.stage).unwrap().inputs;
        let (build, probe) = (
            inputs[join.build_input].stage,
            inputs[join.probe_input].stage,
        );
        let plans = graph
            .stages()
            .iter()
            .map(|stage| crate::definition::StagePlan::InMemory {
                plan: Arc::clone(&stage.plan),
                context: ctx.task_ctx(),
            })
            .collect();
        let shapes = crate::task::StageShape::of_graph(&graph).unwrap();
        let settings = std::collections::HashMap::from([(
            "sluice.skew_join_min_rows".to_string(),
            "0".to_string(),
        )]);
        let (output, _) = tokio::sync::mpsc::unbounded_channel();
        let entry = JobEntry::new(
            JobId(1),
            graph,
            (plans, shapes),
            Arc::new(settings),
            None,
            None,
            output,
        );
        (entry, join, build, probe)
    }

    /// Places `attempt` of (`stage`, `partition`) on worker `partition % 2 + 1`; with `rows`, it
    /// succeeds having written those rows per channel (16 bytes a row).
    pub(in crate::driver) fn run(
        entry: &mut JobEntry,
        stage: StageId,
        partition: usize,
        attempt: usize,
        rows: &[u64],
    ) {
        use super::super::placement::Location;
        let attempt = TaskAttempt {
            task: TaskId { stage, partition },
            attempt,
        };
        let worker = sluice_planner::WorkerId(partition as u64 % 2 + 1);
        entry.place(attempt, Location::Worker(worker));
        if !rows.is_empty() {
            let metrics = crate::analyze::TaskMetrics {
                channel_rows: rows.to_vec(),
                rows: rows.iter().sum(),
                shuffled_bytes: rows.iter().sum::<u64>() * 16,
                ..Default::default()
            };
            entry.metrics.insert(attempt, metrics);
            entry.task_succeeded(attempt);
        }
    }

    /// The probe and build streams `attempt` of join task `partition` reads, as (producer
    /// partition, producer attempt, channel).
    pub(in crate::driver) fn reads(
        entry: &JobEntry,
        join: &SkewJoin,
        partition: usize,
        attempt: usize,
    ) -> [Vec<(usize, usize, usize)>; 2] {
        let attempt = TaskAttempt {
            task: TaskId {
                stage: join.stage,
                partition,
            },
            attempt,
        };
        let definition = super::super::definitions::task_definition(
            sluice_planner::JobId(1),
            entry,
            attempt,
            &|location| Some(format!("{location:?}")),
        )
        .unwrap();
        [join.probe_input, join.build_input].map(|input| {
            let streams = &definition.inputs[input].partitions;
            assert_eq!(streams.len(), 1, "one input partition: its own");
            streams[0]
                .iter()
                .map(|l| {
                    let key = &l.stream.stream;
                    (key.partition, key.attempt, key.channel)
                })
                .collect()
        })
    }

    #[tokio::test]
    async fn a_split_is_decided_once_and_every_attempt_of_a_task_reads_the_same_streams() {
        let (mut entry, join, build, probe) = join_entry().await;
        assert!(needs_channel_rows(&entry.graph, build) && needs_channel_rows(&entry.graph, probe));
        assert!(!needs_channel_rows(&entry.graph, join.stage));
        for partition in 0..2 {
            run(&mut entry, build, partition, 0, &[10, 10, 10, 10]);
        }
        // The probe side is not complete: nothing to decide yet.
        assert_eq!(decide_ready(&mut entry, build), []);
        for partition in 0..4 {
            run(&mut entry, probe, partition, 0, &[5, 5, 1000, 5]);
        }
        let notes = decide_ready(&mut entry, probe);
        assert_eq!(
            notes,
            [StageNote {
                target: join.stage,
                text: format!(
                    "skew split: partition 2 (4000 probe rows, 20 build rows) over tasks \
                     2 (1000), 0 (1000), 1 (1000), 3 (1000), each reading its build rows too \
                     (over 4 times the median partition and 0 rows), for {}",
                    join.join
                ),
            }]
        );
        // Task 0 reads its own channel of every probe producer and producer 1's piece of
        // channel 2, and build channels 0 and 2.
        run(&mut entry, join.stage, 0, 0, &[]);
        let first = reads(&entry, &join, 0, 0);
        assert_eq!(
            first,
            [
                vec![(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (1, 0, 2)],
                vec![(0, 0, 0), (1, 0, 0), (0, 0, 2), (1, 0, 2)],
            ]
        );
        assert_eq!(reads(&entry, &join, 2, 0)[0], [(0, 0, 2)]);
        // Its retry reads the same streams.
        run(&mut entry, join.stage, 0, 1, &[]);
        assert_eq!(reads(&entry, &join, 0, 1), first);
        // Probe producer 1 runs again (its output was lost) and writes other counts: the split
        // stands, and the retried task reads the re-run's streams in the same places.
        entry.forget_success(TaskId {
            stage: probe,
            partition: 1,
        });
        run(&mut entry, probe, 1, 1, &[1000, 5, 5, 5]);
        assert_eq!(decide_ready(&mut entry, probe), []);
        run(&mut entry, join.stage, 0, 2, &[]);
        let rerun = reads(&entry, &join, 0, 2);
        assert_eq!(
            rerun[0],
            [(0, 0, 0), (1, 1, 0), (2, 0, 0), (3, 0, 0), (1, 1, 2)]
        );
        assert_eq!(rerun[1], first[1]);
        // Every task took a piece of channel 2 here.
        assert!(
            entry.skew_splits[&join.stage]
                .shares
                .iter()
                .all(Option::is_some)
        );

        // Switched off: no split, no note.
        let (mut off, _, build, probe) = join_entry().await;
        Arc::make_mut(&mut off.config).insert("sluice.skew_join_split".into(), "false".into());
        for partition in 0..2 {
            run(&mut off, build, partition, 0, &[10, 10, 10, 10]);
        }
        for partition in 0..4 {
            run(&mut off, probe, partition, 0, &[5, 5, 1000, 5]);
        }
        assert_eq!(decide_ready(&mut off, probe), []);
        assert!(off.skew_splits.is_empty());
        // A producer without row counts: no split, and the note says why.
        let (mut missing, join, build, probe) = join_entry().await;
        for partition in 0..2 {
            run(&mut missing, build, partition, 0, &[10, 10, 10, 10]);
        }
        for partition in 0..4 {
            run(&mut missing, probe, partition, 0, &[5, 5, 1000, 5]);
        }
        let task = TaskAttempt {
            task: TaskId {
                stage: probe,
                partition: 3,
            },
            attempt: 0,
        };
        missing.metrics.get_mut(&task).unwrap().channel_rows.clear();
        let notes = decide_ready(&mut missing, probe);
        assert_eq!(notes.len(), 1);
        assert_eq!(notes[0].target, join.stage);
        assert_eq!(
            notes[0].text,
            format!(
                "skew split: none, {} reported no rows per channel",
                task.task
            )
        );
        assert!(missing.skew_splits.is_empty());
    }

    #[test]
    fn a_share_replaces_the_task_s_own_channel_of_both_inputs() {
        let split = SkewSplit {
            build_input: 0,
            probe_input: 1,
            shares: vec![
                Some(TaskShare {
                    probe: vec![(0, 0), (1, 0), (1, 1)],
                    build_channels: vec![0, 1],
                }),
                None,
            ],
        };
        let own = |stage, channel| TaskInput {
            stage: StageId(stage),
            mode: sluice_planner::InputMode::Shuffle,
            keys: vec![
                (0..2)
                    .map(|q| InputKey {
                        partition: q,
                        channel,
                        replica: 0,
                    })
                    .collect(),
            ],
            first: channel,
        };
        let mut inputs = vec![own(0, 0), own(1, 0)];
        reassign(&mut inputs, &split, 0, 3).unwrap();
        let pairs = |input: &TaskInput| -> Vec<(usize, usize)> {
            input.keys[0]
                .iter()
                .map(|k| (k.partition, k.channel))
                .collect()
        };
        assert_eq!(pairs(&inputs[1]), [(0, 0), (1, 0), (1, 1)]);
        assert_eq!(
            pairs(&inputs[0]),
            [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
        );
        // A task without a share reads as planned.
        let mut untouched = vec![own(0, 1), own(1, 1)];
        reassign(&mut untouched, &split, 1, 3).unwrap();
        assert_eq!(untouched, vec![own(0, 1), own(1, 1)]);
        // A share for a partition the task does not read is an error, not a silent skip.
        let mut wrong = vec![own(0, 1), own(1, 1)];
        let error = reassign(&mut wrong, &split, 0, 3).unwrap_err();
        assert!(
            error.to_string().contains("does not read partition 0"),
            "{error}"
        );
    }
}
