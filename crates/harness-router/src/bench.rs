//! The router's own latency, measured over a real local socket (for `harness bench`).
//!
//! [`frame_latency`] starts an SSE server on 127.0.0.1 that speaks the Anthropic Messages
//! streaming format, points the Anthropic adapter at it, and measures:
//!
//! * **per frame** — from the moment the server hands an event's bytes to the socket to the moment
//!   the matching frame, parsed back into a `Frame` the way the loop does, comes out of the
//!   router's frame channel. One event is in flight at a time (the server writes the next one
//!   when the previous frame arrived), so this is latency, not throughput;
//! * **socket baseline** — the same ping-pong with a plain `TcpStream` reader: what the kernel
//!   and the runtime cost without HTTP, SSE, JSON or the router. `added_per_frame` is the
//!   difference of the medians;
//! * **per request** — the router's share of one short request: from `Router::chat` to the
//!   server having read the whole request, plus from the server's last byte to the ack.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use harness_bus::CallContext;
use harness_types::message::AgentMessage;
use harness_types::router::{ChatRequest, Frame};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::providers::{ProviderConfig, ProviderKind};
use crate::router::Router;

/// What to measure.
#[derive(Clone, Debug)]
pub struct FrameLatencyOptions {
    /// Streamed text deltas measured (after `warmup`).
    pub frames: usize,
    pub warmup: usize,
    /// Short requests measured for the per-request overhead.
    pub requests: usize,
}

impl Default for FrameLatencyOptions {
    fn default() -> Self {
        FrameLatencyOptions {
            frames: 2000,
            warmup: 100,
            requests: 50,
        }
    }
}

/// Percentiles in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Micros {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub samples: usize,
}

impl Micros {
    fn of(mut v: Vec<Duration>) -> Micros {
        if v.is_empty() {
            return Micros::default();
        }
        v.sort();
        let at = |q: f64| {
            let i = ((v.len() as f64 - 1.0) * q).round() as usize;
            v[i].as_secs_f64() * 1e6
        };
        Micros {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: at(1.0),
            samples: v.len(),
        }
    }
}

/// The measurement.
#[derive(Clone, Debug, Serialize)]
pub struct FrameLatencyReport {
    /// Socket bytes → frame in the loop, one event in flight.
    pub per_frame_us: Micros,
    /// The same ping-pong on a raw TCP reader.
    pub socket_baseline_us: Micros,
    /// `per_frame.p50 - socket_baseline.p50`: what HTTP + SSE + JSON + the router add.
    pub added_per_frame_p50_us: f64,
    /// The router's share of one short request (request out + ack back).
    pub per_request_us: Micros,
}

async fn read_request(sock: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            let total = end + 4 + len;
            while buf.len() < total {
                let mut chunk = [0u8; 8192];
                let n = sock.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(false);
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            buf.drain(..total);
            return Ok(true);
        }
        let mut chunk = [0u8; 8192];
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(false);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn chunk(event: &str, data: &str) -> Vec<u8> {
    let payload = format!("event: {event}\ndata: {data}\n\n");
    format!("{:x}\r\n{payload}\r\n", payload.len()).into_bytes()
}

const HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn opening() -> Vec<u8> {
    let mut out = HEAD.to_vec();
    out.extend(chunk(
        "message_start",
        r#"{"type":"message_start","message":{"id":"msg_bench","type":"message","role":"assistant","content":[],"model":"bench","stop_reason":null,"usage":{"input_tokens":10,"output_tokens":1}}}"#,
    ));
    out.extend(chunk(
        "content_block_start",
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    ));
    out
}

fn closing() -> Vec<u8> {
    let mut out = chunk(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#,
    );
    out.extend(chunk(
        "message_delta",
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":5}}"#,
    ));
    out.extend(chunk("message_stop", r#"{"type":"message_stop"}"#));
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

fn delta(i: usize) -> Vec<u8> {
    chunk(
        "content_block_delta",
        &format!(
            r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"tok{i} "}}}}"#
        ),
    )
}

fn request(model: &str) -> ChatRequest {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let id = format!("bench:{}", NEXT.fetch_add(1, Ordering::Relaxed));
    ChatRequest {
        provider: Some("anthropic".into()),
        ..ChatRequest::new(id, model, vec![AgentMessage::user_text("bench", 0)])
    }
}

fn router_for(addr: std::net::SocketAddr) -> Router {
    let router = Router::new();
    let cfg = ProviderConfig::new(
        "anthropic",
        ProviderKind::Anthropic,
        &format!("http://{addr}"),
        Some("bench-not-a-key"),
    );
    router.add_provider(cfg.build());
    router
}

/// Measures the router's added latency per streamed frame and per request over a local SSE
/// server (see the module docs). Takes about a second with the default options.
pub async fn frame_latency(opts: FrameLatencyOptions) -> std::io::Result<FrameLatencyReport> {
    let per_frame = streamed_frames(&opts).await?;
    let baseline = socket_baseline(opts.frames + opts.warmup, opts.warmup).await?;
    let per_request = requests(opts.requests).await?;
    let per_frame_us = Micros::of(per_frame);
    let socket_baseline_us = Micros::of(baseline);
    Ok(FrameLatencyReport {
        added_per_frame_p50_us: (per_frame_us.p50 - socket_baseline_us.p50).max(0.0),
        per_frame_us,
        socket_baseline_us,
        per_request_us: Micros::of(per_request),
    })
}

