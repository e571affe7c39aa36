//! Which object store serves which URL: built lazily, in each process, from that process's own
//! environment.
//!
//! A plan names its files by URL (`s3://bucket/trips/part-0.parquet`); the plan travels to workers
//! without any credential. When a scan in any process (the driver listing a table, a worker reading
//! byte ranges) first meets `scheme://authority`, [`ObjectStores`] builds the store for it with the
//! builders' standard variables of *that* process (`AWS_*`, `GOOGLE_*`, `AZURE_*`) and keeps it for
//! the process's life:
//!
//! ```text
//!   driver:  SQL ─► plan (URLs only) ─► task definition ─┐        worker:  get_store(s3://bucket)
//!            get_store(s3://bucket) ◄─ AWS_* of driver   └──────►          ◄─ AWS_* of worker
//! ```
//!
//! Invariants: a store is built once per `scheme://authority` and process; `file://` is the local
//! file system (DataFusion's default); every remote store gets [`StoreLimits`], so a refused or
//! unreachable endpoint fails within the budget, never after object_store's default of minutes
//! (403 and 404 are not retried, 5xx and timeouts are, within the budget). No store, builder or
//! option is ever printed: they hold secrets.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::http::HttpBuilder;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use url::Url;

/// The time and retry budget of every remote store's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// How long a connection may take to open.
    pub connect_timeout: Duration,
    /// How long one request may take, body included.
    pub request_timeout: Duration,
    /// How many times a request that met a 5xx, a timeout or a broken connection is made again.
    pub max_retries: usize,
    /// How long after its first try a request is no longer made again.
    pub retry_timeout: Duration,
}

impl Default for StoreLimits {
    /// A closed port fails within about 10 s: 3 s to connect, retried twice within 8 s.
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(60),
            max_retries: 2,
            retry_timeout: Duration::from_secs(8),
        }
    }
}

impl StoreLimits {
    fn client_options(&self) -> ClientOptions {
        ClientOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_timeout(self.request_timeout)
    }

    fn retry(&self) -> RetryConfig {
        RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: self.max_retries,
            retry_timeout: self.retry_timeout,
        }
    }
}

/// The URL schemes Sluice reads and writes besides local paths.
pub const REMOTE_SCHEMES: &[&str] = &["s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https"];

/// Whether `location` is a URL of a remote store (rather than a local path or `file://`).
pub fn is_remote(location: &str) -> bool {
    location
        .split_once("://")
        .is_some_and(|(scheme, _)| REMOTE_SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()))
}

/// The object store registry of a Sluice process (driver or worker): local files as DataFusion
/// does, remote stores built on first use from the process's environment.
pub struct ObjectStores {
    local: DefaultObjectStoreRegistry,
    remote: DashMap<String, Arc<dyn ObjectStore>>,
    limits: StoreLimits,
}

impl std::fmt::Debug for ObjectStores {
    /// Names the stores only, never their settings (they hold credentials).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStores")
            .field(
                "remote",
                &self
                    .remote
                    .iter()
                    .map(|e| e.key().clone())
                    .collect::<Vec<_>>(),
            )
            .field("limits", &self.limits)
            .finish()
    }
}

impl ObjectStores {
    /// A registry whose remote stores obey `limits`.
    pub fn new(limits: StoreLimits) -> Self {
        Self {
            local: DefaultObjectStoreRegistry::new(),
            remote: DashMap::new(),
            limits,
        }
    }

    /// The registry as DataFusion's runtime takes it.
    pub fn into_registry(self) -> Arc<dyn ObjectStoreRegistry> {
        Arc::new(self)
    }
}

/// `scheme://authority`: the key one store serves.
fn store_key(url: &Url) -> String {
    format!("{}://{}", url.scheme(), url.authority())
}

impl ObjectStoreRegistry for ObjectStores {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        if url.scheme() == "file" {
            return self.local.register_store(url, store);
        }
        self.remote.insert(store_key(url), store)
    }

    fn deregister_store(&self, url: &Url) -> Result<Arc<dyn ObjectStore>> {
        if url.scheme() == "file" {
            return self.local.deregister_store(url);
        }
        self.remote
            .remove(&store_key(url))
            .map(|(_, store)| store)
            .ok_or_else(|| {
                DataFusionError::Execution(format!("no object store for {}", store_key(url)))
            })
    }

    fn get_store(&self, url: &Url) -> Result<Arc<dyn ObjectStore>> {
        if url.scheme() == "file" {
            return self.local.get_store(url);
        }
        let key = store_key(url);
        if let Some(store) = self.remote.get(&key) {
            return Ok(Arc::clone(store.value()));
        }
        let store = build_store(url, &self.limits)?;
        // Two scans racing to build one store keep whichever landed first.
        Ok(Arc::clone(self.remote.entry(key).or_insert(store).value()))
    }
}

/// Builds the store for `url`'s scheme and authority from this process's environment. The limits
/// go in first, so a variable the builders know (`AWS_ALLOW_HTTP`, a timeout) still applies.
fn build_store(url: &Url, limits: &StoreLimits) -> Result<Arc<dyn ObjectStore>> {
    let key = store_key(url);
    let host = url.host_str().unwrap_or_default();
    let failed = |e: object_store::Error| {
        DataFusionError::Execution(format!("cannot open object store {key}: {e}"))
    };
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" | "s3a" => {
            let builder = AmazonS3Builder::new()
                .with_client_options(limits.client_options())
                .with_retry(limits.retry());
            let builder = with_env(builder, "AWS_", |b, k, v| b.with_config(k, v));
            Arc::new(builder.with_bucket_name(host).build().map_err(failed)?)
        }
        "gs" => {
            let builder = GoogleCloudStorageBuilder::new()
                .with_client_options(limits.client_options())
                .with_retry(limits.retry());
            let builder = with_env(builder, "GOOGLE_", |b, k, v| b.with_config(k, v));
            Arc::new(builder.with_bucket_name(host).build().map_err(failed)?)
        }
        "az" | "abfs" | "abfss" => {
            let builder = MicrosoftAzureBuilder::new()
                .with_client_options(limits.client_options())
                .with_retry(limits.retry());
            let builder = with_env(builder, "AZURE_", |b, k, v| b.with_config(k, v));
            Arc::new(builder.with_url(url.as_str()).build().map_err(failed)?)
        }
        "http" | "https" => Arc::new(
            HttpBuilder::new()
                .with_url(key.clone())
                .with_retry(limits.retry())
                .with_client_options(limits.client_options().with_allow_http(true))
                .build()
                .map_err(failed)?,
        ),
        other => {
            return Err(DataFusionError::Plan(format!(
                "{url}: Sluice reads local paths and {} URLs, not {other}://",
                REMOTE_SCHEMES.join(", ")
            )));
        }
    };
    Ok(store)
}

/// Applies every variable of this process's environment that starts with `prefix` and that the
/// builder knows (as the builders' own `from_env` does) to `builder`.
fn with_env<B, K: std::str::FromStr>(
    builder: B,
    prefix: &str,
    with_config: impl Fn(B, K, String) -> B,
) -> B {
    std::env::vars_os()
        .filter_map(|(key, value)| Some((key.into_string().ok()?, value.into_string().ok()?)))
        .filter(|(key, _)| key.starts_with(prefix))
        .filter_map(|(key, value)| Some((key.to_ascii_lowercase().parse::<K>().ok()?, value)))
        .fold(builder, |builder, (key, value)| {
            with_config(builder, key, value)
        })
}
