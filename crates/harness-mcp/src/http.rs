//! The HTTP side of the streamable HTTP client transport: rmcp's `StreamableHttpClient` over the
//! workspace's reqwest (0.12).
//!
//! rmcp's transport keeps the protocol (sessions, resumption, re-initialization, the standalone
//! event stream); this only moves one request and classifies the answer the way the transport's
//! error type describes it. rmcp's own client for this would link a second reqwest (0.13).
//!
//! Every body is read under the transport's limits before it is parsed: a JSON answer over its
//! limit is refused, an error page is cut to its diagnostic prefix, and an event stream ends with
//! an error at the first event larger than allowed (counted on the raw bytes, before parsing).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::stream::{BoxStream, Stream, StreamExt};
use http::{HeaderName, HeaderValue, StatusCode};
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_client::{
    AuthRequiredError, HttpStatusError, InsufficientScopeError, SseError, StreamableHttpClient,
    StreamableHttpError, StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use sse_stream::{Sse, SseStream};

const SESSION_ID: &str = "mcp-session-id";
const LAST_EVENT_ID: &str = "last-event-id";
const EVENT_STREAM: &str = "text/event-stream";
const JSON: &str = "application/json";

type Error = StreamableHttpError<reqwest::Error>;

/// One MCP server's HTTP connection pool. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Http {
    client: reqwest::Client,
}

impl Http {
    /// No overall timeout: an event stream stays open as long as the session does. Calls are
    /// bounded by the caller (`call_timeout`, `CONNECT_TIMEOUT`).
    pub(crate) fn new() -> Result<Http, reqwest::Error> {
        Ok(Http {
            // No redirects: a configured header (an API key) must not follow a server's answer
            // to another host, and the protocol has no use for them.
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()?,
        })
    }

    /// A request with what every request carries: the configured headers, the session, the
    /// bearer token. A configured header that would replace one the protocol needs is refused.
    fn request(
        &self,
        method: reqwest::Method,
        uri: &str,
        session_id: Option<&str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<reqwest::RequestBuilder, Error> {
        let mut request = self.client.request(method, uri);
        for (name, value) in custom_headers {
            let reserved = [
                http::header::ACCEPT,
                http::header::CONTENT_TYPE,
                HeaderName::from_static(SESSION_ID),
                HeaderName::from_static(LAST_EVENT_ID),
            ];
            if reserved.contains(&name) {
                return Err(StreamableHttpError::ReservedHeaderConflict(
                    name.as_str().to_string(),
                ));
            }
            request = request.header(name, value);
        }
        if let Some(id) = session_id {
            request = request.header(SESSION_ID, id);
        }
        if let Some(token) = auth_header {
            request = request.bearer_auth(token);
        }
        Ok(request)
    }
}

fn header(response: &reqwest::Response, name: impl http::header::AsHeaderName) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The media type without its parameters, lower case.
fn media_type(response: &reqwest::Response) -> Option<String> {
    header(response, http::header::CONTENT_TYPE).map(|ct| {
        ct.split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
    })
}

/// Up to `max` bytes of the body; `Err(())` inside when it is longer.
async fn body_within(
    mut response: reqwest::Response,
    max: usize,
) -> Result<Result<Vec<u8>, Vec<u8>>, Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(client_error)? {
        if body.len() + chunk.len() > max {
            body.extend_from_slice(&chunk[..max - body.len()]);
            return Ok(Err(body));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Ok(body))
}

/// The `scope` a 403's challenge asks for (`Bearer error="insufficient_scope", scope="a b"`).
fn challenged_scope(challenge: &str) -> Option<String> {
    let rest = &challenge[challenge.find("scope=\"")? + "scope=\"".len()..];
    Some(rest[..rest.find('"')?].to_string())
}

/// The failures every method answers alike: authentication, and an expired session.
fn refused(response: &reqwest::Response, had_session: bool) -> Option<Error> {
    let challenge = || header(response, http::header::WWW_AUTHENTICATE).unwrap_or_default();
    match response.status() {
        StatusCode::UNAUTHORIZED => Some(StreamableHttpError::AuthRequired(
            AuthRequiredError::new(challenge()),
        )),
        StatusCode::FORBIDDEN => {
            let challenge = challenge();
            let scope = challenged_scope(&challenge);
            Some(StreamableHttpError::InsufficientScope(
                InsufficientScopeError::new(challenge, scope),
            ))
        }
        StatusCode::NOT_FOUND if had_session => Some(StreamableHttpError::SessionExpired),
        _ => None,
    }
}

/// A failed status as the transport wants it: 429 and 5xx with their `Retry-After` (it decides
/// about retrying), anything else with the start of the body, for the log.
async fn failed(response: reqwest::Response, limits: &StreamableHttpResponseLimits) -> Error {
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
        let retry_after = header(&response, http::header::RETRY_AFTER);
        return StreamableHttpError::HttpStatus(HttpStatusError::new(status.as_u16(), retry_after));
    }
    let body = match body_within(response, limits.max_error_response_size).await {
        Ok(Ok(b) | Err(b)) => b,
        Err(e) => return e,
    };
    StreamableHttpError::UnexpectedServerResponse(
        format!("HTTP {status}: {}", String::from_utf8_lossy(&body)).into(),
    )
}

