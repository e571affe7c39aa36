//! The synthetic job graphs of the driver simulation: a chain of stages of equal width, each task
//! reading exactly one task of the stage before it (a `Rescale` of equal widths: its definition
//! carries one locator), and every stage waiting for all of the one before it.
//!
//! ```text
//!   stage 0 (W tasks) ──Rescale──► stage 1 (W tasks) ──Rescale──► … ──► stage S-1 (W tasks) ──► job output
//!   blocking exchange: every task its own region (retried alone); a stage's W regions become
//!                      ready together, when the last task of the stage before it succeeded
//!   pipelined exchange: one region of S × W tasks, placed whole
//! ```

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{Result, plan_err};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::{ExecutionPlan, PlanProperties};
use sluice_planner::{
    InputMode, JobGraph, OutputDistribution, OutputMode, Stage, StageId, StageInput,
    StageInputExec, TaskPlacement,
};

/// The one column every simulated stage declares.
pub(crate) fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]))
}

/// A chain of `stages` stages of `width` tasks; every output but the last is `Blocking` when
/// `blocking`, else `Pipelined`.
pub(crate) fn chain_graph(stages: usize, width: usize, blocking: bool) -> Result<JobGraph> {
    if stages == 0 || width == 0 {
        return plan_err!("a simulated job needs at least one stage of at least one task");
    }
    let mode = |last: bool| {
        if blocking && !last {
            OutputMode::Blocking
        } else {
            OutputMode::Pipelined
        }
    };
    let read = Arc::new(PlanProperties::new(
        EquivalenceProperties::new(schema()),
        Partitioning::UnknownPartitioning(width),
        EmissionType::Incremental,
        Boundedness::Bounded,
    ));
    let plans = (0..stages).map(|s| -> Arc<dyn ExecutionPlan> {
        if s == 0 {
            Arc::new(EmptyExec::new(schema()).with_partitions(width))
        } else {
            Arc::new(StageInputExec::new(0usize, Arc::clone(&read)))
        }
    });
    let graph = plans
        .enumerate()
        .map(|(s, plan)| Stage {
            inputs: s
                .checked_sub(1)
                .map(|producer| StageInput {
                    stage: StageId(producer),
                    mode: InputMode::Rescale,
                })
                .into_iter()
                .collect(),
            plan,
            mode: mode(s + 1 == stages),
            distribution: OutputDistribution::RoundRobin { channels: 1 },
            placement: TaskPlacement::Worker,
            wire_form: None,
        })
        .collect();
    JobGraph::from_stages(graph, schema())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocking_chain_is_a_region_per_task_waiting_for_the_stage_before_and_pipelined_one_region()
    {
        let blocking = chain_graph(3, 4, true).unwrap();
        let topology = blocking.topology();
        let sizes: Vec<usize> = topology.regions().iter().map(|r| r.tasks.len()).collect();
        assert_eq!(sizes, [1; 12]);
        assert_eq!(topology.components(), [0..4, 4..8, 8..12]);
        // Every task of stage 1 waits for all of stage 0, kept as one dependency.
        for region in &topology.regions()[4..8] {
            assert_eq!(
                region.depends_on,
                [sluice_planner::Dependency::Component(
                    sluice_planner::ComponentId(0)
                )]
            );
        }
        let pipelined = chain_graph(3, 4, false).unwrap();
        let sizes: Vec<usize> = pipelined
            .topology()
            .regions()
            .iter()
            .map(|r| r.tasks.len())
            .collect();
        assert_eq!(sizes, [12]);
        assert!(chain_graph(0, 4, true).is_err());
    }
}
