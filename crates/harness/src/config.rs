//! The loop configuration as the binary assembles it: defaults, then a YAML or JSON file (with
//! `${ENV}` expansion), then `HARNESS_<KEY>` environment variables, then flags; `harness config
//! show` / `validate`; and the watcher that hot-reloads the file through
//! `harness::on-config-change`.
//!
//! The watcher polls the file's content once per [`POLL`] instead of using OS file events
//! (`notify`): editors save by rename-over, truncate-then-write or atomic replace, which arrive
//! as different event sequences per platform (and not at all on some network and container
//! mounts), while reading a file of a few hundred bytes every half second costs nothing and
//! behaves the same everywhere. Content, not mtime, is compared: a touch does not reload and a
//! same-second edit is not missed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use harness_bus::Bus;
use harness_core::{ConfigError, HarnessConfig};
use serde_json::{Map, Value};

/// How often the watcher reads the file.
pub const POLL: Duration = Duration::from_millis(500);

/// Keys accepted (so a seed configuration loads) that this version of the loop does not act on
/// yet, with what is missing; `config show` and `serve` say so instead of implying an effect.
pub const NOT_YET_ACTED_ON: [(&str, &str); 1] = [(
    "projects_file_path",
    "the operator project catalog is not supported yet",
)];

/// Where an effective value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    /// The environment variable's name.
    Env(String),
    /// The flag's name.
    Flag(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(v) => write!(f, "env {v}"),
            Source::Flag(name) => write!(f, "flag --{name}"),
        }
    }
}

/// Values given as flags, by configuration key.
pub type Flags = Vec<(&'static str, &'static str, Value)>;

/// The configuration in force and the source of each key.
pub struct Effective {
    pub config: HarnessConfig,
    pub sources: BTreeMap<String, Source>,
}

/// Reads and checks a configuration file on its own: the keys it sets, `${ENV}` expanded.
pub fn read_file(path: &Path) -> Result<Map<String, Value>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("config", format!("cannot read {}: {e}", path.display())))?;
    parse_text(&text)
}

/// Parses a configuration document (YAML, or JSON, which YAML reads too).
pub fn parse_text(text: &str) -> Result<Map<String, Value>, ConfigError> {
    let value: Value = if text.trim().is_empty() {
        Value::Object(Map::new())
    } else {
        serde_yaml_ng::from_str(text).map_err(|e| ConfigError::new("config", e.to_string()))?
    };
    let value = match value {
        // A file of only comments.
        Value::Null => Value::Object(Map::new()),
        v => v,
    };
    let Value::Object(map) = value else {
        return Err(ConfigError::new(
            "config",
            "must be a mapping of keys to values",
        ));
    };
    let mut out = Map::new();
    for (key, value) in map {
        let value = expand(&key, value)?;
        out.insert(key, value);
    }
    // Unknown keys and wrong types, each named.
    check(HarnessConfig::from_value(Value::Object(out.clone()))?)?;
    Ok(out)
}

/// Semantic checks serde cannot make.
fn check(config: HarnessConfig) -> Result<HarnessConfig, ConfigError> {
    if let Err(e) = croner::Cron::from_str(&config.sweep_expression) {
        return Err(ConfigError::new(
            "sweep_expression",
            format!(
                "'{}' is not a cron expression: {e}",
                config.sweep_expression
            ),
        ));
    }
    if config.queue_concurrency == 0 {
        return Err(ConfigError::new("queue_concurrency", "must be at least 1"));
    }
    mcp_servers(&config)?;
    Ok(config)
}

/// The `mcp_servers` entries, checked (unknown fields, the two transports, names).
pub fn mcp_servers(config: &HarnessConfig) -> Result<Vec<harness_mcp::ServerSpec>, ConfigError> {
    harness_mcp::parse_servers(&Value::Object(config.mcp_servers.clone())).map_err(|e| match e {
        harness_mcp::McpError::Config { key, message } => ConfigError::new(key, message),
        other => ConfigError::new("mcp_servers", other.to_string()),
    })
}

