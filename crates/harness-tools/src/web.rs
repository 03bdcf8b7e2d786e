//! `web::fetch`: one HTTP(S) request, with size and time caps, HTML turned into Markdown.
//!
//! The addresses a name resolves to are checked before connecting, and the request connects
//! only to those checked addresses (the client is pinned to them), so a name that resolves to
//! a loopback, private, link-local or metadata address is refused just like the address
//! itself, and a second resolution cannot swap in another one. Redirects are followed by hand,
//! each hop checked the same way.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{Result, ToolError};
use crate::Limits;

#[derive(Clone, Copy, Debug, Default, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "UPPERCASE")]
pub enum Method {
    #[default]
    Get,
    Post,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FetchRequest {
    /// An http or https URL.
    pub url: String,
    /// GET (default) or POST.
    #[serde(default)]
    pub method: Method,
    /// Request body (POST).
    #[serde(default)]
    pub body: Option<String>,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Return HTML as it came instead of converting it to Markdown.
    #[serde(default)]
    pub raw: bool,
}

/// Why an address is refused, or None when a model may reach it.
pub fn refused(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return refused_v4(v4);
            }
            let seg = v6.segments();
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if seg[0] & 0xfe00 == 0xfc00 {
                Some("private (unique local)")
            } else if seg[0] & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if seg[0] == 0x64 && seg[1] == 0xff9b {
                // NAT64: the IPv4 address is in the last 32 bits.
                let v4 = Ipv4Addr::new(
                    (seg[6] >> 8) as u8,
                    seg[6] as u8,
                    (seg[7] >> 8) as u8,
                    seg[7] as u8,
                );
                refused_v4(v4)
            } else {
                None
            }
        }
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_unspecified() || o[0] == 0 {
        Some("unspecified")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        // 169.254.169.254 is the cloud metadata service.
        Some("link-local (cloud metadata)")
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some("shared address space (carrier NAT)")
    } else if ip.is_broadcast() || ip.is_multicast() || o[0] >= 240 {
        Some("broadcast, multicast or reserved")
    } else {
        None
    }
}

/// The addresses to connect to for `url`, every one checked.
async fn checked_addrs(url: &url::Url, allow_private: bool) -> Result<(String, Vec<SocketAddr>)> {
    let host = url
        .host()
        .ok_or_else(|| ToolError::invalid("url", "has no host"))?;
    let port = url
        .port_or_known_default()
        .ok_or_else(|| ToolError::invalid("url", "has no port"))?;
    let (name, addrs): (String, Vec<SocketAddr>) = match host {
        url::Host::Ipv4(ip) => (ip.to_string(), vec![SocketAddr::new(ip.into(), port)]),
        url::Host::Ipv6(ip) => (ip.to_string(), vec![SocketAddr::new(ip.into(), port)]),
        url::Host::Domain(d) => {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((d, port))
                .await
                .map_err(|e| ToolError::Fetch(format!("url: cannot resolve '{d}': {e}")))?
                .collect();
            if found.is_empty() {
                return Err(ToolError::Fetch(format!(
                    "url: '{d}' resolves to no address"
                )));
            }
            (d.to_string(), found)
        }
    };
    if !allow_private {
        // One refused address refuses the name: which one a connection would use is not ours
        // to choose safely.
        for a in &addrs {
            if let Some(why) = refused(a.ip()) {
                return Err(ToolError::AddressRefused(format!(
                    "url: '{name}' is (or resolves to) {}, a {why} address; a model may reach only public addresses unless the configuration sets web_fetch_allow_private",
                    a.ip()
                )));
            }
        }
    }
    Ok((name, addrs))
}

