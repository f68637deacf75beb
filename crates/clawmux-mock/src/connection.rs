//! One accepted WebSocket: a reader task that runs the handshake and
//! dispatches requests, and a writer task that owns the socket's sink, the
//! connection's `seq` counter and its `tick` timer.
//!
//! Everything destined for the client goes through the writer's queue, so a
//! response queued before an event is delivered before it, and `seq` is
//! stamped in delivery order.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::{sleep, sleep_until, Instant, Interval, MissedTickBehavior};
use tokio_tungstenite::tungstenite::protocol::frame::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use super::handshake::{self, AdmissionInput, Admitted, ConnectError, PREAUTH_MAX_BYTES};
use super::methods::{self, GATEWAY_EVENTS, IMPLEMENTED_METHODS};
use super::origin::Upgrade;
use super::state::{
    lock, now_ms, res_frame, ConnCtl, ConnEntry, EncodedEvent, Inner, Outbound, Session,
};

/// How long a closing connection waits for the peer's close reply before the
/// socket is dropped (the real server's `ws` library waits 30 s).
pub(crate) const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Writer: how many queued frames are written before one flush.
const WRITE_BATCH: usize = 64;

/// A byte stream the double serves: TCP on loopback, or a unix socket (the
/// demo's double, so `serve --demo` opens no TCP port at all).
pub(crate) trait Io:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static
{
}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> Io for T {}

type WsSink = SplitSink<WebSocketStream<Box<dyn Io>>, Message>;
type WsSource = SplitStream<WebSocketStream<Box<dyn Io>>>;

/// Whether the reader keeps going after a frame.
enum Flow {
    Continue,
    Stop,
}

/// Deregisters the connection and stops its writer however the reader ends,
/// including when its task is aborted or panics.
struct ConnGuard {
    inner: Arc<Inner>,
    index: u64,
    writer: AbortHandle,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.inner.deregister(self.index);
        self.writer.abort();
    }
}

/// Serves one accepted TCP connection until it closes.
pub(crate) async fn serve(inner: Arc<Inner>, tcp: TcpStream) {
    let _ = tcp.set_nodelay(true);
    serve_io(inner, Box::new(tcp)).await;
}

/// Serves one accepted connection of any kind until it closes.
pub(crate) async fn serve_io(inner: Arc<Inner>, tcp: Box<dyn Io>) {
    // tungstenite's own limits sit above ours, so the double (not the
    // library) decides how oversize frames are answered.
    let limit = (inner.cfg.max_payload as usize)
        .max(PREAUTH_MAX_BYTES)
        .saturating_mul(2);
    let ws_config = WebSocketConfig::default()
        .max_message_size(Some(limit))
        .max_frame_size(Some(limit));
    let mut upgrade = Upgrade::default();
    // The callback's error type is tungstenite's (`ErrorResponse`), not ours.
    #[allow(clippy::result_large_err)]
    let read_upgrade = |req: &tokio_tungstenite::tungstenite::handshake::server::Request, res| {
        let header = |name| {
            req.headers()
                .get(name)
                .and_then(|v: &http::HeaderValue| v.to_str().ok())
                .map(str::to_owned)
        };
        upgrade.origin = header(http::header::ORIGIN);
        upgrade.host = header(http::header::HOST);
        Ok(res)
    };
    let accepted = tokio::time::timeout(
        inner.cfg.handshake_timeout,
        tokio_tungstenite::accept_hdr_async_with_config(tcp, read_upgrade, Some(ws_config)),
    )
    .await;
    let Ok(Ok(ws)) = accepted else { return };
    let opened = Instant::now();
    let (sink, stream) = ws.split();
    let (tx, rx) = mpsc::unbounded_channel();
    let ctl = Arc::new(ConnCtl::default());
    let index = inner.next_index.fetch_add(1, Ordering::AcqRel);
    inner.total_connections.fetch_add(1, Ordering::AcqRel);
    let writer = tokio::spawn(write_loop(sink, rx, inner.clone(), ctl.clone()));
    let _guard = ConnGuard {
        inner: inner.clone(),
        index,
        writer: writer.abort_handle(),
    };
    let conn_id = uuid::Uuid::new_v4().to_string();
    let entry = ConnEntry {
        index,
        tx,
        ctl: ctl.clone(),
        session: None,
        sessions_subscribed: false,
        message_keys: Default::default(),
    };
    let nonce = uuid::Uuid::new_v4().to_string();
    if !inner.faults().no_challenge {
        let mut payload = json!({ "nonce": nonce, "ts": now_ms() });
        if let Some(Value::Object(extra)) = &inner.cfg.challenge_extra {
            for (k, v) in extra {
                payload[k] = v.clone();
            }
        }
        let challenge =
            format!("{{\"type\":\"event\",\"event\":\"connect.challenge\",\"payload\":{payload}}}");
        let len = challenge.len();
        entry.send(Outbound::Frame(challenge), len);
    }
    lock(&inner.conns).insert(index, entry);
    inner.notify_changed();
    // Shutdown sets the flag before it empties the registry: checking after
    // inserting means a connection racing with `stop()` cannot outlive it.
    if *inner.shutdown.borrow() {
        return;
    }
    tracing::debug!(conn = index, conn_id = %conn_id, "mock gateway: connection opened");

    let mut reader = Reader {
        handshake_deadline: opened + inner.cfg.handshake_timeout,
        inner,
        index,
        conn_id,
        ctl,
        nonce,
        upgrade,
        session: None,
        closing_deadline: None,
    };
    reader.run(stream, writer).await;
    tracing::debug!(conn = index, "mock gateway: connection closed");
}

