//! The HTTP API: every bus function over `POST /v1/functions/{id}`, the function catalog, a
//! resumable per-session event stream (SSE), and a health check.
//!
//! Every failure is a JSON error `{"error": {"code": "harness/<code>", "message": ...}}` with a
//! matching status; nothing drops a connection silently.
//!
//! The surface is locked ([`Guard`]): whoever reaches it can drive every session, approve held
//! calls and rebind hooks, so a request must prove it is the operator. On a loopback bind the
//! Host header must name the loopback address we serve (a page that rebinds its DNS name to
//! 127.0.0.1 still sends its own name), a browser `Origin` other than our own is refused, a set
//! token is required on every request, bodies are capped and event streams per client bounded.
//! Exactly one Host is accepted, and an absolute-form target's authority passes the same check
//! and must agree with Host. (Connection-level bounds live in `accept.rs`.)

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures::{Stream, StreamExt};
use harness_bus::{Bus, EmbeddedBus};
use harness_session::SessionStore;
use harness_store::EventRow;
use harness_types::{ErrorCode, HarnessError};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Clone)]
pub struct AppState {
    pub bus: EmbeddedBus,
    pub sessions: SessionStore,
    pub guard: Arc<Guard>,
    /// Serve the web console at `/` (`--no-console` / `console: false` turn it off).
    pub console: bool,
    /// Serve `GET /metrics` from this runtime's registry (`--no-metrics`: `None`, a 404).
    pub metrics: Option<harness_telemetry::Installed>,
}

/// Request body cap when none is configured (a send with a large pasted file fits).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Open event streams per client address when none is configured.
pub const DEFAULT_MAX_STREAMS_PER_CLIENT: usize = 16;

/// What a request must satisfy before it reaches a handler.
pub struct Guard {
    /// SHA-256 of the token: comparing fixed-length digests in constant time leaks neither the
    /// token's bytes nor its length through timing.
    token_digest: Option<[u8; 32]>,
    /// The Host values accepted; `None` off loopback, where the token is the lock.
    hosts: Option<Vec<String>>,
    max_body_bytes: usize,
    max_streams_per_client: usize,
    /// Open event streams by client address. A std Mutex: held only to count.
    streams: Mutex<HashMap<IpAddr, usize>>,
}

/// Why `serve` will not start with the options given.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("harness/unauthorized: --listen {0}: not a loopback address; binding it requires a token (--token or HARNESS_TOKEN)")]
    TokenRequired(SocketAddr),
    #[error("harness/invalid_request: --token: must not be empty")]
    EmptyToken,
    #[error("harness/invalid_request: --max-streams-per-client: must be at least 1")]
    NoStreams,
}

impl Guard {
    pub fn new(
        listen: SocketAddr,
        token: Option<&str>,
        max_body_bytes: usize,
        max_streams_per_client: usize,
    ) -> Result<Guard, GuardError> {
        if token.is_some_and(|t| t.trim().is_empty()) {
            return Err(GuardError::EmptyToken);
        }
        let loopback = listen.ip().is_loopback();
        if !loopback && token.is_none() {
            return Err(GuardError::TokenRequired(listen));
        }
        if max_streams_per_client == 0 {
            return Err(GuardError::NoStreams);
        }
        let hosts = loopback.then(|| {
            let port = listen.port();
            // The bound address itself too (127.0.0.2 is loopback as well).
            let own = match listen.ip() {
                IpAddr::V4(ip) => ip.to_string(),
                IpAddr::V6(ip) => format!("[{ip}]"),
            };
            let mut names = vec!["localhost".to_string(), "127.0.0.1".into(), "[::1]".into()];
            if !names.contains(&own) {
                names.push(own);
            }
            let mut hosts: Vec<String> = names.iter().map(|h| format!("{h}:{port}")).collect();
            // A client leaves the default port out of Host.
            if port == 80 {
                hosts.extend(names);
            }
            hosts
        });
        Ok(Guard {
            token_digest: token.map(digest),
            hosts,
            max_body_bytes,
            max_streams_per_client,
            streams: Mutex::new(HashMap::new()),
        })
    }

    fn token_matches(&self, presented: Option<&str>) -> bool {
        use subtle::ConstantTimeEq;
        match (&self.token_digest, presented) {
            (None, _) => true,
            (Some(want), Some(got)) => bool::from(want.ct_eq(&digest(got))),
            (Some(_), None) => false,
        }
    }

