//! Typed configuration and where each value came from.
//!
//! Layers, later ones winning: built-in defaults, then an optional TOML file (`--config FILE`), then
//! `SLUICE_*` environment variables, then command-line flags. Every key is known: an unknown key in the
//! file, an unknown `SLUICE_*` variable or an unknown DataFusion setting is an error naming the key and
//! where it came from, never silently ignored.
//!
//! DataFusion session settings (`datafusion.*`) pass through unchanged and are validated against
//! DataFusion's own `ConfigOptions` when the layer that sets them is applied.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use datafusion::prelude::SessionConfig;

use crate::error::{Result, SluiceError};
use crate::joins::JoinStrategy;

/// How queries execute. Each mode is one `sluice_runtime::JobRunner`, built by the front end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExecutionMode {
    /// In-process DataFusion (`execute_stream`): the embedded default.
    #[default]
    Local,
    /// The job graph run by the driver on one in-process worker: stages, shuffles and
    /// task regions exactly as a cluster runs them, without networking.
    LocalGraph,
    /// A driver and `workers` workers in this process, talking only through gRPC and Arrow Flight
    /// on loopback, exactly as separate processes do.
    LocalCluster,
    /// The driver in this process and `workers` worker processes it starts (and any worker that
    /// joins its address).
    Cluster,
}

impl ExecutionMode {
    /// Every mode, in the order `--help` lists them.
    pub const ALL: &'static [ExecutionMode] = &[
        ExecutionMode::Local,
        ExecutionMode::LocalGraph,
        ExecutionMode::LocalCluster,
        ExecutionMode::Cluster,
    ];

    /// The name used on the command line and in config files.
    pub fn name(self) -> &'static str {
        match self {
            ExecutionMode::Local => "local",
            ExecutionMode::LocalGraph => "local-graph",
            ExecutionMode::LocalCluster => "local-cluster",
            ExecutionMode::Cluster => "cluster",
        }
    }

    /// Whether this mode runs queries through a job graph (every mode but `local`).
    pub fn is_distributed(self) -> bool {
        self != ExecutionMode::Local
    }

    /// DataFusion settings this mode needs for correct results, applied over every layer: a job-graph
    /// mode needs [`sluice_planner::DISTRIBUTED_SETTINGS`].
    pub fn required_settings(self) -> &'static [(&'static str, &'static str)] {
        match self {
            ExecutionMode::Local => &[],
            ExecutionMode::LocalGraph | ExecutionMode::LocalCluster | ExecutionMode::Cluster => {
                sluice_planner::DISTRIBUTED_SETTINGS
            }
        }
    }
}

impl fmt::Display for ExecutionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ExecutionMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ExecutionMode::ALL
            .iter()
            .copied()
            .find(|mode| mode.name() == s)
            .ok_or_else(|| {
                let known: Vec<_> = ExecutionMode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mode '{s}' (known: {})", known.join(", "))
            })
    }
}

/// A memory size in bytes, written `512M`, `4G`, `4GiB` or a plain byte count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text = s.trim();
        let split = text
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: f64 = number
            .parse()
            .map_err(|_| format!("'{s}' is not a size (try 512M or 4G)"))?;
        let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            "t" | "tb" | "tib" => 1 << 40,
            other => return Err(format!("unknown size unit '{other}' in '{s}'")),
        };
        let bytes = number * factor as f64;
        if !(bytes.is_finite() && bytes >= 1.0) {
            return Err(format!("size '{s}' must be at least one byte"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [
            ("T", 1 << 40),
            ("G", 1 << 30),
            ("M", 1 << 20),
            ("K", 1 << 10),
        ];
        for (unit, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{unit}", self.0 / size);
            }
        }
        write!(f, "{}", self.0)
    }
}

/// A value together with the layer that set it, so `sluice config` can say why it is what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    /// The value.
    pub value: T,
    /// `default`, a file path, an environment variable or a flag.
    pub source: String,
}

impl<T> Sourced<T> {
    pub fn new(value: T, source: impl Into<String>) -> Self {
        Self {
            value,
            source: source.into(),
        }
    }
}

/// Declares every Sluice setting once: its field, type, default, environment variable, parser,
/// how `sluice config` prints it, and its help line. From that list come the fields of
/// [`SluiceConfig`] (each value with its source) and [`ConfigLayer`], the TOML file's keys, the
/// environment variables, how a layer applies, and the settings part of [`SluiceConfig::to_toml`].
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])*
        $name:ident: $ty:ty = $default:expr,
            env $env:literal, parse $parse:expr, show $show:expr, help $help:literal;
    )*) => {
        /// The effective configuration.
        #[derive(Debug, Clone)]
        pub struct SluiceConfig {
            $(
                $(#[doc = $doc])*
                pub $name: Sourced<$ty>,
            )*
            /// DataFusion settings (`datafusion.*`), validated, by key.
            pub session: BTreeMap<String, Sourced<String>>,
        }

        impl Default for SluiceConfig {
            fn default() -> Self {
                Self {
                    $( $name: Sourced::new($default, "default"), )*
                    // `SHOW` and `information_schema` are what a data engineer reaches for first.
                    session: BTreeMap::from([(
                        "datafusion.catalog.information_schema".to_string(),
                        Sourced::new("true".to_string(), "default"),
                    )]),
                }
            }
        }

        /// The settings a layer may carry; `None` leaves the lower layer's value.
        #[derive(Debug, Clone, Default)]
        pub struct ConfigLayer {
            $(
                $(#[doc = $doc])*
                pub $name: Option<$ty>,
            )*
            /// DataFusion settings as `(key, value)`.
            pub session: Vec<(String, String)>,
        }

        /// Every setting's key, environment variable and help line, in `sluice config`'s order.
        pub const SETTINGS: &[SettingInfo] = &[
            $( SettingInfo { key: stringify!($name), env: $env, help: $help }, )*
        ];

        impl ConfigLayer {
            /// Sets the setting `key` from its text; `None` when no setting has that key.
            fn set_text(&mut self, key: &str, text: &str) -> Option<Result<(), String>> {
                match key {
                    $(
                        stringify!($name) => {
                            let parse: fn(&str) -> Result<$ty, String> = $parse;
                            Some(parse(text).map(|value| self.$name = Some(value)))
                        }
                    )*
                    _ => None,
                }
            }
        }

        impl SluiceConfig {
            /// Takes `layer`'s settings (not its DataFusion ones) over these, sourced `source`.
            fn apply_settings(&mut self, layer: &mut ConfigLayer, source: &str) {
                $(
                    if let Some(value) = layer.$name.take() {
                        self.$name = Sourced::new(value, source);
                    }
                )*
            }

            /// The settings as TOML lines with their sources (one left out when it shows nothing).
            fn settings_toml(&self, out: &mut String) {
                use std::fmt::Write;
                $(
                    let show: fn(&$ty) -> Option<String> = $show;
                    if let Some(text) = show(&self.$name.value) {
                        let _ = writeln!(
                            out,
                            "{} = {text}  # from {}",
                            stringify!($name),
                            self.$name.source
                        );
                    }
                )*
            }
        }
    };
}

/// One declared setting, for help texts and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettingInfo {
    /// Its key in config files (and the field of [`SluiceConfig`]).
    pub key: &'static str,
    /// Its environment variable.
    pub env: &'static str,
    /// What it sets.
    pub help: &'static str,
}

