//! The HTTP providers and where their settings come from.
//!
//! | provider id | API | registered when |
//! |---|---|---|
//! | `anthropic` | Messages API | `ANTHROPIC_API_KEY` (or `providers.anthropic.api_key`) is set |
//! | `openai` | Chat Completions | `OPENAI_API_KEY` is set |
//! | `openai-responses` | Responses API (same key and base URL as `openai`) | `OPENAI_API_KEY` is set |
//! | `openai-compatible` | Chat Completions on a server of your choice | `OPENAI_COMPATIBLE_BASE_URL` or `OPENAI_COMPATIBLE_PRESET` is set |
//! | `ollama`, `llamacpp`, `vllm`, `lmstudio` | Chat Completions on the local server's default port | always (nothing to configure; override with `OLLAMA_BASE_URL`, …) |
//! | any other id | `kind` given in the config file | the config file names it |
//!
//! Base URLs: `ANTHROPIC_BASE_URL` (default `https://api.anthropic.com`), `OPENAI_BASE_URL`
//! (default `https://api.openai.com/v1`), `OPENAI_COMPATIBLE_BASE_URL` (with its `/v1`), and
//! `<PRESET>_BASE_URL` / `<PRESET>_API_KEY` per local server. The environment wins over the
//! config file, a JSON file at `HARNESS_ROUTER_CONFIG`, else `<config dir>/harness/router.json`:
//!
//! ```json
//! {"default_provider": "anthropic", "default_model": "claude-sonnet-4-5",
//!  "model_catalog": "catalog-overrides.json",
//!  "retry": {"max_attempts": 3, "base_delay_ms": 500, "max_delay_ms": 8000, "max_total_wait_ms": 30000},
//!  "providers": {"anthropic": {"api_key_env": "MY_ANTHROPIC_KEY"},
//!                "openai-compatible": {"preset": "ollama"},
//!                "gpu-box": {"kind": "openai-compatible", "base_url": "http://10.0.0.5:8000/v1"}}}
//! ```
//!
//! Keys live in [`Secret`], whose `Debug` prints `[redacted]`, and are passed to every error
//! path so a provider echoing one back is scrubbed.

pub mod anthropic;
pub mod caps;
pub mod openai_chat;
pub mod openai_responses;
mod structured;
mod wire;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::catalog::Catalog;
use crate::error::RouterError;
use crate::retry::RetryPolicy;
use crate::router::{Provider, Router};

pub use caps::{JsonSchemaForm, Tokenize, ToolChoice, WireCaps, WirePatch};

/// A credential. Never printed, never serialized.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The credential itself, for the one header that carries it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

/// Which wire protocol a provider speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderKind {
    /// Anthropic Messages API.
    Anthropic,
    /// OpenAI Chat Completions.
    Openai,
    /// OpenAI Responses API.
    OpenaiResponses,
    /// Chat Completions on an OpenAI-compatible server (Ollama, llama.cpp, vLLM, LM Studio).
    OpenaiCompatible,
}

/// Network settings of a provider.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    pub retry: RetryPolicy,
    /// A stream with no data for this long is stalled (transient failure).
    pub idle_timeout: Duration,
    pub connect_timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            retry: RetryPolicy::default(),
            idle_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Where a provider's settings came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Env,
    Config,
    Preset,
}

/// One provider to register.
#[derive(Clone, Debug)]
pub struct ProviderConfig {
    pub id: String,
    pub kind: ProviderKind,
    pub base_url: String,
    pub api_key: Option<Secret>,
    pub source: Source,
    pub http: HttpOptions,
    /// What the server accepts (Chat Completions kinds only): the preset's, with the config
    /// entry's `wire` laid over.
    pub wire: WireCaps,
    /// Generations (and token counts) sent to the server at once; the rest wait in turn.
    /// `None`: no limit. The `llamacpp` preset defaults to 1: llama-cpp-python cuts a running
    /// stream when another request arrives, so two sessions would keep interrupting each other.
    pub concurrency: Option<usize>,
}