    /// Event streams open now, every client together.
    pub fn open_streams(&self) -> usize {
        self.streams
            .lock()
            .expect("stream count lock")
            .values()
            .sum()
    }

    fn acquire_stream(self: &Arc<Self>, client: IpAddr) -> Option<StreamPermit> {
        let mut streams = self.streams.lock().expect("stream count lock");
        let open = streams.entry(client).or_insert(0);
        if *open >= self.max_streams_per_client {
            return None;
        }
        *open += 1;
        Some(StreamPermit {
            guard: self.clone(),
            client,
        })
    }
}

fn digest(token: &str) -> [u8; 32] {
    harness_types::digest::sha256(token.as_bytes())
}

/// One open event stream; dropping it (the client went away) frees the slot.
struct StreamPermit {
    guard: Arc<Guard>,
    client: IpAddr,
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        let mut streams = self.guard.streams.lock().expect("stream count lock");
        if let Some(open) = streams.get_mut(&self.client) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                streams.remove(&self.client);
            }
        }
    }
}

/// The peer address, as the guard saw it (unspecified when served without connect info).
#[derive(Clone, Copy)]
struct Client(IpAddr);

pub fn router(state: AppState) -> Router {
    let max_body = state.guard.max_body_bytes;
    let console = if state.console {
        crate::console::routes()
    } else {
        Router::new()
    };
    let metrics = match state.metrics {
        Some(_) => Router::new().route("/metrics", get(metrics)),
        None => Router::new(),
    };
    Router::new()
        .merge(console)
        .merge(metrics)
        .route("/healthz", get(healthz))
        .route("/v1/functions", get(list_functions))
        .route("/v1/functions/{function_id}", post(call_function))
        .route("/v1/sessions/{session_id}/events", get(session_events))
        .fallback(|req: Request| async move {
            refusal(
                StatusCode::NOT_FOUND,
                "harness/not_found",
                format!("no route {} {}", req.method(), req.uri().path()),
            )
        })
        .method_not_allowed_fallback(|req: Request| async move {
            refusal(
                StatusCode::METHOD_NOT_ALLOWED,
                "harness/method_not_allowed",
                format!("{} is not allowed on {}", req.method(), req.uri().path()),
            )
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

/// `harness_http_requests_total{route, code}`: the route template, never the path (a path
/// carries session ids), and `unmatched` for what no route took.
async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_string());
    let resp = next.run(req).await;
    if let Some(m) = &state.metrics {
        let route = route.as_deref().unwrap_or("unmatched");
        m.metrics.http_request(route, resp.status().as_u16());
    }
    resp
}

/// The Prometheus scrape: in-memory values only, text format 0.0.4.
async fn metrics(State(state): State<AppState>) -> Response {
    match &state.metrics {
        Some(m) => {
            for queue in [harness_core::TURN_QUEUE, harness_core::DELETION_QUEUE] {
                m.metrics
                    .set_queue_depth(queue, state.bus.queues().depth(queue));
            }
            m.metrics.set_event_streams_open(state.guard.open_streams());
            (
                [(
                    header::CONTENT_TYPE,
                    harness_telemetry::Metrics::CONTENT_TYPE,
                )],
                m.render(),
            )
                .into_response()
        }
        None => refusal(
            StatusCode::NOT_FOUND,
            "harness/not_found",
            "no route GET /metrics",
        ),
    }
}

/// An HTTP-level refusal (no bus code exists for these).
fn refusal(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let mut resp = (
        status,
        Json(json!({"error": {"code": code, "message": message.into()}})),
    )
        .into_response();
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

async fn guard(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let g = &state.guard;
    // Two Host values let a proxy and this server each believe a different one.
    let host_count = req.headers().get_all(header::HOST).iter().count();
    if host_count > 1 {
        return refusal(
            StatusCode::BAD_REQUEST,
            "harness/invalid_request",
            format!("Host: sent {host_count} times; exactly one is allowed"),
        );
    }
    let host_header = req
        .headers()
        .get(header::HOST)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    // An absolute-form target (`GET http://name:port/path`) names a host of its own, which
    // HTTP says wins over Host: it gets the same check, and must agree with Host.
    let target = req.uri().authority().map(|a| a.as_str().to_string());
    let host = host_header.clone().or_else(|| target.clone());
    if let Some(hosts) = &g.hosts {
        for (what, name) in [("Host", &host), ("request target", &target)] {
            let Some(name) = name else { continue };
            if !hosts.iter().any(|a| a.eq_ignore_ascii_case(name)) {
                return refusal(
                    StatusCode::FORBIDDEN,
                    "harness/forbidden_host",
                    format!(
                        "{what}: '{name}' is not this loopback server (expected one of {})",
                        hosts.join(", ")
                    ),
                );
            }
        }
        if host.is_none() {
            return refusal(
                StatusCode::FORBIDDEN,
                "harness/forbidden_host",
                format!(
                    "Host: missing; this loopback server expects one of {}",
                    hosts.join(", ")
                ),
            );
        }
    }
    if let (Some(target), Some(host)) = (&target, &host_header) {
        if !target.eq_ignore_ascii_case(host) {
            return refusal(
                StatusCode::BAD_REQUEST,
                "harness/invalid_request",
                format!("request target: names '{target}' but Host is '{host}'"),
            );
        }
    }
    // A browser page of another origin can send a request without reading the answer (no CORS
    // headers are ever sent); refusing it keeps it from acting at all.
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let same = host.as_deref().is_some_and(|h| {
            origin
                .as_bytes()
                .eq_ignore_ascii_case(format!("http://{h}").as_bytes())
        });
        if !same {
            return refusal(
                StatusCode::FORBIDDEN,
                "harness/forbidden_origin",
                format!(
                    "Origin: '{}' may not call this server",
                    String::from_utf8_lossy(origin.as_bytes())
                ),
            );
        }
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    // The console's files hold no data, and a browser cannot attach a token to a navigation.
    let asset = state.console && crate::console::is_asset_request(req.method(), req.uri().path());
    if !asset && !g.token_matches(presented) {
        return refusal(
            StatusCode::UNAUTHORIZED,
            "harness/unauthorized",
            "Authorization: a valid 'Bearer <token>' is required",
        );
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > g.max_body_bytes as u64) {
        return too_large(g.max_body_bytes);
    }
    let client = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    req.extensions_mut().insert(Client(client));
    next.run(req).await
}

/// `{"ok": true}` while the store can write; `503 {"ok": false, "status": "degraded",
/// "reason": "harness/storage_full: ..."}` while the disk is full (reads still work, writes
/// answer 507 and resume by themselves once there is space).
async fn healthz(State(state): State<AppState>) -> Response {
    match state.bus.store().storage_full() {
        None => Json(json!({"ok": true})).into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "ok": false,
                "status": "degraded",
                "reason": format!("{}: {reason}", ErrorCode::StorageFull.as_str()),
            })),
        )
            .into_response(),
    }
}

