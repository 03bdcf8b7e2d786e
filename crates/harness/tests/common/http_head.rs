//! The head of a raw HTTP/1.1 message, for the tests that speak HTTP over a bare socket (a
//! stand-in provider, chromedriver, the server's keep-alive connections).

/// The body length a message head declares in `Content-Length`; `head` is lowercased by the
/// caller, as header names may come in any case.
pub fn content_length(head: &str) -> Option<usize> {
    head.lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
}