pub async fn fetch(req: FetchRequest, limits: &Limits) -> Result<Value> {
    let mut url = url::Url::parse(&req.url).map_err(|e| ToolError::invalid("url", e))?;
    if req.body.is_some() && req.method == Method::Get {
        return Err(ToolError::invalid(
            "body",
            "a GET carries no body; use method POST",
        ));
    }
    let mut headers = reqwest::header::HeaderMap::new();
    for (k, v) in &req.headers {
        let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|e| ToolError::invalid(&format!("headers.{k}"), e))?;
        let value = reqwest::header::HeaderValue::from_str(v)
            .map_err(|e| ToolError::invalid(&format!("headers.{k}"), e))?;
        headers.insert(name, value);
    }
    let started = Instant::now();
    let deadline = Duration::from_millis(limits.fetch_timeout_ms);
    let mut method = req.method;
    let mut body = req.body.clone();
    let mut hops = 0;
    let response = loop {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ToolError::invalid(
                "url",
                format!("scheme '{}' is not http or https", url.scheme()),
            ));
        }
        let (name, addrs) = checked_addrs(&url, (limits.allow_private)()).await?;
        let left = deadline.checked_sub(started.elapsed()).ok_or_else(|| {
            ToolError::Timeout(format!(
                "web::fetch: no answer within {} ms",
                limits.fetch_timeout_ms
            ))
        })?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .resolve_to_addrs(&name, &addrs)
            .timeout(left)
            .user_agent(concat!("harness/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ToolError::Internal(e.to_string()))?;
        let mut rb = match method {
            Method::Get => client.get(url.clone()),
            Method::Post => client.post(url.clone()),
        }
        .headers(headers.clone());
        if let Some(b) = &body {
            rb = rb.body(b.clone());
        }
        let resp = rb.send().await.map_err(|e| {
            if e.is_timeout() {
                ToolError::Timeout(format!(
                    "web::fetch: no answer within {} ms",
                    limits.fetch_timeout_ms
                ))
            } else {
                ToolError::Fetch(format!("url: {}", error_chain(&e)))
            }
        })?;
        if resp.status().is_redirection() {
            if let Some(loc) = resp.headers().get(reqwest::header::LOCATION) {
                hops += 1;
                if hops > limits.fetch_max_redirects {
                    return Err(ToolError::Fetch(format!(
                        "url: more than {} redirects",
                        limits.fetch_max_redirects
                    )));
                }
                let loc = loc.to_str().map_err(|_| {
                    ToolError::Fetch("url: a redirect without a readable location".into())
                })?;
                url = url
                    .join(loc)
                    .map_err(|e| ToolError::Fetch(format!("url: bad redirect '{loc}': {e}")))?;
                if resp.status() == reqwest::StatusCode::SEE_OTHER
                    || (method == Method::Post && resp.status().as_u16() < 307)
                {
                    method = Method::Get;
                    body = None;
                }
                continue;
            }
        }
        break resp;
    };
    let status = response.status();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let final_url = response.url().to_string();
    let cap = limits.fetch_max_bytes;
    let mut bytes: Vec<u8> = Vec::new();
    let mut truncated = false;
    let mut response = response;
    loop {
        let chunk =
            tokio::time::timeout(deadline.saturating_sub(started.elapsed()), response.chunk())
                .await
                .map_err(|_| {
                    ToolError::Timeout(format!(
                        "web::fetch: body not read within {} ms",
                        limits.fetch_timeout_ms
                    ))
                })?
                .map_err(|e| ToolError::Fetch(format!("url: {}", error_chain(&e))))?;
        let Some(chunk) = chunk else { break };
        let room = cap.saturating_sub(bytes.len());
        bytes.extend_from_slice(&chunk[..room.min(chunk.len())]);
        if chunk.len() > room {
            truncated = true;
            break;
        }
    }
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let is_html = mime == "text/html" || mime == "application/xhtml+xml";
    let is_text = is_html
        || mime.starts_with("text/")
        || mime.ends_with("json")
        || mime.ends_with("xml")
        || mime.ends_with("javascript")
        || (mime.is_empty() && std::str::from_utf8(&bytes).is_ok());
    let text = if !is_text {
        format!("[{} bytes of {mime} not shown]", bytes.len())
    } else {
        let raw = String::from_utf8_lossy(&bytes).into_owned();
        if is_html && !req.raw {
            html_to_markdown(&raw)
        } else {
            raw
        }
    };
    let mut shown = format!("HTTP {} {final_url}\n\n{text}", status.as_u16());
    if truncated {
        shown.push_str(&format!("\n[cut at {cap} bytes]"));
    }
    Ok(json!({
        "content": [{"type": "text", "text": shown}],
        "is_error": !status.is_success(),
        "status": status.as_u16(),
        "url": final_url,
        "content_type": content_type,
        "bytes": bytes.len(),
        "truncated": truncated,
    }))
}

/// Markdown from HTML, without the parts that are never content.
pub fn html_to_markdown(html: &str) -> String {
    let converter = htmd::HtmlToMarkdown::builder()
        .skip_tags(vec!["script", "style", "noscript", "template", "head"])
        .build();
    converter.convert(html).unwrap_or_else(|_| html.to_string())
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_classes() {
        for ip in [
            "127.0.0.1",
            "127.9.9.9",
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(refused(ip).is_some(), "{ip} must be refused");
        }
        for ip in [
            "93.184.216.34",
            "1.1.1.1",
            "2606:4700:4700::1111",
            "172.32.0.1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(refused(ip), None, "{ip} is public");
        }
    }

    #[test]
    fn html_becomes_markdown_without_scripts() {
        let md = html_to_markdown(
            "<html><head><title>t</title><script>evil()</script></head><body><h1>Title</h1><p>Some <b>bold</b> text and a <a href=\"https://example.org/x\">link</a>.</p><ul><li>one</li><li>two</li></ul></body></html>",
        );
        assert!(md.contains("# Title"), "{md}");
        assert!(md.contains("**bold**"), "{md}");
        assert!(md.contains("[link](https://example.org/x)"), "{md}");
        assert!(md.contains("one") && md.contains("two"), "{md}");
        assert!(!md.contains("evil"), "{md}");
    }
}
