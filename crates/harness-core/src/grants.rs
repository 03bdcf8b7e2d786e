//! `harness::filesystem::{grant,grants,revoke,info}`: per-session extra filesystem roots.
//!
//! A grant is a directory an operator lets one session's `fs::*` and `shell::*` calls
//! reach beside the turn's root. Grants live in [`SCOPE`] keyed by session id, are read each
//! time a scoped call is stamped (so a revoke holds from the next call on), and are deleted with
//! the session tree. The harness's data directory and configuration can never be granted, nor a
//! path holding them. A model never reaches these functions (the control-plane wall), nor the
//! state row.

use std::path::PathBuf;

use harness_types::HarnessError;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::harness::{Harness, Result};

/// The state scope of the grants, keyed by session id.
pub(crate) const SCOPE: &str = "harness_filesystem_grants";

#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    pub session_id: String,
    /// Absolute path of an existing directory; kept canonical (symlinks resolved).
    pub path: String,
}

#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantsRequest {
    pub session_id: String,
}

#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RevokeRequest {
    pub session_id: String,
    /// The path as granted (or any spelling of it that resolves to the same place).
    pub path: String,
}

#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InfoRequest {
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Grant {
    /// Canonical absolute path.
    pub path: String,
    pub granted_at_ms: i64,
}

#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct GrantsResponse {
    pub session_id: String,
    pub grants: Vec<Grant>,
}

#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct GrantResponse {
    pub session_id: String,
    /// The canonical path that was granted.
    pub path: String,
    /// False when the path was already granted.
    pub created: bool,
    pub grants: Vec<Grant>,
}

#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct RevokeResponse {
    pub session_id: String,
    /// False when no such grant existed.
    pub revoked: bool,
    pub grants: Vec<Grant>,
}

#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct InfoResponse {
    /// The configured default root (`null`: `default_filesystem_root` is `"off"`).
    pub default_root: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The root the session's last turn froze (`null`: no turn yet, or a turn without a root).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<crate::fsroot::FsRoot>,
    /// The session's grants (empty without `session_id`).
    pub grants: Vec<Grant>,
}

#[derive(Default, Serialize, Deserialize)]
struct Row {
    grants: Vec<Grant>,
}

fn need_session(session_id: &str) -> Result<()> {
    if session_id.trim().is_empty() {
        return Err(HarnessError::invalid_field(
            "session_id",
            "must not be empty",
        ));
    }
    Ok(())
}

/// A grant path: absolute, an existing directory, canonical; never the protected paths nor one holding them.
pub(crate) fn check_path(field: &str, path: &str, protected: &[PathBuf]) -> Result<PathBuf> {
    let real = crate::fsroot::existing_dir(field, path)?;
    for prot in protected {
        if real.starts_with(prot) || prot.starts_with(&real) {
            return Err(HarnessError::invalid_field(
                field,
                format!(
                    "'{path}' is or holds the harness's own data or configuration ({}); it cannot be granted",
                    prot.display()
                ),
            ));
        }
    }
    Ok(real)
}

impl Harness {
    async fn grants_row(&self, session_id: &str) -> Result<Row> {
        let v = self.state_get(SCOPE, session_id).await?;
        Ok(v.and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default())
    }

    async fn put_row(&self, session_id: &str, row: &Row) -> Result<()> {
        let bus = &self.inner.bus;
        if row.grants.is_empty() {
            bus.state_delete(SCOPE, session_id).await
        } else {
            bus.state_set(SCOPE, session_id, json!(row)).await
        }
        .map_err(|e| e.into_harness())
    }

    /// The session's granted paths, as the loop stamps them.
    pub(crate) async fn session_grants(&self, session_id: &str) -> Result<Vec<String>> {
        Ok(self
            .grants_row(session_id)
            .await?
            .grants
            .into_iter()
            .map(|g| g.path)
            .collect())
    }

