//! How each plan node takes part in distributed execution: the planner's extension point.
//!
//! The job-graph builder never matches on node types itself. It asks [`DistributionRules`] for each
//! node's [`NodeDistribution`]: whether the node runs inside a stage (and whether it reads a child's
//! partitions once or shares them across its partitions), whether it is a stage boundary, whether it
//! must run on the driver, or whether it cannot run distributed at all. DataFusion's built-in nodes and
//! Sluice's own nodes get their rules here through [`DistributedExec`]; a custom `ExecutionPlan`
//! implements the same trait and is registered with [`DistributionRules::register`]. A node with no
//! rule runs inside a stage, reading each child partition once.

use std::fmt;
use std::sync::Arc;

use datafusion::datasource::sink::DataSinkExec;
use datafusion::physical_expr::Partitioning;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode, PiecewiseMergeJoinExec,
};
use datafusion::physical_plan::memory::LazyMemoryExec;
use datafusion::physical_plan::recursive_query::RecursiveQueryExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::partial_sort::PartialSortExec;
use datafusion::physical_plan::sorts::partitioned_topk::PartitionedTopKExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::streaming::StreamingTableExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::job_graph::OutputDistribution;
use crate::plan::rescale::RescaleExec;

/// How a node reads one child's partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildUsage {
    /// Each child partition is read by one partition of the node.
    Once,
    /// Every partition of the node reads the same child partitions (a collected build side): across a
    /// stage boundary this becomes a `Broadcast` input.
    Shared,
    /// Like `Shared`, and a partition of the node may read the child a second time (a nested-loop
    /// join re-reads its build side when it falls back to spilling): the reader keeps what it read.
    SharedReplayed,
}

impl ChildUsage {
    /// Whether every partition of the node reads the same child partitions.
    pub fn is_shared(self) -> bool {
        self != ChildUsage::Once
    }
}

/// The kinds of stage boundary.
#[derive(Debug, Clone)]
pub enum Boundary {
    /// The node is replaced by a read of its child's stage, whose tasks split their output by
    /// `distribution`; read with `Shuffle` (or `Broadcast` when shared). A `fetch` is kept as a limit
    /// above the read.
    Exchange {
        /// How the producer tasks split rows.
        distribution: OutputDistribution,
        /// A row limit the node applied, re-applied above the read.
        fetch: Option<usize>,
    },
    /// The node stays in the consumer and reads every partition of its child's stage (`Merge`).
    Merge,
    /// The node is replaced by a `Rescale` read of its child's stage with the node's partition count.
    Rescale,
}

/// How a node distributes.
#[derive(Debug, Clone)]
pub enum NodeDistribution {
    /// Runs inside a stage, once per partition; one usage per child.
    InStage(Vec<ChildUsage>),
    /// A stage boundary over the node's single child.
    Boundary(Boundary),
    /// Runs in a driver stage. With `whole_subtree` its inputs run with it in the same stage, uncut
    /// (they share state with it); otherwise each input becomes a worker stage read with `Forward`.
    Driver {
        /// Keep the node's whole input tree in the driver stage.
        whole_subtree: bool,
    },
    /// Cannot run distributed; the message names the node and how to avoid it.
    Unsupported(String),
}

/// A plan node that declares how it distributes. Register the type with
/// [`DistributionRules::register`].
pub trait DistributedExec: ExecutionPlan {
    /// How this node distributes.
    fn distribution(&self) -> NodeDistribution;
}

type Rule = Arc<dyn Fn(&dyn ExecutionPlan) -> Option<NodeDistribution> + Send + Sync>;

/// The distribution rules the job-graph builder consults, by node type.
#[derive(Clone)]
pub struct DistributionRules {
    rules: Vec<Rule>,
}

impl fmt::Debug for DistributionRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DistributionRules({} rules)", self.rules.len())
    }
}

impl Default for DistributionRules {
    /// The rules for DataFusion's built-in nodes and Sluice's own.
    fn default() -> Self {
        let mut rules = Self { rules: Vec::new() };
        rules
            .register::<RepartitionExec>()
            .register::<CoalescePartitionsExec>()
            .register::<SortPreservingMergeExec>()
            .register::<HashJoinExec>()
            .register::<CrossJoinExec>()
            .register::<NestedLoopJoinExec>()
            .register::<RecursiveQueryExec>()
            .register::<StreamingTableExec>()
            .register::<LazyMemoryExec>()
            .register::<PartialSortExec>()
            .register::<PartitionedTopKExec>()
            .register::<PiecewiseMergeJoinExec>()
            .register::<DataSinkExec>()
            .register::<RescaleExec>();
        rules
    }
}

