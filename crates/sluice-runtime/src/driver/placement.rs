//! Task placement: which worker runs each task of a region. Pure code over slot counts.
//!
//! Rules: a region is placed whole or waits (its tasks exchange pipelined streams, so all must run at
//! once); driver-placed stages run on the driver's executor and take no worker slot; a task that
//! reads a `Forward` input goes to its producer's worker when that worker has a free slot; any other
//! task goes to the worker with the most free slots. A region that needs more slots than the whole
//! cluster has is [`Placement::Short`] of capacity: the driver waits for workers to join (up to
//! its capacity wait), then fails the job.
//!
//! Between jobs ([`next_region`]): the waiting region placed next is the one whose job holds the
//! fewest worker slots, the earliest queued among equals, so a job running wide does not keep jobs
//! that run nothing behind its later regions. When that region does not fit, nothing is placed
//! until slots free up (smaller regions do not jump the queue). A region of a job that holds slots
//! may be passed by jobs holding fewer, but only until its job's running tasks end: then it holds
//! none and only regions queued before it go first, so no region waits forever.

use sluice_planner::{JobId, TaskId, WorkerId};

/// Where a task attempt runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Location {
    /// The driver's own executor.
    Driver,
    /// A registered worker.
    Worker(WorkerId),
}

/// One worker's task slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slots {
    /// The worker.
    pub worker: WorkerId,
    /// Slots not held by a task attempt.
    pub free: usize,
    /// All its slots.
    pub total: usize,
}

/// The outcome of placing one region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Placement {
    /// One location per task, in the region's task order.
    Placed(Vec<Location>),
    /// Not enough free slots now; try again when tasks finish.
    Wait,
    /// The region needs more slots than the live workers have in all: it can only run once
    /// workers join.
    Short(CapacityShortfall),
}

/// How far a region is from fitting the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CapacityShortfall {
    /// Worker slots the region needs at once.
    pub needed: usize,
    /// Worker slots of every live worker taking tasks.
    pub capacity: usize,
    /// Those workers.
    pub workers: usize,
}

impl std::fmt::Display for CapacityShortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a task region needs {} task slots at once but the cluster has {} ({} workers)",
            self.needed, self.capacity, self.workers
        )
    }
}

/// What placement needs to know about a region's tasks.
pub(crate) trait PlacementView {
    /// Whether `task`'s stage runs on the driver.
    fn on_driver(&self, task: TaskId) -> bool;
    /// The producer task of `task`'s `Forward` input, if it has one.
    fn forward_producer(&self, task: TaskId) -> Option<TaskId>;
    /// Where an already placed task (of an earlier region) runs.
    fn placed(&self, task: TaskId) -> Option<Location>;
}

/// Places `tasks` on the workers of `slots` (in worker order).
pub(crate) fn place(tasks: &[TaskId], view: &dyn PlacementView, slots: &[Slots]) -> Placement {
    let needed = tasks.iter().filter(|t| !view.on_driver(**t)).count();
    let capacity: usize = slots.iter().map(|s| s.total).sum();
    if needed > capacity {
        return Placement::Short(CapacityShortfall {
            needed,
            capacity,
            workers: slots.len(),
        });
    }
    if needed > slots.iter().map(|s| s.free).sum::<usize>() {
        return Placement::Wait;
    }
    let index_of = |worker: WorkerId| slots.iter().position(|s| s.worker == worker);
    let mut free: Vec<usize> = slots.iter().map(|s| s.free).collect();
    let mut locations: Vec<Location> = Vec::with_capacity(tasks.len());
    for (index, task) in tasks.iter().enumerate() {
        if view.on_driver(*task) {
            locations.push(Location::Driver);
            continue;
        }
        let producer_worker = view.forward_producer(*task).and_then(|producer| {
            let here = tasks
                .iter()
                .take(index)
                .position(|t| *t == producer)
                .map(|i| locations[i]);
            match here.or_else(|| view.placed(producer)) {
                Some(Location::Worker(w)) => {
                    index_of(w).filter(|i| free.get(*i).is_some_and(|f| *f > 0))
                }
                _ => None,
            }
        });
        let worker = producer_worker.or_else(|| {
            free.iter()
                .enumerate()
                .filter(|(_, f)| **f > 0)
                .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
                .map(|(w, _)| w)
        });
        let Some(worker) = worker else {
            return Placement::Wait;
        };
        free[worker] -= 1;
        locations.push(Location::Worker(slots[worker].worker));
    }
    Placement::Placed(locations)
}

