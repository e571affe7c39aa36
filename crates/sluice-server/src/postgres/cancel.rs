//! `CancelRequest`s (psql's Ctrl-C): a cancel names a connection by process id and secret key and
//! ends the statement it is running, wherever that statement is.
//!
//! pgwire covers only planning (it races a connection's `do_query` against its own cancel signal);
//! a query's rows stream after `do_query` has returned, so each connection also holds a cancel
//! generation here. A statement remembers the generation it started under and ends (`57014`, its
//! stream and so its job dropped) as soon as the generation moves past it.
//!
//! Invariants: a cancel reaches only statements already running when it arrives (a later statement
//! starts under the new generation); a connection is listed only while it is open.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use pgwire::api::ConnectionManager;
use pgwire::api::cancel::CancelHandler;
use pgwire::messages::cancel::CancelRequest;
use pgwire::messages::startup::SecretKey;
use tokio::sync::watch;

/// Resolves once the statement it was made for is cancelled.
pub type CancelSignal = Shared<BoxFuture<'static, ()>>;

type Key = (i32, Vec<u8>);

fn key_of(pid: i32, secret: &SecretKey) -> Key {
    (pid, secret.to_bytes().to_vec())
}

/// The open connections' cancel generations, by process id and secret key.
#[derive(Debug, Default)]
pub struct Cancels {
    by_key: Mutex<HashMap<Key, Weak<watch::Sender<u64>>>>,
}

impl Cancels {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Weak<watch::Sender<u64>>>> {
        self.by_key
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Lists a connection (its generation lives as long as the `Arc`).
    pub fn register(&self, pid: i32, secret: &SecretKey, generation: &Arc<watch::Sender<u64>>) {
        let mut by_key = self.lock();
        by_key.retain(|_, sender| sender.strong_count() > 0);
        by_key.insert(key_of(pid, secret), Arc::downgrade(generation));
    }

    /// Moves the named connection's generation on; whether it was found.
    pub fn cancel(&self, pid: i32, secret: &SecretKey) -> bool {
        let sender = self
            .lock()
            .get(&key_of(pid, secret))
            .and_then(Weak::upgrade);
        match sender {
            Some(sender) => {
                sender.send_modify(|generation| *generation += 1);
                true
            }
            None => false,
        }
    }

    /// Connections listed and still open.
    pub fn open(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| s.strong_count() > 0)
            .count()
    }
}

/// The signal of a statement starting now on the connection whose generation `generation` is.
pub fn signal(generation: &watch::Sender<u64>) -> CancelSignal {
    let mut receiver = generation.subscribe();
    let started = *receiver.borrow_and_update();
    async move {
        loop {
            if receiver.changed().await.is_err() {
                // The connection is gone: nothing will cancel this statement any more.
                futures::future::pending::<()>().await;
            }
            if *receiver.borrow_and_update() > started {
                return;
            }
        }
    }
    .boxed()
    .shared()
}

/// Handles `CancelRequest`s: pgwire's planning-time signal and Sluice's streaming one.
#[derive(Debug)]
pub struct PgCancel {
    pub(crate) manager: Arc<ConnectionManager>,
    pub(crate) cancels: Arc<Cancels>,
}

#[async_trait]
impl CancelHandler for PgCancel {
    async fn on_cancel_request(&self, request: CancelRequest) {
        self.manager.cancel(request.pid, &request.secret_key).await;
        self.cancels.cancel(request.pid, &request.secret_key);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_cancel_ends_the_running_statement_but_not_the_next() {
        let cancels = Cancels::default();
        let generation = Arc::new(watch::Sender::new(0));
        let secret = SecretKey::I32(77);
        cancels.register(5, &secret, &generation);
        let running = signal(&generation);
        assert!(!cancels.cancel(5, &SecretKey::I32(78)), "wrong key");
        assert!(running.clone().now_or_never().is_none());
        assert!(cancels.cancel(5, &secret));
        tokio::time::timeout(Duration::from_secs(5), running)
            .await
            .unwrap();
        let next = signal(&generation);
        tokio::task::yield_now().await;
        assert!(
            next.now_or_never().is_none(),
            "a later statement is not cancelled"
        );
        assert_eq!(cancels.open(), 1);
        drop(generation);
        assert_eq!(cancels.open(), 0);
        assert!(
            !cancels.cancel(5, &secret),
            "a closed connection is not found"
        );
    }
}