/// A quoted TOML string.
fn quoted(text: impl fmt::Display) -> Option<String> {
    Some(format!("\"{text}\""))
}

fn parse_named<T: FromStr<Err = String>>(text: &str) -> Result<T, String> {
    text.trim().parse()
}

settings! {
    /// Which job runner executes queries.
    mode: ExecutionMode = ExecutionMode::default(),
        env "SLUICE_MODE", parse parse_named, show |m| quoted(m),
        help "execution mode";
    /// Memory budget for query execution; `None` is unbounded.
    memory_limit: Option<ByteSize> = None,
        env "SLUICE_MEMORY_LIMIT", parse parse_memory_limit,
        show |l| quoted(l.map_or_else(|| "unlimited".to_string(), |b| b.to_string())),
        help "memory budget, e.g. 4G, or 'unlimited'";
    /// Workers of a local cluster, or worker processes of a cluster (default 2 in `--mode cluster`).
    workers: usize = DEFAULT_WORKERS,
        env "SLUICE_WORKERS",
        parse |t| t.trim().parse().map_err(|_| format!("'{t}' is not a number of workers")),
        show |n| Some(n.to_string()),
        help "workers of a local cluster, or worker processes of a cluster";
    /// Compression of Arrow IPC on the Flight data plane.
    flight_compression: FlightCompression = FlightCompression::None,
        env "SLUICE_FLIGHT_COMPRESSION", parse parse_named, show |c| quoted(c.name()),
        help "Arrow IPC compression between workers: none, lz4 or zstd";
    /// How stage outputs move between stages in the distributed modes.
    exchange: ExchangeMode = ExchangeMode::Pipelined,
        env "SLUICE_EXCHANGE", parse parse_named, show |e| quoted(e.name()),
        help "how stage outputs move between stages: pipelined or blocking";
    /// Which algorithm partitioned equi-joins use (see [`crate::joins`]).
    joins: JoinStrategy = JoinStrategy::Auto,
        env "SLUICE_JOINS", parse parse_named, show |j| quoted(j.name()),
        help "partitioned joins: auto (hash; under a memory limit, a query that runs out of \
              memory runs again with sort-merge joins), hash or sort-merge";
    /// Cluster mode: where the driver listens for workers (`None`: 127.0.0.1, a free port).
    driver_listen: Option<String> = None,
        env "SLUICE_DRIVER_LISTEN", parse |t| Ok(Some(t.trim().to_string())),
        show |l| l.as_ref().and_then(quoted),
        help "cluster mode: where the driver listens for workers";
    /// Cluster mode: workers that must have joined before the first query (`None`: `workers`).
    min_workers: Option<usize> = None,
        env "SLUICE_MIN_WORKERS", parse |t| parse_workers(t).map(Some),
        show |n| n.map(|n| n.to_string()),
        help "cluster mode: workers that must have joined before the first query, and the \
              fewest kept";
    /// Cluster mode: the most workers its cluster manager keeps (`None`: the larger of `workers`
    /// and `min_workers`); workers started elsewhere may join beyond it.
    max_workers: Option<usize> = None,
        env "SLUICE_MAX_WORKERS", parse |t| parse_workers(t).map(Some),
        show |n| n.map(|n| n.to_string()),
        help "cluster mode: the most workers started while task regions wait for slots";
    /// Cluster mode: how long a worker its cluster manager started may stay idle before it is let
    /// go (down to `min_workers`).
    worker_idle_timeout: Duration = DEFAULT_WORKER_IDLE_TIMEOUT,
        env "SLUICE_WORKER_IDLE_TIMEOUT", parse parse_duration,
        show |d| quoted(format_duration(*d)),
        help "cluster mode: how long a started worker may stay idle before it is let go, e.g. 60s";
    /// Task slots of each worker (`sluice worker`, and each worker a cluster starts); `None`: the
    /// worker's default.
    slots: Option<usize> = None,
        env "SLUICE_SLOTS", parse |t| parse_at_least_one(t, "slots").map(Some),
        show |n| n.map(|n| n.to_string()),
        help "task slots of each worker";
    /// Cluster mode: where workers come from.
    cluster_manager: ClusterManagerKind = ClusterManagerKind::Process,
        env "SLUICE_CLUSTER_MANAGER", parse parse_named, show |m| quoted(m.name()),
        help "cluster mode: where workers come from: process (children of the driver) or \
              kubernetes (worker pods)";
    /// `cluster_manager = "kubernetes"`: the worker pods' namespace (`None`: the driver pod's, or
    /// the kubeconfig context's).
    kubernetes_namespace: Option<String> = None,
        env "SLUICE_KUBERNETES_NAMESPACE", parse |t| Ok(Some(t.trim().to_string())),
        show |n| n.as_ref().and_then(quoted),
        help "kubernetes: the worker pods' namespace (default: the driver's)";
    /// `cluster_manager = "kubernetes"`: the worker image.
    kubernetes_image: String = "sluice:latest".to_string(),
        env "SLUICE_KUBERNETES_IMAGE", parse |t| Ok(t.trim().to_string()), show |i| quoted(i),
        help "kubernetes: the worker pods' image";
    /// `cluster_manager = "kubernetes"`: a pod template file (YAML), merged under Sluice's fields.
    kubernetes_pod_template: Option<String> = None,
        env "SLUICE_KUBERNETES_POD_TEMPLATE", parse |t| Ok(Some(t.trim().to_string())),
        show |p| p.as_ref().and_then(quoted),
        help "kubernetes: a pod template file (YAML) for the worker pods";
    /// `cluster_manager = "kubernetes"`: the Secret (key `secret`) holding the cluster secret.
    kubernetes_secret: String = "sluice-cluster-secret".to_string(),
        env "SLUICE_KUBERNETES_SECRET", parse |t| Ok(t.trim().to_string()), show |n| quoted(n),
        help "kubernetes: the Secret whose key 'secret' holds the cluster secret";
    /// `cluster_manager = "kubernetes"`: the worker pods' service account.
    kubernetes_service_account: Option<String> = None,
        env "SLUICE_KUBERNETES_SERVICE_ACCOUNT", parse |t| Ok(Some(t.trim().to_string())),
        show |n| n.as_ref().and_then(quoted),
        help "kubernetes: the worker pods' service account";
    /// `cluster_manager = "kubernetes"`: the driver's address as workers reach it (`None`:
    /// `$SLUICE_POD_IP` and the driver's port).
    kubernetes_driver_address: Option<String> = None,
        env "SLUICE_KUBERNETES_DRIVER_ADDRESS", parse |t| Ok(Some(t.trim().to_string())),
        show |a| a.as_ref().and_then(quoted),
        help "kubernetes: the driver's address as worker pods reach it (default: its pod IP)";
    /// How long a task region that needs more task slots than the live workers have waits for
    /// workers to join (or be replaced) before its job fails.
    capacity_wait: Duration = sluice_runtime::driver::DEFAULT_CAPACITY_WAIT,
        env "SLUICE_CAPACITY_WAIT", parse parse_duration, show |d| quoted(format_duration(*d)),
        help "how long a task region waits for enough task slots (workers joining or replaced), \
              e.g. 60s";
    /// Attempts of a task region (a task whose worker process died counts too; one cut off by
    /// the network does not) before its job fails.
    max_task_attempts: usize = DEFAULT_MAX_TASK_ATTEMPTS,
        env "SLUICE_MAX_TASK_ATTEMPTS", parse parse_task_attempts, show |n| Some(n.to_string()),
        help "attempts of a task region before its job fails (at least 1)";
    /// `sluice server` with user accounts: where readers and writers may read (paths or URLs;
    /// empty: `--data`'s directory).
    read_roots: Vec<String> = Vec::new(),
        env "SLUICE_READ_ROOTS", parse parse_list, show |roots| toml_list(roots),
        help "server: where non-admin users may read, comma-separated paths or URLs \
              (default: --data's directory)";
    /// `sluice server` with user accounts: where writers may write (paths or URLs).
    write_roots: Vec<String> = Vec::new(),
        env "SLUICE_WRITE_ROOTS", parse parse_list, show |roots| toml_list(roots),
        help "server: where writers may write, comma-separated paths or URLs";
    /// `sluice server`: the most a statement's result may hold in the server's memory where it
    /// is buffered (a statement followed by others in one Postgres query string).
    result_buffer: ByteSize = ByteSize(64 << 20),
        env "SLUICE_RESULT_BUFFER", parse parse_named, show |b| quoted(b),
        help "server: the most one statement's buffered result may hold, e.g. 64M";
    /// `sluice server`: the most a Flight SQL client's bound parameters may hold.
    max_parameter_bytes: ByteSize = ByteSize(1 << 20),
        env "SLUICE_MAX_PARAMETER_BYTES", parse parse_named, show |b| quoted(b),
        help "server: the most one binding of a prepared statement's parameters may hold";
    /// `sluice server`: open prepared statements per Flight SQL session.
    max_prepared_statements: usize = 100,
        env "SLUICE_MAX_PREPARED_STATEMENTS", parse |t| parse_at_least_one(t, "max_prepared_statements"),
        show |n| Some(n.to_string()),
        help "server: open prepared statements per Flight SQL session";
    /// `sluice server`: how long a prepared statement may go unused before it is closed.
    prepared_statement_idle: Duration = Duration::from_secs(600),
        env "SLUICE_PREPARED_STATEMENT_IDLE", parse parse_duration,
        show |d| quoted(format_duration(*d)),
        help "server: how long a prepared statement may go unused before it is closed, e.g. 10m";
    /// `sluice server`: Flight SQL sessions one user may hold open at once.
    max_sessions_per_user: usize = 16,
        env "SLUICE_MAX_SESSIONS_PER_USER", parse |t| parse_at_least_one(t, "max_sessions_per_user"),
        show |n| Some(n.to_string()),
        help "server: Flight SQL sessions one user may hold open at once";
    /// `sluice server` with accounts: failed logins allowed per user name and per client address
    /// within a minute, before that name or address is refused for a minute.
    max_failed_logins: usize = 5,
        env "SLUICE_MAX_FAILED_LOGINS", parse |t| parse_at_least_one(t, "max_failed_logins"),
        show |n| Some(n.to_string()),
        help "server: failed logins per user name and per address within a minute";
}

