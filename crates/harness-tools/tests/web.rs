//! `web::fetch` against local servers: loopback, private, link-local and metadata addresses
//! (and names resolving to them) are refused before any connection; when the operator allows
//! private addresses, pages are fetched and HTML comes back as Markdown.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use harness_tools::Limits;
use serde_json::json;
use support::*;

/// A local server counting its requests.
async fn server() -> (String, u16, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let h2 = hits.clone();
    let h3 = hits.clone();
    let app = Router::new()
        .route(
            "/page",
            get(move || {
                h.fetch_add(1, Ordering::SeqCst);
                async {
                    axum::response::Html(
                        "<html><head><script>track()</script></head><body><h1>Hello</h1><p>A <em>local</em> page.</p></body></html>",
                    )
                }
            }),
        )
        .route(
            "/echo",
            post(move |body: String| {
                h2.fetch_add(1, Ordering::SeqCst);
                async move { format!("got {body}") }
            }),
        )
        .route(
            "/big",
            get(move || {
                h3.fetch_add(1, Ordering::SeqCst);
                async { "y".repeat(100_000) }
            }),
        )
        .route("/moved", get(|| async { axum::response::Redirect::to("/page") }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://127.0.0.1:{port}"), port, hits)
}

#[tokio::test]
async fn loopback_private_link_local_and_names_resolving_to_them_are_refused() {
    let rig = Rig::new();
    let (base, port, hits) = server().await;
    for url in [
        format!("{base}/page"),
        format!("http://localhost:{port}/page"),
        format!("http://[::1]:{port}/page"),
        format!("http://0.0.0.0:{port}/page"),
        "http://10.0.0.1/".to_string(),
        "http://10.200.3.4:8080/x".to_string(),
        "http://192.168.0.1/".to_string(),
        "http://169.254.169.254/latest/meta-data/".to_string(),
        "http://[::ffff:169.254.169.254]/".to_string(),
        "http://2130706433/".to_string(),
        format!("http://0x7f.1:{port}/page"),
        format!("http://[::127.0.0.1]:{port}/page"),
        format!("http://[2002:7f00:1::]:{port}/page"),
        format!("http://[64:ff9b::7f00:1]:{port}/page"),
        format!("http://[::ffff:0:127.0.0.1]:{port}/page"),
    ] {
        let e = rig.err("web::fetch", json!({"url": url})).await;
        assert_eq!(e.code, "tools/address_refused", "{url}: {e}");
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "no request reached the server"
    );
    let e = rig
        .err("web::fetch", json!({"url": "file:///etc/passwd"}))
        .await;
    assert!(e.message.starts_with("url:"), "{e}");
}

/// A plain `web::fetch` of `url`, which the rig lets through.
async fn fetch(rig: &Rig, url: &str) -> serde_json::Value {
    rig.ok("web::fetch", json!({ "url": url })).await
}

fn allowing() -> Limits {
    Limits {
        allow_private: Arc::new(|| true),
        fetch_max_bytes: 10_000,
        ..Limits::default()
    }
}

#[tokio::test]
async fn with_private_addresses_allowed_pages_come_back_as_markdown() {
    let rig = Rig::with_limits(allowing(), |_| Vec::new());
    let (_base, port, hits) = server().await;
    // By name: resolved, checked, connected to the checked address.
    let r = fetch(&rig, &format!("http://localhost:{port}/page")).await;
    assert_eq!(r["status"], 200);
    let t = text(&r);
    assert!(t.contains("# Hello"), "{t}");
    assert!(t.contains("*local*") || t.contains("_local_"), "{t}");
    assert!(!t.contains("track()"), "{t}");
    let r = rig
        .ok(
            "web::fetch",
            json!({"url": format!("http://127.0.0.1:{port}/page"), "raw": true}),
        )
        .await;
    assert!(text(&r).contains("<h1>Hello</h1>"));
    let r = rig
        .ok("web::fetch", json!({"url": format!("http://127.0.0.1:{port}/echo"), "method": "POST", "body": "ping"}))
        .await;
    assert!(text(&r).ends_with("got ping"), "{}", text(&r));
    let r = fetch(&rig, &format!("http://127.0.0.1:{port}/moved")).await;
    assert!(
        text(&r).contains("# Hello"),
        "redirects are followed: {}",
        text(&r)
    );
    let r = fetch(&rig, &format!("http://127.0.0.1:{port}/big")).await;
    assert_eq!(r["truncated"], true);
    assert_eq!(r["bytes"], 10_000);
    let r = fetch(&rig, &format!("http://127.0.0.1:{port}/nothing")).await;
    assert_eq!(r["status"], 404);
    assert_eq!(r["is_error"], true);
    assert_eq!(hits.load(Ordering::SeqCst), 5);
    let e = rig
        .err(
            "web::fetch",
            json!({"url": format!("http://127.0.0.1:{port}/page"), "body": "x"}),
        )
        .await;
    assert!(e.message.starts_with("body:"), "{e}");
}
