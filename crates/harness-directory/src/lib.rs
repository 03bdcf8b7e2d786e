//! `directory::*`: the operator's folder of agent profiles, skills and system prompts.
//!
//! ```text
//! <directory>/
//!   system-prompts/default.md   replaces the built-in identity of every new session
//!   agents/<name>.md            agent profiles (front matter + prompt body), `extends` chains
//!   skills/<name>/SKILL.md      skills (front matter name + description, then the body)
//! ```
//!
//! Every call reads the files again, so an edit reaches the next send without a restart; a
//! session keeps what it froze when it was resolved. The readers are open to models; the
//! writers (`create`/`update`, `write.rs`) are the operator's, walled off from every model by
//! harness-core, check a write as a read would, and replace a file atomically.

mod agents;
mod error;
mod frontmatter;
mod register;
mod skills;
mod write;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub use error::DirectoryError;
pub use register::register;
pub use write::{Kind, WriteRequest, WriteResponse};

/// A handle on the directory's folder; clones share the path, which can be moved at runtime.
#[derive(Clone, Debug)]
pub struct Directory {
    root: Arc<RwLock<PathBuf>>,
}

impl Directory {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Directory {
            root: Arc::new(RwLock::new(root.into())),
        }
    }

    pub fn root(&self) -> PathBuf {
        self.root.read().map(|r| r.clone()).unwrap_or_default()
    }

    /// The file `rel` under the root as `parse` reads it (given `rel` and the text), or `None`
    /// when there is no such file.
    pub(crate) fn load<T>(
        &self,
        rel: &str,
        parse: impl FnOnce(&str, &str) -> Result<T, DirectoryError>,
    ) -> Result<Option<T>, DirectoryError> {
        let Some(text) = read(&self.root(), rel)? else {
            return Ok(None);
        };
        parse(rel, &text).map(Some)
    }

    /// Points the directory at another folder (a configuration change).
    pub fn set_root(&self, root: impl Into<PathBuf>) {
        if let Ok(mut r) = self.root.write() {
            *r = root.into();
        }
    }

    /// `system-prompts/<name>.md`: its body (front matter optional).
    pub fn system_prompt(
        &self,
        name: &str,
    ) -> Result<harness_types::directory::SystemPrompt, DirectoryError> {
        check_name(name)?;
        let rel = format!("system-prompts/{name}.md");
        let text = read(&self.root(), &rel)?.ok_or(DirectoryError::NotFound {
            kind: "system prompt",
            name: name.to_string(),
        })?;
        let (_, body) = frontmatter::parse::<PromptFrontMatter>(&rel, &text, true)?;
        Ok(harness_types::directory::SystemPrompt {
            name: name.to_string(),
            body,
        })
    }
}

/// A system prompt's optional front matter.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PromptFrontMatter {
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
}

/// Entry names are file stems or folder names, never paths: a model may call the readers, and
/// `../../harness.db` must not reach the data directory.
pub(crate) fn check_name(name: &str) -> Result<(), DirectoryError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(DirectoryError::BadName(name.to_string()))
    }
}

/// A file under the root by relative path; `None` when it does not exist.
pub(crate) fn read(root: &Path, rel: &str) -> Result<Option<String>, DirectoryError> {
    match std::fs::read_to_string(root.join(rel)) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(DirectoryError::Io {
            file: rel.to_string(),
            message: e.to_string(),
        }),
    }
}

/// The entries of a folder under the root, sorted; an absent folder has none.
pub(crate) fn entries(root: &Path, folder: &str) -> Result<Vec<PathBuf>, DirectoryError> {
    let dir = root.join(folder);
    let read = match std::fs::read_dir(&dir) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(DirectoryError::Io {
                file: folder.to_string(),
                message: e.to_string(),
            })
        }
    };
    let mut out: Vec<PathBuf> = read.filter_map(|e| e.ok().map(|e| e.path())).collect();
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_never_paths() {
        for bad in ["", "..", "../x", "a/b", ".hidden", "a\\b", "a b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["default", "code-reviewer", "a_b.c", "A1"] {
            check_name(good).unwrap();
        }
    }

    #[test]
    fn system_prompt_reads_with_or_without_front_matter() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("system-prompts")).unwrap();
        std::fs::write(dir.path().join("system-prompts/default.md"), "You are X.\n").unwrap();
        let d = Directory::new(dir.path());
        assert_eq!(d.system_prompt("default").unwrap().body, "You are X.");
        std::fs::write(
            dir.path().join("system-prompts/default.md"),
            "---\ndescription: d\n---\nYou are Y.\n",
        )
        .unwrap();
        assert_eq!(d.system_prompt("default").unwrap().body, "You are Y.");
        assert!(matches!(
            d.system_prompt("other"),
            Err(DirectoryError::NotFound { .. })
        ));
    }
}
