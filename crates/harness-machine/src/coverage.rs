//! Transition coverage: which rows of each machine's table a run took.
//!
//! With `HARNESS_MACHINE_COVERAGE=<dir>` set, every transition appends `<machine> <row>` to a
//! file of its own process in `<dir>` (the first time the process takes that row: a run pays
//! one small write per row, not per transition). Unset, a transition costs one check of an
//! initialized `OnceLock`. `machine-coverage <dir>` ([`report`]) reads the files back and lists
//! every row of both tables as reached or not.

use std::collections::{BTreeSet, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The variable naming the directory the rows go to.
pub const ENV: &str = "HARNESS_MACHINE_COVERAGE";

struct Sink {
    file: File,
    seen: HashSet<(&'static str, &'static str)>,
}

static SINK: OnceLock<Option<Mutex<Sink>>> = OnceLock::new();

fn open() -> Option<Mutex<Sink>> {
    let dir = PathBuf::from(std::env::var_os(ENV)?);
    // Coverage is a test aid: a directory that cannot be written leaves the run uncounted
    // (the report then says so), never a failed turn.
    std::fs::create_dir_all(&dir).ok()?;
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{}.rows", std::process::id())))
        .ok()?;
    Some(Mutex::new(Sink {
        file,
        seen: HashSet::new(),
    }))
}

/// Records that `machine` took table row `row`.
pub fn hit(machine: &'static str, row: &'static str) {
    let Some(sink) = SINK.get_or_init(open) else {
        return;
    };
    let Ok(mut sink) = sink.lock() else { return };
    if sink.seen.insert((machine, row)) {
        let _ = writeln!(sink.file, "{machine} {row}");
    }
}

/// One row of a table and whether a run reached it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowReach {
    pub machine: &'static str,
    pub row: &'static str,
    pub says: &'static str,
    pub reached: bool,
}

/// Every table the report covers: the machine's name and its rows.
pub fn tables() -> [(&'static str, &'static [(&'static str, &'static str)]); 2] {
    [("turn", crate::machine::ROWS), ("call", crate::call::ROWS)]
}

/// Every row of every table, reached or not, from the files in `dir`.
pub fn report(dir: &Path) -> std::io::Result<Vec<RowReach>> {
    let mut hits = BTreeSet::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rows") {
            for line in std::fs::read_to_string(&path)?.lines() {
                if let Some((machine, row)) = line.split_once(' ') {
                    hits.insert((machine.to_string(), row.to_string()));
                }
            }
        }
    }
    let mut out = Vec::new();
    for (machine, rows) in tables() {
        for &(row, says) in rows {
            out.push(RowReach {
                machine,
                row,
                says,
                reached: hits.contains(&(machine.to_string(), row.to_string())),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// Each machine's module docs print its table; the rows there are the rows in code, in order.
    #[test]
    fn the_docs_tables_list_exactly_the_rows() {
        let docs = [
            ("turn", include_str!("machine.rs"), "//! | T"),
            ("call", include_str!("call.rs"), "//! | C"),
        ];
        for ((machine, rows), (named, source, prefix)) in super::tables().into_iter().zip(docs) {
            assert_eq!(machine, named);
            let listed: Vec<&str> = source
                .lines()
                .filter_map(|l| l.strip_prefix(prefix))
                .map(|l| &l[..2])
                .collect();
            let ids: Vec<&str> = rows.iter().map(|r| &r.0[1..]).collect();
            assert_eq!(listed, ids, "the {machine} machine's docs table");
        }
    }
}
