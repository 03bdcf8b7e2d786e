//! System prompt assembly, the pure part: the built-in identity, the blocks a profile and the
//! skills index add, how the layers compose into the frozen prompt (and where its cacheable
//! prefix ends), and the runtime aid each step appends. Resolved once at send time and frozen on
//! the record; the I/O that gathers the layers is in `identity.rs`.

use harness_types::api::{FunctionPolicy, SystemPromptStrategy};
use harness_types::directory::SkillSummary;
use harness_types::router::{CacheIntent, ChatExtras, SystemSection};
use serde_json::Value;

use crate::record::PromptShape;

/// The built-in identity every agent starts from (a directory `system-prompts/default.md`
/// replaces it). Tool guidance only: how to find, read and call a function.
pub const IDENTITY: &str = "You are an agent running inside harness, a durable agent loop. You act by calling functions registered on the engine; the registry is the truth, trust it over memory.

To use a capability: list, info, call.
1. List: engine::functions::list (narrow it with `prefix`, `search` words or a `worker`) shows the functions you may call; engine::workers::list and engine::triggers::list show who serves them and the trigger types.
2. Info: engine::functions::info { function_id } returns one function's request schema; read it before the first call.
3. Call: call the function with a JSON object matching that schema (an object, never a string of JSON).

Only functions your dispatch policy allows will run; when none are allowed, answer directly. Be concise.";

/// The operating-mode paragraph `options.mode` puts before the identity (`mode\n\nidentity`,
/// as v1.0.6 did). `agent` is the loop's ordinary behaviour and adds nothing.
pub(crate) fn mode_paragraph(mode: Option<harness_types::api::Mode>) -> Option<&'static str> {
    use harness_types::api::Mode;
    match mode? {
        Mode::Agent => None,
        Mode::Plan => Some(crate::texts::MODE_PLAN),
        Mode::Ask => Some(crate::texts::MODE_ASK),
    }
}

/// A frozen prompt with the paragraph of mode `to` heading it instead of `from`'s; the
/// layer offsets move with it. Refused for a session whose prompt is disabled.
pub(crate) fn remode(
    text: Option<String>,
    shape: Option<PromptShape>,
    from: Option<harness_types::api::Mode>,
    to: Option<harness_types::api::Mode>,
) -> Result<(Option<String>, Option<PromptShape>), String> {
    let (old, new) = (mode_paragraph(from), mode_paragraph(to));
    if old == new {
        return Ok((text, shape));
    }
    let Some(text) = text else {
        return match new {
            Some(_) => Err("the session's system prompt is disabled, so it has no room for the mode's paragraph; name system_prompt_strategy 'enrich' with it".into()),
            None => Ok((None, shape)),
        };
    };
    let body = match old.and_then(|p| text.strip_prefix(p)?.strip_prefix("\n\n")) {
        Some(body) => body.to_string(),
        None => text.clone(),
    };
    let removed = text.len() - body.len();
    let (text, added) = match new {
        Some(p) => (format!("{p}\n\n{body}"), p.len() + 2),
        None => (body, 0),
    };
    let shape = shape.map(|s| PromptShape {
        base_len: s.base_len - removed + added,
        stable_len: s.stable_len - removed + added,
    });
    Ok((Some(text), shape))
}

/// The parts a frozen prompt is made of, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Layers {
    /// The identity: built-in, the directory's default, a profile (with its preloaded blocks),
    /// or an `override` text.
    pub base: String,
    /// The names-and-descriptions skills index.
    pub skills_index: Option<String>,
    /// The caller's `enrich` text: per session, so after the cacheable prefix.
    pub custom: Option<String>,
}

impl Layers {
    /// The frozen prompt and where its layers end.
    pub fn compose(&self) -> (String, PromptShape) {
        let mut text = self.base.clone();
        let base_len = text.len();
        if let Some(index) = &self.skills_index {
            text.push_str("\n\n");
            text.push_str(index);
        }
        let stable_len = text.len();
        if let Some(custom) = &self.custom {
            text.push_str("\n\n");
            text.push_str(custom);
        }
        (
            text,
            PromptShape {
                base_len,
                stable_len,
            },
        )
    }