impl ProviderConfig {
    pub fn new(id: &str, kind: ProviderKind, base_url: &str, api_key: Option<&str>) -> Self {
        ProviderConfig {
            id: id.to_string(),
            kind,
            base_url: base_url.trim_end_matches('/').to_string(),
            api_key: api_key.map(Secret::new),
            source: Source::Config,
            http: HttpOptions::default(),
            wire: match kind {
                ProviderKind::OpenaiCompatible => WireCaps::of_preset(id),
                _ => WireCaps::OPENAI,
            },
            concurrency: default_concurrency(id),
        }
    }

    /// The name of the environment variable that sets this provider's base URL, when there is
    /// one (said in hints when nothing answers there).
    pub fn url_variable(&self) -> Option<String> {
        match self.id.as_str() {
            "anthropic" => Some("ANTHROPIC_BASE_URL".into()),
            "openai" => Some("OPENAI_BASE_URL".into()),
            "openai-compatible" => Some("OPENAI_COMPATIBLE_BASE_URL".into()),
            id if preset_url(id).is_some() => Some(env_key(id, "BASE_URL")),
            _ => None,
        }
    }

    pub fn with_http(mut self, http: HttpOptions) -> Self {
        self.http = http;
        self
    }

    /// The provider itself.
    pub fn build(&self) -> Arc<dyn Provider> {
        match self.kind {
            ProviderKind::Anthropic => Arc::new(anthropic::AnthropicProvider::new(self)),
            ProviderKind::Openai | ProviderKind::OpenaiCompatible => {
                Arc::new(openai_chat::OpenAiChatProvider::new(self))
            }
            ProviderKind::OpenaiResponses => {
                Arc::new(openai_responses::OpenAiResponsesProvider::new(self))
            }
        }
    }
}

/// The local OpenAI-compatible servers with a known default address.
pub const PRESETS: [(&str, &str, &str); 4] = [
    ("ollama", "http://127.0.0.1:11434/v1", "Ollama"),
    ("llamacpp", "http://127.0.0.1:8080/v1", "llama.cpp server"),
    ("vllm", "http://127.0.0.1:8000/v1", "vLLM"),
    ("lmstudio", "http://127.0.0.1:1234/v1", "LM Studio"),
];

/// A preset's default limit of requests at once (see [`ProviderConfig::concurrency`]).
pub fn default_concurrency(preset: &str) -> Option<usize> {
    (preset == "llamacpp").then_some(1)
}

pub fn preset_url(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|p| p.0 == name).map(|p| p.1)
}

pub const DEFAULT_ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com";
pub const DEFAULT_OPENAI_BASE_URL: &str = "https://api.openai.com/v1";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderSection {
    #[serde(default)]
    kind: Option<ProviderKind>,
    #[serde(default)]
    base_url: Option<String>,
    #[serde(default)]
    api_key: Option<String>,
    /// The name of the environment variable holding the key (keeps keys out of the file).
    #[serde(default)]
    api_key_env: Option<String>,
    #[serde(default)]
    preset: Option<String>,
    #[serde(default)]
    enabled: Option<bool>,
    /// What the server accepts, over the preset's (see [`caps`]).
    #[serde(default)]
    wire: Option<WirePatch>,
    /// Requests at once (0: no limit); the preset's default otherwise.
    #[serde(default)]
    concurrency: Option<usize>,
}

/// The router config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouterConfig {
    #[serde(default)]
    default_provider: Option<String>,
    #[serde(default)]
    default_model: Option<String>,
    /// A path (relative to the config file) or an inline catalog object.
    #[serde(default)]
    model_catalog: Option<Value>,
    #[serde(default)]
    providers: BTreeMap<String, ProviderSection>,
    #[serde(default)]
    retry: Option<RetryPolicy>,
    #[serde(default)]
    idle_timeout_ms: Option<u64>,
    #[serde(default)]
    connect_timeout_ms: Option<u64>,
}

