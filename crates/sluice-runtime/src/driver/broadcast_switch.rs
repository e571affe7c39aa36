//! The driver's broadcast switch: a partitioned hash join (`sluice_planner::SkewJoin`, blocking
//! exchanges) whose build side finished small before its probe side's producer started becomes a
//! broadcast join. Every task of the join reads the whole build side and runs the probe
//! producer's plan itself, so the probe rows are never written, shuffled or read back; the probe
//! producer's tasks run an empty plan. Pure code over the job's entry.
//!
//! ```text
//!   planned                                       switched (build side B finished under the limit,
//!                                                 no task of P placed yet)
//!   B ─Shuffle─┐                                  B ─all channels of every task─┐
//!              ▼                                                                ▼
//!   J: HashJoinExec(Partitioned), task i:          J: HashJoinExec(Partitioned), task i:
//!      build channel i ⋈ probe channel i              all build rows ⋈ partition i of P's plan
//!              ▲                                                     (its scan, its filters)
//!   P: scan ─Shuffle─┘ (writes every probe row)    P: EmptyExec (writes nothing)
//! ```
//!
//! Why it is right: the join's type decides each probe row's output from that row and the whole
//! build side alone (inner, right, right semi, right anti: the candidates' invariant), and task `i`
//! holds every build row, so each probe row, read by exactly one task (the one running its
//! partition of P's plan), meets every build row it could match. Nothing above the join in its
//! stage needs its rows hash-partitioned, and the stage's reader repartitions or merges them.
//!
//! Cost: every task but one builds the build side again, which costs [`BUILD_ROW_COST`] probe rows
//! a build row; a probe side whose plan is estimated (DataFusion's statistics, its filters
//! included) at fewer rows than those extra builds is left shuffled. Without an estimate the
//! switch is made (the build side is small).
//!
//! When: the probe producer waits for the build side when a runtime filter of this join aims at
//! it (inner and right semi joins on orderable keys); otherwise the switch is made only if the
//! probe producer had not been placed yet when the build side finished (it was waiting for slots),
//! which depends on timing.
//!
//! Invariants: decided once per join stage, when its build side is complete and every runtime
//! filter aimed at its probe producer was applied (its scan keeps them); a switch is made only
//! before any task of the probe producer is placed (so before any task of the join: it waits for
//! both inputs), and every attempt of every task of those stages runs what was decided; the probe
//! producer has no inputs of its own, is read by the join's stage only, is no runtime filter's
//! source, runs where the join runs (both on workers, or both on the driver) and has as many
//! partitions as the join reads, so partition `i` of its plan is what task `i` of the join read
//! before; both rewritten plans are encoded before either is installed; anything else leaves the
//! join as planned and, when the build side was small enough, says why.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::{StatisticsArgs, StatisticsContext};
use sluice_planner::{InputKey, JobGraph, SkewJoin, StageId, StageInputExec, TaskId};

use super::StageNote;
use super::job::JobEntry;
use super::skew_splits::{BUILD_ROW_COST, producers};
use crate::options::sluice_options_of;
use crate::task::TaskInput;

/// A join stage switched to a broadcast join: what its tasks read in place of their own channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BroadcastSwitch {
    /// The join's build input (index into the stage's inputs): every task reads all of it.
    pub build_input: usize,
    /// Its probe input: no task reads it (the join's plan runs the producer's plan instead).
    pub probe_input: usize,
}

/// How every note of a join left partitioned although its build side was small begins (the log
/// tells these apart from switches by it).
pub(super) const NO_SWITCH: &str = "broadcast switch: none";

/// Decides the switch of every candidate join not decided yet whose build side is complete and
/// whose probe producer's runtime filters were applied; called whenever a stage completes (after
/// the filters it completes were applied). See the module docs.
pub(super) fn decide_ready(entry: &mut JobEntry) -> Vec<StageNote> {
    let graph = Arc::clone(&entry.graph);
    let mut notes = Vec::new();
    for join in graph.skew_joins() {
        if entry.switch_decided.contains(&join.stage) {
            continue;
        }
        let Some((build, probe)) = producers(&graph, join) else {
            continue;
        };
        if !entry.stage_complete(build) {
            continue;
        }
        // A runtime filter still to come for the probe producer goes into its plan first; the
        // join is decided once it came (the producer waits for it too).
        let filters_pending = !entry.filtered_stages.contains(&probe)
            && graph.runtime_filters().iter().any(|f| {
                f.target == probe && f.delivery == sluice_planner::FilterDelivery::BeforeStart
            });
        if filters_pending {
            continue;
        }
        entry.switch_decided.insert(join.stage);
        match decide(entry, &graph, join, build, probe) {
            Ok(Some(note)) => {
                entry.skew_decided.insert(join.stage);
                entry.broadcast_switches.insert(
                    join.stage,
                    BroadcastSwitch {
                        build_input: join.build_input,
                        probe_input: join.probe_input,
                    },
                );
                notes.push(note);
            }
            Ok(None) => {}
            Err(why) => notes.push(StageNote {
                target: join.stage,
                text: format!("{NO_SWITCH}, {why}"),
            }),
        }
    }
    notes
}

