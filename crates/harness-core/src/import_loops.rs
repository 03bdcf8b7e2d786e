//! No two of core's modules import each other, directly or around a circle: a reader (or "go
//! to definition") can then place a module below the ones it uses. Read off the sources: every
//! `crate::<module>` path outside comments and test modules, with the crate root's re-exports
//! (`crate::Harness`) counted as the module they come from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The names a `crate::` path starts with: `crate::a::b` gives `a`, `crate::{a, b::c}` gives
/// `a` and `b`.
fn heads(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        match rest.strip_prefix('{') {
            Some(group) => {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                out.extend(group.split(',').map(|g| ident(g.trim()).to_string()));
            }
            None => out.push(ident(rest).to_string()),
        }
    }
    out.retain(|h| !h.is_empty());
    out
}

/// The code of a file without comments and without its test module.
fn code(text: &str) -> String {
    let text = &text[..text.find("#[cfg(test)]").unwrap_or(text.len())];
    text.lines()
        .map(|l| &l[..l.find("//").unwrap_or(l.len())])
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module each name the crate root re-exports comes from (`Harness` → `harness`).
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in code(lib).split(';') {
        let stmt = stmt.trim();
        let Some(path) = stmt
            .strip_prefix("pub use ")
            .or_else(|| stmt.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let Some((module, names)) = path.split_once("::") else {
            continue;
        };
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let last = name.trim().rsplit("::").next().unwrap_or_default();
            let last = last.split(" as ").last().unwrap_or_default().trim();
            if !last.is_empty() {
                out.insert(last.to_string(), module.trim().to_string());
            }
        }
    }
    out
}

fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// Module → the modules it names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let via_root = reexports(&lib);
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let stem = file.file_stem().unwrap().to_string_lossy().to_string();
        if rel == Path::new("lib.rs") || stem.contains("tests") || stem == "import_loops" {
            continue;
        }
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let top = top.trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        let deps = graph.entry(top.clone()).or_default();
        for head in heads(&code(&text)) {
            let module = via_root.get(&head).cloned().unwrap_or(head);
            if module != top
                && module
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_lowercase())
            {
                deps.insert(module);
            }
        }
    }
    graph
}

/// A circle through `from`, if one exists (the modules in order).
fn circle(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![(from.to_string(), vec![from.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((at, path)) = stack.pop() {
        for next in graph.get(&at).into_iter().flatten() {
            if next == from {
                return Some(path.clone());
            }
            if graph.contains_key(next) && seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn no_module_of_core_imports_one_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = graph(&src);
    assert!(graph.len() > 20, "the sources were read: {graph:?}");
    assert!(graph["send"].contains("harness"), "paths were read");
    let circles: Vec<String> = graph
        .keys()
        .filter_map(|m| circle(&graph, m))
        .map(|c| c.join(" → "))
        .collect();
    assert!(circles.is_empty(), "import circles: {circles:#?}");
}

#[test]
fn a_circle_is_found_through_the_crate_roots_reexports() {
    let lib = "pub use harness::Harness;\npub use dispatch::{model_verdict, wall};";
    let roots = reexports(lib);
    assert_eq!(roots["Harness"], "harness");
    assert_eq!(roots["wall"], "dispatch");
    assert_eq!(
        heads("use crate::{a, b::c};\nimpl crate::Harness {}"),
        ["a", "b", "Harness"]
    );
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("harness".into())
        .or_default()
        .insert("trace".into());
    g.entry("trace".into())
        .or_default()
        .insert("harness".into());
    g.entry("send".into()).or_default().insert("harness".into());
    assert_eq!(
        circle(&g, "trace"),
        Some(vec!["trace".to_string(), "harness".to_string()])
    );
    assert_eq!(circle(&g, "send"), None);
}