    /// `harness::filesystem::grant`.
    pub async fn filesystem_grant(&self, req: GrantRequest) -> Result<GrantResponse> {
        need_session(&req.session_id)?;
        let real = check_path("path", &req.path, &self.protected_paths())?;
        let path = real.display().to_string();
        let _guard = self.inner.grants_lock.lock().await;
        let mut row = self.grants_row(&req.session_id).await?;
        let created = !row.grants.iter().any(|g| g.path == path);
        if created {
            row.grants.push(Grant {
                path: path.clone(),
                granted_at_ms: harness_types::now_ms(),
            });
            self.put_row(&req.session_id, &row).await?;
        }
        Ok(GrantResponse {
            session_id: req.session_id,
            path,
            created,
            grants: row.grants,
        })
    }

    /// `harness::filesystem::grants`.
    pub async fn filesystem_grants(&self, req: GrantsRequest) -> Result<GrantsResponse> {
        need_session(&req.session_id)?;
        let row = self.grants_row(&req.session_id).await?;
        Ok(GrantsResponse {
            session_id: req.session_id,
            grants: row.grants,
        })
    }

    /// `harness::filesystem::revoke`.
    pub async fn filesystem_revoke(&self, req: RevokeRequest) -> Result<RevokeResponse> {
        need_session(&req.session_id)?;
        if req.path.is_empty() {
            return Err(HarnessError::invalid_field("path", "must not be empty"));
        }
        // The path may be gone since it was granted: match it as written too.
        let resolved = std::fs::canonicalize(&req.path)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| req.path.clone());
        let _guard = self.inner.grants_lock.lock().await;
        let mut row = self.grants_row(&req.session_id).await?;
        let before = row.grants.len();
        row.grants
            .retain(|g| g.path != resolved && g.path != req.path);
        let revoked = row.grants.len() != before;
        if revoked {
            self.put_row(&req.session_id, &row).await?;
        }
        Ok(RevokeResponse {
            session_id: req.session_id,
            revoked,
            grants: row.grants,
        })
    }

    /// `harness::filesystem::info`.
    pub async fn filesystem_info(&self, req: InfoRequest) -> Result<InfoResponse> {
        let default_root =
            crate::fsroot::configured(self.config().default_filesystem_root.as_deref())
                .map(|r| r.root);
        let Some(sid) = req.session_id else {
            return Ok(InfoResponse {
                default_root,
                session_id: None,
                root: None,
                grants: Vec::new(),
            });
        };
        need_session(&sid)?;
        let root = self
            .load_record(&sid)
            .await?
            .and_then(|r| r.options.filesystem.clone());
        let grants = self.grants_row(&sid).await?.grants;
        Ok(InfoResponse {
            default_root,
            session_id: Some(sid),
            root,
            grants,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_paths_are_absolute_existing_and_never_the_protected_ones() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let data = std::fs::canonicalize(&data).unwrap();
        let other = dir.path().join("other");
        std::fs::create_dir(&other).unwrap();
        let prot = vec![data.clone()];
        let ok = check_path("path", other.to_str().unwrap(), &prot).unwrap();
        assert_eq!(ok, std::fs::canonicalize(&other).unwrap());
        let e = check_path("path", "rel/dir", &prot).unwrap_err();
        assert!(
            e.message.starts_with("path: 'rel/dir' is not an absolute"),
            "{e}"
        );
        let file = other.join("f.txt");
        std::fs::write(&file, "x").unwrap();
        let e = check_path("path", file.to_str().unwrap(), &prot).unwrap_err();
        assert!(e.message.ends_with("is not a directory"), "{e}");
        let e = check_path("path", "/no/such/place/here", &prot).unwrap_err();
        assert!(e.message.starts_with("path: '/no/such/place/here':"), "{e}");
        for p in [data.clone(), data.parent().unwrap().to_path_buf()] {
            let e = check_path("path", p.to_str().unwrap(), &prot).unwrap_err();
            assert!(e.message.contains("cannot be granted"), "{e}");
        }
    }
}
