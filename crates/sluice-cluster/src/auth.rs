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
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
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

/// `service`, answering only calls that carry `secret`.
pub(crate) fn guarded<S>(
    service: S,
    secret: &ClusterSecret,
) -> Result<InterceptedService<S, CheckSecret>> {
    Ok(InterceptedService::new(service, CheckSecret::new(secret)?))
}

/// A client channel that carries the secret.
pub(crate) type SecretChannel = InterceptedService<Channel, AttachSecret>;

/// A channel to `address`, connected on first use, carrying `secret`.
pub(crate) fn connect_lazy(address: &str, secret: &ClusterSecret) -> Result<SecretChannel> {
    Ok(InterceptedService::new(
        endpoint(address)?.connect_lazy(),
        AttachSecret(secret.header()?),
    ))
}

/// `channel` carrying `secret`.
pub(crate) fn with_secret(channel: Channel, secret: &ClusterSecret) -> Result<SecretChannel> {
    Ok(InterceptedService::new(
        channel,
        AttachSecret(secret.header()?),
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
