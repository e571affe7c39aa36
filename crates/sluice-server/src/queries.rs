//! Statements between planning and fetching: `GetFlightInfo` plans a statement and files it under a
//! handle; `DoGet` with that handle's ticket takes it out and runs it, listed as running until its
//! stream is dropped, so that `CancelFlightInfo` can end it (or drop it before it runs). Prepared
//! statements stay until closed, with the parameters last bound to them.
//!
//! Invariants:
//! - A cancel is honoured only for the session that owns the statement.
//! - A handle is used by the session that made it, and a planned statement is run at most once.
//! - Planned statements nobody fetched are dropped after [`PENDING_TTL`] (checked whenever one is
//!   filed), so abandoned `GetFlightInfo` calls do not pile up.
//! - A session holds at most [`PreparedLimits::per_session`] prepared statements; one unused for
//!   [`PreparedLimits::idle`] is closed ([`Queries::expire_prepared`], which the endpoint runs
//!   periodically, and before each new one is opened).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use datafusion::common::ScalarValue;
use sluice_engine::{PlannedStatement, SluiceSession};
use tokio::sync::watch;
use tonic::Status;

use crate::admission::AdmissionTicket;
use crate::sessions::SessionKey;
use sluice_runtime::JobRunner;

/// How long a planned statement waits for its `DoGet`.
pub const PENDING_TTL: Duration = Duration::from_secs(600);

/// The handle of a planned or prepared statement, as it travels in tickets: a sequence number (for
/// messages) and 64 random bits, so that a handle cannot be guessed from another one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QueryHandle {
    /// The statement's number on this server.
    pub number: u64,
    nonce: u64,
}

impl QueryHandle {
    /// The bytes put in tickets and prepared-statement handles.
    pub fn to_bytes(self) -> Vec<u8> {
        format!("sluice-query-{}-{:016x}", self.number, self.nonce).into_bytes()
    }

    /// The handle `bytes` carry.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Status> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.strip_prefix("sluice-query-"))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(number, nonce)| {
                Some(Self {
                    number: number.parse().ok()?,
                    nonce: u64::from_str_radix(nonce, 16).ok()?,
                })
            })
            .ok_or_else(|| Status::invalid_argument("not a statement handle of this server"))
    }
}

impl std::fmt::Display for QueryHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "statement {}", self.number)
    }
}

struct Pending {
    owner: SessionKey,
    session: Arc<SluiceSession>,
    planned: PlannedStatement,
    sql: String,
    filed: Instant,
}

/// A statement taken out of the pending ones by its `DoGet`.
pub struct Taken {
    /// The session that planned it.
    pub session: Arc<SluiceSession>,
    /// Its plan.
    pub planned: PlannedStatement,
    /// Its SQL text.
    pub sql: String,
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken")
            .field("sql", &self.sql)
            .finish_non_exhaustive()
    }
}

/// Where a statement is in its life, as `PollFlightInfo` reports it.
#[derive(Clone)]
pub enum Phase {
    /// Planned; its `DoGet` has not come yet.
    Planned,
    /// Fetched: waiting for a slot or running.
    Running {
        /// Its place in the admission queue.
        ticket: AdmissionTicket,
        /// The runner its job runs on (for the job's progress).
        runner: Arc<dyn JobRunner>,
    },
    /// Its result stream ended (finished, failed or cancelled).
    Finished,
}

/// A prepared statement: its SQL and the parameters bound last.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The statement's text.
    pub sql: String,
    /// Values for `$1`, `$2`, … (empty until bound).
    pub parameters: Vec<ScalarValue>,
}

struct PreparedEntry {
    owner: SessionKey,
    prepared: Prepared,
    last_used: Instant,
}

/// How many prepared statements a session may hold, and for how long unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedLimits {
    /// Open prepared statements per session.
    pub per_session: usize,
    /// How long one may go unused before it is closed.
    pub idle: Duration,
}

impl Default for PreparedLimits {
    fn default() -> Self {
        let limits = crate::limits::ServerLimits::default();
        Self {
            per_session: limits.prepared_per_session,
            idle: limits.prepared_idle,
        }
    }
}

/// Planned statements waiting for their `DoGet`, and open prepared statements.
#[derive(Default)]
pub struct Queries {
    next: AtomicU64,
    pending: Mutex<HashMap<QueryHandle, Pending>>,
    prepared: Mutex<HashMap<QueryHandle, PreparedEntry>>,
    prepared_limits: PreparedLimits,
    running: Arc<Mutex<HashMap<QueryHandle, RunningEntry>>>,
    finished: Arc<Mutex<Finished>>,
}

