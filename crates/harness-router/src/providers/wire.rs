//! Small pieces every adapter needs when it builds a request.

use harness_types::message::ContentBlock;
use harness_types::router::{ChatAck, ChatRequest, Frame};
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

use crate::error::{classify_stream, parse_error_body, ProviderError};
use crate::http::{client, run, Decoder, Transport};
use crate::names::ToolNames;
use crate::providers::{is_loopback, ProviderConfig};
use crate::router::{ChatContext, FrameWriter};

/// What an adapter's `body` answers: the request body, the name table for mapping tool names
/// back, and warnings for the caller.
pub(crate) type Built = Result<(Value, ToolNames, Vec<String>), ProviderError>;

/// What a stream decoder knows of its call besides the events: the name table, the secrets an
/// in-stream error is scrubbed of, and the model and provider its start frame names.
#[derive(Clone)]
pub(crate) struct Call {
    pub(crate) names: ToolNames,
    pub(crate) secrets: Vec<String>,
    pub(crate) model: String,
    pub(crate) provider: String,
}

impl Call {
    pub(crate) fn start(&self) -> Frame {
        Frame::Start {
            model: Some(self.model.clone()),
            provider: Some(self.provider.clone()),
        }
    }

    /// An error event of the stream (its JSON `v`), classified and scrubbed.
    pub(crate) fn error(&self, v: &Value) -> ProviderError {
        classify_stream(&parse_error_body(v), &self.secrets)
    }
}

/// A stream event that does not parse as the API promises (`what`: the API's word for it).
/// Transient: the next attempt usually reads a whole one.
pub(crate) fn malformed(what: &str, data: &str) -> ProviderError {
    let cut: String = data.chars().take(200).collect();
    ProviderError::new(
        harness_types::ErrorKind::Transient,
        format!("malformed {what} from the provider: {cut}"),
    )
    .with_code("malformed_stream")
}

impl Transport {
    /// One streamed call of this provider: a body that could not be built fails the call;
    /// else its warnings go out first, then `request` (which may still refuse, e.g. without a
    /// key) is sent and retried by [`run`], every attempt with a fresh decoder from `decoder`.
    pub(crate) async fn stream<D, R>(
        &self,
        model: &str,
        built: Built,
        mut out: FrameWriter,
        cancel: CancellationToken,
        request: impl FnOnce(&Value) -> Result<R, ProviderError>,
        decoder: impl Fn(Call) -> D,
    ) -> ChatAck
    where
        D: Decoder,
        R: Fn() -> reqwest::RequestBuilder + Send + Sync,
    {
        let (body, names, warnings) = match built {
            Ok(b) => b,
            Err(e) => return out.fail(&e),
        };
        for w in warnings {
            out.warn(w);
        }
        let request = match request(&body) {
            Ok(r) => r,
            Err(e) => return out.fail(&e),
        };
        let call = Call {
            names,
            secrets: self.secrets.clone(),
            model: model.to_string(),
            provider: self.provider.clone(),
        };
        run(self, &request, || decoder(call.clone()), out, cancel).await
    }

    /// The request of an OpenAI-style streaming call: a JSON POST asking for an event stream,
    /// with the key (if any) as a bearer token. A closure, because [`run`] sends it again on a
    /// retry.
    pub(crate) fn bearer_sse_post(
        &self,
        url: String,
        body: &Value,
        key: &Option<crate::providers::Secret>,
    ) -> impl Fn() -> reqwest::RequestBuilder {
        let client = self.client.clone();
        let key = key.clone();
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
}

/// `prompt_cache_key` for OpenAI: the digest of the stable prompt surface, when the caller
/// gave one, so requests sharing that prefix land on the same cache.
pub(crate) fn prompt_cache_key(ctx: &ChatContext) -> Option<&String> {
    ctx.extras
        .cache_intent
        .as_ref()
        .and_then(|c| c.surface_digest.as_ref())
}

/// A tool-name collision is the caller's to fix: a permanent failure.
pub(crate) fn collision(e: crate::names::NameCollision) -> ProviderError {
    ProviderError::new(harness_types::ErrorKind::Permanent, e.to_string())
        .with_code("tool_name_collision")
}

/// The request's tools in the API's shape, and the name table that maps a call's name back to
/// its function id: `shape` makes one of an API-valid name and an object schema; the
/// description, if any, goes into the object `describe` picks out of it.
pub(crate) fn mapped_tools(
    req: &ChatRequest,
    shape: impl Fn(String, Value) -> Value,
    describe: impl Fn(&mut Value) -> &mut Value,
) -> Result<(ToolNames, Vec<Value>), ProviderError> {
    let mut names = ToolNames::default();
    let mut out = Vec::with_capacity(req.tools.len());
    for t in &req.tools {
        let mut schema = args_object(&t.parameters);
        if schema.get("type").is_none() {
            schema["type"] = Value::String("object".into());
        }
        let mut tool = shape(names.add(&t.name).map_err(collision)?, schema);
        if !t.description.is_empty() {
            describe(&mut tool)["description"] = json!(t.description);
        }
        out.push(tool);
    }
    Ok((names, out))
}

/// The transport of a provider: one pooled client, its retry policy, its key as a secret.
pub(crate) fn transport(cfg: &ProviderConfig) -> Transport {
    let mut builder = reqwest::Client::builder()
        .connect_timeout(cfg.http.connect_timeout)
        .pool_idle_timeout(std::time::Duration::from_secs(60));
    if is_loopback(&cfg.base_url) {
        // A proxy from the environment must never see (or break) traffic to this machine.
        builder = builder.no_proxy();
    }
    Transport {
        provider: cfg.id.clone(),
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
