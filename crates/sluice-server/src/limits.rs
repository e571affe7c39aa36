//! The server's bounds on what clients can make it hold: each path that buffers for a client has
//! one, set from the configuration ([`ServerLimits::of`]), and going past it is one clear error
//! naming the setting, never an unbounded allocation.
//!
//! | what                                                        | setting                   | default |
//! |-------------------------------------------------------------|---------------------------|---------|
//! | a result held until its statement ends (a Postgres statement followed by others in one query string) | `result_buffer` | 64 MiB |
//! | one binding of a prepared statement's parameters (Flight SQL) | `max_parameter_bytes`   | 1 MiB   |
//! | open prepared statements per Flight SQL session             | `max_prepared_statements` | 100     |
//! | idle time after which a prepared statement is closed        | `prepared_statement_idle` | 10 min  |
//! | Flight SQL sessions one user holds open (servers with accounts) | `max_sessions_per_user` | 16    |
//!
//! A Flight SQL statement update (`DoPut`) streams its result and counts it, holding one batch at
//! a time; failed logins have their own limits ([`crate::login_limit`], `max_failed_logins`).

use std::time::Duration;

use sluice_engine::SluiceConfig;

/// See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Bytes a buffered result may hold.
    pub result_buffer: usize,
    /// Bytes of one binding of parameters.
    pub parameter_bytes: usize,
    /// Open prepared statements per session.
    pub prepared_per_session: usize,
    /// How long a prepared statement may go unused.
    pub prepared_idle: Duration,
    /// Flight SQL sessions per user.
    pub sessions_per_user: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self::of(&SluiceConfig::default())
    }
}

impl ServerLimits {
    /// The limits `config` sets.
    pub fn of(config: &SluiceConfig) -> Self {
        let bytes = |value: u64| usize::try_from(value).unwrap_or(usize::MAX);
        Self {
            result_buffer: bytes(config.result_buffer.value.0),
            parameter_bytes: bytes(config.max_parameter_bytes.value.0),
            prepared_per_session: config.max_prepared_statements.value,
            prepared_idle: config.prepared_statement_idle.value,
            sessions_per_user: config.max_sessions_per_user.value,
        }
    }
}

/// `bytes` for messages: `64 MiB`, `1 MiB`, `512 KiB`, `100 B`.
pub fn human_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let limits = ServerLimits::default();
        assert_eq!(limits.result_buffer, 64 << 20);
        assert_eq!(limits.parameter_bytes, 1 << 20);
        assert_eq!(limits.prepared_per_session, 100);
        assert_eq!(limits.prepared_idle, Duration::from_secs(600));
        assert_eq!(limits.sessions_per_user, 16);
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(2048), "2 KiB");
        assert_eq!(human_bytes(1536), "1536 B");
    }
}