/// Statements whose stream ended, remembered for [`PENDING_TTL`] (oldest first, so forgetting
/// costs only the expired ones).
#[derive(Default)]
struct Finished {
    owners: HashMap<QueryHandle, SessionKey>,
    order: std::collections::VecDeque<(Instant, QueryHandle)>,
}

impl Finished {
    fn remember(&mut self, handle: QueryHandle, owner: SessionKey) {
        while let Some((at, old)) = self.order.front().copied() {
            if at.elapsed() < PENDING_TTL {
                break;
            }
            self.order.pop_front();
            self.owners.remove(&old);
        }
        self.owners.insert(handle, owner);
        self.order.push_back((Instant::now(), handle));
    }
}

struct RunningEntry {
    owner: SessionKey,
    cancel: watch::Sender<bool>,
    ticket: AdmissionTicket,
    runner: Arc<dyn JobRunner>,
}

/// What [`Queries::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// The statement had not started: it never will.
    BeforeItRan,
    /// The statement was running: its stream ends now, and its job with it.
    WhileRunning,
}

/// A statement listed as running; dropping it (with its stream) unlists it.
pub struct Running {
    handle: QueryHandle,
    cancelled: watch::Receiver<bool>,
    running: Arc<Mutex<HashMap<QueryHandle, RunningEntry>>>,
    finished: Arc<Mutex<Finished>>,
}

impl Running {
    /// Resolves when the statement is cancelled; it holds the listing until then or until dropped.
    pub async fn cancelled(mut self) {
        if self
            .cancelled
            .wait_for(|cancelled| *cancelled)
            .await
            .is_err()
        {
            futures::future::pending::<()>().await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Finished before unlisted (lock order: finished, then running), so a poll never finds
        // the statement in neither.
        let mut finished = lock(&self.finished);
        let Some(entry) = lock(&self.running).remove(&self.handle) else {
            return;
        };
        finished.remember(self.handle, entry.owner);
    }
}

impl std::fmt::Debug for Queries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queries")
            .field("pending", &self.pending_count())
            .field("prepared", &lock(&self.prepared).len())
            .finish()
    }
}

impl Queries {
    /// Files `planned` for `owner`; the handle fetches it once.
    pub fn file(
        &self,
        owner: SessionKey,
        session: Arc<SluiceSession>,
        planned: PlannedStatement,
        sql: String,
    ) -> QueryHandle {
        let handle = self.next_handle();
        let mut pending = lock(&self.pending);
        pending.retain(|_, entry| entry.filed.elapsed() < PENDING_TTL);
        pending.insert(
            handle,
            Pending {
                owner,
                session,
                planned,
                sql,
                filed: Instant::now(),
            },
        );
        handle
    }

    /// Takes the statement filed under `handle` by `owner`.
    pub fn take(&self, handle: QueryHandle, owner: &SessionKey) -> Result<Taken, Status> {
        Self::take_from(&mut lock(&self.pending), handle, owner)
    }

    fn take_from(
        pending: &mut HashMap<QueryHandle, Pending>,
        handle: QueryHandle,
        owner: &SessionKey,
    ) -> Result<Taken, Status> {
        match pending.get(&handle) {
            Some(entry) if &entry.owner == owner => {}
            Some(_) => {
                return Err(Status::permission_denied(format!(
                    "{handle} belongs to another session"
                )));
            }
            None => {
                return Err(Status::not_found(format!(
                    "{handle} is unknown, already fetched or expired: call GetFlightInfo again"
                )));
            }
        }
        let entry = pending
            .remove(&handle)
            .ok_or_else(|| Status::internal("lost a statement"))?;
        Ok(Taken {
            session: entry.session,
            planned: entry.planned,
            sql: entry.sql,
        })
    }

    /// Takes the statement filed under `handle` by `owner` and lists it as running, admitted
    /// under `ticket` (one step, so a poll never finds it in neither list).
    pub fn take_and_start(
        &self,
        handle: QueryHandle,
        owner: &SessionKey,
        ticket: AdmissionTicket,
    ) -> Result<(Taken, Running), Status> {
        let mut pending = lock(&self.pending);
        let taken = Self::take_from(&mut pending, handle, owner)?;
        let running = self.start(
            handle,
            owner.clone(),
            ticket,
            taken.session.runner().clone(),
        );
        drop(pending);
        Ok((taken, running))
    }

