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

use datafusion::prelude::SessionConfig;
use serde::Deserialize;

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

/// The effective configuration.
#[derive(Debug, Clone)]
pub struct SluiceConfig {
    /// Which job runner executes queries.
    pub mode: Sourced<ExecutionMode>,
    /// Memory budget for query execution; `None` is unbounded.
    pub memory_limit: Sourced<Option<ByteSize>>,
    /// Workers of a local cluster, or worker processes of a cluster (default 2 in `--mode cluster`).
    pub workers: Sourced<usize>,
    /// Compression of Arrow IPC on the Flight data plane.
    pub flight_compression: Sourced<FlightCompression>,
    /// How stage outputs move between stages in the distributed modes.
    pub exchange: Sourced<ExchangeMode>,
    /// Which algorithm partitioned equi-joins use (see [`crate::joins`]).
    pub joins: Sourced<JoinStrategy>,
    /// Cluster mode: where the driver listens for workers (`None`: 127.0.0.1, a free port).
    pub driver_listen: Sourced<Option<String>>,
    /// Cluster mode: workers that must have joined before the first query (`None`: `workers`).
    pub min_workers: Sourced<Option<usize>>,
    /// DataFusion settings (`datafusion.*`), validated, by key.
    pub session: BTreeMap<String, Sourced<String>>,
}

