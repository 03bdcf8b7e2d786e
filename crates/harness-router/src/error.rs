//! Errors: provider failures (classified for the loop) and router setup errors.
//!
//! Every provider failure is one of five kinds the loop acts on (`auth_expired`, `rate_limited`,
//! `context_overflow`, `transient`, `permanent`), carries one public sentence (`message`, safe to
//! show anyone) and the raw diagnostic (`detail`: status, the provider's error type and text,
//! its request id). Credentials never reach either: [`redact`] runs over every provider text.

use std::sync::OnceLock;
use std::time::Duration;

use harness_types::message::ErrorKind;
use harness_types::HarnessError;
use regex::Regex;
use serde_json::Value;

/// A provider failure before or during a stream.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProviderError {
    /// `router/<code>`.
    pub code: String,
    pub kind: ErrorKind,
    /// One public sentence.
    pub message: String,
    /// The raw diagnostic, credentials redacted.
    pub detail: Option<String>,
    /// How long the provider asked us to wait before trying again.
    pub retry_after: Option<Duration>,
    /// What the provider answered and what to do about it (boxed: keeps the error small).
    pub cause: Box<Cause>,
}

/// The parts of a failure an API client gets as fields of their own.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cause {
    /// The HTTP status of an error answer.
    pub status: Option<u16>,
    /// The provider's own words (its error message, else its body), bounded and redacted.
    pub provider_message: Option<String>,
    /// What a person can do about it, where that is known (kept out of `detail`;
    /// [`ProviderError::diagnostic`] adds it back).
    pub hint: Option<String>,
}

impl ProviderError {
    /// A failure of `kind` with the standard public sentence and code `router/<kind>`.
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> Self {
        ProviderError {
            code: format!("router/{}", kind.as_str()),
            kind,
            message: summary(kind).to_string(),
            detail: Some(detail.into()),
            retry_after: None,
            cause: Box::default(),
        }
    }

    pub fn with_code(mut self, code: &str) -> Self {
        self.code = format!("router/{code}");
        self
    }

    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// The diagnostic when there is one, else the public sentence; with the hint.
    pub fn diagnostic(&self) -> String {
        explained(
            self.detail.as_deref().unwrap_or(&self.message),
            self.cause.hint.as_deref(),
        )
    }
}

impl From<ProviderError> for HarnessError {
    fn from(e: ProviderError) -> Self {
        HarnessError::dependency(e.to_string())
    }
}

/// A diagnostic followed by its hint, as people read them (the router's own texts and
/// `harness chat` both use it).
pub fn explained(diagnostic: &str, hint: Option<&str>) -> String {
    match hint {
        Some(h) => format!("{diagnostic} (hint: {h})"),
        None => diagnostic.to_string(),
    }
}

/// The public sentence of a kind: the same one a turn that failed on it reports.
pub fn summary(kind: ErrorKind) -> &'static str {
    harness_types::router::error_summary(kind)
}

/// Router setup errors (configuration, catalog).
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("router config {path}: {why}")]
    Config { path: String, why: String },
    #[error("model catalog {source_name}: {why}")]
    Catalog { source_name: String, why: String },
    #[error("unknown OpenAI-compatible preset '{0}' (known: ollama, llamacpp, vllm, lmstudio)")]
    UnknownPreset(String),
}

fn secret_patterns() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(
            r#"(?i)(\bsk-[a-z0-9_\-*]{6,}|bearer\s+[^\s"',]+|x-api-key["']?\s*[:=]\s*["']?[^\s"',]+|api[_-]?key["']?\s*[:=]\s*["']?[^\s"',]+)"#,
        )
        .expect("secret pattern")
    })
}

/// The most of a provider's own words an error carries.
pub const MAX_PROVIDER_MESSAGE: usize = 500;

