//! The accept loop of `harness serve`, in place of `axum::serve`, which offers neither a
//! header-read timeout nor a bound on connections.
//!
//! * A connection that has not sent a whole request head within the header-read timeout is
//!   closed (hyper's own timer), so a slow client cannot hold a socket and a task forever.
//! * One client address holds at most `max_connections_per_client` connections. Past that a
//!   new connection gets an immediate `429 harness/too_many_connections` and is closed; the
//!   client's other connections and every other client are served as before.
//! * On shutdown the listener closes, open connections finish their request in flight (keep-alive
//!   ends) for up to [`SHUTDOWN_GRACE`], and whatever is still open after that (an event stream
//!   never finishes by itself) is dropped. In-flight steps live in the queue, not in a connection.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::connect_info::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower_service::Service;

/// Time a client has to send a whole request head when none is configured.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Connections one client address may hold open when none is configured: room for a local
/// tool that runs a hundred sessions at once over its own connections, few enough that one
/// client cannot take every descriptor of the process.
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: usize = 256;
/// How long open connections get to finish after the shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long a refused connection is drained before it is closed, so that the client reads the
/// refusal instead of a reset caused by the request bytes we never read.
const REFUSAL_DRAIN: Duration = Duration::from_secs(1);

/// The bounds the accept loop enforces.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub max_connections_per_client: usize,
}

/// Why `serve` will not start with the limits given.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    #[error("harness/invalid_request: --max-connections-per-client: must be at least 1")]
    NoConnections,
    #[error("harness/invalid_request: --header-read-timeout-ms: must be at least 1")]
    NoTimeout,
}

impl Limits {
    pub fn new(
        header_read_timeout_ms: u64,
        max_connections_per_client: usize,
    ) -> Result<Limits, LimitsError> {
        if max_connections_per_client == 0 {
            return Err(LimitsError::NoConnections);
        }
        if header_read_timeout_ms == 0 {
            return Err(LimitsError::NoTimeout);
        }
        Ok(Limits {
            header_read_timeout: Duration::from_millis(header_read_timeout_ms),
            max_connections_per_client,
        })
    }
}

/// Open connections by client address.
type Counts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// One open connection's slot; dropping it (the connection task ended) frees the slot.
struct Slot {
    counts: Counts,
    client: IpAddr,
}

impl Slot {
    fn take(counts: &Counts, client: IpAddr, max: usize) -> Option<Slot> {
        let mut open = counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(client).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Slot {
            counts: counts.clone(),
            client,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.client);
            }
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module doc).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let counts: Counts = Arc::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    match Slot::take(&counts, peer.ip(), limits.max_connections_per_client) {
                        Some(slot) => {
                            connections.spawn(connection(
                                stream, peer, app.clone(), limits, stop_rx.clone(), slot,
                            ));
                        }
                        None => {
                            connections.spawn(refuse(stream, peer, limits.max_connections_per_client));
                        }
                    }
                }
                Err(e) => {
                    // Out of descriptors, most likely: give connections time to close instead
                    // of spinning on accept.
                    tracing::warn!(error = %e, "harness: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::info!(
            open = connections.len(),
            "harness: closing connections still open after the shutdown grace"
        );
    }
    connections.shutdown().await;
}

/// Serves one connection with HTTP/1.1 under the header-read timeout.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    _slot: Slot,
) {
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        // What `into_make_service_with_connect_info` would insert: the guard reads it.
        req.extensions_mut().insert(ConnectInfo(peer));
        let mut app = app.clone();
        async move {
            let res: Result<axum::response::Response, Infallible> =
                app.call(req.map(axum::body::Body::new)).await;
            res
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(%peer, error = %e, "harness: connection ended with an error");
                }
                return;
            }
            changed = stop.changed(), if !stopping => {
                if changed.is_err() || *stop.borrow() {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Answers a connection over the per-client cap and closes it.
async fn refuse(mut stream: TcpStream, peer: SocketAddr, max: usize) {
    let body = serde_json::json!({"error": {
        "code": "harness/too_many_connections",
        "message": format!("{} already has {max} open connections; close one first", peer.ip()),
    }})
    .to_string();
    let answer = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_DRAIN, async {
        if stream.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}
