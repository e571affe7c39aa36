//! Named fault points: places in a worker where a test makes a fault happen for real (an error, a
//! panic, a delay, the process exiting), to prove the driver recovers from it with the right rows.
//!
//! ```text
//!   SLUICE_FAILPOINTS="producer_mid_stream=1*panic;flight_fetch=delay(500)"
//!   SLUICE_FAILPOINTS_WORKERS="2"          (default: worker 1)
//!        │ parsed once at the worker's start (an unknown point or action is an error)
//!        ▼
//!   FaultPoints ──(task context extension, worker options)──► fire(point) at the point
//!        error: a retryable transport error │ panic │ delay(ms): async sleep │ exit: process ends
//! ```
//!
//! Invariants: a point fires only in the workers the spec names, at most its count (`N*action`)
//! times across the worker, and logs its name (target `sluice::faults`, warn) each time it fires;
//! a delay never blocks a runtime thread. The environment is read only by worker processes built
//! with the `failpoints` feature; other builds ignore it with one warning. Tests in one process
//! hand [`FaultPoints`] to a worker through its options instead.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use datafusion::common::Result;

use crate::error::transport_error;

/// The variable holding the fault specs of worker processes.
pub const FAILPOINTS_VAR: &str = "SLUICE_FAILPOINTS";
/// The variable naming the worker ids the specs apply to (comma-separated; default `1`).
pub const FAILPOINTS_WORKERS_VAR: &str = "SLUICE_FAILPOINTS_WORKERS";
/// The exit code of a process ended by an `exit` fault.
pub const FAULT_EXIT_CODE: i32 = 86;

/// A place where a fault can be made to happen; see ARCHITECTURE.md for what each one breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// In a task's output writer, once its output holds rows (or at its end if it has none):
    /// its readers have part of its output.
    ProducerMidStream,
    /// Before a task status report is sent (an error drops this sending: the report is resent).
    ReportBeforeSend,
    /// After a task status report reached the driver (an error loses its acknowledgement: the
    /// report is sent again, a duplicate the driver ignores).
    ReportAfterSend,
    /// Before a task reads a stream of another worker over Flight.
    FlightFetch,
    /// Right after a task's output spilled a batch to disk, or at the first input batch its
    /// writer takes after the task's operators (sorts, joins, aggregates) spilled.
    SpillWrite,
    /// Before a heartbeat is sent (an error skips this one).
    Heartbeat,
}

impl FaultPoint {
    /// Every point, in the order documented.
    pub const ALL: [FaultPoint; 6] = [
        FaultPoint::ProducerMidStream,
        FaultPoint::ReportBeforeSend,
        FaultPoint::ReportAfterSend,
        FaultPoint::FlightFetch,
        FaultPoint::SpillWrite,
        FaultPoint::Heartbeat,
    ];

    /// The point's name in specs and logs.
    pub fn name(self) -> &'static str {
        match self {
            FaultPoint::ProducerMidStream => "producer_mid_stream",
            FaultPoint::ReportBeforeSend => "report_before_send",
            FaultPoint::ReportAfterSend => "report_after_send",
            FaultPoint::FlightFetch => "flight_fetch",
            FaultPoint::SpillWrite => "spill_write",
            FaultPoint::Heartbeat => "heartbeat",
        }
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a point does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// The code at the point fails with a retryable transport error.
    Error,
    /// The code at the point panics.
    Panic,
    /// The code at the point waits this long (asynchronously), then goes on.
    Delay(Duration),
    /// The process exits at once with [`FAULT_EXIT_CODE`].
    Exit,
}

impl fmt::Display for FaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultAction::Error => f.write_str("error"),
            FaultAction::Panic => f.write_str("panic"),
            FaultAction::Delay(delay) => write!(f, "delay({})", delay.as_millis()),
            FaultAction::Exit => f.write_str("exit"),
        }
    }
}

/// One point's spec: its action and how many more times it fires.
#[derive(Debug)]
struct Armed {
    point: FaultPoint,
    action: FaultAction,
    remaining: AtomicU64,
    fired: AtomicU64,
}

/// The fault points of one worker; see the module docs.
#[derive(Debug, Default)]
pub struct FaultPoints {
    armed: Vec<Armed>,
    /// The worker ids the points fire in; `None`: every worker holding them.
    workers: Option<Vec<u64>>,
    /// This worker's id at the driver (0 until it registered).
    worker: AtomicU64,
}

impl FromStr for FaultPoints {
    type Err = String;

