//! The model catalog: what each model can take and what it costs.
//!
//! Shipped as data (`catalog.json`, compiled in) so a price change is a data change, and
//! overridable by a file of the same shape (`HARNESS_MODEL_CATALOG` or `model_catalog` in the
//! router config): override entries are deep-merged into the entry with the same
//! `(provider, id)`, new entries are added. A `"*"` entry is the row for any model of that provider
//! (used for local servers, whose models nobody can list in advance).
//!
//! Provider ids that speak another provider's catalog (the Responses API shares OpenAI's models,
//! every local-server preset shares `openai-compatible`'s) are mapped by `provider_families`.

use std::collections::BTreeMap;
use std::path::Path;

use harness_types::api::ThinkingLevel;
use harness_types::message::Usage;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::RouterError;
use crate::providers::caps::WirePatch;

/// The catalog compiled into the binary.
pub const BUILTIN_CATALOG: &str = include_str!("../catalog.json");

/// What a model can do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Capabilities {
    #[serde(default)]
    pub tools: bool,
    #[serde(default)]
    pub vision: bool,
    #[serde(default)]
    pub thinking: bool,
    #[serde(default)]
    pub structured_output: bool,
}

/// One capability name as `router::models::supports` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    Tools,
    Vision,
    Thinking,
    StructuredOutput,
}

impl Capability {
    pub fn parse(name: &str) -> Option<Capability> {
        Some(match name {
            "tools" | "function_calling" => Capability::Tools,
            "vision" | "images" => Capability::Vision,
            "thinking" | "reasoning" => Capability::Thinking,
            "structured_output" | "structured_outputs" | "json_schema" => {
                Capability::StructuredOutput
            }
            _ => return None,
        })
    }

    pub const NAMES: &'static str = "tools, vision, thinking, structured_output";
}

/// USD per million tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Pricing {
    pub input: f64,
    pub output: f64,
    /// Cached input read; when absent, cached reads cost `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read: Option<f64>,
    /// Cached input written; when absent, cache writes cost `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
}

impl Pricing {
    /// The cost of `usage`. `usage.input` is uncached input (cached reads and writes are counted
    /// apart, the way every adapter normalizes them); `output` includes reasoning tokens.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let m = |tokens: Option<u64>, price: f64| tokens.unwrap_or(0) as f64 * price / 1e6;
        let cost = m(usage.input, self.input)
            + m(usage.output, self.output)
            + m(usage.cache_read, self.cache_read.unwrap_or(self.input))
            + m(usage.cache_write, self.cache_write.unwrap_or(self.input));
        // Round to a millionth of a cent: sums of many steps stay readable.
        (cost * 1e8).round() / 1e8
    }
}

/// One row of the catalog.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ModelEntry {
    /// The catalog provider (a family: `openai` also serves `openai-responses`).
    pub provider: String,
    /// The model id sent to the API; `*` matches any model of the provider.
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Other ids of the same model (dated snapshots).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The provider's default model (what `harness chat` picks without `--model`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
    /// Input + output tokens the model accepts.
    pub context_window: u64,
    pub max_output_tokens: u64,
    #[serde(default)]
    pub capabilities: Capabilities,
    /// The provider-native reasoning efforts, least first (`none` when it can be off).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasoning_efforts: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pricing: Option<Pricing>,
    /// Set on a lookup answered by the provider's `*` row as shipped: its limits are a guess,
    /// and the loop prefers its own default window. A `*` row whose `context_window` an
    /// override set, or a window the server reported, is not generic.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub generic: bool,
    /// The context window came from an override of the catalog or from the server itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub window_known: bool,
    /// What the server accepts for this model, over its provider's (see
    /// [`crate::providers::caps`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wire: Option<WirePatch>,
}

impl ModelEntry {
    pub fn supports(&self, cap: Capability) -> bool {
        let c = &self.capabilities;
        match cap {
            Capability::Tools => c.tools,
            Capability::Vision => c.vision,
            Capability::Thinking => c.thinking,
            Capability::StructuredOutput => c.structured_output,
        }
    }

