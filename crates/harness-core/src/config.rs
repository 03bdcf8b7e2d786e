//! Loop configuration, with the README's shipped defaults.

use harness_types::api::FunctionPolicy;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How malformed call arguments are repaired before dispatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallReconciliation {
    /// Dispatch as written.
    Off,
    /// Lossless repairs only: stringified JSON the schema rejects is parsed.
    Coerce,
    /// Coerce, then ask `judge::evaluate` (when registered) about misnamed keys, off-enum values
    /// and unknown arguments.
    #[default]
    Judge,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HarnessConfig {
    /// Generate-step cap per turn when a send names none.
    pub default_max_turns: u32,
    /// Recovery generations after a stream failed with partial output.
    pub max_transient_resumes: u32,
    /// Minimum interval between streamed `update-message` writes (0 = every frame).
    pub stream_coalesce_ms: u64,
    /// How long a step's first write (the `working` status, the assistant entry) may wait for
    /// the model's answer, to be committed with it as one write (0 = before the model is
    /// called).
    pub first_write_hold_ms: u64,
    /// Outer budget of one `router::chat`.
    pub router_timeout_ms: u64,
    /// Budget of `session::*`, `state::*` and `context::*` calls.
    pub session_timeout_ms: u64,
    /// Budget of one function target call.
    pub dispatch_timeout_ms: u64,
    /// Context window assumed for models the catalog does not know.
    pub default_context_window: u64,
    /// Steps of different sessions running at once.
    pub queue_concurrency: usize,
    /// A step not finished within this time is redelivered.
    pub step_visibility_timeout_ms: u64,
    /// Function results larger than this (serialized content + details) are replaced by an
    /// elision marker; 0 turns the cap off, values below 1024 count as 1024.
    pub max_result_bytes: usize,
    pub call_reconciliation: CallReconciliation,
    /// A pending call (not a hook hold: those never expire) older than this gets a timeout
    /// result from the sweep.
    pub default_pending_timeout_ms: u64,
    /// 6-field cron expression of the pending-call sweep.
    pub sweep_expression: String,
    /// Send the frozen prompt prefix as its own cacheable section (+ digest) on `router::chat`.
    pub prompt_cache_sections: bool,
    /// Sub-agent depth budget.
    pub max_depth: u32,
    /// Child sessions one turn may create.
    pub max_children: u32,
    /// Output-contract nudges (a final answer that fails the turn's JSON contract) before the
    /// turn fails.
    pub max_validation_retries: u32,
    /// How long an idempotency key of `harness::send` dedupes; older rows are pruned.
    pub idem_ttl_secs: u64,
    /// Budget of one `context::assemble`.
    pub context_timeout_ms: u64,
    /// The dispatch policy of parentless spawns (and agent-profile sends) that name none;
    /// `null`, the default, denies every call.
    pub default_functions: Option<FunctionPolicy>,
    /// Filesystem root stamped on new sessions: `null` = the working directory at boot,
    /// `"off"` = none, anything else = that path.
    pub default_filesystem_root: Option<String>,
    /// Let `web::fetch` reach loopback, private and link-local addresses (off: a model reaches
    /// public addresses only).
    pub web_fetch_allow_private: bool,
    /// Run `shell::exec` commands unconfined when the kernel cannot sandbox them (off: such a
    /// call is refused with `harness/sandbox_unavailable`).
    pub shell_exec_unconfined: bool,
    /// Let `shell::exec` commands open TCP connections and listen (off: the sandbox denies both).
    pub shell_exec_allow_network: bool,
    /// Extra trees `shell::exec` commands may read and execute from (toolchains such as
    /// `~/.cargo`); `~` is expanded. The data directory and configuration stay unreachable.
    pub shell_exec_read_paths: Vec<String>,
    /// Environment variables never passed to `shell::exec` commands, by name or glob (`*` and
    /// `?`, ASCII case ignored), beyond those scrubbed always (names like `*_KEY`, `*_TOKEN`,
    /// `*_SECRET`, `*_PASSWORD`, `*_PAT`, `*CREDENTIAL*`, and URLs carrying a password).
    #[serde(deserialize_with = "scrub_env_names")]
    pub shell_exec_scrub_env: Vec<String>,
    /// The durable operator project catalog.
    pub projects_file_path: String,
    /// MCP servers whose tools become `mcp::<server>::<tool>` functions, by server name:
    /// `{command, args, env, cwd}` or `{url, headers}`. The loop does not read it; the binary
    /// checks it (`harness_mcp::parse_servers`) and runs the servers.
    pub mcp_servers: serde_json::Map<String, Value>,
    /// The folder of agent profiles, skills and system prompts (`directory::*`); `null` =
    /// `directory/` in the data dir. Read at start.
    pub directory_path: Option<String>,
    /// Serve the web console at `/` (`harness serve --no-console` turns it off too).
    pub console: bool,
    /// OTLP/HTTP receiver of the turn traces (`http://host:4318`; `/v1/traces` is appended).
    /// `null` = no export, unless `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` is set (which wins).
    pub otel_endpoint: Option<String>,
    /// Record the anonymous usage announcements on `harness:usage` (`false` = none at all;
    /// `III_TELEMETRY_ENABLED=false` and `HARNESS_TELEMETRY_ENABLED=false` turn them off too).
    pub usage_reporting: bool,
}

/// `shell_exec_scrub_env`: each entry a variable name or a glob of one.
fn scrub_env_names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    for (i, name) in names.iter().enumerate() {
        let ok = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '*' | '?' | '.' | '-'));
        if !ok {
            return Err(serde::de::Error::custom(format!(
                "entry {i} ({name:?}) is not a variable name or a glob of one (letters, digits, '_', '.', '-', '*' and '?')"
            )));
        }
    }
    Ok(names)
}

