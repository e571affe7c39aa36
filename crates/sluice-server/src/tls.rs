//! TLS on the front doors (`sluice server --serve-tls-cert FILE --serve-tls-key FILE`): the
//! certificate both the Flight SQL endpoint (`grpc+tls://`) and the Postgres endpoint (`SSLRequest`,
//! `sslmode=require`) present. Clients are not asked for certificates; they log in with a password.
//!
//! Invariants: with TLS a Postgres connection that does not ask for it is refused before its
//! startup message is read (only a `CancelRequest`, which carries no credentials or rows, may come
//! in clear); a front door listens on a non-loopback address only with TLS *and* user accounts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sluice_engine::{Result, SluiceError};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tonic::transport::{Identity, ServerTlsConfig};

/// The front doors' certificate and key, read once.
#[derive(Clone)]
pub struct FrontDoorTls {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    acceptor: TlsAcceptor,
    /// Where the certificate was read from (for messages).
    pub cert: PathBuf,
}

impl std::fmt::Debug for FrontDoorTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontDoorTls")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

impl FrontDoorTls {
    /// Reads the PEM certificate chain `cert` and private key `key`; an unreadable or malformed
    /// file is an error naming it.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self> {
        let read = |path: &Path| std::fs::read(path).map_err(|e| SluiceError::io(path, e));
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        let bad = |path: &Path, what: &str, e: &dyn std::fmt::Display| {
            SluiceError::invalid(format!("{}: not a PEM {what}: {e}", path.display()))
        };
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| bad(cert, "certificate chain", &e))?;
        if chain.is_empty() {
            return Err(bad(cert, "certificate chain", &"no certificate in it"));
        }
        let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| bad(key, "key", &e))?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|builder| {
                builder
                    .with_no_client_auth()
                    .with_single_cert(chain, private)
            })
            .map_err(|e| {
                SluiceError::invalid(format!(
                    "TLS with {} and {}: {e}",
                    cert.display(),
                    key.display()
                ))
            })?;
        Ok(Self {
            cert_pem,
            key_pem,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            cert: cert.to_path_buf(),
        })
    }

    /// The Flight SQL endpoint's TLS setup.
    pub(crate) fn grpc(&self) -> ServerTlsConfig {
        sluice_runtime::install_default_crypto_provider();
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
    }

    /// The Postgres endpoint's TLS acceptor.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }
}

/// How long a new HTTPS connection may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Handshakes an HTTPS listener runs at once; further connections wait in the kernel's queue.
const MAX_HANDSHAKES: usize = 256;

type Handshake = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Option<(
                    tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
                    std::net::SocketAddr,
                )>,
            > + Send,
    >,
>;

/// The REST endpoint's HTTPS listener: accepts TCP connections and hands out those whose TLS
/// handshake succeeded. Handshakes run side by side (at most [`MAX_HANDSHAKES`], each within
/// [`HANDSHAKE_TIMEOUT`]), so a client that stalls in its handshake holds up no one else; one that
/// fails or stalls is dropped.
pub(crate) struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: TlsAcceptor,
    handshakes: futures::stream::FuturesUnordered<Handshake>,
}