/// Switches `join` if its build side is small enough: the note saying so, `None` when it is not
/// small (or the switch is off), or why a small build side could not be broadcast.
fn decide(
    entry: &mut JobEntry,
    graph: &JobGraph,
    join: &SkewJoin,
    build: StageId,
    probe: StageId,
) -> Result<Option<StageNote>, String> {
    let options = sluice_options_of(&entry.config).map_err(|e| e.strip_backtrace())?;
    if !options.broadcast_join_switch {
        return Ok(None);
    }
    let (mut bytes, mut rows) = (0u64, 0u64);
    let build_partitions = graph
        .stage(build)
        .map(|s| s.partitions())
        .ok_or_else(|| format!("there is no stage {build}"))?;
    for partition in 0..build_partitions {
        let task = TaskId {
            stage: build,
            partition,
        };
        let metrics = entry
            .metrics_of_success(task)
            .ok_or_else(|| format!("{task} reported nothing"))?;
        bytes = bytes.saturating_add(metrics.shuffled_bytes);
        rows = rows.saturating_add(metrics.rows);
    }
    if bytes > options.broadcast_join_switch_bytes {
        return Ok(None);
    }
    let small = format!(
        "stage {build} finished with {rows} rows ({bytes} bytes, at most {} may be broadcast)",
        options.broadcast_join_switch_bytes
    );
    let producer = graph
        .stage(probe)
        .ok_or_else(|| format!("there is no stage {probe}"))?;
    let started = (0..producer.partitions()).any(|partition| {
        entry.latest.contains_key(&TaskId {
            stage: probe,
            partition,
        })
    });
    let why_not = if started {
        Some(format!("stage {probe} (the probe side) had started"))
    } else if !producer.inputs.is_empty() {
        Some(format!("stage {probe} (the probe side) reads other stages"))
    } else if graph
        .stages()
        .iter()
        .enumerate()
        .any(|(id, s)| id != join.stage.0 && s.inputs.iter().any(|i| i.stage == probe))
    {
        Some(format!("stage {probe} (the probe side) has other readers"))
    } else if graph.runtime_filters().iter().any(|f| f.source == probe) {
        Some(format!(
            "stage {probe} (the probe side) is a runtime filter's source"
        ))
    } else if entry.runs_on_driver(probe) != entry.runs_on_driver(join.stage) {
        // A driver stage's plan may not survive the wire; a join on the driver would scan the
        // probe side there.
        Some(format!(
            "stage {probe} (the probe side) and stage {} run in different places (the driver, \
             workers)",
            join.stage
        ))
    } else {
        None
    };
    if let Some(why) = why_not {
        return Err(format!("{small} but {why}, for {}", join.join));
    }
    let join_plan = entry
        .stage_plan(join.stage)
        .ok_or_else(|| format!("there is no stage {}", join.stage))?;
    let probe_plan = entry
        .stage_plan(probe)
        .ok_or_else(|| format!("there is no stage {probe}"))?;
    // Every task but one builds the build side again; the switch saves shuffling the probe rows.
    // A probe side estimated smaller than those extra builds stays shuffled.
    let tasks = graph.stage(join.stage).map_or(1, |s| s.partitions()) as u64;
    let extra_build = rows
        .saturating_mul(tasks.saturating_sub(1))
        .saturating_mul(BUILD_ROW_COST);
    let estimated_probe = StatisticsContext::new()
        .compute(probe_plan.as_ref(), &StatisticsArgs::new())
        .ok()
        .and_then(|s| s.num_rows.get_value().copied())
        .map(|n| n as u64);
    if let Some(estimate) = estimated_probe
        && estimate < extra_build
    {
        return Err(format!(
            "{small} but stage {probe}'s plan is estimated at {estimate} rows, fewer than \
             building the build side again in {} more tasks costs ({extra_build} rows' worth), \
             for {}",
            tasks.saturating_sub(1),
            join.join
        ));
    }
    let switched = with_probe_plan(join_plan, join.probe_input, &probe_plan)
        .map_err(|e| format!("{small} but {}, for {}", e.strip_backtrace(), join.join))?;
    let empty: Arc<dyn ExecutionPlan> =
        Arc::new(EmptyExec::new(probe_plan.schema()).with_partitions(producer.partitions()));
    // Both plans are encoded before either is installed: a join that scans the probe side must
    // read the whole build side, and an emptied probe side must not be read by the join as planned.
    let shipped = entry
        .shipped_form(join.stage, &switched)
        .and_then(|join_shipped| Ok((join_shipped, entry.shipped_form(probe, &empty)?)))
        .map_err(|e| format!("{small} but {}, for {}", e.strip_backtrace(), join.join))?;
    entry.install(join.stage, switched, shipped.0);
    entry.install(probe, empty, shipped.1);
    // Nothing may filter the emptied producer's plan again.
    entry.filtered_stages.insert(probe);
    Ok(Some(StageNote {
        target: join.stage,
        text: format!(
            "broadcast switch: {small}; every task reads all of it and runs stage {probe}'s plan \
             in place of reading its shuffled rows, for {}",
            join.join
        ),
    }))
}

