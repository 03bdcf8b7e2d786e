//! Small pieces every adapter needs when it builds a request.

use harness_types::message::ContentBlock;
use harness_types::router::ChatRequest;
use serde_json::{Map, Value};

use crate::http::{client, Transport};
use crate::providers::{is_loopback, ProviderConfig};
use crate::router::ChatContext;

/// The transport of a provider: one pooled client, its retry policy, its key as a secret.
/// The request of an OpenAI-style streaming call: a JSON POST asking for an event stream, with
/// the key (if any) as a bearer token. A closure, because the driver sends it again on a retry.
pub(crate) fn bearer_sse_post(
    client: reqwest::Client,
    url: String,
    body: &Value,
    key: Option<crate::providers::Secret>,
) -> impl Fn() -> reqwest::RequestBuilder {
    let bytes = bytes::Bytes::from(body.to_string());
    move || {
        let rb = client
            .post(&url)
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .body(bytes.clone());
        match &key {
            Some(k) => rb.bearer_auth(k.expose()),
            None => rb,
        }
    }
}

/// A tool-name collision is the caller's to fix: a permanent failure.
pub(crate) fn collision(e: crate::names::NameCollision) -> crate::error::ProviderError {
    crate::error::ProviderError::new(harness_types::ErrorKind::Permanent, e.to_string())
        .with_code("tool_name_collision")
}

/// The request's tools as every API wants them: an API-valid name (recorded in `names`, so a
/// call maps back to its function id), an object schema, and the description if any.
pub(crate) fn mapped_tools(
    req: &ChatRequest,
    names: &mut crate::names::ToolNames,
) -> Result<Vec<(String, Value, Option<String>)>, crate::error::ProviderError> {
    let mut out = Vec::with_capacity(req.tools.len());
    for t in &req.tools {
        let mut schema = args_object(&t.parameters);
        if schema.get("type").is_none() {
            schema["type"] = Value::String("object".into());
        }
        let description = (!t.description.is_empty()).then(|| t.description.clone());
        out.push((names.add(&t.name).map_err(collision)?, schema, description));
    }
    Ok(out)
}

pub(crate) fn transport(cfg: &ProviderConfig) -> Transport {
    let mut builder = reqwest::Client::builder()
        .connect_timeout(cfg.http.connect_timeout)
        .pool_idle_timeout(std::time::Duration::from_secs(60));
    if is_loopback(&cfg.base_url) {
        // A proxy from the environment must never see (or break) traffic to this machine.
        builder = builder.no_proxy();
    }
    Transport {
        client: builder
            .build()
            .unwrap_or_else(|_| client(cfg.http.connect_timeout)),
        policy: cfg.http.retry.clone(),
        idle_timeout: cfg.http.idle_timeout,
        secrets: cfg.api_key.iter().map(|k| k.expose().to_string()).collect(),
        base_url: crate::providers::public_url(&cfg.base_url),
        url_variable: cfg.url_variable(),
        compatible: cfg.kind == crate::providers::ProviderKind::OpenaiCompatible,
    }
}

/// `provider_options.<id>` for the first of `ids` present (options are namespaced by provider
/// id or API family, e.g. `{"anthropic": {"top_k": 5}}`).
pub(crate) fn namespaced<'a>(req: &'a ChatRequest, ids: &[&str]) -> Option<&'a Map<String, Value>> {
    let opts = req.provider_options.as_ref()?.as_object()?;
    ids.iter().find_map(|id| opts.get(*id)?.as_object())
}

/// Copies provider options into the body, except the keys the adapter owns.
pub(crate) fn merge_options(
    body: &mut Value,
    opts: Option<&Map<String, Value>>,
    reserved: &[&str],
) {
    let (Some(opts), Some(obj)) = (opts, body.as_object_mut()) else {
        return;
    };
    for (k, v) in opts {
        if !reserved.contains(&k.as_str()) {
            obj.insert(k.clone(), v.clone());
        }
    }
}

/// The text of a function result (text blocks, one per line; other blocks named).
pub(crate) fn result_text(content: &[ContentBlock]) -> String {
    let parts: Vec<String> = content
        .iter()
        .map(|b| match b {
            ContentBlock::Text { text } => text.clone(),
            ContentBlock::Image { mime, .. } => format!("[image {mime} omitted]"),
            other => serde_json::to_string(other).unwrap_or_default(),
        })
        .collect();
    parts.join("\n")
}

/// Call arguments as a JSON object (the APIs require one).
pub(crate) fn args_object(v: &Value) -> Value {
    match v {
        Value::Object(_) => v.clone(),
        Value::Null => Value::Object(Map::new()),
        other => serde_json::json!({ "value": other }),
    }
}

/// The output budget: the caller's, clamped to the model's limit; else `fallback` clamped the
/// same way. Never more than the whole context window (a local model's window may be smaller
/// than the catch-all row's output limit).
pub(crate) fn max_output(req: &ChatRequest, ctx: &ChatContext, fallback: u64) -> u64 {
    let limit = ctx.model.as_ref().map(|m| match m.context_window {
        0 => m.max_output_tokens,
        w => m.max_output_tokens.min(w),
    });
    let wanted = req.max_output_tokens.map(u64::from).unwrap_or(fallback);
    match limit {
        Some(l) if l > 0 => wanted.min(l),
        _ => wanted,
    }
    .max(1)
}

/// A `data:` URL of an image block.
pub(crate) fn data_url(mime: &str, data: &str) -> String {
    format!("data:{mime};base64,{data}")
}
