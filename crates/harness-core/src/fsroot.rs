//! A turn's filesystem root, and its stamping onto calls of scoped functions.
//!
//! The root is decided by whoever starts the turn (a send's `options.filesystem_root`, the
//! session's previous root, the configured default) and frozen in the turn's options. Calls of
//! `fs::*` and `shell::*` get it as `fs_scope` in their arguments, written over whatever the
//! model put there, before and again after the pre-trigger hooks: neither a model nor a hook
//! can widen it, and the functions trust nothing else.

use std::path::{Path, PathBuf};

use harness_types::HarnessError;
use serde_json::{json, Value};

/// The argument stamped onto scoped calls.
pub(crate) const FIELD: &str = "fs_scope";

// The types live with the turn record they are frozen in.
pub use harness_machine::record::{FsBoundary, FsRoot};

/// Functions that work inside the turn's root.
pub(crate) fn scoped(function_id: &str) -> bool {
    function_id.starts_with("fs::") || function_id.starts_with("shell::")
}

/// Overwrites `fs_scope` on a scoped call's arguments with the turn's own and the session's
/// grants (or removes it when the turn has no root). Other calls are left as they are.
pub(crate) fn stamp(
    function_id: &str,
    arguments: &mut Value,
    root: Option<&FsRoot>,
    grants: &[String],
) {
    if !scoped(function_id) {
        return;
    }
    let Some(map) = arguments.as_object_mut() else {
        return;
    };
    map.remove(FIELD);
    if let Some(r) = root {
        map.insert(
            FIELD.to_string(),
            json!({"root": r.root, "grants": grants, "boundary": r.boundary}),
        );
    }
}

/// `path` of a request's `field` resolved: it must be absolute and name an existing directory.
pub(crate) fn existing_dir(field: &str, path: &str) -> Result<PathBuf, HarnessError> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(HarnessError::invalid_field(
            field,
            format!("'{path}' is not an absolute path"),
        ));
    }
    let real = std::fs::canonicalize(p)
        .map_err(|e| HarnessError::invalid_field(field, format!("'{path}': {e}")))?;
    if !real.is_dir() {
        return Err(HarnessError::invalid_field(
            field,
            format!("'{path}' is not a directory"),
        ));
    }
    Ok(real)
}

/// A root named in a request: absolute, an existing directory; kept resolved.
pub(crate) fn explicit(field: &str, path: &str) -> Result<FsRoot, HarnessError> {
    let real = existing_dir(field, path)?;
    Ok(FsRoot {
        root: real.display().to_string(),
        boundary: FsBoundary::Workspace,
    })
}

/// The configured default: `null` = the working directory of the process, `"off"` = none,
/// anything else = that path (relative to the working directory).
pub(crate) fn configured(setting: Option<&str>) -> Option<FsRoot> {
    let cwd = std::env::current_dir().ok();
    let path: PathBuf = match setting {
        Some("off") => return None,
        None => cwd?,
        Some(p) if Path::new(p).is_absolute() => PathBuf::from(p),
        Some(p) => cwd?.join(p),
    };
    let real = std::fs::canonicalize(&path).unwrap_or(path);
    Some(FsRoot {
        root: real.display().to_string(),
        boundary: FsBoundary::ConfiguredRoots,
    })
}

/// Whether `child` lies under `parent` (both resolved).
pub(crate) fn within(child: &FsRoot, parent: &FsRoot) -> bool {
    Path::new(&child.root).starts_with(&parent.root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamping_overwrites_what_the_model_wrote_and_only_on_scoped_calls() {
        let root = FsRoot {
            root: "/work/a".into(),
            boundary: FsBoundary::Workspace,
        };
        let mut args = json!({"path": "x", "fs_scope": {"root": "/", "grants": ["/etc"], "boundary": "workspace"}});
        stamp("fs::read", &mut args, Some(&root), &[]);
        assert_eq!(
            args,
            json!({"path": "x", "fs_scope": {"root": "/work/a", "grants": [], "boundary": "workspace"}})
        );
        let mut args = json!({"path": "x", "fs_scope": {"root": "/", "grants": ["/etc"], "boundary": "workspace"}});
        stamp(
            "fs::read",
            &mut args,
            Some(&root),
            &["/srv/shared".to_string()],
        );
        assert_eq!(
            args["fs_scope"]["grants"],
            json!(["/srv/shared"]),
            "the session's grants, not the model's"
        );
        let mut args = json!({"command": "ls", "fs_scope": {"root": "/"}});
        stamp("shell::exec", &mut args, None, &["/srv/shared".to_string()]);
        assert_eq!(args, json!({"command": "ls"}), "no root: no scope at all");
        let mut args = json!({"url": "u", "fs_scope": {"root": "/"}});
        stamp("web::fetch", &mut args, Some(&root), &[]);
        assert_eq!(args["fs_scope"]["root"], "/", "not a scoped function");
    }

    #[test]
    fn explicit_roots_are_absolute_existing_directories() {
        let dir = tempfile::tempdir().unwrap();
        let r = explicit("options.filesystem_root", dir.path().to_str().unwrap()).unwrap();
        assert_eq!(
            r.root,
            std::fs::canonicalize(dir.path())
                .unwrap()
                .display()
                .to_string()
        );
        let e = explicit("options.filesystem_root", "relative/dir").unwrap_err();
        assert!(
            e.message
                .starts_with("options.filesystem_root: 'relative/dir' is not an absolute"),
            "{e}"
        );
        let e = explicit("options.filesystem_root", "/no/such/dir/here").unwrap_err();
        assert!(e.message.starts_with("options.filesystem_root:"), "{e}");
        assert_eq!(configured(Some("off")), None);
        assert_eq!(
            configured(None).unwrap().boundary,
            FsBoundary::ConfiguredRoots
        );
    }
}
