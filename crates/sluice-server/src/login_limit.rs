//! Failed logins, limited per user name and per client address, on every door that checks a
//! password (the Flight SQL handshake, the Postgres SCRAM exchange).
//!
//! ```text
//!   login(user, address) ─► attempt ── refused: "too many failed logins …", no password check
//!                                  └─ counted as a failure ─► check the password
//!                                                            └─ right: succeeded(user, address)
//! ```
//!
//! Every attempt counts as a failure from the moment it starts, so a burst of concurrent tries
//! cannot get more than the limit past the check while the first ones are still being hashed; a
//! success takes its own count back. A key (a user name, or an address) with
//! [`LoginLimits::failures`] counted within [`LoginLimits::window`] is refused for
//! [`LoginLimits::lockout`] from the last of them, before any password is hashed, so once the limit
//! is reached a burst of guesses costs the server no PBKDF2 rounds. A success clears its user's
//! failures, and only its own from its address (one's own account must not reset the count of
//! guesses at others from the same address).
//!
//! Invariants: pure state (the caller passes the time); at most [`MAX_KEYS`] keys are held: when
//! full, keys whose failures have all expired go first, then the addresses (user names stay, so a
//! flood of addresses cannot unlock a user).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The most keys the limiter holds.
pub const MAX_KEYS: usize = 65_536;

/// How many failed logins are allowed, and for how long the refusal lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginLimits {
    /// Failed logins of one key within `window` that start a refusal.
    pub failures: usize,
    /// The window failures are counted in.
    pub window: Duration,
    /// How long a key is refused after its last failure.
    pub lockout: Duration,
}

impl Default for LoginLimits {
    /// 5 failures a minute, then refused for a minute.
    fn default() -> Self {
        Self {
            failures: 5,
            window: Duration::from_secs(60),
            lockout: Duration::from_secs(60),
        }
    }
}

/// What a failure is counted against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    User(String),
    Address(IpAddr),
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::User(user) => write!(f, "for user '{user}'"),
            Key::Address(address) => write!(f, "from {address}"),
        }
    }
}

/// A refused login: which key is locked out, and for how much longer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    key: Key,
    remaining: Duration,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "too many failed logins {}: try again in {} s",
            self.key,
            self.remaining.as_secs().max(1)
        )
    }
}

#[derive(Debug, Default)]
struct Failures {
    /// When the failures within the window happened, oldest first.
    recent: VecDeque<Instant>,
    /// Refused until then.
    refused_until: Option<Instant>,
}

impl Failures {
    fn forget_before(&mut self, now: Instant, window: Duration) {
        while let Some(&first) = self.recent.front() {
            if now.saturating_duration_since(first) < window {
                break;
            }
            self.recent.pop_front();
        }
        if self.refused_until.is_some_and(|until| until <= now) {
            self.refused_until = None;
        }
    }

    fn expired(&self) -> bool {
        self.recent.is_empty() && self.refused_until.is_none()
    }
}

/// The failed logins of every user name and address (see the module docs).
#[derive(Debug, Default)]
pub struct LoginLimiter {
    limits: LoginLimits,
    keys: Mutex<HashMap<Key, Failures>>,
}

impl LoginLimiter {
    /// A limiter with `limits`.
    pub fn new(limits: LoginLimits) -> Self {
        Self {
            limits,
            keys: Mutex::default(),
        }
    }