/// A whole number of at least 1 for setting `key`.
fn parse_at_least_one(text: &str, key: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "{key} must be a whole number of at least 1, not '{text}'"
        )),
    }
}

/// Comma-separated items, trimmed, empty ones left out.
fn parse_list(text: &str) -> Result<Vec<String>, String> {
    Ok(text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(ToString::to_string)
        .collect())
}

/// A TOML array of strings (`None` when empty: nothing to show).
fn toml_list(items: &[String]) -> Option<String> {
    if items.is_empty() {
        return None;
    }
    let quoted: Vec<String> = items
        .iter()
        .map(|item| toml::Value::String(item.clone()).to_string())
        .collect();
    Some(format!("[{}]", quoted.join(", ")))
}

/// The default [`SluiceConfig::worker_idle_timeout`].
pub const DEFAULT_WORKER_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The default [`SluiceConfig::max_task_attempts`].
pub const DEFAULT_MAX_TASK_ATTEMPTS: usize = 4;

/// Parses a count of attempts (at least 1).
pub fn parse_task_attempts(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "max_task_attempts must be a whole number of at least 1, not '{text}'"
        )),
    }
}

/// Parses a duration: a number with `ms`, `s`, `m` or `h` (a plain number is seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a duration (try 500ms, 60s or 2m)"))?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        other => return Err(format!("unknown duration unit '{other}' in '{text}'")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("'{text}' is not a duration"))
}

