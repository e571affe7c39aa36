//! EXPLAIN DISTRIBUTED: a job graph and its topology as text or JSON.
//!
//! Text starts, for a job run whole as one task, with a line saying so ("Single task: the scans read
//! N bytes, …"); then shows each stage (id, placement, partitions, output distribution and mode,
//! inputs) followed by the runtime filters its plan gets, the skew split the driver may make of it,
//! and its indented physical plan, then the task regions with their dependencies. JSON has the
//! shape `{"single_task":text|null,"stages":[{"id","partitions","placement","mode",
//! "distribution":{"kind","channels","keys"},"inputs":[{"stage","mode"}],"runtime_filters":[text],
//! "skew_split":text|null,"plan"}],"regions":[{"id","tasks":[[stage,partition]],"depends_on"}]}`.

use std::fmt::Write;

use datafusion::physical_plan::displayable;
use serde_json::{Value, json};

use crate::ids::RegionId;
use crate::ids::StageId;
use crate::job_graph::runtime_filters::node_at;
use crate::job_graph::{FilterDelivery, JobGraph, RuntimeFilter, Stage};
use crate::topology::TaskRegion;

fn plan_text(stage: &Stage) -> String {
    displayable(stage.plan.as_ref()).indent(false).to_string()
}

fn distribution_text(stage: &Stage) -> String {
    let d = &stage.distribution;
    let keys = d.key_names();
    if keys.is_empty() {
        format!("{}({})", d.kind(), d.channels())
    } else {
        format!("{}([{}], {})", d.kind(), keys.join(", "), d.channels())
    }
}

/// One line per runtime filter `stage`'s plan gets.
fn runtime_filter_lines(graph: &JobGraph, stage: StageId) -> Vec<String> {
    graph
        .runtime_filters()
        .iter()
        .filter(|f| f.target == stage)
        .map(|f| runtime_filter_text(graph, f))
        .collect()
}

