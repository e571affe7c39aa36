//! Reconciling the driver's view of a worker's attempts with the worker's own, from a heartbeat.
//! Pure code: the actor applies what comes out.
//!
//! ```text
//!   worker heartbeat: known attempts K (running, or final report on its way), RunTasks accepted A
//!   driver: attempts it runs there, each with the acceptance number its RunTask answered (or none
//!           yet: the RunTask is in flight)
//!     placed, answered n <= A, not in K ──► forgotten: the worker never ran it or lost its final
//!                                           report; the attempt fails and its region retries
//!     in K, not run there by the driver ──► orphan: the driver ended it; stop it on the worker
//! ```
//!
//! Invariants: an attempt whose `RunTask` is unanswered, or answered after the heartbeat's snapshot
//! (`n > A`), is never forgotten (the heartbeat may predate it); an attempt the worker still
//! reports about is never forgotten; reconciling twice with the same heartbeat changes nothing more.

use std::collections::HashSet;

use sluice_planner::AttemptKey;

/// What a worker's heartbeat says about its attempts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerBeat {
    /// The attempts it knows: running, or with a final report on its way.
    pub known: Vec<AttemptKey>,
    /// `RunTask`s it accepted up to the moment `known` was read.
    pub accepted: u64,
}

/// What the driver must do after a heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Reconciled {
    /// Attempts the driver runs there that the worker does not know: they failed.
    pub forgotten: Vec<AttemptKey>,
    /// Attempts the worker runs that the driver does not run there: stop them.
    pub orphans: Vec<AttemptKey>,
}

/// Compares the attempts the driver runs on a worker (`running`: each with the acceptance number
/// of its `RunTask`, `None` while unanswered) with what the worker's `beat` says.
pub(crate) fn reconcile(
    running: impl IntoIterator<Item = (AttemptKey, Option<u64>)>,
    beat: &WorkerBeat,
) -> Reconciled {
    let known: HashSet<AttemptKey> = beat.known.iter().copied().collect();
    let mut driver_side = HashSet::new();
    let mut forgotten = Vec::new();
    for (key, accepted) in running {
        driver_side.insert(key);
        if accepted.is_some_and(|n| n <= beat.accepted) && !known.contains(&key) {
            forgotten.push(key);
        }
    }
    let mut orphans: Vec<AttemptKey> = beat
        .known
        .iter()
        .copied()
        .filter(|key| !driver_side.contains(key))
        .collect();
    forgotten.sort();
    orphans.sort();
    orphans.dedup();
    Reconciled { forgotten, orphans }
}

#[cfg(test)]
mod tests {
    use sluice_planner::{JobId, StageId};

    use super::*;

    fn key(partition: usize) -> AttemptKey {
        AttemptKey {
            job: JobId(1),
            stage: StageId(0),
            partition,
            attempt: 0,
        }
    }

    #[test]
    fn an_accepted_attempt_the_worker_does_not_list_is_forgotten() {
        let beat = WorkerBeat {
            known: vec![key(0)],
            accepted: 2,
        };
        let reconciled = reconcile([(key(0), Some(1)), (key(1), Some(2))], &beat);
        assert_eq!(
            reconciled,
            Reconciled {
                forgotten: vec![key(1)],
                orphans: vec![]
            }
        );
    }

    #[test]
    fn an_attempt_accepted_after_the_heartbeat_or_unanswered_is_not_judged() {
        let beat = WorkerBeat {
            known: vec![],
            accepted: 2,
        };
        // Accepted third: the heartbeat was read before it arrived.
        let reconciled = reconcile([(key(0), Some(3)), (key(1), None)], &beat);
        assert_eq!(reconciled, Reconciled::default());
    }

    #[test]
    fn an_attempt_the_worker_runs_but_the_driver_ended_is_an_orphan() {
        let beat = WorkerBeat {
            known: vec![key(4), key(2), key(4)],
            accepted: 9,
        };
        let reconciled = reconcile([(key(2), Some(5))], &beat);
        assert_eq!(
            reconciled,
            Reconciled {
                forgotten: vec![],
                orphans: vec![key(4)]
            }
        );
    }
}
