//! Helpers shared by the engine's integration tests.

use std::path::Path;
use std::sync::OnceLock;

use sluice_engine::tpch::datagen::{GenOptions, generate};

/// TPC-H SF 0.01 with 4 files per large table, generated once per test binary.
pub fn tpch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let options = GenOptions {
            scale_factor: 0.01,
            out: dir.path().to_path_buf(),
            parts: Some(4),
            force: false,
            threads: 2,
        };
        generate(&options, &|_| {}).unwrap();
        dir
    })
    .path()
}