/// The providers and catalog configured from the environment and the config file.
#[derive(Debug, Clone)]
pub struct Setup {
    pub providers: Vec<ProviderConfig>,
    pub catalog: Catalog,
    pub default_provider: Option<String>,
    pub default_model: Option<String>,
    /// The config file read, if any.
    pub config_path: Option<PathBuf>,
}

/// The environment variable that names the router config file.
pub const CONFIG_ENV: &str = "HARNESS_ROUTER_CONFIG";
/// The environment variable that names a catalog override file.
pub const CATALOG_ENV: &str = "HARNESS_MODEL_CATALOG";

fn env_key(preset: &str, suffix: &str) -> String {
    format!("{}_{suffix}", preset.to_ascii_uppercase())
}

impl Setup {
    /// Reads the process environment and the config file.
    pub fn from_env() -> Result<Setup, RouterError> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let path = match env(CONFIG_ENV) {
            Some(p) => Some((PathBuf::from(p), true)),
            None => dirs::config_dir()
                .map(|d| d.join("harness").join("router.json"))
                .filter(|p| p.exists())
                .map(|p| (p, false)),
        };
        let config = match path {
            Some((p, _)) => {
                let text = std::fs::read_to_string(&p).map_err(|e| RouterError::Config {
                    path: p.display().to_string(),
                    why: e.to_string(),
                })?;
                let value: Value =
                    serde_json::from_str(&text).map_err(|e| RouterError::Config {
                        path: p.display().to_string(),
                        why: e.to_string(),
                    })?;
                Some((p, value))
            }
            None => None,
        };
        Setup::from_sources(&env, config)
    }

    /// Builds a setup from an environment lookup and an optional parsed config file (tests pass
    /// both explicitly).
    pub fn from_sources(
        env: &dyn Fn(&str) -> Option<String>,
        config: Option<(PathBuf, Value)>,
    ) -> Result<Setup, RouterError> {
        let env = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let (config_path, cfg) = match config {
            Some((path, value)) => {
                let cfg: RouterConfig =
                    harness_types::parse::parse_payload(value).map_err(|e| {
                        RouterError::Config {
                            path: path.display().to_string(),
                            why: e.message,
                        }
                    })?;
                (Some(path), cfg)
            }
            None => (None, RouterConfig::default()),
        };
        let cfg_name = config_path
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "router config".into());

        let mut catalog = Catalog::builtin();
        match &cfg.model_catalog {
            Some(Value::String(p)) => {
                let base = config_path.as_deref().and_then(Path::parent);
                let path = base.map(|b| b.join(p)).unwrap_or_else(|| PathBuf::from(p));
                catalog = catalog.merged_file(&path)?;
            }
            Some(v @ Value::Object(_)) => catalog = catalog.merged(v, &cfg_name)?,
            Some(Value::Null) | None => {}
            Some(_) => {
                return Err(RouterError::Config {
                    path: cfg_name,
                    why: "model_catalog: expected a path or an object".into(),
                })
            }
        }
        if let Some(p) = env(CATALOG_ENV) {
            catalog = catalog.merged_file(Path::new(&p))?;
        }

        let mut http = HttpOptions::default();
        if let Some(r) = &cfg.retry {
            http.retry = r.clone();
        }
        if let Some(ms) = cfg.idle_timeout_ms {
            http.idle_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = cfg.connect_timeout_ms {
            http.connect_timeout = Duration::from_millis(ms);
        }

        let section = |id: &str| cfg.providers.get(id);
        let enabled = |id: &str| section(id).and_then(|s| s.enabled).unwrap_or(true);
        let key_of = |id: &str, var: &str| -> Option<(String, Source)> {
            if let Some(k) = env(var) {
                return Some((k, Source::Env));
            }
            let s = section(id)?;
            if let Some(var) = &s.api_key_env {
                return env(var).map(|k| (k, Source::Env));
            }
            s.api_key.clone().map(|k| (k, Source::Config))
        };
        let url_of = |id: &str, var: &str| -> Option<(String, Source)> {
            env(var)
                .map(|u| (u, Source::Env))
                .or_else(|| section(id)?.base_url.clone().map(|u| (u, Source::Config)))
        };
        let mut providers = Vec::new();
        let mut push =
            |id: &str, kind, url: String, key: Option<String>, source, preset: Option<&str>| {
                let mut p = ProviderConfig::new(id, kind, &url, key.as_deref());
                p.source = source;
                p.http = http.clone();
                if let Some(name) = preset {
                    p.wire = WireCaps::of_preset(name);
                    p.concurrency = p.concurrency.or(default_concurrency(name));
                }
                // A local server may still be loading its model: wait that out, unless the
                // config says how to retry.
                let local = preset.or(Some(id)).is_some_and(|n| preset_url(n).is_some());
                if local && cfg.retry.is_none() {
                    p.http.retry = RetryPolicy::local();
                }
                if let Some(n) = section(id).and_then(|s| s.concurrency) {
                    p.concurrency = (n > 0).then_some(n);
                }
                p.wire = p.wire.with(section(id).and_then(|s| s.wire.as_ref()));
                providers.push(p);
            };

        if enabled("anthropic") {
            if let Some((key, source)) = key_of("anthropic", "ANTHROPIC_API_KEY") {
                let url = url_of("anthropic", "ANTHROPIC_BASE_URL")
                    .map(|u| u.0)
                    .unwrap_or_else(|| DEFAULT_ANTHROPIC_BASE_URL.into());
                push(
                    "anthropic",
                    ProviderKind::Anthropic,
                    url,
                    Some(key),
                    source,
                    None,
                );
            }
        }
        if let Some((key, source)) = key_of("openai", "OPENAI_API_KEY") {
            let url = url_of("openai", "OPENAI_BASE_URL")
                .map(|u| u.0)
                .unwrap_or_else(|| DEFAULT_OPENAI_BASE_URL.into());
            if enabled("openai") {
                push(
                    "openai",
                    ProviderKind::Openai,
                    url.clone(),
                    Some(key.clone()),
                    source,
                    None,
                );
            }
            if enabled("openai-responses") {
                let url = section("openai-responses")
                    .and_then(|s| s.base_url.clone())
                    .unwrap_or(url);
                push(
                    "openai-responses",
                    ProviderKind::OpenaiResponses,
                    url,
                    Some(key),
                    source,
                    None,
                );
            }
        }
        if enabled("openai-compatible") {
            let preset = env("OPENAI_COMPATIBLE_PRESET")
                .or_else(|| section("openai-compatible")?.preset.clone());
            let preset_base = match &preset {
                Some(name) => {
                    Some(preset_url(name).ok_or_else(|| RouterError::UnknownPreset(name.clone()))?)
                }
                None => None,
            };
            let url = url_of("openai-compatible", "OPENAI_COMPATIBLE_BASE_URL")
                .or_else(|| preset_base.map(|u| (u.to_string(), Source::Preset)));
            if let Some((url, source)) = url {
                let key = key_of("openai-compatible", "OPENAI_COMPATIBLE_API_KEY").map(|k| k.0);
                push(
                    "openai-compatible",
                    ProviderKind::OpenaiCompatible,
                    url,
                    key,
                    source,
                    preset.as_deref(),
                );
            }
        }
        for (name, default_url, _) in PRESETS {
            if !enabled(name) {
                continue;
            }
            let (url, source) = url_of(name, &env_key(name, "BASE_URL"))
                .unwrap_or_else(|| (default_url.to_string(), Source::Preset));
            let key = key_of(name, &env_key(name, "API_KEY")).map(|k| k.0);
            push(name, ProviderKind::OpenaiCompatible, url, key, source, None);
        }
        for (id, s) in &cfg.providers {
            let known = [
                "anthropic",
                "openai",
                "openai-responses",
                "openai-compatible",
            ]
            .contains(&id.as_str())
                || preset_url(id).is_some();
            if known || s.enabled == Some(false) {
                continue;
            }
            let Some(kind) = s.kind else {
                return Err(RouterError::Config {
                    path: cfg_name,
                    why: format!("providers.{id}.kind: required (anthropic, openai, openai-responses, openai-compatible)"),
                });
            };
            let url = match (&s.base_url, &s.preset, kind) {
                (Some(u), _, _) => u.clone(),
                (None, Some(p), _) => preset_url(p)
                    .ok_or_else(|| RouterError::UnknownPreset(p.clone()))?
                    .to_string(),
                (None, None, ProviderKind::Anthropic) => DEFAULT_ANTHROPIC_BASE_URL.into(),
                (None, None, ProviderKind::Openai | ProviderKind::OpenaiResponses) => {
                    DEFAULT_OPENAI_BASE_URL.into()
                }
                (None, None, ProviderKind::OpenaiCompatible) => {
                    return Err(RouterError::Config {
                        path: cfg_name,
                        why: format!(
                            "providers.{id}.base_url: required for an openai-compatible server"
                        ),
                    })
                }
            };
            let key = key_of(id, "").map(|k| k.0);
            push(id, kind, url, key, Source::Config, s.preset.as_deref());
        }
        for p in &providers {
            let family = match p.kind {
                ProviderKind::Anthropic => "anthropic",
                ProviderKind::Openai | ProviderKind::OpenaiResponses => "openai",
                ProviderKind::OpenaiCompatible => "openai-compatible",
            };
            if p.id != family && catalog.family(&p.id) == p.id {
                catalog.set_family(&p.id, family);
            }
        }
        Ok(Setup {
            providers,
            catalog,
            default_provider: cfg.default_provider,
            default_model: cfg.default_model,
            config_path,
        })
    }

    /// Installs the catalog on `router` and adds every configured provider (after whatever is
    /// already registered, so the scripted provider stays the default).
    pub fn register(&self, router: &Router) {
        router.set_catalog(self.catalog.clone());
        for p in &self.providers {
            router.add_provider(p.build());
        }
    }

    pub fn provider(&self, id: &str) -> Option<&ProviderConfig> {
        self.providers.iter().find(|p| p.id == id)
    }

    pub fn is_configured(&self, id: &str) -> bool {
        id == "scripted" || self.provider(id).is_some()
    }

    /// The provider `harness chat` uses when none is named: the config's `default_provider`,
    /// else the first with credentials among `anthropic`, `openai`, `openai-compatible`.
    pub fn pick(&self) -> Option<String> {
        if let Some(p) = &self.default_provider {
            if self.is_configured(p) {
                return Some(p.clone());
            }
        }
        ["anthropic", "openai", "openai-compatible"]
            .into_iter()
            .find(|id| self.provider(id).is_some())
            .map(str::to_string)
    }

    /// The model used on `provider` when none is named: the config's `default_model` for its
    /// `default_provider`, else the catalog's default.
    pub fn default_model(&self, provider: &str) -> Option<String> {
        if let Some(m) = &self.default_model {
            if self
                .default_provider
                .as_deref()
                .is_none_or(|p| p == provider)
            {
                return Some(m.clone());
            }
        }
        self.catalog.default_model(provider)
    }

    /// What to set to make `id` available (for `harness chat --provider id`).
    pub fn missing(&self, id: &str) -> String {
        let file = self
            .config_path
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| format!("${CONFIG_ENV}"));
        match id {
            "anthropic" => format!(
                "provider 'anthropic' needs an API key: set ANTHROPIC_API_KEY (or providers.anthropic.api_key_env in {file})"
            ),
            "openai" | "openai-responses" => format!(
                "provider '{id}' needs an API key: set OPENAI_API_KEY (or providers.openai.api_key_env in {file})"
            ),
            "openai-compatible" => "provider 'openai-compatible' needs a server: set OPENAI_COMPATIBLE_BASE_URL (e.g. http://127.0.0.1:11434/v1) or OPENAI_COMPATIBLE_PRESET=ollama|llamacpp|vllm|lmstudio (optional key: OPENAI_COMPATIBLE_API_KEY)".to_string(),
            _ if preset_url(id).is_some() => format!(
                "provider '{id}' is disabled in {file}"
            ),
            _ => format!(
                "unknown provider '{id}' (known: scripted, anthropic, openai, openai-responses, openai-compatible, ollama, llamacpp, vllm, lmstudio, or a kind-ed entry under providers in {file})"
            ),
        }
    }
}

