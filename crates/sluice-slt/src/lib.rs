//! SQL logic tests through Sluice: DataFusion's `.slt` files run against a [`sluice_engine::SluiceSession`]
//! in any execution mode, with results formatted as DataFusion's own runner formats them.
//!
//! ```text
//!   file.slt ──parse──► records ──► sqllogictest Runner ──► SltDb (one session per file)
//!                                        │                      │  plan in the session's context
//!                                        │                      └─ execute through the mode's JobRunner
//!                                        └─ compare (format::rows_match) ──► FileReport
//! ```

pub mod db;
pub mod format;
pub mod run;

use sluice_engine::config::ConfigLayer;
use sluice_engine::{Result, SluiceConfig};

pub use run::{FileReport, RunnerFactory, SltEvent, SltFailure, SltOptions, SltTarget, run_file};

/// The settings DataFusion's runner uses: four target partitions (so that results do not depend on the
/// machine) and DataFusion's defaults otherwise, with the user's own settings on top.
pub fn slt_config(user: &SluiceConfig) -> Result<SluiceConfig> {
    // The user's Sluice settings; DataFusion's start from its defaults.
    let mut config = SluiceConfig {
        session: Default::default(),
        ..user.clone()
    };
    let defaults = ConfigLayer {
        session: vec![("datafusion.execution.target_partitions".into(), "4".into())],
        ..Default::default()
    };
    config.apply(defaults, "slt default")?;
    for (key, value) in &user.session {
        if value.source != "default" {
            let layer = ConfigLayer {
                session: vec![(key.clone(), value.value.clone())],
                ..Default::default()
            };
            config.apply(layer, &value.source)?;
        }
    }
    Ok(config)
}
