//! `harness bench --quick --json` at sizes a debug build runs well under a minute, shared by the
//! in-process and the iii bench tests.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Runs the quick bench in `dir` with `extra` flags: the one JSON object it printed, and its
/// stderr.
pub fn quick_bench(dir: &Path, extra: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_harness"))
        .args([
            "bench",
            "--quick",
            "--json",
            "--idle-sessions",
            "300",
            "--cell-secs",
            "0.4",
        ])
        .args(extra)
        .arg("--dir")
        .arg(dir)
        .env("HARNESS_LOG", "error")
        .output()
        .expect("run harness bench");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "bench {extra:?} failed: {stderr}");
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stdout}"));
    (report, stderr)
}
