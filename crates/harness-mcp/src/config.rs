//! The `mcp_servers` configuration key: one entry per server, by name.
//!
//! ```yaml
//! mcp_servers:
//!   notes:                       # tools become mcp::notes::<tool>
//!     command: npx
//!     args: ["-y", "@modelcontextprotocol/server-filesystem", "/srv/notes"]
//!     env: {NOTES_TOKEN: "${NOTES_TOKEN}"}
//!   search:
//!     url: https://mcp.example.com/mcp
//!     headers: {Authorization: "Bearer ${SEARCH_TOKEN}"}
//! ```
//!
//! `${ENV}` references are expanded by the configuration loader before this module sees the
//! values. Unknown fields are refused by name, and so are fields of the other transport
//! (`headers` on a command, `args` on a url).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::error::McpError;

/// The longest server name: ids are `mcp::<server>::<tool>` and provider tool names stop at 64.
pub const MAX_SERVER_NAME: usize = 32;

/// How long one tool call may take when the entry names no `timeout_ms`.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// One configured server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSpec {
    pub name: String,
    pub transport: Transport,
    /// Budget of one `tools/call`.
    pub call_timeout: Duration,
}

/// How the harness reaches a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// A child process speaking MCP on its stdin/stdout (stderr goes to the log).
    Stdio {
        command: String,
        args: Vec<String>,
        /// Added to the small base environment the child gets (see `client.rs`).
        env: BTreeMap<String, String>,
        cwd: Option<PathBuf>,
    },
    /// A streamable HTTP endpoint.
    Http {
        url: String,
        headers: BTreeMap<String, String>,
    },
}

/// The entry as written; checked into a [`ServerSpec`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    command: Option<String>,
    #[serde(default)]
    args: Option<Vec<String>>,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    cwd: Option<PathBuf>,
    url: Option<String>,
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

/// True for a name usable inside a function id and a provider tool name.
fn valid_server_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_SERVER_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Checks the value of `mcp_servers` (an object, or null for none).
pub fn parse_servers(value: &Value) -> Result<Vec<ServerSpec>, McpError> {
    let map = match value {
        Value::Null => return Ok(Vec::new()),
        Value::Object(map) => map,
        _ => {
            return Err(McpError::config(
                "mcp_servers",
                "must be a mapping of server names to {command, args, env} or {url, headers}",
            ))
        }
    };
    map.iter()
        .map(|(name, entry)| parse_one(name, entry))
        .collect()
}

