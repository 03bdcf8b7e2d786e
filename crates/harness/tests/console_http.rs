//! The web console as HTTP serves it (no browser): the page and every file it names, their
//! headers, the token exemption of the assets only, the Host rule on `/`, `--no-console`, and
//! the embedded table against the directory it is built from.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{script, text_gen, Server};

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn console_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console")
}

fn demo() -> serde_json::Value {
    script(vec![text_gen(None, "hi", 0, true)])
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A `GET` of `url` that reached the server (whatever it answered).
async fn get(c: &reqwest::Client, url: String) -> reqwest::Response {
    sent(c.get(url)).await
}

/// The answer to `request`, which must reach the server (whatever it answered).
async fn sent(request: reqwest::RequestBuilder) -> reqwest::Response {
    request
        .send()
        .await
        .unwrap_or_else(|e| panic!("no answer: {e}"))
}

/// A GET of `url` carrying `header` is refused as 403 with the error `code`.
async fn assert_forbidden(c: &reqwest::Client, url: String, header: (&str, &str), code: &str) {
    let r = sent(c.get(url).header(header.0, header.1)).await;
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no {name} header on {}", r.url()))
}

fn assert_asset_headers(r: &reqwest::Response) {
    assert_eq!(header(r, "content-security-policy"), CSP, "{}", r.url());
    assert_eq!(header(r, "x-content-type-options"), "nosniff");
    assert_eq!(header(r, "referrer-policy"), "no-referrer");
    assert_eq!(header(r, "cache-control"), "no-cache");
    let etag = header(r, "etag");
    assert!(
        etag.len() > 2 && etag.starts_with('"') && etag.ends_with('"'),
        "etag {etag:?}"
    );
    assert!(
        r.headers().get("access-control-allow-origin").is_none(),
        "the console adds no CORS header"
    );
}

/// The `/console/...` files `index.html` names in `src="..."` and `href="..."`, and the
/// modules those import (`from "./x.js"`).
fn referenced(index: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for attr in ["src=\"", "href=\""] {
        for part in index.split(attr).skip(1) {
            let url: String = part.chars().take_while(|c| *c != '"').collect();
            out.insert(url);
        }
    }
    out
}

fn imports(js: &str) -> Vec<String> {
    js.split("from \"./")
        .skip(1)
        .map(|p| p.chars().take_while(|c| *c != '"').collect())
        .collect()
}

#[tokio::test]
async fn page_and_every_asset_are_served_with_their_headers() {
    let s = Server::start(&demo(), &[]).await;
    let c = client();
    let r = get(&c, format!("{}/", s.url())).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/html; charset=utf-8");
    assert_asset_headers(&r);
    let index = r.text().await.unwrap();
    assert!(index.contains("<script type=\"module\""), "{index}");
    let refs = referenced(&index);
    assert!(
        refs.contains("/console/app.js") && refs.contains("/console/app.css"),
        "{refs:?}"
    );
    let mut modules: Vec<String> = Vec::new();
    for url in &refs {
        assert!(url.starts_with("/console/"), "index.html names {url}");
        let r = get(&c, format!("{}{url}", s.url())).await;
        assert_eq!(r.status(), 200, "{url}");
        let want = if url.ends_with(".css") {
            "text/css; charset=utf-8"
        } else {
            "text/javascript; charset=utf-8"
        };
        assert_eq!(header(&r, "content-type"), want, "{url}");
        assert_asset_headers(&r);
        if url.ends_with(".js") {
            modules.extend(imports(&r.text().await.unwrap()));
        }
    }
    // The modules the entry module pulls in, transitively.
    let mut seen = BTreeSet::new();
    while let Some(m) = modules.pop() {
        if !seen.insert(m.clone()) {
            continue;
        }
        let r = get(&c, format!("{}/console/{m}", s.url())).await;
        assert_eq!(r.status(), 200, "module {m}");
        assert_eq!(header(&r, "content-type"), "text/javascript; charset=utf-8");
        assert_asset_headers(&r);
        modules.extend(imports(&r.text().await.unwrap()));
    }
    assert!(
        seen.contains("api.js") && seen.contains("sse.js"),
        "{seen:?}"
    );

    // HEAD answers the same headers, no body.
    let r = sent(c.head(format!("{}/", s.url()))).await;
    assert_eq!(r.status(), 200);
    assert_asset_headers(&r);
    assert!(r.bytes().await.unwrap().is_empty());

    // A revalidation with the ETag gets 304.
    let r = get(&c, format!("{}/console/app.js", s.url())).await;
    let etag = header(&r, "etag").to_string();
    let r = sent(
        c.get(format!("{}/console/app.js", s.url()))
            .header("if-none-match", &etag),
    )
    .await;
    assert_eq!(r.status(), 304);

    // An unknown console path is the API's JSON 404.
    let r = get(&c, format!("{}/console/nope.js", s.url())).await;
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "harness/not_found");
    let r = get(&c, format!("{}/console/../Cargo.toml", s.url())).await;
    assert_ne!(r.status(), 200);
}

