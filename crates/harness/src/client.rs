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

/// A GET with the token (the event stream).
pub async fn get(endpoint: &str) -> reqwest::Result<reqwest::Response> {
    authorize(reqwest::Client::new().get(endpoint)).send().await
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
}
