//! The HTTP API: every bus function over `POST /v1/functions/{id}`, the function catalog, a
//! resumable per-session event stream (SSE), and a health check.
//!
//! Every failure is a JSON error `{"error": {"code": "harness/<code>", "message": ...}}` with a
//! matching status; nothing drops a connection silently.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
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
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"ok": true})) }))
        .route("/v1/functions", get(list_functions))
        .route("/v1/functions/{function_id}", post(call_function))
        .route("/v1/sessions/{session_id}/events", get(session_events))
        .with_state(state)
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
    Path(function_id): Path<String>,
    body: Bytes,
) -> Response {
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
    match state.bus.call(&function_id, payload, None).await {
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
    Path(session_id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Response {
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
    Sse::new(event_stream(state, session_id, after))
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
            if changes.changed().await.is_err() {
                return;
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