/// A transport failure without its URL, which may carry a credential (userinfo, a key in the
/// query) into error texts and logs.
fn client_error(e: reqwest::Error) -> Error {
    Error::Client(e.without_url())
}

impl StreamableHttpClient for Http {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, Error> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, Error> {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = max_sse_event_size;
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            limits,
        )
        .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, Error> {
        let response = self
            .request(
                reqwest::Method::POST,
                &uri,
                session_id.as_deref(),
                auth_header,
                custom_headers,
            )?
            .header(http::header::ACCEPT, format!("{JSON}, {EVENT_STREAM}"))
            .json(&message)
            .send()
            .await
            .map_err(client_error)?;
        if let Some(e) = refused(&response, session_id.is_some()) {
            return Err(e);
        }
        let status = response.status();
        let media = media_type(&response);
        let new_session = header(&response, SESSION_ID);
        if status == StatusCode::ACCEPTED {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if !status.is_success() {
            // A JSON-RPC error in a failed answer is the server's answer to the request (a 429
            // is classified by its status alone).
            if media.as_deref() == Some(JSON) && status != StatusCode::TOO_MANY_REQUESTS {
                let retry_after = header(&response, http::header::RETRY_AFTER);
                let body = match body_within(response, limits.max_json_response_size).await? {
                    Ok(body) => body,
                    Err(_) => {
                        return Err(StreamableHttpError::ResponseBodyTooLarge {
                            max_size: limits.max_json_response_size,
                        })
                    }
                };
                return match serde_json::from_slice::<ServerJsonRpcMessage>(&body) {
                    Ok(m @ ServerJsonRpcMessage::Error(_)) => {
                        Ok(StreamableHttpPostResponse::Json(m, new_session))
                    }
                    _ if status.is_server_error() => Err(StreamableHttpError::HttpStatus(
                        HttpStatusError::new(status.as_u16(), retry_after),
                    )),
                    _ => {
                        let shown = &body[..body.len().min(limits.max_error_response_size)];
                        Err(StreamableHttpError::UnexpectedServerResponse(
                            format!("HTTP {status}: {}", String::from_utf8_lossy(shown)).into(),
                        ))
                    }
                };
            }
            return Err(failed(response, &limits).await);
        }
        match media.as_deref() {
            Some(EVENT_STREAM) => Ok(StreamableHttpPostResponse::Sse(
                events(response, limits.max_sse_event_size),
                new_session,
            )),
            Some(JSON) => {
                let body = match body_within(response, limits.max_json_response_size).await? {
                    Ok(body) => body,
                    Err(_) => {
                        return Err(StreamableHttpError::ResponseBodyTooLarge {
                            max_size: limits.max_json_response_size,
                        })
                    }
                };
                // A notification answered 200 with nothing in it was still accepted.
                if body.iter().all(u8::is_ascii_whitespace) {
                    return Ok(StreamableHttpPostResponse::Accepted);
                }
                let message = serde_json::from_slice(&body)?;
                Ok(StreamableHttpPostResponse::Json(message, new_session))
            }
            None if response.content_length() == Some(0) => {
                Ok(StreamableHttpPostResponse::Accepted)
            }
            other => Err(StreamableHttpError::UnexpectedContentType(
                other.map(str::to_string),
            )),
        }
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), Error> {
        let response = self
            .request(
                reqwest::Method::DELETE,
                &uri,
                Some(&session_id),
                auth_header,
                custom_headers,
            )?
            .send()
            .await
            .map_err(client_error)?;
        match response.status() {
            s if s.is_success() => Ok(()),
            // Gone already is what deleting wanted.
            StatusCode::NOT_FOUND => Ok(()),
            StatusCode::METHOD_NOT_ALLOWED => {
                Err(StreamableHttpError::ServerDoesNotSupportDeleteSession)
            }
            _ => match refused(&response, false) {
                Some(e) => Err(e),
                None => Err(failed(response, &StreamableHttpResponseLimits::default()).await),
            },
        }
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, Error> {
        self.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default().max_sse_event_size,
        )
        .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, Error> {
        let mut request = self
            .request(
                reqwest::Method::GET,
                &uri,
                session_id.as_deref(),
                auth_header,
                custom_headers,
            )?
            .header(http::header::ACCEPT, EVENT_STREAM);
        if let Some(id) = last_event_id {
            request = request.header(LAST_EVENT_ID, id);
        }
        let response = request.send().await.map_err(client_error)?;
        if response.status() == StatusCode::METHOD_NOT_ALLOWED {
            return Err(StreamableHttpError::ServerDoesNotSupportSse);
        }
        if let Some(e) = refused(&response, session_id.is_some()) {
            return Err(e);
        }
        if !response.status().is_success() {
            return Err(failed(response, &StreamableHttpResponseLimits::default()).await);
        }
        match media_type(&response) {
            Some(m) if m == EVENT_STREAM => Ok(events(response, max_sse_event_size)),
            other => Err(StreamableHttpError::UnexpectedContentType(other)),
        }
    }
}

/// The response body as server-sent events, ending with an error at the first event over `max`.
fn events(response: reqwest::Response, max: usize) -> BoxStream<'static, Result<Sse, SseError>> {
    let limited = EventLimit::new(response.bytes_stream().boxed(), max);
    SseStream::from_bytes_stream(limited).boxed()
}

#[derive(Debug, thiserror::Error)]
#[error("an event of the stream is larger than {0} bytes")]
struct EventTooLarge(usize);

/// Counts the raw bytes of the event being received (an event ends at a blank line, whichever
/// line ending the server uses) and stops the stream once one passes the limit.
struct EventLimit<E> {
    inner: BoxStream<'static, Result<Bytes, E>>,
    max: usize,
    in_event: usize,
    /// No byte but line endings since the last line ending: the next one ends the event.
    line_empty: bool,
    /// The last byte was `\r`, so a `\n` right after it ends no further line.
    after_cr: bool,
    done: bool,
}

impl<E> EventLimit<E> {
    fn new(inner: BoxStream<'static, Result<Bytes, E>>, max: usize) -> Self {
        EventLimit {
            inner,
            max,
            in_event: 0,
            line_empty: true,
            after_cr: false,
            done: false,
        }
    }

