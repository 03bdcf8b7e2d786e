//! The part every HTTP provider shares: send the request, classify an error answer, parse the
//! SSE body into events for the provider's decoder, retry the start, honour an abort.
//!
//! A provider adapter is then only "build the request body" plus a [`Decoder`] that turns its
//! API's events into frames.

use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use harness_types::message::{ErrorKind, StopReason};
use harness_types::router::ChatAck;
use tokio_util::sync::CancellationToken;

use crate::error::{classify_http, classify_stream, parse_error_body, redact, ProviderError};
use crate::retry::{retry_after, RetryPolicy};
use crate::router::FrameWriter;
use crate::sse::{SseEvent, SseParser};

/// What a decoder says after an event.
pub(crate) enum Flow {
    Continue,
    /// The provider signalled the end of the message.
    End,
}

/// Turns one API's stream events into frames.
pub(crate) trait Decoder: Send {
    fn event(&mut self, ev: &SseEvent, out: &mut FrameWriter) -> Result<Flow, ProviderError>;

    /// The body ended without the API's end event: is what arrived a whole message anyway?
    /// (Some OpenAI-compatible servers close the stream without `[DONE]`.)
    fn complete_at_eof(&self) -> bool {
        false
    }

    /// The stop reason (and the API's own word for it) once the message ended.
    fn finish(&mut self, out: &mut FrameWriter) -> (StopReason, Option<String>);

    /// A whole reply as one JSON document (a request sent with `stream: false`), folded into
    /// the same frames; `None` when the API has no such answer or `v` is not one.
    fn whole(
        &mut self,
        _v: &serde_json::Value,
        _out: &mut FrameWriter,
    ) -> Option<Result<(StopReason, Option<String>), ProviderError>> {
        None
    }
}

/// Connection settings shared by a provider's requests.
pub(crate) struct Transport {
    /// The provider id the requests go out for.
    pub provider: String,
    pub client: reqwest::Client,
    pub policy: RetryPolicy,
    /// No byte for this long mid-stream = a stalled stream (transient).
    pub idle_timeout: Duration,
    /// Strings that must never appear in an error (the API key).
    pub secrets: Vec<String>,
    /// The provider's base URL (credentials stripped), for hints.
    pub base_url: String,
    /// The environment variable that sets it, if any (for hints).
    pub url_variable: Option<String>,
    /// A Chat Completions server of someone's choice: its base URL usually ends in `/v1`.
    pub compatible: bool,
}

impl Transport {
    /// Says what a person can do about `err`, where that is obvious. The one place hints are
    /// written: `harness chat` prints this field and the API carries it as `failure.hint`.
    pub(crate) fn hint(&self, err: &mut ProviderError) {
        if let Some(h) = hint(self, err) {
            err.cause.hint = Some(h);
        }
    }
}

fn hint(t: &Transport, err: &ProviderError) -> Option<String> {
    let detail = err.diagnostic().to_ascii_lowercase();
    let set = |what: &str| match &t.url_variable {
        Some(var) => format!("{what}, or set {var} to where it listens"),
        None => what.to_string(),
    };
    if err.code == "router/connect_failed" {
        return Some(set(&format!(
            "nothing answers at {}: start the server",
            t.base_url
        )));
    }
    if !detail.starts_with("http 404") && err.code != "router/not_found" {
        return None;
    }
    let model_words = ["model", "not found"];
    if model_words.iter().all(|w| detail.contains(w)) && !detail.contains("endpoint") {
        return Some(
            "the server does not know this model; `harness call router::models::list '{\"provider\": \"<id>\"}'` lists the ones it serves".into(),
        );
    }
    let path = reqwest::Url::parse(&t.base_url)
        .map(|u| u.path().trim_end_matches('/').to_string())
        .unwrap_or_default();
    if t.compatible && !path.ends_with("/v1") {
        return Some(set(&format!(
            "OpenAI-compatible servers serve under /v1: try {}/v1 as the base URL",
            t.base_url
        )));
    }
    None
}

