//! Failed logins, limited per user name and per client address, on every door that checks a
//! password (the Flight SQL handshake, the Postgres SCRAM exchange).
//!
//! ```text
//!   login(user, address) ─► check ── locked out: "too many failed logins …" (no password check)
//!                                └─ (Flight: a hashing permit, then check again)
//!                                   ─► verify the password ─► wrong: failed(user, address)
//!                                                          └► right: succeeded(user)
//! ```
//!
//! Only wrong passwords count: a pool opening many connections with the right one is never
//! refused. A key (a user name, or an address) with [`LoginLimits::failures`] failures within
//! [`LoginLimits::window`] is locked out for [`LoginLimits::lockout`] from the last of them. The
//! doors check the lockout again right before they verify (Flight after it waits for one of a few
//! hashing permits, Postgres when the proof arrives), so a concurrent burst of wrong passwords gets
//! only the limit (plus the permits) verified: the rest is refused without hashing. A success
//! clears its user name's failures, never its address's (one's own account must not reset the
//! count of guesses at others from the same address).
//!
//! Invariants: pure state (the caller passes the time); at most [`MAX_KEYS`] keys, user names
//! kept to their first [`MAX_NAME_BYTES`] bytes. When full, keys go in this order: those whose
//! failures have all expired, addresses not locked out, user names not locked out, locked-out
//! addresses; a locked-out user name is never dropped (a flood cannot unlock it), and while such
//! names alone fill the map, failures of new keys are not recorded.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The most keys the limiter holds.
pub const MAX_KEYS: usize = 65_536;

/// The bytes of a user name the limiter keeps (longer names are not accounts anyway).
pub const MAX_NAME_BYTES: usize = 256;

/// How many failed logins are allowed, and for how long the refusal lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginLimits {
    /// Failed logins of one key within `window` that start a lockout (at least 1).
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

impl Key {
    fn user(name: &str) -> Self {
        let mut end = name.len().min(MAX_NAME_BYTES);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        Key::User(name[..end].to_string())
    }
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
    /// A limiter with `limits` (a `failures` of 0 counts as 1).
    pub fn new(limits: LoginLimits) -> Self {
        Self {
            limits: LoginLimits {
                failures: limits.failures.max(1),
                ..limits
            },
            keys: Mutex::default(),
        }
    }

    fn keys_of(user: &str, address: Option<IpAddr>) -> impl Iterator<Item = Key> {
        std::iter::once(Key::user(user)).chain(address.map(Key::Address))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Failures>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a login of `user` from `address` may verify its password at `now`: refused while
    /// either key is locked out.
    pub fn check(&self, user: &str, address: Option<IpAddr>, now: Instant) -> Result<(), Refused> {
        let window = self.limits.window;
        let mut keys = self.lock();
        for key in Self::keys_of(user, address) {
            if let Some(failures) = keys.get_mut(&key) {
                failures.forget_before(now, window);
                if let Some(until) = failures.refused_until {
                    return Err(Refused {
                        key,
                        remaining: until.saturating_duration_since(now),
                    });
                }
            }
        }
        Ok(())
    }

    /// Counts a wrong password of `user` from `address` at `now`.
    pub fn failed(&self, user: &str, address: Option<IpAddr>, now: Instant) {
        let limits = self.limits;
        let mut keys = self.lock();
        for key in Self::keys_of(user, address) {
            if !keys.contains_key(&key) && !make_room(&mut keys, now, limits.window) {
                continue;
            }
            let failures = keys.entry(key).or_default();
            failures.forget_before(now, limits.window);
            failures.recent.push_back(now);
            if failures.recent.len() >= limits.failures {
                failures.refused_until = now.checked_add(limits.lockout);
                // Only the newest failures matter for the next lockout.
                while failures.recent.len() > limits.failures {
                    failures.recent.pop_front();
                }
            }
        }
    }

    /// A login of `user` succeeded: its user name's failures are forgotten.
    pub fn succeeded(&self, user: &str) {
        self.lock().remove(&Key::user(user));
    }

    /// How many keys are held (tests, metrics).
    pub fn keys(&self) -> usize {
        self.lock().len()
    }
}

/// Makes room for one more key if the map is full (see the module docs for the order), down to
/// three quarters of [`MAX_KEYS`] so that a flood does not pay for this on every failure; false
/// when locked-out user names alone fill it.
fn make_room(keys: &mut HashMap<Key, Failures>, now: Instant, window: Duration) -> bool {
    if keys.len() < MAX_KEYS {
        return true;
    }
    let low_water = MAX_KEYS / 4 * 3;
    keys.retain(|_, failures| {
        failures.forget_before(now, window);
        !failures.expired()
    });
    let passes: [fn(&Key, &Failures) -> bool; 3] = [
        |key, failures| matches!(key, Key::User(_)) || failures.refused_until.is_some(),
        |_, failures| failures.refused_until.is_some(),
        |key, _| matches!(key, Key::User(_)),
    ];
    for keep in passes {
        if keys.len() <= low_water {
            break;
        }
        keys.retain(|key, failures| keep(key, failures));
    }
    keys.len() < MAX_KEYS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn after_five_wrong_passwords_in_a_minute_the_user_is_refused_for_a_minute() {
        let limiter = LoginLimiter::default();
        let start = Instant::now();
        for second in 0..5 {
            let now = start + Duration::from_secs(second);
            assert_eq!(limiter.check("ann", address(1), now), Ok(()));
            limiter.failed("ann", address(1), now);
        }
        let refused = limiter
            .check("ann", address(2), start + Duration::from_secs(5))
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "too many failed logins for user 'ann': try again in 59 s"
        );
        // Another user from another address is not affected.
        assert_eq!(limiter.check("bob", address(2), start), Ok(()));
        // The lockout lasts a minute from the fifth failure (at 4 s).
        assert!(
            limiter
                .check("ann", address(2), start + Duration::from_secs(63))
                .is_err()
        );
        assert_eq!(
            limiter.check("ann", address(2), start + Duration::from_secs(64)),
            Ok(())
        );
    }