impl TlsListener {
    /// HTTPS on `tcp` with `acceptor`'s certificate.
    pub(crate) fn new(tcp: tokio::net::TcpListener, acceptor: TlsAcceptor) -> Self {
        Self {
            tcp,
            acceptor,
            handshakes: futures::stream::FuturesUnordered::new(),
        }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        use futures::StreamExt;
        loop {
            let room = self.handshakes.len() < MAX_HANDSHAKES;
            tokio::select! {
                accepted = self.tcp.accept(), if room => match accepted {
                    Ok((socket, peer)) => {
                        let _ = socket.set_nodelay(true);
                        let acceptor = self.acceptor.clone();
                        self.handshakes.push(Box::pin(async move {
                            let handshake = acceptor.accept(socket);
                            match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                                Ok(Ok(stream)) => Some((stream, peer)),
                                _ => None,
                            }
                        }));
                    }
                    // A failed accept (out of file descriptors) must not spin.
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                },
                Some(done) = self.handshakes.next(), if !self.handshakes.is_empty() => {
                    if let Some(connection) = done {
                        return connection;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// The request codes a Postgres client may open with in clear on a TLS door: `SSLRequest` and
/// `CancelRequest` (its secret key is all it carries).
const SSL_REQUEST: u32 = 80_877_103;
const CANCEL_REQUEST: u32 = 80_877_102;

/// How long a new Postgres connection may take to send its first 8 bytes.
const FIRST_BYTES_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether the Postgres client on `socket` opens with a request a TLS door accepts in clear
/// (without consuming it: pgwire reads it next). `false` for anything else, or for a client that
/// sends nothing in time.
pub(crate) async fn opens_with_tls_or_cancel(socket: &tokio::net::TcpStream) -> bool {
    let mut first = [0u8; 8];
    let peeked = async {
        loop {
            match socket.peek(&mut first).await {
                Ok(8) => return true,
                Ok(0) | Err(_) => return false,
                // Part of it came: wait for the rest without spinning.
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
            }
        }
    };
    if !matches!(
        tokio::time::timeout(FIRST_BYTES_TIMEOUT, peeked).await,
        Ok(true)
    ) {
        return false;
    }
    let [l0, l1, l2, l3, c0, c1, c2, c3] = first;
    let length = u32::from_be_bytes([l0, l1, l2, l3]);
    let code = u32::from_be_bytes([c0, c1, c2, c3]);
    matches!((length, code), (8, SSL_REQUEST) | (16, CANCEL_REQUEST))
}

/// A Postgres `ErrorResponse` (FATAL, SQLSTATE `code`, `message`), for refusing a connection
/// before pgwire sees it.
pub(crate) fn fatal_error(code: &str, message: &str) -> Vec<u8> {
    let mut fields = Vec::new();
    for (tag, value) in [
        (b'S', "FATAL"),
        (b'V', "FATAL"),
        (b'C', code),
        (b'M', message),
    ] {
        fields.push(tag);
        fields.extend_from_slice(value.as_bytes());
        fields.push(0);
    }
    fields.push(0);
    let length = u32::try_from(fields.len() + 4).unwrap_or(u32::MAX);
    let mut message = vec![b'E'];
    message.extend_from_slice(&length.to_be_bytes());
    message.extend(fields);
    message
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_fatal_error_is_a_well_formed_error_response() {
        let bytes = fatal_error("28000", "TLS required");
        assert_eq!(bytes[0], b'E');
        let length = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        assert_eq!(length, bytes.len() - 1);
        assert_eq!(
            &bytes[5..],
            b"SFATAL\0VFATAL\0C28000\0MTLS required\0\0".as_slice()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_sends_nothing_or_too_little_is_refused_after_the_timeout() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        for sent in [&b""[..], &b"\0\0\0\x08"[..]] {
            let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
            let (server, _) = listener.accept().await.unwrap();
            client.write_all(sent).await.unwrap();
            let started = tokio::time::Instant::now();
            assert!(!opens_with_tls_or_cancel(&server).await, "{sent:?}");
            assert!(started.elapsed() >= FIRST_BYTES_TIMEOUT, "{sent:?}");
        }
        // A client that closes before 8 bytes is refused at once.
        let client = tokio::net::TcpStream::connect(address).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        drop(client);
        assert!(!opens_with_tls_or_cancel(&server).await);
    }

    #[tokio::test]
    async fn only_an_ssl_or_cancel_request_may_open_a_tls_door_in_clear() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let mut ssl = 8u32.to_be_bytes().to_vec();
        ssl.extend(SSL_REQUEST.to_be_bytes());
        let mut cancel = 16u32.to_be_bytes().to_vec();
        cancel.extend(CANCEL_REQUEST.to_be_bytes());
        cancel.extend([0u8; 8]);
        // A plain startup message: length, protocol 3.0.
        let mut startup = 9u32.to_be_bytes().to_vec();
        startup.extend(196_608u32.to_be_bytes());
        startup.push(0);
        for (first, accepted) in [(ssl, true), (cancel, true), (startup, false)] {
            let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
            let (server, _) = listener.accept().await.unwrap();
            client.write_all(&first).await.unwrap();
            assert_eq!(
                opens_with_tls_or_cancel(&server).await,
                accepted,
                "{first:?}"
            );
            // Peeking left the bytes for pgwire.
            let mut again = vec![0u8; first.len()];
            assert_eq!(server.peek(&mut again).await.unwrap(), first.len());
        }
    }
}