fn too_large(limit: usize) -> Response {
    refusal(
        StatusCode::PAYLOAD_TOO_LARGE,
        "harness/too_large",
        format!("body: larger than the {limit}-byte limit"),
    )
}

fn error_response(e: HarnessError) -> Response {
    let status =
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(json!({"error": {"code": e.code.as_str(), "message": e.message}})),
    )
        .into_response()
}

async fn list_functions(State(state): State<AppState>) -> Json<Value> {
    let functions: Vec<Value> = state
        .bus
        .function_defs()
        .into_iter()
        .map(|d| {
            json!({"function_id": d.function_id, "description": d.description,
                   "request_schema": d.request_schema, "response_schema": d.response_schema,
                   "metadata": d.metadata})
        })
        .collect();
    Json(json!({ "functions": functions }))
}

async fn call_function(
    State(state): State<AppState>,
    function_id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let function_id = match function_id {
        Ok(Path(id)) => id,
        Err(e) => return error_response(HarnessError::invalid_field("function_id", e.body_text())),
    };
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return too_large(state.guard.max_body_bytes)
        }
        Err(e) => return error_response(HarnessError::invalid_field("body", e.body_text())),
    };
    let payload: Value = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                return error_response(HarnessError::invalid_field(
                    "body",
                    format!("not valid JSON: {e}"),
                ))
            }
        }
    };
    if function_id == "harness::turn" {
        // Steps run only from the queue; a direct call could overlap a running step.
        return error_response(HarnessError::invalid_field(
            "function_id",
            "harness::turn runs only from the harness-turn queue; use harness::send",
        ));
    }
    // A caller's W3C trace context reaches `harness::send` in this task (a malformed one is
    // ignored there: the turn starts a trace of its own).
    let traceparent = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let call = state.bus.call(&function_id, payload, None);
    let answer = match traceparent {
        Some(tp) => harness_core::trace::with_traceparent(tp, call).await,
        None => call.await,
    };
    match answer {
        Ok(v) => Json(v).into_response(),
        Err(e) => error_response(e.into_harness()),
    }
}

