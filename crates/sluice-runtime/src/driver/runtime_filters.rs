//! The driver's side of runtime filters (`sluice_planner::job_graph::runtime_filters`): when a
//! filter's source stage finished, the key summaries its tasks reported become a predicate that is
//! put into the target stage's plan, pushed down towards its scans, and shipped to the target's
//! tasks in place of the plan accepted with the job. Pure code over the job's entry.
//!
//! ```text
//!   source stage complete ─► every filter of a target whose sources are all complete:
//!       KeySummary::merge(the succeeded attempts' summaries) ─► predicate over the probe keys
//!       ─► FilterExec on top of the node at the filter's path, pushed down within that subtree
//!          (FilterPushdown) ─► entry.plans[target] (encoded once; unencoded in entry.rewritten)
//! ```
//!
//! A filter delivered while its target runs (pipelined exchanges) leaves the plan as it is: the
//! target's tasks put an empty filter in place as they start (`worker::live_filters`), and once
//! the source finished its merged summary goes to the workers running them
//! ([`RuntimeFilterUpdate`]) and into the definition of every later attempt of the target.
//!
//! Invariants: a target's plan is filtered at most once per job, and a live filter sent at most
//! once (a source run again after a lost worker changes nothing: a retried target task runs the
//! plan, or gets the summary, its job chose); a target of a filter delivered before it starts
//! starts only after its sources finished (the topology makes it wait), so every one of its tasks
//! runs the filtered plan; a live filter drops only what its target's tasks read after it arrived,
//! which changes the work, never the answer; anything missing (a source task without a summary) or
//! failing leaves the plan as it was, which is always a correct answer, and says why; a source
//! task that runs again after its filter was applied or sent (lineage) must see only keys that
//! filter kept, or its job fails; a live filter whose source and target both run again (a retried
//! pipelined region) is withdrawn instead, so the target's new attempts read every row; the filter
//! is not pushed down into a subtree holding a limit.

use std::collections::BTreeSet;
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::job_graph::runtime_filters::node_at;
use sluice_planner::{
    FilterDelivery, JobId, RegionId, RuntimeFilter, StageId, TaskAttempt, TaskId,
};

use super::StageNote;
use super::job::JobEntry;
use crate::definition::RuntimeFilterUpdate;
use crate::options::{SluiceOptions, sluice_options_of};
use crate::runtime_filter::{KeySummary, filter_at};

/// The longest predicate text a note shows.
const NOTE_PREDICATE_CHARS: usize = 240;

/// What the filters whose source finished made: notes, and the summaries to send to the running
/// tasks of the targets of filters delivered while they run, each with its note (to which the
/// sender adds where it went).
#[derive(Debug, Default)]
pub(super) struct Applied {
    pub notes: Vec<StageNote>,
    pub updates: Vec<(RuntimeFilterUpdate, StageNote)>,
}

/// Applies every filter whose sources are all complete now that `finished` is; see the module
/// docs.
pub(super) fn apply_ready(entry: &mut JobEntry, job: JobId, finished: StageId) -> Applied {
    let mut applied = Applied {
        notes: filter_waiting_targets(entry, finished),
        updates: Vec::new(),
    };
    let graph = Arc::clone(&entry.graph);
    for (index, filter) in graph.runtime_filters().iter().enumerate() {
        if filter.source != finished
            || filter.delivery != FilterDelivery::WhileRunning
            || entry.live_filters.contains_key(&index)
            || entry.withdrawn_filters.contains(&index)
        {
            continue;
        }
        let sent = match live_summary(entry, filter) {
            Ok((Some((summary, bytes)), note)) => {
                applied.updates.push((
                    RuntimeFilterUpdate {
                        job,
                        stage: filter.target,
                        filter: index,
                        summary: bytes.clone(),
                    },
                    note,
                ));
                Some((summary, bytes))
            }
            Ok((None, note)) => {
                applied.updates.push((release(job, filter, index), note));
                None
            }
            Err(e) => {
                let note = StageNote {
                    target: filter.target,
                    text: format!(
                        "runtime filter: none from stage {}, the filter could not be built ({e}), \
                         for {}",
                        filter.source, filter.join
                    ),
                };
                applied.updates.push((release(job, filter, index), note));
                None
            }
        };
        if let Some((summary, _)) = &sent {
            entry
                .applied_summaries
                .insert(filter.source, summary.clone());
        }
        entry
            .live_filters
            .insert(index, sent.map(|(_, bytes)| bytes));
    }
    applied
}

