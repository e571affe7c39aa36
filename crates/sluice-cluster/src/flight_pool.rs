//! Idle Flight connections kept for the next read from the same worker, so a job's many small
//! streams do not each pay a TCP and HTTP/2 handshake (and, with TLS, a full handshake).
//!
//! ```text
//!   fetch(address) ─► take: an idle connection to address, else a new one
//!        DoGet … end marker, then the call's end ─► give_back: idle again (at most IDLE_PER_ADDRESS)
//!        DoGet fails, or its reader drops it mid-stream ─► the connection is not given back
//! ```
//!
//! Invariants: a connection carries one `DoGet` at a time (a stream its reader has not reached
//! yet holds HTTP/2 flow-control window that every stream of its connection shares, which would
//! throttle the streams the reader needs first); it is given back only after its call ended cleanly
//! at the stream's end marker; a read that failed at `address` drops every idle connection there
//! (its worker may be gone), and a retried read always opens a new one; a connection idle for
//! [`IDLE_FOR`] is closed at the next take or give-back (a departed worker's too), and at most [`IDLE_PER_ADDRESS`] per address
//! and [`IDLE_IN_ALL`] in all are kept.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use datafusion::common::Result;

use crate::auth::{ClusterLink, SecretChannel, connect_lazy};

/// Idle connections kept per worker address.
const IDLE_PER_ADDRESS: usize = 16;

/// Idle connections kept in all.
const IDLE_IN_ALL: usize = 256;

/// How long a connection stays idle before it is closed.
const IDLE_FOR: Duration = Duration::from_secs(30);

/// Idle connections by worker address, each with when it became idle; see the module docs.
#[derive(Default)]
pub(crate) struct ConnectionPool {
    idle: Mutex<HashMap<String, Vec<(SecretChannel, Instant)>>>,
}

impl std::fmt::Debug for ConnectionPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self
            .idle
            .lock()
            .map(|idle| idle.values().map(Vec::len).sum::<usize>())
            .unwrap_or(0);
        f.debug_struct("ConnectionPool")
            .field("idle", &idle)
            .finish()
    }
}

impl ConnectionPool {
    /// A connection to `address` for one call: an idle one (`true`), else a new, lazily
    /// connecting one.
    pub fn take(&self, address: &str, link: &ClusterLink) -> Result<(SecretChannel, bool)> {
        if let Ok(mut idle) = self.idle.lock() {
            close_stale(&mut idle, Instant::now());
            if let Some((channel, _)) = idle.get_mut(address).and_then(Vec::pop) {
                return Ok((channel, true));
            }
        }
        Ok((connect_lazy(address, link)?, false))
    }

    /// `channel`'s call to `address` ended cleanly: it may carry the next one.
    pub fn give_back(&self, address: &str, channel: SecretChannel) {
        if let Ok(mut idle) = self.idle.lock() {
            let now = Instant::now();
            close_stale(&mut idle, now);
            let in_all: usize = idle.values().map(Vec::len).sum();
            let channels = idle.entry(address.to_string()).or_default();
            if channels.len() < IDLE_PER_ADDRESS && in_all < IDLE_IN_ALL {
                channels.push((channel, now));
            }
        }
    }

    /// A call to `address` failed: its idle connections go too.
    pub fn forget(&self, address: &str) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.remove(address);
        }
    }

    /// Idle connections to `address` (for tests).
    #[cfg(test)]
    pub fn idle(&self, address: &str) -> usize {
        self.idle
            .lock()
            .map(|idle| idle.get(address).map_or(0, Vec::len))
            .unwrap_or(0)
    }
}

/// Closes the connections idle for longer than [`IDLE_FOR`] at `now`.
fn close_stale(idle: &mut HashMap<String, Vec<(SecretChannel, Instant)>>, now: Instant) {
    idle.retain(|_, channels| {
        channels.retain(|(_, since)| now.duration_since(*since) < IDLE_FOR);
        !channels.is_empty()
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::auth::ClusterSecret;

    #[tokio::test]
    async fn idle_connections_are_capped_per_address_and_closed_once_idle_too_long() {
        let link = ClusterLink::new(ClusterSecret::random().unwrap(), None);
        let pool = ConnectionPool::default();
        for _ in 0..IDLE_PER_ADDRESS + 3 {
            pool.give_back("w1:1", connect_lazy("w1:1", &link).unwrap());
        }
        pool.give_back("w2:1", connect_lazy("w2:1", &link).unwrap());
        assert_eq!(
            (pool.idle("w1:1"), pool.idle("w2:1")),
            (IDLE_PER_ADDRESS, 1)
        );
        let (_, reused) = pool.take("w1:1", &link).unwrap();
        assert!(reused);
        assert_eq!(pool.idle("w1:1"), IDLE_PER_ADDRESS - 1);
        pool.forget("w1:1");
        let (_, reused) = pool.take("w1:1", &link).unwrap();
        assert!(!reused);
        let mut idle = pool.idle.lock().unwrap();
        let now = Instant::now();
        close_stale(&mut idle, now + IDLE_FOR - Duration::from_secs(1));
        assert_eq!(idle.get("w2:1").map(Vec::len), Some(1));
        close_stale(&mut idle, now + IDLE_FOR);
        assert!(idle.is_empty());
    }
}
