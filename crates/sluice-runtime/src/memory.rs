//! Views of a memory pool: each task's operators (on a worker: the worker's one pool; a stage
//! placed on the driver: the session's pool), and the stream store's blocking outputs, draw on
//! the pool through a view that measures what they hold (and its peak) and, where there is one,
//! holds them to a cap (the session's memory limit per task; half the pool for blocking outputs).
//!
//! ```text
//!   a task's operators ─► CappedPool (peak; the session's limit, if any) ─┐
//!   blocking outputs   ─► CappedPool (half the pool)                      ─┼─► the worker's pool
//!   pipelined channels ────────────────────────────────────────────────────┘   (FairSpillPool)
//! ```
//!
//! Invariants: every byte reserved through a view is reserved in the worker's pool too, so the
//! worker's budget holds whatever the caps allow; a reservation that would pass the cap fails
//! with `ResourcesExhausted` (so spilling operators spill, and blocking outputs go to files) and
//! reserves nothing anywhere; a view without a cap reports its worker pool's limit.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};
use datafusion::execution::runtime_env::RuntimeEnv;

/// At most `cap` bytes (`usize::MAX`: no cap of its own), drawn from `inner`; `what` names the
/// cap in errors. It remembers the most it ever held.
#[derive(Debug)]
pub(crate) struct CappedPool {
    inner: Arc<dyn MemoryPool>,
    cap: usize,
    what: &'static str,
    used: AtomicUsize,
    /// What the inner pool granted (`used` also counts a request while the inner pool decides).
    held: AtomicUsize,
    peak: AtomicUsize,
}

impl CappedPool {
    pub(crate) fn new(inner: Arc<dyn MemoryPool>, cap: usize, what: &'static str) -> Self {
        Self {
            inner,
            cap,
            what,
            used: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// The most bytes this view held at once.
    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    /// The inner pool granted `additional` more bytes.
    fn granted(&self, additional: usize) {
        let now = self.held.fetch_add(additional, Ordering::SeqCst) + additional;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }
}

/// A task's view of the worker's pool in `runtime`: held to `cap` when its session set a memory
/// limit per task, measuring the task's peak either way. Returns the task's runtime (disk,
/// caches and object stores shared) and the view, to read the peak when the task ends.
pub(crate) fn task_pool(
    runtime: &Arc<RuntimeEnv>,
    cap: Option<usize>,
) -> (Arc<RuntimeEnv>, Arc<CappedPool>) {
    let view = Arc::new(CappedPool::new(
        Arc::clone(&runtime.memory_pool),
        cap.unwrap_or(usize::MAX),
        "the session's memory limit per task",
    ));
    (
        through(runtime, Arc::clone(&view) as Arc<dyn MemoryPool>),
        view,
    )
}

/// `runtime` with its pool seen through a [`CappedPool`] of `cap` bytes (disk, caches and object
/// stores shared).
pub(crate) fn capped(runtime: &Arc<RuntimeEnv>, cap: usize, what: &'static str) -> Arc<RuntimeEnv> {
    let view = CappedPool::new(Arc::clone(&runtime.memory_pool), cap, what);
    through(runtime, Arc::new(view))
}

/// `runtime` with `pool` as its memory pool.
fn through(runtime: &Arc<RuntimeEnv>, pool: Arc<dyn MemoryPool>) -> Arc<RuntimeEnv> {
    Arc::new(RuntimeEnv {
        memory_pool: pool,
        disk_manager: Arc::clone(&runtime.disk_manager),
        cache_manager: Arc::clone(&runtime.cache_manager),
        object_store_registry: Arc::clone(&runtime.object_store_registry),
    })
}

/// The memory pool of blocking outputs in a store over `runtime`: at most half of a limited pool
/// (the rest stays for the operators), or the pool itself when it is unlimited.
pub(crate) fn blocking_outputs_pool(runtime: &Arc<RuntimeEnv>) -> Arc<RuntimeEnv> {
    match runtime.memory_pool.memory_limit() {
        MemoryLimit::Finite(limit) => capped(
            runtime,
            limit / 2,
            "the share of blocking outputs, half the worker's pool",
        ),
        _ => Arc::clone(runtime),
    }
}

impl fmt::Display for CappedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} bytes within {}",
            self.what, self.cap, self.inner
        )
    }
}

