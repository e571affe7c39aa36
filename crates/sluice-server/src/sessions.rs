//! The server's sessions: each client that authenticates gets a [`SluiceSession`] of its own, forked
//! from the server's base session (its tables, runner and memory pool), so what it creates or sets
//! stays its own. Without user accounts, any user name opens a session and requests that carry no
//! token share one anonymous session; with accounts (`--users`), a handshake needs a valid user and
//! password and every other call needs its token.
//!
//! Invariants:
//! - A token is `s<id>.<secret>`: the id finds the session, the 128-bit random secret is compared in
//!   constant time, so neither a guessed id nor timing reveals another session.
//! - Flight SQL has no "logout": a session unused for [`SESSION_IDLE_TTL`] is dropped (checked
//!   whenever a session opens); its token is then refused like an unknown one.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_engine::access::{Access, Role, Roots};
use sluice_engine::{Result, SluiceError, SluiceSession};
use subtle::ConstantTimeEq;
use tokio::time::Instant;
use tonic::{Request, Status};

use crate::admission::Admission;
use crate::limits::ServerLimits;
use crate::login_limit::{LoginLimiter, LoginLimits};
use crate::users::Users;

/// Makes the session of each new client.
#[derive(Debug)]
pub struct SessionFactory {
    base: SluiceSession,
}

impl SessionFactory {
    /// Sessions forked from `base` (its tables, settings, runner and memory pool).
    pub fn new(base: SluiceSession) -> Self {
        Self { base }
    }

    /// A new session.
    pub async fn open(&self) -> Result<SluiceSession> {
        self.base.fork().await
    }

    /// The base session (tables registered at start).
    pub fn base(&self) -> &SluiceSession {
        &self.base
    }
}

/// Which session a request belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SessionKey {
    /// The shared session of requests without a token.
    Anonymous,
    /// A session opened by a handshake.
    Opened(SessionId),
}

/// A session's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "session {}", self.0)
    }
}

/// Password hashes (PBKDF2) the Flight SQL door runs at once: enough for logins to go on while
/// one is hashed, few enough that a burst of them leaves the cores to the queries.
pub const HASHING_PERMITS: usize = 2;

/// How long a session may go unused before it is dropped.
pub const SESSION_IDLE_TTL: Duration = Duration::from_secs(3600);

struct Opened {
    secret: String,
    user: String,
    session: Arc<SluiceSession>,
    last_used: Instant,
}

/// Every session of the server.
pub struct Sessions {
    factory: SessionFactory,
    users: Option<Arc<Users>>,
    /// Where non-admin users may read and write.
    roots: Arc<Roots>,
    /// The bounds on what clients make the server hold.
    limits: ServerLimits,
    /// Failed logins, per user name and address.
    logins: Arc<LoginLimiter>,
    /// Password hashes that may run at once.
    hashing: tokio::sync::Semaphore,
    idle_ttl: Duration,
    anonymous: Arc<SluiceSession>,
    next: AtomicU64,
    opened: Mutex<HashMap<SessionId, Opened>>,
    /// Postgres connections open now (each holds a session of its own, outside `opened`).
    postgres_connections: Arc<AtomicUsize>,
    /// The limit on statements running at once, and the queue beyond it.
    admission: Arc<Admission>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("opened", &self.len())
            .finish_non_exhaustive()
    }
}

impl Sessions {
    /// The sessions of a server whose clients fork `factory`'s base session.
    pub async fn new(factory: SessionFactory) -> Result<Self> {
        Self::with_users(factory, None).await
    }

    /// The sessions of a server whose clients log in as one of `users` (`None`: anyone, no password).
    pub async fn with_users(factory: SessionFactory, users: Option<Users>) -> Result<Self> {
        let anonymous = Arc::new(factory.open().await?);
        Ok(Self {
            factory,
            users: users.map(Arc::new),
            roots: Arc::new(Roots::default()),
            limits: ServerLimits::default(),
            logins: Arc::new(LoginLimiter::default()),
            hashing: tokio::sync::Semaphore::new(HASHING_PERMITS),
            idle_ttl: SESSION_IDLE_TTL,
            anonymous,
            next: AtomicU64::new(1),
            opened: Mutex::new(HashMap::new()),
            postgres_connections: Arc::new(AtomicUsize::new(0)),
            admission: Arc::new(Admission::default()),
        })
    }