/// `text` redacted, then cut to [`MAX_PROVIDER_MESSAGE`] characters (redacting first, so a cut
/// never leaves the start of a credential that the patterns would no longer see whole).
pub fn provider_words(text: &str, secrets: &[String]) -> Option<String> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let clean = redact(text, secrets);
    let mut cut: String = clean.chars().take(MAX_PROVIDER_MESSAGE).collect();
    if cut.len() < clean.len() {
        cut.push('…');
    }
    Some(cut)
}

/// Removes credentials from `text`: the configured `secrets` verbatim, and anything shaped like
/// an API key or an auth header.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut out = text.to_string();
    for s in secrets {
        if s.len() >= 4 && out.contains(s.as_str()) {
            out = out.replace(s.as_str(), "[redacted]");
        }
    }
    secret_patterns()
        .replace_all(&out, "[redacted]")
        .into_owned()
}

/// The parts of a provider's error body, whatever the API.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ApiErrorBody {
    /// Anthropic `error.type`, OpenAI `error.type`.
    pub error_type: Option<String>,
    /// OpenAI `error.code` (a string, or a number on some local servers).
    pub code: Option<String>,
    pub message: Option<String>,
}

fn as_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Reads `{"type":"error","error":{"type","message"}}` (Anthropic), `{"error":{"message","type",
/// "code"}}` (OpenAI, llama.cpp, vLLM), `{"error":"text"}` (Ollama) and the Responses API's
/// `{"code","message"}` error events.
pub fn parse_error_body(v: &Value) -> ApiErrorBody {
    let err = v.get("error").unwrap_or(v);
    if let Value::String(s) = err {
        return ApiErrorBody {
            message: Some(s.clone()),
            ..ApiErrorBody::default()
        };
    }
    let error_type = err.get("type").and_then(as_text);
    ApiErrorBody {
        // The top-level `{"type": "error"}` wrapper is not the error's type.
        error_type: error_type.filter(|t| t != "error"),
        code: err.get("code").and_then(as_text),
        message: err
            .get("message")
            .and_then(as_text)
            .or_else(|| err.get("detail").and_then(as_text)),
    }
}

fn overflow_wording() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(
            r"(?i)(prompt is too long|context[ _-]length|context[ _-]window|maximum context|exceeds? (the )?(available )?context|context size|input is too long|too many (input )?tokens|reduce the length of the (messages|input))",
        )
        .expect("overflow pattern")
    })
}

fn is_overflow(body: &ApiErrorBody) -> bool {
    let ids = [body.error_type.as_deref(), body.code.as_deref()];
    ids.iter().flatten().any(|t| {
        matches!(
            *t,
            "context_length_exceeded" | "exceed_context_size_error" | "request_too_large"
        )
    }) || body
        .message
        .as_deref()
        .is_some_and(|m| overflow_wording().is_match(m))
}

fn is_quota(body: &ApiErrorBody) -> bool {
    [body.error_type.as_deref(), body.code.as_deref()]
        .iter()
        .flatten()
        .any(|t| matches!(*t, "insufficient_quota" | "billing_error"))
}

fn is_validation(body: &ApiErrorBody) -> bool {
    body.message
        .as_deref()
        .is_some_and(|m| m.contains("validation error"))
}

fn describe(prefix: &str, body: &ApiErrorBody, raw: &str, request_id: Option<&str>) -> String {
    let mut s = prefix.to_string();
    let label = body.error_type.as_deref().or(body.code.as_deref());
    if let Some(t) = label {
        s.push_str(&format!(" ({t})"));
    }
    match &body.message {
        Some(m) => s.push_str(&format!(": {m}")),
        None if !raw.trim().is_empty() => {
            let cut: String = raw.trim().chars().take(500).collect();
            s.push_str(&format!(": {cut}"));
        }
        None => {}
    }
    if let Some(id) = request_id {
        s.push_str(&format!(" [request-id {id}]"));
    }
    s
}

