//! Helpers shared by the integration tests: TPC-H data, configurations and sessions per mode.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use sluice_cluster::{ClusterOptions, LocalClusterRunner};
use sluice_engine::config::ConfigLayer;
use sluice_engine::{ExecutionMode, SluiceConfig, SluiceSession};
use sluice_runtime::{JobRunner, LocalGraphRunner, LocalRunner};
use sluice_tpch::bench::open_tpch_data;
use sluice_tpch::datagen::{GenOptions, generate};

/// TPC-H SF 0.01 with 4 files per large table, generated once and reused by later runs.
///
/// It lives under Cargo's per-target temporary directory (so `cargo clean` removes it and nothing is
/// left in `/tmp`), in a directory of this test binary's own: two binaries running at once never write
/// the same files. Generation is resumable, so a run interrupted mid-way completes the data next time.
pub fn tpch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tpch-sf0.01-{}", env!("CARGO_CRATE_NAME")));
        let options = GenOptions {
            scale_factor: 0.01,
            out: dir.clone(),
            parts: Some(4),
            force: false,
            threads: 2,
        };
        generate(&options, &|_| {}).unwrap();
        dir
    })
}

/// The configuration of `mode` with 4 target partitions and `settings` on top. Jobs are cut into
/// stages however little they read (`sluice.single_task_bytes` = 0), so the tests exercise the
/// distributed path on their small data; a test of single-task jobs sets it in `settings`.
pub fn config(mode: ExecutionMode, settings: &[(&str, &str)]) -> SluiceConfig {
    let mut config = SluiceConfig::default();
    let mut session = vec![
        (
            "datafusion.execution.target_partitions".to_string(),
            "4".to_string(),
        ),
        ("sluice.single_task_bytes".to_string(), "0".to_string()),
    ];
    session.extend(settings.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let layer = ConfigLayer {
        mode: Some(mode),
        session,
        ..Default::default()
    };
    config.apply(layer, "test").unwrap();
    config
}

/// The default runner of `mode` (a 2-worker cluster for local-cluster).
pub fn runner(mode: ExecutionMode) -> Arc<dyn JobRunner> {
    match mode {
        ExecutionMode::Local => Arc::new(LocalRunner),
        ExecutionMode::LocalGraph => Arc::new(LocalGraphRunner::default()),
        ExecutionMode::LocalCluster => Arc::new(LocalClusterRunner::with_options(ClusterOptions {
            workers: 2,
            ..ClusterOptions::default()
        })),
        ExecutionMode::Cluster => {
            panic!("cluster mode starts the sluice executable: its tests are sluice-cli's")
        }
    }
}

/// A session of `mode` (run by `runner`) over the TPC-H data.
pub async fn tpch_session(
    mode: ExecutionMode,
    settings: &[(&str, &str)],
    runner: Arc<dyn JobRunner>,
) -> SluiceSession {
    let mut session = SluiceSession::new(&config(mode, settings), runner).unwrap();
    open_tpch_data(&mut session, tpch_dir(), Some(0.01))
        .await
        .unwrap();
    session
}

/// A session of `mode` with its default runner over the TPC-H data.
pub async fn session(mode: ExecutionMode, settings: &[(&str, &str)]) -> SluiceSession {
    tpch_session(mode, settings, runner(mode)).await
}
