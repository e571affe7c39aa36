//! Sluice's own session settings, next to DataFusion's: `SET sluice.<name> = <value>`, the
//! `[session]` table of a config file, `SHOW ALL`. They travel with a job's other settings (a task
//! definition carries them; the driver decides by them).
//!
//! Invariant: every session a job is planned or run in registers [`SluiceOptions`] (through
//! [`with_sluice_options`]); a setting the job does not carry reads as its default.

use std::any::Any;
use std::collections::HashMap;

use datafusion::common::config::{ConfigEntry, ConfigExtension, ExtensionOptions};
use datafusion::common::{Result, config_err};
use datafusion::prelude::SessionConfig;

/// Adaptive execution's switches (the driver applies them once a stage's inputs finished).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SluiceOptions {
    /// With blocking exchanges, spread a partition of a partitioned hash join whose probe rows are
    /// skewed over several tasks, each reading part of its probe rows and all of its build rows.
    pub skew_join_split: bool,
    /// A join partition is skewed when its probe rows exceed this many times the median of the
    /// join's partitions ...
    pub skew_join_factor: u64,
    /// ... and this many rows.
    pub skew_join_min_rows: u64,
    /// With blocking exchanges, turn a partitioned hash join into a broadcast join when its build
    /// side finished small before its probe side started: every task of the join reads the whole
    /// build side and runs the probe side's scan itself, so the probe rows are never shuffled.
    pub broadcast_join_switch: bool,
    /// The most bytes a build side may hold for that switch.
    pub broadcast_join_switch_bytes: u64,
    /// Run a job whose scans read at most this many bytes whole, as one task on one worker,
    /// instead of as stages of tasks (`sluice_planner::job_graph::single_task`); 0 cuts every job.
    pub single_task_bytes: u64,
    /// A runtime filter whose build side held more distinct keys than it lists checks the union
    /// of its source tasks' Bloom filters, besides the key bounds.
    pub runtime_filter_bloom: bool,
    /// With pipelined exchanges, how long (milliseconds) a task whose runtime filters have not
    /// arrived waits for them before it starts reading (0: it starts at once).
    pub runtime_filter_wait_ms: u64,
}

/// The default of `sluice.broadcast_join_switch_bytes`: the distributed planner's static broadcast
/// threshold (`sluice_planner::DISTRIBUTED_BROADCAST_THRESHOLD`).
pub const BROADCAST_JOIN_SWITCH_BYTES: u64 = 10 * 1024 * 1024;

/// The default of `sluice.runtime_filter_wait_ms`: a second, as Impala's scans wait for their
/// runtime filters (`RUNTIME_FILTER_WAIT_TIME_MS`).
pub const RUNTIME_FILTER_WAIT_MS: u64 = 1000;

/// The default of `sluice.single_task_bytes`: 32 MiB, a quarter of the bytes one Spark task
/// scans by default (`spark.sql.files.maxPartitionBytes`, 128 MiB). TPC-H SF 0.01 (3.5 MB) runs
/// as one task per query, SF 1 (316 MB) is cut as before.
pub const SINGLE_TASK_BYTES: u64 = 32 * 1024 * 1024;

impl Default for SluiceOptions {
    fn default() -> Self {
        Self {
            skew_join_split: true,
            skew_join_factor: 4,
            skew_join_min_rows: 100_000,
            broadcast_join_switch: true,
            broadcast_join_switch_bytes: BROADCAST_JOIN_SWITCH_BYTES,
            single_task_bytes: SINGLE_TASK_BYTES,
            runtime_filter_bloom: true,
            runtime_filter_wait_ms: RUNTIME_FILTER_WAIT_MS,
        }
    }
}

