//! A task's view of its worker's memory pool when the session set a memory limit of its own.
//!
//! ```text
//!   task's operators ─► TaskMemoryPool (at most `cap` bytes for this task) ─► the worker's pool
//!                                                                 (shared by every task and the store)
//! ```
//!
//! Invariants: every byte a task reserves is reserved in the worker's pool too, so the worker's
//! budget holds whatever the sessions ask for; a reservation that would take the task past its cap
//! fails with `ResourcesExhausted` (so spilling operators spill) and reserves nothing anywhere.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};

/// At most `cap` bytes for one task, drawn from `inner`.
#[derive(Debug)]
pub(crate) struct TaskMemoryPool {
    inner: Arc<dyn MemoryPool>,
    cap: usize,
    used: AtomicUsize,
}

impl TaskMemoryPool {
    pub(crate) fn new(inner: Arc<dyn MemoryPool>, cap: usize) -> Self {
        Self {
            inner,
            cap,
            used: AtomicUsize::new(0),
        }
    }
}

impl fmt::Display for TaskMemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "task pool of {} bytes within {}", self.cap, self.inner)
    }
}

impl MemoryPool for TaskMemoryPool {
    fn name(&self) -> &str {
        "sluice task pool"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        self.inner.register(consumer);
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        self.inner.unregister(consumer);
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.inner.grow(reservation, additional);
        self.used.fetch_add(additional, Ordering::SeqCst);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.inner.shrink(reservation, shrink);
        self.used.fetch_sub(shrink, Ordering::SeqCst);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        let cap = self.cap;
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(additional).filter(|total| *total <= cap)
            })
            .map_err(|used| {
                DataFusionError::ResourcesExhausted(format!(
                    "{} cannot reserve {additional} more bytes: the session's memory limit of \
                     {cap} bytes per task is reached ({used} bytes reserved)",
                    reservation.consumer().name()
                ))
            })?;
        if let Err(e) = self.inner.try_grow(reservation, additional) {
            self.used.fetch_sub(additional, Ordering::SeqCst);
            return Err(e);
        }
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use datafusion::execution::memory_pool::{FairSpillPool, GreedyMemoryPool};

    use super::*;

    #[test]
    fn a_task_is_held_to_its_cap_and_every_byte_counts_in_the_worker_pool() {
        let worker: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(1000));
        let task: Arc<dyn MemoryPool> = Arc::new(TaskMemoryPool::new(Arc::clone(&worker), 300));
        let reservation = MemoryConsumer::new("sort").register(&task);
        reservation.try_grow(200).unwrap();
        assert_eq!((task.reserved(), worker.reserved()), (200, 200));
        let error = reservation.try_grow(101).unwrap_err().to_string();
        assert_eq!(
            error,
            "Resources exhausted: sort cannot reserve 101 more bytes: the session's memory limit \
             of 300 bytes per task is reached (200 bytes reserved)"
        );
        assert_eq!((task.reserved(), worker.reserved()), (200, 200));
        reservation.shrink(150);
        assert_eq!((task.reserved(), worker.reserved()), (50, 50));
        drop(reservation);
        assert_eq!((task.reserved(), worker.reserved()), (0, 0));
    }

    #[test]
    fn a_full_worker_pool_refuses_a_task_below_its_cap_and_the_cap_is_not_charged() {
        let worker: Arc<dyn MemoryPool> = Arc::new(FairSpillPool::new(100));
        let other = MemoryConsumer::new("other").register(&worker);
        other.try_grow(80).unwrap();
        let task: Arc<dyn MemoryPool> = Arc::new(TaskMemoryPool::new(Arc::clone(&worker), 300));
        let reservation = MemoryConsumer::new("join").register(&task);
        let error = reservation.try_grow(50).unwrap_err().to_string();
        assert!(error.starts_with("Resources exhausted"), "{error}");
        assert_eq!((task.reserved(), worker.reserved()), (0, 80));
    }
}