/// Classifies an HTTP error answer. `body` is the raw response text.
pub fn classify_http(
    status: u16,
    body: &str,
    retry_after: Option<Duration>,
    request_id: Option<&str>,
    secrets: &[String],
) -> ProviderError {
    let parsed = serde_json::from_str::<Value>(body)
        .map(|v| parse_error_body(&v))
        .unwrap_or_default();
    let detail = redact(
        &describe(&format!("HTTP {status}"), &parsed, body, request_id),
        secrets,
    );
    let mut err = match status {
        401 | 403 => ProviderError::new(ErrorKind::AuthExpired, detail),
        429 if is_quota(&parsed) => ProviderError::new(ErrorKind::Permanent, detail)
            .with_code("quota_exceeded")
            .with_message("The provider account has no quota left."),
        429 => ProviderError::new(ErrorKind::RateLimited, detail),
        413 => ProviderError::new(ErrorKind::ContextOverflow, detail),
        400 | 404 | 422 if is_overflow(&parsed) => {
            ProviderError::new(ErrorKind::ContextOverflow, detail)
        }
        404 => ProviderError::new(ErrorKind::Permanent, detail)
            .with_code("not_found")
            .with_message("The provider does not know this model or endpoint."),
        // Some servers answer a request their schema rejects with a 500; sending it again
        // cannot help.
        500 if is_validation(&parsed) => {
            ProviderError::new(ErrorKind::Permanent, detail).with_code("invalid_request")
        }
        408 | 409 | 425 | 500..=599 => ProviderError::new(ErrorKind::Transient, detail),
        _ => ProviderError::new(ErrorKind::Permanent, detail),
    };
    err.retry_after = retry_after;
    err.cause.status = Some(status);
    err.cause.provider_message = provider_words(parsed.message.as_deref().unwrap_or(body), secrets);
    err
}

/// Classifies an error reported inside a stream, by its type or code (unknown ones are
/// transient: a stream that broke mid-way is the server's trouble, not the request's).
pub fn classify_stream(body: &ApiErrorBody, secrets: &[String]) -> ProviderError {
    let mut err = classify_stream_kind(body, secrets);
    err.cause.provider_message = body
        .message
        .as_deref()
        .and_then(|m| provider_words(m, secrets));
    err
}