    fn keys_of(user: &str, address: Option<IpAddr>) -> impl Iterator<Item = Key> {
        std::iter::once(Key::User(user.to_string())).chain(address.map(Key::Address))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Failures>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a login of `user` from `address` at `now`: refused while either key is locked out,
    /// else counted as a failure until [`Self::succeeded`] takes it back.
    pub fn attempt(
        &self,
        user: &str,
        address: Option<IpAddr>,
        now: Instant,
    ) -> Result<(), Refused> {
        let limits = self.limits;
        let mut keys = self.lock();
        for key in Self::keys_of(user, address) {
            if let Some(failures) = keys.get_mut(&key) {
                failures.forget_before(now, limits.window);
                if let Some(until) = failures.refused_until {
                    return Err(Refused {
                        key,
                        remaining: until.saturating_duration_since(now),
                    });
                }
            }
        }
        if keys.len() + 2 > MAX_KEYS {
            make_room(&mut keys, now, limits.window);
        }
        for key in Self::keys_of(user, address) {
            let failures = keys.entry(key).or_default();
            failures.recent.push_back(now);
            if failures.recent.len() >= limits.failures {
                failures.refused_until = Some(now + limits.lockout);
                // Only the newest failures matter for the next refusal.
                while failures.recent.len() > limits.failures {
                    failures.recent.pop_front();
                }
            }
        }
        Ok(())
    }

    /// The login of `user` from `address` that [`Self::attempt`] counted succeeded: the user
    /// name's failures are forgotten, and the address's count loses this one attempt.
    pub fn succeeded(&self, user: &str, address: Option<IpAddr>) {
        let limits = self.limits;
        let mut keys = self.lock();
        keys.remove(&Key::User(user.to_string()));
        if let Some(address) = address
            && let Some(failures) = keys.get_mut(&Key::Address(address))
        {
            failures.recent.pop_back();
            if failures.recent.len() < limits.failures {
                failures.refused_until = None;
            }
        }
    }

    /// How many keys are held (tests, metrics).
    pub fn keys(&self) -> usize {
        self.lock().len()
    }
}

/// Makes room for two keys: drops the keys whose failures have all expired, then those not
/// refused now (addresses first, then user names), and if refused keys alone fill the map (a flood
/// from tens of thousands of addresses within one window), all of them: memory stays bounded.
fn make_room(keys: &mut HashMap<Key, Failures>, now: Instant, window: Duration) {
    let full = |keys: &HashMap<Key, Failures>| keys.len() + 2 > MAX_KEYS;
    keys.retain(|_, failures| {
        failures.forget_before(now, window);
        !failures.expired()
    });
    if full(keys) {
        keys.retain(|key, failures| {
            matches!(key, Key::User(_)) || failures.refused_until.is_some()
        });
    }
    if full(keys) {
        keys.retain(|_, failures| failures.refused_until.is_some());
    }
    if full(keys) {
        keys.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn the_sixth_try_within_a_minute_is_refused_for_a_minute_from_the_last_failure() {
        let limiter = LoginLimiter::default();
        let start = Instant::now();
        for second in 0..5 {
            let now = start + Duration::from_secs(second);
            assert_eq!(limiter.attempt("ann", address(1), now), Ok(()));
        }
        let refused = limiter
            .attempt("ann", address(1), start + Duration::from_secs(5))
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "too many failed logins for user 'ann': try again in 59 s"
        );
        // Another user from another address is not affected.
        assert_eq!(limiter.attempt("bob", address(2), start), Ok(()));
        // The refusal lasts a minute from the fifth failure (at 4 s); refused tries do not count.
        let still = start + Duration::from_secs(63);
        assert!(limiter.attempt("ann", address(1), still).is_err());
        let over = start + Duration::from_secs(64);
        assert_eq!(limiter.attempt("ann", address(1), over), Ok(()));
    }

    #[test]
    fn four_failures_a_window_are_never_refused() {
        let limiter = LoginLimiter::default();
        let start = Instant::now();
        for try_number in 0..20 {
            let now = start + Duration::from_secs(16 * try_number);
            assert_eq!(
                limiter.attempt("ann", address(1), now),
                Ok(()),
                "try {try_number}"
            );
        }
    }

    #[test]
    fn an_address_guessing_at_many_users_is_refused_for_every_user() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for user in ["a", "b", "c", "d", "e"] {
            assert_eq!(limiter.attempt(user, address(7), now), Ok(()));
        }
        let refused = limiter.attempt("f", address(7), now).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "too many failed logins from 10.0.0.7: try again in 60 s"
        );
        assert_eq!(limiter.attempt("f", address(8), now), Ok(()));
    }

    #[test]
    fn a_success_clears_its_user_and_only_its_own_try_from_its_address() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for _ in 0..4 {
            limiter.attempt("ann", address(1), now).unwrap();
        }
        limiter.attempt("ann", address(1), now).unwrap();
        // The fifth try succeeded: ann starts over, the address is back to 4 failures.
        limiter.succeeded("ann", address(1));
        assert_eq!(limiter.attempt("ann", address(2), now), Ok(()));
        assert_eq!(limiter.attempt("zed", address(1), now), Ok(()));
        let refused = limiter.attempt("yan", address(1), now).unwrap_err();
        assert!(refused.to_string().contains("from 10.0.0.1"), "{refused}");
    }

    #[test]
    fn a_flood_of_names_and_addresses_is_bounded_and_keeps_a_refused_user_refused() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for _ in 0..5 {
            limiter.attempt("ann", None, now).unwrap();
        }
        for n in 0..(MAX_KEYS as u32 + 100) {
            let address = Some(IpAddr::from(n.to_be_bytes()));
            assert_eq!(limiter.attempt(&format!("u{n}"), address, now), Ok(()));
        }
        assert!(limiter.keys() <= MAX_KEYS, "{}", limiter.keys());
        assert!(limiter.attempt("ann", address(1), now).is_err());
    }
}