/// What `harness chat` talks to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub provider: String,
    pub model: String,
    /// Said to the user when the choice was not asked for (the demo fallback).
    pub note: Option<String>,
}

impl Setup {
    /// Picks the provider and model for a chat: the flags, else the config's defaults, else the
    /// first provider with credentials, else the scripted demo. A model left open comes from the
    /// config or the catalog, or — for a local server — the first model the server lists. The
    /// error says exactly what is missing.
    pub async fn choose(
        &self,
        provider: Option<&str>,
        model: Option<&str>,
    ) -> Result<Choice, String> {
        let picked = provider.map(str::to_string).or_else(|| self.pick());
        let Some(provider) = picked else {
            return Ok(Choice {
                provider: "scripted".into(),
                model: model.unwrap_or("demo").to_string(),
                note: Some(
                    "no model provider is configured (set ANTHROPIC_API_KEY, OPENAI_API_KEY or OPENAI_COMPATIBLE_BASE_URL, or pass --provider ollama); replies come from the scripted demo".into(),
                ),
            });
        };
        if provider == "scripted" {
            return Ok(Choice {
                provider,
                model: model.unwrap_or("demo").to_string(),
                note: None,
            });
        }
        let Some(cfg) = self.provider(&provider) else {
            return Err(self.missing(&provider));
        };
        if let Some(m) = model
            .map(str::to_string)
            .or_else(|| self.default_model(&provider))
        {
            return Ok(Choice {
                provider,
                model: m,
                note: None,
            });
        }
        let listed = cfg.build().list_models().await.map_err(|e| {
            format!(
                "no --model given and the models of '{provider}' at {} could not be listed: {}",
                cfg.base_url,
                e.diagnostic()
            )
        })?;
        match listed.and_then(|ids| ids.into_iter().next()) {
            Some(m) => Ok(Choice {
                provider,
                model: m,
                note: None,
            }),
            None => Err(format!(
                "no --model given and '{provider}' at {} lists no models; name one with --model",
                cfg.base_url
            )),
        }
    }
}

