//! The physical reference every figure is read against, measured in the same run on the same
//! directory: what one fsync costs there, and what SQLite alone needs for one commit (with and
//! without its fsync). A step can never be cheaper than its share of these; a ratio to them
//! says how far the loop is from the hardware, whatever the machine.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use harness_store::Connection;

use crate::stats::{per, Percentiles};

/// Samples per reference figure.
const SAMPLES: usize = 200;

#[derive(Clone, Copy, Debug)]
pub struct Reference {
    /// One `fdatasync` of a file just appended 4 KiB to, p50.
    pub fsync_us: f64,
    /// One bare SQLite commit (WAL, one small insert, `synchronous=FULL`: it fsyncs), p50.
    pub commit_us: f64,
    /// The same commit with `synchronous=OFF`: SQLite's CPU cost of a commit, no disk wait.
    pub commit_nosync_us: f64,
}

impl Reference {
    /// Durable commits per second one at a time: the rate a loop with one fsync per step and
    /// no group commit could never exceed on this disk.
    pub fn serial_fsyncs_per_sec(&self) -> f64 {
        per(1e6, self.fsync_us)
    }
}

/// Measures the reference in `dir` (a fresh subdirectory, removed afterwards).
pub fn measure(dir: &Path) -> Result<Reference> {
    let dir = tempfile::Builder::new()
        .prefix("harness-bench-reference-")
        .tempdir_in(dir)
        .with_context(|| format!("cannot create a directory in {}", dir.display()))?;
    measure_in(dir.path())
}

fn measure_in(dir: &Path) -> Result<Reference> {
    let mut file = std::fs::File::create(dir.join("fsync.bin"))?;
    let block = vec![0u8; 4096];
    let mut fsync = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        file.write_all(&block)?;
        let t = Instant::now();
        file.sync_data()?;
        fsync.push(t.elapsed().as_nanos() as u64);
    }
    let commit = |synchronous: &str, name: &str| -> Result<f64> {
        let conn = Connection::open(dir.join(name))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", synchronous)?;
        conn.execute_batch("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT NOT NULL)")?;
        let mut ns = Vec::with_capacity(SAMPLES);
        for i in 0..SAMPLES {
            let t = Instant::now();
            conn.execute_batch("BEGIN IMMEDIATE")?;
            conn.prepare_cached("INSERT INTO t(v) VALUES (?1)")?
                .execute([format!("row {i}")])?;
            conn.execute_batch("COMMIT")?;
            ns.push(t.elapsed().as_nanos() as u64);
        }
        Ok(Percentiles::of(ns).p50)
    };
    Ok(Reference {
        fsync_us: Percentiles::of(fsync).p50,
        commit_us: commit("FULL", "full.db")?,
        commit_nosync_us: commit("OFF", "off.db")?,
    })
}
