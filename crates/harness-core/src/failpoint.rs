//! Crash injection for tests that kill a real process at an exact point of a step.
//!
//! `HARNESS_FAILPOINT=<name>[:<n>]` makes the process SIGKILL itself the n-th time (default 1st)
//! it reaches the failpoint `<name>`. Unset (always, outside crash tests) it costs one relaxed
//! atomic load. The names are listed in [`POINTS`].

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// Every failpoint the loop has, in the order a function step reaches them.
pub const POINTS: &[&str] = &[
    "after_send_persisted",
    "before_compaction_appended",
    "after_compaction_appended",
    "after_assistant_appended",
    "after_call_triggered",
    "after_call_target",
    "after_call_result_appended",
    "after_call_done",
    // A turn's advanced record and its next step, committed as one batch (one transaction on
    // the embedded bus, so no kill finds the one without the other): by a step, a released or
    // delivered call (resolve), and the recovery at start.
    "after_advance_persisted",
    // A stop (or a cut) closed the open calls, before the finalizer's batch writes their results.
    "after_calls_closed",
    "after_finalize_persisted",
    // A session tree deletion, after one member is deleted and before its progress is saved.
    "after_member_deleted",
];

struct Armed {
    name: String,
    nth: u32,
    seen: AtomicU32,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var("HARNESS_FAILPOINT").ok()?;
            let (name, nth) = match spec.split_once(':') {
                Some((name, n)) => (name.to_string(), n.parse().unwrap_or(1)),
                None => (spec, 1),
            };
            Some(Armed {
                name,
                nth,
                seen: AtomicU32::new(0),
            })
        })
        .as_ref()
}

/// Kills the process here if this failpoint is armed and its count is reached.
pub fn hit(name: &str) {
    let Some(a) = armed() else { return };
    if a.name != name {
        return;
    }
    if a.seen.fetch_add(1, Ordering::Relaxed) + 1 == a.nth {
        eprintln!("failpoint {name}: killing the process");
        kill_self();
    }
}

#[cfg(unix)]
fn kill_self() {
    // SAFETY: getpid and kill have no memory-safety preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

#[cfg(not(unix))]
fn kill_self() {
    std::process::abort();
}