fn runtime_filter_text(graph: &JobGraph, filter: &RuntimeFilter) -> String {
    let columns = |stage: StageId, path: &[usize], indices: &[usize]| {
        let schema = graph
            .stage(stage)
            .and_then(|s| node_at(&s.plan, path).ok())
            .map(|node| node.schema());
        indices
            .iter()
            .map(|i| match schema.as_ref().and_then(|s| s.fields().get(*i)) {
                Some(field) => format!("{}@{i}", field.name()),
                None => format!("@{i}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let place = if filter.target_path.is_empty() {
        "on top of the plan".to_string()
    } else {
        let node = graph
            .stage(filter.target)
            .and_then(|s| node_at(&s.plan, &filter.target_path).ok());
        match node {
            Some(node) => format!("on top of its {}", node.name()),
            None => "on top of a node it no longer has".to_string(),
        }
    };
    let when = match filter.delivery {
        FilterDelivery::BeforeStart => "",
        FilterDelivery::WhileRunning => ", sent to its running tasks",
    };
    format!(
        "runtime filter: [{}] within stage {}'s [{}], {place}{when}, for {}",
        columns(filter.target, &filter.target_path, &filter.target_columns),
        filter.source,
        columns(filter.source, &[], &filter.source_columns),
        filter.join
    )
}

/// The skew split (or broadcast switch) the driver may make of `stage`'s join once its inputs
/// finished, if any.
fn skew_split_line(graph: &JobGraph, stage: StageId) -> Option<String> {
    let join = graph.skew_joins().iter().find(|j| j.stage == stage)?;
    let producer = |input: usize| {
        graph
            .stage(stage)
            .and_then(|s| s.inputs.get(input))
            .map_or_else(|| "?".to_string(), |i| i.stage.to_string())
    };
    let (build, probe) = (producer(join.build_input), producer(join.probe_input));
    Some(format!(
        "skew split: once stages {build} and {probe} finished, a partition with skewed probe rows \
         (see sluice.skew_join_*) may be spread over several tasks; or, if stage {build} finishes \
         small before stage {probe} starts and stage {probe} is a scan read by this join alone (see \
         sluice.broadcast_join_switch_*), the join may become a broadcast join, for {}",
        join.join
    ))
}

fn region_tasks(region: &TaskRegion) -> String {
    region
        .tasks
        .iter()
        .map(|t| format!("{}/{}", t.stage, t.partition))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The graph and topology as indented text.
pub fn explain_text(graph: &JobGraph) -> String {
    let topology = graph.topology();
    let mut out = String::new();
    let last = graph.final_stage();
    if let Some(line) = single_task_line(graph) {
        let _ = writeln!(out, "{line}");
    }
    for (id, stage) in graph.stages().iter().enumerate() {
        let role = if id == last.0 { " (final)" } else { "" };
        let inputs = stage
            .inputs
            .iter()
            .enumerate()
            .map(|(i, input)| format!("input {i} = stage {} {}", input.stage, input.mode.name()))
            .collect::<Vec<_>>();
        let _ = writeln!(
            out,
            "Stage {id}{role}: placement={}, partitions={}, output={} {}",
            stage.placement.name(),
            stage.partitions(),
            distribution_text(stage),
            stage.mode.name(),
        );
        if !inputs.is_empty() {
            let _ = writeln!(out, "  inputs: {}", inputs.join(", "));
        }
        for line in runtime_filter_lines(graph, StageId(id)) {
            let _ = writeln!(out, "  {line}");
        }
        if let Some(line) = skew_split_line(graph, StageId(id)) {
            let _ = writeln!(out, "  {line}");
        }
        for line in plan_text(stage).lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    let _ = writeln!(out, "Regions:");
    for (id, region) in topology.regions().iter().enumerate() {
        let dependencies = topology.dependency_regions(RegionId(id));
        let depends = if dependencies.is_empty() {
            String::new()
        } else {
            let ids: Vec<String> = dependencies.iter().map(|r| r.0.to_string()).collect();
            format!(" after region {}", ids.join(", "))
        };
        let _ = writeln!(
            out,
            "  region {id}: tasks {}{depends}",
            region_tasks(region)
        );
    }
    out
}

/// The graph and topology as a JSON value (see the module docs for the shape).
pub fn explain_json(graph: &JobGraph) -> Value {
    let topology = graph.topology();
    let stages: Vec<Value> = graph
        .stages()
        .iter()
        .enumerate()
        .map(|(id, stage)| {
            json!({
                "id": id,
                "partitions": stage.partitions(),
                "placement": stage.placement.name(),
                "mode": stage.mode.name(),
                "distribution": {
                    "kind": stage.distribution.kind(),
                    "channels": stage.distribution.channels(),
                    "keys": stage.distribution.key_names(),
                },
                "inputs": stage.inputs.iter().map(|i| json!({
                    "stage": i.stage.0,
                    "mode": i.mode.name(),
                })).collect::<Vec<_>>(),
                "runtime_filters": runtime_filter_lines(graph, StageId(id)),
                "skew_split": skew_split_line(graph, StageId(id)),
                "plan": plan_text(stage),
            })
        })
        .collect();
    let regions: Vec<Value> = topology
        .regions()
        .iter()
        .enumerate()
        .map(|(id, region)| {
            json!({
                "id": id,
                "tasks": region.tasks.iter().map(|t| json!([t.stage.0, t.partition])).collect::<Vec<_>>(),
                "depends_on": topology
                    .dependency_regions(RegionId(id))
                    .iter()
                    .map(|r| r.0)
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "single_task": single_task_line(graph),
        "stages": stages,
        "regions": regions,
    })
}

/// Why the job runs whole as one task, when it does.
fn single_task_line(graph: &JobGraph) -> Option<String> {
    graph.single_task().map(|single| {
        format!(
            "Single task: the scans read {} bytes, at most sluice.single_task_bytes = {}: the whole \
             plan runs in one task, its exchanges in memory",
            single.read_bytes, single.limit_bytes
        )
    })
}
