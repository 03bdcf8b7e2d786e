//! Writing the directory: `directory::{system-prompts,agents,skills}::{create,update}`.
//!
//! These are the operator's (the wall in harness-core refuses them to every model): a model
//! must never rewrite its own identity, profiles or skills. A write is checked exactly as a
//! later read will check it (typed front matter, unknown keys refused, names never paths, a
//! profile's `extends` chain resolving without a cycle) before anything touches the disk, and
//! then lands atomically: the new text goes to a temporary file in the same folder, is synced,
//! and is renamed over the entry, so a reader sees the old file or the new one, never a part.
//! Readers read the files on every call, so the next send picks the change up.

use std::io::Write;
use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::DirectoryError;
use crate::{check_name, frontmatter, read, Directory, PromptFrontMatter};

/// What a write names: the entry and its new text.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteRequest {
    /// The entry's name: a file stem (a skill's folder), never a path.
    pub name: String,
    /// The whole file: YAML front matter between `---` lines, then the markdown body.
    /// Exactly one of `content` and `body`.
    #[serde(default)]
    pub content: Option<String>,
    /// The markdown body alone; `front_matter` (an object) becomes the YAML above it.
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default)]
    pub front_matter: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct WriteResponse {
    pub name: String,
    /// The file written, relative to the directory.
    pub file: String,
    /// True when the entry did not exist before.
    pub created: bool,
}

/// Which kind of entry a write is for.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    SystemPrompt,
    Agent,
    Skill,
}

impl Kind {
    fn rel(self, name: &str) -> String {
        match self {
            Kind::SystemPrompt => format!("system-prompts/{name}.md"),
            Kind::Agent => format!("agents/{name}.md"),
            Kind::Skill => format!("skills/{name}/SKILL.md"),
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Kind::SystemPrompt => "system prompt",
            Kind::Agent => "agent profile",
            Kind::Skill => "skill",
        }
    }

    fn id(self) -> &'static str {
        match self {
            Kind::SystemPrompt => "system-prompts",
            Kind::Agent => "agents",
            Kind::Skill => "skills",
        }
    }
}

