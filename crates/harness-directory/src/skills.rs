//! Skills: `skills/<name>/SKILL.md`, a front matter name and description, then the body.

use harness_types::directory::{Skill, SkillList, SkillSummary};
use serde::Deserialize;

use crate::error::DirectoryError;
use crate::{check_name, entries, frontmatter, Directory};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SkillFrontMatter {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    /// Accepted for skills written for other loaders; not used.
    #[serde(default)]
    #[allow(dead_code)]
    license: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<serde_json::Value>,
}

impl Directory {
    fn load_skill(&self, name: &str) -> Result<Option<Skill>, DirectoryError> {
        self.load(&format!("skills/{name}/SKILL.md"), |rel, text| {
            parse_skill(name, rel, text)
        })
    }

    /// `directory::skills::get`.
    pub fn skill(&self, name: &str) -> Result<Skill, DirectoryError> {
        check_name(name)?;
        self.load_skill(name)?.ok_or(DirectoryError::NotFound {
            kind: "skill",
            name: name.to_string(),
        })
    }

    /// `directory::skills::list`: names and descriptions, sorted by name.
    pub fn skills(&self) -> Result<SkillList, DirectoryError> {
        let mut skills = Vec::new();
        for path in entries(&self.root(), "skills")? {
            if !path.is_dir() {
                continue;
            }
            let Some(name) = path.file_name().and_then(|s| s.to_str()) else {
                continue;
            };
            if check_name(name).is_err() {
                continue;
            }
            if let Some(s) = self.load_skill(name)? {
                skills.push(SkillSummary {
                    name: s.name,
                    description: s.description,
                });
            }
        }
        Ok(SkillList { skills })
    }
}

/// A skill file's front matter and body, checked as every read checks them.
pub(crate) fn parse_skill(name: &str, rel: &str, text: &str) -> Result<Skill, DirectoryError> {
    let (fm, body) = frontmatter::parse::<SkillFrontMatter>(rel, text, false)?;
    let bad = |field: &str, message: String| DirectoryError::bad_file(rel, field, message);
    match fm.name.as_deref() {
        None => {
            return Err(bad(
                "name",
                "missing (it must equal the folder name)".into(),
            ))
        }
        Some(n) if n != name => {
            return Err(bad(
                "name",
                format!("'{n}' differs from the folder name '{name}'"),
            ))
        }
        Some(_) => {}
    }
    let description = fm
        .description
        .map(|d| d.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|d| !d.is_empty())
        .ok_or_else(|| bad("description", "missing: the skills index shows it".into()))?;
    Ok(Skill {
        name: name.to_string(),
        description,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skills_list_and_get() {
        let t = tempfile::tempdir().unwrap();
        let write = |rel: &str, text: &str| {
            let p = t.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        write(
            "skills/b/SKILL.md",
            "---\nname: b\ndescription: >\n  Does b\n  well.\n---\nB body",
        );
        write(
            "skills/a/SKILL.md",
            "---\nname: a\ndescription: Does a.\nlicense: MIT\n---\nA body",
        );
        write("skills/empty/README.md", "not a skill");
        let d = Directory::new(t.path());
        let list = d.skills().unwrap();
        assert_eq!(
            list.skills,
            vec![
                SkillSummary {
                    name: "a".into(),
                    description: "Does a.".into()
                },
                SkillSummary {
                    name: "b".into(),
                    description: "Does b well.".into()
                },
            ]
        );
        assert_eq!(d.skill("a").unwrap().body, "A body");
        assert!(matches!(
            d.skill("zzz"),
            Err(DirectoryError::NotFound { .. })
        ));
        assert!(matches!(d.skill("../a"), Err(DirectoryError::BadName(_))));

        write("skills/c/SKILL.md", "---\nname: c\n---\nC body");
        let err = d.skills().unwrap_err().to_string();
        assert!(
            err.starts_with("skills/c/SKILL.md: description: missing"),
            "{err}"
        );
    }
}