    /// Lists the statement `handle`, just taken by `owner`, as running: admitted under `ticket`,
    /// its job on `runner`.
    fn start(
        &self,
        handle: QueryHandle,
        owner: SessionKey,
        ticket: AdmissionTicket,
        runner: Arc<dyn JobRunner>,
    ) -> Running {
        let (cancel, cancelled) = watch::channel(false);
        let entry = RunningEntry {
            owner,
            cancel,
            ticket,
            runner,
        };
        lock(&self.running).insert(handle, entry);
        Running {
            handle,
            cancelled,
            running: self.running.clone(),
            finished: self.finished.clone(),
        }
    }

    /// Where the statement `handle` of `owner` is: planned, running or finished (remembered for
    /// [`PENDING_TTL`] after it ended).
    pub fn phase(&self, handle: QueryHandle, owner: &SessionKey) -> Result<Phase, Status> {
        let stranger = || Status::permission_denied(format!("{handle} belongs to another session"));
        if let Some(entry) = lock(&self.pending).get(&handle) {
            return if &entry.owner == owner {
                Ok(Phase::Planned)
            } else {
                Err(stranger())
            };
        }
        if let Some(entry) = lock(&self.running).get(&handle) {
            return if &entry.owner == owner {
                Ok(Phase::Running {
                    ticket: entry.ticket,
                    runner: entry.runner.clone(),
                })
            } else {
                Err(stranger())
            };
        }
        match lock(&self.finished).owners.get(&handle) {
            Some(finisher) if finisher == owner => Ok(Phase::Finished),
            Some(_) => Err(stranger()),
            None => Err(Status::not_found(format!(
                "{handle} is unknown or expired (statements are kept {} minutes)",
                PENDING_TTL.as_secs() / 60
            ))),
        }
    }

    /// Cancels the statement `handle` of `owner`: drops it if it has not run, ends it if it runs.
    pub fn cancel(&self, handle: QueryHandle, owner: &SessionKey) -> Result<Cancelled, Status> {
        let stranger = || Status::permission_denied(format!("{handle} belongs to another session"));
        {
            let mut pending = lock(&self.pending);
            if let Some(entry) = pending.get(&handle) {
                if &entry.owner != owner {
                    return Err(stranger());
                }
                pending.remove(&handle);
                lock(&self.finished).remember(handle, owner.clone());
                return Ok(Cancelled::BeforeItRan);
            }
        }
        let running = lock(&self.running);
        match running.get(&handle) {
            Some(entry) if &entry.owner == owner => {
                entry.cancel.send_replace(true);
                Ok(Cancelled::WhileRunning)
            }
            Some(_) => Err(stranger()),
            None => Err(Status::not_found(format!(
                "{handle} is unknown or already finished"
            ))),
        }
    }

    /// Statements running now (their stream not dropped yet).
    pub fn running_count(&self) -> usize {
        lock(&self.running).len()
    }

    /// Statements planned and not fetched yet.
    pub fn pending_count(&self) -> usize {
        lock(&self.pending).len()
    }

    /// Queries whose sessions hold prepared statements within `limits`.
    pub fn with_prepared_limits(limits: PreparedLimits) -> Self {
        Self {
            prepared_limits: limits,
            ..Self::default()
        }
    }

    /// The prepared statements' limits.
    pub fn prepared_limits(&self) -> PreparedLimits {
        self.prepared_limits
    }

    /// Opens a prepared statement; a session that holds its limit of them gets
    /// `ResourceExhausted`.
    pub fn prepare(&self, owner: SessionKey, sql: String) -> Result<QueryHandle, Status> {
        self.expire_prepared();
        let mut prepared = lock(&self.prepared);
        let held = prepared
            .values()
            .filter(|entry| entry.owner == owner)
            .count();
        let limits = self.prepared_limits;
        if held >= limits.per_session {
            return Err(Status::resource_exhausted(format!(
                "this session holds {held} prepared statements, the most one may \
                 (max_prepared_statements): close one (one unused for {} s is closed)",
                limits.idle.as_secs()
            )));
        }
        let handle = self.next_handle();
        prepared.insert(
            handle,
            PreparedEntry {
                owner,
                prepared: Prepared {
                    sql,
                    parameters: Vec::new(),
                },
                last_used: Instant::now(),
            },
        );
        Ok(handle)
    }

    /// Closes every prepared statement unused for the idle limit; how many it closed.
    pub fn expire_prepared(&self) -> usize {
        let idle = self.prepared_limits.idle;
        let mut prepared = lock(&self.prepared);
        let before = prepared.len();
        prepared.retain(|_, entry| entry.last_used.elapsed() < idle);
        before - prepared.len()
    }

    /// Prepared statements open now.
    pub fn prepared_count(&self) -> usize {
        lock(&self.prepared).len()
    }

