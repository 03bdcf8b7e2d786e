//! Replays exchanges recorded from a real server (`tests/fixtures/<server>-<version>/*.json`,
//! written by `tests/fixtures/record.py`): a local server answers each request with the bytes
//! the real one sent for the same method and path, and keeps what it was asked.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The recorder's `DIGITS`: 3,000 dense digits, which llama-cpp-python counts as 3,001 tokens,
/// over the 2,048-token window the recorded server ran with.
pub fn digits() -> String {
    (0..3000)
        .map(|i| char::from(b'0' + ((i * 7) % 10) as u8))
        .collect()
}

/// The one chat request in `bodies` went out after the dense message was refused: without it,
/// with "Say hi.", asking for no more output than the 2,048-token window leaves.
pub fn assert_asked_without_the_digits(bodies: &[Value]) {
    assert_eq!(bodies.len(), 1);
    let sent = bodies[0]["messages"].to_string();
    assert!(
        !sent.contains(&digits()[..64]),
        "the refused message was replayed: {sent}"
    );
    assert!(sent.contains("Say hi."), "{sent}");
    let max_tokens = bodies[0]["max_tokens"].as_u64().unwrap();
    assert!(
        max_tokens < 2048,
        "max_tokens {max_tokens} over the 2,048-token window"
    );
}

/// One HTTP/1.1 request as a test server read it: the body parsed as JSON (`null` if it is not).
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Names lowercased.
    pub headers: HashMap<String, String>,
    pub body: Value,
}

/// Reads one request (head, then a body of its `content-length`); `None` when the client
/// closed the connection first.
pub async fn read_request(sock: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let method = first.next().unwrap_or_default().to_string();
    let path = first.next().unwrap_or_default().to_string();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[end + 4..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(Some(Request {
        method,
        path,
        headers,
        body,
    }))
}

/// One recorded case: where it came from and its exchanges.
#[derive(Clone, Debug)]
pub struct Fixture {
    pub server: String,
    pub model: String,
    pub exchanges: Vec<Exchange>,
}

#[derive(Clone, Debug)]
pub struct Exchange {
    pub method: String,
    pub path: String,
    /// The request the recorder sent.
    pub request: Value,
    pub status: u16,
    pub content_type: String,
    /// The body as received (HTTP chunking removed).
    pub body: String,
    /// The server ended the body properly (else it dropped the connection mid-body).
    pub clean: bool,
}

pub const LLAMA_CPP_PYTHON: &str = "llama-cpp-python-0.3.36";

/// Loads `tests/fixtures/<dir>/<case>.json`.
pub fn fixture(dir: &str, case: &str) -> Fixture {
    // Through the crate directory's parent, so the binary's tests can load them too.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../harness-router/tests/fixtures")
        .join(dir)
        .join(format!("{case}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    let exchanges = v["exchanges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| Exchange {
            method: e["request"]["method"].as_str().unwrap().to_string(),
            path: e["request"]["path"].as_str().unwrap().to_string(),
            request: e["request"]["body"].clone(),
            status: e["response"]["status"].as_u64().unwrap() as u16,
            content_type: e["response"]["content_type"]
                .as_str()
                .unwrap_or("application/json")
                .to_string(),
            body: e["response"]["body"].as_str().unwrap().to_string(),
            clean: e["response"]["ended"].as_str().unwrap_or("clean") == "clean",
        })
        .collect();
    Fixture {
        server: v["server"].as_str().unwrap().to_string(),
        model: v["model"].as_str().unwrap().to_string(),
        exchanges,
    }
}

/// What the replay server was asked.
#[derive(Clone, Debug)]
pub struct Asked {
    pub method: String,
    pub path: String,
    pub body: Value,
}

/// A local server answering with recorded exchanges. Each request takes the first unused
/// exchange of its method and path; a GET may be answered again (a server's model list does
/// not change). A request nothing was recorded for gets a 404 like the real server's.
pub struct Replay {
    /// The base URL, without `/v1`.
    pub url: String,
    asked: Arc<Mutex<Vec<Asked>>>,
    /// The most requests that were being answered at the same moment.
    most_at_once: Arc<std::sync::atomic::AtomicUsize>,
}

/// How the replay server answers.
#[derive(Clone, Copy, Default)]
struct Pace {
    /// A pause between the pieces of a body, so a stream takes as long as a real one would.
    piece: std::time::Duration,
}

impl Replay {
    pub async fn start(exchanges: Vec<Exchange>) -> Replay {
        Replay::start_paced(exchanges, std::time::Duration::ZERO).await
    }

    /// [`start`](Replay::start), pausing `piece` between the pieces of every body (two streams
    /// asked for at once then overlap unless the client queues them).
    pub async fn start_paced(exchanges: Vec<Exchange>, piece: std::time::Duration) -> Replay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let asked = Arc::new(Mutex::new(Vec::new()));
        let pool: Arc<Mutex<Vec<(Exchange, bool)>>> = Arc::new(Mutex::new(
            exchanges.into_iter().map(|e| (e, false)).collect(),
        ));
        let most_at_once = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let now = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let pace = Pace { piece };
        let (a, most) = (asked.clone(), most_at_once.clone());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (a, pool, most, now) = (a.clone(), pool.clone(), most.clone(), now.clone());
                tokio::spawn(async move {
                    let _ = serve(sock, a, pool, pace, (most, now)).await;
                });
            }
        });
        Replay {
            url,
            asked,
            most_at_once,
        }
    }

    pub fn asked(&self) -> Vec<Asked> {
        self.asked.lock().unwrap().clone()
    }

    /// The most requests answered at the same moment so far.
    pub fn most_at_once(&self) -> usize {
        self.most_at_once.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The JSON bodies of the chat requests, in order.
    pub fn chat_bodies(&self) -> Vec<Value> {
        self.asked()
            .into_iter()
            .filter(|a| a.path.ends_with("/chat/completions"))
            .map(|a| a.body)
            .collect()
    }
}