    /// The layers of a frozen prompt, back from its shape (None when the shape does not fit).
    pub fn split(prompt: &str, shape: PromptShape) -> Option<Layers> {
        let base = prompt.get(..shape.base_len)?;
        let index = prompt.get(shape.base_len..shape.stable_len)?;
        let custom = prompt.get(shape.stable_len..)?;
        let part = |s: &str| s.strip_prefix("\n\n").map(str::to_string);
        Some(Layers {
            base: base.to_string(),
            skills_index: if index.is_empty() {
                None
            } else {
                Some(part(index)?)
            },
            custom: if custom.is_empty() {
                None
            } else {
                Some(part(custom)?)
            },
        })
    }
}

/// The identity and the caller's text per strategy (None: no prompt at all). `identity` is
/// the built-in one or the directory's replacement.
pub(crate) fn base_layers(
    identity: &str,
    custom: Option<&str>,
    strategy: SystemPromptStrategy,
) -> Option<Layers> {
    let custom = custom.map(str::trim).filter(|c| !c.is_empty());
    match (strategy, custom) {
        (SystemPromptStrategy::Disabled, _) => None,
        (SystemPromptStrategy::Override, Some(c)) => Some(Layers {
            base: c.to_string(),
            ..Layers::default()
        }),
        (SystemPromptStrategy::Enrich, Some(c)) => Some(Layers {
            base: identity.to_string(),
            custom: Some(c.to_string()),
            ..Layers::default()
        }),
        (_, None) => Some(Layers {
            base: identity.to_string(),
            ..Layers::default()
        }),
    }
}

/// The skills index frozen into new sessions: names and descriptions only; bodies come from
/// `directory::skills::get`. None when there is no skill to list.
pub(crate) fn skills_index(skills: &[SkillSummary]) -> Option<String> {
    if skills.is_empty() {
        return None;
    }
    let mut out = String::from(
        "<skills>\nSkills hold instructions for particular kinds of task. When one fits, read it with directory::skills::get {\"name\": \"<name>\"} before you start.\n",
    );
    for s in skills {
        out.push_str(&format!("- {}: {}\n", s.name, s.description));
    }
    out.push_str("</skills>");
    Some(out)
}

/// The `(name, description)` lines of a skills index.
fn index_lines(index: &str) -> Vec<(String, String)> {
    index
        .lines()
        .filter_map(|l| l.strip_prefix("- ")?.split_once(": "))
        .map(|(n, d)| (n.to_string(), d.to_string()))
        .collect()
}

/// The user-role correction a session gets when the skills catalog changed under the index
/// frozen in its prompt (the prompt itself never changes: it is the shared cache prefix).
/// `None` when the two indexes list the same skills.
pub(crate) fn skills_correction(seen: &str, now: Option<&str>) -> Option<String> {
    let (before, after) = (index_lines(seen), index_lines(now.unwrap_or_default()));
    let mut parts = Vec::new();
    for (name, description) in &after {
        match before.iter().find(|(n, _)| n == name) {
            None => parts.push(format!("added `{name}`: {description}")),
            Some((_, old)) if old != description => {
                parts.push(format!("changed `{name}`: {description}"))
            }
            Some(_) => {}
        }
    }
    for (name, _) in &before {
        if !after.iter().any(|(n, _)| n == name) {
            parts.push(format!("removed `{name}`"));
        }
    }
    (!parts.is_empty()).then(|| crate::texts::skills_changed(&parts.join("; ")))
}

/// One preloaded function: its id and, when the registry knows it, its description and
/// request schema.
pub(crate) struct Contract {
    pub id: String,
    pub found: Option<(String, Value)>,
}

/// The `<preloaded_functions>` block: each contract (description and compact request schema),
/// then the ids the registry did not know.
pub(crate) fn preloaded_functions(contracts: &[Contract]) -> Option<String> {
    if contracts.is_empty() {
        return None;
    }
    let mut out = String::from(
        "<preloaded_functions>\nContracts of functions you use routinely; call them directly, without looking them up.\n",
    );
    let mut missing = Vec::new();
    for c in contracts {
        match &c.found {
            Some((description, schema)) => {
                let mut schema = schema.clone();
                if let Some(map) = schema.as_object_mut() {
                    // Noise to a model, and identical for every function.
                    map.remove("$schema");
                    map.remove("title");
                }
                out.push_str(&format!(
                    "<function id=\"{}\">\n{}\nRequest schema: {}\n</function>\n",
                    c.id,
                    description.trim(),
                    schema
                ));
            }
            None => missing.push(c.id.as_str()),
        }
    }
    if !missing.is_empty() {
        out.push_str(&format!(
            "Unavailable (not registered when this session started): {}\n",
            missing.join(", ")
        ));
    }
    out.push_str("</preloaded_functions>");
    Some(out)
}