/// A configuration that cannot be applied, naming the key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("harness/invalid_config: {key}: {message}")]
pub struct ConfigError {
    /// The key (or dotted path inside a key) at fault; `config` for the document as a whole.
    pub key: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl HarnessConfig {
    /// The cap the loop applies to a function's result (`max_result_bytes`): 0 for none, never
    /// below 1024 otherwise.
    pub fn result_cap(&self) -> usize {
        match self.max_result_bytes {
            0 => 0,
            n => n.max(1024),
        }
    }

    /// Every key the configuration knows, in declaration order.
    pub fn keys() -> Vec<String> {
        match serde_json::to_value(HarnessConfig::default()) {
            Ok(Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    /// A configuration from a JSON object: missing keys take their defaults, an unknown key is
    /// refused by name (not serde's "expected one of" list, which buries it).
    pub fn from_value(value: Value) -> Result<HarnessConfig, ConfigError> {
        let Value::Object(map) = &value else {
            return Err(ConfigError::new(
                "config",
                "must be a mapping of keys to values",
            ));
        };
        let known = HarnessConfig::keys();
        if let Some(unknown) = map.keys().find(|k| !known.iter().any(|n| n == *k)) {
            return Err(ConfigError::new(unknown.clone(), "unknown key"));
        }
        serde_path_to_error::deserialize::<_, HarnessConfig>(value).map_err(|err| {
            let path = err.path().to_string();
            let inner = err.into_inner().to_string();
            let inner = inner.split(" at line ").next().unwrap_or("").to_string();
            ConfigError::new(if path == "." { "config".into() } else { path }, inner)
        })
    }
}

impl Default for HarnessConfig {
    fn default() -> Self {
        HarnessConfig {
            default_max_turns: 16,
            max_transient_resumes: 1,
            stream_coalesce_ms: 150,
            first_write_hold_ms: 20,
            router_timeout_ms: 620_000,
            session_timeout_ms: 10_000,
            dispatch_timeout_ms: 300_000,
            default_context_window: 200_000,
            queue_concurrency: 256,
            step_visibility_timeout_ms: 900_000,
            max_result_bytes: 262_144,
            call_reconciliation: CallReconciliation::Judge,
            default_pending_timeout_ms: 1_800_000,
            sweep_expression: "0 * * * * *".into(),
            prompt_cache_sections: true,
            max_depth: 3,
            max_children: 8,
            max_validation_retries: 2,
            idem_ttl_secs: 86_400,
            context_timeout_ms: 320_000,
            // Deny-by-default holds here too: an operator opts parentless spawns into a policy.
            default_functions: None,
            default_filesystem_root: None,
            web_fetch_allow_private: false,
            shell_exec_unconfined: false,
            shell_exec_allow_network: false,
            shell_exec_read_paths: Vec::new(),
            shell_exec_scrub_env: Vec::new(),
            projects_file_path: "~/.iii/data/harness/projects.json".into(),
            mcp_servers: serde_json::Map::new(),
            directory_path: None,
            console: true,
            otel_endpoint: None,
            usage_reporting: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_unknown_key_is_named() {
        let err = HarnessConfig::from_value(json!({"max_depth": 2, "max_dept": 3})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "harness/invalid_config: max_dept: unknown key"
        );
    }

    #[test]
    fn a_wrong_type_names_its_key() {
        let err = HarnessConfig::from_value(json!({"max_depth": "deep"})).unwrap_err();
        assert_eq!(err.key, "max_depth");
    }

    #[test]
    fn default_functions_is_deny_all_unless_an_operator_names_a_policy() {
        let c = HarnessConfig::from_value(json!({"default_functions": null})).unwrap();
        assert!(c.default_functions.is_none());
        let c = HarnessConfig::from_value(json!({})).unwrap();
        assert!(c.default_functions.is_none());
        let c =
            HarnessConfig::from_value(json!({"default_functions": {"allow": ["fs::*"]}})).unwrap();
        assert_eq!(
            c.default_functions.unwrap().allow,
            vec!["fs::*".to_string()]
        );
    }

    #[test]
    fn shell_exec_scrub_env_takes_names_and_globs_and_names_a_bad_entry() {
        let c =
            HarnessConfig::from_value(json!({"shell_exec_scrub_env": ["CORP_*", "MY_VAR", "A?C"]}))
                .unwrap();
        assert_eq!(c.shell_exec_scrub_env, vec!["CORP_*", "MY_VAR", "A?C"]);
        for bad in [
            json!([""]),
            json!(["OK", "NOT OK"]),
            json!(["A=B"]),
            json!("CORP_*"),
        ] {
            let err =
                HarnessConfig::from_value(json!({ "shell_exec_scrub_env": bad })).unwrap_err();
            assert_eq!(err.key, "shell_exec_scrub_env", "{err}");
        }
        let err = HarnessConfig::from_value(json!({"shell_exec_scrub_env": ["OK", "NOT OK"]}))
            .unwrap_err();
        assert!(err.message.contains("entry 1"), "{err}");
    }

    #[test]
    fn every_key_round_trips() {
        let all = serde_json::to_value(HarnessConfig::default()).unwrap();
        assert_eq!(all.as_object().unwrap().len(), HarnessConfig::keys().len());
        HarnessConfig::from_value(all).unwrap();
    }
}
