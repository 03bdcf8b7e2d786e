//! The web console: a page of plain ES modules and one stylesheet, compiled into the binary.
//!
//! The files under `crates/harness/console/` are the bytes served: no build step, nothing
//! generated, nothing read from disk at run time (a debug and a release binary serve the same
//! thing). Each file's ETag is a hash computed at compile time, so a new binary never serves a
//! browser's stale copy, and `Cache-Control: no-cache` makes the browser ask every time.
//!
//! The assets hold no data, so they are served without the API token (a browser cannot attach
//! `Authorization` to a navigation); the Host and Origin rules still apply (see `http::guard`).
//! The page then calls the `/v1/*` API like any other client, token included.

use axum::body::Body;
use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;

/// One embedded file.
pub struct Asset {
    pub name: &'static str,
    pub mime: &'static str,
    pub body: &'static [u8],
    /// `"` + 16 hex digits + `"`: FNV-1a of the body, computed by the compiler.
    etag: [u8; 18],
}

impl Asset {
    pub fn etag(&self) -> &str {
        std::str::from_utf8(&self.etag).unwrap_or("\"0\"")
    }
}

/// FNV-1a 64: a content hash the compiler can evaluate (an ETag needs no cryptographic strength).
const fn etag_of(body: &[u8]) -> [u8; 18] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < body.len() {
        h ^= body[i] as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [b'"'; 18];
    let mut k = 0;
    while k < 16 {
        out[1 + k] = HEX[((h >> (60 - 4 * k)) & 0xf) as usize];
        k += 1;
    }
    out
}

macro_rules! asset {
    ($name:literal, $mime:literal) => {{
        const BODY: &[u8] = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/console/", $name));
        Asset {
            name: $name,
            mime: $mime,
            body: BODY,
            etag: etag_of(BODY),
        }
    }};
}

/// Every file of `crates/harness/console/` (tests/console_http.rs checks the directory against
/// what is served, so a file added there and forgotten here fails).
pub static ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("app.css", "text/css; charset=utf-8"),
    asset!("app.js", "text/javascript; charset=utf-8"),
    asset!("api.js", "text/javascript; charset=utf-8"),
    asset!("sse.js", "text/javascript; charset=utf-8"),
    asset!("render.js", "text/javascript; charset=utf-8"),
    asset!("chat.js", "text/javascript; charset=utf-8"),
    asset!("waterfall.js", "text/javascript; charset=utf-8"),
];

/// No inline script or style anywhere, so nothing needs `unsafe-*`; `frame-ancestors 'none'`
/// keeps the approve button from being clickjacked.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

pub fn asset(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.name == name)
}

/// Whether a request is for the page or one of its files (the token does not apply to these).
pub fn is_asset_request(method: &Method, path: &str) -> bool {
    (method == Method::GET || method == Method::HEAD)
        && (path == "/" || path.starts_with("/console/"))
}

/// `GET /` and `GET /console/{file}`, to merge into the API's router (before its guard layer).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|h: HeaderMap| async move { serve("index.html", &h) }),
        )
        .route(
            "/console/{*file}",
            get(|Path(file): Path<String>, h: HeaderMap| async move { serve(&file, &h) }),
        )
}

fn serve(name: &str, request: &HeaderMap) -> Response {
    let Some(a) = asset(name) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {"code": "harness/not_found",
                "message": format!("no console file '{name}'")}})),
        )
            .into_response();
    };
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == a.etag()));
    let mut resp = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        Response::new(Body::from(a.body))
    };
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(a.mime));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(a.etag()) {
        h.insert(header::ETAG, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_differ_by_content_and_are_quoted_hex() {
        let a = etag_of(b"a");
        let b = etag_of(b"b");
        assert_ne!(a, b);
        let s = std::str::from_utf8(&a).unwrap();
        assert!(
            s.starts_with('"') && s.ends_with('"') && s.len() == 18,
            "{s}"
        );
        assert!(s[1..17].bytes().all(|c| c.is_ascii_hexdigit()), "{s}");
    }

    #[test]
    fn index_references_only_embedded_files() {
        let index = std::str::from_utf8(asset("index.html").unwrap().body).unwrap();
        for part in index.split("/console/").skip(1) {
            let name: String = part.chars().take_while(|c| *c != '"').collect();
            assert!(asset(&name).is_some(), "index.html names {name}");
        }
    }
}