    /// Parses `name=[N*]action;...` (actions: `error`, `panic`, `exit`, `delay(MS)`; `off` arms
    /// nothing). An unknown point or action, or a malformed count, is an error naming it.
    fn from_str(spec: &str) -> std::result::Result<Self, String> {
        let mut armed = Vec::new();
        for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, action) = item
                .split_once('=')
                .ok_or_else(|| format!("fault spec '{item}' is not name=action"))?;
            let name = name.trim();
            let point = FaultPoint::ALL
                .into_iter()
                .find(|point| point.name() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = FaultPoint::ALL.iter().map(|p| p.name()).collect();
                    format!("unknown fault point '{name}' (known: {})", known.join(", "))
                })?;
            let action = action.trim();
            let (count, action) = match action.split_once('*') {
                Some((count, action)) => {
                    let count: u64 = count.trim().parse().map_err(|_| {
                        format!("fault point {name}: '{count}' is not a count (as in 1*panic)")
                    })?;
                    (count, action.trim())
                }
                None => (u64::MAX, action),
            };
            let action = match action {
                "off" => continue,
                "error" => FaultAction::Error,
                "panic" => FaultAction::Panic,
                "exit" => FaultAction::Exit,
                delay if delay.starts_with("delay(") && delay.ends_with(')') => {
                    let millis = &delay["delay(".len()..delay.len() - 1];
                    let millis: u64 = millis.trim().parse().map_err(|_| {
                        format!("fault point {name}: '{delay}' needs milliseconds, as delay(500)")
                    })?;
                    FaultAction::Delay(Duration::from_millis(millis))
                }
                other => {
                    return Err(format!(
                        "fault point {name}: unknown action '{other}' (known: error, panic, \
                         exit, delay(MS), off)"
                    ));
                }
            };
            armed.push(Armed {
                point,
                action,
                remaining: AtomicU64::new(count),
                fired: AtomicU64::new(0),
            });
        }
        Ok(Self {
            armed,
            workers: None,
            worker: AtomicU64::new(0),
        })
    }
}

impl FaultPoints {
    /// `spec` (see [`FromStr`]) for the worker ids in `workers` (comma-separated; empty: worker 1).
    pub fn parse_for_workers(spec: &str, workers: &str) -> std::result::Result<Self, String> {
        let mut points: FaultPoints = spec.parse()?;
        let ids = workers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|id| {
                id.parse::<u64>().map_err(|_| {
                    format!("{FAILPOINTS_WORKERS_VAR}: '{id}' is not a worker id (as in 1,3)")
                })
            })
            .collect::<std::result::Result<Vec<u64>, String>>()?;
        points.workers = Some(if ids.is_empty() { vec![1] } else { ids });
        Ok(points)
    }

    /// The fault points of a worker process: [`FAILPOINTS_VAR`] and [`FAILPOINTS_WORKERS_VAR`]
    /// with the `failpoints` feature, else none (a set variable gets one warning).
    pub fn from_env() -> std::result::Result<Option<Self>, String> {
        let Ok(spec) = std::env::var(FAILPOINTS_VAR) else {
            return Ok(None);
        };
        if cfg!(feature = "failpoints") {
            let workers = std::env::var(FAILPOINTS_WORKERS_VAR).unwrap_or_default();
            Self::parse_for_workers(&spec, &workers).map(Some)
        } else {
            tracing::warn!(
                target: "sluice::faults",
                "{FAILPOINTS_VAR} is set but this build has no fault points (the failpoints \
                 feature); ignored"
            );
            Ok(None)
        }
    }

    /// Whether any point is armed.
    pub fn is_empty(&self) -> bool {
        self.armed.is_empty()
    }

    /// This worker's id at the driver: the points fire only if the spec names it.
    pub fn set_worker(&self, id: u64) {
        self.worker.store(id, Ordering::Relaxed);
    }

    /// Whether `point` may still fire here (armed, with firings left).
    pub fn is_armed(&self, point: FaultPoint) -> bool {
        self.armed
            .iter()
            .any(|armed| armed.point == point && armed.remaining.load(Ordering::SeqCst) > 0)
    }

    /// How often `point` fired here.
    pub fn fired(&self, point: FaultPoint) -> u64 {
        self.armed
            .iter()
            .filter(|armed| armed.point == point)
            .map(|armed| armed.fired.load(Ordering::Relaxed))
            .sum()
    }

    /// Fires `point` if it is armed here and has firings left: an error, a panic, a delay or the
    /// process's exit. `Ok(())` when nothing fired (or after a delay).
    pub async fn fire(&self, point: FaultPoint) -> Result<()> {
        let Some(armed) = self.armed.iter().find(|armed| armed.point == point) else {
            return Ok(());
        };
        if let Some(workers) = &self.workers
            && !workers.contains(&self.worker.load(Ordering::Relaxed))
        {
            return Ok(());
        }
        let claimed = armed
            .remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok();
        if !claimed {
            return Ok(());
        }
        armed.fired.fetch_add(1, Ordering::Relaxed);
        let worker = self.worker.load(Ordering::Relaxed);
        tracing::warn!(
            target: "sluice::faults",
            point = point.name(),
            action = %armed.action,
            worker,
            "fault point {point} fired ({}) in worker {worker}",
            armed.action
        );
        match armed.action {
            FaultAction::Error => Err(transport_error(format!(
                "fault point {point} fired in worker {worker}"
            ))),
            FaultAction::Panic => fault_panic(point, worker),
            FaultAction::Delay(delay) => {
                tokio::time::sleep(delay).await;
                Ok(())
            }
            FaultAction::Exit => std::process::exit(FAULT_EXIT_CODE),
        }
    }
}

