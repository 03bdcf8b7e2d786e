//! Function ids ↔ provider tool names.
//!
//! Function ids look like `engine::functions::list`; the Anthropic and OpenAI APIs accept tool
//! names matching `^[a-zA-Z0-9_-]{1,64}$` only. [`encode`] is a pure function of the id, so the
//! same id gets the same name in every request of a conversation (the model sees its own earlier
//! calls under the names it used), and it is injective:
//!
//! * the readable form replaces each `::` with `__` — used when the id has only `[A-Za-z0-9_-]`
//!   and `::` separators, contains no `__`, has no `_` touching a `::`, fits in 64 characters and
//!   does not end like the hashed form. Then every `__` run in the name comes from a `::` and
//!   [`decode_readable`] gives the id back;
//! * anything else becomes `<sanitized prefix>_h<16 hex digits of a 64-bit FNV-1a hash>`. The
//!   single `_` before `h` can never appear in a readable name, so the two forms never collide;
//!   two hashed ids collide only on a 64-bit hash collision, which [`ToolNames`] detects per
//!   request and reports instead of silently merging two functions.
//!
//! Mapping back uses the table of the request (every tool offered and every call in the
//! history), so hashed names decode too; a name the model invented decodes readably when it can.

use std::collections::HashMap;

use harness_types::digest::fnv1a_hex;

/// The longest name both APIs accept.
pub const MAX_NAME: usize = 64;

const HASH_SUFFIX: usize = 2 + 16; // "_h" + 16 hex digits

fn valid_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// True when `name` has the shape of a hashed name.
fn looks_hashed(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() > HASH_SUFFIX
        && b[b.len() - HASH_SUFFIX..b.len() - 16] == *b"_h"
        && b[b.len() - HASH_SUFFIX - 1] != b'_'
        && b[b.len() - 16..]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

fn readable(id: &str) -> Option<String> {
    if id.is_empty() || id.contains("__") || id.contains("_::") || id.contains("::_") {
        return None;
    }
    let name = id.replace("::", "__");
    if name.len() > MAX_NAME || !name.chars().all(valid_char) || looks_hashed(&name) {
        return None;
    }
    // A lone `:` (not part of `::`) would have survived the replace and failed `valid_char`.
    Some(name)
}

/// The tool name for a function id.
pub fn encode(id: &str) -> String {
    if let Some(name) = readable(id) {
        return name;
    }
    let mut prefix: String = id
        .replace("::", "__")
        .chars()
        .map(|c| if valid_char(c) { c } else { '_' })
        .take(MAX_NAME - HASH_SUFFIX)
        .collect();
    while prefix.ends_with('_') {
        prefix.pop();
    }
    if prefix.is_empty() {
        prefix.push('f');
    }
    format!("{prefix}_h{}", fnv1a_hex(id.as_bytes()))
}

/// The id of a readable name (`__` → `::`); `None` for hashed names.
pub fn decode_readable(name: &str) -> Option<String> {
    if looks_hashed(name) {
        return None;
    }
    Some(name.replace("__", "::"))
}

/// Two function ids of one request map to the same tool name.
#[derive(Debug, thiserror::Error)]
#[error("function ids '{0}' and '{1}' map to the same tool name '{2}'")]
pub struct NameCollision(pub String, pub String, pub String);

/// The name table of one request.
#[derive(Debug, Default, Clone)]
pub struct ToolNames {
    to_id: HashMap<String, String>,
}

impl ToolNames {
    /// Registers `id` and returns its name.
    pub fn add(&mut self, id: &str) -> Result<String, NameCollision> {
        let name = encode(id);
        match self.to_id.get(&name) {
            Some(existing) if existing != id => {
                Err(NameCollision(existing.clone(), id.to_string(), name))
            }
            Some(_) => Ok(name),
            None => {
                self.to_id.insert(name.clone(), id.to_string());
                Ok(name)
            }
        }
    }

    /// The function id of a name the model used.
    pub fn id_of(&self, name: &str) -> String {
        if let Some(id) = self.to_id.get(name) {
            return id.clone();
        }
        decode_readable(name).unwrap_or_else(|| name.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_ids_stay_readable_and_round_trip() {
        for id in [
            "engine::functions::list",
            "agent_trigger",
            "submit_result",
            "coder::read-file",
            "a::::b",
            "x",
        ] {
            let name = encode(id);
            assert!(
                name.len() <= MAX_NAME && name.chars().all(valid_char),
                "{name}"
            );
            assert_eq!(
                decode_readable(&name).as_deref(),
                Some(id),
                "{id} -> {name}"
            );
        }
        assert_eq!(encode("session::append"), "session__append");
    }

    #[test]
    fn ambiguous_ids_get_distinct_hashed_names() {
        let ids = [
            "a_::b",
            "a::_b",
            "a__b",
            "a:b",
            "a b",
            "ünï::cödé",
            "",
            &"long::".repeat(20),
            "x_h0123456789abcdef",
        ];
        let mut names = ToolNames::default();
        let mut seen = std::collections::HashSet::new();
        for id in ids {
            let name = names.add(id).unwrap();
            assert!(
                !name.is_empty() && name.len() <= MAX_NAME && name.chars().all(valid_char),
                "{name}"
            );
            assert!(looks_hashed(&name), "{id} -> {name}");
            assert!(seen.insert(name.clone()), "{id} collided");
            assert_eq!(names.id_of(&name), id);
        }
        // Readable names never look hashed, so the forms cannot meet.
        assert!(!looks_hashed(&encode("a::b")));
        assert_ne!(encode("a_::b"), encode("a::_b"));
        // A model sees, and transcripts keep, the hashed name: its bytes are pinned.
        assert_eq!(encode("a b"), "a_b_he63f991904833892");
    }

    #[test]
    fn unknown_names_decode_readably() {
        let names = ToolNames::default();
        assert_eq!(names.id_of("web__fetch"), "web::fetch");
        assert_eq!(names.id_of("plain"), "plain");
    }
}
