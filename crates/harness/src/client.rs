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

/// Calls a function on a server; a `harness/<code>` error comes back as the error.
pub async fn call_value(url: &str, function_id: &str, payload: &Value) -> Result<Value> {
    let endpoint = format!("{}/v1/functions/{}", url.trim_end_matches('/'), function_id);
    let resp = authorize(reqwest::Client::new().post(&endpoint))
        .json(payload)
        .send()
        .await
        .with_context(|| format!("cannot reach {url}"))?;
    let status = resp.status();
    let body: Value = resp
        .json()
        .await
        .with_context(|| format!("{endpoint} answered something that is not JSON"))?;
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
