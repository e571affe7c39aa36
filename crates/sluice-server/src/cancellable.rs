//! [`UntilCancelled`]: a result stream that a signal can end early, with one error, for both front
//! doors (a Flight SQL `CancelFlightInfo`, a Postgres `CancelRequest`).
//!
//! Invariant: once the signal fires, the inner stream is dropped at once (which cancels the job on
//! every worker) and the stream yields the given error, then ends; an inner stream that ends first
//! ends the stream normally.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{FutureExt, Stream, StreamExt};

/// `inner` until `signal` resolves, then `error`.
pub struct UntilCancelled<S, F, E> {
    inner: Option<S>,
    signal: F,
    error: Option<E>,
}

impl<S, F, E> UntilCancelled<S, F, E> {
    /// `inner`, ended by `signal` with `error`.
    pub fn new(inner: S, signal: F, error: E) -> Self {
        Self {
            inner: Some(inner),
            signal,
            error: Some(error),
        }
    }
}

impl<S, F, T, E> Stream for UntilCancelled<S, F, E>
where
    S: Stream<Item = Result<T, E>> + Unpin,
    F: Future<Output = ()> + Unpin,
    E: Unpin,
{
    type Item = Result<T, E>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if this.signal.poll_unpin(cx).is_ready() {
            this.inner = None;
            return Poll::Ready(this.error.take().map(Err));
        }
        let next = inner.poll_next_unpin(cx);
        if let Poll::Ready(None) = next {
            this.inner = None;
        }
        next
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use futures::stream;
    use tokio::sync::oneshot;

    use super::*;

    /// Sets its flag when dropped.
    struct Dropped(Arc<AtomicBool>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_signal_drops_the_inner_stream_and_ends_with_the_error() {
        let dropped = Arc::new(AtomicBool::new(false));
        let guard = Dropped(dropped.clone());
        // An endless inner stream that holds the guard.
        let inner = stream::repeat_with(move || {
            let _ = &guard;
            Ok::<u32, String>(1)
        })
        .boxed();
        let (cancel, cancelled) = oneshot::channel::<()>();
        let signal = cancelled.map(|_| ());
        let mut stream = UntilCancelled::new(inner, signal, "cancelled".to_string());
        assert_eq!(stream.next().await, Some(Ok(1)));
        cancel.send(()).unwrap();
        assert_eq!(stream.next().await, Some(Err("cancelled".to_string())));
        assert!(
            dropped.load(Ordering::SeqCst),
            "the inner stream is dropped at once"
        );
        assert_eq!(stream.next().await, None);
    }

    #[tokio::test]
    async fn an_inner_stream_that_ends_first_ends_normally() {
        let inner = stream::iter([Ok::<u32, String>(1), Ok(2)]);
        let mut stream = UntilCancelled::new(inner, futures::future::pending(), "no".to_string());
        assert_eq!(stream.next().await, Some(Ok(1)));
        assert_eq!(stream.next().await, Some(Ok(2)));
        assert_eq!(stream.next().await, None);
    }
}
