//! The cluster secret: every call between the driver and its workers, gRPC and Flight alike,
//! carries it, and every server checks it before the call does anything.
//!
//! ```text
//!   client ── AttachSecret ──► "authorization: Bearer <secret>" ──► CheckSecret ── server
//!                                                           (wrong or missing: Unauthenticated)
//! ```
//!
//! Invariants: the comparison takes the same time wherever the given token differs (`subtle`); the
//! secret never appears in `Debug` output, error messages or a command line (`--mode cluster`
//! hands it to its workers on their stdin).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig,
};
use tonic::{Request, Status};

use crate::net::endpoint;

/// The metadata key the secret travels in.
const KEY: &str = "authorization";

/// A shared secret of one cluster (printable ASCII, no spaces).
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<str>);

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(…)")
    }
}

impl ClusterSecret {
    /// A secret from its text (a file's or an environment variable's; surrounding whitespace is
    /// dropped). Empty text, or text that is not printable ASCII, is an error.
    pub fn new(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.is_empty() {
            return Err(DataFusionError::Configuration(
                "the cluster secret is empty".to_string(),
            ));
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(DataFusionError::Configuration(
                "the cluster secret must be printable ASCII without spaces".to_string(),
            ));
        }
        Ok(Self(text.into()))
    }

    /// 32 random bytes from the operating system, as hex.
    pub fn random() -> Result<Self> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| {
            DataFusionError::Execution(format!("cannot make a random cluster secret: {e}"))
        })?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self(hex.into()))
    }

    /// The text, to hand to a worker (never to print).
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn header(&self) -> Result<MetadataValue<Ascii>> {
        format!("Bearer {}", self.0)
            .parse()
            .map_err(|_| DataFusionError::Configuration("bad cluster secret".to_string()))
    }
}

/// Adds the secret to every request of a client.
#[derive(Clone)]
pub(crate) struct AttachSecret(MetadataValue<Ascii>);

impl Interceptor for AttachSecret {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request.metadata_mut().insert(KEY, self.0.clone());
        Ok(request)
    }
}

/// Lets a request through only when it carries the secret.
#[derive(Clone)]
pub(crate) struct CheckSecret(Arc<[u8]>);

impl CheckSecret {
    pub fn new(secret: &ClusterSecret) -> Result<Self> {
        Ok(Self(secret.header()?.as_bytes().into()))
    }
}

impl Interceptor for CheckSecret {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let given = request
            .metadata()
            .get(KEY)
            .map(|value| value.as_bytes())
            .unwrap_or_default();
        if bool::from(given.ct_eq(&self.0)) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(
                "this call lacks the cluster's secret (or carries a wrong one)",
            ))
        }
    }
}

/// `service`, answering only calls that carry the link's secret.
pub(crate) fn guarded<S>(
    service: S,
    link: &ClusterLink,
) -> Result<InterceptedService<S, CheckSecret>> {
    Ok(InterceptedService::new(
        service,
        CheckSecret::new(&link.secret)?,
    ))
}

/// Mutual TLS between the driver and the workers: this process's certificate and key (it serves
/// and calls with them) and the CA that signed every peer's.
#[derive(Clone)]
pub struct ClusterTls {
    identity: Identity,
    ca: Certificate,
    /// Where they were read from, to hand to spawned workers.
    pub files: TlsFiles,
}

/// The PEM files of a [`ClusterTls`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This process's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA every peer's certificate must be signed by.
    pub ca: PathBuf,
}

impl fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterTls")
            .field("files", &self.files)
            .finish()
    }
}

impl ClusterTls {
    /// Reads the three PEM files; an unreadable one is an error naming it.
    pub fn from_files(files: TlsFiles) -> Result<Self> {
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).map_err(|e| {
                DataFusionError::Configuration(format!(
                    "cannot read the TLS {what} {}: {e}",
                    path.display()
                ))
            })
        };
        let (cert, key, ca) = (
            read(&files.cert, "certificate")?,
            read(&files.key, "key")?,
            read(&files.ca, "CA certificate")?,
        );
        Ok(Self {
            identity: Identity::from_pem(cert, key),
            ca: Certificate::from_pem(ca),
            files,
        })
    }
}

/// How this process talks to the rest of its cluster: the secret every call carries and, when set,
/// mutual TLS.
#[derive(Debug, Clone)]
pub struct ClusterLink {
    secret: ClusterSecret,
    tls: Option<Arc<ClusterTls>>,
}

impl ClusterLink {
    /// The link of a cluster started with `secret` (`None`: a random one) and `tls`.
    pub fn for_cluster(secret: Option<&ClusterSecret>, tls: Option<&ClusterTls>) -> Result<Self> {
        let secret = match secret {
            Some(secret) => secret.clone(),
            None => ClusterSecret::random()?,
        };
        Ok(Self::new(secret, tls.cloned()))
    }

