//! Helpers of the CLI's end-to-end tests: the built binary without the caller's `SLUICE_*`
//! environment, and TPC-H data generated once per test binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The `sluice` binary with no `SLUICE_*` variable and no backtraces.
pub fn sluice() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    command.env_remove("RUST_BACKTRACE");
    for (name, _) in std::env::vars() {
        if name.starts_with("SLUICE_") {
            command.env_remove(name);
        }
    }
    command
}

/// TPC-H SF 0.01, generated once per test binary into Cargo's tmp dir.
pub fn tpch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tpch-sf0.01-{}", env!("CARGO_CRATE_NAME")));
        let output = sluice()
            .args(["tpch", "gen", "--scale", "0.01", "--out"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        dir
    })
}