/// The update telling `filter`'s running target tasks (filter `index`) that none could be built:
/// those waiting for it go on, keeping every row.
fn release(job: JobId, filter: &RuntimeFilter, index: usize) -> RuntimeFilterUpdate {
    RuntimeFilterUpdate {
        job,
        stage: filter.target,
        filter: index,
        summary: bytes::Bytes::new(),
    }
}

/// The merged summary of `filter`'s source and its encoding, checked by building the predicate
/// for its target (which the note shows); `None` if a source task reported none.
fn live_summary(
    entry: &JobEntry,
    filter: &RuntimeFilter,
) -> Result<(Option<(KeySummary, bytes::Bytes)>, StageNote)> {
    let Some(summary) = filter_summary(entry, filter)? else {
        let note = StageNote {
            target: filter.target,
            text: format!(
                "runtime filter: none from stage {} (a task of it reported no key summary), for {}",
                filter.source, filter.join
            ),
        };
        return Ok((None, note));
    };
    let stage = entry
        .graph
        .stage(filter.target)
        .ok_or_else(|| DataFusionError::Internal(format!("no stage {}", filter.target)))?;
    let node = node_at(&stage.plan, &filter.target_path)?;
    let predicate = summary.predicate(&node.schema(), &filter.target_columns)?;
    let bytes = bytes::Bytes::from(summary.encode()?);
    let note = StageNote {
        target: filter.target,
        text: format!(
            "runtime filter: {} (from stage {}, for {})",
            shortened(&predicate.to_string()),
            filter.source,
            filter.join
        ),
    };
    Ok((Some((summary, bytes)), note))
}

/// Filters every target waiting only for `finished` (now complete) before it starts.
fn filter_waiting_targets(entry: &mut JobEntry, finished: StageId) -> Vec<StageNote> {
    let graph = Arc::clone(&entry.graph);
    let targets: BTreeSet<StageId> = graph
        .runtime_filters()
        .iter()
        .filter(|f| f.source == finished && f.delivery == FilterDelivery::BeforeStart)
        .map(|f| f.target)
        .collect();
    let mut notes = Vec::new();
    for target in targets {
        if entry.filtered_stages.contains(&target) {
            continue;
        }
        let filters: Vec<&RuntimeFilter> = graph
            .runtime_filters()
            .iter()
            .filter(|f| f.target == target && f.delivery == FilterDelivery::BeforeStart)
            .collect();
        if !filters.iter().all(|f| entry.stage_complete(f.source)) {
            continue;
        }
        entry.filtered_stages.insert(target);
        match filter_stage(entry, target, &filters) {
            Ok(filtered) => {
                notes.extend(filtered.notes);
                if let Some(plan) = filtered.plan {
                    match entry.rewrite_stage(target, plan) {
                        Ok(()) => entry.applied_summaries.extend(filtered.applied),
                        Err(e) => notes.push(StageNote {
                            target,
                            text: format!(
                                "runtime filter: none, the filtered plan could not be encoded ({e})"
                            ),
                        }),
                    }
                }
            }
            Err(e) => notes.push(StageNote {
                target,
                text: format!("runtime filter: none, the filter could not be applied ({e})"),
            }),
        }
    }
    notes
}

