//! The receiving side: WebSocket clients (tokio-tungstenite, as a real local
//! client would be) over the broker's unix socket or straight to the gateway
//! over TCP, and bare readers for the ceiling. Each counts the events it got
//! and, while a measurement window is open, the latency of each one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::source::latency_of;

/// How long a client may take to open and finish its handshake.
pub const HANDSHAKE_PATIENCE: Duration = Duration::from_secs(10);

/// The clients' read buffer. tungstenite zeroes as much of its read buffer
/// as it may read into before every read (its default: 128 KiB), which made
/// the bench's own clients spend a third of their CPU in `memset`, on the
/// cores the broker measured beside them needs; 16 KiB holds dozens of
/// the events measured here per read.
const CLIENT_READ_BUFFER_BYTES: usize = 16 * 1024;

/// Latencies from 1 µs to 60 s in nanoseconds, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// What one reader has received.
#[derive(Debug)]
pub struct ReaderStat {
    pub received: AtomicU64,
    pub bytes: AtomicU64,
    /// A stalled reader never reads; the source does not wait for it.
    pub healthy: bool,
    latencies: Mutex<Histogram<u64>>,
}

impl ReaderStat {
    fn record(&self, frame: &[u8], measuring: bool) {
        if let Some(latency) = latency_of(frame) {
            self.count(latency, frame.len(), measuring);
        } // else not a bench event (e.g. a broker notice)
    }

    /// Counts one event (or round trip) and its latency in nanoseconds.
    pub fn count(&self, latency: u64, bytes: usize, measuring: bool) {
        self.received.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if measuring {
            let mut hist = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
            hist.saturating_record(latency);
        }
    }
}

struct ReceiversInner {
    stats: Vec<Arc<ReaderStat>>,
    measuring: AtomicBool,
}

/// Every reader of one run, shared by the readers, the source (which never
/// runs more than a window ahead of the slowest healthy one) and the harness.
#[derive(Clone)]
pub struct Receivers(Arc<ReceiversInner>);

impl Receivers {
    pub fn new(healthy: usize, stalled: usize) -> Receivers {
        let stat = |healthy| {
            Arc::new(ReaderStat {
                received: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                healthy,
                latencies: Mutex::new(new_histogram()),
            })
        };
        let stats = (0..healthy)
            .map(|_| stat(true))
            .chain((0..stalled).map(|_| stat(false)))
            .collect();
        Receivers(Arc::new(ReceiversInner {
            stats,
            measuring: AtomicBool::new(false),
        }))
    }

    pub fn all(&self) -> &[Arc<ReaderStat>] {
        &self.0.stats
    }

    pub fn healthy(&self) -> impl Iterator<Item = &Arc<ReaderStat>> {
        self.0.stats.iter().filter(|s| s.healthy)
    }

