//! Agent profiles: `agents/<name>.md`, composed along their `extends` chain.

use harness_types::api::ThinkingLevel;
use harness_types::directory::{AgentList, AgentProfile, AgentSummary, Display, SkippedFile};
use serde::Deserialize;

use crate::error::DirectoryError;
use crate::{check_name, entries, frontmatter, Directory};

/// The front matter of a profile; every field optional, unknown ones refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentFrontMatter {
    /// When given, must equal the file stem (the id a send names).
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    reasoning_effort: Option<ThinkingLevel>,
    #[serde(default)]
    extends: Option<String>,
    #[serde(default)]
    functions: Vec<String>,
    #[serde(default)]
    skills: Vec<String>,
    #[serde(default)]
    display: Option<Display>,
}

struct Loaded {
    fm: AgentFrontMatter,
    body: String,
}

impl Directory {
    fn load_agent(&self, name: &str) -> Result<Option<Loaded>, DirectoryError> {
        self.load(&format!("agents/{name}.md"), |rel, text| {
            parse_agent(name, rel, text)
        })
    }

    /// Checks a profile's new text before it is written: its front matter as a read would,
    /// and its `extends` chain (the parent resolves, and does not lead back to this profile).
    pub(crate) fn check_agent_text(&self, name: &str, text: &str) -> Result<(), DirectoryError> {
        let rel = format!("agents/{name}.md");
        let loaded = parse_agent(name, &rel, text)?;
        if let Some(parent) = &loaded.fm.extends {
            let resolved = self
                .agent(parent)
                .map_err(|e| DirectoryError::bad_file(&rel, "extends", e.to_string()))?;
            if resolved.chain.iter().any(|c| c == name) {
                let mut chain = vec![name.to_string()];
                chain.extend(resolved.chain.iter().rev().cloned());
                return Err(DirectoryError::Cycle {
                    name: name.to_string(),
                    chain: chain.join(" → "),
                });
            }
        }
        Ok(())
    }
}

/// A profile file's front matter and body, checked as every read checks them.
fn parse_agent(name: &str, rel: &str, text: &str) -> Result<Loaded, DirectoryError> {
    let (fm, body) = frontmatter::parse::<AgentFrontMatter>(rel, text, false)?;
    let bad = |field: &str, message: String| DirectoryError::bad_file(rel, field, message);
    if let Some(n) = fm.name.as_deref().filter(|n| *n != name) {
        return Err(bad(
            "name",
            format!("'{n}' differs from the file name '{name}' (the profile's id)"),
        ));
    }
    if fm.model.as_deref() == Some("") {
        return Err(bad("model", "must not be empty".into()));
    }
    if let Some(e) = &fm.extends {
        check_name(e).map_err(|_| bad("extends", format!("'{e}' is not a profile name")))?;
    }
    if let Some(d) = &fm.display {
        if let Some(n) = &d.name {
            let len = n.trim().chars().count();
            if !(1..=48).contains(&len) {
                return Err(bad("display.name", "must be 1 to 48 characters".into()));
            }
        }
    }
    Ok(Loaded { fm, body })
}