/// Every setting: its name (after `sluice.`) and its description.
const SETTINGS: [(&str, &str); 8] = [
    (
        "skew_join_split",
        "With blocking exchanges, spread a skewed partition of a partitioned hash join (probe rows \
         over skew_join_factor times the median and skew_join_min_rows) over several tasks",
    ),
    (
        "skew_join_factor",
        "A join partition is skewed when its probe rows exceed this many times the median",
    ),
    (
        "skew_join_min_rows",
        "A join partition is skewed only above this many probe rows",
    ),
    (
        "broadcast_join_switch",
        "With blocking exchanges, turn a partitioned hash join into a broadcast join when its \
         build side finished under broadcast_join_switch_bytes before its probe side started (the \
         probe side is then scanned by the join's tasks, never shuffled)",
    ),
    (
        "broadcast_join_switch_bytes",
        "The most bytes a build side may hold for a partitioned hash join to become a broadcast join",
    ),
    (
        "single_task_bytes",
        "Distributed modes: run a query whose scans read at most this many bytes (file byte \
         ranges, in-memory tables) whole, as one task on one worker, instead of as stages of \
         tasks joined by shuffles; 0 cuts every query into stages",
    ),
    (
        "runtime_filter_bloom",
        "Distributed modes: a runtime filter whose join build side held more than 256 distinct \
         keys drops the probe rows whose key is not in a Bloom filter of the build keys (besides \
         those outside the keys' bounds), when it filters another stage than the join's, the \
         build side had at most 131072 rows, and integer keys fill at most half their bounds",
    ),
    (
        "runtime_filter_wait_ms",
        "With pipelined exchanges, how long (milliseconds) a task whose runtime filters have not \
         arrived yet waits for them before it starts reading, so its scans skip what they rule \
         out; 0 starts it at once (the filters then drop only what it reads after they arrive)",
    ),
];

impl ExtensionOptions for SluiceOptions {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let number = |value: &str| {
            value.trim().parse::<u64>().or_else(|_| {
                config_err!("sluice.{key} takes a whole number of at least 0, not '{value}'")
            })
        };
        let flag = |value: &str| match value.trim().to_ascii_lowercase().as_str() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => config_err!("sluice.{key} takes true or false, not '{value}'"),
        };
        match key {
            "skew_join_split" => self.skew_join_split = flag(value)?,
            "skew_join_factor" => self.skew_join_factor = number(value)?.max(1),
            "skew_join_min_rows" => self.skew_join_min_rows = number(value)?,
            "broadcast_join_switch" => self.broadcast_join_switch = flag(value)?,
            "broadcast_join_switch_bytes" => self.broadcast_join_switch_bytes = number(value)?,
            "single_task_bytes" => self.single_task_bytes = number(value)?,
            "runtime_filter_bloom" => self.runtime_filter_bloom = flag(value)?,
            "runtime_filter_wait_ms" => self.runtime_filter_wait_ms = number(value)?,
            _ => {
                let names: Vec<String> = SETTINGS
                    .iter()
                    .map(|(n, _)| format!("sluice.{n}"))
                    .collect();
                return config_err!(
                    "there is no setting sluice.{key}; Sluice's settings are {}",
                    names.join(", ")
                );
            }
        }
        Ok(())
    }

    fn entries(&self) -> Vec<ConfigEntry> {
        let values = [
            self.skew_join_split.to_string(),
            self.skew_join_factor.to_string(),
            self.skew_join_min_rows.to_string(),
            self.broadcast_join_switch.to_string(),
            self.broadcast_join_switch_bytes.to_string(),
            self.single_task_bytes.to_string(),
            self.runtime_filter_bloom.to_string(),
            self.runtime_filter_wait_ms.to_string(),
        ];
        SETTINGS
            .iter()
            .zip(values)
            .map(|((name, description), value)| ConfigEntry {
                key: format!("sluice.{name}"),
                value: Some(value),
                description,
            })
            .collect()
    }
}

impl ConfigExtension for SluiceOptions {
    const PREFIX: &'static str = "sluice";
}

/// `config` with Sluice's settings registered at their defaults.
pub fn with_sluice_options(config: SessionConfig) -> SessionConfig {
    if config.options().extensions.get::<SluiceOptions>().is_some() {
        return config;
    }
    config.with_option_extension(SluiceOptions::default())
}