type Gauge = (
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<std::sync::atomic::AtomicUsize>,
);

async fn serve(
    mut sock: TcpStream,
    asked: Arc<Mutex<Vec<Asked>>>,
    pool: Arc<Mutex<Vec<(Exchange, bool)>>>,
    pace: Pace,
    (most, now): Gauge,
) -> std::io::Result<()> {
    let Some(Request {
        method, path, body, ..
    }) = read_request(&mut sock).await?
    else {
        return Ok(());
    };
    asked.lock().unwrap().push(Asked {
        method: method.clone(),
        path: path.clone(),
        body: body.clone(),
    });
    let reply = {
        let mut pool = pool.lock().unwrap();
        // The exchange recorded for this very request first, else the next one of its method
        // and path. A GET, or a token count, may be answered again: the server's model list
        // does not change, and it counts the same text the same way.
        let again = |e: &Exchange| e.method == "GET" || e.path.contains("tokenize");
        let at = pool
            .iter()
            .position(|(e, used)| {
                !*used && e.method == method && e.path == path && e.request == body
            })
            .or_else(|| {
                pool.iter()
                    .position(|(e, used)| !*used && e.method == method && e.path == path)
            });
        at.map(|i| {
            let (e, used) = &mut pool[i];
            *used = !again(e);
            e.clone()
        })
    };
    let Some(e) = reply else {
        let body = r#"{"detail":"Not Found"}"#;
        let resp = format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(resp.as_bytes()).await?;
        return Ok(());
    };
    let head = format!(
        "HTTP/1.1 {} X\r\ncontent-type: {}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
        e.status, e.content_type
    );
    use std::sync::atomic::Ordering::SeqCst;
    let at_once = now.fetch_add(1, SeqCst) + 1;
    most.fetch_max(at_once, SeqCst);
    let written = async {
        sock.write_all(head.as_bytes()).await?;
        // The body in the pieces a server flushes: one SSE event (or the whole document) at a time.
        for piece in e.body.split_inclusive("\n\n") {
            if !piece.is_empty() {
                if !pace.piece.is_zero() {
                    tokio::time::sleep(pace.piece).await;
                }
                sock.write_all(format!("{:x}\r\n{piece}\r\n", piece.len()).as_bytes())
                    .await?;
            }
        }
        std::io::Result::Ok(())
    }
    .await;
    now.fetch_sub(1, SeqCst);
    written?;
    if e.clean {
        sock.write_all(b"0\r\n\r\n").await?;
    }
    sock.flush().await?;
    Ok(())
}
