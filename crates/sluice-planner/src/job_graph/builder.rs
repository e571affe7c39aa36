//! Recursive stage splitting: walks the (rewritten) plan from the root, asks the distribution rules
//! what each node is, and cuts a new stage below every boundary.
//!
//! Children are split before their parent, so producer stages are pushed before their consumers and
//! the stage list comes out in topological order. A child read `Shared` (a collected build side) turns
//! the first boundary below it into a `Broadcast` input; below that boundary reads are `Once` again.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Result, internal_err, plan_err};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::limit::GlobalLimitExec;

use super::rewrites::coalesce;
use super::wire_fidelity::{Travel, travel};
use super::{
    InputMode, JobGraphOptions, OutputDistribution, OutputMode, Stage, StageId, StageInput,
    TaskPlacement, WireForm,
};
use crate::distribution::{Boundary, ChildUsage, NodeDistribution};
use crate::plan::stage_input::StageInputExec;

/// Splits `plan` into stages, the final stage last.
pub(super) fn build_stages(
    plan: Arc<dyn ExecutionPlan>,
    options: &JobGraphOptions,
) -> Result<Vec<Stage>> {
    with_final_stage(options, |builder| builder.split(plan, ChildUsage::Once))
}

/// The one stage of a job run whole as one task: `plan`, uncut, read as one partition.
pub(super) fn build_whole_plan_stage(
    plan: Arc<dyn ExecutionPlan>,
    options: &JobGraphOptions,
) -> Result<Vec<Stage>> {
    with_final_stage(options, |_| Ok(coalesce(plan)))
}

/// The stages `root` pushes, then the final stage: the plan `root` returns, on workers.
fn with_final_stage(
    options: &JobGraphOptions,
    root: impl FnOnce(&mut Builder<'_>) -> Result<Arc<dyn ExecutionPlan>>,
) -> Result<Vec<Stage>> {
    let mut builder = Builder {
        options,
        stages: Vec::new(),
    };
    let root = root(&mut builder)?;
    builder.push_stage(
        root,
        TaskPlacement::Worker,
        OutputDistribution::RoundRobin { channels: 1 },
        OutputMode::Pipelined,
    )?;
    Ok(builder.stages)
}

struct Builder<'a> {
    options: &'a JobGraphOptions,
    stages: Vec<Stage>,
}

fn single_child(plan: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    match plan.children().as_slice() {
        [child] => Ok(Arc::clone(child)),
        children => internal_err!(
            "{} is a stage boundary but has {} children; boundaries have exactly one",
            plan.name(),
            children.len()
        ),
    }
}

fn combine(outer: ChildUsage, inner: ChildUsage) -> ChildUsage {
    let rank = |u| match u {
        ChildUsage::Once => 0,
        ChildUsage::Shared => 1,
        ChildUsage::SharedReplayed => 2,
    };
    if rank(outer) >= rank(inner) {
        outer
    } else {
        inner
    }
}

fn placeholder(
    input: StageInput,
    properties_of: &Arc<dyn ExecutionPlan>,
) -> Arc<dyn ExecutionPlan> {
    Arc::new(StageInputExec::new(
        input,
        properties_of.properties().clone(),
    ))
}

fn shared_placeholder(
    input: StageInput,
    properties_of: &Arc<dyn ExecutionPlan>,
    usage: ChildUsage,
) -> Arc<dyn ExecutionPlan> {
    let read = StageInputExec::new(input, properties_of.properties().clone())
        .with_replay(usage == ChildUsage::SharedReplayed);
    Arc::new(read)
}