/// A duration as [`parse_duration`] reads it back: whole seconds as `60s`, else milliseconds.
pub fn format_duration(duration: Duration) -> String {
    if duration.subsec_millis() == 0 {
        format!("{}s", duration.as_secs())
    } else {
        format!("{}ms", duration.as_millis())
    }
}

/// Environment variables Sluice reads besides its settings' own (read where they are used).
const OTHER_ENV_VARS: &[(&str, &str)] = &[
    (
        "SLUICE_SET",
        "DataFusion settings, 'key=value' separated by commas",
    ),
    (
        "SLUICE_SECRET",
        "cluster mode and sluice worker: the cluster secret (read by the CLI, not a setting)",
    ),
    (
        "SLUICE_LOG",
        "which log lines go to stderr, e.g. info or sluice::driver=debug (read by the CLI)",
    ),
    (
        "SLUICE_LOG_FORMAT",
        "log lines as text or json, like --log-format (read by the CLI)",
    ),
    (
        "SLUICE_OTLP_ENDPOINT",
        "where to export spans over OTLP/gRPC, like --otlp-endpoint (read by the CLI)",
    ),
    (
        "SLUICE_FAILPOINTS",
        "worker processes built with the failpoints feature: faults to fire, \
         'point=[N*]action;...' (tests only; read by sluice worker)",
    ),
    (
        "SLUICE_FAILPOINTS_WORKERS",
        "the worker ids SLUICE_FAILPOINTS applies to, comma-separated (default 1)",
    ),
    (
        "SLUICE_POD_IP",
        "on Kubernetes (downward API status.podIP): a worker pod's address; the driver's, which \
         its worker pods reach",
    ),
    (
        "SLUICE_POD_NAME",
        "on Kubernetes (downward API metadata.name): the driver's pod, whose name its worker pods \
         carry",
    ),
    (
        "SLUICE_POD_UID",
        "on Kubernetes (downward API metadata.uid): the driver's pod, which owns its worker pods",
    ),
];

/// Every environment variable Sluice reads, with what it sets.
pub fn env_vars() -> Vec<(&'static str, &'static str)> {
    SETTINGS
        .iter()
        .map(|setting| (setting.env, setting.help))
        .chain(OTHER_ENV_VARS.iter().copied())
        .collect()
}

/// Where cluster mode's workers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClusterManagerKind {
    /// Worker processes of this machine, children of the driver (the default).
    #[default]
    Process,
    /// Worker pods on Kubernetes (a build with the `kubernetes` feature).
    Kubernetes,
}

impl ClusterManagerKind {
    /// The name used in config files and flags.
    pub fn name(self) -> &'static str {
        match self {
            ClusterManagerKind::Process => "process",
            ClusterManagerKind::Kubernetes => "kubernetes",
        }
    }
}

impl FromStr for ClusterManagerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "process" => Ok(ClusterManagerKind::Process),
            "kubernetes" => Ok(ClusterManagerKind::Kubernetes),
            other => Err(format!(
                "unknown cluster manager '{other}' (known: process, kubernetes)"
            )),
        }
    }
}

/// How stage outputs move to the stages that read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeMode {
    /// Read while written, producer and consumer scheduled together (the default).
    #[default]
    Pipelined,
    /// Written to files in full first; a stage starts when its inputs are complete, and a failed
    /// consumer re-reads them without recomputing its producers.
    Blocking,
}

impl ExchangeMode {
    /// The name used in config files and flags.
    pub fn name(self) -> &'static str {
        match self {
            ExchangeMode::Pipelined => "pipelined",
            ExchangeMode::Blocking => "blocking",
        }
    }

    /// The job graph's output mode of every stage that feeds another.
    pub fn output_mode(self) -> sluice_planner::OutputMode {
        match self {
            ExchangeMode::Pipelined => sluice_planner::OutputMode::Pipelined,
            ExchangeMode::Blocking => sluice_planner::OutputMode::Blocking,
        }
    }
}

impl FromStr for ExchangeMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "pipelined" => Ok(ExchangeMode::Pipelined),
            "blocking" => Ok(ExchangeMode::Blocking),
            other => Err(format!(
                "unknown exchange '{other}' (known: pipelined, blocking)"
            )),
        }
    }
}

/// Compression of Arrow IPC batches on the Flight data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlightCompression {
    /// Uncompressed (the default: on loopback, compressing costs CPU and saves nothing).
    #[default]
    None,
    /// LZ4 frames.
    Lz4,
    /// Zstandard.
    Zstd,
}

impl FlightCompression {
    /// The name used in config files and flags.
    pub fn name(self) -> &'static str {
        match self {
            FlightCompression::None => "none",
            FlightCompression::Lz4 => "lz4",
            FlightCompression::Zstd => "zstd",
        }
    }
}

impl FromStr for FlightCompression {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "none" => Ok(FlightCompression::None),
            "lz4" => Ok(FlightCompression::Lz4),
            "zstd" => Ok(FlightCompression::Zstd),
            other => Err(format!(
                "unknown flight compression '{other}' (known: none, lz4, zstd)"
            )),
        }
    }
}

/// Workers of a local cluster unless configured.
pub const DEFAULT_WORKERS: usize = 4;

/// Parses a worker count (at least 1).
pub fn parse_workers(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "workers must be a whole number of at least 1, not '{text}'"
        )),
    }
}

/// Parses a memory limit: a size, or `unlimited` / `none` for no limit.
pub fn parse_memory_limit(text: &str) -> Result<Option<ByteSize>, String> {
    match text.trim() {
        "unlimited" | "none" | "" => Ok(None),
        other => other.parse().map(Some),
    }
}

/// Splits `key=value`.
pub fn parse_setting(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("'{text}' is not key=value"))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(format!("'{text}' has an empty key"));
    }
    Ok((key.to_string(), value.trim().to_string()))
}