/// `mcp_servers` as `config show` prints it: `env` and `headers` values hidden, since they
/// usually carry tokens that `${ENV}` expanded.
fn redacted(key: &str, value: Value) -> Value {
    let Value::Object(mut servers) = value else {
        return value;
    };
    if key != "mcp_servers" {
        return Value::Object(servers);
    }
    for entry in servers.values_mut() {
        for field in ["env", "headers"] {
            if let Some(Value::Object(vars)) = entry.get_mut(field) {
                for v in vars.values_mut() {
                    *v = Value::String("<hidden>".into());
                }
            }
        }
    }
    Value::Object(servers)
}

/// `${VAR}` and `${VAR:-fallback}` in every string (`$$` is a literal `$`). A string that is one
/// reference and nothing else takes the variable's YAML type, so `max_depth: ${DEPTH}` is a
/// number; substitution never adds keys, since it happens after parsing.
fn expand(path: &str, value: Value) -> Result<Value, ConfigError> {
    match value {
        Value::String(s) => {
            let whole = s.starts_with("${") && s.ends_with('}') && s.matches("${").count() == 1;
            let expanded = expand_str(path, &s)?;
            if whole && expanded != s {
                Ok(serde_yaml_ng::from_str::<Value>(&expanded)
                    .ok()
                    .filter(|v| !v.is_object() && !v.is_array())
                    .unwrap_or(Value::String(expanded)))
            } else {
                Ok(Value::String(expanded))
            }
        }
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, v)| expand(&format!("{path}[{i}]"), v))
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array),
        Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| {
                let p = format!("{path}.{k}");
                expand(&p, v).map(|v| (k, v))
            })
            .collect::<Result<Map<_, _>, _>>()
            .map(Value::Object),
        other => Ok(other),
    }
}

