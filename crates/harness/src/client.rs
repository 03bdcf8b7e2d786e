//! The HTTP client side: `harness call`, and what `chat --url` uses.

use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use serde_json::Value;

/// The API token every request to a server carries (`--token` / `HARNESS_TOKEN`). Set once at
/// startup: one process talks to one server, and a process-wide value spares threading it
/// through every chat call path.
static TOKEN: OnceLock<Option<String>> = OnceLock::new();

pub fn set_token(token: Option<String>) {
    let _ = TOKEN.set(token.filter(|t| !t.is_empty()));
}

pub(crate) fn authorize(req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match TOKEN.get().and_then(Option::as_deref) {
        Some(token) => req.bearer_auth(token),
        None => req,
    }
}

/// A session's event stream on a server (SSE), opened with the token. A failure names the
/// server by [`shown_url`], never with the credential its URL may carry.
pub async fn session_events(url: &str, session_id: &str) -> Result<reqwest::Response> {
    let path = format!("/v1/sessions/{session_id}/events");
    let endpoint = format!("{}{path}", url.trim_end_matches('/'));
    let resp = authorize(reqwest::Client::new().get(&endpoint))
        .send()
        .await
        .map_err(reqwest::Error::without_url)
        .with_context(|| format!("cannot reach {}", shown_url(url)))?;
    if !resp.status().is_success() {
        return Err(anyhow!("{}{path}: HTTP {}", shown_url(url), resp.status()));
    }
    Ok(resp)
}

/// A server's URL as an error or a log may show it: without the user name and password it may
/// carry (a credential), its query or fragment. Text that is not a URL is shown as given.
pub(crate) fn shown_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut parsed) => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.as_str().trim_end_matches('/').to_string()
        }
        Err(_) => url.to_string(),
    }
}

/// Calls a function on a server; a `harness/<code>` error comes back as the error. A failure
/// names the server by [`shown_url`], never with the credential its URL may carry.
pub async fn call_value(url: &str, function_id: &str, payload: &Value) -> Result<Value> {
    let endpoint = format!("{}/v1/functions/{}", url.trim_end_matches('/'), function_id);
    let shown = || format!("{}/v1/functions/{}", shown_url(url), function_id);
    let resp = authorize(reqwest::Client::new().post(&endpoint))
        .json(payload)
        .send()
        .await
        .map_err(reqwest::Error::without_url)
        .with_context(|| format!("cannot reach {}", shown_url(url)))?;
    let status = resp.status();
    let body: Value = resp
        .json()
        .await
        .map_err(reqwest::Error::without_url)
        .with_context(|| format!("{} answered something that is not JSON", shown()))?;
    if status.is_success() {
        return Ok(body);
    }
    let code = body["error"]["code"].as_str().unwrap_or("harness/internal");
    let message = body["error"]["message"].as_str().unwrap_or("(no message)");
    Err(anyhow!("{code}: {message}"))
}

pub async fn call(url: &str, function_id: &str, json: Option<&str>) -> Result<()> {
    let payload: Value = match json {
        Some(text) => serde_json::from_str(text)
            .map_err(|e| anyhow!("harness/invalid_request: payload: not valid JSON: {e}"))?,
        None => Value::Object(Default::default()),
    };
    let result = call_value(url, function_id, &payload).await?;
    // `harness::status` answers `null` for a session it does not know: as a command, that is a
    // failure (a script checking the exit code must not read it as a status).
    if result.is_null() && function_id == "harness::status" {
        let session = payload["session_id"].as_str().unwrap_or("?");
        return Err(anyhow!("harness/not_found: no session '{session}'"));
    }
    println!("{}", serde_json::to_string_pretty(&result)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shown_url_carries_no_credential() {
        assert_eq!(
            shown_url("http://ops:hunter2@127.0.0.1:3113/?token=abc#x"),
            "http://127.0.0.1:3113"
        );
        assert_eq!(shown_url("not a url"), "not a url");
    }

    #[tokio::test]
    async fn a_server_out_of_reach_is_named_without_its_credential() {
        // A port nobody listens on: bound, then released.
        let bound = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
        let port = bound.unwrap().port();
        let url = format!("http://ops:hunter2@127.0.0.1:{port}");
        let err = call_value(&url, "harness::status", &serde_json::json!({}))
            .await
            .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains(&format!("cannot reach http://127.0.0.1:{port}")),
            "{text}"
        );
        assert!(
            !text.contains("hunter2") && !text.contains("ops:"),
            "{text}"
        );
    }
    #[tokio::test]
    async fn a_refused_event_stream_is_named_without_the_credential() {
        // A server that answers every request 401, as one given a wrong token does.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut head = [0u8; 4096];
                let _ = socket.read(&mut head).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
        let url = format!("http://ops:hunter2@127.0.0.1:{port}/?token=abc");
        let err = session_events(&url, "s1").await.unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("401"), "{text}");
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
        assert!(
            !text.contains("hunter2") && !text.contains("ops:") && !text.contains("abc"),
            "{text}"
        );
    }
}
