//! `joins = "auto"` under a memory limit: a query runs with hash joins (the fast plan), and one
//! whose run fails for lack of memory before it returned a row is planned again with sort-merge
//! joins (which spill; [`crate::joins`]) and run once more. The caller sees one stream.
//!
//! ```text
//!   plan (hash joins) ──► runner ──► batch with rows ──────────────────────► caller (no fallback now)
//!                            └─────► Resources exhausted, no row yet
//!                                      drop the first run (cancels its job)
//!                                      plan the same logical plan with SortMergeJoins
//!                                      (DataFusion's broadcast threshold again) ──► runner ──► caller
//! ```
//!
//! Invariants: a fallback exists only for a statement that reads and returns rows (no
//! `DataSinkExec`: a write that failed part-way is never repeated) and whose plan holds a join the
//! sort-merge rule would change; it is taken at most once, and only before the first row reached the
//! caller, so the caller never sees a row twice or a mix of two runs; any other error, or an
//! out-of-memory error after a row, ends the stream as it is. The first run's job carries
//! [`RetryPolicy::resources_final`], so a distributed run does not spend its region retries on a
//! plan that cannot fit before the fallback starts; the second run retries as any job does. Each
//! fallback is logged (`sluice::joins`, warn).

use std::sync::Arc;

use datafusion::common::DataFusionError;
use datafusion::common::tree_node::TreeNode;
use datafusion::datasource::sink::DataSinkExec;
use datafusion::execution::session_state::{SessionState, SessionStateBuilder};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{StreamExt, stream};
use sluice_runtime::scheduler::RetryPolicy;
use sluice_runtime::{ErrorKind, JobRunner};

use crate::joins::{has_sort_merge_candidates, physical_optimizer_rules};
use crate::scan_balance::balance_scans;

/// What a statement runs instead when its hash joins run out of memory: the same logical plan,
/// planned with sort-merge joins.
#[derive(Debug)]
pub struct SortMergeFallback {
    logical: LogicalPlan,
    /// Boxed: a session state is large, and fallbacks travel inside enums of small variants.
    state: Box<SessionState>,
    balance_scans: bool,
}

impl SortMergeFallback {
    /// The fallback of `plan`, planned from `logical` in `state` (the session's state when it was
    /// planned), if it needs one (see the module docs). `resets` are settings the session holds at
    /// a distributed default that sort-merge plans do without (the broadcast threshold): the
    /// fallback plans with DataFusion's default for each.
    pub fn of(
        plan: &Arc<dyn ExecutionPlan>,
        logical: LogicalPlan,
        state: &SessionState,
        resets: &[&str],
        balance_scans: bool,
    ) -> datafusion::common::Result<Option<Self>> {
        let writes = plan
            .exists(|node| Ok(node.downcast_ref::<DataSinkExec>().is_some()))
            .unwrap_or(true);
        if writes || !has_sort_merge_candidates(plan) {
            return Ok(None);
        }
        let mut state = SessionStateBuilder::new_from_existing(state.clone())
            .with_physical_optimizer_rules(physical_optimizer_rules(true))
            .build();
        let defaults = datafusion::config::ConfigOptions::default();
        for key in resets {
            let default = defaults
                .entries()
                .into_iter()
                .find(|entry| entry.key == *key)
                .and_then(|entry| entry.value);
            if let Some(default) = default {
                state.config_mut().options_mut().set(key, &default)?;
            }
        }
        Ok(Some(Self {
            logical,
            state: Box::new(state),
            balance_scans,
        }))
    }

    /// The sort-merge plan.
    async fn plan(&self) -> datafusion::common::Result<Arc<dyn ExecutionPlan>> {
        let plan = self.state.create_physical_plan(&self.logical).await?;
        if self.balance_scans {
            balance_scans(plan, self.state.runtime_env()).await
        } else {
            Ok(plan)
        }
    }
}