fn parse_one(name: &str, value: &Value) -> Result<ServerSpec, McpError> {
    let key = format!("mcp_servers.{name}");
    if !valid_server_name(name) {
        return Err(McpError::config(
            key,
            format!(
                "server name must be 1-{MAX_SERVER_NAME} characters of A-Z, a-z, 0-9, '-' and '_'"
            ),
        ));
    }
    let entry: Entry = serde_path_to_error::deserialize(value.clone()).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." {
            key.clone()
        } else {
            format!("{key}.{path}")
        };
        let message = e.into_inner().to_string();
        // serde names the unknown field inside its message; keep the key path on the entry.
        McpError::config(at, message)
    })?;
    let call_timeout = match entry.timeout_ms {
        Some(0) => {
            return Err(McpError::config(
                format!("{key}.timeout_ms"),
                "must be at least 1",
            ))
        }
        Some(ms) => Duration::from_millis(ms),
        None => DEFAULT_CALL_TIMEOUT,
    };
    let transport =
        match (entry.command, entry.url) {
            (Some(_), Some(_)) => return Err(McpError::config(
                key,
                "give either command (a stdio server) or url (a streamable HTTP server), not both",
            )),
            (None, None) => {
                return Err(McpError::config(
                    key,
                    "needs command (a stdio server) or url (a streamable HTTP server)",
                ))
            }
            (Some(command), None) => {
                if let Some(field) = entry.headers.as_ref().map(|_| "headers") {
                    return Err(McpError::config(
                        format!("{key}.{field}"),
                        "only for a url server",
                    ));
                }
                if command.trim().is_empty() {
                    return Err(McpError::config(
                        format!("{key}.command"),
                        "must not be empty",
                    ));
                }
                Transport::Stdio {
                    command,
                    args: entry.args.unwrap_or_default(),
                    env: entry.env.unwrap_or_default(),
                    cwd: entry.cwd,
                }
            }
            (None, Some(url)) => {
                for (field, set) in [
                    ("args", entry.args.is_some()),
                    ("env", entry.env.is_some()),
                    ("cwd", entry.cwd.is_some()),
                ] {
                    if set {
                        return Err(McpError::config(
                            format!("{key}.{field}"),
                            "only for a command server",
                        ));
                    }
                }
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(McpError::config(
                        format!("{key}.url"),
                        format!("'{url}' is not an http:// or https:// URL"),
                    ));
                }
                let headers = entry.headers.unwrap_or_default();
                for (h, v) in &headers {
                    if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                        return Err(McpError::config(
                            format!("{key}.headers.{h}"),
                            "is not a valid header name",
                        ));
                    }
                    if http::HeaderValue::from_str(v).is_err() {
                        return Err(McpError::config(
                            format!("{key}.headers.{h}"),
                            "is not a valid header value",
                        ));
                    }
                }
                Transport::Http { url, headers }
            }
        };
    Ok(ServerSpec {
        name: name.to_string(),
        transport,
        call_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: Value) -> String {
        parse_servers(&v).unwrap_err().to_string()
    }

    #[test]
    fn a_command_and_a_url_server_parse() {
        let specs = parse_servers(&json!({
            "a": {"command": "srv", "args": ["-x"], "env": {"K": "v"}},
            "b": {"url": "https://h/mcp", "headers": {"Authorization": "Bearer t"}, "timeout_ms": 5}
        }))
        .unwrap();
        assert_eq!(
            specs[0].transport,
            Transport::Stdio {
                command: "srv".into(),
                args: vec!["-x".into()],
                env: [("K".to_string(), "v".to_string())].into(),
                cwd: None
            }
        );
        assert_eq!(specs[0].call_timeout, DEFAULT_CALL_TIMEOUT);
        assert_eq!(specs[1].call_timeout, Duration::from_millis(5));
        assert!(matches!(specs[1].transport, Transport::Http { .. }));
        assert!(parse_servers(&Value::Null).unwrap().is_empty());
    }

    #[test]
    fn an_unknown_field_is_refused_by_name() {
        let e = err(json!({"a": {"command": "srv", "argv": []}}));
        assert!(
            e.starts_with("harness/invalid_config: mcp_servers.a"),
            "{e}"
        );
        assert!(e.contains("unknown field `argv`"), "{e}");
    }

    #[test]
    fn fields_of_the_other_transport_and_bad_values_are_named() {
        assert_eq!(
            err(json!({"a": {"command": "srv", "headers": {}}})),
            "harness/invalid_config: mcp_servers.a.headers: only for a url server"
        );
        assert_eq!(
            err(json!({"a": {"url": "https://h", "env": {}}})),
            "harness/invalid_config: mcp_servers.a.env: only for a command server"
        );
        assert!(err(json!({"a": {}})).contains("needs command"));
        assert!(err(json!({"a": {"command": "x", "url": "https://h"}})).contains("not both"));
        assert!(err(json!({"a": {"url": "ftp://h"}}))
            .starts_with("harness/invalid_config: mcp_servers.a.url: 'ftp://h' is not"));
        assert!(err(json!({"a b": {"command": "x"}}))
            .starts_with("harness/invalid_config: mcp_servers.a b: server name"));
        assert_eq!(
            err(json!({"a": {"command": "x", "args": "-v"}}))
                .split(':')
                .nth(1),
            Some(" mcp_servers.a.args")
        );
        assert!(
            err(json!({"a": {"url": "https://h", "headers": {"X": "a\nb"}}}))
                .starts_with("harness/invalid_config: mcp_servers.a.headers.X:")
        );
        assert!(err(json!([1])).starts_with("harness/invalid_config: mcp_servers: must be"));
    }
}