    /// Events received by the slowest healthy reader.
    pub fn slowest_healthy(&self) -> u64 {
        self.healthy()
            .map(|s| s.received.load(Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    }

    /// (events, bytes) received by the healthy readers so far.
    pub fn healthy_totals(&self) -> (u64, u64) {
        self.healthy().fold((0, 0), |(n, b), s| {
            (
                n + s.received.load(Ordering::Relaxed),
                b + s.bytes.load(Ordering::Relaxed),
            )
        })
    }

    pub fn measuring(&self) -> bool {
        self.0.measuring.load(Ordering::Relaxed)
    }

    /// Opens a measurement window: latencies recorded from now on.
    pub fn open_window(&self) {
        for s in self.healthy() {
            s.latencies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .reset();
        }
        self.0.measuring.store(true, Ordering::Relaxed);
    }

    /// Closes the window; returns the healthy readers' latencies merged.
    pub fn close_window(&self) -> Histogram<u64> {
        self.0.measuring.store(false, Ordering::Relaxed);
        let mut all = new_histogram();
        for s in self.healthy() {
            let hist = s.latencies.lock().unwrap_or_else(|p| p.into_inner());
            let _ = all.add(&*hist);
        }
        all
    }
}

/// The connect frame a local client sends (the broker injects the token upstream).
pub fn connect_frame(token: Option<&str>) -> String {
    // Every operator scope, as the openclaw CLI asks: the bench event ("bench")
    // is not in the gateway's guard table, so only admin clients receive it.
    let mut frame = json!({"type":"req","id":"c1","method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"cli","version":"bench","platform":"linux","mode":"cli"},
        "role":"operator","scopes":["operator.admin","operator.read","operator.write"]}});
    if let Some(token) = token {
        frame["params"]["auth"] = json!({ "token": token });
    }
    frame.to_string()
}

pub type Ws<S> = tokio_tungstenite::WebSocketStream<S>;

/// Opens a WebSocket on `stream` and completes the gateway handshake
/// (challenge, connect, `hello-ok`).
pub async fn handshake<S>(stream: S, token: Option<&str>) -> Result<Ws<S>, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let work = async {
        let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
            .read_buffer_size(CLIENT_READ_BUFFER_BYTES);
        let (mut ws, _) =
            tokio_tungstenite::client_async_with_config("ws://localhost/ws", stream, Some(config))
                .await
                .map_err(|e| format!("upgrade: {e}"))?;
        let mut sent = false;
        loop {
            let msg = ws
                .next()
                .await
                .ok_or("closed during the handshake")?
                .map_err(|e| format!("handshake read: {e}"))?;
            let Message::Text(text) = msg else { continue };
            let frame: Value = serde_json::from_str(text.as_str()).unwrap_or_default();
            if frame["event"] == "connect.challenge" && !sent {
                ws.send(Message::text(connect_frame(token)))
                    .await
                    .map_err(|e| format!("send connect: {e}"))?;
                sent = true;
            } else if frame["type"] == "res" && frame["id"] == "c1" {
                return if frame["ok"] == true {
                    Ok(ws)
                } else {
                    Err(format!("connect refused: {}", frame["error"]))
                };
            }
        }
    };
    tokio::time::timeout(HANDSHAKE_PATIENCE, work)
        .await
        .map_err(|_| "handshake timed out".to_owned())?
}

/// Reads events until the connection ends.
pub async fn read_ws<S>(mut ws: Ws<S>, receivers: Receivers, slot: usize)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let stat = Arc::clone(&receivers.all()[slot]);
    while let Some(Ok(msg)) = ws.next().await {
        match msg {
            Message::Text(text) => stat.record(text.as_bytes(), receivers.measuring()),
            Message::Close(_) => break,
            _ => {}
        }
    }
}

/// A client that completed its handshake and then never reads again.
pub async fn stall<S>(ws: Ws<S>, until: CancellationToken) {
    until.cancelled().await;
    drop(ws);
}

/// The ceiling's reader: bytes off a unix socket, cut into frames by their
/// 4-byte WebSocket header (no WebSocket library, no JSON).
pub async fn read_raw(mut stream: tokio::net::UnixStream, receivers: Receivers, slot: usize) {
    let stat = Arc::clone(&receivers.all()[slot]);
    let mut buf = vec![0u8; 256 * 1024];
    let mut filled = 0;
    loop {
        let n = match stream.read(&mut buf[filled..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        filled += n;
        let mut at = 0;
        let measuring = receivers.measuring();
        while let Some((header, len)) = frame_len(&buf[at..filled]) {
            if filled - at < header + len {
                break;
            }
            stat.record(&buf[at + header..at + header + len], measuring);
            at += header + len;
        }
        buf.copy_within(at..filled, 0);
        filled -= at;
    }
}

/// (header length, payload length) of an unmasked frame, if the header is complete.
fn frame_len(b: &[u8]) -> Option<(usize, usize)> {
    match *b.get(1)? {
        126 => Some((4, u16::from_be_bytes([*b.get(2)?, *b.get(3)?]) as usize)),
        127 => {
            let len: [u8; 8] = b.get(2..10)?.try_into().ok()?;
            Some((10, u64::from_be_bytes(len) as usize))
        }
        n => Some((2, n as usize)),
    }
}