/// The largest error body read for a diagnostic.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// The largest reply read when a request was sent without streaming.
const MAX_WHOLE_BODY: usize = 16 * 1024 * 1024;

pub(crate) fn client(connect_timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// A transport failure (no HTTP answer), with the URL's host only: paths and query strings stay
/// out of diagnostics.
pub(crate) fn transport_error(e: &reqwest::Error, secrets: &[String]) -> ProviderError {
    let host = e
        .url()
        .map(|u| {
            format!(
                "{}:{}",
                u.host_str().unwrap_or("?"),
                u.port_or_known_default().unwrap_or(0)
            )
        })
        .unwrap_or_default();
    let what = if e.is_connect() {
        "cannot connect to"
    } else if e.is_timeout() {
        "timed out talking to"
    } else if e.is_builder() {
        "invalid request for"
    } else {
        "request failed to"
    };
    let mut why = String::new();
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(s) = source {
        why = s.to_string();
        source = s.source();
    }
    let detail = redact(
        &format!(
            "{what} {host}{}",
            if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            }
        ),
        secrets,
    );
    let kind = if e.is_builder() {
        ErrorKind::Permanent
    } else {
        ErrorKind::Transient
    };
    ProviderError::new(kind, detail).with_code(if e.is_connect() {
        "connect_failed"
    } else {
        kind.as_str()
    })
}

async fn read_limited(resp: reqwest::Response, idle: Duration, limit: usize) -> String {
    let mut body = resp.bytes_stream();
    let mut buf = Vec::new();
    while buf.len() < limit {
        match tokio::time::timeout(idle, body.next()).await {
            Ok(Some(Ok(chunk))) => buf.extend_from_slice(&chunk),
            _ => break,
        }
    }
    buf.truncate(limit);
    String::from_utf8_lossy(&buf).into_owned()
}

fn request_id(headers: &reqwest::header::HeaderMap) -> Option<String> {
    ["request-id", "x-request-id"]
        .iter()
        .find_map(|h| headers.get(*h).and_then(|v| v.to_str().ok()))
        .map(str::to_string)
}

async fn attempt<D: Decoder>(
    t: &Transport,
    request: &(dyn Fn() -> reqwest::RequestBuilder + Send + Sync),
    decoder: &mut D,
    out: &mut FrameWriter,
) -> Result<(StopReason, Option<String>), ProviderError> {
    let resp = request()
        .send()
        .await
        .map_err(|e| transport_error(&e, &t.secrets))?;
    let status = resp.status();
    if !status.is_success() {
        let wait = retry_after(resp.headers(), SystemTime::now());
        let rid = request_id(resp.headers());
        let body = read_limited(resp, t.idle_timeout, MAX_ERROR_BODY).await;
        return Err(classify_http(
            status.as_u16(),
            &body,
            wait,
            rid.as_deref(),
            &t.secrets,
        ));
    }
    let content_type = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if content_type.starts_with("application/json") {
        // A reply to a request sent without streaming, or an error delivered with 200 (some
        // proxies and local servers do this).
        let body = read_limited(resp, t.idle_timeout, MAX_WHOLE_BODY).await;
        let parsed = serde_json::from_str::<serde_json::Value>(&body).ok();
        if let Some(v) = parsed.as_ref().filter(|v| v.get("error").is_none()) {
            if let Some(r) = decoder.whole(v, out) {
                return r;
            }
        }
        return Err(match parsed {
            Some(v) if v.get("error").is_some() => {
                classify_stream(&parse_error_body(&v), &t.secrets)
            }
            _ => ProviderError::new(
                ErrorKind::Permanent,
                "the provider answered JSON where an event stream was expected",
            )
            .with_code("not_streaming"),
        });
    }
    let mut body = resp.bytes_stream();
    let mut parser = SseParser::new();
    let mut events: Vec<SseEvent> = Vec::new();
    let mut any_event = false;
    loop {
        let chunk = match tokio::time::timeout(t.idle_timeout, body.next()).await {
            Err(_) => {
                return Err(ProviderError::new(
                    ErrorKind::Transient,
                    format!(
                        "the stream stalled: no data for {} s",
                        t.idle_timeout.as_secs_f64()
                    ),
                )
                .with_code("stream_stalled"))
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                let mut why = e.to_string();
                if let Some(s) = std::error::Error::source(&e) {
                    why = format!("{why}: {s}");
                }
                return Err(ProviderError::new(
                    ErrorKind::Transient,
                    redact(&format!("the stream broke: {why}"), &t.secrets),
                )
                .with_code("stream_interrupted"));
            }
            Ok(Some(Ok(chunk))) => chunk,
        };
        parser.push(&chunk, &mut events).map_err(|e| {
            ProviderError::new(ErrorKind::Transient, e.to_string()).with_code("malformed_stream")
        })?;
        for ev in events.drain(..) {
            any_event = true;
            if let Flow::End = decoder.event(&ev, out)? {
                return Ok(decoder.finish(out));
            }
        }
    }
    if !parser.mid_event() && decoder.complete_at_eof() {
        return Ok(decoder.finish(out));
    }
    if !any_event && !parser.mid_event() {
        // A server that fails on a request after it answered 200 (llama-cpp-python raises its
        // errors inside the stream) closes the body without a single event and without saying
        // why; the same request would fail the same way, so this is not retried. Recorded from
        // llama-cpp-python, the cause is a prompt over its window: an overflow, which the loop
        // treats as one (not a fault of the server).
        return Err(ProviderError::new(
            ErrorKind::ContextOverflow,
            "the server answered 200 and closed the stream without sending anything: it failed on this request after accepting it (its log says why; a prompt longer than the context window it runs with is the usual cause: see --context-window)",
        )
        .with_code("empty_stream")
        .with_message("The provider failed on this request without saying why."));
    }
    Err(ProviderError::new(
        ErrorKind::Transient,
        "the stream ended before the provider finished the message",
    )
    .with_code("stream_interrupted"))
}