/// The `<preloaded_skills>` block: each body the directory served, then the names it could
/// not serve.
pub(crate) fn preloaded_skills(skills: &[(String, Option<String>)]) -> Option<String> {
    if skills.is_empty() {
        return None;
    }
    let mut out = String::from("<preloaded_skills>\n");
    let mut missing = Vec::new();
    for (name, body) in skills {
        match body {
            Some(body) => out.push_str(&format!(
                "<skill name=\"{name}\">\n{}\n</skill>\n",
                body.trim()
            )),
            None => missing.push(name.as_str()),
        }
    }
    if !missing.is_empty() {
        out.push_str(&format!("Unavailable skills: {}\n", missing.join(", ")));
    }
    out.push_str("</preloaded_skills>");
    Some(out)
}

/// The short policy aid line the prompt carries.
pub(crate) fn policy_aid(policy: Option<&FunctionPolicy>) -> Option<String> {
    let Some(p) = policy.filter(|p| !p.allow.is_empty()) else {
        return Some(crate::texts::DISPATCH_DISABLED.into());
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
    root: Option<&str>,
) -> Option<String> {
    let aid = runtime_aid(session_id, policy, root);
    Some(match frozen {
        Some(p) => format!("{p}\n\n{aid}"),
        None => aid,
    })
}

/// The per-step runtime context: session id, working directory (when the session has a
/// filesystem root) and the policy aid.
pub(crate) fn runtime_aid(
    session_id: &str,
    policy: Option<&FunctionPolicy>,
    root: Option<&str>,
) -> String {
    let mut aid = format!("Your session id is {session_id}.");
    if let Some(root) = root {
        aid.push_str(&format!("\nWorking directory: {root}"));
    }
    if let Some(line) = policy_aid(policy) {
        aid.push('\n');
        aid.push_str(&line);
    }
    aid
}

/// The filesystem root a session's metadata names (`fs_scope.root`), if any.
pub(crate) fn fs_root(metadata: Option<&Value>) -> Option<&str> {
    metadata?.get("fs_scope")?.get("root")?.as_str()
}

/// The cache seam of a step's prompt: when the prompt still starts with the frozen prefix, the
/// router gets it as two sections (the stable one marked as a cache boundary) plus a digest of
/// the stable text, so providers with prompt caching reuse it across steps and turns.
pub(crate) fn cache_sections(frozen: Option<&str>, prompt: Option<&str>) -> Option<ChatExtras> {
    let (stable, prompt) = (frozen?, prompt?);
    let rest = prompt.strip_prefix(stable)?.strip_prefix("\n\n")?;
    let section = |text: &str, cache_boundary| SystemSection {
        text: text.to_string(),
        cache_boundary,
    };
    Some(ChatExtras {
        system_sections: Some(vec![section(stable, true), section(rest, false)]),
        cache_intent: Some(CacheIntent {
            surface_digest: Some(format!("sha256:{}", stable_digest(stable))),
        }),
        reasoning: None,
    })
}

/// Stable prefixes whose digest is remembered (the latest ones used).
const DIGESTS_KEPT: usize = 16;

/// The SHA-256 (hex) of a frozen prefix. A session sends the same prefix (several KB) at every
/// step, so the digests of the latest few are kept: a compare of the text instead of hashing it
/// again on every step.
fn stable_digest(stable: &str) -> String {
    static KEPT: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());
    if let Ok(mut kept) = KEPT.lock() {
        if let Some(at) = kept.iter().position(|(text, _)| text == stable) {
            let hit = kept.remove(at);
            let hex = hit.1.clone();
            kept.push(hit);
            return hex;
        }
    }
    let hex = harness_types::digest::sha256_hex(stable.as_bytes());
    if let Ok(mut kept) = KEPT.lock() {
        if kept.len() >= DIGESTS_KEPT {
            kept.remove(0);
        }
        kept.push((stable.to_string(), hex.clone()));
    }
    hex
}

