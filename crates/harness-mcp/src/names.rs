//! MCP tool names → function ids `mcp::<server>::<tool>`.
//!
//! A tool name may hold anything a server likes (`files/read`, `search.web`, spaces, `::`); a
//! function id segment here keeps to `[A-Za-z0-9_-]`, which is what policy globs
//! (`mcp::notes::*`) and provider tool names (`names.rs` in the router) handle without
//! surprises. Every other character becomes `_`. Two tools that sanitize alike are told apart
//! deterministically: the names are taken in sorted order and a repeat gets `_2`, `_3`, ... ,
//! so the same list always gives the same ids. The original name is kept for the call.

use std::collections::BTreeMap;

/// The prefix of every MCP function id.
pub const PREFIX: &str = "mcp";

/// The segment a tool name becomes.
pub fn sanitize(tool: &str) -> String {
    let s: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "_".into()
    } else {
        s
    }
}

/// `mcp::<server>::<segment>`.
pub fn function_id(server: &str, segment: &str) -> String {
    format!("{PREFIX}::{server}::{segment}")
}

/// Function id → original tool name, for every tool of one server.
pub fn assign(server: &str, tools: impl IntoIterator<Item = String>) -> BTreeMap<String, String> {
    let mut names: Vec<String> = tools.into_iter().collect();
    names.sort();
    names.dedup();
    let mut out = BTreeMap::new();
    for name in names {
        let base = sanitize(&name);
        let mut id = function_id(server, &base);
        let mut n = 2;
        while out.contains_key(&id) {
            id = function_id(server, &format!("{base}_{n}"));
            n += 1;
        }
        out.insert(id, name);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitized_and_collisions_numbered_in_sorted_order() {
        let m = assign(
            "s",
            ["files/read", "files.read", "echo", "a::b", ""].map(String::from),
        );
        let v: Vec<(&str, &str)> = m.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            v,
            vec![
                ("mcp::s::_", ""),
                ("mcp::s::a__b", "a::b"),
                ("mcp::s::echo", "echo"),
                ("mcp::s::files_read", "files.read"),
                ("mcp::s::files_read_2", "files/read"),
            ]
        );
    }
}
