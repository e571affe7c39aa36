//! Networking shared by the driver and the workers: listening on a `host:port` (port 0 picks one),
//! serving tonic on it, and connecting to a `host:port`.
//!
//! Invariant: every failure names the address it concerns.

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

/// A tonic endpoint for `host:port`.
pub(crate) fn endpoint(address: &str) -> Result<Endpoint> {
    Endpoint::from_shared(format!("http://{address}"))
        .map(|e| e.tcp_nodelay(true))
        .map_err(|e| DataFusionError::Configuration(format!("bad address '{address}': {e}")))
}