/// What `harness::status` and `turn-completed` report of the cache seam: the digest the
/// sections carried, or why none went out.
pub(crate) fn surface(
    enabled: bool,
    stable: Option<&str>,
    digest: Option<&str>,
) -> harness_types::api::PromptSurface {
    let fallback = |why: &str| harness_types::api::PromptSurface {
        prompt_surface_digest: None,
        prompt_sections_fallback: Some(why.into()),
    };
    if !enabled {
        return fallback("disabled");
    }
    if stable.is_none_or(str::is_empty) {
        return fallback("no_stable_prefix");
    }
    match digest {
        Some(d) => harness_types::api::PromptSurface {
            prompt_surface_digest: Some(d.to_string()),
            prompt_sections_fallback: None,
        },
        None => fallback("prefix_rewritten"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_prefix_digest_is_the_digest_of_that_prefix() {
        let prefixes: Vec<String> = (0..DIGESTS_KEPT + 3)
            .map(|i| format!("frozen prefix {i}"))
            .collect();
        // Twice over more prefixes than are kept: hits, misses and evictions all answer the
        // text's own digest.
        for p in prefixes
            .iter()
            .chain(&prefixes)
            .chain(prefixes.iter().rev())
        {
            assert_eq!(
                stable_digest(p),
                harness_types::digest::sha256_hex(p.as_bytes()),
                "{p}"
            );
        }
        let sections = cache_sections(Some("stable"), Some("stable\n\nrest")).unwrap();
        assert_eq!(
            sections.surface_digest(),
            Some(format!("sha256:{}", harness_types::digest::sha256_hex(b"stable")).as_str())
        );
    }

    #[test]
    fn a_skills_correction_names_what_was_added_changed_and_removed() {
        let index = |skills: &[(&str, &str)]| {
            skills_index(
                &skills
                    .iter()
                    .map(|(n, d)| SkillSummary {
                        name: n.to_string(),
                        description: d.to_string(),
                    })
                    .collect::<Vec<_>>(),
            )
        };
        let seen = index(&[("style", "House style."), ("tests", "How to test.")]).unwrap();
        assert_eq!(skills_correction(&seen, Some(&seen)), None);
        let now = index(&[("style", "House style, v2."), ("deploy", "How to ship.")]);
        let text = skills_correction(&seen, now.as_deref()).unwrap();
        assert!(text.contains("added `deploy`: How to ship."), "{text}");
        assert!(text.contains("changed `style`: House style, v2."), "{text}");
        assert!(text.contains("removed `tests`"), "{text}");
        let gone = skills_correction(&seen, None).unwrap();
        assert!(gone.contains("removed `style`") && gone.contains("removed `tests`"));
    }

    #[test]
    fn remode_swaps_the_paragraph_and_moves_the_layers() {
        use harness_types::api::Mode;
        let text = "identity\n\nindex".to_string();
        let shape = PromptShape {
            base_len: 8,
            stable_len: 15,
        };
        let (planned, s) = remode(Some(text.clone()), Some(shape), None, Some(Mode::Plan)).unwrap();
        let planned = planned.unwrap();
        let s = s.unwrap();
        assert!(planned.starts_with(mode_paragraph(Some(Mode::Plan)).unwrap()));
        assert!(planned[..s.base_len].ends_with("identity"));
        assert_eq!(&planned[..s.stable_len], planned.as_str());
        let (asked, s2) =
            remode(Some(planned), Some(s), Some(Mode::Plan), Some(Mode::Ask)).unwrap();
        let asked = asked.unwrap();
        assert!(asked.starts_with("Operating mode: ask."), "{asked}");
        assert!(!asked.contains("Operating mode: plan"), "{asked}");
        let (back, s3) = remode(Some(asked), s2, Some(Mode::Ask), Some(Mode::Agent)).unwrap();
        assert_eq!((back.unwrap(), s3.unwrap()), (text, shape));
        assert!(remode(None, None, None, Some(Mode::Plan)).is_err());
    }

    #[test]
    fn cache_sections_split_at_the_frozen_prefix() {
        let s =
            cache_sections(Some("identity"), Some("identity\n\nYour session id is s.")).unwrap();
        // The wire shape a router across the bus reads, field for field.
        let wire = serde_json::to_value(&s).unwrap();
        assert_eq!(
            wire["system_sections"][0],
            serde_json::json!({"text": "identity", "cache_boundary": true})
        );
        assert_eq!(wire["system_sections"][1]["text"], "Your session id is s.");
        assert_eq!(wire["system_sections"][1]["cache_boundary"], false);
        assert!(s.surface_digest().unwrap().starts_with("sha256:"));
        assert!(cache_sections(Some("identity"), Some("rewritten by a hook")).is_none());
        assert!(cache_sections(None, Some("x")).is_none());
    }

    #[test]
    fn strategies() {
        let base = |c, st| base_layers("ID", c, st).map(|l| l.compose().0);
        assert_eq!(
            base(Some("X"), SystemPromptStrategy::Override).as_deref(),
            Some("X")
        );
        assert_eq!(
            base(Some("X"), SystemPromptStrategy::Enrich).as_deref(),
            Some("ID\n\nX")
        );
        assert_eq!(base(Some("X"), SystemPromptStrategy::Disabled), None);
        assert_eq!(
            base(Some("  "), SystemPromptStrategy::Override).as_deref(),
            Some("ID")
        );
    }

    #[test]
    fn layers_compose_with_the_enrich_text_after_the_stable_prefix() {
        let layers = Layers {
            base: "ID".into(),
            skills_index: skills_index(&[SkillSummary {
                name: "s".into(),
                description: "does s".into(),
            }]),
            custom: Some("mine".into()),
        };
        let (text, shape) = layers.compose();
        assert!(text.starts_with("ID\n\n<skills>\n"), "{text}");
        assert!(text.contains("- s: does s\n</skills>\n\nmine"), "{text}");
        assert_eq!(&text[..shape.base_len], "ID");
        assert!(text[..shape.stable_len].ends_with("</skills>"));
        assert_eq!(Layers::split(&text, shape), Some(layers));
        let bare = Layers {
            base: "ID".into(),
            ..Layers::default()
        };
        let (text, shape) = bare.compose();
        assert_eq!(Layers::split(&text, shape), Some(bare));
    }

    #[test]
    fn preloaded_blocks_name_what_is_missing() {
        let f = preloaded_functions(&[
            Contract {
                id: "a::b".into(),
                found: Some((
                    "Does b.".into(),
                    serde_json::json!({"$schema": "x", "type": "object"}),
                )),
            },
            Contract {
                id: "c::d".into(),
                found: None,
            },
        ])
        .unwrap();
        assert!(
            f.contains("<function id=\"a::b\">\nDoes b.\nRequest schema: {\"type\":\"object\"}"),
            "{f}"
        );
        assert!(
            f.contains("Unavailable (not registered when this session started): c::d"),
            "{f}"
        );
        let s = preloaded_skills(&[("x".into(), Some("Body".into())), ("y".into(), None)]).unwrap();
        assert!(s.contains("<skill name=\"x\">\nBody\n</skill>"), "{s}");
        assert!(s.contains("Unavailable skills: y"), "{s}");
    }

    #[test]
    fn the_runtime_aid_names_the_session_and_the_working_directory() {
        let meta = serde_json::json!({"fs_scope": {"root": "/srv/repo"}});
        let aid = runtime_aid("s_1", None, fs_root(Some(&meta)));
        assert!(
            aid.starts_with("Your session id is s_1.\nWorking directory: /srv/repo\nFunction dispatch is entirely disabled"),
            "{aid}"
        );
        assert_eq!(fs_root(Some(&serde_json::json!({"fs_scope": {}}))), None);
        assert_eq!(
            for_step(Some("ID"), "s_1", None, None).unwrap(),
            format!("ID\n\n{}", runtime_aid("s_1", None, None))
        );
    }

    #[test]
    fn the_identity_teaches_list_info_call() {
        let list = IDENTITY.find("engine::functions::list").unwrap();
        let info = IDENTITY.find("engine::functions::info").unwrap();
        assert!(list < info && IDENTITY.contains("3. Call"));
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