/// The default value of Sluice's setting `key` (`sluice.<name>`, any case), what `RESET` sets it
/// to; an unknown name is the error `SET` gives.
pub fn sluice_default_of(key: &str) -> Result<String> {
    let wanted = key.to_ascii_lowercase();
    SluiceOptions::default()
        .entries()
        .into_iter()
        .find(|entry| entry.key == wanted)
        .and_then(|entry| entry.value)
        .map_or_else(
            || {
                let name = wanted.strip_prefix("sluice.").unwrap_or(&wanted);
                SluiceOptions::default()
                    .set(name, "")
                    .map(|()| String::new())
            },
            Ok,
        )
}

/// Sluice's settings among a job's shipped `settings` (keys `sluice.<name>`), the rest at their
/// defaults.
pub fn sluice_options_of(settings: &HashMap<String, String>) -> Result<SluiceOptions> {
    let mut options = SluiceOptions::default();
    for (key, value) in settings {
        if let Some(name) = key.strip_prefix("sluice.") {
            options.set(name, value)?;
        }
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn settings_are_set_shown_and_read_back_from_shipped_settings() {
        let mut config = with_sluice_options(SessionConfig::new());
        config
            .options_mut()
            .set("sluice.skew_join_factor", "7")
            .unwrap();
        let shipped: HashMap<String, String> = config
            .options()
            .entries()
            .into_iter()
            .filter(|e| e.key.starts_with("sluice."))
            .filter_map(|e| Some((e.key, e.value?)))
            .collect();
        assert_eq!(
            shipped.get("sluice.skew_join_factor").map(String::as_str),
            Some("7")
        );
        assert_eq!(shipped.len(), 8, "{shipped:?}");
        let read = sluice_options_of(&shipped).unwrap();
        assert_eq!(
            (
                read.skew_join_split,
                read.skew_join_factor,
                read.skew_join_min_rows
            ),
            (true, 7, 100_000)
        );
        assert_eq!(
            sluice_options_of(&HashMap::new()).unwrap().skew_join_factor,
            4
        );
        assert_eq!(
            (read.broadcast_join_switch, read.broadcast_join_switch_bytes),
            (true, 10 * 1024 * 1024)
        );
        let bad = HashMap::from([("sluice.skew_join_split".to_string(), "maybe".to_string())]);
        assert_eq!(
            sluice_options_of(&bad).unwrap_err().strip_backtrace(),
            "Invalid or Unsupported Configuration: sluice.skew_join_split takes true or false, not 'maybe'"
        );
        let off = HashMap::from([(
            "sluice.broadcast_join_switch".to_string(),
            "FALSE".to_string(),
        )]);
        assert!(!sluice_options_of(&off).unwrap().broadcast_join_switch);
        let error = config
            .options_mut()
            .set("sluice.no_such_thing", "1")
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("there is no setting sluice.no_such_thing; Sluice's settings are sluice.skew_join_split, "),
            "{error}"
        );
        let error = config
            .options_mut()
            .set("sluice.broadcast_join_switch_bytes", "10M")
            .unwrap_err();
        assert!(
            error.to_string().contains(
                "sluice.broadcast_join_switch_bytes takes a whole number of at least 0, not '10M'"
            ),
            "{error}"
        );
        config
            .options_mut()
            .set("sluice.broadcast_join_switch_bytes", "4096")
            .unwrap();
        let ours = config.options().extensions.get::<SluiceOptions>().unwrap();
        assert_eq!(ours.broadcast_join_switch_bytes, 4096);
        assert_eq!(
            sluice_default_of("SLUICE.Broadcast_Join_Switch_Bytes").unwrap(),
            "10485760"
        );
        assert_eq!(sluice_default_of("sluice.skew_join_split").unwrap(), "true");
        let error = sluice_default_of("sluice.nope").unwrap_err();
        assert!(
            error
                .to_string()
                .contains("there is no setting sluice.nope; Sluice's settings are "),
            "{error}"
        );
        let error = config
            .options_mut()
            .set("sluice.skew_join_factor", "-1")
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("sluice.skew_join_factor takes a whole number"),
            "{error}"
        );
    }
}