    /// The least reasoning this model allows (README: `options.reasoning: "lowest"`): the first
    /// effort other than `none`, else `minimal` for a model that only says it thinks, else none.
    pub fn lowest_reasoning(&self) -> LowestReasoning {
        if let Some(e) = self.reasoning_efforts.iter().find(|e| *e != "none") {
            return LowestReasoning {
                thinking_level: level_of(e),
                reasoning_effort: Some(e.clone()),
            };
        }
        if self.capabilities.thinking {
            return LowestReasoning {
                thinking_level: Some(ThinkingLevel::Minimal),
                reasoning_effort: None,
            };
        }
        LowestReasoning::default()
    }

    /// The native effort closest to `level` among the model's efforts (`level` as is when the
    /// model lists none). Never picks `none` for a level that asked for some reasoning.
    pub fn effort_for(&self, level: ThinkingLevel) -> String {
        let wanted = effort_name(level);
        let known: Vec<&String> = self
            .reasoning_efforts
            .iter()
            .filter(|e| *e != "none")
            .collect();
        if known.is_empty() || known.iter().any(|e| *e == wanted) {
            return wanted.to_string();
        }
        let rank = |e: &str| EFFORTS.iter().position(|x| *x == e).unwrap_or(3) as i32;
        let target = rank(wanted);
        known
            .into_iter()
            .min_by_key(|e| ((rank(e) - target).abs(), -rank(e)))
            .cloned()
            .unwrap_or_else(|| wanted.to_string())
    }
}

const EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];

/// The native effort name of a thinking level.
pub fn effort_name(level: ThinkingLevel) -> &'static str {
    match level {
        ThinkingLevel::Minimal => "minimal",
        ThinkingLevel::Low => "low",
        ThinkingLevel::Medium => "medium",
        ThinkingLevel::High => "high",
        ThinkingLevel::Xhigh => "xhigh",
    }
}

fn level_of(effort: &str) -> Option<ThinkingLevel> {
    Some(match effort {
        "minimal" => ThinkingLevel::Minimal,
        "low" => ThinkingLevel::Low,
        "medium" => ThinkingLevel::Medium,
        "high" => ThinkingLevel::High,
        "xhigh" => ThinkingLevel::Xhigh,
        _ => return None,
    })
}

/// What `reasoning: "lowest"` resolves to.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LowestReasoning {
    pub thinking_level: Option<ThinkingLevel>,
    pub reasoning_effort: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CatalogFile {
    #[serde(default)]
    provider_families: BTreeMap<String, String>,
    #[serde(default)]
    models: Vec<ModelEntry>,
}

/// The catalog.
#[derive(Clone, Debug)]
pub struct Catalog {
    families: BTreeMap<String, String>,
    models: Vec<ModelEntry>,
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog::builtin()
    }
}

impl Catalog {
    /// The shipped catalog.
    pub fn builtin() -> Catalog {
        Catalog::from_json(BUILTIN_CATALOG).expect("the shipped catalog.json parses")
    }

    pub fn from_json(text: &str) -> Result<Catalog, RouterError> {
        let value: Value = serde_json::from_str(text).map_err(|e| RouterError::Catalog {
            source_name: "catalog".into(),
            why: e.to_string(),
        })?;
        Catalog::from_value(&value, "catalog")
    }

    fn from_value(value: &Value, source_name: &str) -> Result<Catalog, RouterError> {
        let file: CatalogFile =
            harness_types::parse::parse_payload(value.clone()).map_err(|e| {
                RouterError::Catalog {
                    source_name: source_name.to_string(),
                    why: e.message,
                }
            })?;
        Ok(Catalog {
            families: file.provider_families,
            models: file.models,
        })
    }

