//! Percentiles and the figures every phase takes of its steps, rounding, and what the process
//! reads about itself (CPU time, resident set, the filesystem under the bench directory).

use std::collections::HashMap;
use std::fmt;
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

/// The p50 and p99 of a set of ns samples (nearest rank), in µs.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Percentiles {
    pub(crate) samples: usize,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
}

impl Percentiles {
    pub(crate) fn of(ns: Vec<u64>) -> Percentiles {
        let ns = sorted(ns);
        Percentiles {
            samples: ns.len(),
            p50: percentile_us(&ns, 0.5),
            p99: percentile_us(&ns, 0.99),
        }
    }
}

/// As the progress lines say it: "p50 0.12 ms p99 0.34 ms".
impl fmt::Display for Percentiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "p50 {:.2} ms p99 {:.2} ms",
            self.p50 / 1e3,
            self.p99 / 1e3
        )
    }
}

/// What a set of measured steps took, as every phase that times steps reports it.
pub(crate) struct Steps {
    /// The whole step: the handler's wall time (less what [`Steps::less`] takes out).
    pub(crate) whole: Percentiles,
    /// The same less the time awaiting the store: the loop's own work.
    pub(crate) outside_store: Percentiles,
    /// Time awaiting the store, and the store operations awaited, per step.
    pub(crate) store: Percentiles,
    pub(crate) store_ops: f64,
}

impl Steps {
    pub(crate) fn of<'a>(samples: impl IntoIterator<Item = &'a StepSample>) -> Steps {
        Steps::less(samples, |_| 0)
    }

    /// The steps with `taken_out` ns of each taken out of its wall time (a call step's time
    /// awaiting its target).
    pub(crate) fn less<'a>(
        samples: impl IntoIterator<Item = &'a StepSample>,
        taken_out: impl Fn(&StepSample) -> u64,
    ) -> Steps {
        let (mut whole, mut outside, mut store, mut ops) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for s in samples {
            let wall = s.wall_ns.saturating_sub(taken_out(s));
            whole.push(wall);
            outside.push(wall.saturating_sub(s.store_ns));
            store.push(s.store_ns);
            ops += s.store_ops;
        }
        let n = whole.len().max(1) as f64;
        Steps {
            whole: Percentiles::of(whole),
            outside_store: Percentiles::of(outside),
            store: Percentiles::of(store),
            store_ops: ops as f64 / n,
        }
    }

    /// Steps measured.
    pub(crate) fn count(&self) -> usize {
        self.whole.samples
    }
}

/// An operation's calls and time per step, averaged over the steps measured.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OpMean {
    pub(crate) calls: f64,
    pub(crate) us: f64,
}

/// Per operation over `samples`: its calls and time per step.
pub(crate) fn op_means(samples: &[StepSample]) -> HashMap<String, OpMean> {
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
        .map(|(op, (n, ns))| {
            let mean = OpMean {
                calls: n as f64 / count,
                us: ns as f64 / 1000.0 / count,
            };
            (op, mean)
        })
        .collect()
}

/// p50 of `f` over `samples`, in µs.
pub(crate) fn p50_of(samples: &[StepSample], f: impl Fn(&StepSample) -> u64) -> f64 {
    Percentiles::of(samples.iter().map(f).collect()).p50
}

pub(crate) fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

/// `x` in units of `unit`: a ratio, a mean, a share; 0 when `unit` is not positive (nothing
/// measured to divide by).
pub(crate) fn per(x: f64, unit: f64) -> f64 {
    if unit > 0.0 {
        x / unit
    } else {
        0.0
    }
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// A line of progress on stderr (stdout holds only the report), formatted as `eprintln!` does.
macro_rules! progress {
    ($($arg:tt)*) => {
        eprintln!("bench: {}", format_args!($($arg)*))
    };
}
pub(crate) use progress;

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
