//! System prompt assembly: resolved once at send time and frozen on the record; each step only
//! appends the runtime aid after it.

use harness_types::api::{FunctionPolicy, SystemPromptStrategy};

/// The built-in identity every agent starts from.
pub const IDENTITY: &str =
    "You are a capable assistant working inside harness, a durable agent loop. \
Answer directly and concisely. When functions are available, call them only when they help, and \
never call a function the dispatch policy does not allow.";

pub(crate) fn resolve(custom: Option<&str>, strategy: SystemPromptStrategy) -> Option<String> {
    let custom = custom.map(str::trim).filter(|c| !c.is_empty());
    match (strategy, custom) {
        (SystemPromptStrategy::Disabled, _) => None,
        (SystemPromptStrategy::Override, Some(c)) => Some(c.to_string()),
        (SystemPromptStrategy::Enrich, Some(c)) => Some(format!("{IDENTITY}\n\n{c}")),
        (_, None) => Some(IDENTITY.to_string()),
    }
}

/// The short policy aid line the prompt carries.
pub(crate) fn policy_aid(policy: Option<&FunctionPolicy>) -> Option<String> {
    let Some(p) = policy.filter(|p| !p.allow.is_empty()) else {
        return Some(
            "Function dispatch is entirely disabled this turn — do not call any function.".into(),
        );
    };
    if p.allow.iter().any(|a| a == "*") && p.deny.is_empty() {
        return None;
    }
    let mut allow: Vec<&str> = p.allow.iter().map(String::as_str).collect();
    allow.sort();
    allow.dedup();
    let mut line = String::from("Functions you may call this turn: ");
    line.push_str(
        &allow
            .iter()
            .take(30)
            .copied()
            .collect::<Vec<_>>()
            .join(", "),
    );
    if allow.len() > 30 {
        line.push_str(", …");
    }
    line.push('.');
    if !p.deny.is_empty() {
        let mut deny: Vec<&str> = p.deny.iter().map(String::as_str).collect();
        deny.sort();
        deny.dedup();
        line.push_str(&format!(" Deny-listed on top: {}.", deny.join(", ")));
    }
    Some(line)
}

/// The prompt sent with one generation: the frozen prompt plus the runtime aid.
pub(crate) fn for_step(
    frozen: Option<&str>,
    session_id: &str,
    policy: Option<&FunctionPolicy>,
) -> Option<String> {
    let mut aid = format!("Your session id is {session_id}.");
    if let Some(line) = policy_aid(policy) {
        aid.push('\n');
        aid.push_str(&line);
    }
    Some(match frozen {
        Some(p) => format!("{p}\n\n{aid}"),
        None => aid,
    })
}

/// The cache seam of a step's prompt: when the prompt still starts with the frozen prefix, the
/// router gets it as two sections (the stable one marked as a cache boundary) plus a digest of
/// the stable text, so providers with prompt caching reuse it across steps and turns.
pub(crate) fn cache_sections(
    frozen: Option<&str>,
    prompt: Option<&str>,
) -> Option<serde_json::Value> {
    let (stable, prompt) = (frozen?, prompt?);
    let rest = prompt.strip_prefix(stable)?.strip_prefix("\n\n")?;
    let hex = harness_types::digest::sha256_hex(stable.as_bytes());
    Some(serde_json::json!({
        "system_sections": [{"text": stable, "cache_boundary": true}, {"text": rest, "cache_boundary": false}],
        "cache_intent": {"surface_digest": format!("sha256:{hex}")}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sections_split_at_the_frozen_prefix() {
        let s =
            cache_sections(Some("identity"), Some("identity\n\nYour session id is s.")).unwrap();
        assert_eq!(
            s["system_sections"][0],
            serde_json::json!({"text": "identity", "cache_boundary": true})
        );
        assert_eq!(s["system_sections"][1]["text"], "Your session id is s.");
        assert!(s["cache_intent"]["surface_digest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"));
        assert!(cache_sections(Some("identity"), Some("rewritten by a hook")).is_none());
        assert!(cache_sections(None, Some("x")).is_none());
    }

    #[test]
    fn strategies() {
        assert_eq!(
            resolve(Some("X"), SystemPromptStrategy::Override).as_deref(),
            Some("X")
        );
        assert_eq!(
            resolve(Some("X"), SystemPromptStrategy::Enrich),
            Some(format!("{IDENTITY}\n\nX"))
        );
        assert_eq!(resolve(Some("X"), SystemPromptStrategy::Disabled), None);
        assert_eq!(
            resolve(Some("  "), SystemPromptStrategy::Override).as_deref(),
            Some(IDENTITY)
        );
    }

    #[test]
    fn policy_aid_lines() {
        assert!(policy_aid(None).unwrap().contains("entirely disabled"));
        let all = FunctionPolicy {
            allow: vec!["*".into()],
            ..Default::default()
        };
        assert_eq!(policy_aid(Some(&all)), None);
        let some = FunctionPolicy {
            allow: vec!["b::x".into(), "a::*".into()],
            deny: vec!["a::rm".into()],
            ..Default::default()
        };
        assert_eq!(
            policy_aid(Some(&some)).unwrap(),
            "Functions you may call this turn: a::*, b::x. Deny-listed on top: a::rm."
        );
    }
}