impl ConfigLayer {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| SluiceError::io(path, e))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parses TOML text; `source_name` names it in errors.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self> {
        let error = |message: String| SluiceError::Config {
            source_name: source_name.to_string(),
            message,
        };
        let table: toml::Table =
            toml::from_str(text).map_err(|e| error(e.message().to_string()))?;
        let mut layer = Self::default();
        for (key, value) in table {
            if key == "session" {
                let toml::Value::Table(session) = value else {
                    return Err(error("[session] must be a table of settings".to_string()));
                };
                layer
                    .session
                    .extend(session.into_iter().map(|(key, value)| {
                        let value = match value {
                            toml::Value::String(s) => s,
                            other => other.to_string(),
                        };
                        (key, value)
                    }));
                continue;
            }
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    value.to_string()
                }
                // A list of strings (`read_roots = ["/data", "s3://lake/"]`).
                toml::Value::Array(items)
                    if items
                        .iter()
                        .all(|item| matches!(item, toml::Value::String(_))) =>
                {
                    items
                        .iter()
                        .filter_map(toml::Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                }
                other => {
                    return Err(error(format!(
                        "{key}: expected a string or a number, not {}",
                        other.type_str()
                    )));
                }
            };
            match layer.set_text(&key, &text) {
                Some(Ok(())) => {}
                // Name the key unless the parser's message already does.
                Some(Err(message)) if message.contains(&key) => return Err(error(message)),
                Some(Err(message)) => return Err(error(format!("{key}: {message}"))),
                None => {
                    let known: Vec<&str> = SETTINGS.iter().map(|s| s.key).collect();
                    return Err(error(format!(
                        "unknown key `{key}` (known: {}, [session])",
                        known.join(", ")
                    )));
                }
            }
        }
        Ok(layer)
    }

    /// Reads `SLUICE_*` variables from `vars`; any other `SLUICE_*` name is an error.
    pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let mut layer = Self::default();
        for (name, value) in vars {
            if !name.starts_with("SLUICE_") {
                continue;
            }
            let error = |message: String| SluiceError::Config {
                source_name: format!("environment variable {name}"),
                message,
            };
            if let Some(setting) = SETTINGS.iter().find(|s| s.env == name) {
                if let Some(Err(message)) = layer.set_text(setting.key, &value) {
                    return Err(error(message));
                }
                continue;
            }
            match name.as_str() {
                "SLUICE_SET" => {
                    for item in value.split(',').filter(|s| !s.trim().is_empty()) {
                        layer.session.push(parse_setting(item).map_err(error)?);
                    }
                }
                // Read where they are used: the cluster secret (never shown by `sluice config`),
                // logging (set up by the CLI before the configuration is read), fault points
                // (read by worker processes at their start).
                known if OTHER_ENV_VARS.iter().any(|(n, _)| *n == known) => {}
                _ => {
                    let known: Vec<_> = env_vars().iter().map(|(n, _)| *n).collect();
                    return Err(error(format!(
                        "unknown Sluice variable (known: {})",
                        known.join(", ")
                    )));
                }
            }
        }
        Ok(layer)
    }
}

impl SluiceConfig {
    /// Applies `layer` over `self`; `source` names the layer in errors and in `sluice config`.
    pub fn apply(&mut self, mut layer: ConfigLayer, source: &str) -> Result<()> {
        self.apply_settings(&mut layer, source);
        for (key, value) in layer.session {
            validate_setting(&key, &value).map_err(|message| SluiceError::Config {
                source_name: source.to_string(),
                message,
            })?;
            self.session.insert(key, Sourced::new(value, source));
        }
        Ok(())
    }

    /// Whether partitioned equi-joins are planned as sort-merge joins from the start (`joins =
    /// "sort-merge"`).
    pub fn sort_merge_joins(&self) -> bool {
        self.joins.value.sort_merge()
    }

    /// Whether a query whose hash joins ran out of memory runs again with sort-merge joins (`joins
    /// = "auto"` under a memory limit; [`crate::join_fallback`]).
    pub fn join_fallback(&self) -> bool {
        self.joins
            .value
            .falls_back(self.memory_limit.value.is_some())
    }

    /// DataFusion settings Sluice derives from its own, unless the user set them, each with what it
    /// is derived from: under a memory limit, each sort's merge reservation is a 32nd of the limit
    /// (at least 256 KiB, at most DataFusion's 10 MiB), so that a small budget is not taken by the
    /// reservations of the sorts that run at once (two per sort-merge join partition) before any of
    /// them holds a row; in a distributed mode, [`Self::distributed_defaults`].
    pub fn derived_settings(&self) -> Vec<(&'static str, String, String)> {
        const SORT_RESERVATION: &str = "datafusion.execution.sort_spill_reservation_bytes";
        let mut derived = Vec::new();
        if let Some(limit) = self.memory_limit.value
            && !self.session.contains_key(SORT_RESERVATION)
        {
            let bytes = (limit.0 / 32).clamp(256 << 10, 10 << 20);
            derived.push((
                SORT_RESERVATION,
                bytes.to_string(),
                "memory_limit".to_string(),
            ));
        }
        if self.mode.value.is_distributed() {
            let from = format!("mode {}", self.mode.value);
            derived.extend(
                self.distributed_defaults()
                    .into_iter()
                    .map(|(key, value)| (key, value, from.clone())),
            );
        }
        derived
    }

    /// The settings a distributed run of this configuration plans with unless the user set them,
    /// whatever the mode (`EXPLAIN DISTRIBUTED` in a local session shows the plan a cluster would
    /// run): hash joins broadcast build sides estimated under
    /// [`sluice_planner::DISTRIBUTED_BROADCAST_THRESHOLD`], except when partitioned joins are
    /// sort-merge joins (`joins`): a broadcast hash join holds its whole build side in every task
    /// and cannot spill, so a memory-bounded plan keeps DataFusion's smaller threshold.
    pub fn distributed_defaults(&self) -> Vec<(&'static str, String)> {
        let (key, value) = sluice_planner::DISTRIBUTED_BROADCAST_THRESHOLD;
        if self.sort_merge_joins() || self.session.contains_key(key) {
            Vec::new()
        } else {
            vec![(key, value.to_string())]
        }
    }

