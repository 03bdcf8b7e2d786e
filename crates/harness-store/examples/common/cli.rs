//! The command line of the store benchmarks (this crate's `throughput`, `harness-session`'s
//! `turn_writes`): `[sessions] [seconds] [full|normal]`.

use harness_store::Durability;

/// (sessions, seconds, durability) from the process's arguments; 200 sessions, 5 seconds and
/// `full` where one is not given.
pub fn parse() -> (usize, u64, Durability) {
    let args: Vec<String> = std::env::args().collect();
    let sessions = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    let seconds = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let durability = match args.get(3).map(String::as_str) {
        Some("normal") => Durability::Normal,
        _ => Durability::Full,
    };
    (sessions, seconds, durability)
}