    fn tally(&mut self, chunk: &[u8]) -> Result<(), EventTooLarge> {
        for &b in chunk {
            // The second byte of a `\r\n` ends no line of its own.
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\r' || b == b'\n' {
                if self.line_empty {
                    self.in_event = 0;
                    continue;
                }
                self.line_empty = true;
            } else {
                self.line_empty = false;
            }
            self.in_event += 1;
            if self.in_event > self.max {
                return Err(EventTooLarge(self.max));
            }
        }
        Ok(())
    }
}

impl<E: std::error::Error + Send + Sync + 'static> Stream for EventLimit<E> {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let item = match self.inner.poll_next_unpin(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => None,
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                Some(Err(std::io::Error::other(e)))
            }
            Poll::Ready(Some(Ok(chunk))) => match self.tally(&chunk) {
                Ok(()) => Some(Ok(chunk)),
                Err(e) => {
                    self.done = true;
                    Some(Err(std::io::Error::other(e)))
                }
            },
        };
        Poll::Ready(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, Method};
    use serde_json::json;
    use std::sync::Mutex;

    type Seen = Arc<Mutex<Vec<(Method, HeaderMap)>>>;

    /// A server on loopback that answers what the request's `x-want` header names.
    async fn server() -> (String, Seen) {
        let seen: Seen = Arc::default();
        let record = seen.clone();
        let app = axum::Router::new().fallback(move |method: Method, headers: HeaderMap| {
            let record = record.clone();
            async move {
                let want = headers
                    .get("x-want")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                record.lock().unwrap().push((method, headers));
                let rpc_error =
                    r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"bad"}}"#;
                let (status, headers, body): (u16, Vec<(&str, &str)>, String) = match want.as_str()
                {
                    "accepted" => (202, vec![], String::new()),
                    "json" => (
                        200,
                        vec![("content-type", "application/json"), (SESSION_ID, "s-2")],
                        r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.into(),
                    ),
                    "sse" => (
                        200,
                        vec![("content-type", "text/event-stream")],
                        "id: e1\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n".into(),
                    ),
                    "401" => (
                        401,
                        vec![("www-authenticate", "Bearer realm=\"mcp\"")],
                        String::new(),
                    ),
                    "403" => (
                        403,
                        vec![(
                            "www-authenticate",
                            "Bearer error=\"insufficient_scope\", scope=\"tools:call\"",
                        )],
                        String::new(),
                    ),
                    "404" => (404, vec![], "no such thing".into()),
                    "400-rpc" => (
                        400,
                        vec![("content-type", "application/json")],
                        rpc_error.into(),
                    ),
                    "500-rpc" => (
                        500,
                        vec![("content-type", "application/json")],
                        rpc_error.into(),
                    ),
                    "503" => (503, vec![("retry-after", "7")], "busy".into()),
                    "429" => (
                        429,
                        vec![("content-type", "application/json")],
                        rpc_error.into(),
                    ),
                    "big" => (
                        200,
                        vec![("content-type", "application/json")],
                        format!("\"{}\"", "x".repeat(200)),
                    ),
                    "html" => (200, vec![("content-type", "text/html")], "<p>hi</p>".into()),
                    "redirect" => (307, vec![("location", "/elsewhere")], String::new()),
                    _ => (405, vec![], String::new()),
                };
                let mut r = axum::response::Response::builder().status(status);
                for (k, v) in headers {
                    r = r.header(k, v);
                }
                r.body(axum::body::Body::from(body)).unwrap()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}/mcp"), seen)
    }

    fn want(what: &str) -> HashMap<HeaderName, HeaderValue> {
        HashMap::from([(
            HeaderName::from_static("x-want"),
            HeaderValue::from_str(what).unwrap(),
        )])
    }

    fn ping() -> ClientJsonRpcMessage {
        serde_json::from_value(json!({"jsonrpc": "2.0", "id": 1, "method": "ping"})).unwrap()
    }

    async fn post(
        http: &Http,
        url: &str,
        what: &str,
        session: Option<&str>,
    ) -> Result<StreamableHttpPostResponse, Error> {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_json_response_size = 100;
        http.post_message_with_response_limits(
            url.into(),
            ping(),
            session.map(Into::into),
            None,
            want(what),
            limits,
        )
        .await
    }

    #[tokio::test]
    async fn a_post_carries_the_session_the_token_and_the_configured_headers() {
        let (url, seen) = server().await;
        let http = Http::new().unwrap();
        let r = http
            .post_message(
                url.as_str().into(),
                ping(),
                Some("s-1".into()),
                Some("tok".into()),
                want("accepted"),
            )
            .await
            .unwrap();
        assert!(matches!(r, StreamableHttpPostResponse::Accepted), "{r:?}");
        let (method, headers) = seen.lock().unwrap().pop().unwrap();
        let h = |k: &str| headers.get(k).unwrap().to_str().unwrap().to_string();
        assert_eq!(method, Method::POST);
        assert_eq!(h("mcp-session-id"), "s-1");
        assert_eq!(h("authorization"), "Bearer tok");
        assert_eq!(h("x-want"), "accepted");
        assert_eq!(h("content-type"), "application/json");
        assert!(
            h("accept").contains("application/json") && h("accept").contains("text/event-stream")
        );

        // A header the protocol sets itself cannot be configured over it.
        let mut clash = want("accepted");
        clash.insert(http::header::ACCEPT, HeaderValue::from_static("text/html"));
        let e = http
            .post_message(url.as_str().into(), ping(), None, None, clash)
            .await
            .unwrap_err();
        assert!(
            matches!(e, StreamableHttpError::ReservedHeaderConflict(ref h) if h == "accept"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn a_redirect_is_not_followed_and_a_failure_names_no_url_credential() {
        let (url, seen) = server().await;
        let http = Http::new().unwrap();
        // Followed, the configured headers would go wherever the answer points.
        assert!(post(&http, &url, "redirect", None).await.is_err());
        assert_eq!(seen.lock().unwrap().len(), 1, "the redirect was followed");

        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let e = post(
            &http,
            &format!("http://user:pw-secret@127.0.0.1:{port}/mcp?api_key=key-secret"),
            "json",
            None,
        )
        .await
        .unwrap_err();
        let text = format!("{e} {e:?}");
        assert!(!text.contains("secret"), "{text}");
    }

    #[tokio::test]
    async fn answers_are_classified_as_the_transport_expects() {
        let (url, _) = server().await;
        let http = Http::new().unwrap();
        match post(&http, &url, "json", None).await.unwrap() {
            StreamableHttpPostResponse::Json(ServerJsonRpcMessage::Response(_), session) => {
                assert_eq!(session.as_deref(), Some("s-2"))
            }
            other => panic!("{other:?}"),
        }
        match post(&http, &url, "sse", None).await.unwrap() {
            StreamableHttpPostResponse::Sse(events, _) => {
                let events: Vec<_> = events.collect().await;
                assert_eq!(events.len(), 1, "{events:?}");
                let e = events[0].as_ref().unwrap();
                assert_eq!(e.id.as_deref(), Some("e1"));
                assert!(e.data.as_deref().unwrap().contains("\"result\""));
            }
            other => panic!("{other:?}"),
        }
        for what in ["400-rpc", "500-rpc"] {
            match post(&http, &url, what, None).await.unwrap() {
                StreamableHttpPostResponse::Json(ServerJsonRpcMessage::Error(e), _) => {
                    assert_eq!(e.error.message, "bad")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        let err = |what: &'static str, session: Option<&'static str>| {
            let (http, url) = (http.clone(), url.clone());
            async move { post(&http, &url, what, session).await.unwrap_err() }
        };
        match err("401", None).await {
            StreamableHttpError::AuthRequired(e) => {
                assert_eq!(e.www_authenticate_header, "Bearer realm=\"mcp\"")
            }
            other => panic!("{other}"),
        }
        match err("403", None).await {
            StreamableHttpError::InsufficientScope(e) => {
                assert_eq!(e.get_required_scope(), Some("tools:call"))
            }
            other => panic!("{other}"),
        }
        assert!(matches!(
            err("404", Some("s-1")).await,
            StreamableHttpError::SessionExpired
        ));
        match err("404", None).await {
            StreamableHttpError::UnexpectedServerResponse(m) => {
                assert!(m.contains("404") && m.contains("no such thing"), "{m}")
            }
            other => panic!("{other}"),
        }
        match err("503", None).await {
            StreamableHttpError::HttpStatus(e) => {
                assert_eq!((e.status, e.retry_after.as_deref()), (503, Some("7")))
            }
            other => panic!("{other}"),
        }
        assert!(
            matches!(err("429", None).await, StreamableHttpError::HttpStatus(e) if e.status == 429)
        );
        assert!(matches!(
            err("big", None).await,
            StreamableHttpError::ResponseBodyTooLarge { max_size: 100 }
        ));
        assert!(matches!(
            err("html", None).await,
            StreamableHttpError::UnexpectedContentType(Some(ref t)) if t == "text/html"
        ));
    }

    #[tokio::test]
    async fn a_server_without_streams_or_session_deletion_says_so() {
        let (url, seen) = server().await;
        let http = Http::new().unwrap();
        let e = http
            .get_stream(
                url.as_str().into(),
                Some("s-1".into()),
                Some("e9".into()),
                None,
                want("405"),
            )
            .await
            .err()
            .unwrap();
        assert!(
            matches!(e, StreamableHttpError::ServerDoesNotSupportSse),
            "{e}"
        );
        let (method, headers) = seen.lock().unwrap().pop().unwrap();
        assert_eq!(method, Method::GET);
        assert_eq!(headers.get("last-event-id").unwrap(), "e9");
        assert_eq!(headers.get("accept").unwrap(), "text/event-stream");
        let e = http
            .delete_session(url.as_str().into(), "s-1".into(), None, want("405"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, StreamableHttpError::ServerDoesNotSupportDeleteSession),
            "{e}"
        );
        http.delete_session(url.as_str().into(), "s-1".into(), None, want("accepted"))
            .await
            .unwrap();
        assert_eq!(seen.lock().unwrap().pop().unwrap().0, Method::DELETE);
    }

    fn limited(chunks: &[&'static str], max: usize) -> Vec<Result<String, String>> {
        let inner = futures::stream::iter(
            chunks
                .iter()
                .map(|c| Ok::<_, std::io::Error>(Bytes::from_static(c.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .boxed();
        let out: Vec<_> = futures::executor::block_on(EventLimit::new(inner, max).collect());
        out.into_iter()
            .map(|r| {
                r.map(|b| String::from_utf8(b.to_vec()).unwrap())
                    .map_err(|e| e.to_string())
            })
            .collect()
    }

    #[test]
    fn events_within_the_limit_pass_whatever_the_line_endings() {
        let max = "data: 0123456789\n".len();
        for ending in ["\n", "\r\n", "\r"] {
            let event = format!("data: 0123456789{ending}{ending}");
            let event: &'static str = Box::leak(event.into_boxed_str());
            // Three events split anywhere: each alone is within the limit, together they are not.
            let (a, b) = event.split_at(7);
            let got = limited(&[a, b, event, event], max + 1);
            assert!(got.iter().all(Result::is_ok), "{ending:?}: {got:?}");
            assert_eq!(got.len(), 4);
        }
    }

    #[test]
    fn an_event_over_the_limit_ends_the_stream_with_an_error() {
        let got = limited(
            &["data: ok\n\n", "data: 01234", "56789\n", "data: later\n\n"],
            12,
        );
        assert_eq!(got[0], Ok("data: ok\n\n".to_string()));
        assert_eq!(got[1], Ok("data: 01234".to_string()));
        assert_eq!(
            got[2],
            Err("an event of the stream is larger than 12 bytes".to_string())
        );
        assert_eq!(got.len(), 3, "nothing after the error: {got:?}");
    }

    #[test]
    fn the_scope_a_403_asks_for_is_read_from_its_challenge() {
        assert_eq!(
            challenged_scope(
                r#"Bearer error="insufficient_scope", scope="files:read files:write""#
            )
            .as_deref(),
            Some("files:read files:write")
        );
        assert_eq!(challenged_scope("Bearer realm=\"x\""), None);
    }
}