/// Withdraws every live filter sent (or settled) whose source and target both run again in the
/// retried `region`
/// (a pipelined region is its whole job): the target's new attempts read every row, so the
/// source's new run may see other keys than the first (upstream filters arrive at other times) and
/// is not checked against the summary sent from the first. A filter whose target does not run
/// again keeps its check. Returns the notes saying so.
pub(super) fn withdraw_for_retry(entry: &mut JobEntry, region: RegionId) -> Vec<StageNote> {
    let Some(tasks) = entry.graph.topology().regions().get(region.0) else {
        return Vec::new();
    };
    let stages: BTreeSet<StageId> = tasks.tasks.iter().map(|t| t.stage).collect();
    let graph = Arc::clone(&entry.graph);
    let mut notes = Vec::new();
    for (index, filter) in graph.runtime_filters().iter().enumerate() {
        // One not sent yet carries no summary of the first run: it is sent from the new one.
        if filter.delivery != FilterDelivery::WhileRunning
            || !entry.live_filters.contains_key(&index)
            || !stages.contains(&filter.source)
            || !stages.contains(&filter.target)
            || !entry.withdrawn_filters.insert(index)
        {
            continue;
        }
        notes.push(StageNote {
            target: filter.target,
            text: format!(
                "runtime filter from stage {} withdrawn: its region ran again, and the retried \
                 tasks read every row (for {})",
                filter.source, filter.join
            ),
        });
    }
    // A source none of whose filters is still in force is no longer checked.
    let (mut withdrawn, mut kept) = (BTreeSet::new(), BTreeSet::new());
    for (index, filter) in graph.runtime_filters().iter().enumerate() {
        if entry.withdrawn_filters.contains(&index) {
            withdrawn.insert(filter.source);
        } else {
            kept.insert(filter.source);
        }
    }
    for source in withdrawn.difference(&kept) {
        entry.applied_summaries.remove(source);
    }
    notes
}

/// Why the job must fail: `attempt` of a filter's source stage succeeded after the filter was
/// applied (a re-run after its output was lost) and saw keys the filter drops, so the rows its
/// target kept may lack some this run's build side matches (a build side whose rows change from
/// run to run). `None` when there is nothing to fear.
pub(super) fn rerun_escapes_filter(entry: &JobEntry, attempt: TaskAttempt) -> Option<String> {
    let applied = entry.applied_summaries.get(&attempt.task.stage)?;
    let summary = entry
        .metrics
        .get(&attempt)
        .map(|m| m.key_summary.as_slice())
        .filter(|bytes| !bytes.is_empty())
        .and_then(|bytes| KeySummary::decode(bytes).ok());
    match summary {
        Some(summary) if summary.covered_by(applied) => None,
        _ => Some(format!(
            "{} ran again after its stage's keys filtered another stage, and saw keys that \
             filter dropped (a build side whose rows differ from run to run); the job fails \
             rather than risk a wrong answer",
            attempt.task
        )),
    }
}

/// What filtering one target stage made.
struct FilteredStage {
    /// The plan its tasks run, `None` if no filter could be built.
    plan: Option<Arc<dyn ExecutionPlan>>,
    /// Per source stage, the summary its filter was built from.
    applied: Vec<(StageId, KeySummary)>,
    notes: Vec<StageNote>,
}