impl Directory {
    /// `directory::agents::get`: the profile with its chain composed root first: bodies joined
    /// by a blank line, the nearest model / provider / effort / description / display, the
    /// union of preloaded functions and skills.
    pub fn agent(&self, name: &str) -> Result<AgentProfile, DirectoryError> {
        check_name(name)?;
        let mut chain: Vec<String> = Vec::new();
        let mut loaded: Vec<Loaded> = Vec::new();
        let mut next = Some(name.to_string());
        while let Some(current) = next {
            if chain.contains(&current) {
                chain.push(current);
                return Err(DirectoryError::Cycle {
                    name: name.to_string(),
                    chain: chain.join(" → "),
                });
            }
            let Some(l) = self.load_agent(&current)? else {
                return Err(match chain.last() {
                    None => DirectoryError::NotFound {
                        kind: "agent profile",
                        name: current,
                    },
                    Some(child) => DirectoryError::BadFile {
                        file: format!("agents/{child}.md"),
                        field: "extends".into(),
                        message: format!(
                            "profile '{current}' is not in the directory (chain {} → {current})",
                            chain.join(" → ")
                        ),
                    },
                });
            };
            next = l.fm.extends.clone();
            chain.push(current);
            loaded.push(l);
        }
        chain.reverse();
        loaded.reverse();
        let mut profile = AgentProfile {
            name: name.to_string(),
            description: String::new(),
            model: None,
            provider: None,
            reasoning_effort: None,
            system_prompt: String::new(),
            functions: Vec::new(),
            skills: Vec::new(),
            display: None,
            chain,
        };
        let mut bodies = Vec::new();
        for l in loaded {
            let fm = l.fm;
            if !l.body.is_empty() {
                bodies.push(l.body);
            }
            if let Some(d) = fm.description {
                profile.description = d;
            }
            if fm.model.is_some() {
                // A provider belongs to its model: a child naming another model drops it.
                profile.provider = fm.provider;
                profile.model = fm.model;
            } else if fm.provider.is_some() {
                profile.provider = fm.provider;
            }
            profile.reasoning_effort = fm.reasoning_effort.or(profile.reasoning_effort);
            profile.display = fm.display.or(profile.display);
            for f in fm.functions {
                if !profile.functions.contains(&f) {
                    profile.functions.push(f);
                }
            }
            for s in fm.skills {
                if !profile.skills.contains(&s) {
                    profile.skills.push(s);
                }
            }
        }
        profile.system_prompt = bodies.join("\n\n");
        Ok(profile)
    }