/// Runs a streamed request to its end: retries failures that happen before any output (bounded
/// attempts and total wait, `retry-after` honoured), ends with exactly one terminal frame, and
/// answers an abort at any point (also during a wait) with `done` + `stop_reason: aborted`.
pub(crate) async fn run<D: Decoder>(
    t: &Transport,
    request: &(dyn Fn() -> reqwest::RequestBuilder + Send + Sync),
    new_decoder: impl Fn() -> D,
    mut out: FrameWriter,
    cancel: CancellationToken,
) -> ChatAck {
    let mut waited = Duration::ZERO;
    let started = Instant::now();
    let mut n = 0u32;
    loop {
        n += 1;
        let mut decoder = new_decoder();
        let result = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            r = attempt(t, request, &mut decoder, &mut out) => Some(r),
        };
        let mut err = match result {
            None => return out.aborted(),
            Some(Ok((stop, native))) => return out.complete(stop, native),
            Some(Err(e)) => e,
        };
        let note = |err: &mut ProviderError, why: String| {
            let d = err.detail.as_deref().unwrap_or(&err.message);
            err.detail = Some(format!("{d} ({why})"));
        };
        t.hint(&mut err);
        if out.has_output() || !err.kind.retryable() || n >= t.policy.max_attempts.max(1) {
            if n > 1 {
                note(
                    &mut err,
                    format!(
                        "attempt {n}, {} ms after the first",
                        started.elapsed().as_millis()
                    ),
                );
            }
            return out.fail(&err);
        }
        let wait = t.policy.delay(n, err.retry_after);
        if waited + wait > Duration::from_millis(t.policy.max_total_wait_ms) {
            note(
                &mut err,
                format!(
                    "not retried: the wait of {} ms exceeds the retry budget",
                    wait.as_millis()
                ),
            );
            return out.fail(&err);
        }
        tracing::info!(
            code = %err.code,
            attempt = n,
            wait_ms = wait.as_millis() as u64,
            "provider failed before any output; retrying"
        );
        out.restart();
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return out.aborted(),
            _ = tokio::time::sleep(wait) => {}
        }
        waited += wait;
    }
}
