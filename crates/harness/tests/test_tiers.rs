//! The test tiers of `.cargo/config.toml` cover the suite: every test target under
//! `crates/*/tests` is named by exactly one of `test-integration`, `test-crash` and `test-live`,
//! and each name there is a target that exists. Without this, a new test file would silently run
//! in no tier of CI.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Each alias of the `[alias]` table with the words of its command, in order. The file is ours
/// and keeps one form (`name = [ "word", … ]`, possibly over several lines), so a small reader
/// is enough.
fn aliases(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line == "[alias]" {
            continue;
        }
        let words_part = match line.split_once('=') {
            Some((name, rest)) if current.is_none() => {
                current = Some(name.trim().to_string());
                rest
            }
            _ => line,
        };
        let name = current.clone().expect("a word outside any alias");
        let words = out.entry(name).or_insert_with(Vec::new);
        words.extend(words_part.split('"').skip(1).step_by(2).map(str::to_string));
        if words_part.trim_end().ends_with(']') {
            current = None;
        }
    }
    out
}

fn targets_of(words: &[String]) -> Vec<String> {
    words
        .windows(2)
        .filter(|w| w[0] == "--test")
        .map(|w| w[1].clone())
        .collect()
}

fn test_targets() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for krate in std::fs::read_dir(workspace().join("crates")).unwrap() {
        let tests = krate.unwrap().path().join("tests");
        let Ok(dir) = std::fs::read_dir(&tests) else {
            continue;
        };
        for f in dir {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|e| e == "rs") {
                out.insert(p.file_stem().unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out
}

#[test]
fn every_test_target_is_in_exactly_one_tier_and_every_tier_names_real_targets() {
    let text = std::fs::read_to_string(workspace().join(".cargo/config.toml")).unwrap();
    let aliases = aliases(&text);
    for tier in ["test-unit", "test-integration", "test-crash", "test-live"] {
        let words = aliases
            .get(tier)
            .unwrap_or_else(|| panic!("no alias {tier}"));
        assert_eq!(words[0], "test", "{tier}");
        for w in ["--workspace", "--locked", "--features", "harness/iii"] {
            assert!(words.contains(&w.to_string()), "{tier} lacks {w}");
        }
    }
    let unit = &aliases["test-unit"];
    assert!(unit.contains(&"--lib".into()) && unit.contains(&"--bins".into()));
    assert!(
        targets_of(unit).is_empty(),
        "the unit tier runs no tests/ target"
    );

    let targets = test_targets();
    let mut seen: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for tier in ["test-integration", "test-crash", "test-live"] {
        for t in targets_of(&aliases[tier]) {
            assert!(
                targets.contains(&t),
                "{tier} names {t}, which is no test target"
            );
            seen.entry(t).or_default().push(tier);
        }
    }
    for t in &targets {
        match seen.get(t).map(Vec::as_slice) {
            Some([_]) => {}
            None => panic!("test target {t} is in no tier of .cargo/config.toml"),
            Some(tiers) => panic!("test target {t} is in more than one tier: {tiers:?}"),
        }
    }
}

#[test]
fn the_reader_takes_one_line_and_several_line_aliases() {
    let a = aliases(
        "# note\n[alias]\nx = [\"test\", \"--lib\"]\ny = [\n    \"test\", # why\n    \"--test\", \"a\",\n]\n",
    );
    assert_eq!(a["x"], ["test", "--lib"]);
    assert_eq!(a["y"], ["test", "--test", "a"]);
    assert_eq!(targets_of(&a["y"]), ["a"]);
}