    /// This catalog with `overlay` (same JSON shape) merged over it.
    pub fn merged(&self, overlay: &Value, source_name: &str) -> Result<Catalog, RouterError> {
        let bad = |why: String| RouterError::Catalog {
            source_name: source_name.to_string(),
            why,
        };
        let mut models: Vec<Value> = self
            .models
            .iter()
            .map(|m| serde_json::to_value(m).map_err(|e| bad(e.to_string())))
            .collect::<Result<_, _>>()?;
        let Some(obj) = overlay.as_object() else {
            return Err(bad("expected a JSON object".into()));
        };
        let mut families = self.families.clone();
        if let Some(f) = obj.get("provider_families") {
            let f: BTreeMap<String, String> = serde_json::from_value(f.clone())
                .map_err(|e| bad(format!("provider_families: {e}")))?;
            families.extend(f);
        }
        if let Some(list) = obj.get("models") {
            let Some(list) = list.as_array() else {
                return Err(bad("models: expected an array".into()));
            };
            for (i, m) in list.iter().enumerate() {
                let key = |v: &Value| {
                    (
                        v.get("provider")
                            .and_then(Value::as_str)
                            .map(str::to_string),
                        v.get("id").and_then(Value::as_str).map(str::to_string),
                    )
                };
                let (Some(p), Some(id)) = key(m) else {
                    return Err(bad(format!("models[{i}]: provider and id are required")));
                };
                let mut m = m.clone();
                if id == "*" && m.get("context_window").is_some() {
                    // Someone measured this: a catch-all row with a window set by hand is the
                    // best answer there is for that server's models.
                    m["window_known"] = Value::Bool(true);
                }
                match models
                    .iter_mut()
                    .find(|x| key(x) == (Some(p.clone()), Some(id.clone())))
                {
                    Some(existing) => deep_merge(existing, &m),
                    None => {
                        // A new row of a provider with a catch-all row (its own or its
                        // family's) starts from it: `{"provider": "llamacpp", "id": "*",
                        // "context_window": 2048}` is a whole row.
                        let family = families.get(&p).cloned().unwrap_or_else(|| p.clone());
                        let base = [&p, &family].into_iter().find_map(|fp| {
                            models
                                .iter()
                                .find(|x| key(x) == (Some(fp.clone()), Some("*".to_string())))
                                .cloned()
                        });
                        match base {
                            Some(mut row) => {
                                if let Some(o) = row.as_object_mut() {
                                    o.remove("default");
                                    o.remove("name");
                                    o.remove("aliases");
                                    o.remove("window_known");
                                }
                                deep_merge(&mut row, &m);
                                models.push(row);
                            }
                            None => models.push(m),
                        }
                    }
                }
            }
        }
        let merged = serde_json::json!({"provider_families": families, "models": models});
        Catalog::from_value(&merged, source_name)
    }