    /// The prepared statement `handle` of `owner`.
    pub fn prepared(&self, handle: QueryHandle, owner: &SessionKey) -> Result<Prepared, Status> {
        let mut prepared = lock(&self.prepared);
        owned(prepared.get(&handle), handle, owner)?;
        match prepared.get_mut(&handle) {
            Some(entry) => {
                entry.last_used = Instant::now();
                Ok(entry.prepared.clone())
            }
            None => Err(Status::not_found(format!(
                "prepared {handle} is unknown or closed"
            ))),
        }
    }

    /// Binds `parameters` to prepared statement `handle`.
    pub fn bind(
        &self,
        handle: QueryHandle,
        owner: &SessionKey,
        parameters: Vec<ScalarValue>,
    ) -> Result<(), Status> {
        let mut prepared = lock(&self.prepared);
        owned(prepared.get(&handle), handle, owner)?;
        if let Some(entry) = prepared.get_mut(&handle) {
            entry.prepared.parameters = parameters;
            entry.last_used = Instant::now();
        }
        Ok(())
    }

    /// Closes prepared statement `handle`.
    pub fn close(&self, handle: QueryHandle, owner: &SessionKey) -> Result<(), Status> {
        let mut prepared = lock(&self.prepared);
        owned(prepared.get(&handle), handle, owner)?;
        prepared.remove(&handle);
        Ok(())
    }

    fn next_handle(&self) -> QueryHandle {
        let mut nonce = [0u8; 8];
        // Without randomness the handle is still unique (its number); it is only guessable.
        let _ = getrandom::fill(&mut nonce);
        QueryHandle {
            number: self.next.fetch_add(1, Ordering::Relaxed) + 1,
            nonce: u64::from_le_bytes(nonce),
        }
    }
}