/// The reading half of a connection and its handshake state.
struct Reader {
    inner: Arc<Inner>,
    index: u64,
    conn_id: String,
    ctl: Arc<ConnCtl>,
    /// The nonce of the challenge (kept even when the challenge was suppressed).
    nonce: String,
    /// What the upgrade request said (`Origin`, `Host`).
    upgrade: Upgrade,
    handshake_deadline: Instant,
    /// `Some` after hello-ok.
    session: Option<Session>,
    /// Set once a close frame is queued: when to give up on the peer's reply.
    closing_deadline: Option<Instant>,
}

impl Reader {
    async fn run(&mut self, mut stream: WsSource, writer: tokio::task::JoinHandle<()>) {
        let ctl = self.ctl.clone();
        loop {
            let closing = self.closing_deadline;
            let handshake_pending = self.session.is_none() && closing.is_none();
            let far = Instant::now() + Duration::from_secs(86_400);
            tokio::select! {
                biased;
                _ = ctl.kill.notified() => return,
                _ = ctl.closing.notified(), if closing.is_none() => {
                    self.closing_deadline = Some(Instant::now() + CLOSE_GRACE);
                }
                _ = sleep_until(closing.unwrap_or(far)), if closing.is_some() => return,
                _ = sleep_until(self.handshake_deadline), if handshake_pending => {
                    // No successful connect in time: close 1000 without a reason.
                    self.close(1000, "");
                }
                // A gateway that stopped reading looks again now and then
                // whether the fault was cleared.
                _ = tokio::time::sleep(Duration::from_millis(20)), if self.inner.faults().stop_reading => {}
                next = stream.next(), if !self.inner.faults().stop_reading => match next {
                    None => return,
                    Some(Err(WsError::Capacity(_))) => {
                        self.close(1009, "");
                        let _ = tokio::time::timeout(CLOSE_GRACE, writer).await;
                        return;
                    }
                    Some(Err(_)) => return,
                    Some(Ok(message)) if closing.is_none() => {
                        if let Flow::Stop = self.on_message(message).await {
                            return;
                        }
                    }
                    Some(Ok(_)) => {}
                },
            }
        }
    }

    /// Queues a close frame for this connection and starts the close grace.
    fn close(&mut self, code: u16, reason: &str) {
        if let Some(entry) = lock(&self.inner.conns).get(&self.index) {
            entry.close(code, reason);
        }
        self.closing_deadline
            .get_or_insert(Instant::now() + CLOSE_GRACE);
    }

    async fn on_message(&mut self, message: Message) -> Flow {
        // The real server decodes binary frames as text too (`rawDataToString`).
        let text = match message {
            Message::Text(t) => t.as_str().to_owned(),
            Message::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
            _ => return Flow::Continue,
        };
        if self.session.is_none() {
            self.on_preauth_frame(&text).await
        } else {
            self.on_request_frame(&text);
            Flow::Continue
        }
    }