fn expand_str(path: &str, s: &str) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(body) = tail.strip_prefix("${") {
            let Some(end) = body.find('}') else {
                return Err(ConfigError::new(
                    path,
                    "unclosed '${' (write $$ for a literal $)",
                ));
            };
            let reference = &body[..end];
            let (name, fallback) = match reference.split_once(":-") {
                Some((n, f)) => (n, Some(f)),
                None => (reference, None),
            };
            let valid =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(ConfigError::new(
                    path,
                    format!("'${{{reference}}}' is not a variable reference"),
                ));
            }
            match (std::env::var(name), fallback) {
                (Ok(v), _) => out.push_str(&v),
                (Err(_), Some(f)) => out.push_str(f),
                (Err(_), None) => {
                    return Err(ConfigError::new(
                        path,
                        format!("${{{name}}}: environment variable is not set"),
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// The environment variable that sets `key`.
pub fn env_var(key: &str) -> String {
    format!("HARNESS_{}", key.to_ascii_uppercase())
}

/// Defaults, then the file, then `HARNESS_<KEY>` variables, then flags.
pub fn resolve(file: Option<&Path>, flags: &Flags) -> Result<Effective, ConfigError> {
    let Value::Object(mut merged) =
        serde_json::to_value(HarnessConfig::default()).unwrap_or(Value::Null)
    else {
        return Err(ConfigError::new("config", "defaults do not serialize"));
    };
    let mut sources: BTreeMap<String, Source> = merged
        .keys()
        .map(|k| (k.clone(), Source::Default))
        .collect();
    if let Some(path) = file {
        for (key, value) in
            read_file(path).map_err(|e| in_source(e, &path.display().to_string()))?
        {
            sources.insert(key.clone(), Source::File(path.to_path_buf()));
            merged.insert(key, value);
        }
    }
    for key in HarnessConfig::keys() {
        let var = env_var(&key);
        let Ok(text) = std::env::var(&var) else {
            continue;
        };
        let value = serde_yaml_ng::from_str::<Value>(&text).unwrap_or(Value::String(text.clone()));
        let mut one = Map::new();
        one.insert(key.clone(), value.clone());
        HarnessConfig::from_value(Value::Object(one)).map_err(|e| in_source(e, &var))?;
        sources.insert(key.clone(), Source::Env(var));
        merged.insert(key, value);
    }
    for (key, flag, value) in flags {
        sources.insert(key.to_string(), Source::Flag(flag));
        merged.insert(key.to_string(), value.clone());
    }
    let config = check(HarnessConfig::from_value(Value::Object(merged))?)?;
    Ok(Effective { config, sources })
}

fn in_source(mut e: ConfigError, source: &str) -> ConfigError {
    e.message = format!("{} (in {source})", e.message);
    e
}

impl Effective {
    /// A warning per key set away from its default that the loop does not act on yet.
    pub fn inert_warnings(&self) -> Vec<String> {
        NOT_YET_ACTED_ON
            .iter()
            .filter(|(key, _)| !matches!(self.sources.get(*key), None | Some(Source::Default)))
            .map(|(key, why)| format!("config: {key} is accepted but not acted on ({why})"))
            .collect()
    }
}

/// The OTLP endpoint export will use when the standard `OTEL_*` variables decide it, with
/// their name as its source: they win over the key, so showing the key alone would mislead.
fn otel_override(configured: Option<&str>) -> Option<(Value, String)> {
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Some((Value::Null, "env OTEL_SDK_DISABLED=true".into()));
    }
    match harness_telemetry::OtlpConfig::resolve(None, configured) {
        Ok(Some(c))
            if !matches!(
                c.source,
                harness_telemetry::EndpointSource::ConfigFile
                    | harness_telemetry::EndpointSource::Flag
            ) =>
        {
            Some((Value::String(c.endpoint), c.source.as_str().to_string()))
        }
        _ => None,
    }
}

/// `harness config show`: one `key: value  # source` line per key (valid YAML), or JSON.
pub fn show(effective: &Effective, json: bool) -> anyhow::Result<String> {
    let values = serde_json::to_value(&effective.config)?;
    let Value::Object(mut values) = values else {
        anyhow::bail!("configuration does not serialize to an object");
    };
    let otel = otel_override(effective.config.otel_endpoint.as_deref());
    if let Some((value, _)) = &otel {
        values.insert("otel_endpoint".into(), value.clone());
    }
    let source_of = |key: &str| match &otel {
        Some((_, source)) if key == "otel_endpoint" => source.clone(),
        _ => effective
            .sources
            .get(key)
            .map(ToString::to_string)
            .unwrap_or_else(|| "default".into()),
    };
    if json {
        let out: Map<String, Value> = values
            .into_iter()
            .map(|(k, v)| {
                let source = source_of(&k);
                let v = redacted(&k, v);
                (k, serde_json::json!({"value": v, "source": source}))
            })
            .collect();
        return Ok(serde_json::to_string_pretty(&Value::Object(out))?);
    }
    let mut out = String::new();
    for (key, value) in values {
        let source = source_of(&key);
        let value = redacted(&key, value);
        let inert = NOT_YET_ACTED_ON.iter().any(|(k, _)| *k == key);
        let note = if inert { ", not acted on yet" } else { "" };
        out.push_str(&format!("{key}: {value}  # {source}{note}\n"));
    }
    Ok(out)
}

/// Re-reads `file` every [`POLL`]; a changed, valid file is applied through
/// `harness::on-config-change` (flags and environment still win over it), a bad one is refused
/// with its key named and the running configuration kept. Stops with the runtime.
pub fn watch(
    file: PathBuf,
    flags: Flags,
    bus: std::sync::Arc<dyn Bus>,
    mcp: harness_mcp::McpHub,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = std::fs::read(&file).ok();
        let mut applied = resolve(Some(&file), &flags)
            .ok()
            .and_then(|e| serde_json::to_value(e.config).ok());
        loop {
            tokio::time::sleep(POLL).await;
            let now = std::fs::read(&file).ok();
            if now == last {
                continue;
            }
            last = now;
            if last.is_none() {
                tracing::warn!(
                    "config {}: cannot be read; keeping the running configuration",
                    file.display()
                );
                continue;
            }
            let config = match resolve(Some(&file), &flags) {
                Ok(e) => {
                    // Servers added, removed or changed start and stop now; unchanged ones
                    // keep running.
                    if let Ok(specs) = mcp_servers(&e.config) {
                        mcp.apply(specs).await;
                    }
                    serde_json::to_value(e.config).unwrap_or(Value::Null)
                }
                Err(e) => {
                    eprintln!(
                        "harness: config {} refused: {e}; keeping the running configuration",
                        file.display()
                    );
                    continue;
                }
            };
            if applied.as_ref() == Some(&config) {
                continue;
            }
            match bus
                .call(
                    "harness::on-config-change",
                    serde_json::json!({"id": "harness", "config": config}),
                    None,
                )
                .await
            {
                Ok(_) => {
                    eprintln!("harness: config {} reloaded", file.display());
                    applied = Some(config);
                }
                Err(e) => eprintln!(
                    "harness: config {} refused: {}; keeping the running configuration",
                    file.display(),
                    e.into_harness()
                ),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_both_read() {
        let y = parse_text("max_depth: 2\ncall_reconciliation: coerce\n").unwrap();
        let j = parse_text(r#"{"max_depth": 2, "call_reconciliation": "coerce"}"#).unwrap();
        assert_eq!(y, j);
    }

    #[test]
    fn an_unknown_key_names_itself() {
        let err = parse_text("max_depth: 2\nmax_dept: 3\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "harness/invalid_config: max_dept: unknown key"
        );
    }

    #[test]
    fn env_references_expand_with_their_type() {
        std::env::set_var("HARNESS_TEST_DEPTH_7", "5");
        let m = parse_text("max_depth: ${HARNESS_TEST_DEPTH_7}\nprojects_file_path: /p/${HARNESS_TEST_DEPTH_7}/$$x\n").unwrap();
        assert_eq!(m["max_depth"], 5);
        assert_eq!(m["projects_file_path"], "/p/5/$x");
        let m = parse_text("max_children: ${HARNESS_TEST_UNSET_7:-4}\n").unwrap();
        assert_eq!(m["max_children"], 4);
    }

    #[test]
    fn an_unset_variable_names_key_and_variable() {
        let err = parse_text("projects_file_path: ${HARNESS_TEST_UNSET_8}\n").unwrap_err();
        assert_eq!(err.key, "projects_file_path");
        assert!(err.message.contains("HARNESS_TEST_UNSET_8"), "{err}");
    }

    #[test]
    fn mcp_servers_are_checked_with_their_field_named_and_shown_without_secrets() {
        std::env::set_var("HARNESS_TEST_MCP_TOKEN_9", "s3cret");
        let err = parse_text("mcp_servers:\n  fx:\n    command: srv\n    argz: []\n").unwrap_err();
        assert!(err.key.starts_with("mcp_servers.fx"), "{err}");
        assert!(err.message.contains("unknown field `argz`"), "{err}");
        let err =
            parse_text("mcp_servers:\n  fx:\n    url: https://h\n    args: []\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "harness/invalid_config: mcp_servers.fx.args: only for a command server"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(
            &file,
            "mcp_servers:\n  web:\n    url: https://h/mcp\n    headers: {Authorization: \"Bearer ${HARNESS_TEST_MCP_TOKEN_9}\"}\n",
        )
        .unwrap();
        let effective = resolve(Some(&file), &Flags::new()).unwrap();
        let specs = mcp_servers(&effective.config).unwrap();
        assert_eq!(
            specs[0].transport,
            harness_mcp::Transport::Http {
                url: "https://h/mcp".into(),
                headers: [("Authorization".to_string(), "Bearer s3cret".to_string())].into()
            }
        );
        let shown = show(&effective, false).unwrap();
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("<hidden>"), "{shown}");
        let shown = show(&effective, true).unwrap();
        assert!(!shown.contains("s3cret"), "{shown}");
    }

    #[test]
    fn a_bad_cron_is_refused_by_name() {
        let err = parse_text("sweep_expression: every minute\n").unwrap_err();
        assert_eq!(err.key, "sweep_expression");
    }
}