    /// This catalog with the file at `path` merged over it.
    pub fn merged_file(&self, path: &Path) -> Result<Catalog, RouterError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| RouterError::Catalog {
            source_name: name.clone(),
            why: e.to_string(),
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| RouterError::Catalog {
            source_name: name.clone(),
            why: e.to_string(),
        })?;
        self.merged(&value, &name)
    }

    /// Lets `provider` use `family`'s rows (a provider id the config file made up).
    pub fn set_family(&mut self, provider: &str, family: &str) {
        self.families
            .insert(provider.to_string(), family.to_string());
    }

    /// The catalog provider whose rows serve `provider`.
    pub fn family<'a>(&'a self, provider: &'a str) -> &'a str {
        self.families
            .get(provider)
            .map(String::as_str)
            .unwrap_or(provider)
    }

    fn find(&self, provider: &str, id: &str) -> Option<&ModelEntry> {
        self.models
            .iter()
            .find(|m| m.provider == provider && m.id == id)
            .or_else(|| {
                self.models
                    .iter()
                    .find(|m| m.provider == provider && m.aliases.iter().any(|a| a == id))
            })
    }

    /// The row of model `id` on `provider` (any provider when `None`). A provider's `*` row
    /// answers for models it has no row of, marked `generic`, with the asked id.
    pub fn get(&self, provider: Option<&str>, id: &str) -> Option<ModelEntry> {
        let Some(provider) = provider else {
            return self
                .models
                .iter()
                .find(|m| m.id == id && m.id != "*")
                .or_else(|| {
                    self.models
                        .iter()
                        .find(|m| m.aliases.iter().any(|a| a == id))
                })
                .cloned();
        };
        let family = self.family(provider);
        for p in [provider, family] {
            if let Some(m) = self.find(p, id) {
                if m.id != "*" {
                    return Some(m.clone());
                }
            }
        }
        for p in [provider, family] {
            if let Some(m) = self.find(p, "*") {
                let mut m = m.clone();
                m.id = id.to_string();
                m.generic = !m.window_known;
                return Some(m);
            }
        }
        None
    }

    /// Every row, optionally of one provider (its family's rows included).
    pub fn entries(&self, provider: Option<&str>) -> Vec<&ModelEntry> {
        self.models
            .iter()
            .filter(|m| match provider {
                None => true,
                Some(p) => m.provider == p || m.provider == self.family(p),
            })
            .collect()
    }

    /// The model `harness chat` uses on `provider` without `--model`.
    pub fn default_model(&self, provider: &str) -> Option<String> {
        let family = self.family(provider);
        self.models
            .iter()
            .find(|m| (m.provider == provider || m.provider == family) && m.default)
            .map(|m| m.id.clone())
    }

    pub fn supports(&self, provider: Option<&str>, id: &str, cap: Capability) -> bool {
        self.get(provider, id).is_some_and(|m| m.supports(cap))
    }

    pub fn context_window(&self, provider: Option<&str>, id: &str) -> Option<u64> {
        self.get(provider, id).map(|m| m.context_window)
    }

    pub fn max_output_tokens(&self, provider: Option<&str>, id: &str) -> Option<u64> {
        self.get(provider, id).map(|m| m.max_output_tokens)
    }

    pub fn pricing(&self, provider: Option<&str>, id: &str) -> Option<Pricing> {
        self.get(provider, id).and_then(|m| m.pricing)
    }

    /// `reasoning: "lowest"` for a model; `None` when the catalog has no row for it (the README
    /// says that fails the send).
    pub fn lowest_reasoning(&self, provider: Option<&str>, id: &str) -> Option<LowestReasoning> {
        self.get(provider, id).map(|m| m.lowest_reasoning())
    }
}