    /// `directory::agents::list`: every profile's name, description and display. A malformed
    /// profile is left out and named in `skipped` with the error `get` would give, so one bad
    /// file never hides the others.
    pub fn agents(&self) -> Result<AgentList, DirectoryError> {
        let mut agents = Vec::new();
        let mut skipped = Vec::new();
        for path in entries(&self.root(), "agents")? {
            if path.extension().and_then(|e| e.to_str()) != Some("md") {
                continue;
            }
            let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if check_name(name).is_err() {
                continue;
            }
            match self.load_agent(name) {
                Ok(Some(l)) => agents.push(AgentSummary {
                    name: name.to_string(),
                    description: l.fm.description.unwrap_or_default(),
                    display: l.fm.display,
                }),
                Ok(None) => {}
                Err(e) => skipped.push(SkippedFile {
                    file: format!("agents/{name}.md"),
                    reason: e.to_string(),
                }),
            }
        }
        Ok(AgentList { agents, skipped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(files: &[(&str, &str)]) -> (tempfile::TempDir, Directory) {
        let t = tempfile::tempdir().unwrap();
        for (rel, text) in files {
            let p = t.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let d = Directory::new(t.path());
        (t, d)
    }

    #[test]
    fn extends_composes_root_first() {
        let (_t, d) = dir(&[
            (
                "agents/base.md",
                "---\nmodel: m1\nprovider: p1\nfunctions: [engine::functions::list]\nskills: [a]\n---\nBase rules.",
            ),
            (
                "agents/lead.md",
                "---\nname: lead\ndescription: leads\nextends: base\nreasoning_effort: high\nfunctions: [x::y, engine::functions::list]\ndisplay: {name: Lead, icon: review, color: teal}\n---\nLead body.",
            ),
        ]);
        let p = d.agent("lead").unwrap();
        assert_eq!(p.system_prompt, "Base rules.\n\nLead body.");
        assert_eq!(p.chain, vec!["base", "lead"]);
        assert_eq!(p.model.as_deref(), Some("m1"));
        assert_eq!(p.provider.as_deref(), Some("p1"));
        assert_eq!(p.reasoning_effort, Some(ThinkingLevel::High));
        assert_eq!(p.functions, vec!["engine::functions::list", "x::y"]);
        assert_eq!(p.skills, vec!["a"]);
        assert_eq!(p.description, "leads");
        assert_eq!(p.display.unwrap().name.as_deref(), Some("Lead"));
    }

    #[test]
    fn an_extends_cycle_is_refused_naming_the_chain() {
        let (_t, d) = dir(&[
            ("agents/a.md", "---\nextends: b\n---\nA"),
            ("agents/b.md", "---\nextends: c\n---\nB"),
            ("agents/c.md", "---\nextends: a\n---\nC"),
            ("agents/self.md", "---\nextends: self\n---\nS"),
        ]);
        let err = d.agent("a").unwrap_err();
        assert_eq!(err.to_string(), "agents/a.md: extends: cycle a → b → c → a");
        let err = d.agent("self").unwrap_err();
        assert_eq!(
            err.to_string(),
            "agents/self.md: extends: cycle self → self"
        );
    }

    #[test]
    fn a_missing_parent_names_the_file_the_field_and_the_chain() {
        let (_t, d) = dir(&[("agents/a.md", "---\nextends: ghost\n---\nA")]);
        let err = d.agent("a").unwrap_err();
        assert_eq!(
            err.to_string(),
            "agents/a.md: extends: profile 'ghost' is not in the directory (chain a → ghost)"
        );
        assert!(matches!(
            d.agent("nobody"),
            Err(DirectoryError::NotFound { .. })
        ));
    }

    #[test]
    fn a_malformed_profile_is_skipped_in_the_list_and_named_with_its_reason() {
        let (_t, d) = dir(&[
            ("agents/good.md", "---\ndescription: fine\n---\nG"),
            ("agents/bad.md", "---\nreasoning_effort: enormous\n---\nB"),
            ("agents/worse.md", "---\nmodel: [unclosed\n---\nW"),
            ("agents/zed.md", "---\ndescription: last\n---\nZ"),
        ]);
        let list = d.agents().unwrap();
        let names: Vec<&str> = list.agents.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, vec!["good", "zed"]);
        let files: Vec<&str> = list.skipped.iter().map(|s| s.file.as_str()).collect();
        assert_eq!(files, vec!["agents/bad.md", "agents/worse.md"]);
        assert!(
            list.skipped[0]
                .reason
                .contains("reasoning_effort: unknown variant `enormous`"),
            "{:?}",
            list.skipped[0]
        );
        // The same file still fails a get, naming the file and the field.
        let err = d.agent("bad").unwrap_err().to_string();
        assert!(
            err.starts_with("agents/bad.md: reasoning_effort: unknown variant"),
            "{err}"
        );
        assert_eq!(list.skipped[0].reason, err);
        // Nothing skipped: the field is absent from the answer, as before.
        let (_t, d) = dir(&[("agents/good.md", "---\ndescription: g\n---\nG")]);
        let v = serde_json::to_value(d.agents().unwrap()).unwrap();
        assert!(v.get("skipped").is_none(), "{v}");
    }

    #[test]
    fn bad_front_matter_names_file_and_field() {
        let (_t, d) = dir(&[
            ("agents/a.md", "---\nreasoning_effort: enormous\n---\nA"),
            ("agents/b.md", "---\nname: c\n---\nB"),
            ("agents/i.md", "---\ndisplay: {icon: rocket}\n---\nI"),
        ]);
        let err = d.agent("a").unwrap_err().to_string();
        assert!(
            err.starts_with("agents/a.md: reasoning_effort: unknown variant `enormous`"),
            "{err}"
        );
        let err = d.agent("b").unwrap_err().to_string();
        assert!(err.starts_with("agents/b.md: name: 'c' differs"), "{err}");
        let err = d.agent("i").unwrap_err().to_string();
        assert!(
            err.starts_with("agents/i.md: display.icon: unknown variant `rocket`"),
            "{err}"
        );
    }
}