#[tokio::test]
async fn every_file_of_the_console_dir_is_embedded_byte_for_byte() {
    let s = Server::start(&demo(), &[]).await;
    let c = client();
    let mut files = 0;
    let mut total = 0u64;
    for entry in std::fs::read_dir(console_dir()).unwrap() {
        let entry = entry.unwrap();
        assert!(entry.file_type().unwrap().is_file(), "{:?}", entry.path());
        let name = entry.file_name().into_string().unwrap();
        let disk = std::fs::read(entry.path()).unwrap();
        total += disk.len() as u64;
        let r = get(&c, format!("{}/console/{name}", s.url())).await;
        assert_eq!(
            r.status(),
            200,
            "{name} is not embedded (console.rs ASSETS)"
        );
        let served = r.bytes().await.unwrap();
        assert!(
            served == disk,
            "{name}: the binary serves other bytes than the file"
        );
        files += 1;
    }
    assert!(files >= 6, "{files} files");
    assert!(total <= 250 * 1024, "console assets are {total} bytes");
    // No remote script, style or font.
    for entry in std::fs::read_dir(console_dir()).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for bad in [
            "src=\"http",
            "href=\"http",
            "@import",
            "url(http",
            "from \"http",
        ] {
            assert!(!text.contains(bad), "{bad}");
        }
        assert!(
            !text.contains("innerHTML"),
            "model text is never assigned to innerHTML"
        );
    }
}

/// `harness serve` with a token: the shared helper's readiness probe has none, so this one
/// waits for the console line instead. Killed on drop.
struct Locked {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Locked {
    fn start(token: &str) -> Locked {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("script.json"), demo().to_string()).unwrap();
        let port = common::free_port();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let child = std::process::Command::new(common::BIN)
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--token",
                token,
            ])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--script")
            .arg(dir.path().join("script.json"))
            .env_remove("HARNESS_TOKEN")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut l = Locked { child, port, dir };
        let deadline = std::time::Instant::now() + common::WAIT;
        while !l.log().contains("console: http://") {
            assert!(l.child.try_wait().unwrap().is_none(), "exited: {}", l.log());
            assert!(std::time::Instant::now() < deadline, "{}", l.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        l
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn assets_need_no_token_while_the_api_still_does() {
    let s = Locked::start("sekret");
    let c = client();
    for path in ["/", "/console/app.js", "/console/app.css"] {
        let r = get(&c, format!("{}{path}", s.url())).await;
        assert_eq!(r.status(), 200, "{path}");
    }
    let r = sent(
        c.post(format!("{}/v1/functions/session::list", s.url()))
            .body("{}"),
    )
    .await;
    assert_eq!(r.status(), 401);
    let r = get(&c, format!("{}/v1/functions", s.url())).await;
    assert_eq!(r.status(), 401);
    // A POST to the page's path is not an asset request: the token applies.
    let r = sent(c.post(format!("{}/", s.url()))).await;
    assert_eq!(r.status(), 401);
    let r = sent(
        c.post(format!("{}/v1/functions/session::list", s.url()))
            .bearer_auth("sekret")
            .body("{}"),
    )
    .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn host_and_origin_rules_apply_to_the_page() {
    let s = Server::start(&demo(), &[]).await;
    let c = client();
    let url = format!("{}/", s.url());
    assert_forbidden(
        &c,
        url,
        ("host", "evil.test:3113"),
        "harness/forbidden_host",
    )
    .await;
    let url = format!("{}/console/app.js", s.url());
    assert_forbidden(
        &c,
        url,
        ("origin", "http://127.0.0.1:1"),
        "harness/forbidden_origin",
    )
    .await;
}

#[tokio::test]
async fn no_console_serves_the_json_404() {
    let s = Server::start(&demo(), &["--no-console"]).await;
    let c = client();
    for path in ["/", "/console/app.js"] {
        let r = get(&c, format!("{}{path}", s.url())).await;
        assert_eq!(r.status(), 404, "{path}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "harness/not_found");
    }
    assert!(!s.log().contains("console: http://"), "{}", s.log());

    // The config key does the same.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("harness.yaml");
    std::fs::write(&file, "console: false\n").unwrap();
    let s = Server::start(&demo(), &["--config", file.to_str().unwrap()]).await;
    let r = get(&c, format!("{}/", s.url())).await;
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn serve_prints_the_console_url_without_the_token() {
    let s = Server::start(&demo(), &[]).await;
    assert!(
        s.log().contains(&format!("console: {}/", s.url())),
        "{}",
        s.log()
    );
    let s = Locked::start("sekret-token-123");
    let log = s.log();
    assert!(log.contains("append #token=<your token>"), "{log}");
    assert!(!log.contains("sekret-token-123"), "{log}");
}