    /// A link with `secret`, over TLS when `tls` is given.
    pub fn new(secret: ClusterSecret, tls: Option<ClusterTls>) -> Self {
        Self {
            secret,
            tls: tls.map(Arc::new),
        }
    }

    /// The secret.
    pub fn secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// The TLS setup, if any.
    pub fn tls(&self) -> Option<&ClusterTls> {
        self.tls.as_deref()
    }

    /// An endpoint for `address` (`host:port`): `https` with this process's certificate and the
    /// cluster CA under TLS, `http` otherwise.
    pub(crate) fn endpoint(&self, address: &str) -> Result<Endpoint> {
        let Some(tls) = &self.tls else {
            return endpoint(address);
        };
        sluice_runtime::install_default_crypto_provider();
        let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
        let config = ClientTlsConfig::new()
            .ca_certificate(tls.ca.clone())
            .identity(tls.identity.clone())
            .domain_name(host.trim_start_matches('[').trim_end_matches(']'));
        Endpoint::from_shared(format!("https://{address}"))
            .map(crate::net::tuned)
            .map_err(|e| DataFusionError::Configuration(format!("bad address '{address}': {e}")))?
            .tls_config(config)
            .map_err(|e| {
                DataFusionError::Configuration(format!("TLS setup for {address} failed: {e}"))
            })
    }

    /// A server builder: it pings its clients as they ping it (a connection whose client went
    /// silent, behind a cut link, is closed after the interval and the timeout, and what its calls
    /// held is let go), and under TLS it presents this process's certificate and requires a client
    /// certificate signed by the cluster CA. Its clients may send it frames of up to
    /// [`MAX_FRAME_SIZE`](crate::net::MAX_FRAME_SIZE).
    pub(crate) fn server(&self) -> Result<Server> {
        let server = Server::builder()
            .http2_keepalive_interval(Some(crate::net::KEEP_ALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(crate::net::KEEP_ALIVE_TIMEOUT))
            .max_frame_size(crate::net::MAX_FRAME_SIZE);
        match &self.tls {
            None => Ok(server),
            Some(tls) => {
                sluice_runtime::install_default_crypto_provider();
                server
                    .tls_config(
                        ServerTlsConfig::new()
                            .identity(tls.identity.clone())
                            .client_ca_root(tls.ca.clone()),
                    )
                    .map_err(|e| DataFusionError::Configuration(format!("TLS server setup: {e}")))
            }
        }
    }
}

/// A client channel that carries the secret.
pub(crate) type SecretChannel = InterceptedService<Channel, AttachSecret>;

/// A channel to `address`, connected on first use, carrying the link's secret (over TLS when set).
pub(crate) fn connect_lazy(address: &str, link: &ClusterLink) -> Result<SecretChannel> {
    Ok(InterceptedService::new(
        link.endpoint(address)?.connect_lazy(),
        AttachSecret(link.secret.header()?),
    ))
}

/// `channel` carrying the link's secret.
pub(crate) fn with_secret(channel: Channel, link: &ClusterLink) -> Result<SecretChannel> {
    Ok(InterceptedService::new(
        channel,
        AttachSecret(link.secret.header()?),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(secret: &ClusterSecret, header: Option<&str>) -> Result<(), Status> {
        let mut request = Request::new(());
        if let Some(header) = header {
            request.metadata_mut().insert(KEY, header.parse().unwrap());
        }
        CheckSecret::new(secret).unwrap().call(request).map(|_| ())
    }

    #[test]
    fn only_the_right_secret_passes() {
        let secret = ClusterSecret::new("s3cret").unwrap();
        assert!(check(&secret, Some("Bearer s3cret")).is_ok());
        for wrong in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("s3cret"),
        ] {
            let status = check(&secret, wrong).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{wrong:?}");
        }
        let mut attached = Request::new(());
        attached = AttachSecret(secret.header().unwrap())
            .call(attached)
            .unwrap();
        let mut checker = CheckSecret::new(&secret).unwrap();
        assert!(checker.call(attached).is_ok());
    }

    #[test]
    fn secrets_are_random_printable_and_never_shown() {
        let (a, b) = (
            ClusterSecret::random().unwrap(),
            ClusterSecret::random().unwrap(),
        );
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 64);
        assert_eq!(format!("{a:?}"), "ClusterSecret(…)");
        assert_eq!(ClusterSecret::new(" x \n").unwrap().expose(), "x");
        assert!(ClusterSecret::new("  ").is_err());
        assert!(ClusterSecret::new("a b").is_err());
    }
}