impl DistributionRules {
    /// Registers node type `T`; a later registration for the same type wins.
    pub fn register<T: DistributedExec>(&mut self) -> &mut Self {
        self.rules.push(Arc::new(|plan: &dyn ExecutionPlan| {
            plan.downcast_ref::<T>().map(DistributedExec::distribution)
        }));
        self
    }

    /// How `plan` distributes: its registered rule, or in-stage reading every child once.
    pub fn distribution_of(&self, plan: &dyn ExecutionPlan) -> NodeDistribution {
        self.rules
            .iter()
            .rev()
            .find_map(|rule| rule(plan))
            .unwrap_or_else(|| {
                NodeDistribution::InStage(vec![ChildUsage::Once; plan.children().len()])
            })
    }
}

fn child_partitions(plan: &dyn ExecutionPlan) -> usize {
    plan.children()
        .first()
        .map_or(1, |c| c.output_partitioning().partition_count())
}

fn in_stage(plan: &dyn ExecutionPlan) -> NodeDistribution {
    NodeDistribution::InStage(vec![ChildUsage::Once; plan.children().len()])
}

fn unsupported(node: &str, why: &str, setting: &str) -> NodeDistribution {
    NodeDistribution::Unsupported(format!(
        "{node} cannot run in a distributed job: {why}; set {setting} or run with --mode local"
    ))
}

impl DistributedExec for RepartitionExec {
    fn distribution(&self) -> NodeDistribution {
        let distribution = match self.partitioning() {
            Partitioning::Hash(keys, channels) => OutputDistribution::Hash {
                keys: keys.clone(),
                channels: *channels,
            },
            Partitioning::RoundRobinBatch(channels)
            | Partitioning::UnknownPartitioning(channels) => OutputDistribution::RoundRobin {
                channels: *channels,
            },
            Partitioning::Range(_) => {
                return unsupported(
                    "a range RepartitionExec",
                    "Sluice's shuffle does not route by source-declared ranges yet",
                    "datafusion.optimizer.preserve_file_partitions = 0",
                );
            }
        };
        NodeDistribution::Boundary(Boundary::Exchange {
            distribution,
            fetch: None,
        })
    }
}

impl DistributedExec for CoalescePartitionsExec {
    fn distribution(&self) -> NodeDistribution {
        if child_partitions(self) <= 1 {
            return in_stage(self);
        }
        NodeDistribution::Boundary(Boundary::Exchange {
            distribution: OutputDistribution::RoundRobin { channels: 1 },
            fetch: self.fetch(),
        })
    }
}

impl DistributedExec for SortPreservingMergeExec {
    fn distribution(&self) -> NodeDistribution {
        if child_partitions(self) <= 1 {
            return in_stage(self);
        }
        NodeDistribution::Boundary(Boundary::Merge)
    }
}

impl DistributedExec for HashJoinExec {
    fn distribution(&self) -> NodeDistribution {
        match self.partition_mode() {
            PartitionMode::CollectLeft => {
                NodeDistribution::InStage(vec![ChildUsage::Shared, ChildUsage::Once])
            }
            _ => in_stage(self),
        }
    }
}

impl DistributedExec for CrossJoinExec {
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::InStage(vec![ChildUsage::Shared, ChildUsage::Once])
    }
}

impl DistributedExec for NestedLoopJoinExec {
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::InStage(vec![ChildUsage::SharedReplayed, ChildUsage::Once])
    }
}

impl DistributedExec for RecursiveQueryExec {
    /// The recursive term reads a work table that the node fills: they must share one process.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: true,
        }
    }
}

impl DistributedExec for StreamingTableExec {
    /// System tables (information_schema) stream from the driver's catalog.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: true,
        }
    }
}

impl DistributedExec for LazyMemoryExec {
    /// Generated series have no wire form; they are produced on the driver.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: true,
        }
    }
}

impl DistributedExec for PartialSortExec {
    /// No wire form: it runs on the driver over its input read from workers.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: false,
        }
    }
}

impl DistributedExec for DataSinkExec {
    /// Writes into the driver's catalog (in-memory tables, files): runs on the driver over its input
    /// read from workers.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::Driver {
            whole_subtree: false,
        }
    }
}

impl DistributedExec for PartitionedTopKExec {
    /// Per partition: its input is hash-partitioned on the window's partition keys, so every key's
    /// top rows are decided in one task.
    fn distribution(&self) -> NodeDistribution {
        in_stage(self)
    }
}

impl DistributedExec for PiecewiseMergeJoinExec {
    /// The buffered side is collected once per instance, like a collect-left build side; the
    /// rewrites give joins that emit unmatched buffered rows a single streamed partition.
    fn distribution(&self) -> NodeDistribution {
        NodeDistribution::InStage(vec![ChildUsage::Shared, ChildUsage::Once])
    }
}
