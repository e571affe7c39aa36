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

/// A tonic endpoint for `host:port`.
pub(crate) fn endpoint(address: &str) -> Result<Endpoint> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(tuned)
        .map_err(|e| DataFusionError::Configuration(format!("bad address '{address}': {e}")))
}

/// `endpoint` with Sluice's connection settings: no Nagle delay, the connect timeout, keep-alive
/// pings.
pub(crate) fn tuned(endpoint: Endpoint) -> Endpoint {
    endpoint
        .tcp_nodelay(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
}
