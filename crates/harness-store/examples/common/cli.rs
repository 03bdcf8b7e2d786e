//! The command line of the store benchmarks (this crate's `throughput`, `harness-session`'s
//! `turn_writes`): `[sessions] [seconds] [full|normal]`.

use harness_store::Durability;

/// How many sessions run, for how many seconds, at which durability.
pub struct Cli {
    pub sessions: usize,
    pub seconds: u64,
    pub durability: Durability,
}

impl Cli {
    /// The process's arguments; 200 sessions, 5 seconds and `full` where one is not given.
    pub fn parse() -> Cli {
        let args: Vec<String> = std::env::args().collect();
        Cli {
            sessions: args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200),
            seconds: args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5),
            durability: match args.get(3).map(String::as_str) {
                Some("normal") => Durability::Normal,
                _ => Durability::Full,
            },
        }
    }
}
