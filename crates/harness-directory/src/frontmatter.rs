//! Markdown files with YAML front matter: `---`, the YAML, `---`, then the body.

use serde::de::DeserializeOwned;

use crate::error::DirectoryError;

/// Splits `text` into its front matter (typed, unknown keys refused) and its body (trimmed).
/// `file` is the path relative to the directory, for errors. A file without front matter reads
/// as `T::default()` only when `optional`.
pub fn parse<T: DeserializeOwned + Default>(
    file: &str,
    text: &str,
    optional: bool,
) -> Result<(T, String), DirectoryError> {
    let bad = |field: &str, message: String| DirectoryError::bad_file(file, field, message);
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let Some(rest) = strip_fence(text) else {
        if optional {
            return Ok((T::default(), text.trim().to_string()));
        }
        return Err(bad(
            "front matter",
            "missing: the file must start with a '---' line, the YAML fields, and a closing '---' line".into(),
        ));
    };
    let (yaml, body) =
        split_closing(rest).ok_or_else(|| bad("front matter", "no closing '---' line".into()))?;
    let yaml = if yaml.trim().is_empty() { "{}" } else { yaml };
    let de = serde_yaml_ng::Deserializer::from_str(yaml);
    let value: T = serde_path_to_error::deserialize(de).map_err(|err| {
        let path = err.path().to_string();
        let message = err.into_inner().to_string();
        // The YAML error repeats the path; the field is named once, in front.
        let message = message
            .strip_prefix(&format!("{path}: "))
            .map(str::to_string)
            .unwrap_or(message);
        let field = if path == "." {
            "front matter".to_string()
        } else {
            path
        };
        bad(&field, message)
    })?;
    Ok((value, body.trim().to_string()))
}

fn strip_fence(text: &str) -> Option<&str> {
    let first = text.lines().next()?;
    (first.trim_end() == "---")
        .then(|| &text[first.len()..])
        .map(|r| {
            r.strip_prefix("\r\n")
                .or_else(|| r.strip_prefix('\n'))
                .unwrap_or(r)
        })
}

/// The YAML up to the closing fence line, and everything after it.
fn split_closing(rest: &str) -> Option<(&str, &str)> {
    let mut offset = 0;
    for line in rest.split_inclusive('\n') {
        if line.trim_end() == "---" {
            return Some((&rest[..offset], &rest[offset + line.len()..]));
        }
        offset += line.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Fm {
        name: Option<String>,
        #[serde(default)]
        n: u32,
    }

    #[test]
    fn splits_front_matter_and_body() {
        let (fm, body) = parse::<Fm>("x.md", "---\nname: a\nn: 2\n---\n\nHello\n", false).unwrap();
        assert_eq!(
            fm,
            Fm {
                name: Some("a".into()),
                n: 2
            }
        );
        assert_eq!(body, "Hello");
    }

    #[test]
    fn a_bad_field_names_file_and_field() {
        let err = parse::<Fm>("agents/x.md", "---\nn: lots\n---\nbody", false).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("agents/x.md: n: invalid type"), "{text}");
        let err = parse::<Fm>("agents/x.md", "---\nnmae: a\n---\nbody", false).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("agents/x.md: nmae: unknown field `nmae`"),
            "{text}"
        );
    }

    #[test]
    fn missing_or_unclosed_front_matter() {
        let err = parse::<Fm>("a.md", "just text", false).unwrap_err();
        assert!(err.to_string().contains("front matter: missing"), "{err}");
        let err = parse::<Fm>("a.md", "---\nname: a\nbody", false).unwrap_err();
        assert!(err.to_string().contains("no closing"), "{err}");
        let (fm, body) = parse::<Fm>("a.md", "just text", true).unwrap();
        assert_eq!((fm, body.as_str()), (Fm::default(), "just text"));
    }
}