    /// A frame before hello-ok: must be a valid `connect` (§2.7).
    async fn on_preauth_frame(&mut self, text: &str) -> Flow {
        if text.len() > PREAUTH_MAX_BYTES {
            // The docs name the reason "preauth payload too large", but a real
            // 2026.9.6 gateway's `ws` limit fires first: 1009, empty reason.
            self.close(1009, "");
            return Flow::Continue;
        }
        let Ok(parsed) = serde_json::from_str::<Value>(text) else {
            self.close(1000, "");
            return Flow::Continue;
        };
        if handshake::validate_request_frame(&parsed).is_err() {
            self.close(1008, "invalid request frame");
            return Flow::Continue;
        }
        let id = parsed["id"].clone();
        if parsed["method"] != "connect" {
            self.reject(
                &id,
                ConnectError::invalid("invalid handshake: first request must be connect"),
            );
            return Flow::Continue;
        }
        let params = parsed.get("params").cloned().unwrap_or(Value::Null);
        {
            let mut records = lock(&self.inner.records);
            records.connects.push(params.clone());
            records.connect_origins.push(self.upgrade.origin.clone());
        }
        self.inner.notify_changed();

        if let Some(delay) = self.inner.faults().hello_delay {
            let ctl = self.ctl.clone();
            tokio::select! {
                _ = ctl.kill.notified() => return Flow::Stop,
                _ = sleep_until(self.handshake_deadline) => {
                    self.close(1000, "");
                    return Flow::Continue;
                }
                _ = sleep(delay) => {}
            }
        }
        let faults = {
            let mut faults = lock(&self.inner.faults);
            if faults.unavailable_connects > 0 {
                faults.unavailable_connects -= 1;
                drop(faults);
                self.reject(&id, ConnectError::gateway_starting());
                return Flow::Continue;
            }
            faults.clone()
        };
        if let Some(rejection) = &faults.reject_connect {
            self.reject(&id, rejection.into());
            return Flow::Continue;
        }
        if let Err(why) = handshake::validate_connect_params(&params) {
            self.reject(
                &id,
                ConnectError::invalid(&format!("invalid connect params: {why}")),
            );
            return Flow::Continue;
        }
        let cfg = &self.inner.cfg;
        let admission = {
            let tokens = lock(&self.inner.device_tokens);
            handshake::admit(&AdmissionInput {
                params: &params,
                nonce: &self.nonce,
                now_ms: now_ms(),
                expected_token: cfg.token.as_deref(),
                server_protocol: cfg.protocol,
                verify_device: cfg.verify_device,
                require_device: cfg.require_device,
                device_tokens: &tokens,
                upgrade: &self.upgrade,
            })
        };
        match admission {
            Err(e) => self.reject(&id, e),
            Ok(mut admitted) => {
                if let Some(granted) = faults.grant_scopes {
                    admitted.scopes = granted;
                }
                self.welcome(&id, &params, admitted);
            }
        }
        Flow::Continue
    }

    /// Sends the error `res`, then the close frame.
    fn reject(&mut self, id: &Value, e: ConnectError) {
        tracing::debug!(conn = self.index, error = %e.error, "mock gateway: connect rejected");
        self.inner
            .send_frame(self.index, res_frame(id, Err(&e.error)));
        self.close(e.close_code, &e.close_reason);
    }

    /// Returns the device token for `device_id`, minting one on first use.
    fn device_token_for(&self, device_id: &str) -> String {
        let mut tokens = lock(&self.inner.device_tokens);
        if let Some((token, _)) = tokens.iter().find(|(_, owner)| owner.as_str() == device_id) {
            return token.clone();
        }
        let bytes: [u8; 24] = rand::random();
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let token = format!("dt_{token}");
        tokens.insert(token.clone(), device_id.to_string());
        token
    }