/// Of the waiting regions' jobs (oldest first), the index of the region to place next: the fewest
/// slots `held` by its job, the oldest among equals; `None` when nothing waits.
pub(crate) fn next_region(waiting: &[JobId], held: impl Fn(JobId) -> usize) -> Option<usize> {
    waiting
        .iter()
        .enumerate()
        .min_by_key(|(index, job)| (held(**job), *index))
        .map(|(index, _)| index)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::collections::HashMap;

    use sluice_planner::StageId;

    use super::*;

    struct View {
        driver_stages: Vec<usize>,
        forward: HashMap<TaskId, TaskId>,
        placed: HashMap<TaskId, Location>,
    }

    impl PlacementView for View {
        fn on_driver(&self, task: TaskId) -> bool {
            self.driver_stages.contains(&task.stage.0)
        }
        fn forward_producer(&self, task: TaskId) -> Option<TaskId> {
            self.forward.get(&task).copied()
        }
        fn placed(&self, task: TaskId) -> Option<Location> {
            self.placed.get(&task).copied()
        }
    }

    #[test]
    fn the_next_region_is_of_the_job_holding_fewest_slots_then_the_oldest() {
        let held = |job: JobId| match job.0 {
            1 => 6,
            2 => 0,
            _ => 2,
        };
        // Job 1 runs wide and queued first; job 2 runs nothing; job 3 runs a little.
        let waiting = [JobId(1), JobId(3), JobId(2), JobId(2)];
        assert_eq!(next_region(&waiting, held), Some(2));
        assert_eq!(next_region(&[JobId(1), JobId(3)], held), Some(1));
        assert_eq!(
            next_region(&[JobId(3), JobId(4)], held),
            Some(0),
            "oldest of equals"
        );
        assert_eq!(next_region(&[], held), None);
    }

    fn task(stage: usize, partition: usize) -> TaskId {
        TaskId {
            stage: StageId(stage),
            partition,
        }
    }

    fn slots(free: &[usize], total: &[usize]) -> Vec<Slots> {
        free.iter()
            .zip(total)
            .enumerate()
            .map(|(i, (free, total))| Slots {
                worker: WorkerId(i as u64 + 1),
                free: *free,
                total: *total,
            })
            .collect()
    }

    fn on(worker: u64) -> Location {
        Location::Worker(WorkerId(worker))
    }

    fn empty() -> View {
        View {
            driver_stages: vec![],
            forward: HashMap::new(),
            placed: HashMap::new(),
        }
    }

    #[test]
    fn spreads_tasks_over_the_freest_workers() {
        let tasks: Vec<_> = (0..4).map(|p| task(0, p)).collect();
        let placement = place(&tasks, &empty(), &slots(&[2, 2], &[2, 2]));
        assert_eq!(
            placement,
            Placement::Placed(vec![on(1), on(2), on(1), on(2)])
        );
        // The freest worker first.
        let placement = place(&tasks[..2], &empty(), &slots(&[1, 3], &[4, 4]));
        assert_eq!(placement, Placement::Placed(vec![on(2), on(2)]));
    }

    #[test]
    fn a_region_waits_for_free_slots_or_is_short_of_capacity() {
        let tasks: Vec<_> = (0..3).map(|p| task(0, p)).collect();
        assert_eq!(
            place(&tasks, &empty(), &slots(&[1, 1], &[2, 2])),
            Placement::Wait
        );
        let short = place(&tasks, &empty(), &slots(&[1, 1], &[1, 1]));
        let expected = CapacityShortfall {
            needed: 3,
            capacity: 2,
            workers: 2,
        };
        assert_eq!(short, Placement::Short(expected));
        assert_eq!(
            expected.to_string(),
            "a task region needs 3 task slots at once but the cluster has 2 (2 workers)"
        );
        // No worker at all: short by the whole region.
        assert_eq!(
            place(&tasks, &empty(), &[]),
            Placement::Short(CapacityShortfall {
                needed: 3,
                capacity: 0,
                workers: 0
            })
        );
    }

    #[test]
    fn forward_consumers_follow_their_producers_and_driver_stages_take_no_slot() {
        let mut view = empty();
        view.forward.insert(task(1, 0), task(0, 0));
        view.forward.insert(task(1, 1), task(0, 1));
        view.driver_stages.push(2);
        let tasks = vec![task(0, 0), task(0, 1), task(1, 0), task(1, 1), task(2, 0)];
        let placement = place(&tasks, &view, &slots(&[4, 4], &[4, 4]));
        let Placement::Placed(locations) = placement else {
            panic!("not placed");
        };
        assert_eq!(locations[2], locations[0]);
        assert_eq!(locations[3], locations[1]);
        assert_ne!(locations[0], locations[1]);
        assert_eq!(locations[4], Location::Driver);
    }
}