/// `context` for the first run of a statement with a fallback: its job fails at its first
/// out-of-memory failure.
pub fn first_run_context(context: &TaskContext) -> Arc<TaskContext> {
    let policy = RetryPolicy {
        resources_final: true,
    };
    let config = policy.attach(context.session_config().clone());
    Arc::new(rebuilt(context).with_session_config(config))
}

/// A copy of `context` (`TaskContext` is not `Clone`).
fn rebuilt(context: &TaskContext) -> TaskContext {
    TaskContext::new(
        context.task_id(),
        context.session_id(),
        context.session_config().clone(),
        context.scalar_functions().clone(),
        context.higher_order_functions().clone(),
        context.aggregate_functions().clone(),
        context.window_functions().clone(),
        context.runtime_env(),
    )
}

enum Phase {
    /// The hash-join run; no row has reached the caller yet.
    First {
        stream: SendableRecordBatchStream,
        fallback: SortMergeFallback,
        runner: Arc<dyn JobRunner>,
        context: Arc<TaskContext>,
    },
    /// Passing on the hash-join run's stream, rows having reached the caller.
    Then(SendableRecordBatchStream),
    /// Passing on the sort-merge run's stream; the hash-join run failed with `first`.
    Second {
        stream: SendableRecordBatchStream,
        first: String,
    },
}

/// `first` (the hash-join run), falling back to `fallback` run by `runner` in `context` as the
/// module docs say.
pub fn with_fallback(
    first: SendableRecordBatchStream,
    fallback: SortMergeFallback,
    runner: Arc<dyn JobRunner>,
    context: Arc<TaskContext>,
) -> SendableRecordBatchStream {
    let schema = first.schema();
    let start = Phase::First {
        stream: first,
        fallback,
        runner,
        context,
    };
    let batches = stream::unfold(Some(start), |phase| async move {
        match phase? {
            Phase::Then(mut stream) => {
                let item = stream.next().await?;
                Some((item, Some(Phase::Then(stream))))
            }
            Phase::Second { mut stream, first } => {
                let item = stream.next().await?.map_err(|e| after_fallback(e, &first));
                Some((item, Some(Phase::Second { stream, first })))
            }
            Phase::First {
                mut stream,
                fallback,
                runner,
                context,
            } => match stream.next().await? {
                Ok(batch) if batch.num_rows() == 0 => Some((
                    Ok(batch),
                    Some(Phase::First {
                        stream,
                        fallback,
                        runner,
                        context,
                    }),
                )),
                Ok(batch) => Some((Ok(batch), Some(Phase::Then(stream)))),
                Err(error) if ErrorKind::of(&error) == ErrorKind::ResourcesExhausted => {
                    // Stops the first run (its job) before the second takes the memory.
                    drop(stream);
                    let first = first_line(&error);
                    tracing::warn!(
                        target: "sluice::joins",
                        "the query ran out of memory with hash joins; running it again with \
                         sort-merge joins, which spill ({first})"
                    );
                    let second = match fallback.plan().await {
                        Ok(plan) => runner.execute(plan, context),
                        Err(e) => Err(e),
                    };
                    match second {
                        Ok(mut stream) => {
                            let item = stream.next().await?.map_err(|e| after_fallback(e, &first));
                            Some((item, Some(Phase::Second { stream, first })))
                        }
                        Err(e) => Some((Err(after_fallback(e, &first)), None)),
                    }
                }
                Err(error) => Some((Err(error), None)),
            },
        }
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, batches))
}

/// The first line of `error` (DataFusion lists the pool's consumers on the lines after it).
fn first_line(error: &DataFusionError) -> String {
    let text = error.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.trim_end_matches([' ', ',', ':']).to_string()
}

/// An out-of-memory error of the sort-merge run says that the hash-join run ran out first.
fn after_fallback(error: DataFusionError, first: &str) -> DataFusionError {
    if ErrorKind::of(&error) != ErrorKind::ResourcesExhausted {
        return error;
    }
    error.context(format!(
        "the query ran out of memory with hash joins ({first}) and again with sort-merge joins"
    ))
}
