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
            client: reqwest::Client::builder().build()?,
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
    while let Some(chunk) = response.chunk().await.map_err(Error::Client)? {
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
            .map_err(Error::Client)?;
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
            // A JSON-RPC error in a failed answer is the server's answer to the request.
            if media.as_deref() == Some(JSON) && !status.is_server_error() {
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
                    _ => Err(StreamableHttpError::UnexpectedServerResponse(
                        format!("HTTP {status}: {}", String::from_utf8_lossy(&body)).into(),
                    )),
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
            .map_err(Error::Client)?;
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
        let response = request.send().await.map_err(Error::Client)?;
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
