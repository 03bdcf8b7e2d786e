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

use harness_types::error::error_chain;
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
///
/// Every IPv6 form that carries an IPv4 address (mapped, compatible, translated, 6to4, NAT64,
/// Teredo) is judged by the IPv4 address inside, since a gateway on the way may deliver it
/// there; ranges that are never public (documentation, benchmarking, site-local, local-use
/// NAT64, discard) are refused whole.
pub fn refused(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn v4_at(seg: &[u16; 8], i: usize) -> Ipv4Addr {
    let [a, b] = seg[i].to_be_bytes();
    let [c, d] = seg[i + 1].to_be_bytes();
    Ipv4Addr::new(a, b, c, d)
}

fn refused_v6(v6: std::net::Ipv6Addr) -> Option<&'static str> {
    let seg = v6.segments();
    if v6.is_loopback() {
        return Some("loopback");
    }
    if v6.is_unspecified() {
        return Some("unspecified");
    }
    // ::ffff:a.b.c.d (mapped).
    if seg[..5] == [0; 5] && seg[5] == 0xffff {
        return refused_v4(v4_at(&seg, 6));
    }
    // ::ffff:0:a.b.c.d (translated): for stateless translators inside a network only.
    if seg[4..6] == [0xffff, 0] && seg[..4] == [0; 4] {
        return Some("IPv4-translated");
    }
    // ::a.b.c.d (IPv4-compatible, deprecated): never a public route.
    if seg[..6] == [0; 6] {
        return Some(refused_v4(v4_at(&seg, 6)).unwrap_or("IPv4-compatible (deprecated)"));
    }
    match seg[0] {
        0x0064 if seg[1] == 0xff9b && seg[2..6] == [0; 4] => {
            // NAT64 (64:ff9b::/96): the IPv4 address is the last 32 bits.
            return refused_v4(v4_at(&seg, 6));
        }
        0x0064 if seg[1] == 0xff9b && seg[2] == 1 => return Some("local-use NAT64"),
        0x0100 if seg[1..4] == [0; 3] => return Some("discard-only"),
        0x2001 if seg[1] == 0 => {
            // Teredo: the server's IPv4 address, then the client's, inverted.
            let server = v4_at(&seg, 2);
            let client = Ipv4Addr::from(u32::from(v4_at(&seg, 6)) ^ 0xffff_ffff);
            return refused_v4(server)
                .or(refused_v4(client))
                .map(|_| "Teredo to a non-public");
        }
        0x2001 if seg[1] == 0x0db8 => return Some("documentation"),
        0x2001 if seg[1] == 0x0002 && seg[2] == 0 => return Some("benchmarking"),
        0x2001 if (seg[1] & 0xfff0) == 0x0010 || (seg[1] & 0xfff0) == 0x0020 => {
            return Some("ORCHID (not routable)")
        }
        0x2002 => {
            // 6to4: the IPv4 address follows the prefix.
            return refused_v4(v4_at(&seg, 1)).map(|_| "6to4 to a non-public");
        }
        0x3fff if seg[1] < 0x1000 => return Some("documentation"),
        _ => {}
    }
    if seg[0] & 0xfe00 == 0xfc00 {
        Some("private (unique local)")
    } else if seg[0] & 0xffc0 == 0xfe80 {
        Some("link-local")
    } else if seg[0] & 0xffc0 == 0xfec0 {
        Some("site-local (deprecated)")
    } else if v6.is_multicast() {
        Some("multicast")
    } else {
        None
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if o[0] == 0 {
        Some("unspecified (this network)")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        // 169.254.169.254 is the cloud metadata service.
        Some("link-local (cloud metadata)")
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some("shared address space (carrier NAT)")
    } else if o[..3] == [192, 0, 0] {
        Some("IETF protocol assignment")
    } else if o[..3] == [192, 0, 2] || o[..3] == [198, 51, 100] || o[..3] == [203, 0, 113] {
        Some("documentation")
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        Some("benchmarking")
    } else if o[..3] == [192, 88, 99] {
        Some("6to4 relay anycast (deprecated)")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_classes() {
        for ip in [
            // IPv4
            "127.0.0.1",
            "127.9.9.9",
            "0.0.0.0",
            "0.1.2.3",
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.0.1",
            "100.64.0.1",
            "100.127.255.254",
            "192.0.0.1",
            "192.0.0.170",
            "192.0.2.1",
            "198.51.100.7",
            "203.0.113.9",
            "198.18.0.1",
            "198.19.255.255",
            "192.88.99.1",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            // IPv6 native
            "::1",
            "::",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "feff::1",
            "fc00::1",
            "fd00:ec2::254",
            "ff02::1",
            "ff0e::1",
            "100::1",
            "2001:db8::1",
            "2001:2::1",
            "2001:10::1",
            "2001:20::1",
            "3fff::1",
            // IPv4 inside IPv6
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
            "::ffff:169.254.169.254",
            "::ffff:0:127.0.0.1",
            "::ffff:0:8.8.8.8",
            "::127.0.0.1",
            "::10.0.0.1",
            "::8.8.8.8",
            "2002:7f00:1::",
            "2002:7f00:0001::1",
            "2002:a9fe:a9fe::",
            "2002:0a00:0001::",
            "64:ff9b::7f00:1",
            "64:ff9b::127.0.0.1",
            "64:ff9b::a00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "64:ff9b:1::8.8.8.8",
            // Teredo: server 127.0.0.1; client 10.0.0.1 (inverted: f5ff:fffe).
            "2001:0:7f00:1::",
            "2001:0:0808:0808::f5ff:fffe",
        ] {
            let parsed: IpAddr = ip.parse().unwrap();
            assert!(refused(parsed).is_some(), "{ip} must be refused");
        }
        for ip in [
            "93.184.216.34",
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "192.0.3.1",
            "198.20.0.1",
            "2606:4700:4700::1111",
            "2a00:1450:4001::200e",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:0808:0808::1",
            // Teredo between two public addresses (client 8.8.4.4 inverted: f7f7:fbfb).
            "2001:0:0808:0808::f7f7:fbfb",
        ] {
            let parsed: IpAddr = ip.parse().unwrap();
            assert_eq!(refused(parsed), None, "{ip} is public");
        }
    }

    /// URL spellings of loopback the url crate normalises (decimal, octal, hex, short forms):
    /// what is checked is the address it parsed, not the text.
    #[test]
    fn url_spellings_of_a_refused_address_are_refused() {
        for url in [
            "http://2130706433/",
            "http://0x7f.1/",
            "http://0x7f000001/",
            "http://0177.0.0.1/",
            "http://017700000001/",
            "http://127.1/",
            "http://127.0.1/",
            "http://0/",
            "http://0x0/",
            "http://[::ffff:7f00:1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[0:0:0:0:0:ffff:127.0.0.1]/",
            "http://[::127.0.0.1]/",
            "http://[2002:7f00:1::]/",
            "http://[64:ff9b::7f00:1]/",
            "http://[fe80::1%25eth0]/",
            "http://169.254.169.254/",
            "http://0xa9.0xfe.0xa9.0xfe/",
            "http://2852039166/",
        ] {
            let parsed = url::Url::parse(url);
            let ip: IpAddr = match parsed.as_ref().ok().and_then(|u| u.host()) {
                Some(url::Host::Ipv4(ip)) => ip.into(),
                Some(url::Host::Ipv6(ip)) => ip.into(),
                // Not a URL the fetch accepts at all (refused as invalid).
                None => continue,
                Some(url::Host::Domain(d)) => panic!("{url} parsed as the name {d}"),
            };
            assert!(refused(ip).is_some(), "{url} ({ip}) must be refused");
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