    #[test]
    fn right_passwords_never_count_so_a_pool_of_connections_is_never_refused() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for _ in 0..100 {
            assert_eq!(limiter.check("ann", address(1), now), Ok(()));
            limiter.succeeded("ann");
        }
        assert_eq!(limiter.keys(), 0);
    }

    #[test]
    fn four_failures_a_window_are_never_refused() {
        let limiter = LoginLimiter::default();
        let start = Instant::now();
        for try_number in 0..20 {
            let now = start + Duration::from_secs(16 * try_number);
            assert_eq!(
                limiter.check("ann", address(1), now),
                Ok(()),
                "try {try_number}"
            );
            limiter.failed("ann", address(1), now);
        }
    }

    #[test]
    fn an_address_guessing_at_many_users_is_refused_for_every_user() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for user in ["a", "b", "c", "d", "e"] {
            limiter.failed(user, address(7), now);
        }
        let refused = limiter.check("f", address(7), now).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "too many failed logins from 10.0.0.7: try again in 60 s"
        );
        assert_eq!(limiter.check("f", address(8), now), Ok(()));
    }

    #[test]
    fn a_success_clears_its_user_but_not_its_address() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for _ in 0..4 {
            limiter.failed("ann", address(1), now);
        }
        limiter.succeeded("ann");
        // ann starts over; the address keeps its 4 failures, so one more locks it out.
        limiter.failed("zed", address(1), now);
        assert_eq!(limiter.check("ann", address(2), now), Ok(()));
        let refused = limiter.check("ann", address(1), now).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "too many failed logins from 10.0.0.1: try again in 60 s"
        );
    }

    #[test]
    fn a_flood_of_names_and_addresses_is_bounded_and_keeps_a_locked_out_user_locked_out() {
        let limiter = LoginLimiter::default();
        let now = Instant::now();
        for _ in 0..5 {
            limiter.failed("ann", None, now);
        }
        for n in 0..(MAX_KEYS as u32 * 2) {
            let address = Some(IpAddr::from(n.to_be_bytes()));
            limiter.failed(&format!("u{n}"), address, now);
            assert!(
                limiter.keys() <= MAX_KEYS,
                "{} keys after {n}",
                limiter.keys()
            );
        }
        assert!(limiter.check("ann", address(1), now).is_err());
        // Long names are kept to their first bytes.
        let long = "x".repeat(10 * MAX_NAME_BYTES);
        for _ in 0..5 {
            limiter.failed(&long, None, now);
        }
        assert!(
            limiter
                .check(&"x".repeat(MAX_NAME_BYTES), None, now)
                .is_err()
        );
    }

    #[test]
    fn locked_out_names_alone_filling_the_map_stay_locked_out_and_new_keys_are_not_recorded() {
        let limiter = LoginLimiter::new(LoginLimits {
            failures: 1,
            ..LoginLimits::default()
        });
        let now = Instant::now();
        for n in 0..MAX_KEYS {
            limiter.failed(&format!("u{n}"), None, now);
        }
        assert_eq!(limiter.keys(), MAX_KEYS);
        limiter.failed("late", None, now);
        assert_eq!(limiter.keys(), MAX_KEYS);
        assert_eq!(limiter.check("late", None, now), Ok(()));
        assert!(limiter.check("u0", None, now).is_err());
        assert!(
            limiter
                .check(&format!("u{}", MAX_KEYS - 1), None, now)
                .is_err()
        );
    }
}