fn owned<'a>(
    entry: Option<&'a PreparedEntry>,
    handle: QueryHandle,
    owner: &SessionKey,
) -> Result<&'a PreparedEntry, Status> {
    match entry {
        Some(entry) if &entry.owner == owner => Ok(entry),
        Some(_) => Err(Status::permission_denied(format!(
            "prepared {handle} belongs to another session"
        ))),
        None => Err(Status::not_found(format!(
            "prepared {handle} is unknown or closed"
        ))),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use sluice_engine::SluiceConfig;

    use super::*;
    use crate::sessions::SessionId;

    fn local_session() -> Arc<SluiceSession> {
        let config = SluiceConfig::default();
        Arc::new(SluiceSession::new(&config, Arc::new(sluice_runtime::LocalRunner)).unwrap())
    }

    async fn planned(session: &SluiceSession) -> PlannedStatement {
        let statement = session.parse_sql("select 1").unwrap().remove(0);
        session.plan(statement).await.unwrap()
    }

    #[tokio::test]
    async fn a_filed_statement_is_taken_once_and_only_by_its_session() {
        let session = local_session();
        let queries = Queries::default();
        let owner = SessionKey::Opened(SessionId(1));
        let handle = queries.file(
            owner.clone(),
            session.clone(),
            planned(&session).await,
            "select 1".into(),
        );
        assert_eq!(QueryHandle::from_bytes(&handle.to_bytes()).unwrap(), handle);
        let stranger = queries.take(handle, &SessionKey::Anonymous).unwrap_err();
        assert_eq!(stranger.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            queries
                .take(handle, &owner)
                .unwrap()
                .planned
                .schema()
                .fields()
                .len(),
            1
        );
        let again = queries.take(handle, &owner).unwrap_err();
        assert_eq!(again.code(), tonic::Code::NotFound);
        assert_eq!(queries.pending_count(), 0);
    }

    #[tokio::test]
    async fn a_cancel_drops_a_waiting_statement_and_ends_a_running_one_of_its_session_only() {
        let session = local_session();
        let queries = Queries::default();
        let owner = SessionKey::Opened(SessionId(1));
        let waiting = queries.file(
            owner.clone(),
            session.clone(),
            planned(&session).await,
            "select 1".into(),
        );
        assert_eq!(
            queries
                .cancel(waiting, &SessionKey::Anonymous)
                .unwrap_err()
                .code(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            queries.cancel(waiting, &owner).unwrap(),
            Cancelled::BeforeItRan
        );
        assert!(
            matches!(queries.phase(waiting, &owner), Ok(Phase::Finished)),
            "a statement cancelled before it ran is finished"
        );
        assert_eq!(
            queries.take(waiting, &owner).unwrap_err().code(),
            tonic::Code::NotFound
        );

        let handle = queries.file(
            owner.clone(),
            session.clone(),
            planned(&session).await,
            "select 1".into(),
        );
        let (_, running) = queries
            .take_and_start(handle, &owner, AdmissionTicket::default())
            .unwrap();
        assert_eq!(queries.running_count(), 1);
        assert_eq!(
            queries
                .cancel(handle, &SessionKey::Anonymous)
                .unwrap_err()
                .code(),
            tonic::Code::PermissionDenied
        );
        let signal = datafusion::common::runtime::SpawnedTask::spawn(running.cancelled());
        assert_eq!(
            queries.cancel(handle, &owner).unwrap(),
            Cancelled::WhileRunning
        );
        tokio::time::timeout(std::time::Duration::from_secs(5), signal.join())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            queries.running_count(),
            0,
            "a finished statement is unlisted"
        );
        assert_eq!(
            queries.cancel(handle, &owner).unwrap_err().code(),
            tonic::Code::NotFound
        );
    }

    #[tokio::test]
    async fn a_statement_is_planned_then_running_then_finished_for_its_session_only() {
        let session = local_session();
        let queries = Queries::default();
        let owner = SessionKey::Opened(SessionId(1));
        let stranger = SessionKey::Opened(SessionId(2));
        let phase = |handle, key: &SessionKey| match queries.phase(handle, key) {
            Ok(Phase::Planned) => "planned".to_string(),
            Ok(Phase::Running { .. }) => "running".to_string(),
            Ok(Phase::Finished) => "finished".to_string(),
            Err(status) => format!("{:?}", status.code()),
        };
        let handle = queries.file(
            owner.clone(),
            session.clone(),
            planned(&session).await,
            "select 1".into(),
        );
        assert_eq!(phase(handle, &owner), "planned");
        assert_eq!(phase(handle, &stranger), "PermissionDenied");
        let (taken, running) = queries
            .take_and_start(handle, &owner, AdmissionTicket::default())
            .unwrap();
        assert_eq!(taken.sql, "select 1");
        assert_eq!(phase(handle, &owner), "running");
        assert_eq!(phase(handle, &stranger), "PermissionDenied");
        drop(running);
        assert_eq!(phase(handle, &owner), "finished");
        assert_eq!(phase(handle, &stranger), "PermissionDenied");
        let never = queries.prepare(owner.clone(), "select 2".into()).unwrap();
        assert_eq!(phase(never, &owner), "NotFound");
    }

    #[test]
    fn prepared_statements_keep_their_parameters_until_closed() {
        let queries = Queries::default();
        let owner = SessionKey::Anonymous;
        let handle = queries.prepare(owner.clone(), "select $1".into()).unwrap();
        queries
            .bind(handle, &owner, vec![ScalarValue::Int64(Some(7))])
            .unwrap();
        assert_eq!(
            queries.prepared(handle, &owner).unwrap().parameters,
            vec![ScalarValue::Int64(Some(7))]
        );
        let stranger = SessionKey::Opened(SessionId(3));
        assert_eq!(
            queries.close(handle, &stranger).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        queries.close(handle, &owner).unwrap();
        assert_eq!(
            queries.prepared(handle, &owner).unwrap_err().code(),
            tonic::Code::NotFound
        );
        assert_eq!(
            QueryHandle::from_bytes(b"nonsense").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }

    #[test]
    fn a_session_holds_its_limit_of_prepared_statements_and_unused_ones_expire() {
        let queries = Queries::with_prepared_limits(PreparedLimits {
            per_session: 3,
            idle: Duration::from_secs(1),
        });
        let (ann, bob) = (
            SessionKey::Opened(crate::sessions::SessionId(1)),
            SessionKey::Opened(crate::sessions::SessionId(2)),
        );
        let kept = queries.prepare(ann.clone(), "select 1".into()).unwrap();
        for _ in 0..2 {
            queries.prepare(ann.clone(), "select 1".into()).unwrap();
        }
        let refused = queries.prepare(ann.clone(), "select 1".into()).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            refused.message(),
            "this session holds 3 prepared statements, the most one may \
             (max_prepared_statements): close one (one unused for 1 s is closed)"
        );
        // Another session has its own allowance.
        queries.prepare(bob.clone(), "select 1".into()).unwrap();
        assert_eq!(queries.prepared_count(), 4);
        std::thread::sleep(Duration::from_millis(600));
        // Using one keeps it open.
        queries.prepared(kept, &ann).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(queries.expire_prepared(), 3);
        assert_eq!(queries.prepared_count(), 1);
        queries.prepared(kept, &ann).unwrap();
    }
}