    /// Sends hello-ok and marks the connection ready.
    fn welcome(&mut self, id: &Value, params: &Value, admitted: Admitted) {
        let cfg = &self.inner.cfg;
        let client = &params["client"];
        let mut presence = json!({
            "host": client.get("displayName").unwrap_or(&client["id"]),
            "version": client["version"], "platform": client["platform"], "mode": client["mode"],
            "roles": [admitted.role], "scopes": admitted.scopes, "reason": "connect", "ts": now_ms(),
        });
        for key in ["deviceFamily", "modelIdentifier", "instanceId"] {
            if let Some(v) = client.get(key) {
                presence[key] = v.clone();
            }
        }
        let mut auth = json!({ "method": admitted.auth_method, "role": admitted.role,
                               "scopes": admitted.scopes });
        if let Some(device_id) = &admitted.device_id {
            presence["deviceId"] = json!(device_id);
            presence["instanceId"] = json!(device_id);
            auth["deviceToken"] = json!(self.device_token_for(device_id));
            auth["issuedAtMs"] = json!(now_ms());
        }
        let session = Session {
            role: admitted.role,
            scopes: admitted.scopes,
            caps: admitted.caps,
            device_id: admitted.device_id,
            presence: presence.clone(),
        };
        let health = lock(&self.inner.last_health)
            .clone()
            .unwrap_or_else(|| json!({}));
        let state_version = self.inner.bump_presence();
        {
            let mut conns = lock(&self.inner.conns);
            let presence_rows = self
                .inner
                .presence_rows(&conns, Some((self.index, &presence)));
            let mut hello = json!({
                "type": "hello-ok",
                "protocol": cfg.protocol,
                "server": { "version": cfg.server_version, "connId": self.conn_id },
                "features": {
                    "methods": IMPLEMENTED_METHODS
                        .iter()
                        .filter(|m| !cfg.without_methods.iter().any(|w| w == *m))
                        .collect::<Vec<_>>(),
                    "events": GATEWAY_EVENTS,
                },
                "snapshot": {
                    "presence": presence_rows,
                    "health": health,
                    "stateVersion": state_version.to_json(),
                    "uptimeMs": self.inner.started.elapsed().as_millis() as u64,
                    "sessionDefaults": { "defaultAgentId": "main", "mainKey": "main",
                                         "mainSessionKey": "agent:main:main", "scope": "per-sender" },
                    "authMode": if cfg.token.is_some() { "token" } else { "none" },
                },
                "policy": { "maxPayload": cfg.max_payload, "maxBufferedBytes": cfg.max_buffered_bytes,
                            "tickIntervalMs": cfg.tick_interval_ms },
                "auth": auth,
                // Capability URLs minted per connection, as a 2026.9.6
                // gateway with its canvas plugin advertises them (here the
                // connection's id stands in for the random capability).
                "pluginSurfaceUrls": {
                    "canvas": format!("http://127.0.0.1/__openclaw__/cap/{}", self.conn_id)
                },
            });
            if let Some(replay) = &cfg.replay {
                hello = replay.hello(&self.conn_id, &hello["auth"]);
            }
            let Some(entry) = conns.get_mut(&self.index) else {
                return;
            };
            let faults = self.inner.faults();
            for n in 0..faults.early_events {
                let early = json!({"type": "event", "event": "tick", "payload": {"ts": now_ms(), "early": n}}).to_string();
                let len = early.len();
                entry.send(Outbound::Frame(early), len);
            }
            let frame = res_frame(id, Ok(&hello));
            let len = frame.len();
            // Queue hello-ok before the connection becomes visible to
            // broadcasts, so no event can overtake it.
            entry.send(Outbound::Frame(frame), len);
            entry.send(Outbound::StartTicks, 0);
            entry.session = Some(session.clone());
            if faults.close_after_hello {
                entry.close(1012, "service restart");
            }
        }
        self.session = Some(session);
        self.inner.notify_changed();
        tracing::debug!(conn = self.index, "mock gateway: hello-ok");
        if let Some(replay) = &cfg.replay {
            tokio::spawn(crate::replay::play(
                self.inner.clone(),
                self.index,
                Arc::clone(replay),
            ));
        }
    }