impl Default for SluiceConfig {
    fn default() -> Self {
        Self {
            mode: Sourced::new(ExecutionMode::default(), "default"),
            memory_limit: Sourced::new(None, "default"),
            workers: Sourced::new(DEFAULT_WORKERS, "default"),
            flight_compression: Sourced::new(FlightCompression::None, "default"),
            exchange: Sourced::new(ExchangeMode::Pipelined, "default"),
            joins: Sourced::new(JoinStrategy::Auto, "default"),
            driver_listen: Sourced::new(None, "default"),
            min_workers: Sourced::new(None, "default"),
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
    /// `mode`.
    pub mode: Option<ExecutionMode>,
    /// `memory_limit`; `Some(None)` sets "unlimited".
    pub memory_limit: Option<Option<ByteSize>>,
    /// `workers`.
    pub workers: Option<usize>,
    /// `flight_compression`.
    pub flight_compression: Option<FlightCompression>,
    /// `exchange`.
    pub exchange: Option<ExchangeMode>,
    /// `joins`.
    pub joins: Option<JoinStrategy>,
    /// `driver_listen`.
    pub driver_listen: Option<String>,
    /// `min_workers`.
    pub min_workers: Option<usize>,
    /// DataFusion settings as `(key, value)`.
    pub session: Vec<(String, String)>,
}

/// The shape of a TOML config file. Unknown keys are rejected by serde.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLayer {
    mode: Option<String>,
    memory_limit: Option<String>,
    workers: Option<usize>,
    flight_compression: Option<String>,
    exchange: Option<String>,
    joins: Option<String>,
    driver_listen: Option<String>,
    min_workers: Option<usize>,
    #[serde(default)]
    session: BTreeMap<String, toml::Value>,
}

/// The environment variables Sluice reads, besides those it rejects as unknown.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("SLUICE_MODE", "execution mode"),
    (
        "SLUICE_MEMORY_LIMIT",
        "memory budget, e.g. 4G, or 'unlimited'",
    ),
    (
        "SLUICE_WORKERS",
        "workers of a local cluster, or worker processes of a cluster",
    ),
    (
        "SLUICE_FLIGHT_COMPRESSION",
        "Arrow IPC compression between workers: none, lz4 or zstd",
    ),
    (
        "SLUICE_EXCHANGE",
        "how stage outputs move between stages: pipelined or blocking",
    ),
    (
        "SLUICE_JOINS",
        "partitioned joins: auto (sort-merge under a memory limit, else hash), hash or sort-merge",
    ),
    (
        "SLUICE_DRIVER_LISTEN",
        "cluster mode: where the driver listens for workers",
    ),
    (
        "SLUICE_MIN_WORKERS",
        "cluster mode: workers that must have joined before the first query",
    ),
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
];

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
        let file: FileLayer = toml::from_str(text).map_err(|e| error(e.message().to_string()))?;
        let mode = file.mode.map(|m| m.parse()).transpose().map_err(error)?;
        let memory_limit = file
            .memory_limit
            .map(|m| parse_memory_limit(&m))
            .transpose()
            .map_err(|e| error(format!("memory_limit: {e}")))?;
        let session = file
            .session
            .into_iter()
            .map(|(key, value)| {
                let value = match value {
                    toml::Value::String(s) => s,
                    other => other.to_string(),
                };
                (key, value)
            })
            .collect();
        let flight_compression = file
            .flight_compression
            .map(|c| c.parse())
            .transpose()
            .map_err(error)?;
        let exchange = file
            .exchange
            .map(|c| c.parse())
            .transpose()
            .map_err(error)?;
        let joins = file.joins.map(|j| j.parse()).transpose().map_err(error)?;
        Ok(Self {
            mode,
            memory_limit,
            workers: file.workers,
            flight_compression,
            exchange,
            joins,
            driver_listen: file.driver_listen,
            min_workers: file.min_workers,
            session,
        })
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
            match name.as_str() {
                "SLUICE_MODE" => layer.mode = Some(value.parse().map_err(error)?),
                "SLUICE_WORKERS" => {
                    layer.workers = Some(
                        value
                            .trim()
                            .parse()
                            .map_err(|_| error(format!("'{value}' is not a number of workers")))?,
                    )
                }
                "SLUICE_FLIGHT_COMPRESSION" => {
                    layer.flight_compression = Some(value.parse().map_err(error)?)
                }
                "SLUICE_EXCHANGE" => layer.exchange = Some(value.parse().map_err(error)?),
                "SLUICE_JOINS" => layer.joins = Some(value.parse().map_err(error)?),
                "SLUICE_DRIVER_LISTEN" => layer.driver_listen = Some(value.clone()),
                "SLUICE_MIN_WORKERS" => {
                    layer.min_workers = Some(parse_workers(&value).map_err(error)?)
                }
                "SLUICE_MEMORY_LIMIT" => {
                    layer.memory_limit = Some(parse_memory_limit(&value).map_err(error)?)
                }
                // The cluster secret is read where it is used, and never shown by `sluice config`.
                "SLUICE_SECRET" => {}
                // Logging is set up by the CLI before the configuration is read.
                "SLUICE_LOG" | "SLUICE_LOG_FORMAT" | "SLUICE_OTLP_ENDPOINT" => {}
                "SLUICE_SET" => {
                    for item in value.split(',').filter(|s| !s.trim().is_empty()) {
                        layer.session.push(parse_setting(item).map_err(error)?);
                    }
                }
                _ => {
                    let known: Vec<_> = ENV_VARS.iter().map(|(n, _)| *n).collect();
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
    pub fn apply(&mut self, layer: ConfigLayer, source: &str) -> Result<()> {
        if let Some(mode) = layer.mode {
            self.mode = Sourced::new(mode, source);
        }
        if let Some(limit) = layer.memory_limit {
            self.memory_limit = Sourced::new(limit, source);
        }
        if let Some(workers) = layer.workers {
            self.workers = Sourced::new(workers, source);
        }
        if let Some(compression) = layer.flight_compression {
            self.flight_compression = Sourced::new(compression, source);
        }
        if let Some(exchange) = layer.exchange {
            self.exchange = Sourced::new(exchange, source);
        }
        if let Some(joins) = layer.joins {
            self.joins = Sourced::new(joins, source);
        }
        if let Some(listen) = layer.driver_listen {
            self.driver_listen = Sourced::new(Some(listen), source);
        }
        if let Some(min) = layer.min_workers {
            self.min_workers = Sourced::new(Some(min), source);
        }
        for (key, value) in layer.session {
            validate_setting(&key, &value).map_err(|message| SluiceError::Config {
                source_name: source.to_string(),
                message,
            })?;
            self.session.insert(key, Sourced::new(value, source));
        }
        Ok(())
    }

    /// Whether partitioned equi-joins are planned as sort-merge joins: `joins`, given whether a
    /// memory limit is set.
    pub fn sort_merge_joins(&self) -> bool {
        self.joins
            .value
            .sort_merge(self.memory_limit.value.is_some())
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
        let mut config = SessionConfig::new();
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
        let _ = writeln!(
            out,
            "mode = \"{}\"  # from {}",
            self.mode.value, self.mode.source
        );
        let limit = self
            .memory_limit
            .value
            .map(|b| b.to_string())
            .unwrap_or_else(|| "unlimited".into());
        let _ = writeln!(
            out,
            "memory_limit = \"{limit}\"  # from {}",
            self.memory_limit.source
        );
        let _ = writeln!(
            out,
            "workers = {}  # from {}",
            self.workers.value, self.workers.source
        );
        let _ = writeln!(
            out,
            "flight_compression = \"{}\"  # from {}",
            self.flight_compression.value.name(),
            self.flight_compression.source
        );
        let _ = writeln!(
            out,
            "exchange = \"{}\"  # from {}",
            self.exchange.value.name(),
            self.exchange.source
        );
        let _ = writeln!(
            out,
            "joins = \"{}\"  # from {}",
            self.joins.value.name(),
            self.joins.source
        );
        if let Some(listen) = &self.driver_listen.value {
            let _ = writeln!(
                out,
                "driver_listen = \"{listen}\"  # from {}",
                self.driver_listen.source
            );
        }
        if let Some(min) = self.min_workers.value {
            let _ = writeln!(
                out,
                "min_workers = {min}  # from {}",
                self.min_workers.source
            );
        }
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
                        .unwrap_or_else(|| "DataFusion default".into())
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

/// Checks one DataFusion setting against DataFusion's own option table.
fn validate_setting(key: &str, value: &str) -> Result<(), String> {
    let mut options = datafusion::config::ConfigOptions::new();
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
            !config.sort_merge_joins(),
            "auto without a memory limit: hash joins"
        );
        let file = ConfigLayer::from_toml("memory_limit = \"1G\"\n", "test.toml").unwrap();
        config.apply(file, "test.toml").unwrap();
        assert!(
            config.sort_merge_joins(),
            "auto under a memory limit: sort-merge joins"
        );
        let env_layer = ConfigLayer::from_env(env(&[("SLUICE_JOINS", "hash")])).unwrap();
        config.apply(env_layer, "environment").unwrap();
        assert!(!config.sort_merge_joins());
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
        // Sort-merge joins bound memory; a broadcast hash join cannot spill, so the default stays.
        let limited = with("mode = \"cluster\"\nmemory_limit = \"1G\"");
        assert_eq!(threshold(&limited), 1 << 20);
        assert!(limited.distributed_defaults().is_empty());
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
