//! The event source: a minimal gateway that speaks just enough of the
//! protocol (challenge, `hello-ok`) and then writes pre-encoded WebSocket
//! event frames straight into its sockets, and the same writer aimed at bare
//! unix sockets (the ceiling).
//!
//! Why not `MockGateway::broadcast`: the double serializes a `serde_json::Value`
//! per event, stamps each connection's frame with `format!`, and queues it on
//! an unbounded channel. It can feed the broker's one connection, but for the
//! direct baseline (100 connections) its own per-connection cost would be
//! what the baseline measures. Every fan-out path uses this source instead,
//! so they differ only by the path; the harness still measures the double's
//! rate to one reader in the same run (the "gateway double itself" line).
//!
//! The writer is one thread doing blocking writes: what it costs is read
//! from that thread's CPU time, and a reader that falls behind slows it
//! through the socket, as a real gateway's kernel buffers would.
//!
//! The same gateway can serve `wss://` ([`GatewayTls`]): the frames are then
//! written through rustls, with the double's TLS configuration
//! (`clawmux_mock::tls_server_config`) and a certificate made here with rcgen.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clawmux::policy::scopes::REQUESTED_SCOPES;
use clawmux_mock::rustls;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::{self, Message};

use crate::clients::Receivers;
use crate::procfs::GATEWAY_THREAD;

/// The event name: not droppable for the broker (only `tick`, `presence`,
/// `heartbeat` and chat deltas are), so every event must reach every client.
pub const EVENT_NAME: &str = "bench";
/// Frames written per socket per write at most.
const BATCH: u64 = 64;