    /// The DataFusion session configuration these settings describe.
    pub fn session_config(&self) -> Result<SessionConfig> {
        let mut config = sluice_runtime::options::with_sluice_options(SessionConfig::new());
        for (key, value, from) in self.derived_settings() {
            config
                .options_mut()
                .set(key, &value)
                .map_err(|e| SluiceError::Config {
                    source_name: from,
                    message: format!("setting {key}: {}", first_line(&e.to_string())),
                })?;
        }
        for (key, value) in &self.session {
            config
                .options_mut()
                .set(key, &value.value)
                .map_err(|e| SluiceError::Config {
                    source_name: value.source.clone(),
                    message: format!("setting {key}: {}", first_line(&e.to_string())),
                })?;
        }
        for (key, value) in self.mode.value.required_settings() {
            config
                .options_mut()
                .set(key, value)
                .map_err(|e| SluiceError::Config {
                    source_name: format!("mode {}", self.mode.value),
                    message: format!("setting {key}: {}", first_line(&e.to_string())),
                })?;
        }
        Ok(config)
    }

    /// The effective configuration as commented TOML, for `sluice config`. With `all`, every DataFusion
    /// setting is listed, not only those Sluice's layers set.
    pub fn to_toml(&self, all: bool) -> Result<String> {
        use std::fmt::Write;
        let mut out = String::new();
        self.settings_toml(&mut out);
        let _ = writeln!(out, "\n[session]");
        let derived = self.derived_settings();
        if all {
            let config = self.session_config()?;
            for entry in config.options().entries() {
                let value = entry.value.unwrap_or_default();
                let required = self.mode.value.required_settings();
                let source = if required.iter().any(|(k, _)| *k == entry.key) {
                    format!("mode {} (required)", self.mode.value)
                } else if let Some((_, _, from)) = derived.iter().find(|(k, ..)| *k == entry.key) {
                    from.clone()
                } else {
                    self.session
                        .get(&entry.key)
                        .map(|s| s.source.clone())
                        .unwrap_or_else(|| {
                            if entry.key.starts_with("sluice.") {
                                "Sluice default".into()
                            } else {
                                "DataFusion default".into()
                            }
                        })
                };
                let _ = writeln!(out, "{:?} = {:?}  # from {source}", entry.key, value);
            }
        } else {
            let required = self.mode.value.required_settings();
            for (key, value) in &self.session {
                if !required.iter().any(|(k, _)| k == key) {
                    let _ = writeln!(out, "{key:?} = {:?}  # from {}", value.value, value.source);
                }
            }
            for (key, value, from) in &derived {
                let _ = writeln!(out, "{key:?} = {value:?}  # from {from}");
            }
            for (key, value) in required {
                let _ = writeln!(
                    out,
                    "{key:?} = {value:?}  # from mode {} (required)",
                    self.mode.value
                );
            }
        }
        Ok(out)
    }
}

