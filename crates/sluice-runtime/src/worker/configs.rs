//! The session settings a worker's tasks run with, built once per distinct set of shipped settings.
//!
//! Building a `SessionConfig` from a task definition's settings starts from DataFusion's two
//! hundred defaults and parses each shipped value; every task of a job (and of every job of one
//! session) ships the same settings, so the worker keeps the configs it built for the last few
//! sets it saw and hands out clones (a `SessionConfig` shares its options behind an `Arc`; a task
//! that changes one copies them first).
//!
//! Invariant: a cached config is exactly what [`task_settings`] builds from an equal map, so a task
//! cannot tell a cached config from a fresh one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use datafusion::common::Result;
use datafusion::prelude::SessionConfig;

use crate::definition::session_config_of;

/// How many distinct sets of settings are kept (sessions with different settings, each a few
/// strings); the oldest goes first.
const KEPT: usize = 8;

/// Settings as a task definition ships them.
type Settings = Arc<HashMap<String, String>>;

/// The configs built so far, newest last.
#[derive(Default)]
pub(crate) struct SessionConfigs {
    built: Mutex<Vec<(Settings, SessionConfig)>>,
}

impl SessionConfigs {
    /// The config of a task shipped `settings`: a clone of the one built for equal settings, or
    /// a new one (kept for the next task).
    pub(crate) fn of(&self, settings: &Settings) -> Result<SessionConfig> {
        if let Ok(built) = self.built.lock()
            && let Some((_, config)) = built.iter().rev().find(|(seen, _)| seen == settings)
        {
            return Ok(config.clone());
        }
        let config = task_settings(settings)?;
        if let Ok(mut built) = self.built.lock() {
            if built.len() >= KEPT {
                built.remove(0);
            }
            built.push((Arc::clone(settings), config.clone()));
        }
        Ok(config)
    }
}

/// The session's shipped `settings` with the distributed ones on top.
pub(crate) fn task_settings(settings: &HashMap<String, String>) -> Result<SessionConfig> {
    let mut config = session_config_of(settings)?;
    for (name, value) in sluice_planner::DISTRIBUTED_SETTINGS {
        config.options_mut().set(name, value)?;
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> Arc<HashMap<String, String>> {
        Arc::new(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        )
    }

    #[test]
    fn equal_settings_get_the_config_built_the_first_time_and_different_ones_their_own() {
        let configs = SessionConfigs::default();
        let first = settings(&[("datafusion.execution.batch_size", "1234")]);
        let a = configs.of(&first).unwrap();
        // An equal map in another allocation (as every decoded definition is) hits the cache: the
        // clone shares the options the first call built.
        let b = configs
            .of(&settings(&[("datafusion.execution.batch_size", "1234")]))
            .unwrap();
        assert!(Arc::ptr_eq(a.options(), b.options()));
        assert_eq!(b.batch_size(), 1234);
        let other = configs
            .of(&settings(&[("datafusion.execution.batch_size", "99")]))
            .unwrap();
        assert_eq!(other.batch_size(), 99);
        assert!(!Arc::ptr_eq(a.options(), other.options()));
        // Every setting (DataFusion's, the distributed ones on top, Sluice's own) is what a fresh
        // build gives.
        let entries = |c: &SessionConfig| {
            c.options()
                .entries()
                .into_iter()
                .map(|e| (e.key, e.value))
                .collect::<Vec<_>>()
        };
        let fresh = task_settings(&first).unwrap();
        assert_eq!(entries(&b), entries(&fresh));
        assert!(
            entries(&b)
                .iter()
                .any(|(key, _)| key.starts_with("sluice.")),
            "{:?}",
            entries(&b)
        );
        for (name, value) in sluice_planner::DISTRIBUTED_SETTINGS {
            let set = entries(&b).into_iter().find(|(key, _)| key == name);
            assert_eq!(set, Some((name.to_string(), Some(value.to_string()))));
        }
    }

    #[test]
    fn a_bad_setting_is_an_error_and_is_not_kept() {
        let configs = SessionConfigs::default();
        let bad = settings(&[("datafusion.execution.batch_size", "many")]);
        for _ in 0..2 {
            let error = configs.of(&bad).unwrap_err().to_string();
            assert!(error.contains("many"), "{error}");
        }
        assert_eq!(configs.built.lock().unwrap().len(), 0);
    }

    #[test]
    fn only_the_newest_sets_are_kept() {
        let configs = SessionConfigs::default();
        for size in 1..=(KEPT + 2) {
            configs
                .of(&settings(&[(
                    "datafusion.execution.batch_size",
                    &size.to_string(),
                )]))
                .unwrap();
        }
        let built = configs.built.lock().unwrap();
        assert_eq!(built.len(), KEPT);
        assert_eq!(built[0].1.batch_size(), 3);
        assert_eq!(built[KEPT - 1].1.batch_size(), KEPT + 2);
    }
}