impl Builder<'_> {
    fn split(
        &mut self,
        plan: Arc<dyn ExecutionPlan>,
        usage: ChildUsage,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match self.options.rules.distribution_of(plan.as_ref()) {
            NodeDistribution::Unsupported(message) => plan_err!("{message}"),
            NodeDistribution::InStage(usages) => {
                let children = plan.children();
                if usages.len() != children.len() {
                    return internal_err!(
                        "the distribution rule of {} names {} children; it has {}",
                        plan.name(),
                        usages.len(),
                        children.len()
                    );
                }
                let children = children
                    .into_iter()
                    .zip(usages)
                    .map(|(child, u)| self.split(Arc::clone(child), combine(usage, u)))
                    .collect::<Result<Vec<_>>>()?;
                replace_children_if_necessary(plan, children)
            }
            NodeDistribution::Boundary(boundary) => self.split_boundary(plan, boundary, usage),
            NodeDistribution::Driver { whole_subtree } => {
                let node = if whole_subtree {
                    plan
                } else {
                    let children = plan
                        .children()
                        .into_iter()
                        .map(|child| self.forward_from_worker(Arc::clone(child)))
                        .collect::<Result<Vec<_>>>()?;
                    replace_children_if_necessary(plan, children)?
                };
                // A shared read needs one partition that every consumer partition can read.
                let (node, mode) = match usage {
                    ChildUsage::Once => (node, InputMode::Forward),
                    _ => (coalesce(node), InputMode::Broadcast),
                };
                // Pipelined in every exchange mode: the driver is never lost, so its output needs
                // no replay, and a driver subtree may be unbounded (a recursive query under a
                // LIMIT), which a blocking output would wait for forever.
                let stage = self.push_stage(
                    Arc::clone(&node),
                    TaskPlacement::Driver,
                    OutputDistribution::RoundRobin { channels: 1 },
                    OutputMode::Pipelined,
                )?;
                Ok(shared_placeholder(StageInput { stage, mode }, &node, usage))
            }
        }
    }

    /// The input of a driver node: split as usual, then, unless it already reads another stage,
    /// run it in a worker stage that the driver reads partition by partition.
    fn forward_from_worker(
        &mut self,
        child: Arc<dyn ExecutionPlan>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let child = self.split(child, ChildUsage::Once)?;
        if child.is::<StageInputExec<StageInput>>() {
            return Ok(child);
        }
        let input = self.push_single_channel_stage(Arc::clone(&child), InputMode::Forward)?;
        Ok(placeholder(input, &child))
    }

    fn split_boundary(
        &mut self,
        plan: Arc<dyn ExecutionPlan>,
        boundary: Boundary,
        usage: ChildUsage,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let child = self.split(single_child(&plan)?, ChildUsage::Once)?;
        match boundary {
            Boundary::Exchange {
                distribution,
                fetch,
            } => {
                let exchange_mode = self.options.exchange_mode;
                let stage =
                    self.push_stage(child, TaskPlacement::Worker, distribution, exchange_mode)?;
                let mode = match usage {
                    ChildUsage::Once => InputMode::Shuffle,
                    _ => InputMode::Broadcast,
                };
                let read = shared_placeholder(StageInput { stage, mode }, &plan, usage);
                Ok(match fetch {
                    Some(fetch) => Arc::new(GlobalLimitExec::new(read, 0, Some(fetch))),
                    None => read,
                })
            }
            Boundary::Merge => {
                let input = self.push_single_channel_stage(Arc::clone(&child), InputMode::Merge)?;
                replace_children_if_necessary(plan, vec![placeholder(input, &child)])
            }
            Boundary::Rescale => {
                if usage.is_shared() {
                    return plan_err!(
                        "{} under a shared (collected) join input is not supported in a distributed job",
                        plan.name()
                    );
                }
                let input = self.push_single_channel_stage(child, InputMode::Rescale)?;
                Ok(placeholder(input, &plan))
            }
        }
    }

    /// Appends a worker stage writing one channel per task, to be read in `mode`.
    fn push_single_channel_stage(
        &mut self,
        plan: Arc<dyn ExecutionPlan>,
        mode: InputMode,
    ) -> Result<StageInput> {
        let stage = self.push_stage(
            plan,
            TaskPlacement::Worker,
            OutputDistribution::RoundRobin { channels: 1 },
            self.options.exchange_mode,
        )?;
        Ok(StageInput { stage, mode })
    }

    /// Numbers the stage's placeholders by input index and appends it; returns its id.
    fn push_stage(
        &mut self,
        plan: Arc<dyn ExecutionPlan>,
        placement: TaskPlacement,
        distribution: OutputDistribution,
        mode: OutputMode,
    ) -> Result<StageId> {
        let mut inputs = Vec::new();
        let plan = plan
            .transform_up(|node| {
                let Some(read) = node.downcast_ref::<StageInputExec<StageInput>>() else {
                    return Ok(Transformed::no(node));
                };
                let index = inputs.len();
                inputs.push(*read.input());
                let numbered = StageInputExec::new(index, read.properties().clone())
                    .with_replay(read.replay());
                Ok(Transformed::yes(
                    Arc::new(numbered) as Arc<dyn ExecutionPlan>
                ))
            })?
            .data;
        if distribution.channels() == 0 {
            return plan_err!("{} would split its output into zero channels", plan.name());
        }
        // A plan that would not survive the wire exactly runs on the driver, from memory.
        let (placement, wire_form) = match placement {
            TaskPlacement::Driver => (TaskPlacement::Driver, None),
            TaskPlacement::Worker => match travel(&plan, self.options)? {
                Travel::Exact(bytes) => (
                    TaskPlacement::Worker,
                    bytes.map(|bytes| WireForm::new(&plan, bytes)),
                ),
                Travel::Changed => (TaskPlacement::Driver, None),
            },
        };
        let id = StageId(self.stages.len());
        self.stages.push(Stage {
            inputs,
            plan,
            mode,
            distribution,
            placement,
            wire_form,
        });
        Ok(id)
    }
}