fn classify_stream_kind(body: &ApiErrorBody, secrets: &[String]) -> ProviderError {
    let detail = redact(&describe("stream error", body, "", None), secrets);
    if is_overflow(body) {
        return ProviderError::new(ErrorKind::ContextOverflow, detail);
    }
    if is_quota(body) {
        return ProviderError::new(ErrorKind::Permanent, detail)
            .with_code("quota_exceeded")
            .with_message("The provider account has no quota left.");
    }
    let t = body
        .error_type
        .as_deref()
        .or(body.code.as_deref())
        .unwrap_or("");
    let kind = match t {
        "authentication_error" | "permission_error" | "invalid_api_key" => ErrorKind::AuthExpired,
        "rate_limit_error" | "rate_limit_exceeded" | "rate_limited" => ErrorKind::RateLimited,
        "invalid_request_error" | "invalid_prompt" | "not_found_error" | "invalid_request" => {
            ErrorKind::Permanent
        }
        _ => ErrorKind::Transient,
    };
    ProviderError::new(kind, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies_classify() {
        let k = |status, body: &str| classify_http(status, body, None, None, &[]).kind;
        assert_eq!(k(401, "{}"), ErrorKind::AuthExpired);
        assert_eq!(
            k(
                429,
                r#"{"error":{"type":"rate_limit_error","message":"slow down"}}"#
            ),
            ErrorKind::RateLimited
        );
        assert_eq!(
            k(
                429,
                r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#
            ),
            ErrorKind::Permanent
        );
        assert_eq!(
            k(
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 208656 tokens > 200000 maximum"}}"#
            ),
            ErrorKind::ContextOverflow
        );
        assert_eq!(
            k(
                400,
                r#"{"error":{"message":"This model's maximum context length is 128000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#
            ),
            ErrorKind::ContextOverflow
        );
        assert_eq!(
            k(
                400,
                r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}}"#
            ),
            ErrorKind::ContextOverflow
        );
        assert_eq!(
            k(
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: 10000 > 4096, which is the maximum allowed number of output tokens"}}"#
            ),
            ErrorKind::Permanent
        );
        assert_eq!(
            k(
                529,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            ErrorKind::Transient
        );
        assert_eq!(k(500, "oops"), ErrorKind::Transient);
        assert_eq!(
            k(404, r#"{"error":"model 'x' not found"}"#),
            ErrorKind::Permanent
        );
    }

    #[test]
    fn details_name_the_error_and_never_a_key() {
        let e = classify_http(
            401,
            r#"{"error":{"message":"Incorrect API key provided: sk-proj-abcdef123456. You can find your API key at ...","type":"invalid_request_error","code":"invalid_api_key"}}"#,
            None,
            Some("req_1"),
            &["sk-proj-abcdef123456".into()],
        );
        let d = e.detail.unwrap();
        assert!(
            d.starts_with("HTTP 401 (invalid_request_error): Incorrect API key"),
            "{d}"
        );
        assert!(d.contains("[request-id req_1]"));
        assert!(!d.contains("abcdef123456"), "{d}");
        assert_eq!(e.message, "The provider rejected the credentials.");
        assert_eq!(
            redact(
                "Authorization: Bearer abc.def and x-api-key: sk-ant-api03-zzz",
                &[]
            ),
            "Authorization: [redacted] and [redacted]"
        );
    }

    #[test]
    fn the_providers_words_are_kept_bounded_and_without_credentials() {
        let key = "k3y-0f-the-operator".to_string();
        let body = format!(
            r#"{{"error":{{"message":"no such route; you sent {key} and Bearer abc.def {}","type":"not_found"}}}}"#,
            "x".repeat(2000)
        );
        let e = classify_http(404, &body, None, None, std::slice::from_ref(&key));
        assert_eq!(e.cause.status, Some(404));
        let words = e.cause.provider_message.expect("the provider's words");
        assert!(
            words.starts_with("no such route; you sent [redacted] and [redacted] xxx"),
            "{words}"
        );
        assert_eq!(
            words.chars().count(),
            MAX_PROVIDER_MESSAGE + 1,
            "cut, and marked so"
        );
        assert!(words.ends_with('…'));
        // A body that is not JSON is the provider's words as it is.
        let e = classify_http(502, "  Bad gateway  ", None, None, &[]);
        assert_eq!(e.cause.provider_message.as_deref(), Some("Bad gateway"));
        assert_eq!(
            classify_http(500, "", None, None, &[])
                .cause
                .provider_message,
            None
        );
        // In a stream, the error's message.
        let e = classify_stream(
            &ApiErrorBody {
                error_type: Some("overloaded_error".into()),
                code: None,
                message: Some(format!("busy, {key}")),
            },
            std::slice::from_ref(&key),
        );
        assert_eq!(
            e.cause.provider_message.as_deref(),
            Some("busy, [redacted]")
        );
        assert_eq!(e.cause.status, None);
    }

    #[test]
    fn stream_errors_classify_by_type() {
        let b = |t: &str| ApiErrorBody {
            error_type: Some(t.into()),
            code: None,
            message: Some("m".into()),
        };
        for (error_type, kind) in [
            ("overloaded_error", ErrorKind::Transient),
            ("rate_limit_error", ErrorKind::RateLimited),
            ("authentication_error", ErrorKind::AuthExpired),
            ("invalid_request_error", ErrorKind::Permanent),
            ("context_length_exceeded", ErrorKind::ContextOverflow),
        ] {
            assert_eq!(
                classify_stream(&b(error_type), &[]).kind,
                kind,
                "{error_type}"
            );
        }
    }
}