    /// The same sessions with at most `limit` statements running at once (`None`: no limit).
    pub fn with_max_concurrent_jobs(mut self, limit: Option<usize>) -> Self {
        self.admission = Arc::new(Admission::new(limit));
        self
    }

    /// The same sessions with `roots` as the read and write roots of non-admin users.
    pub fn with_roots(mut self, roots: Roots) -> Self {
        self.roots = Arc::new(roots);
        self
    }

    /// The same sessions with other bounds on what clients make the server hold.
    pub fn with_limits(mut self, limits: ServerLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The bounds on what clients make the server hold.
    pub fn limits(&self) -> &ServerLimits {
        &self.limits
    }

    /// The roots of non-admin users.
    pub fn roots(&self) -> &Roots {
        &self.roots
    }

    /// What a session of `user` may do: `None` (everything) on a server without accounts, else
    /// the user's role under the server's roots (an unknown user: a reader).
    pub fn access_of(&self, user: &str) -> Option<Arc<Access>> {
        let users = self.users.as_ref()?;
        let role = users.role(user).unwrap_or(Role::Reader);
        Some(Arc::new(Access::new(user, role, Arc::clone(&self.roots))))
    }

    /// The same sessions with other limits on failed logins.
    pub fn with_login_limits(mut self, limits: LoginLimits) -> Self {
        self.logins = Arc::new(LoginLimiter::new(limits));
        self
    }

    /// Where statements wait for a slot.
    pub fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// The same sessions with another idle time-out (tests).
    pub fn with_idle_ttl(mut self, idle_ttl: Duration) -> Self {
        self.idle_ttl = idle_ttl;
        self
    }

    /// Whether calls must log in (the server has user accounts).
    pub fn requires_login(&self) -> bool {
        self.users.is_some()
    }

    /// Opens a session for `user` (checking `password` when the server has accounts) and returns
    /// its bearer token.
    pub async fn open(&self, user: &str, password: &str) -> Result<String, Status> {
        self.open_from(user, password, None).await
    }

    /// [`Self::open`] for a client at `address`. With accounts, a user name or address with too
    /// many recent failed logins is refused before the password is hashed. The hashing (PBKDF2,
    /// thousands of rounds) waits for one of [`HASHING_PERMITS`] permits and runs on the blocking
    /// pool, never on a thread that runs queries; the lockout is checked again once the permit is
    /// held, so a burst of wrong passwords gets only the limit (plus the permits) hashed.
    pub async fn open_from(
        &self,
        user: &str,
        password: &str,
        address: Option<IpAddr>,
    ) -> Result<String, Status> {
        self.authenticate(user, password, address).await?;
        let session = self
            .factory
            .open()
            .await
            .map_err(|e| crate::status::status_of(&e))?;
        session.grant(self.access_of(user));
        let session = Arc::new(session);
        let id = SessionId(self.next.fetch_add(1, Ordering::Relaxed));
        let secret = random_hex().map_err(|e| crate::status::status_of(&e))?;
        let token = format!("s{}.{secret}", id.0);
        let mut opened = self.lock();
        let idle_ttl = self.idle_ttl;
        opened.retain(|_, entry| entry.last_used.elapsed() < idle_ttl);
        let held = opened.values().filter(|entry| entry.user == user).count();
        if self.requires_login() && held >= self.limits.sessions_per_user {
            return Err(Status::resource_exhausted(format!(
                "user '{user}' holds {held} sessions, the most one user may \
                 (max_sessions_per_user): a session ends after {} s unused",
                idle_ttl.as_secs()
            )));
        }
        opened.insert(
            id,
            Opened {
                secret,
                user: user.to_string(),
                session,
                last_used: Instant::now(),
            },
        );
        Ok(token)
    }

    /// Checks `user`'s `password` from a client at `address` with the limits of
    /// [`Self::open_from`], without opening a session (a server without accounts takes anyone).
    pub async fn authenticate(
        &self,
        user: &str,
        password: &str,
        address: Option<IpAddr>,
    ) -> Result<(), Status> {
        if let Some(users) = &self.users {
            let refused = |refused: crate::login_limit::Refused| {
                Status::resource_exhausted(refused.to_string())
            };
            self.logins
                .check(user, address, Instant::now())
                .map_err(refused)?;
            let _permit = self.hashing.acquire().await.map_err(|_| {
                Status::unavailable("the server is stopping: no password is checked")
            })?;
            self.logins
                .check(user, address, Instant::now())
                .map_err(refused)?;
            let (users, name, offered) =
                (Arc::clone(users), user.to_string(), password.to_string());
            let valid = tokio::task::spawn_blocking(move || users.check(&name, &offered))
                .await
                .map_err(|e| {
                    Status::internal(format!("checking the password of '{user}' failed: {e}"))
                })?;
            if !valid {
                self.logins.failed(user, address, Instant::now());
                return Err(Status::unauthenticated(format!(
                    "wrong user name or password for '{user}'"
                )));
            }
            self.logins.succeeded(user);
        }
        Ok(())
    }

    /// The user whose session `token` names (`None`: no such session, or it expired).
    pub fn user_of_token(&self, token: &str) -> Option<String> {
        match self.by_token(token)? {
            (SessionKey::Opened(id), _) => self.user_of(id),
            (SessionKey::Anonymous, _) => None,
        }
    }

    /// Ends the session `token` names (a logout); `false` when there is none.
    pub fn close(&self, token: &str) -> bool {
        match self.by_token(token) {
            Some((SessionKey::Opened(id), _)) => self.lock().remove(&id).is_some(),
            _ => false,
        }
    }

    /// The session `request` belongs to: its `authorization: Bearer` token's, else the anonymous
    /// one. A token that names no session is `Unauthenticated`.
    pub fn of_request<T>(
        &self,
        request: &Request<T>,
    ) -> Result<(SessionKey, Arc<SluiceSession>), Status> {
        let Some(value) = request.metadata().get("authorization") else {
            if self.requires_login() {
                return Err(Status::unauthenticated(
                    "this server requires a login: hand shake with a user name and password first",
                ));
            }
            return Ok((SessionKey::Anonymous, self.anonymous.clone()));
        };
        let text = value
            .to_str()
            .map_err(|_| Status::unauthenticated("the authorization header is not text"))?;
        let Some(token) = text.strip_prefix("Bearer ") else {
            return Err(Status::unauthenticated(
                "expected 'authorization: Bearer <token>' from the handshake",
            ));
        };
        self.by_token(token.trim())
            .ok_or_else(|| Status::unauthenticated("unknown or expired session token"))
    }

    fn by_token(&self, token: &str) -> Option<(SessionKey, Arc<SluiceSession>)> {
        let (id, secret) = token.strip_prefix('s')?.split_once('.')?;
        let id = SessionId(id.parse().ok()?);
        let mut opened = self.lock();
        let entry = opened.get_mut(&id)?;
        let same: bool = entry.secret.as_bytes().ct_eq(secret.as_bytes()).into();
        if !same || entry.last_used.elapsed() >= self.idle_ttl {
            return None;
        }
        entry.last_used = Instant::now();
        Some((SessionKey::Opened(id), entry.session.clone()))
    }

    /// The user a request with `key` runs for (`anonymous` without a handshake).
    pub fn user_name(&self, key: &SessionKey) -> String {
        match key {
            SessionKey::Opened(id) => self.user_of(*id).unwrap_or_else(|| "unknown".to_string()),
            SessionKey::Anonymous => "anonymous".to_string(),
        }
    }

    /// The user who opened session `id`.
    pub fn user_of(&self, id: SessionId) -> Option<String> {
        self.lock().get(&id).map(|opened| opened.user.clone())
    }

    /// Sessions opened by handshakes so far.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no handshake opened a session yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The count of open Postgres connections (kept by the Postgres endpoint).
    pub fn postgres_connections(&self) -> &Arc<AtomicUsize> {
        &self.postgres_connections
    }

    /// The accounts clients log in with (`None`: anyone, no password).
    pub fn users(&self) -> Option<&Users> {
        self.users.as_deref()
    }

    /// The failed logins of every door (the Postgres login counts its own there too).
    pub fn logins(&self) -> &Arc<LoginLimiter> {
        &self.logins
    }

    /// A new session forked from the base session, not filed under any token (a Postgres
    /// connection holds its own).
    ///
    /// On a server with accounts it may read only the registered tables until its login grants
    /// the user's access ([`Self::access_of`]).
    pub async fn fork(&self) -> Result<SluiceSession> {
        let session = self.factory.open().await?;
        if self.requires_login() {
            let nobody = Access::new("(not logged in)", Role::Reader, Arc::new(Roots::default()));
            session.grant(Some(Arc::new(nobody)));
        }
        Ok(session)
    }

    /// The base session the others fork.
    pub fn base(&self) -> &SluiceSession {
        self.factory.base()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Opened>> {
        self.opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn random_hex() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| SluiceError::invalid(format!("cannot make a session token: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use sluice_engine::SluiceConfig;

    use super::*;

    async fn sessions() -> Sessions {
        let base = SluiceSession::new(
            &SluiceConfig::default(),
            Arc::new(sluice_runtime::LocalRunner),
        )
        .unwrap();
        Sessions::new(SessionFactory::new(base)).await.unwrap()
    }

    fn request(authorization: Option<&str>) -> Request<()> {
        let mut request = Request::new(());
        if let Some(value) = authorization {
            request
                .metadata_mut()
                .insert("authorization", value.parse().unwrap());
        }
        request
    }

    #[tokio::test]
    async fn a_token_finds_its_own_session_and_settings_stay_in_it() {
        let sessions = sessions().await;
        let first = sessions.open("ann", "").await.unwrap();
        let second = sessions.open("bob", "").await.unwrap();
        let (key, one) = sessions
            .of_request(&request(Some(&format!("Bearer {first}"))))
            .unwrap();
        assert_eq!(key, SessionKey::Opened(SessionId(1)));
        assert_eq!(sessions.user_of(SessionId(1)).as_deref(), Some("ann"));
        one.run_sql("set datafusion.execution.batch_size = 123")
            .await
            .unwrap();
        let (_, two) = sessions
            .of_request(&request(Some(&format!("Bearer {second}"))))
            .unwrap();
        let batch_size = |s: &SluiceSession| s.context().state().config().batch_size();
        assert_eq!(batch_size(&one), 123);
        assert_eq!(batch_size(&two), 8192);
        let (key, anonymous) = sessions.of_request(&request(None)).unwrap();
        assert_eq!(key, SessionKey::Anonymous);
        assert_eq!(batch_size(&anonymous), 8192);
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_unused_for_its_idle_time_is_dropped() {
        let sessions = sessions().await.with_idle_ttl(Duration::from_secs(60));
        let idle = sessions.open("ann", "").await.unwrap();
        let busy = sessions.open("bob", "").await.unwrap();
        tokio::time::advance(Duration::from_secs(40)).await;
        assert!(
            sessions
                .of_request(&request(Some(&format!("Bearer {busy}"))))
                .is_ok()
        );
        tokio::time::advance(Duration::from_secs(30)).await;
        let expired = sessions
            .of_request(&request(Some(&format!("Bearer {idle}"))))
            .unwrap_err();
        assert_eq!(expired.code(), tonic::Code::Unauthenticated);
        assert_eq!(expired.message(), "unknown or expired session token");
        sessions.open("carol", "").await.unwrap();
        assert_eq!(
            sessions.len(),
            2,
            "ann's session is dropped, bob's (used 30 s ago) kept"
        );
        assert!(
            sessions
                .of_request(&request(Some(&format!("Bearer {busy}"))))
                .is_ok()
        );
    }

    #[tokio::test]
    async fn a_wrong_secret_or_a_bad_header_is_unauthenticated() {
        let sessions = sessions().await;
        let token = sessions.open("ann", "").await.unwrap();
        let flipped = if token.ends_with('0') { '1' } else { '0' };
        let forged = format!("Bearer {}{flipped}", &token[..token.len() - 1]);
        for header in [forged.as_str(), "Bearer s1.00", "Bearer s9.00", "Basic abc"] {
            let status = sessions.of_request(&request(Some(header))).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{header}");
        }
    }
}