impl MemoryPool for CappedPool {
    fn name(&self) -> &str {
        "sluice capped pool"
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
        self.granted(additional);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.inner.shrink(reservation, shrink);
        self.held.fetch_sub(shrink, Ordering::SeqCst);
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
                    "{} cannot reserve {additional} more bytes: {} ({cap} bytes) is reached \
                     ({used} bytes reserved)",
                    reservation.consumer().name(),
                    self.what
                ))
            })?;
        if let Err(e) = self.inner.try_grow(reservation, additional) {
            self.used.fetch_sub(additional, Ordering::SeqCst);
            return Err(e);
        }
        self.granted(additional);
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    fn memory_limit(&self) -> MemoryLimit {
        if self.cap == usize::MAX {
            return self.inner.memory_limit();
        }
        MemoryLimit::Finite(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use datafusion::execution::memory_pool::{FairSpillPool, GreedyMemoryPool};

    use super::*;

    #[test]
    fn a_capped_view_is_held_to_its_cap_and_every_byte_counts_in_the_worker_pool() {
        let worker: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(1000));
        let task: Arc<dyn MemoryPool> = Arc::new(CappedPool::new(
            Arc::clone(&worker),
            300,
            "the session's memory limit per task",
        ));
        let reservation = MemoryConsumer::new("sort").register(&task);
        reservation.try_grow(200).unwrap();
        assert_eq!((task.reserved(), worker.reserved()), (200, 200));
        let error = reservation.try_grow(101).unwrap_err().to_string();
        assert_eq!(
            error,
            "Resources exhausted: sort cannot reserve 101 more bytes: the session's memory limit \
             per task (300 bytes) is reached (200 bytes reserved)"
        );
        assert_eq!((task.reserved(), worker.reserved()), (200, 200));
        reservation.shrink(150);
        assert_eq!((task.reserved(), worker.reserved()), (50, 50));
        drop(reservation);
        assert_eq!((task.reserved(), worker.reserved()), (0, 0));
    }

    #[test]
    fn a_task_view_without_a_cap_measures_its_peak_and_reports_the_worker_limit() {
        let worker = Arc::new(RuntimeEnv {
            memory_pool: Arc::new(GreedyMemoryPool::new(1000)),
            ..RuntimeEnv::default()
        });
        let (runtime, view) = task_pool(&worker, None);
        assert!(matches!(
            runtime.memory_pool.memory_limit(),
            MemoryLimit::Finite(1000)
        ));
        let a = MemoryConsumer::new("a").register(&runtime.memory_pool);
        let b = MemoryConsumer::new("b").register(&runtime.memory_pool);
        a.try_grow(400).unwrap();
        b.grow(300);
        a.shrink(350);
        b.try_grow(100).unwrap();
        // 700 at most (400 + 300), now 450; the worker's pool holds the same.
        assert_eq!((view.peak(), view.reserved()), (700, 450));
        assert_eq!(worker.memory_pool.reserved(), 450);
        let error = a.try_grow(600).unwrap_err().to_string();
        assert!(error.starts_with("Resources exhausted"), "{error}");
        assert_eq!((view.peak(), view.reserved()), (700, 450));
    }

    #[test]
    fn a_full_worker_pool_refuses_a_task_below_its_cap_and_the_cap_is_not_charged() {
        let worker: Arc<dyn MemoryPool> = Arc::new(FairSpillPool::new(100));
        let other = MemoryConsumer::new("other").register(&worker);
        other.try_grow(80).unwrap();
        let task: Arc<dyn MemoryPool> = Arc::new(CappedPool::new(
            Arc::clone(&worker),
            300,
            "the session's memory limit per task",
        ));
        let reservation = MemoryConsumer::new("join").register(&task);
        let error = reservation.try_grow(50).unwrap_err().to_string();
        assert!(error.starts_with("Resources exhausted"), "{error}");
        assert_eq!((task.reserved(), worker.reserved()), (0, 80));
    }
}