/// Nanoseconds since the first call, on a clock shared by every thread of
/// the process: the source stamps it, readers subtract it.
pub fn now_ns() -> u64 {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Builds the event frames: `{"type":"event","event":"bench","payload":
/// {"t":"<20-digit ns>","pad":"…"},"seq":N}`, padded to the chosen size.
#[derive(Debug, Clone)]
pub struct FrameEncoder {
    pad: String,
}

impl FrameEncoder {
    /// Frames of about `size` bytes of JSON (exact for 6-digit seqs).
    pub fn new(size: usize) -> FrameEncoder {
        let bare = Self { pad: String::new() }.json(0, 100_000).len();
        FrameEncoder {
            pad: "x".repeat(size.saturating_sub(bare)),
        }
    }

    pub fn json(&self, ts: u64, seq: u64) -> Vec<u8> {
        format!(
            r#"{{"type":"event","event":"{EVENT_NAME}","payload":{{"t":"{ts:020}","text":"{}"}},"seq":{seq}}}"#,
            self.pad
        )
        .into_bytes()
    }

    /// Appends one unmasked server-to-client text frame (RFC 6455 §5.2).
    pub fn append_ws_frame(&self, buf: &mut Vec<u8>, ts: u64, seq: u64) {
        let json = self.json(ts, seq);
        buf.push(0x81);
        match json.len() {
            n if n < 126 => buf.push(n as u8),
            n if n <= 0xffff => {
                buf.push(126);
                buf.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                buf.push(127);
                buf.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        buf.extend_from_slice(&json);
    }
}

/// Reads the source timestamp back out of a received frame.
pub fn timestamp_in(frame: &[u8]) -> Option<u64> {
    const KEY: &[u8] = br#""t":""#;
    let head = &frame[..frame.len().min(128)];
    let at = head.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    std::str::from_utf8(frame.get(at..at + 20)?)
        .ok()?
        .parse()
        .ok()
}

/// How fast one phase offers events.
#[derive(Debug, Clone, Copy)]
pub struct Offer {
    /// Events per second (per sink); `None` = as fast as the readers take them.
    pub rate: Option<f64>,
    pub duration: Duration,
}

/// A running source thread and its sockets.
pub struct Source {
    /// `None` once dropped: the thread sees the channel close and ends.
    commands: Option<mpsc::Sender<Offer>>,
    done: tokio::sync::mpsc::UnboundedReceiver<io::Result<u64>>,
    thread: Option<JoinHandle<()>>,
}

/// One destination: a socket and the `seq` its next frame carries.
struct Sink {
    out: Box<dyn Write + Send>,
    seq: u64,
}

impl Source {
    /// Starts offering events; [`finish`](Self::finish) waits for the end.
    pub fn start(&self, offer: Offer) {
        if let Some(commands) = &self.commands {
            let _ = commands.send(offer);
        }
    }

    /// Waits for the offer to end; returns the events offered per sink.
    pub async fn finish(&mut self) -> io::Result<u64> {
        self.done
            .recv()
            .await
            .unwrap_or_else(|| Err(io::Error::other("the source thread is gone")))
    }

    /// Starts the command loop on its own thread once `open` produced the sinks.
    fn spawn(
        open: impl FnOnce() -> io::Result<Vec<Box<dyn Write + Send>>> + Send + 'static,
        receivers: Receivers,
        window: u64,
        frame_bytes: usize,
    ) -> Source {
        let (commands, command_rx) = mpsc::channel();
        let (done_tx, done) = tokio::sync::mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name(GATEWAY_THREAD.into())
            .spawn(move || {
                let mut sinks: Vec<Sink> = match open() {
                    Ok(outs) => outs.into_iter().map(|out| Sink { out, seq: 0 }).collect(),
                    Err(e) => {
                        let _ = done_tx.send(Err(e));
                        return;
                    }
                };
                let encoder = FrameEncoder::new(frame_bytes);
                let mut emitted = 0u64;
                while let Ok(offer) = command_rx.recv() {
                    let result = emit(
                        &mut sinks,
                        &encoder,
                        offer,
                        &receivers,
                        window,
                        &mut emitted,
                    );
                    let _ = done_tx.send(result);
                }
            })
            .expect("spawn the source thread");
        Source {
            commands: Some(commands),
            done,
            thread: Some(thread),
        }
    }

    /// A gateway on loopback TCP that accepts `connections` WebSocket
    /// connections (the broker's one, or every client's) before it writes.
    pub fn gateway(
        connections: usize,
        receivers: Receivers,
        window: u64,
        frame_bytes: usize,
    ) -> io::Result<(Source, SocketAddr)> {
        Source::gateway_with(connections, None, receivers, window, frame_bytes)
    }

    /// The same gateway serving `wss://` with `tls`: every frame is
    /// encrypted on this thread, so "source CPU" includes it.
    pub fn gateway_tls(
        connections: usize,
        tls: &GatewayTls,
        receivers: Receivers,
        window: u64,
        frame_bytes: usize,
    ) -> io::Result<(Source, SocketAddr)> {
        Source::gateway_with(
            connections,
            Some(tls.clone()),
            receivers,
            window,
            frame_bytes,
        )
    }

    fn gateway_with(
        connections: usize,
        tls: Option<GatewayTls>,
        receivers: Receivers,
        window: u64,
        frame_bytes: usize,
    ) -> io::Result<(Source, SocketAddr)> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let open = move || {
            (0..connections)
                .map(|_| accept_session(&listener, tls.as_ref()))
                .collect()
        };
        Ok((Source::spawn(open, receivers, window, frame_bytes), addr))
    }

    /// The ceiling: the same frames written to bare unix sockets.
    pub fn raw(
        sockets: Vec<std::os::unix::net::UnixStream>,
        receivers: Receivers,
        window: u64,
        frame_bytes: usize,
    ) -> Source {
        let open = move || {
            Ok(sockets
                .into_iter()
                .map(|s| Box::new(s) as Box<dyn Write + Send>)
                .collect())
        };
        Source::spawn(open, receivers, window, frame_bytes)
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        // Closing the command channel ends the thread, which closes the sockets.
        self.commands = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Writes events until the offer's time is up. Never more than `window`
/// events ahead of the slowest healthy reader, so no queue on the path can
/// grow past `window` frames: "as fast as possible" is then the rate the
/// whole path sustains, not how fast a queue can be filled.
fn emit(
    sinks: &mut [Sink],
    encoder: &FrameEncoder,
    offer: Offer,
    receivers: &Receivers,
    window: u64,
    emitted: &mut u64,
) -> io::Result<u64> {
    let start = Instant::now();
    let until = start + offer.duration;
    let first = *emitted;
    let mut buf = Vec::with_capacity(BATCH as usize * 400);
    loop {
        let now = Instant::now();
        if now >= until {
            return Ok(*emitted - first);
        }
        let mut n = BATCH;
        if let Some(rate) = offer.rate {
            let due = ((now - start).as_secs_f64() * rate) as u64;
            n = n.min(due.saturating_sub(*emitted - first));
        }
        let ahead = emitted.saturating_sub(receivers.slowest_healthy());
        n = n.min(window.saturating_sub(ahead));
        if n == 0 {
            // Paced and early, or the window is full: a short nap, not a spin
            // (the readers need the CPU).
            std::thread::sleep(Duration::from_micros(20));
            continue;
        }
        let ts = now_ns();
        for sink in sinks.iter_mut() {
            buf.clear();
            for k in 1..=n {
                encoder.append_ws_frame(&mut buf, ts, sink.seq + k);
            }
            sink.seq += n;
            sink.out.write_all(&buf)?;
        }
        *emitted += n;
    }
}

/// A `wss://` gateway's TLS side: the server configuration and the pin
/// the broker is given for it (`settings.tls.fingerprint`, as
/// `--tls-fingerprint` sets it).
#[derive(Clone)]
pub struct GatewayTls {
    server: Arc<rustls::ServerConfig>,
    /// The certificate's SHA-256, 64 lowercase hex digits.
    pub fingerprint: String,
    /// What the first handshake settled on ("TLSv1_3, TLS13_AES_256_GCM_SHA384").
    negotiated: Arc<std::sync::OnceLock<String>>,
}

impl GatewayTls {
    /// A fresh self-signed certificate for `localhost` and `127.0.0.1`
    /// (rcgen: ECDSA P-256), served with the double's TLS configuration
    /// (`clawmux_mock::tls_server_config`: rustls with ring, TLS 1.2 and 1.3).
    /// What the broker negotiated is [`negotiated`](Self::negotiated).
    pub fn self_signed() -> io::Result<GatewayTls> {
        let made = rcgen::generate_simple_self_signed(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
        ])
        .map_err(io::Error::other)?;
        let server =
            clawmux_mock::tls_server_config(&made.cert.pem(), &made.signing_key.serialize_pem())?;
        let fingerprint = clawmux::upstream::tls::fingerprint_of(made.cert.der());
        let fingerprint = clawmux::upstream::tls::normalize_fingerprint(&fingerprint)
            .ok_or_else(|| io::Error::other("rcgen made a certificate without a fingerprint"))?;
        Ok(GatewayTls {
            server,
            fingerprint,
            negotiated: Arc::default(),
        })
    }

    /// The protocol version and cipher suite of the first session, once there was one.
    pub fn negotiated(&self) -> Option<&str> {
        self.negotiated.get().map(String::as_str)
    }
}

/// One accepted gateway connection after the handshake: the socket (or,
/// with `tls`, the rustls stream over it), written to directly from now on
/// (server frames are not masked).
fn accept_session(
    listener: &TcpListener,
    tls: Option<&GatewayTls>,
) -> io::Result<Box<dyn Write + Send>> {
    let tcp = accept_within(listener, ACCEPT_PATIENCE)?;
    tcp.set_nonblocking(false)?;
    tcp.set_nodelay(true)?;
    // The handshakes (TLS, WebSocket, connect) are the only reads: a peer
    // that stops answering fails the run instead of blocking it.
    tcp.set_read_timeout(Some(ACCEPT_PATIENCE))?;
    Ok(match tls {
        None => Box::new(gateway_handshake(tcp)?),
        Some(tls) => {
            let conn =
                rustls::ServerConnection::new(tls.server.clone()).map_err(io::Error::other)?;
            let stream = gateway_handshake(rustls::StreamOwned::new(conn, tcp))?;
            if let (Some(version), Some(suite)) = (
                stream.conn.protocol_version(),
                stream.conn.negotiated_cipher_suite(),
            ) {
                let _ = tls
                    .negotiated
                    .set(format!("{version:?}, {:?}", suite.suite()));
            }
            Box::new(stream)
        }
    })
}

/// The WebSocket upgrade, the challenge and `hello-ok` on `stream`.
fn gateway_handshake<S: Read + Write>(stream: S) -> io::Result<S> {
    let mut ws = tungstenite::accept(stream).map_err(|e| io::Error::other(e.to_string()))?;
    let ws_err = |e: tungstenite::Error| io::Error::other(e.to_string());
    let challenge = json!({"type":"event","event":"connect.challenge",
        "payload":{"nonce": uuid::Uuid::new_v4().to_string(), "ts": clawmux::protocol::now_ms()}});
    ws.send(Message::text(challenge.to_string()))
        .map_err(ws_err)?;
    let connect_id = loop {
        if let Message::Text(text) = ws.read().map_err(ws_err)? {
            let frame: Value = serde_json::from_str(text.as_str()).unwrap_or_default();
            if frame["method"] == "connect" {
                break frame["id"].clone();
            }
        }
    };
    ws.send(Message::text(
        json!({"type":"res","id":connect_id,"ok":true,"payload":hello_ok()}).to_string(),
    ))
    .map_err(ws_err)?;
    Ok(ws.into_inner())
}

/// How long the gateway waits for each expected connection, and for each
/// read of its handshake.
const ACCEPT_PATIENCE: Duration = Duration::from_secs(10);

/// `accept` with a deadline, so a run whose clients never come does not
/// leave the source thread blocked forever.
fn accept_within(listener: &TcpListener, patience: Duration) -> io::Result<TcpStream> {
    let deadline = Instant::now() + patience;
    loop {
        match listener.accept() {
            Ok((tcp, _)) => return Ok(tcp),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no connection came to the bench gateway",
                ));
            }
            Err(e) => return Err(e),
        }
    }
}

fn hello_ok() -> Value {
    json!({
        "type": "hello-ok",
        "protocol": 4,
        "server": {"version": "bench", "connId": uuid::Uuid::new_v4().to_string()},
        "features": {"methods": ["health"], "events": [EVENT_NAME]},
        "snapshot": {"presence": [], "health": {}, "stateVersion": {"presence": 1, "health": 1},
                     "sessionDefaults": {"defaultAgentId": "main", "mainKey": "main",
                                         "mainSessionKey": "agent:main:main", "scope": "per-sender"}},
        "policy": {"maxPayload": 26_214_400, "maxBufferedBytes": 52_428_800,
                   // Long enough that the broker's silence watchdog never fires between phases.
                   "tickIntervalMs": 600_000},
        "auth": {"role": "operator", "scopes": REQUESTED_SCOPES},
    })
}

/// For readers: how long ago the source stamped this frame.
pub fn latency_of(frame: &[u8]) -> Option<u64> {
    timestamp_in(frame).map(|ts| now_ns().saturating_sub(ts))
}