/// Checks one session setting against DataFusion's option table and Sluice's own (`sluice.*`).
fn validate_setting(key: &str, value: &str) -> Result<(), String> {
    let mut options = datafusion::config::ConfigOptions::new();
    options
        .extensions
        .insert(sluice_runtime::options::SluiceOptions::default());
    options
        .set(key, value)
        .map_err(|e| format!("setting {key} = '{value}': {}", first_line(&e.to_string())))
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn later_layers_win() {
        let mut config = SluiceConfig::default();
        let file = ConfigLayer::from_toml(
            r#"
            memory_limit = "1G"
            [session]
            "datafusion.execution.target_partitions" = 3
            "datafusion.execution.batch_size" = 1024
            "#,
            "test.toml",
        )
        .unwrap();
        config.apply(file, "test.toml").unwrap();
        let env_layer = ConfigLayer::from_env(env(&[
            ("SLUICE_MEMORY_LIMIT", "2G"),
            ("SLUICE_SET", "datafusion.execution.target_partitions=5"),
            ("PATH", "/bin"),
        ]))
        .unwrap();
        config.apply(env_layer, "environment").unwrap();
        let flags = ConfigLayer {
            session: vec![("datafusion.execution.target_partitions".into(), "7".into())],
            ..Default::default()
        };
        config.apply(flags, "--set").unwrap();

        assert_eq!(config.memory_limit.value, Some(ByteSize(2 << 30)));
        assert_eq!(config.memory_limit.source, "environment");
        let session = config.session_config().unwrap();
        assert_eq!(session.target_partitions(), 7);
        assert_eq!(session.batch_size(), 1024);
        assert_eq!(
            config.session["datafusion.execution.batch_size"].source,
            "test.toml"
        );
    }

    #[test]
    fn unknown_file_key_is_rejected_with_its_name() {
        let error = ConfigLayer::from_toml("modee = \"local\"", "x.toml").unwrap_err();
        let text = error.to_string();
        assert!(text.contains("x.toml") && text.contains("modee"), "{text}");
    }

    /// `sluice config`'s lines before `[session]`, each without its source comment.
    fn setting_lines(config: &SluiceConfig) -> Vec<String> {
        config
            .to_toml(false)
            .unwrap()
            .lines()
            .take_while(|line| !line.is_empty())
            .map(|line| line.split("  # from ").next().unwrap().to_string())
            .collect()
    }

    #[test]
    fn every_setting_reads_back_what_sluice_config_prints_from_a_file_and_its_variable() {
        let mut config = SluiceConfig::default();
        let layer = ConfigLayer::from_toml(
            "mode = \"local-graph\"\nmemory_limit = \"1G\"\nworkers = 3\n\
             flight_compression = \"zstd\"\nexchange = \"blocking\"\njoins = \"hash\"\n\
             driver_listen = \"0.0.0.0:7070\"\nmin_workers = 2\nmax_workers = 5\n\
             worker_idle_timeout = \"2s\"\nslots = 8\ncluster_manager = \"kubernetes\"\n\
             kubernetes_namespace = \"data\"\nkubernetes_image = \"registry.example/sluice:1\"\n\
             kubernetes_pod_template = \"/etc/sluice/pod.yaml\"\nkubernetes_secret = \"s\"\n\
             kubernetes_service_account = \"sa\"\nkubernetes_driver_address = \"d:7070\"\n\
             capacity_wait = \"1500ms\"\n\
             max_task_attempts = 2\nread_roots = [\"/data\", \"s3://lake/sf1/\"]\n\
             write_roots = \"/out\"\nresult_buffer = \"32M\"\nmax_parameter_bytes = \"2K\"\n\
             max_prepared_statements = 7\nprepared_statement_idle = \"1s\"\n\
             max_sessions_per_user = 3\nmax_failed_logins = 9\n",
            "t.toml",
        )
        .unwrap();
        config.apply(layer, "t.toml").unwrap();
        let lines = setting_lines(&config);
        // Every declared setting is printed once it is set.
        assert_eq!(lines.len(), SETTINGS.len(), "{lines:?}");
        assert_eq!(lines[8], "max_workers = 5");
        assert_eq!(lines[9], "worker_idle_timeout = \"2s\"");
        assert_eq!(lines[10], "slots = 8");
        assert_eq!(lines[11], "cluster_manager = \"kubernetes\"");
        assert_eq!(
            lines[13],
            "kubernetes_image = \"registry.example/sluice:1\""
        );
        assert_eq!(lines[18], "capacity_wait = \"1500ms\"");
        assert_eq!(lines[20], "read_roots = [\"/data\", \"s3://lake/sf1/\"]");
        assert_eq!(lines[21], "write_roots = [\"/out\"]");
        // Read back from a file.
        let mut again = SluiceConfig::default();
        again
            .apply(
                ConfigLayer::from_toml(&lines.join("\n"), "again").unwrap(),
                "again",
            )
            .unwrap();
        assert_eq!(setting_lines(&again), lines);
        // And from each setting's own variable.
        let mut from_env = SluiceConfig::default();
        for (line, setting) in lines.iter().zip(SETTINGS) {
            let (key, value) = line.split_once(" = ").unwrap();
            assert_eq!(key, setting.key);
            // A list's variable is its items, comma-separated.
            let value = match value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
                Some(items) => items
                    .split(", ")
                    .map(|item| item.trim_matches('"'))
                    .collect::<Vec<_>>()
                    .join(","),
                None => value.trim_matches('"').to_string(),
            };
            let layer = ConfigLayer::from_env([(setting.env.to_string(), value)]).unwrap();
            from_env.apply(layer, "environment").unwrap();
            assert_eq!(
                from_env
                    .to_toml(false)
                    .unwrap()
                    .lines()
                    .find(|l| l.starts_with(key)),
                Some(format!("{line}  # from environment").as_str()),
                "{key}"
            );
        }
        assert!(
            env_vars()
                .iter()
                .any(|(name, _)| *name == "SLUICE_CAPACITY_WAIT")
        );
    }

    #[test]
    fn durations_parse_and_print_and_bad_attempt_counts_are_refused() {
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(
            parse_duration("soon"),
            Err("'soon' is not a duration (try 500ms, 60s or 2m)".to_string())
        );
        assert_eq!(
            parse_duration("3 weeks"),
            Err("unknown duration unit 'weeks' in '3 weeks'".to_string())
        );
        assert_eq!(format_duration(Duration::from_secs(60)), "60s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(
            SluiceConfig::default().capacity_wait.value,
            Duration::from_secs(60)
        );
        let error = ConfigLayer::from_toml("max_task_attempts = 0", "a.toml").unwrap_err();
        assert_eq!(
            error.to_string(),
            "config a.toml: max_task_attempts must be a whole number of at least 1, not '0'"
        );
        let error = ConfigLayer::from_toml("capacity_wait = \"soon\"", "c.toml").unwrap_err();
        assert_eq!(
            error.to_string(),
            "config c.toml: capacity_wait: 'soon' is not a duration (try 500ms, 60s or 2m)"
        );
        let error = ConfigLayer::from_toml("modee = \"local\"", "x.toml").unwrap_err();
        assert_eq!(
            error.to_string(),
            "config x.toml: unknown key `modee` (known: mode, memory_limit, workers, \
             flight_compression, exchange, joins, driver_listen, min_workers, max_workers, \
             worker_idle_timeout, slots, cluster_manager, kubernetes_namespace, \
             kubernetes_image, kubernetes_pod_template, kubernetes_secret, \
             kubernetes_service_account, kubernetes_driver_address, capacity_wait, \
             max_task_attempts, read_roots, write_roots, result_buffer, max_parameter_bytes, \
             max_prepared_statements, prepared_statement_idle, max_sessions_per_user, \
             max_failed_logins, [session])"
        );
    }

    #[test]
    fn unknown_env_var_is_rejected() {
        let error = ConfigLayer::from_env(env(&[("SLUICE_MODDE", "local")])).unwrap_err();
        assert!(error.to_string().contains("SLUICE_MODDE"), "{error}");
    }

    #[test]
    fn unknown_datafusion_setting_is_rejected() {
        let mut config = SluiceConfig::default();
        let layer = ConfigLayer {
            session: vec![("datafusion.execution.no_such_thing".into(), "1".into())],
            ..Default::default()
        };
        let error = config.apply(layer, "--set").unwrap_err().to_string();
        assert!(
            error.contains("datafusion.execution.no_such_thing") && error.contains("--set"),
            "{error}"
        );
    }

    #[test]
    fn bad_setting_value_is_rejected() {
        let mut config = SluiceConfig::default();
        let layer = ConfigLayer {
            session: vec![(
                "datafusion.execution.target_partitions".into(),
                "many".into(),
            )],
            ..Default::default()
        };
        assert!(config.apply(layer, "--set").is_err());
    }

    #[test]
    fn unknown_mode_is_rejected() {
        assert!("distributed".parse::<ExecutionMode>().is_err());
        assert_eq!("local".parse::<ExecutionMode>(), Ok(ExecutionMode::Local));
    }

    #[test]
    fn byte_sizes_parse_and_print() {
        assert_eq!("4G".parse::<ByteSize>(), Ok(ByteSize(4 << 30)));
        assert_eq!("512MiB".parse::<ByteSize>(), Ok(ByteSize(512 << 20)));
        assert_eq!("100".parse::<ByteSize>(), Ok(ByteSize(100)));
        assert!("lots".parse::<ByteSize>().is_err());
        assert!("0".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(4 << 30).to_string(), "4G");
    }

    #[test]
    fn config_prints_sources() {
        let mut config = SluiceConfig::default();
        let layer = ConfigLayer {
            session: vec![("datafusion.execution.batch_size".into(), "512".into())],
            ..Default::default()
        };
        config.apply(layer, "--set").unwrap();
        let text = config.to_toml(false).unwrap();
        assert!(text.contains("mode = \"local\"  # from default"), "{text}");
        assert!(text.contains("\"datafusion.execution.batch_size\" = \"512\"  # from --set"));
        assert!(
            config
                .to_toml(true)
                .unwrap()
                .contains("datafusion.execution.target_partitions")
        );
    }

    #[test]
    fn joins_come_from_the_file_the_environment_and_follow_the_memory_limit() {
        let mut config = SluiceConfig::default();
        assert!(
            !config.sort_merge_joins() && !config.join_fallback(),
            "auto without a memory limit: hash joins"
        );
        let file = ConfigLayer::from_toml("memory_limit = \"1G\"\n", "test.toml").unwrap();
        config.apply(file, "test.toml").unwrap();
        assert!(
            !config.sort_merge_joins() && config.join_fallback(),
            "auto under a memory limit: hash joins, sort-merge joins when they run out"
        );
        let env_layer = ConfigLayer::from_env(env(&[("SLUICE_JOINS", "hash")])).unwrap();
        config.apply(env_layer, "environment").unwrap();
        assert!(!config.sort_merge_joins() && !config.join_fallback());
        assert_eq!(config.joins.source, "environment");
        let text = config.to_toml(false).unwrap();
        assert!(
            text.contains("joins = \"hash\"  # from environment"),
            "{text}"
        );
        let file = ConfigLayer::from_toml("joins = \"sort-merge\"\n", "j.toml").unwrap();
        config.apply(file, "j.toml").unwrap();
        assert!(config.sort_merge_joins());
        let error = ConfigLayer::from_toml("joins = \"nested\"\n", "bad.toml").unwrap_err();
        assert_eq!(
            error.to_string(),
            "config bad.toml: unknown joins 'nested' (known: auto, hash, sort-merge)"
        );
    }

    #[test]
    fn a_memory_limit_scales_the_sorts_merge_reservation_unless_it_is_set() {
        let key = "datafusion.execution.sort_spill_reservation_bytes";
        let reservation = |config: &SluiceConfig| {
            config
                .session_config()
                .unwrap()
                .options()
                .execution
                .sort_spill_reservation_bytes
        };
        let mut config = SluiceConfig::default();
        assert_eq!(reservation(&config), 10 << 20, "DataFusion's default");
        for (limit, expected) in [("64M", 2 << 20), ("4M", 256 << 10), ("1G", 10 << 20)] {
            let layer =
                ConfigLayer::from_toml(&format!("memory_limit = \"{limit}\""), "t").unwrap();
            config.apply(layer, "t").unwrap();
            assert_eq!(reservation(&config), expected, "{limit}");
        }
        config
            .apply(
                ConfigLayer::from_toml("memory_limit = \"64M\"", "t").unwrap(),
                "t",
            )
            .unwrap();
        let text = config.to_toml(false).unwrap();
        assert!(
            text.contains(&format!("\"{key}\" = \"2097152\"  # from memory_limit")),
            "{text}"
        );
        let layer = ConfigLayer {
            session: vec![(key.into(), "5000000".into())],
            ..Default::default()
        };
        config.apply(layer, "--set").unwrap();
        assert_eq!(reservation(&config), 5_000_000, "the user's value wins");
        assert!(!config.to_toml(false).unwrap().contains("from memory_limit"));
    }

    #[test]
    fn distributed_modes_broadcast_build_sides_under_10_mib_unless_joins_sort_merge_or_the_user_chose()
     {
        let key = "datafusion.optimizer.hash_join_single_partition_threshold";
        let threshold = |config: &SluiceConfig| {
            config
                .session_config()
                .unwrap()
                .options()
                .optimizer
                .hash_join_single_partition_threshold
        };
        let with = |toml: &str| {
            let mut config = SluiceConfig::default();
            config
                .apply(ConfigLayer::from_toml(toml, "t").unwrap(), "t")
                .unwrap();
            config
        };
        assert_eq!(
            threshold(&with("mode = \"local\"")),
            1 << 20,
            "DataFusion's default"
        );
        for mode in ["local-graph", "local-cluster", "cluster"] {
            let config = with(&format!("mode = \"{mode}\""));
            assert_eq!(threshold(&config), 10 << 20, "{mode}");
            let text = config.to_toml(false).unwrap();
            assert!(
                text.contains(&format!("\"{key}\" = \"10485760\"  # from mode {mode}\n")),
                "{text}"
            );
        }
        // Local mode plans with DataFusion's value but knows the distributed one (EXPLAIN
        // DISTRIBUTED uses it).
        assert_eq!(
            with("mode = \"local\"").distributed_defaults(),
            [(key, "10485760".to_string())]
        );
        // `auto` under a limit plans hash joins first, so it broadcasts as `hash` does (its
        // sort-merge fallback plans with DataFusion's threshold: `join_fallback`).
        let limited = with("mode = \"cluster\"\nmemory_limit = \"1G\"");
        assert_eq!(threshold(&limited), 10 << 20);
        assert_eq!(
            limited.distributed_defaults(),
            [(key, "10485760".to_string())]
        );
        // Sort-merge joins bound memory; a broadcast hash join cannot spill, so the default stays.
        let sort_merge_limited =
            with("mode = \"cluster\"\nmemory_limit = \"1G\"\njoins = \"sort-merge\"");
        assert_eq!(threshold(&sort_merge_limited), 1 << 20);
        assert!(sort_merge_limited.distributed_defaults().is_empty());
        let hash = with("mode = \"cluster\"\nmemory_limit = \"1G\"\njoins = \"hash\"");
        assert_eq!(threshold(&hash), 10 << 20);
        let sort_merge = with("mode = \"cluster\"\njoins = \"sort-merge\"");
        assert_eq!(threshold(&sort_merge), 1 << 20);
        // The user's value wins, and is shown as theirs.
        let mut chosen = with("mode = \"cluster\"");
        let layer = ConfigLayer {
            session: vec![(key.into(), "2000000".into())],
            ..Default::default()
        };
        chosen.apply(layer, "--set").unwrap();
        assert_eq!(threshold(&chosen), 2_000_000);
        assert!(chosen.distributed_defaults().is_empty());
        let text = chosen.to_toml(false).unwrap();
        assert!(
            text.contains(&format!("\"{key}\" = \"2000000\"  # from --set")),
            "{text}"
        );
        assert!(!text.contains("# from mode cluster\n"), "{text}");
    }
}
