//! Resolving a session's identity at send and spawn time: the built-in or directory identity,
//! an agent profile with its preloaded functions and skills, the skills index; and the
//! read-only preview `harness::system-prompt::get`.
//!
//! The directory is a soft dependency: without `directory::*` on the bus, sessions get the
//! built-in identity and no index, and only a send that names a profile or skills is refused.

use harness_types::api::{
    PromptLayer, PromptLayerKind, SelectedPrompt, SystemPromptGetRequest, SystemPromptGetResponse,
    SystemPromptStrategy,
};
use harness_types::directory::{AgentProfile, Skill, SkillList, SystemPrompt};
use harness_types::{ErrorCode, HarnessError};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::harness::{Harness, Result};
use crate::prompt::{self, Contract, Layers};
use crate::record::{FrozenAgent, PromptShape, TurnOptions, TurnRecord};
use std::collections::BTreeMap;

/// What a send freezes about the prompt.
#[derive(Clone, Debug, Default)]
pub(crate) struct FrozenPrompt {
    pub system_prompt: Option<String>,
    pub shape: Option<PromptShape>,
    pub agent: Option<FrozenAgent>,
    /// For the preview: the layers and where each came from; the first `stable_layers` of
    /// them make the cacheable prefix.
    pub layers: Vec<PromptLayer>,
    pub stable_layers: usize,
}

/// Where the identity layer came from.
enum IdentitySource {
    BuiltIn,
    Directory,
}

/// The prompt fields of a send or spawn that ask for a fresh resolution.
pub(crate) struct PromptFields<'a> {
    pub custom: Option<&'a str>,
    pub strategy: SystemPromptStrategy,
    pub agent: Option<&'a AgentProfile>,
    /// The skills the index lists (None = all).
    pub skills: Option<&'a [String]>,
    /// The request field that named `skills`, for errors.
    pub skills_field: &'a str,
    /// The operating mode whose paragraph heads the identity.
    pub mode: Option<harness_types::api::Mode>,
}