fn invalid(field: &str, message: impl Into<String>) -> DirectoryError {
    DirectoryError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

/// The file's text from a request: `content` as given, or `front_matter` and `body` composed.
fn text_of(req: &WriteRequest) -> Result<String, DirectoryError> {
    match (&req.content, &req.body) {
        (Some(_), Some(_)) => Err(invalid("content", "give either content or body, not both")),
        (None, None) => Err(invalid(
            "content",
            "missing: give content (the whole file) or body",
        )),
        (Some(c), None) => {
            if req.front_matter.is_some() {
                return Err(invalid(
                    "front_matter",
                    "only with body: content already holds the front matter",
                ));
            }
            Ok(c.clone())
        }
        (None, Some(body)) => match &req.front_matter {
            None => Ok(format!("---\n---\n{}\n", body.trim())),
            Some(serde_json::Value::Object(map)) => {
                let yaml = serde_yaml_ng::to_string(map)
                    .map_err(|e| invalid("front_matter", e.to_string()))?;
                let yaml = if map.is_empty() { String::new() } else { yaml };
                Ok(format!("---\n{yaml}---\n{}\n", body.trim()))
            }
            Some(_) => Err(invalid("front_matter", "must be an object")),
        },
    }
}

impl Directory {
    /// `create` (`must_exist: false`: refused when the entry exists) or `update`
    /// (`must_exist: true`: refused when it does not).
    pub fn write(
        &self,
        kind: Kind,
        req: &WriteRequest,
        must_exist: bool,
    ) -> Result<WriteResponse, DirectoryError> {
        check_name(&req.name)?;
        let text = text_of(req)?;
        let rel = kind.rel(&req.name);
        match kind {
            Kind::SystemPrompt => {
                let (_, body) = frontmatter::parse::<PromptFrontMatter>(&rel, &text, true)?;
                if body.trim().is_empty() {
                    return Err(DirectoryError::bad_file(
                        &rel,
                        "body",
                        "must not be empty (a blank prompt would fall back to the built-in identity)",
                    ));
                }
            }
            Kind::Agent => self.check_agent_text(&req.name, &text)?,
            Kind::Skill => {
                crate::skills::parse_skill(&req.name, &rel, &text)?;
            }
        }
        let root = self.root();
        let exists = read(&root, &rel)?.is_some();
        match (exists, must_exist) {
            (true, false) => {
                return Err(invalid(
                    "name",
                    format!(
                        "{} '{}' already exists; change it with directory::{}::update",
                        kind.noun(),
                        req.name,
                        kind.id()
                    ),
                ))
            }
            (false, true) => {
                return Err(DirectoryError::NotFound {
                    kind: kind.noun(),
                    name: req.name.clone(),
                })
            }
            _ => {}
        }
        write_atomically(&root, &rel, &text)?;
        Ok(WriteResponse {
            name: req.name.clone(),
            file: rel,
            created: !exists,
        })
    }
}

/// Temporary file, sync, rename over the entry, sync the folder: a reader sees the old file
/// or the new one, and after a crash the entry is one of the two.
fn write_atomically(root: &Path, rel: &str, text: &str) -> Result<(), DirectoryError> {
    let io = |e: std::io::Error| DirectoryError::Io {
        file: rel.to_string(),
        message: e.to_string(),
    };
    let target = root.join(rel);
    let folder = target.parent().ok_or_else(|| DirectoryError::Io {
        file: rel.to_string(),
        message: "no parent folder".into(),
    })?;
    std::fs::create_dir_all(folder).map_err(io)?;
    let file_name = target
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("entry");
    // A leading dot: the listings skip it while it exists.
    let tmp = folder.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)?;
        std::fs::File::open(folder)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, content: &str) -> WriteRequest {
        WriteRequest {
            name: name.into(),
            content: Some(content.into()),
            body: None,
            front_matter: None,
        }
    }

    #[test]
    fn create_then_update_a_system_prompt_and_read_it_back() {
        let t = tempfile::tempdir().unwrap();
        let d = Directory::new(t.path());
        let out = d
            .write(Kind::SystemPrompt, &req("default", "You are A."), false)
            .unwrap();
        assert!(out.created);
        assert_eq!(d.system_prompt("default").unwrap().body, "You are A.");
        let again = d
            .write(Kind::SystemPrompt, &req("default", "You are B."), false)
            .unwrap_err();
        assert!(again.to_string().contains("already exists"), "{again}");
        let out = d
            .write(Kind::SystemPrompt, &req("default", "You are B."), true)
            .unwrap();
        assert!(!out.created);
        assert_eq!(d.system_prompt("default").unwrap().body, "You are B.");
        let missing = d
            .write(Kind::SystemPrompt, &req("other", "x"), true)
            .unwrap_err();
        assert!(matches!(missing, DirectoryError::NotFound { .. }));
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(t.path().join("system-prompts"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("default.md")]);
    }

    #[test]
    fn a_bad_write_changes_nothing_and_names_the_field() {
        let t = tempfile::tempdir().unwrap();
        let d = Directory::new(t.path());
        let refused = |kind: Kind, name: &str, content: &str, replace: bool| {
            d.write(kind, &req(name, content), replace)
                .unwrap_err()
                .to_string()
        };
        d.write(
            Kind::Agent,
            &req("base", "---\ndescription: base\n---\nBase."),
            false,
        )
        .unwrap();
        for (name, content, says) in [
            (
                "a",
                "---\nreasoning_effort: huge\n---\nA",
                "agents/a.md: reasoning_effort:",
            ),
            (
                "a",
                "---\ncolour: red\n---\nA",
                "agents/a.md: colour: unknown field `colour`",
            ),
            ("a", "---\nextends: ghost\n---\nA", "agents/a.md: extends:"),
            ("../x", "---\n---\nA", "name: '../x'"),
        ] {
            let e = refused(Kind::Agent, name, content, false);
            assert!(e.starts_with(says), "{e}");
        }
        // A cycle through an update of the parent is refused too.
        d.write(
            Kind::Agent,
            &req("child", "---\nextends: base\n---\nC"),
            false,
        )
        .unwrap();
        let e = refused(Kind::Agent, "base", "---\nextends: child\n---\nB", true);
        assert!(e.contains("cycle base → child → base"), "{e}");
        assert_eq!(d.agent("base").unwrap().system_prompt, "Base.");
        assert!(d.agent("a").is_err());

        let e = refused(
            Kind::Skill,
            "s",
            "---\nname: t\ndescription: d\n---\nS",
            false,
        );
        assert!(e.starts_with("skills/s/SKILL.md: name:"), "{e}");
        let e = refused(Kind::SystemPrompt, "default", "---\n---\n  ", false);
        assert!(e.contains("body"), "{e}");
    }

    #[test]
    fn body_and_front_matter_compose_the_file() {
        let t = tempfile::tempdir().unwrap();
        let d = Directory::new(t.path());
        let r = WriteRequest {
            name: "review".into(),
            content: None,
            body: Some("Check the diff.".into()),
            front_matter: Some(serde_json::json!({"name": "review", "description": "Reviews."})),
        };
        d.write(Kind::Skill, &r, false).unwrap();
        let s = d.skill("review").unwrap();
        assert_eq!(
            (s.description.as_str(), s.body.as_str()),
            ("Reviews.", "Check the diff.")
        );
    }
}
