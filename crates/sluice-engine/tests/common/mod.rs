//! Helpers shared by the engine's integration tests.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sluice_engine::tpch::datagen::{GenOptions, generate};

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
