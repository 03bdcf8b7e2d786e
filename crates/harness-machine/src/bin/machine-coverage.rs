//! `machine-coverage <dir>`: every row of the turn and call machines' tables, reached or not,
//! from what runs with `HARNESS_MACHINE_COVERAGE=<dir>` recorded. Exits 1 if a row was not
//! reached, 2 on bad usage or an unreadable directory.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: machine-coverage <dir>  (the directory HARNESS_MACHINE_COVERAGE named)");
        return ExitCode::from(2);
    };
    let rows = match harness_machine::coverage::report(std::path::Path::new(&dir)) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("machine-coverage: cannot read {dir}: {e}");
            return ExitCode::from(2);
        }
    };
    let mut missing = 0;
    for r in &rows {
        let mark = if r.reached { "reached" } else { "NOT REACHED" };
        println!("{:<4} {} {:<11} {}", r.machine, r.row, mark, r.says);
        missing += usize::from(!r.reached);
    }
    println!(
        "{} of {} rows reached; {missing} not reached",
        rows.len() - missing,
        rows.len()
    );
    if missing > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
