//! The HTTP client the OTLP exporter posts through: the workspace's own reqwest (0.12), blocking.
//!
//! The exporter crate's built-in clients would link a second reqwest (0.13) into the binary. Its
//! blocking one is what we need, for the reason `otlp.rs` gives: the batch processor exports on
//! a thread of its own under `futures_executor::block_on`, with no Tokio runtime around, where an
//! async reqwest client panics. reqwest's blocking client runs its own runtime on a thread it
//! owns, so `send_bytes` simply blocks the processor's thread until the collector answered.

use std::io::Read;
use std::time::Duration;

use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};

/// The most of a collector's answer that is read.
const ANSWER_LIMIT: u64 = 64 * 1024;

/// Posts one OTLP request and hands back the collector's answer, whatever its status: the
/// exporter turns a non-2xx status into an export error that names the code.
#[derive(Debug)]
pub(crate) struct BlockingHttp {
    client: reqwest::blocking::Client,
}

impl BlockingHttp {
    /// Must run outside any Tokio runtime (building, like dropping, starts or stops the
    /// client's own runtime thread, which Tokio forbids from inside one of its workers).
    pub(crate) fn new(timeout: Duration) -> Result<BlockingHttp, reqwest::Error> {
        // No redirects: the exporter's headers (a vendor's API key) must not follow an answer to
        // another host.
        let client = reqwest::blocking::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(BlockingHttp { client })
    }
}

#[async_trait::async_trait]
impl HttpClient for BlockingHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let answer = self
            .client
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .send()
            // The endpoint may carry a credential in its URL: keep it out of the error text.
            .map_err(|e| e.without_url())?;
        let status = answer.status();
        let headers = answer.headers().clone();
        // The exporter reads only the status and a short reason: a collector's answer is read
        // up to a bound, however large it claims or turns out to be.
        let mut body = Vec::new();
        answer.take(ANSWER_LIMIT).read_to_end(&mut body)?;
        let mut response = Response::builder().status(status).body(Bytes::from(body))?;
        *response.headers_mut() = headers;
        Ok(response)
    }
}