/// Reads the environment and config file, installs the catalog and registers every configured
/// provider on `router`. The one call the runtime makes.
pub fn register_from_env(router: &Router) -> Result<Setup, RouterError> {
    let setup = Setup::from_env()?;
    setup.register(router);
    Ok(setup)
}

/// `url` without credentials in its user-info part (for display).
pub(crate) fn public_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if !u.username().is_empty() || u.password().is_some() => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string().trim_end_matches('/').to_string()
        }
        _ => url.to_string(),
    }
}

/// True for a URL on this machine (no proxy should ever see it).
pub(crate) fn is_loopback(url: &str) -> bool {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_string))
        .is_some_and(|h| {
            h == "localhost"
                || h == "[::1]"
                || h == "::1"
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(vars: &[(&str, &str)], config: Option<Value>) -> Result<Setup, RouterError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        Setup::from_sources(
            &env,
            config.map(|c| (PathBuf::from("/etc/harness/router.json"), c)),
        )
    }

    #[test]
    fn keys_in_the_environment_register_providers() {
        let s = setup(&[], None).unwrap();
        assert!(!s.is_configured("anthropic"));
        assert!(s.is_configured("ollama"));
        assert_eq!(s.pick(), None);
        assert!(s.missing("anthropic").contains("ANTHROPIC_API_KEY"));
        assert!(s.missing("openai").contains("OPENAI_API_KEY"));
        assert!(s
            .missing("openai-compatible")
            .contains("OPENAI_COMPATIBLE_BASE_URL"));

        let s = setup(
            &[
                ("OPENAI_API_KEY", "sk-test-123456"),
                ("OPENAI_COMPATIBLE_PRESET", "llamacpp"),
            ],
            None,
        )
        .unwrap();
        assert!(s.is_configured("openai") && s.is_configured("openai-responses"));
        assert_eq!(s.pick().as_deref(), Some("openai"));
        assert_eq!(s.default_model("openai").as_deref(), Some("gpt-5"));
        let c = s.provider("openai-compatible").unwrap();
        assert_eq!(c.base_url, "http://127.0.0.1:8080/v1");
        assert_eq!(c.api_key, None);
        assert!(!format!("{s:?}").contains("sk-test-123456"));

        let s = setup(&[("ANTHROPIC_API_KEY", "k"), ("OPENAI_API_KEY", "k")], None).unwrap();
        assert_eq!(s.pick().as_deref(), Some("anthropic"));
        assert!(matches!(
            setup(&[("OPENAI_COMPATIBLE_PRESET", "nope")], None),
            Err(RouterError::UnknownPreset(_))
        ));
    }

    #[test]
    fn the_config_file_configures_and_the_environment_wins() {
        let cfg = serde_json::json!({
            "default_provider": "gpu-box", "default_model": "qwen3",
            "providers": {
                "anthropic": {"api_key_env": "MY_KEY", "base_url": "http://proxy.local"},
                "gpu-box": {"kind": "openai-compatible", "base_url": "http://10.0.0.5:8000/v1/"},
                "lmstudio": {"enabled": false}
            },
            "model_catalog": {"models": [{"provider": "gpu-box", "id": "qwen3", "context_window": 40960, "max_output_tokens": 8192}]}
        });
        let s = setup(
            &[
                ("MY_KEY", "secret"),
                ("ANTHROPIC_BASE_URL", "http://env.local"),
            ],
            Some(cfg),
        )
        .unwrap();
        let a = s.provider("anthropic").unwrap();
        assert_eq!(a.base_url, "http://env.local");
        assert_eq!(a.api_key.as_ref().unwrap().expose(), "secret");
        assert_eq!(
            s.provider("gpu-box").unwrap().base_url,
            "http://10.0.0.5:8000/v1"
        );
        assert!(!s.is_configured("lmstudio"));
        assert_eq!(s.pick().as_deref(), Some("gpu-box"));
        assert_eq!(s.default_model("gpu-box").as_deref(), Some("qwen3"));
        assert_eq!(
            s.catalog.context_window(Some("gpu-box"), "qwen3"),
            Some(40960)
        );

        let err = setup(&[], Some(serde_json::json!({"providers": {"x": {}}}))).unwrap_err();
        assert!(err.to_string().contains("providers.x.kind"), "{err}");
        let err = setup(&[], Some(serde_json::json!({"bogus": 1}))).unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn loopback_urls_are_recognized() {
        assert!(is_loopback("http://127.0.0.1:11434/v1"));
        assert!(is_loopback("http://localhost:8080"));
        assert!(is_loopback("http://[::1]:8080"));
        assert!(!is_loopback("https://api.openai.com/v1"));
        assert_eq!(
            public_url("http://u:p@10.0.0.5:8000/v1"),
            "http://10.0.0.5:8000/v1"
        );
        assert_eq!(
            public_url("https://api.openai.com/v1"),
            "https://api.openai.com/v1"
        );
    }
}