/// `join_plan` with its placeholder of input `probe_input` replaced by `probe_plan`, which must
/// have as many partitions as the placeholder.
fn with_probe_plan(
    join_plan: Arc<dyn ExecutionPlan>,
    probe_input: usize,
    probe_plan: &Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut replaced = 0;
    let plan = join_plan
        .transform_up(|node| {
            let Some(placeholder) = node.downcast_ref::<StageInputExec<usize>>() else {
                return Ok(Transformed::no(node));
            };
            if *placeholder.input() != probe_input {
                return Ok(Transformed::no(node));
            }
            let wanted = placeholder.properties().partitioning.partition_count();
            let has = probe_plan.properties().partitioning.partition_count();
            if wanted != has {
                return Err(DataFusionError::Plan(format!(
                    "the probe side's plan has {has} partitions where the join reads {wanted}"
                )));
            }
            replaced += 1;
            Ok(Transformed::yes(Arc::clone(probe_plan)))
        })?
        .data;
    if replaced != 1 {
        return Err(DataFusionError::Internal(format!(
            "the join's plan holds {replaced} placeholders of input {probe_input}"
        )));
    }
    Ok(plan)
}

/// `inputs` (task `partition`'s of a switched stage): every stream of the build producer (its
/// `build_partitions` tasks' `build_channels` channels) in place of its own build channel, and no
/// probe stream.
pub(super) fn reassign(
    inputs: &mut [TaskInput],
    switch: &BroadcastSwitch,
    partition: usize,
    (build_partitions, build_channels): (usize, usize),
) -> Result<()> {
    let all: Vec<InputKey> = (0..build_channels)
        .flat_map(|channel| {
            (0..build_partitions).map(move |producer| InputKey {
                partition: producer,
                channel,
                replica: 0,
            })
        })
        .collect();
    for (index, keys) in [(switch.build_input, all), (switch.probe_input, Vec::new())] {
        let input = inputs.get_mut(index).ok_or_else(|| {
            DataFusionError::Internal(format!("a broadcast switch names missing input {index}"))
        })?;
        let slot = partition
            .checked_sub(input.first)
            .and_then(|k| input.keys.get_mut(k))
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "a switched join's task {partition} does not read partition {partition} of \
                     input {index}"
                ))
            })?;
        *slot = keys;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::super::skew_splits::tests::{join_entry, reads, run};
    use super::*;
    use datafusion::physical_plan::displayable;

    /// The plan `entry` runs for `stage`, one line per node.
    fn shown(entry: &JobEntry, stage: StageId) -> String {
        displayable(entry.stage_plan(stage).unwrap().as_ref())
            .indent(false)
            .to_string()
    }

    #[tokio::test]
    async fn a_small_build_side_switches_the_join_once_and_every_attempt_reads_all_of_it() {
        let (mut entry, join, build, probe) = join_entry().await;
        assert!(shown(&entry, join.stage).contains("StageInputExec"));
        // The build side is not complete: nothing to decide. (Its one row, built again by three
        // more tasks, costs fewer rows than the probe side's 8.)
        run(&mut entry, build, 0, 0, &[0, 1, 0, 0]);
        assert_eq!(decide_ready(&mut entry), []);
        run(&mut entry, build, 1, 0, &[0, 0, 0, 0]);
        entry.filtered_stages.insert(probe);
        let notes = decide_ready(&mut entry);
        assert_eq!(
            notes,
            [StageNote {
                target: join.stage,
                text: format!(
                    "broadcast switch: stage {build} finished with 1 rows (16 bytes, at most \
                     10485760 may be broadcast); every task reads all of it and runs stage \
                     {probe}'s plan in place of reading its shuffled rows, for {}",
                    join.join
                ),
            }]
        );
        // The join's plan runs the probe side's scan; the probe producer runs nothing.
        let join_plan = shown(&entry, join.stage);
        assert_eq!(
            join_plan.matches("StageInputExec").count(),
            1,
            "{join_plan}"
        );
        assert!(join_plan.contains("DataSourceExec"), "{join_plan}");
        let producer_plan = entry.stage_plan(probe).unwrap();
        assert!(
            shown(&entry, probe).starts_with("EmptyExec"),
            "{}",
            shown(&entry, probe)
        );
        assert_eq!(producer_plan.properties().partitioning.partition_count(), 4);
        // Decided once: no skew split, no second note.
        assert!(entry.skew_decided.contains(&join.stage));
        for partition in 0..4 {
            run(&mut entry, probe, partition, 0, &[0, 0, 0, 0]);
        }
        assert_eq!(decide_ready(&mut entry), []);

        // Task 1 reads every stream of the build side and no probe stream; so does its retry.
        let all_of_build = |attempt_of_1: usize| -> Vec<(usize, usize, usize)> {
            (0..4)
                .flat_map(move |c| [(0, 0, c), (1, attempt_of_1, c)])
                .collect()
        };
        run(&mut entry, join.stage, 1, 0, &[]);
        let first = reads(&entry, &join, 1, 0);
        assert_eq!(first, [Vec::new(), all_of_build(0)]);
        run(&mut entry, join.stage, 1, 1, &[]);
        assert_eq!(reads(&entry, &join, 1, 1), first);
        // Build producer 1 runs again (its output was lost) and writes more rows: the switch
        // stands, and the next attempt reads the re-run's streams.
        entry.forget_success(TaskId {
            stage: build,
            partition: 1,
        });
        run(&mut entry, build, 1, 1, &[1, 0, 1, 0]);
        assert_eq!(decide_ready(&mut entry), []);
        run(&mut entry, join.stage, 1, 2, &[]);
        assert_eq!(reads(&entry, &join, 1, 2), [Vec::new(), all_of_build(1)]);
    }

    #[tokio::test]
    async fn a_large_build_side_a_started_probe_side_or_the_switch_off_keep_the_join() {
        let build_done = |entry: &mut JobEntry, build: StageId| {
            run(entry, build, 0, 0, &[100, 100, 100, 100]);
            run(entry, build, 1, 0, &[100, 100, 100, 100]);
        };
        // 800 rows of 16 bytes are over a limit of 12,799 bytes.
        let (mut large, join, build, probe) = join_entry().await;
        Arc::make_mut(&mut large.config)
            .insert("sluice.broadcast_join_switch_bytes".into(), "12799".into());
        large.filtered_stages.insert(probe);
        build_done(&mut large, build);
        assert_eq!(decide_ready(&mut large), []);
        assert!(large.broadcast_switches.is_empty() && large.switch_decided.contains(&join.stage));
        assert!(shown(&large, probe).contains("DataSourceExec"));

        // Switched off.
        let (mut off, join, build, probe) = join_entry().await;
        Arc::make_mut(&mut off.config)
            .insert("sluice.broadcast_join_switch".into(), "false".into());
        off.filtered_stages.insert(probe);
        build_done(&mut off, build);
        assert_eq!(decide_ready(&mut off), []);
        assert!(off.broadcast_switches.is_empty() && off.switch_decided.contains(&join.stage));

        // A probe task was placed before the build side finished: the note says why not.
        let (mut started, join, build, probe) = join_entry().await;
        started.filtered_stages.insert(probe);
        run(&mut started, probe, 2, 0, &[]);
        build_done(&mut started, build);
        assert_eq!(
            decide_ready(&mut started),
            [StageNote {
                target: join.stage,
                text: format!(
                    "broadcast switch: none, stage {build} finished with 800 rows (12800 bytes, at \
                     most 10485760 may be broadcast) but stage {probe} (the probe side) had \
                     started, for {}",
                    join.join
                ),
            }]
        );
        assert!(started.broadcast_switches.is_empty());
        assert!(!started.skew_decided.contains(&join.stage));

        // The probe side runs on the driver and the join on workers: the note says why not.
        let (mut apart, join, build, probe) = join_entry().await;
        apart.filtered_stages.insert(probe);
        apart.plans[join.stage.0] = crate::definition::StagePlan::Encoded(bytes::Bytes::new());
        build_done(&mut apart, build);
        let notes = decide_ready(&mut apart);
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].text.ends_with(&format!(
                "but stage {probe} (the probe side) and stage {} run in different places (the \
                 driver, workers), for {}",
                join.stage, join.join
            )),
            "{}",
            notes[0].text
        );
        assert!(apart.broadcast_switches.is_empty());

        // A probe side estimated at fewer rows than the extra builds cost stays shuffled.
        let (mut cheap, join, build, probe) = join_entry().await;
        cheap.filtered_stages.insert(probe);
        build_done(&mut cheap, build);
        assert_eq!(
            decide_ready(&mut cheap),
            [StageNote {
                target: join.stage,
                text: format!(
                    "broadcast switch: none, stage {build} finished with 800 rows (12800 bytes, at \
                     most 10485760 may be broadcast) but stage {probe}'s plan is estimated at 8 \
                     rows, fewer than building the build side again in 3 more tasks costs (4800 \
                     rows' worth), for {}",
                    join.join
                ),
            }]
        );
        assert!(cheap.broadcast_switches.is_empty());

        // The runtime filter aimed at the probe side, not applied yet, defers the decision.
        let (mut waiting, join, build, probe) = join_entry().await;
        assert!(
            waiting
                .graph
                .runtime_filters()
                .iter()
                .any(|f| f.target == probe),
            "{:?}",
            waiting.graph.runtime_filters()
        );
        run(&mut waiting, build, 0, 0, &[0, 0, 0, 1]);
        run(&mut waiting, build, 1, 0, &[0, 0, 0, 0]);
        assert_eq!(decide_ready(&mut waiting), []);
        assert!(!waiting.switch_decided.contains(&join.stage));
        waiting.filtered_stages.insert(probe);
        assert_eq!(decide_ready(&mut waiting).len(), 1);
        assert!(waiting.broadcast_switches.contains_key(&join.stage));
    }

    #[tokio::test]
    async fn a_probe_plan_of_other_partitions_than_the_join_reads_is_refused() {
        let (entry, join, _, probe) = join_entry().await;
        let join_plan = entry.stage_plan(join.stage).unwrap();
        let schema = entry.stage_plan(probe).unwrap().schema();
        let three: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema).with_partitions(3));
        let error = with_probe_plan(join_plan, join.probe_input, &three).unwrap_err();
        assert_eq!(
            error.strip_backtrace(),
            "Error during planning: the probe side's plan has 3 partitions where the join reads 4"
        );
        let error = with_probe_plan(three, join.probe_input, &entry.stage_plan(probe).unwrap())
            .unwrap_err();
        assert!(
            error.to_string().contains(&format!(
                "the join's plan holds 0 placeholders of input {}",
                join.probe_input
            )),
            "{error}"
        );
    }

    #[test]
    fn a_switched_task_reads_every_build_stream_and_no_probe_stream() {
        let switch = BroadcastSwitch {
            build_input: 0,
            probe_input: 1,
        };
        let own = |stage, channel| TaskInput {
            stage: StageId(stage),
            mode: sluice_planner::InputMode::Shuffle,
            keys: vec![vec![InputKey {
                partition: 0,
                channel,
                replica: 0,
            }]],
            first: channel,
        };
        let mut inputs = vec![own(0, 1), own(1, 1)];
        reassign(&mut inputs, &switch, 1, (2, 3)).unwrap();
        let pairs: Vec<(usize, usize)> = inputs[0].keys[0]
            .iter()
            .map(|k| (k.partition, k.channel))
            .collect();
        assert_eq!(pairs, [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]);
        assert_eq!(inputs[1].keys, [Vec::<InputKey>::new()]);
        let error = reassign(&mut inputs, &switch, 0, (2, 3)).unwrap_err();
        assert!(
            error.to_string().contains("does not read partition 0"),
            "{error}"
        );
    }
}