/// `target`'s plan with `filters` applied.
fn filter_stage(
    entry: &JobEntry,
    target: StageId,
    filters: &[&RuntimeFilter],
) -> Result<FilteredStage> {
    let stage = entry
        .graph
        .stage(target)
        .ok_or_else(|| DataFusionError::Internal(format!("no stage {target}")))?;
    let mut notes = Vec::new();
    let mut built = Vec::new();
    let mut applied = Vec::new();
    for filter in filters {
        let Some(summary) = filter_summary(entry, filter)? else {
            notes.push(StageNote {
                target,
                text: format!(
                    "runtime filter: none from stage {} (a task of it reported no key summary), \
                     for {}",
                    filter.source, filter.join
                ),
            });
            continue;
        };
        let node = node_at(&stage.plan, &filter.target_path)?;
        let predicate = summary.predicate(&node.schema(), &filter.target_columns)?;
        notes.push(StageNote {
            target,
            text: format!(
                "runtime filter: {} (from stage {}, for {})",
                shortened(&predicate.to_string()),
                filter.source,
                filter.join
            ),
        });
        built.push((filter.target_path.clone(), predicate));
        applied.push((filter.source, summary));
    }
    if built.is_empty() {
        return Ok(FilteredStage {
            plan: None,
            applied,
            notes,
        });
    }
    // Deepest first: a filter put on top of a node does not move the nodes below it.
    built.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    let config = crate::definition::session_config_of(&entry.config)?;
    // The plan as the job runs it now: a broadcast switch may have put its probe side's plan in
    // place of a `StageInputExec`. The nodes above keep their paths, so a path still leads to the
    // node it was computed for (or to the root of that probe plan, which then gets the filter).
    let mut plan = entry
        .stage_plan(target)
        .unwrap_or_else(|| Arc::clone(&stage.plan));
    for (path, predicate) in built {
        plan = filter_at(plan, &path, &predicate, config.options())?;
    }
    Ok(FilteredStage {
        plan: Some(plan),
        applied,
        notes,
    })
}

/// The summary `filter` is built from: its source's merged summary, without the Bloom filter when
/// the job's `sluice.runtime_filter_bloom` is off, or when the filter goes into the join's own
/// stage (there the join's hash table checks the same rows as cheaply; bounds still prune the
/// scan's row groups).
fn filter_summary(entry: &JobEntry, filter: &RuntimeFilter) -> Result<Option<KeySummary>> {
    let Some(mut summary) = merged_summary(entry, filter.source)? else {
        return Ok(None);
    };
    if !checks_bloom(filter, &sluice_options_of(&entry.config)?) {
        summary.bloom = None;
    }
    Ok(Some(summary))
}

/// Whether `filter`'s predicate may check its source's Bloom filter; see [`filter_summary`].
fn checks_bloom(filter: &RuntimeFilter, options: &SluiceOptions) -> bool {
    options.runtime_filter_bloom && filter.target != filter.join_stage
}

/// The summary of every task of `source` (their succeeded attempts'), `None` if one has none.
fn merged_summary(entry: &JobEntry, source: StageId) -> Result<Option<KeySummary>> {
    let partitions = entry.graph.stage(source).map_or(0, |s| s.partitions());
    let mut summaries = Vec::with_capacity(partitions);
    for partition in 0..partitions {
        let task = TaskId {
            stage: source,
            partition,
        };
        let bytes = entry
            .metrics_of_success(task)
            .map(|m| m.key_summary.as_slice())
            .unwrap_or_default();
        if bytes.is_empty() {
            return Ok(None);
        }
        summaries.push(KeySummary::decode(bytes)?);
    }
    if summaries.is_empty() {
        return Ok(None);
    }
    KeySummary::merge(&summaries).map(Some)
}

fn shortened(text: &str) -> String {
    match text.char_indices().nth(NOTE_PREDICATE_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_filter_of_another_stage_than_its_joins_checks_a_bloom_filter() {
        let filter = |target: usize| RuntimeFilter {
            source: StageId(0),
            source_columns: vec![0],
            target: StageId(target),
            target_path: Vec::new(),
            target_columns: vec![0],
            join: "HashJoinExec Inner on (a@0 = b@0) in stage 2".to_string(),
            join_stage: StageId(2),
            delivery: FilterDelivery::BeforeStart,
        };
        let on = SluiceOptions::default();
        let off = SluiceOptions {
            runtime_filter_bloom: false,
            ..SluiceOptions::default()
        };
        // Target 1 produces the join's probe side; target 2 is the join's own stage.
        assert_eq!(
            [
                checks_bloom(&filter(1), &on),
                checks_bloom(&filter(2), &on),
                checks_bloom(&filter(1), &off),
                checks_bloom(&filter(2), &off),
            ],
            [true, false, false, false]
        );
    }
}
