//! Local-graph mode: the plan is cut into a job graph and run by the in-process job executor, through
//! the same stages, shuffles and task regions a cluster uses. It proves the job graph's semantics
//! against local mode without networking.

use std::sync::Arc;

use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use sluice_planner::JobGraph;

use super::JobRunner;
use crate::config::ExecutionMode;
use crate::error::Result;

/// Runs plans as job graphs in this process.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalGraphRunner;

impl JobRunner for LocalGraphRunner {
    fn mode(&self) -> ExecutionMode {
        ExecutionMode::LocalGraph
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let graph = JobGraph::try_new(plan)?;
        Ok(sluice_runtime::execute_graph(graph, task_ctx))
    }
}
