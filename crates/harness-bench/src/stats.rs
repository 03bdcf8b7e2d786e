//! Percentiles, rounding, and what the process reads about itself (CPU time, resident set, the
//! filesystem under the bench directory).

use std::collections::HashMap;
use std::path::Path;

use crate::probe::StepSample;

/// The `q` quantile of sorted ns samples (nearest rank), in µs; 0 without samples.
pub(crate) fn percentile_us(sorted_ns: &[u64], q: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ns.len() - 1) as f64 * q).round() as usize;
    sorted_ns[i.min(sorted_ns.len() - 1)] as f64 / 1000.0
}

/// Per operation over `samples`: (calls per step, mean µs per step).
pub(crate) fn op_means(samples: &[StepSample]) -> HashMap<String, (f64, f64)> {
    let mut by_op: HashMap<String, (u64, u64)> = HashMap::new();
    for s in samples {
        for (op, (n, ns)) in &s.by_op {
            let e = by_op.entry(op.clone()).or_default();
            e.0 += n;
            e.1 += ns;
        }
    }
    let count = samples.len().max(1) as f64;
    by_op
        .into_iter()
        .map(|(op, (n, ns))| (op, (n as f64 / count, ns as f64 / 1000.0 / count)))
        .collect()
}

/// p50 of `f` over `samples`, in µs.
pub(crate) fn p50_of(samples: &[StepSample], f: impl Fn(&StepSample) -> u64) -> f64 {
    percentile_us(&sorted(samples.iter().map(f).collect()), 0.5)
}

pub(crate) fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(crate) fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

/// CPU time of the whole process (every thread, user + system) in µs, from /proc/self/stat
/// (clock ticks, assumed 100 Hz as on every mainstream Linux); 0 where unavailable.
pub(crate) fn cpu_time_us() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) * 10_000
}

/// Resident set size in bytes (Linux; None elsewhere).
pub(crate) fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The filesystem type of the mount holding `path` (from /proc/self/mounts).
pub(crate) fn fs_type(path: &Path) -> Option<String> {
    let path = path.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, mount, fstype) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(mount)
                .then(|| (mount.len(), fstype.to_string()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, t)| t)
}
