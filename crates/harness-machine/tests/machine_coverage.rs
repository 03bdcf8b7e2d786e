//! Coverage recording and its report, in a process of their own (the recorder reads its
//! variable once per process).

use harness_machine::call::{self, CallInput, CallPhase, Check};
use harness_machine::coverage;

#[test]
fn rows_taken_are_recorded_once_and_the_report_names_the_rest_unreached() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var(coverage::ENV, dir.path());
    for _ in 0..3 {
        call::next(CallPhase::Planned, CallInput::Reached { stopped: false }).unwrap();
    }
    call::next(CallPhase::Planned, CallInput::Checked(Check::Ask)).unwrap();
    // A refused pair takes no row.
    assert!(call::next(CallPhase::Done, CallInput::Recover).is_err());

    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(files.len(), 1, "one file per process");
    let written = std::fs::read_to_string(files[0].as_ref().unwrap().path()).unwrap();
    assert_eq!(written, "call C01\ncall C07\n", "each row once");

    let rows = coverage::report(dir.path()).unwrap();
    let total = harness_machine::machine::ROWS.len() + call::ROWS.len();
    assert_eq!(rows.len(), total, "every row of both tables is listed");
    let reached: Vec<_> = rows.iter().filter(|r| r.reached).map(|r| r.row).collect();
    assert_eq!(reached, ["C01", "C07"]);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_machine-coverage"))
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "rows are unreached");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("call C07 reached"), "{text}");
    assert!(text.contains("turn T01 NOT REACHED"), "{text}");
    assert!(
        text.contains(&format!("2 of {total} rows reached")),
        "{text}"
    );

    // Every row reached: the report passes.
    let full = tempfile::tempdir().unwrap();
    let mut all = String::new();
    for (machine, rows) in coverage::tables() {
        for (row, _) in rows {
            all.push_str(&format!("{machine} {row}\n"));
        }
    }
    std::fs::write(full.path().join("1.rows"), all).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_machine-coverage"))
        .arg(full.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}