    /// A frame after hello-ok: only `req` frames are valid (§1, §2.1).
    fn on_request_frame(&mut self, text: &str) {
        if text.len() as u64 > self.inner.cfg.max_payload {
            self.close(1009, "");
            return;
        }
        // Invalid JSON after the handshake is logged and ignored.
        let Ok(parsed) = serde_json::from_str::<Value>(text) else {
            return;
        };
        if let Err(why) = handshake::validate_request_frame(&parsed) {
            let id = parsed
                .get("id")
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or_else(|| json!("invalid"));
            let error = json!({ "code": "INVALID_REQUEST", "message": format!("invalid request frame: {why}") });
            methods::respond(&self.inner, self.index, &id, Err(error));
            return;
        }
        lock(&self.inner.records)
            .requests
            .push((self.index, parsed.clone()));
        self.inner.notify_changed();
        let method = parsed["method"].as_str().unwrap_or_default().to_string();
        let faults = self.inner.faults();
        if faults.silent || faults.hold_methods.contains(&method) {
            return;
        }
        let id = parsed["id"].clone();
        if method == "connect" {
            let error = json!({ "code": "INVALID_REQUEST", "message": "connect is only valid as the first request" });
            methods::respond(&self.inner, self.index, &id, Err(error));
            return;
        }
        if let Some((_, error)) = faults.fail_methods.iter().find(|(m, _)| *m == method) {
            methods::respond(&self.inner, self.index, &id, Err(error.clone()));
            return;
        }
        let Some(session) = self.session.clone() else {
            return;
        };
        let params = parsed.get("params").cloned().unwrap_or(Value::Null);
        if let Some(replay) = &self.inner.cfg.replay {
            for frame in replay.answer(&id, &method, &params) {
                self.inner.send_frame(self.index, frame);
            }
            return;
        }
        let (inner, index) = (self.inner.clone(), self.index);
        match faults.response_delay {
            None => methods::handle_request(&inner, index, &session, &id, &method, &params),
            Some(delay) => {
                tokio::spawn(async move {
                    sleep(delay).await;
                    methods::handle_request(&inner, index, &session, &id, &method, &params);
                });
            }
        }
    }
}

/// Resolves at the next tick, or never when ticks have not started.
async fn next_tick(ticker: &mut Option<Interval>) {
    match ticker {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Owns the sink: stamps `seq`, emits ticks, writes frames in queue order.
async fn write_loop(
    mut sink: WsSink,
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    inner: Arc<Inner>,
    ctl: Arc<ConnCtl>,
) {
    let mut seq = 0u64;
    let mut ticker: Option<Interval> = None;
    loop {
        let first = tokio::select! {
            out = rx.recv() => match out {
                Some(out) => out,
                None => return,
            },
            _ = next_tick(&mut ticker) => {
                // Ticks are generated here, never queued, so they do not count
                // against the buffered-bytes budget.
                if inner.faults().silent {
                    continue;
                }
                seq += 1;
                let tick = EncodedEvent::new("tick", &json!({ "ts": now_ms() }), None).frame(seq);
                if sink.send(Message::text(tick)).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let mut batch = vec![first];
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(out) => batch.push(out),
                Err(_) => break,
            }
        }
        for out in batch {
            let message = match out {
                Outbound::Frame(frame) => {
                    ctl.queued_bytes.fetch_sub(frame.len(), Ordering::AcqRel);
                    Message::text(frame)
                }
                Outbound::Event(event) => {
                    seq += 1;
                    ctl.queued_bytes
                        .fetch_sub(event.approx_len(), Ordering::AcqRel);
                    Message::text(event.frame(seq))
                }
                Outbound::FragmentStart(text) => {
                    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
                    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
                    Message::Frame(Frame::message(
                        text.into_bytes(),
                        OpCode::Data(Data::Text),
                        false,
                    ))
                }
                Outbound::FragmentEnd(text) => {
                    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
                    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
                    Message::Frame(Frame::message(
                        text.into_bytes(),
                        OpCode::Data(Data::Continue),
                        true,
                    ))
                }
                Outbound::SkipSeq => {
                    seq += 1;
                    continue;
                }
                Outbound::StartTicks => {
                    let period = Duration::from_millis(inner.cfg.tick_interval_ms.max(1));
                    let mut interval = tokio::time::interval_at(Instant::now() + period, period);
                    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
                    ticker = Some(interval);
                    continue;
                }
                Outbound::Close { code, reason } => {
                    let frame = CloseFrame {
                        code: code.into(),
                        reason: reason.into(),
                    };
                    // Nothing may follow a close frame; the reader waits for the reply.
                    let _ = sink.send(Message::Close(Some(frame))).await;
                    ctl.close_sent.store(true, Ordering::Release);
                    inner.notify_changed();
                    return;
                }
            };
            if sink.feed(message).await.is_err() {
                return;
            }
        }
        if sink.flush().await.is_err() {
            return;
        }
    }
}
