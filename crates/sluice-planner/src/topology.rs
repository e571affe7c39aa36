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
//! partition's region, any other mode → every region of the producer's component). A component's
//! regions have consecutive ids, so a dependency on a whole component is kept as one
//! [`Dependency::Component`] rather than one entry per region: a chain of stages of `W` tasks costs
//! `O(W)` per stage, not `O(W²)`, and the scheduler tracks a component's unfinished regions with
//! one counter.
//!
//! A runtime filter whose target stage does not read its source (a stage below the join; see
//! `runtime_filters`) adds a wait: the target stage's regions depend on the filter source's
//! component as if they read it.

use std::collections::BTreeSet;
use std::ops::Range;

use datafusion::common::{HashMap, Result, internal_err};

use crate::ids::{RegionId, StageId, TaskId};
use crate::job_graph::{InputMode, OutputMode, Stage};

/// A connected component of stages linked by pipelined edges: its regions, consecutive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComponentId(pub usize);

/// What a region waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dependency {
    /// One region (a `Forward` input's same partition).
    Region(RegionId),
    /// Every region of a component (any other input).
    Component(ComponentId),
}

/// Tasks scheduled together, and what must finish first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRegion {
    /// The tasks, by stage then partition.
    pub tasks: Vec<TaskId>,
    /// Regions (one by one or a whole component) whose output this region reads and that must
    /// finish first; [`JobTopology::dependency_regions`] lists them region by region.
    pub depends_on: Vec<Dependency>,
}

/// The regions of a job graph; see the module docs.
#[derive(Debug, Clone)]
pub struct JobTopology {
    regions: Vec<TaskRegion>,
    region_of: HashMap<TaskId, RegionId>,
    /// Per component, its regions.
    components: Vec<Range<usize>>,
    /// Per region, its component.
    component_of: Vec<ComponentId>,
    /// Per region, the regions that depend on it alone.
    region_readers: Vec<Vec<RegionId>>,
    /// Per component, the regions that depend on all of it.
    component_readers: Vec<Vec<RegionId>>,
}

fn find(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

impl JobTopology {
    /// Groups the tasks of `stages` (a job graph's, in topological order) into regions; each
    /// `(source, target)` of `waits` makes the target stage's regions wait for the source stage's
    /// component. The job graph does this once, when it is built: see `JobGraph::topology`.
    pub(crate) fn build(stages: &[Stage], waits: &[(StageId, StageId)]) -> Result<Self> {
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
        let mut ranges = Vec::with_capacity(components.len());
        let mut component_of_stage = vec![ComponentId(0); stages.len()];
        for (c, members) in components.iter().enumerate() {
            for s in members {
                component_of_stage[*s] = ComponentId(c);
            }
            let start = regions.len();
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
            ranges.push(start..regions.len());
        }
        let component_of: Vec<ComponentId> = ranges
            .iter()
            .enumerate()
            .flat_map(|(c, range)| range.clone().map(move |_| ComponentId(c)))
            .collect();
        let region_of: HashMap<TaskId, RegionId> = regions
            .iter()
            .enumerate()
            .flat_map(|(r, region)| region.tasks.iter().map(move |t| (*t, RegionId(r))))
            .collect();
        let mut region_readers = vec![Vec::new(); regions.len()];
        let mut component_readers = vec![Vec::new(); ranges.len()];
        for (r, region) in regions.iter_mut().enumerate() {
            let own = component_of[r];
            let mut depends = BTreeSet::new();
            for t in &region.tasks {
                let waited = waits
                    .iter()
                    .filter(|(_, target)| *target == t.stage)
                    .map(|(source, _)| (*source, InputMode::Broadcast, true));
                let read = stages[t.stage.0]
                    .inputs
                    .iter()
                    .map(|i| (i.stage, i.mode, false));
                for (input_stage, input_mode, wait) in read.chain(waited) {
                    let dependency = match input_mode {
                        InputMode::Forward => {
                            let id = TaskId {
                                stage: input_stage,
                                partition: t.partition,
                            };
                            let Some(dep) = region_of.get(&id) else {
                                return internal_err!(
                                    "task {} of stage {} (read by stage {}) is in no region",
                                    t.partition,
                                    input_stage,
                                    t.stage
                                );
                            };
                            if dep.0 == r {
                                continue;
                            }
                            if dep.0 > r {
                                return internal_err!(
                                    "region {r} would depend on later region {}",
                                    dep.0
                                );
                            }
                            Dependency::Region(*dep)
                        }
                        _ => {
                            let component = component_of_stage[input_stage.0];
                            if component == own && wait {
                                return internal_err!(
                                    "stage {} cannot wait for stage {input_stage}, which runs \
                                     with it",
                                    t.stage
                                );
                            }
                            if component == own {
                                continue;
                            }
                            if ranges[component.0].end > r {
                                return internal_err!(
                                    "region {r} would depend on later region {}",
                                    ranges[component.0].end - 1
                                );
                            }
                            Dependency::Component(component)
                        }
                    };
                    depends.insert(dependency);
                }
            }
            for dependency in &depends {
                match dependency {
                    Dependency::Region(d) => region_readers[d.0].push(RegionId(r)),
                    Dependency::Component(c) => component_readers[c.0].push(RegionId(r)),
                }
            }
            region.depends_on = depends.into_iter().collect();
        }
        Ok(Self {
            regions,
            region_of,
            components: ranges,
            component_of,
            region_readers,
            component_readers,
        })
    }

    /// The regions in dependency order.
    pub fn regions(&self) -> &[TaskRegion] {
        &self.regions
    }

    /// The region holding `task`.
    pub fn region_of(&self, task: TaskId) -> Option<RegionId> {
        self.region_of.get(&task).copied()
    }

    /// The regions of each component, by component id.
    pub fn components(&self) -> &[Range<usize>] {
        &self.components
    }

    /// The component holding `region`.
    pub fn component_of(&self, region: RegionId) -> Option<ComponentId> {
        self.component_of.get(region.0).copied()
    }

    /// Every region `region` waits for, one by one, ascending.
    pub fn dependency_regions(&self, region: RegionId) -> Vec<RegionId> {
        let Some(region) = self.regions.get(region.0) else {
            return Vec::new();
        };
        let mut ids: Vec<RegionId> = region
            .depends_on
            .iter()
            .flat_map(|dependency| match dependency {
                Dependency::Region(r) => r.0..r.0 + 1,
                Dependency::Component(c) => self.components.get(c.0).cloned().unwrap_or(0..0),
            })
            .map(RegionId)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The regions that wait for `region` alone (a `Forward` input of its partition).
    pub fn region_readers(&self, region: RegionId) -> &[RegionId] {
        self.region_readers.get(region.0).map_or(&[], Vec::as_slice)
    }

    /// The regions that wait for every region of `component`.
    pub fn component_readers(&self, component: ComponentId) -> &[RegionId] {
        self.component_readers
            .get(component.0)
            .map_or(&[], Vec::as_slice)
    }

    /// Every region that reads `region`'s output (alone or with the rest of its component).
    pub fn readers(&self, region: RegionId) -> impl Iterator<Item = RegionId> + '_ {
        let whole = self
            .component_of(region)
            .map_or(&[][..], |c| self.component_readers(c));
        self.region_readers(region).iter().chain(whole).copied()
    }
}