async fn streamed_frames(opts: &FrameLatencyOptions) -> std::io::Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let total = opts.frames + opts.warmup;
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel::<Instant>();
    let (go_tx, mut go_rx) = mpsc::unbounded_channel::<()>();
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        let mut buf = Vec::new();
        read_request(&mut sock, &mut buf).await?;
        sock.write_all(&opening()).await?;
        paced_deltas(&mut sock, total, &mut go_rx, &sent_tx).await?;
        sock.write_all(&closing()).await?;
        sock.flush().await?;
        Ok::<_, std::io::Error>(())
    });
    let router = router_for(addr);
    let (tx, mut frames) = mpsc::unbounded_channel::<Value>();
    let chat = tokio::spawn({
        let router = router.clone();
        async move {
            router
                .chat(
                    request("bench"),
                    CallContext {
                        frames: Some(tx),
                        metadata: Value::Null,
                    },
                )
                .await
        }
    });
    let mut samples = Vec::with_capacity(opts.frames);
    let mut seen = 0usize;
    while let Some(v) = frames.recv().await {
        let Ok(frame) = serde_json::from_value::<Frame>(v) else {
            continue;
        };
        match frame {
            Frame::TextDelta { .. } => {
                let at = Instant::now();
                if let Some(sent) = sent_rx.recv().await {
                    if seen >= opts.warmup {
                        samples.push(at.saturating_duration_since(sent));
                    }
                }
                seen += 1;
                let _ = go_tx.send(());
            }
            f if f.is_terminal() => break,
            _ => {}
        }
    }
    let _ = chat.await;
    server.await.map_err(std::io::Error::other)??;
    Ok(samples)
}

/// Writes `total` deltas, each after the reader said it took the one before (one frame in
/// flight, so a sample is one frame's latency, not a queue's), noting when each went out.
async fn paced_deltas(
    sock: &mut TcpStream,
    total: usize,
    go: &mut mpsc::UnboundedReceiver<()>,
    sent: &mpsc::UnboundedSender<Instant>,
) -> std::io::Result<()> {
    for i in 0..total {
        if i > 0 && go.recv().await.is_none() {
            break;
        }
        let bytes = delta(i);
        let _ = sent.send(Instant::now());
        sock.write_all(&bytes).await?;
    }
    Ok(())
}

async fn socket_baseline(total: usize, warmup: usize) -> std::io::Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel::<Instant>();
    let (go_tx, mut go_rx) = mpsc::unbounded_channel::<()>();
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        paced_deltas(&mut sock, total, &mut go_rx, &sent_tx).await?;
        Ok::<_, std::io::Error>(())
    });
    let mut client = TcpStream::connect(addr).await?;
    client.set_nodelay(true)?;
    let mut samples = Vec::with_capacity(total);
    let mut buf = vec![0u8; 4096];
    let mut pending = 0usize;
    for i in 0..total {
        let want = delta(i).len();
        while pending < want {
            let n = client.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            pending += n;
        }
        pending = pending.saturating_sub(want);
        let at = Instant::now();
        if let Some(sent) = sent_rx.recv().await {
            if i >= warmup {
                samples.push(at.saturating_duration_since(sent));
            }
        }
        let _ = go_tx.send(());
    }
    drop(go_tx);
    server.await.map_err(std::io::Error::other)??;
    Ok(samples)
}

async fn requests(n: usize) -> std::io::Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    // (request fully read, last byte written), per request.
    let (marks_tx, mut marks_rx) = mpsc::unbounded_channel::<(Instant, Instant)>();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                break;
            };
            sock.set_nodelay(true)?;
            let marks_tx = marks_tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Ok(true) = read_request(&mut sock, &mut buf).await {
                    let got = Instant::now();
                    let mut body = opening();
                    body.extend(delta(0));
                    body.extend(closing());
                    if sock.write_all(&body).await.is_err() {
                        break;
                    }
                    let _ = marks_tx.send((got, Instant::now()));
                }
            });
        }
        Ok::<_, std::io::Error>(())
    });
    let router = router_for(addr);
    let mut samples = Vec::with_capacity(n);
    // One warm-up request opens the pooled connection.
    for i in 0..n + 1 {
        let (tx, _rx) = mpsc::unbounded_channel::<Value>();
        let t0 = Instant::now();
        let ack = router
            .chat(
                request("bench"),
                CallContext {
                    frames: Some(tx),
                    metadata: Value::Null,
                },
            )
            .await;
        let t_ack = Instant::now();
        if !ack.ok {
            return Err(std::io::Error::other(format!(
                "bench request failed: {:?}",
                ack.error.map(|e| e.detail)
            )));
        }
        let Some((got, last)) = marks_rx.recv().await else {
            break;
        };
        if i > 0 {
            samples.push(got.saturating_duration_since(t0) + t_ack.saturating_duration_since(last));
        }
    }
    server.abort();
    Ok(samples)
}
