//! Networking shared by the driver and the workers: listening on a `host:port` (port 0 picks one),
//! serving tonic on it, and connecting to a `host:port`.
//!
//! Invariant: every failure names the address it concerns.

use std::time::Duration;

use datafusion::common::{DataFusionError, Result};
use tokio::net::TcpListener;
use tonic::transport::Endpoint;
use tonic::transport::server::TcpIncoming;

/// A listener on `address` (`host:port`; port 0 picks one), and the `host:port` it got.
pub(crate) async fn bind(what: &str, address: &str) -> Result<(TcpListener, String)> {
    let listen_error = |e: std::io::Error| {
        DataFusionError::Execution(format!("{what} cannot listen on {address}: {e}"))
    };
    let listener = TcpListener::bind(address).await.map_err(listen_error)?;
    let bound = listener.local_addr().map_err(listen_error)?.to_string();
    Ok((listener, bound))
}

/// The connections tonic serves from `listener` (no Nagle delay).
pub(crate) fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// How long a connection attempt to a driver or worker may take: a peer behind a cut link (its
/// packets dropped) fails within it instead of after the system's minutes of SYN retries.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// HTTP/2 pings on every connection, answered by the peer's transport whatever its calls do: a
/// call whose peer went silent mid-stream (a cut link) fails after the interval and the timeout,
/// instead of waiting for TCP's retransmissions to give up.
pub(crate) const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(2);
pub(crate) const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The largest HTTP/2 frame a connection's peer may send it (HTTP/2's default is 16 KiB). A
/// stream's batches reach their reader in frames of up to this size: on loopback, 1 MiB frames
/// moved a stream of 24 lineitem batches in about 30 ms against 53 ms with 16 KiB frames, each
/// frame costing a write call and a wake-up (`benches/flight.rs`, BENCHMARKS.md). Larger frames
/// gained nothing more, nor did larger flow-control windows.
pub(crate) const MAX_FRAME_SIZE: u32 = 1 << 20;

/// A tonic endpoint for `host:port`.
pub(crate) fn endpoint(address: &str) -> Result<Endpoint> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(tuned)
        .map_err(|e| DataFusionError::Configuration(format!("bad address '{address}': {e}")))
}

/// `endpoint` with Sluice's connection settings: no Nagle delay, the connect timeout, keep-alive
/// pings, frames of up to [`MAX_FRAME_SIZE`].
pub(crate) fn tuned(endpoint: Endpoint) -> Endpoint {
    endpoint
        .tcp_nodelay(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .max_frame_size(MAX_FRAME_SIZE)
}