/// The `panic` action: a real panic, as a bug in an operator would raise.
#[allow(clippy::panic)]
fn fault_panic(point: FaultPoint, worker: u64) -> ! {
    panic!("fault point {point} fired in worker {worker}: panic")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn specs_parse_with_counts_and_unknown_names_are_errors() {
        let points: FaultPoints = "producer_mid_stream=2*delay(5); ".parse().unwrap();
        assert_eq!(points.armed.len(), 1);
        assert_eq!(
            points.armed[0].action,
            FaultAction::Delay(Duration::from_millis(5))
        );
        assert_eq!(points.armed[0].remaining.load(Ordering::Relaxed), 2);
        assert!(
            "producer_mid_stream=off"
                .parse::<FaultPoints>()
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            "nowhere=panic".parse::<FaultPoints>().unwrap_err(),
            "unknown fault point 'nowhere' (known: producer_mid_stream, report_before_send, \
             report_after_send, flight_fetch, spill_write, heartbeat)"
        );
        assert_eq!(
            "producer_mid_stream=explode"
                .parse::<FaultPoints>()
                .unwrap_err(),
            "fault point producer_mid_stream: unknown action 'explode' (known: error, panic, \
             exit, delay(MS), off)"
        );
        assert_eq!(
            "producer_mid_stream=x*error"
                .parse::<FaultPoints>()
                .unwrap_err(),
            "fault point producer_mid_stream: 'x' is not a count (as in 1*panic)"
        );
        assert_eq!(
            FaultPoints::parse_for_workers("producer_mid_stream=error", "1,z").unwrap_err(),
            "SLUICE_FAILPOINTS_WORKERS: 'z' is not a worker id (as in 1,3)"
        );
    }

    #[tokio::test]
    async fn a_point_fires_its_count_only_in_the_workers_named() {
        let points = FaultPoints::parse_for_workers("producer_mid_stream=2*error", "").unwrap();
        // Worker 2 is not named (the default is worker 1): nothing fires.
        points.set_worker(2);
        assert!(points.fire(FaultPoint::ProducerMidStream).await.is_ok());
        assert_eq!(points.fired(FaultPoint::ProducerMidStream), 0);
        points.set_worker(1);
        for _ in 0..2 {
            let error = points
                .fire(FaultPoint::ProducerMidStream)
                .await
                .unwrap_err();
            assert_eq!(
                error.to_string(),
                "External error: fault point producer_mid_stream fired in worker 1"
            );
            assert_eq!(
                crate::error::ErrorKind::of(&error),
                crate::error::ErrorKind::Transport
            );
        }
        assert!(points.fire(FaultPoint::ProducerMidStream).await.is_ok());
        assert_eq!(points.fired(FaultPoint::ProducerMidStream), 2);
    }

    #[tokio::test]
    async fn a_panic_action_panics_with_the_points_name() {
        let points: FaultPoints = "producer_mid_stream=1*panic".parse().unwrap();
        let fired = datafusion::common::runtime::SpawnedTask::spawn(async move {
            points.fire(FaultPoint::ProducerMidStream).await
        });
        let panic = fired.join().await.unwrap_err().into_panic();
        assert_eq!(
            panic.downcast_ref::<String>().map(String::as_str),
            Some("fault point producer_mid_stream fired in worker 0: panic")
        );
    }
}
