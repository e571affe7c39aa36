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
//! (its worker may be gone), and a retried read always opens a new one.

use std::collections::HashMap;
use std::sync::Mutex;

use datafusion::common::Result;

use crate::auth::{ClusterLink, SecretChannel, connect_lazy};

/// Idle connections kept per worker address.
const IDLE_PER_ADDRESS: usize = 16;

/// Idle connections by worker address; see the module docs.
#[derive(Default)]
pub(crate) struct ConnectionPool {
    idle: Mutex<HashMap<String, Vec<SecretChannel>>>,
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
        if let Ok(mut idle) = self.idle.lock()
            && let Some(channel) = idle.get_mut(address).and_then(Vec::pop)
        {
            return Ok((channel, true));
        }
        Ok((connect_lazy(address, link)?, false))
    }

    /// `channel`'s call to `address` ended cleanly: it may carry the next one.
    pub fn give_back(&self, address: &str, channel: SecretChannel) {
        if let Ok(mut idle) = self.idle.lock() {
            let channels = idle.entry(address.to_string()).or_default();
            if channels.len() < IDLE_PER_ADDRESS {
                channels.push(channel);
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
