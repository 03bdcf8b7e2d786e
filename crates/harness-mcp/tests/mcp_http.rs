//! A streamable HTTP MCP server (the fixture's tools behind rmcp's HTTP service, on loopback):
//! its tools registered and called through a scripted turn, with the configured headers sent; a
//! tool list change heard over the session's event stream; a session the server forgot
//! replaced without the call failing. The client's HTTP side is `src/http.rs`.

#[path = "fixture/handler.rs"]
mod handler;
mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use harness_mcp::{ServerSpec, Transport};
use harness_types::api::TurnStatus;
use harness_types::message::joined_text;
use rmcp::transport::streamable_http_server::{
    session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
};
use serde_json::json;
use support::*;

/// Refuses every request without the token, as a server behind auth would.
async fn require_token(req: Request<axum::body::Body>, next: Next) -> Result<Response, StatusCode> {
    match req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        Some("Bearer t0k") => Ok(next.run(req).await),
        _ => Err(StatusCode::UNAUTHORIZED),
    }
}

/// What the server in front of the fixture did: `forget` makes it answer the next POST of a
/// session 404, as a server that restarted and lost its sessions does.
#[derive(Default)]
struct Front {
    forget: AtomicBool,
    initializes: AtomicUsize,
    forgotten: AtomicUsize,
}

async fn front(
    front: Arc<Front>,
    req: Request<axum::body::Body>,
    next: Next,
) -> Result<Response, StatusCode> {
    if req.method() == axum::http::Method::POST {
        if req.headers().get("mcp-session-id").is_none() {
            front.initializes.fetch_add(1, Ordering::SeqCst);
        } else if front.forget.swap(false, Ordering::SeqCst) {
            front.forgotten.fetch_add(1, Ordering::SeqCst);
            return Err(StatusCode::NOT_FOUND);
        }
    }
    Ok(next.run(req).await)
}

async fn serve_http() -> String {
    serve_http_with(Arc::new(Front::default())).await
}

async fn serve_http_with(state: Arc<Front>) -> String {
    let service = StreamableHttpService::new(
        || Ok(handler::Fixture::default()),
        std::sync::Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default().with_sse_keep_alive(None),
    );
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(middleware::from_fn(move |req, next| {
            front(state.clone(), req, next)
        }))
        .layer(middleware::from_fn(require_token));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/mcp")
}

fn http(name: &str, url: &str, token: Option<&str>) -> ServerSpec {
    let mut headers = BTreeMap::new();
    if let Some(t) = token {
        headers.insert("Authorization".to_string(), format!("Bearer {t}"));
    }
    ServerSpec {
        name: name.into(),
        transport: Transport::Http {
            url: url.into(),
            headers,
        },
        call_timeout: Duration::from_secs(20),
    }
}

#[tokio::test]
async fn an_http_server_with_headers_is_registered_and_called_in_a_turn() {
    let url = serve_http().await;
    let script = json!({"generations": [
        call_gen("^go", vec![("c1", "mcp::web::add", json!({"a": 40, "b": 2}))]),
        text_gen("done")
    ]});
    let rt = runtime(
        script,
        vec![http("web", &url, Some("t0k")), http("nokey", &url, None)],
    )
    .await;
    let s = rt.connected("web").await;
    assert!(s.functions.contains(&"mcp::web::echo".to_string()), "{s:?}");
    assert_eq!(s.pid, None);
    let (sid, st) = rt.run_turn(send("go", &["mcp::web::*"])).await;
    assert_eq!(st.status, TurnStatus::Completed);
    let r = rt.result(&sid, "c1");
    assert!(!r.is_error, "{:?}", r.content);
    assert_eq!(joined_text(&r.content), "42");

    // Without the header the server refuses the handshake: reported, nothing registered.
    let k = eventually("the refusal", || {
        Some(rt.server("nokey")).filter(|s| s.last_error.is_some())
    })
    .await;
    assert!(!k.connected && k.functions.is_empty(), "{k:?}");
    assert!(k
        .last_error
        .unwrap()
        .starts_with("mcp server 'nokey' did not start"));
}

#[tokio::test]
async fn a_tool_list_change_is_heard_over_the_sessions_event_stream() {
    let url = serve_http().await;
    let rt = saying_hi(vec![http("web", &url, Some("t0k"))]).await;
    rt.connected("web").await;
    assert!(!rt.function_ids().contains(&"mcp::web::late".to_string()));
    let added = rt.call("mcp::web::add_tool", json!({"name": "late"})).await;
    assert_eq!(added["content"][0]["text"], "added late");
    eventually("mcp::web::late registered", || {
        Some(()).filter(|_| rt.function_ids().contains(&"mcp::web::late".to_string()))
    })
    .await;
    let late = rt.call("mcp::web::late", json!({})).await;
    assert_eq!(late["content"][0]["text"], "late ok");
}

#[tokio::test]
async fn a_session_the_server_forgot_is_replaced_and_the_call_still_answers() {
    let state = Arc::new(Front::default());
    let url = serve_http_with(state.clone()).await;
    let rt = saying_hi(vec![http("web", &url, Some("t0k"))]).await;
    rt.connected("web").await;
    assert_eq!(state.initializes.load(Ordering::SeqCst), 1);

    state.forget.store(true, Ordering::SeqCst);
    let r = rt.call("mcp::web::echo", json!({"text": "again"})).await;
    assert_eq!(r["content"][0]["text"], "echo: again", "{r}");
    assert_ne!(r["is_error"], true, "{r}");
    // The 404 was met, and answered with a second handshake, on the same connection.
    assert_eq!(state.forgotten.load(Ordering::SeqCst), 1);
    assert_eq!(state.initializes.load(Ordering::SeqCst), 2);
    let s = rt.server("web");
    assert!(s.connected && s.connections == 1, "{s:?}");
}