#[derive(Deserialize)]
struct EventsQuery {
    /// Resume after this event id (same as the `Last-Event-ID` header).
    #[serde(default)]
    after: Option<i64>,
}

fn render(sessions: &SessionStore, row: &EventRow) -> Event {
    Event::default()
        .id(row.id.to_string())
        .event(row.topic.clone())
        .data(event_json(sessions, row).to_string())
}

/// One event as the stream sends it: message events carry the entry as it is now.
pub fn event_json(sessions: &SessionStore, row: &EventRow) -> Value {
    let mut data =
        json!({"id": row.id, "topic": row.topic, "at_ms": row.at_ms, "payload": row.payload});
    // Message events carry a pointer; the stream sends the entry as it is now.
    if row.topic.starts_with("session::message-") {
        if let (Some(sid), Some(eid)) = (
            row.session_id.as_deref(),
            row.payload.get("entry_id").and_then(Value::as_str),
        ) {
            if let Ok(Some(entry)) = sessions.entry(sid, eid) {
                data["entry"] = serde_json::to_value(entry).unwrap_or(Value::Null);
            }
        }
    }
    data
}

async fn session_events(
    State(state): State<AppState>,
    session_id: Result<Path<String>, PathRejection>,
    q: Result<Query<EventsQuery>, QueryRejection>,
    client: Option<Extension<Client>>,
    headers: HeaderMap,
) -> Response {
    let session_id = match session_id {
        Ok(Path(id)) => id,
        Err(e) => return error_response(HarnessError::invalid_field("session_id", e.body_text())),
    };
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return error_response(HarnessError::invalid_field("after", e.body_text())),
    };
    match state.sessions.get(&session_id) {
        Ok(Some(_)) => {}
        Ok(None) => {
            return error_response(HarnessError::not_found(format!(
                "session_id: no session '{session_id}'"
            )))
        }
        Err(e) => return error_response(e.into()),
    }
    let header_after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().parse::<i64>());
    let after = match (header_after, q.after) {
        (Some(Ok(n)), _) => n,
        (Some(Err(_)), _) => {
            return error_response(HarnessError::new(
                ErrorCode::InvalidRequest,
                "Last-Event-ID: must be an event id (an integer)",
            ))
        }
        (None, Some(n)) => n,
        (None, None) => 0,
    };
    let client = client.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0 .0);
    let Some(permit) = state.guard.acquire_stream(client) else {
        return refusal(
            StatusCode::TOO_MANY_REQUESTS,
            "harness/too_many_streams",
            format!(
                "{client} already has {} open event streams; close one first",
                state.guard.max_streams_per_client
            ),
        );
    };
    // The permit lives as long as the response body: a client that goes away frees it.
    let stream = event_stream(state, session_id, after).map(move |e| {
        let _held = &permit;
        e
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

fn event_stream(
    state: AppState,
    session_id: String,
    mut after: i64,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let mut changes = state.bus.store().subscribe_events();
    async_stream(move |tx| async move {
        loop {
            let rows = match state.bus.store().events_after(&session_id, after, 256) {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!("event stream read failed: {e}");
                    return;
                }
            };
            let full_page = rows.len() == 256;
            for row in rows {
                after = row.id;
                if tx.send(Ok(render(&state.sessions, &row))).await.is_err() {
                    return;
                }
            }
            if full_page {
                continue;
            }
            // Also wake when the client is gone, so an idle stream does not outlive it.
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = tx.closed() => return,
            }
        }
    })
}

/// A stream fed by a task: the task stops when the client goes away (send fails).
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Event, Infallible>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