fn deep_merge(base: &mut Value, overlay: &Value) {
    match (base, overlay) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(existing) => deep_merge(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_builtin_catalog_answers_lookups() {
        let c = Catalog::builtin();
        let sonnet = c
            .get(Some("anthropic"), "claude-sonnet-4-5-20250929")
            .unwrap();
        assert_eq!(sonnet.id, "claude-sonnet-4-5");
        assert_eq!(sonnet.context_window, 200_000);
        assert!(c.supports(Some("anthropic"), "claude-sonnet-4-5", Capability::Thinking));
        assert_eq!(
            c.default_model("anthropic").as_deref(),
            Some("claude-sonnet-4-5")
        );
        assert_eq!(
            c.default_model("openai-responses").as_deref(),
            Some("gpt-5")
        );
        assert_eq!(c.context_window(Some("scripted"), "demo"), Some(200_000));
        assert_eq!(c.pricing(Some("scripted"), "demo").unwrap().input, 0.0);
        let local = c.get(Some("ollama"), "llama3.2:3b").unwrap();
        assert!(local.generic);
        assert_eq!(local.id, "llama3.2:3b");
        assert!(c.get(Some("anthropic"), "claude-9").is_none());
        assert_eq!(c.get(None, "gpt-4o").unwrap().provider, "openai");
        assert!(c.get(None, "*").is_none());
    }

    #[test]
    fn a_catch_all_row_with_a_configured_window_is_not_a_guess() {
        let c = Catalog::builtin()
            .merged(
                &json!({"models": [{"provider": "openai-compatible", "id": "*", "context_window": 2048}]}),
                "local.json",
            )
            .unwrap();
        let m = c.get(Some("llamacpp"), "gemma-3-270m").unwrap();
        assert_eq!(m.context_window, 2048);
        assert!(!m.generic, "{m:?}");
        assert_eq!(m.max_output_tokens, 4096);
        let shipped = Catalog::builtin()
            .get(Some("llamacpp"), "gemma-3-270m")
            .unwrap();
        assert!(shipped.generic);
        let priced = Catalog::builtin()
            .merged(
                &json!({"models": [{"provider": "openai-compatible", "id": "*", "pricing": {"input": 1, "output": 2}}]}),
                "local.json",
            )
            .unwrap();
        assert!(priced.get(Some("llamacpp"), "x").unwrap().generic);
        let own = Catalog::builtin()
            .merged(
                &json!({"models": [{"provider": "llamacpp", "id": "*", "context_window": 512}]}),
                "local.json",
            )
            .unwrap();
        let m = own.get(Some("llamacpp"), "gemma").unwrap();
        assert_eq!(
            (m.context_window, m.max_output_tokens, m.generic),
            (512, 4096, false)
        );
        assert!(own.get(Some("ollama"), "gemma").unwrap().generic);
    }

    #[test]
    fn lowest_reasoning_follows_the_readme() {
        let c = Catalog::builtin();
        let l = c.lowest_reasoning(Some("openai"), "gpt-5.1").unwrap();
        assert_eq!(l.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(l.thinking_level, Some(ThinkingLevel::Low));
        let l = c.lowest_reasoning(Some("openai"), "gpt-5").unwrap();
        assert_eq!(l.reasoning_effort.as_deref(), Some("minimal"));
        let l = c
            .lowest_reasoning(Some("anthropic"), "claude-haiku-4-5")
            .unwrap();
        assert_eq!(l.thinking_level, Some(ThinkingLevel::Minimal));
        assert_eq!(l.reasoning_effort, None);
        let l = c.lowest_reasoning(Some("openai"), "gpt-4o").unwrap();
        assert_eq!(l, LowestReasoning::default());
        assert!(c.lowest_reasoning(Some("openai"), "unknown").is_none());
    }

    #[test]
    fn efforts_snap_to_what_the_model_has() {
        let c = Catalog::builtin();
        let o3 = c.get(Some("openai"), "o3").unwrap();
        assert_eq!(o3.effort_for(ThinkingLevel::Minimal), "low");
        assert_eq!(o3.effort_for(ThinkingLevel::Xhigh), "high");
        assert_eq!(o3.effort_for(ThinkingLevel::Medium), "medium");
        let g51 = c.get(Some("openai"), "gpt-5.1").unwrap();
        assert_eq!(g51.effort_for(ThinkingLevel::Minimal), "low");
    }

    #[test]
    fn overrides_merge_per_entry_and_add_rows() {
        let c = Catalog::builtin()
            .merged(
                &json!({"models": [
                    {"provider": "anthropic", "id": "claude-sonnet-4-5", "pricing": {"input": 2.5}},
                    {"provider": "ollama", "id": "qwen3:8b", "context_window": 40960, "max_output_tokens": 8192,
                     "capabilities": {"tools": true, "thinking": true}}
                ]}),
                "test",
            )
            .unwrap();
        let p = c.pricing(Some("anthropic"), "claude-sonnet-4-5").unwrap();
        assert_eq!((p.input, p.output), (2.5, 15.0));
        let q = c.get(Some("ollama"), "qwen3:8b").unwrap();
        assert_eq!(q.context_window, 40960);
        assert!(!q.generic);
        let err = Catalog::builtin()
            .merged(
                &json!({"models": [{"provider": "x", "id": "y"}]}),
                "bad.json",
            )
            .unwrap_err();
        assert!(err.to_string().contains("bad.json"), "{err}");
    }

    #[test]
    fn cost_counts_cache_reads_and_writes_apart() {
        let p = Pricing {
            input: 3.0,
            output: 15.0,
            cache_read: Some(0.3),
            cache_write: Some(3.75),
        };
        let u = Usage {
            input: Some(1_000_000),
            output: Some(100_000),
            cache_read: Some(2_000_000),
            cache_write: Some(100_000),
            ..Usage::default()
        };
        assert!((p.cost(&u) - (3.0 + 1.5 + 0.6 + 0.375)).abs() < 1e-9);
    }
}
