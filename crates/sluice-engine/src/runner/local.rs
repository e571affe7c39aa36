//! Local mode: the plan runs in this process through DataFusion's own `execute_stream`, which merges
//! the plan's output partitions into one stream. This is the reference every other mode must match.

use std::sync::Arc;

use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::{ExecutionPlan, execute_stream};

use super::JobRunner;
use crate::config::ExecutionMode;
use crate::error::Result;

/// Runs plans in-process with plain DataFusion.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalRunner;

impl JobRunner for LocalRunner {
    fn mode(&self) -> ExecutionMode {
        ExecutionMode::Local
    }

    fn execute(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        task_ctx: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        Ok(execute_stream(plan, task_ctx)?)
    }
}
