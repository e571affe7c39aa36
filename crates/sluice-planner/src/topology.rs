//! Job topology: which tasks are scheduled (and retried) together, and in what order.
//!
//! A task region is a connected component of stages linked by pipelined edges (a `Pipelined`
//! producer and its consumer must run at the same time). A component whose internal inputs are all
//! `Forward`, with equal partition counts, splits into one region per partition; otherwise one region
//! holds every task of the component. A `Blocking` output ends a component: its consumer's region
//! depends on the producer's region(s) and starts after them.
//!
//! ```text
//!   stage 0 ──Forward──► stage 1 ──Shuffle(Blocking)──► stage 2
//!   region 0: (0,0) (1,0)     region 2: (2,0) (2,1)   depends on regions 0 and 1
//!   region 1: (0,1) (1,1)
//! ```
//!
//! Invariants: every task is in exactly one region; regions are listed in dependency order (a region
//! depends only on regions before it); dependencies follow the inputs (`Forward` → the same
//! partition's region, any other mode → every producer partition's region).

use std::collections::{BTreeSet, HashMap};

use datafusion::common::{Result, internal_err};

use crate::ids::{RegionId, StageId, TaskId};
use crate::job_graph::{InputMode, OutputMode, Stage};

/// Tasks scheduled together, and the regions that must finish first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRegion {
    /// The tasks, by stage then partition.
    pub tasks: Vec<TaskId>,
    /// Regions whose output this region reads and that must finish first.
    pub depends_on: Vec<RegionId>,
}

/// The regions of a job graph; see the module docs.
#[derive(Debug, Clone)]
pub struct JobTopology {
    regions: Vec<TaskRegion>,
    region_of: HashMap<TaskId, RegionId>,
}

fn find(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

impl JobTopology {
    /// Groups the tasks of `stages` (a job graph's, in topological order) into regions. The job
    /// graph does this once, when it is built: see `JobGraph::topology`.
    pub(crate) fn build(stages: &[Stage]) -> Result<Self> {
        let mut parent: Vec<usize> = (0..stages.len()).collect();
        for (consumer, stage) in stages.iter().enumerate() {
            for input in &stage.inputs {
                if stages[input.stage.0].mode == OutputMode::Pipelined {
                    let (a, b) = (
                        find(&mut parent, consumer),
                        find(&mut parent, input.stage.0),
                    );
                    parent[a] = b;
                }
            }
        }
        let mut components: HashMap<usize, Vec<usize>> = HashMap::new();
        for s in 0..stages.len() {
            let root = find(&mut parent, s);
            components.entry(root).or_default().push(s);
        }
        // A component's last stage is its root consumer; ordering by it is a dependency order.
        let mut components: Vec<Vec<usize>> = components.into_values().collect();
        components.sort_by_key(|members| members.last().copied());

        let mut regions = Vec::new();
        for members in &components {
            let set: BTreeSet<usize> = members.iter().copied().collect();
            let internal_forward_only = members.iter().all(|s| {
                stages[*s]
                    .inputs
                    .iter()
                    .filter(|i| set.contains(&i.stage.0))
                    .all(|i| i.mode == InputMode::Forward)
            });
            let partitions: BTreeSet<usize> =
                members.iter().map(|s| stages[*s].partitions()).collect();
            let task = |s: usize, p| TaskId {
                stage: StageId(s),
                partition: p,
            };
            match (internal_forward_only, partitions.iter().next()) {
                (true, Some(&n)) if partitions.len() == 1 => {
                    for p in 0..n {
                        let tasks = members.iter().map(|s| task(*s, p)).collect();
                        regions.push(TaskRegion {
                            tasks,
                            depends_on: Vec::new(),
                        });
                    }
                }
                _ => {
                    let tasks = members
                        .iter()
                        .flat_map(|s| (0..stages[*s].partitions()).map(move |p| task(*s, p)))
                        .collect();
                    regions.push(TaskRegion {
                        tasks,
                        depends_on: Vec::new(),
                    });
                }
            }
        }
        let region_of: HashMap<TaskId, RegionId> = regions
            .iter()
            .enumerate()
            .flat_map(|(r, region)| region.tasks.iter().map(move |t| (*t, RegionId(r))))
            .collect();
        for (r, region) in regions.iter_mut().enumerate() {
            let mut depends = BTreeSet::new();
            for t in &region.tasks {
                for input in &stages[t.stage.0].inputs {
                    let producer = &stages[input.stage.0];
                    let producer_tasks: Vec<usize> = match input.mode {
                        InputMode::Forward => vec![t.partition],
                        _ => (0..producer.partitions()).collect(),
                    };
                    for p in producer_tasks {
                        let id = TaskId {
                            stage: input.stage,
                            partition: p,
                        };
                        let Some(dep) = region_of.get(&id) else {
                            return internal_err!(
                                "task {p} of stage {} (read by stage {}) is in no region",
                                input.stage,
                                t.stage
                            );
                        };
                        if dep.0 > r {
                            return internal_err!(
                                "region {r} would depend on later region {}",
                                dep.0
                            );
                        }
                        if dep.0 != r {
                            depends.insert(*dep);
                        }
                    }
                }
            }
            region.depends_on = depends.into_iter().collect();
        }
        Ok(Self { regions, region_of })
    }

    /// The regions in dependency order.
    pub fn regions(&self) -> &[TaskRegion] {
        &self.regions
    }

    /// The region holding `task`.
    pub fn region_of(&self, task: TaskId) -> Option<RegionId> {
        self.region_of.get(&task).copied()
    }
}