impl Harness {
    /// Calls a sibling the loop can do without: `None` when nothing registered `function_id`.
    /// No retry for an absent function (unlike [`Harness::call`]): absence is the answer.
    async fn call_optional<T: DeserializeOwned>(
        &self,
        function_id: &str,
        payload: Value,
    ) -> Result<Option<T>> {
        match self
            .bus()
            .call(
                function_id,
                payload,
                Some(std::time::Duration::from_millis(
                    self.config().session_timeout_ms,
                )),
            )
            .await
        {
            Ok(v) => serde_json::from_value(v).map(Some).map_err(|e| {
                HarnessError::dependency(format!("{function_id} answered an unexpected shape: {e}"))
            }),
            Err(e) => {
                let e = e.into_harness();
                if e.code == ErrorCode::FunctionNotFound {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// The identity of new sessions: the directory's `default` system prompt, else the
    /// built-in one. Any failure of the directory falls back (and is logged): the identity must
    /// not make every send fail.
    async fn identity(&self) -> (String, IdentitySource) {
        let got: Result<Option<SystemPrompt>> = self
            .call_optional("directory::system-prompts::get", json!({"name": "default"}))
            .await;
        match got {
            Ok(Some(p)) if !p.body.trim().is_empty() => (p.body, IdentitySource::Directory),
            Ok(_) => (prompt::IDENTITY.to_string(), IdentitySource::BuiltIn),
            Err(e) => {
                if e.code != ErrorCode::NotFound {
                    tracing::warn!("directory identity unavailable, using the built-in one: {e}");
                }
                (prompt::IDENTITY.to_string(), IdentitySource::BuiltIn)
            }
        }
    }

    /// An agent profile from the directory, its errors named under `field`.
    pub(crate) async fn agent_profile(&self, field: &str, name: &str) -> Result<AgentProfile> {
        let got: Option<AgentProfile> = self
            .call_optional("directory::agents::get", json!({ "name": name }))
            .await
            .map_err(|e| HarnessError::new(e.code, format!("{field}: {}", e.message)))?;
        got.ok_or_else(|| {
            HarnessError::invalid_field(
                field,
                "no directory is running (directory::agents::get is not registered)",
            )
        })
    }

    /// The skills index of a new session: every skill, or the ones `filter` names (each must
    /// exist). None when the directory is absent or has no skill.
    pub(crate) async fn skills_index(
        &self,
        field: &str,
        filter: Option<&[String]>,
    ) -> Result<Option<String>> {
        // A malformed skill file is the directory's fault, not the request's: named as such
        // (with the file and field the directory gives), never skipped silently.
        let list: Option<SkillList> = self
            .call_optional("directory::skills::list", json!({}))
            .await
            .map_err(|e| HarnessError::dependency(format!("the skills index: {}", e.message)))?;
        let Some(list) = list else {
            if filter.is_some_and(|f| !f.is_empty()) {
                return Err(HarnessError::invalid_field(
                    field,
                    "no directory is running (directory::skills::list is not registered)",
                ));
            }
            return Ok(None);
        };
        let mut skills = list.skills;
        if let Some(names) = filter.filter(|f| !f.is_empty()) {
            if let Some(unknown) = names.iter().find(|n| !skills.iter().any(|s| &s.name == *n)) {
                return Err(HarnessError::invalid_field(
                    field,
                    format!("skill '{unknown}' is not in the directory"),
                ));
            }
            skills.retain(|s| names.contains(&s.name));
        }
        Ok(prompt::skills_index(&skills))
    }

    /// The registry's contracts (description and request schema) of `ids`, each `None` when
    /// the registry does not list it.
    async fn contracts(&self, ids: &[String]) -> Result<Vec<Contract>> {
        let info: Value = self
            .call("engine::functions::info", &json!({ "function_ids": ids }))
            .await?;
        let by_id = |id: &str| {
            info["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|f| f["function_id"] == id && f.get("error").is_none())
                .map(|f| {
                    (
                        f["description"].as_str().unwrap_or_default().to_string(),
                        f.get("request_schema")
                            .filter(|s| s.is_object())
                            .cloned()
                            .unwrap_or_else(|| json!({"type": "object"})),
                    )
                })
        };
        Ok(ids
            .iter()
            .map(|id| Contract {
                id: id.clone(),
                found: by_id(id),
            })
            .collect())
    }

    /// A profile's identity: its resolved prompt, then its preloaded functions' contracts
    /// (from the registry), then its preloaded skills' bodies; and the digest of each contract
    /// as frozen, for the stale notice.
    async fn agent_base(
        &self,
        profile: &AgentProfile,
    ) -> Result<(String, BTreeMap<String, String>)> {
        let mut parts = vec![profile.system_prompt.trim().to_string()];
        let mut digests = BTreeMap::new();
        if !profile.functions.is_empty() {
            let contracts = self.contracts(&profile.functions).await?;
            digests = contract_digests(&contracts);
            parts.extend(prompt::preloaded_functions(&contracts));
        }
        if !profile.skills.is_empty() {
            let mut bodies = Vec::new();
            for name in &profile.skills {
                let got: Result<Option<Skill>> = self
                    .call_optional("directory::skills::get", json!({ "name": name }))
                    .await;
                let body = match got {
                    Ok(s) => s.map(|s| s.body),
                    Err(e) if e.code == ErrorCode::NotFound => None,
                    Err(e) => return Err(e),
                };
                bodies.push((name.clone(), body));
            }
            parts.extend(prompt::preloaded_skills(&bodies));
        }
        Ok((
            parts
                .into_iter()
                .filter(|p| !p.is_empty())
                .collect::<Vec<_>>()
                .join("\n\n"),
            digests,
        ))
    }

    /// The tail notice of a session whose profile preloaded contracts that changed since it
    /// froze them (a schema or description changed, a function went away, an unavailable one
    /// appeared): naming exactly those ids, on every step until a new session resolves the
    /// profile afresh. `None` when nothing changed or the registry cannot be asked.
    pub(crate) async fn preloaded_notice(&self, rec: &TurnRecord) -> Option<String> {
        let frozen = &rec.options.agent.as_ref()?.contracts;
        if frozen.is_empty() {
            return None;
        }
        let ids: Vec<String> = frozen.keys().cloned().collect();
        let now = match self.contracts(&ids).await {
            Ok(c) => contract_digests(&c),
            Err(e) => {
                tracing::warn!(session = %rec.session_id, "preloaded contracts unreadable: {e}");
                return None;
            }
        };
        let changed: Vec<String> = frozen
            .iter()
            .filter_map(|(id, then)| {
                let now = now.get(id).map(String::as_str).unwrap_or(UNAVAILABLE);
                let what = match (then.as_str(), now) {
                    (a, b) if a == b => return None,
                    (_, UNAVAILABLE) => "no longer registered",
                    (UNAVAILABLE, _) => "now available",
                    _ => "changed",
                };
                Some(format!("`{id}` ({what})"))
            })
            .collect();
        (!changed.is_empty()).then(|| crate::texts::preloaded_contracts_stale(&changed.join(", ")))
    }

    /// Resolves a prompt fresh: the profile (whole identity) or the identity with the caller's
    /// text per strategy, then the skills index.
    pub(crate) async fn fresh_prompt(&self, f: PromptFields<'_>) -> Result<FrozenPrompt> {
        let mut contracts = BTreeMap::new();
        let (mut layers, mut labels) = match f.agent {
            Some(profile) => {
                let (base, digests) = self.agent_base(profile).await?;
                contracts = digests;
                let label = format!("agent profile {}", profile.chain.join(" → "));
                (
                    Layers {
                        base,
                        ..Layers::default()
                    },
                    vec![(PromptLayerKind::Agent, label)],
                )
            }
            None => {
                let identity = if f.strategy == SystemPromptStrategy::Disabled {
                    None
                } else {
                    Some(self.identity().await)
                };
                let Some((identity, source)) = identity else {
                    return Ok(FrozenPrompt::default());
                };
                let Some(layers) = prompt::base_layers(&identity, f.custom, f.strategy) else {
                    return Ok(FrozenPrompt::default());
                };
                let base_label = if layers.base == identity {
                    match source {
                        IdentitySource::BuiltIn => (PromptLayerKind::BuiltIn, "built-in identity"),
                        IdentitySource::Directory => (
                            PromptLayerKind::DirectoryIdentity,
                            "directory system-prompts/default.md",
                        ),
                    }
                } else {
                    (PromptLayerKind::Selected, "system_prompt (override)")
                };
                (layers, vec![(base_label.0, base_label.1.to_string())])
            }
        };
        if let Some(paragraph) = prompt::mode_paragraph(f.mode) {
            // Part of the identity, so of the cacheable prefix: every session in the mode
            // shares it.
            layers.base = format!("{paragraph}\n\n{}", layers.base);
            if let Some((_, label)) = labels.first_mut() {
                label.push_str(&format!(
                    ", headed by the {} mode paragraph",
                    mode_name(f.mode)
                ));
            }
        }
        layers.skills_index = self.skills_index(f.skills_field, f.skills).await?;
        if layers.skills_index.is_some() {
            labels.push((PromptLayerKind::SkillsIndex, "skills index".into()));
        }
        if layers.custom.is_some() {
            labels.push((PromptLayerKind::Selected, "system_prompt (enrich)".into()));
        }
        let (text, shape) = layers.compose();
        let stable_layers = labels.len() - usize::from(layers.custom.is_some());
        Ok(FrozenPrompt {
            stable_layers,
            layers: layer_texts(&layers)
                .into_iter()
                .zip(labels)
                .map(|(text, (kind, label))| PromptLayer { kind, label, text })
                .collect(),
            system_prompt: Some(text),
            shape: Some(shape),
            agent: f.agent.map(|p| FrozenAgent {
                name: p.name.clone(),
                chain: p.chain.clone(),
                display: p.display.clone(),
                contracts,
            }),
        })
    }

    /// A new turn of a session whose prompt it inherits: when the skills catalog changed since
    /// the session was last told about it (its frozen index, or its last correction), the
    /// correction to append before the new message, and the index it now knows. Never for a
    /// prompt without an index; a catalog that cannot be read, or lists nothing, is no change.
    pub(crate) async fn skills_catalog_correction(
        &self,
        prev: &TurnOptions,
        next: &TurnOptions,
    ) -> Option<(String, String)> {
        let seen = match &prev.skills_seen {
            Some(s) => s.clone(),
            None => {
                Layers::split(prev.system_prompt.as_deref()?, prev.prompt_shape?)?.skills_index?
            }
        };
        let now = match self
            .skills_index("options.skills", next.skills.as_deref())
            .await
        {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!("skills catalog unreadable, no correction: {e}");
                return None;
            }
        };
        // No index at all is no directory as often as no skills: not told as a removal.
        let now = now?;
        let text = prompt::skills_correction(&seen, Some(&now))?;
        Some((text, now))
    }

    /// The frozen prompt with its skills index rebuilt for `filter` (a send naming
    /// `options.skills` and no prompt field); the identity and the caller's text stay as frozen.
    pub(crate) async fn reindexed(
        &self,
        prev: &TurnOptions,
        filter: Option<&[String]>,
    ) -> Result<Option<(String, PromptShape)>> {
        let (Some(text), Some(shape)) = (prev.system_prompt.as_deref(), prev.prompt_shape) else {
            return Ok(None);
        };
        let Some(mut layers) = Layers::split(text, shape) else {
            return Ok(None);
        };
        layers.skills_index = self.skills_index("options.skills", filter).await?;
        Ok(Some(layers.compose()))
    }

    /// `harness::system-prompt::get`.
    pub async fn system_prompt_get(
        &self,
        req: SystemPromptGetRequest,
    ) -> Result<SystemPromptGetResponse> {
        if req.default_only == Some(true) {
            if req.session_id.is_some() || req.selected_prompt.is_some() {
                return Err(HarnessError::invalid_field(
                    "default_only",
                    "cannot be combined with session_id or selected_prompt",
                ));
            }
            let layer = PromptLayer {
                kind: PromptLayerKind::BuiltIn,
                label: "built-in identity".into(),
                text: prompt::IDENTITY.into(),
            };
            return Ok(response(vec![layer], 1, Vec::new()));
        }
        let rec = match &req.session_id {
            Some(id) if id.is_empty() => {
                return Err(HarnessError::invalid_field(
                    "session_id",
                    "must not be empty",
                ))
            }
            Some(id) => self.load_record(id).await?,
            None => None,
        };
        let (layers, stable) = match (&req.selected_prompt, &rec) {
            (Some(sel), _) => {
                let f = self.preview_selected(sel).await?;
                (f.layers, f.stable_layers)
            }
            (None, Some(rec)) => frozen_layers(&rec.options),
            (None, None) => {
                let f = self
                    .fresh_prompt(PromptFields {
                        custom: None,
                        strategy: SystemPromptStrategy::Enrich,
                        agent: None,
                        skills: None,
                        skills_field: "skills",
                        mode: None,
                    })
                    .await?;
                (f.layers, f.stable_layers)
            }
        };
        let aid = req.session_id.as_deref().map(|sid| PromptLayer {
            kind: PromptLayerKind::RuntimeContext,
            label: "runtime context (appended at every step)".into(),
            text: prompt::runtime_aid(
                sid,
                rec.as_ref().and_then(|r| r.options.functions.as_ref()),
                rec.as_ref()
                    .and_then(|r| prompt::fs_root(r.options.metadata.as_ref())),
            ),
        });
        let mut tail: Vec<PromptLayer> = aid.into_iter().collect();
        tail.extend(self.injected_layers().await?);
        Ok(response(layers, stable, tail))
    }

    /// The static `inject_prompt` texts of the pre-generate bindings, in chain order: what a
    /// step appends after the runtime context without calling anything.
    async fn injected_layers(&self) -> Result<Vec<PromptLayer>> {
        Ok(self
            .hooks(crate::hooks::HookPoint::PreGenerate)
            .await?
            .into_iter()
            .filter_map(|h| {
                let text = h.inject_prompt?;
                Some(PromptLayer {
                    kind: PromptLayerKind::Injected,
                    label: format!(
                        "inject_prompt of the pre-generate binding of {} (appended at every step)",
                        h.function_id
                    ),
                    text,
                })
            })
            .collect())
    }

    async fn preview_selected(&self, sel: &SelectedPrompt) -> Result<FrozenPrompt> {
        let profile = match &sel.agent {
            Some(name) => {
                if sel.system_prompt.is_some() || sel.system_prompt_strategy.is_some() {
                    return Err(agent_with_prompt_fields("selected_prompt.agent"));
                }
                Some(self.agent_profile("selected_prompt.agent", name).await?)
            }
            None => None,
        };
        check_mode("selected_prompt.mode", sel.mode, sel.system_prompt_strategy)?;
        self.fresh_prompt(PromptFields {
            custom: sel.system_prompt.as_deref(),
            strategy: sel.system_prompt_strategy.unwrap_or_default(),
            agent: profile.as_ref(),
            skills: sel.skills.as_deref(),
            skills_field: "selected_prompt.skills",
            mode: sel.mode,
        })
        .await
    }
}

fn mode_name(mode: Option<harness_types::api::Mode>) -> &'static str {
    use harness_types::api::Mode;
    match mode {
        Some(Mode::Plan) => "plan",
        Some(Mode::Ask) => "ask",
        _ => "agent",
    }
}

/// A plan or ask mode needs a prompt to carry its paragraph: `disabled` sends none.
pub(crate) fn check_mode(
    field: &str,
    mode: Option<harness_types::api::Mode>,
    strategy: Option<SystemPromptStrategy>,
) -> Result<()> {
    if prompt::mode_paragraph(mode).is_some() && strategy == Some(SystemPromptStrategy::Disabled) {
        return Err(HarnessError::invalid_field(
            field,
            format!(
                "'{}' cannot be combined with system_prompt_strategy 'disabled': the mode is a paragraph of the system prompt, and 'disabled' sends none",
                mode_name(mode)
            ),
        ));
    }
    Ok(())
}

/// What a preloaded id's digest is while the registry does not list it.
const UNAVAILABLE: &str = "unavailable";

/// `sha256:` of each contract's description and request schema, `unavailable` for a missing one.
fn contract_digests(contracts: &[Contract]) -> BTreeMap<String, String> {
    contracts
        .iter()
        .map(|c| {
            let digest = match &c.found {
                Some((description, schema)) => format!(
                    "sha256:{}",
                    harness_types::digest::sha256_hex(
                        json!({"description": description, "request_schema": schema})
                            .to_string()
                            .as_bytes()
                    )
                ),
                None => UNAVAILABLE.to_string(),
            };
            (c.id.clone(), digest)
        })
        .collect()
}

pub(crate) fn agent_with_prompt_fields(field: &str) -> HarnessError {
    HarnessError::invalid_field(
        field,
        "cannot be combined with system_prompt or system_prompt_strategy: the profile is the whole identity",
    )
}

/// The texts of the layers present, in prompt order.
fn layer_texts(layers: &Layers) -> Vec<String> {
    let mut out = vec![layers.base.clone()];
    out.extend(layers.skills_index.clone());
    out.extend(layers.custom.clone());
    out
}

/// A session's frozen prompt, as layers when its shape is known, and how many of them are
/// stable.
fn frozen_layers(o: &TurnOptions) -> (Vec<PromptLayer>, usize) {
    let Some(text) = o.system_prompt.as_deref() else {
        return (Vec::new(), 0);
    };
    let frozen = |label: &str, text: String| PromptLayer {
        kind: PromptLayerKind::Frozen,
        label: format!("session (frozen at send): {label}"),
        text,
    };
    let split = o.prompt_shape.and_then(|s| Layers::split(text, s));
    let Some(layers) = split else {
        return (vec![frozen("prompt", text.to_string())], 1);
    };
    let identity = match &o.agent {
        Some(a) => format!("agent profile {}", a.chain.join(" → ")),
        None => "identity".to_string(),
    };
    let mut out = vec![frozen(&identity, layers.base)];
    if let Some(i) = layers.skills_index {
        out.push(PromptLayer {
            kind: PromptLayerKind::SkillsIndex,
            label: "session (frozen at send): skills index".into(),
            text: i,
        });
    }
    let stable = out.len();
    if let Some(c) = layers.custom {
        out.push(frozen("system_prompt (enrich)", c));
    }
    (out, stable)
}

/// The response: the prompt the layers compose (frozen layers, then the runtime aid and the
/// bindings' injected texts), its stable prefix (the identity and the skills index) and that
/// prefix's digest.
fn response(
    mut layers: Vec<PromptLayer>,
    stable_count: usize,
    aid: Vec<PromptLayer>,
) -> SystemPromptGetResponse {
    let join = |ls: &[PromptLayer]| {
        ls.iter()
            .map(|l| l.text.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    };
    let stable = (stable_count > 0).then(|| join(&layers[..stable_count]));
    let surface_digest = stable
        .as_ref()
        .map(|s| format!("sha256:{}", harness_types::digest::sha256_hex(s.as_bytes())));
    layers.extend(aid);
    let system_prompt = (!layers.is_empty()).then(|| join(&layers));
    SystemPromptGetResponse {
        layers,
        system_prompt,
        stable_prefix: stable,
        surface_digest,
    }
}
