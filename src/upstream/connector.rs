//! The connector task: opens the upstream WebSocket, performs the gateway
//! handshake with the host credential, runs the session, and reconnects.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

use super::{backoff_delay, Outbound, Phase, Status, UpstreamHello, REQUESTED_SCOPES};
use crate::config::{validate_gateway_url, Secret, Settings, UpstreamOptions};
use crate::driver::Driver;
use crate::hub::Hub;
use crate::protocol::frames::encode_req;
use crate::protocol::{ErrorShape, StudioCode, UpstreamFrame, PROTOCOL_MAX, PROTOCOL_MIN};
use crate::router::Router;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Why one connection attempt failed.
struct AttemptError {
    error: ErrorShape,
    /// The gateway refused us for a reason retrying will not fix (auth,
    /// pairing, protocol): back off to the maximum.
    rejected: bool,
    /// The gateway said when to retry (`retryAfterMs`).
    retry_after: Option<Duration>,
}

impl AttemptError {
    fn new(code: StudioCode, message: String) -> Self {
        AttemptError {
            error: ErrorShape::studio(code, message),
            rejected: false,
            retry_after: None,
        }
    }
}

/// How a ready session ended.
struct SessionEnd {
    /// The gateway announced a restart (`shutdown` with `restartExpectedMs`).
    restart_expected: Option<Duration>,
    cancelled: bool,
}

pub(super) struct Connector {
    url: String,
    token: Option<Secret>,
    opts: UpstreamOptions,
    hub: Arc<Hub>,
    router: Arc<Router>,
    driver: Arc<Driver>,
    status: watch::Sender<Status>,
    rx: mpsc::Receiver<Outbound>,
    cancel: CancellationToken,
    instance_id: String,
    next_connect_id: u64,
}

impl Connector {
    pub(super) fn new(
        settings: &Settings,
        hub: Arc<Hub>,
        router: Arc<Router>,
        driver: Arc<Driver>,
        status: watch::Sender<Status>,
        rx: mpsc::Receiver<Outbound>,
        cancel: CancellationToken,
    ) -> Self {
        Connector {
            url: settings.gateway_url.trim().to_owned(),
            token: settings.token.clone(),
            opts: settings.upstream.clone(),
            hub,
            router,
            driver,
            status,
            rx,
            cancel,
            instance_id: uuid::Uuid::new_v4().to_string(),
            next_connect_id: 0,
        }
    }

    fn set_phase(&self, phase: Phase) {
        self.status.send_modify(|s| {
            s.phase = phase;
            if phase != Phase::Backoff {
                s.retry_at = None;
            }
        });
    }

    /// Settings that cannot work: stay `Rejected` until shutdown.
    async fn reject_settings(&self, error: ErrorShape) {
        tracing::error!(code = %error.code, "{}", error.message);
        self.status.send_modify(|s| {
            s.phase = Phase::Rejected;
            s.last_error = Some(error);
        });
        self.cancel.cancelled().await;
    }

    pub(super) async fn run(mut self) {
        if let Err(e) = validate_gateway_url(&self.url) {
            self.reject_settings(e).await;
            self.set_phase(Phase::Stopped);
            return;
        }
        if self.token.is_none() {
            let e = ErrorShape::studio(
                StudioCode::GatewayTokenMissing,
                "no gateway token: set --token, --token-file or CLAWMUX_GATEWAY_TOKEN (the gateway's gateway.auth.token)",
            );
            self.reject_settings(e).await;
            self.set_phase(Phase::Stopped);
            return;
        }
        let mut failures: u32 = 0;
        let mut had_session = false;
        loop {
            self.set_phase(Phase::Connecting);
            let cancel = self.cancel.clone();
            let attempt = tokio::select! {
                _ = cancel.cancelled() => break,
                r = tokio::time::timeout(self.opts.handshake_timeout, self.attempt()) => r,
            };
            let mut phase_after = Phase::Backoff;
            let delay = match attempt {
                Ok(Ok((ws, hello, early))) => {
                    failures = 0;
                    let end = self.run_session(ws, hello, early, had_session).await;
                    had_session = true;
                    if end.cancelled {
                        break;
                    }
                    end.restart_expected.unwrap_or(self.opts.backoff_initial)
                }
                Ok(Err(e)) => {
                    failures += 1;
                    tracing::warn!(code = %e.error.code, failures, "upstream connect failed: {}", e.error.message);
                    let delay = if e.rejected {
                        phase_after = Phase::Rejected;
                        tracing::error!(
                            code = %e.error.code,
                            "the gateway rejected the broker; retrying only every {} s until the settings are fixed",
                            self.opts.backoff_max.as_secs()
                        );
                        self.opts.backoff_max
                    } else {
                        e.retry_after.unwrap_or_else(|| {
                            backoff_delay(
                                self.opts.backoff_initial,
                                self.opts.backoff_max,
                                failures,
                            )
                        })
                    };
                    self.status.send_modify(|s| s.last_error = Some(e.error));
                    delay
                }
                Err(_) => {
                    failures += 1;
                    let e = ErrorShape::studio(
                        StudioCode::UpstreamTimeout,
                        format!(
                            "the gateway at {} did not complete its handshake within {} ms",
                            self.url,
                            self.opts.handshake_timeout.as_millis()
                        ),
                    );
                    tracing::warn!(code = %e.code, failures, "{}", e.message);
                    self.status.send_modify(|s| s.last_error = Some(e));
                    backoff_delay(self.opts.backoff_initial, self.opts.backoff_max, failures)
                }
            };
            let retry_at = Instant::now() + delay;
            self.status.send_modify(|s| {
                s.phase = phase_after;
                s.retry_at = Some(retry_at);
            });
            tracing::info!(
                upstream_phase = phase_after.as_str(),
                delay_ms = delay.as_millis() as u64,
                "next upstream attempt scheduled"
            );
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
        }
        self.set_phase(Phase::Stopped);
    }

    /// Opens the socket and performs the handshake. Events that arrive
    /// before `hello-ok` are returned so they can be published after it.
    async fn attempt(&mut self) -> Result<(Ws, UpstreamHello, Vec<String>), AttemptError> {
        let config = WebSocketConfig::default()
            .max_message_size(None)
            .max_frame_size(None);
        let (mut ws, _) = tokio_tungstenite::connect_async_with_config(self.url.as_str(), Some(config), true)
            .await
            .map_err(|e| {
                AttemptError::new(
                    StudioCode::UpstreamError,
                    format!(
                        "cannot open the gateway connection to {}: {e}; is the gateway running? (start it: openclaw gateway)",
                        self.url
                    ),
                )
            })?;
        self.set_phase(Phase::Handshaking);
        let nonce = loop {
            let text = next_text(&mut ws).await?;
            if let Some(UpstreamFrame::Event { name, payload, .. }) = UpstreamFrame::parse(&text) {
                if name == "connect.challenge" {
                    break payload
                        .and_then(|p| serde_json::from_str::<Value>(p.get()).ok())
                        .and_then(|p| p.get("nonce").and_then(Value::as_str).map(str::to_owned));
                }
            }
        };
        tracing::debug!(has_nonce = nonce.is_some(), "upstream challenge received");
        self.next_connect_id += 1;
        let connect_id = format!("clawmux-connect-{}", self.next_connect_id);
        let params = self.connect_params();
        let raw = serde_json::value::to_raw_value(&params).map_err(|e| {
            AttemptError::new(
                StudioCode::UpstreamError,
                format!("cannot encode connect: {e}"),
            )
        })?;
        ws.send(Message::text(encode_req(
            &connect_id,
            "connect",
            Some(&raw),
        )))
        .await
        .map_err(|e| {
            AttemptError::new(
                StudioCode::UpstreamError,
                format!("cannot send connect: {e}"),
            )
        })?;
        let mut early = Vec::new();
        loop {
            let text = next_text(&mut ws).await?;
            match UpstreamFrame::parse(&text) {
                Some(UpstreamFrame::Res {
                    id,
                    ok,
                    payload,
                    error,
                }) if id == connect_id => {
                    if ok {
                        let payload: Value = payload
                            .and_then(|p| serde_json::from_str(p.get()).ok())
                            .unwrap_or(Value::Null);
                        return Ok((ws, parse_hello(payload), early));
                    }
                    let error: Value = error
                        .and_then(|e| serde_json::from_str(e.get()).ok())
                        .unwrap_or(Value::Null);
                    return Err(rejection(error));
                }
                Some(UpstreamFrame::Event { .. }) => early.push(text),
                _ => {}
            }
        }
    }

    fn connect_params(&self) -> Value {
        let mut params = json!({
            "minProtocol": PROTOCOL_MIN,
            "maxProtocol": PROTOCOL_MAX,
            "client": {
                "id": "gateway-client",
                "displayName": "clawmux",
                "version": env!("CARGO_PKG_VERSION"),
                "platform": std::env::consts::OS,
                "mode": "backend",
                "instanceId": self.instance_id,
            },
            "role": "operator",
            "scopes": REQUESTED_SCOPES,
            "caps": ["tool-events"],
            "userAgent": concat!("clawmux/", env!("CARGO_PKG_VERSION")),
        });
        if let Some(token) = &self.token {
            params["auth"] = json!({ "token": token.expose() });
        }
        params
    }

    async fn run_session(
        &mut self,
        ws: Ws,
        hello: UpstreamHello,
        early: Vec<String>,
        reconnected: bool,
    ) -> SessionEnd {
        let hello = Arc::new(hello);
        if !hello.lost_scopes.is_empty() {
            tracing::warn!(lost = ?hello.lost_scopes, "the gateway granted fewer scopes than requested; some methods will fail");
        }
        let tick = hello
            .payload
            .pointer("/policy/tickIntervalMs")
            .and_then(Value::as_u64)
            .unwrap_or(30_000);
        let silence_limit = Duration::from_millis(tick.saturating_mul(2).max(1));
        self.hub.reset_snapshot(
            hello
                .payload
                .get("snapshot")
                .cloned()
                .unwrap_or(Value::Null),
        );
        let mut epoch = 0;
        self.status.send_modify(|s| {
            s.epoch += 1;
            epoch = s.epoch;
            s.phase = Phase::Ready;
            s.hello = Some(Arc::clone(&hello));
            s.last_error = None;
            s.retry_at = None;
            if reconnected {
                s.reconnects += 1;
            }
        });
        tracing::info!(upstream_phase = "ready", epoch, server_version = %hello.server_version, protocol = hello.protocol, "upstream session ready");
        if reconnected {
            // Everything that happened while we were away is unknown to the
            // clients: a gap makes them resync, the event says why.
            self.hub.gap();
            self.hub.publish_local(
                "clawmux.upstream",
                &json!({"phase": "ready", "serverVersion": hello.server_version, "reason": "reconnected"}),
            );
        }
        let mut last_seq: Option<u64> = None;
        let mut restart_expected = None;
        for text in &early {
            self.on_frame(text, &mut last_seq, &mut restart_expected);
        }
        let (mut sink, mut stream) = ws.split();
        // Connection-scoped subscriptions died with the old session.
        for (i, (method, params)) in self.driver.resubscribe().into_iter().enumerate() {
            let raw = serde_json::value::to_raw_value(&params).ok();
            let id = format!("clawmux-resubscribe-{epoch}-{i}");
            let _ = sink
                .feed(Message::text(encode_req(&id, method, raw.as_deref())))
                .await;
        }
        let _ = sink.flush().await;
        let mut last_rx = Instant::now();
        let end_reason: String;
        let mut cancelled = false;
        loop {
            let watchdog = tokio::time::sleep_until((last_rx + silence_limit).into());
            tokio::select! {
                msg = stream.next() => {
                    last_rx = Instant::now();
                    match msg {
                        Some(Ok(Message::Text(text))) => {
                            self.on_frame(text.as_str(), &mut last_seq, &mut restart_expected);
                        }
                        Some(Ok(Message::Close(frame))) => {
                            end_reason = match frame {
                                Some(f) => format!("gateway closed the connection ({}): {}", u16::from(f.code), f.reason),
                                None => "gateway closed the connection".into(),
                            };
                            break;
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => {
                            end_reason = format!("gateway connection failed: {e}");
                            break;
                        }
                        None => {
                            end_reason = "gateway connection ended".into();
                            break;
                        }
                    }
                }
                out = self.rx.recv() => {
                    let Some(out) = out else {
                        end_reason = "broker stopping".into();
                        cancelled = true;
                        break;
                    };
                    if let Err(e) = self.write_batch(&mut sink, epoch, out).await {
                        end_reason = format!("cannot write to the gateway: {e}");
                        break;
                    }
                }
                _ = watchdog => {
                    end_reason = format!("no frame from the gateway for {} ms (2 x tickIntervalMs)", silence_limit.as_millis());
                    let _ = sink.send(Message::Close(Some(CloseFrame { code: CloseCode::from(4000), reason: "tick timeout".into() }))).await;
                    break;
                }
                _ = self.cancel.cancelled() => {
                    end_reason = "broker stopping".into();
                    cancelled = true;
                    let _ = sink.send(Message::Close(Some(CloseFrame { code: CloseCode::Normal, reason: "broker stopping".into() }))).await;
                    break;
                }
            }
        }
        tracing::warn!(epoch, "upstream session ended: {end_reason}");
        let retry_ms = restart_expected
            .unwrap_or(self.opts.backoff_initial)
            .as_millis() as u64;
        let error = ErrorShape::studio(
            StudioCode::UpstreamClosed,
            format!("the gateway session ended before the answer: {end_reason}"),
        )
        .with_retry_after_ms((!cancelled).then_some(retry_ms));
        self.status.send_modify(|s| {
            s.phase = if cancelled {
                Phase::Stopped
            } else {
                Phase::Backoff
            };
            s.hello = None;
            s.last_error = Some(ErrorShape::studio(
                StudioCode::UpstreamClosed,
                end_reason.clone(),
            ));
        });
        let failed = self.router.fail_epoch(epoch, &error);
        if failed > 0 {
            tracing::info!(epoch, failed, "failed pending requests of the lost session");
        }
        if !cancelled {
            self.hub.publish_local(
                "clawmux.upstream",
                &json!({"phase": "backoff", "serverVersion": hello.server_version, "reason": end_reason}),
            );
        }
        SessionEnd {
            restart_expected,
            cancelled,
        }
    }

    /// Writes one request and any others already queued, then flushes once.
    async fn write_batch(
        &mut self,
        sink: &mut futures_util::stream::SplitSink<Ws, Message>,
        epoch: u64,
        first: Outbound,
    ) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        let mut next = Some(first);
        let mut written = 0;
        while let Some(out) = next.take() {
            if out.epoch == epoch {
                sink.feed(Message::text(out.text)).await?;
                written += 1;
            }
            if written < 64 {
                next = self.rx.try_recv().ok();
            }
        }
        sink.flush().await
    }

    fn on_frame(
        &self,
        text: &str,
        last_seq: &mut Option<u64>,
        restart_expected: &mut Option<Duration>,
    ) {
        match UpstreamFrame::parse(text) {
            Some(UpstreamFrame::Event {
                name,
                payload,
                seq,
                state_version,
            }) => {
                if let Some(seq) = seq {
                    if let Some(last) = *last_seq {
                        if seq > last + 1 {
                            tracing::info!(expected = last + 1, received = seq, "upstream seq gap");
                            self.hub.gap();
                        }
                    }
                    *last_seq = Some(seq);
                }
                if name == "shutdown" {
                    *restart_expected = payload
                        .and_then(|p| serde_json::from_str::<Value>(p.get()).ok())
                        .and_then(|p| p.get("restartExpectedMs").and_then(Value::as_u64))
                        .map(Duration::from_millis);
                }
                let audience = self.driver.audience(&name, payload);
                self.hub.publish(&name, payload, state_version, &audience);
            }
            Some(UpstreamFrame::Res {
                id,
                ok,
                payload,
                error,
            }) => {
                if !self.router.complete(&id, ok, payload, error) {
                    tracing::debug!(upstream_id = %id, "answer for an unknown or expired request");
                }
            }
            None => tracing::debug!("ignoring a malformed frame from the gateway"),
        }
    }
}

/// Reads the next text frame during the handshake; a close or error becomes
/// the matching `studio.*` failure.
async fn next_text(ws: &mut Ws) -> Result<String, AttemptError> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(t))) => return Ok(t.as_str().to_owned()),
            Some(Ok(Message::Close(frame))) => {
                let (code, reason) = frame
                    .map(|f| (u16::from(f.code), f.reason.as_str().to_owned()))
                    .unwrap_or((1005, String::new()));
                return Err(if code == 1008 {
                    AttemptError {
                        error: ErrorShape::studio(
                            StudioCode::UpstreamRejected,
                            format!("Upstream gateway rejected connect (1008): {reason}"),
                        )
                        .with_details(json!({"closeCode": code, "closeReason": reason})),
                        rejected: true,
                        retry_after: None,
                    }
                } else {
                    AttemptError::new(
                        StudioCode::UpstreamClosed,
                        format!("Upstream gateway closed ({code}): {reason}"),
                    )
                });
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                return Err(AttemptError::new(
                    StudioCode::UpstreamClosed,
                    format!("the gateway connection failed during the handshake: {e}"),
                ))
            }
            None => {
                return Err(AttemptError::new(
                    StudioCode::UpstreamClosed,
                    "the gateway closed the connection during the handshake".into(),
                ))
            }
        }
    }
}

/// Maps a gateway `connect` error to the broker's failure. A retryable error
/// (`UNAVAILABLE` while the gateway starts) is transient; anything else is a
/// rejection that needs a fix. The gateway's error is kept whole in `details`.
fn rejection(error: Value) -> AttemptError {
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("connect refused");
    let retryable = error.get("retryable").and_then(Value::as_bool) == Some(true);
    let retry_after = error
        .get("retryAfterMs")
        .and_then(Value::as_u64)
        .map(Duration::from_millis);
    if retryable {
        return AttemptError {
            error: ErrorShape::studio(
                StudioCode::UpstreamClosed,
                format!("the gateway is not ready yet: {message}"),
            )
            .with_details(error.clone()),
            rejected: false,
            retry_after,
        };
    }
    let detail_code = error
        .pointer("/details/code")
        .and_then(Value::as_str)
        .unwrap_or("");
    let hint = match detail_code {
        c if c.starts_with("AUTH_") => {
            "; check the token (gateway.auth.token in the gateway's openclaw.json)"
        }
        "PAIRING_REQUIRED" | "DEVICE_IDENTITY_REQUIRED" => {
            "; approve this device on the gateway (openclaw devices approve)"
        }
        "PROTOCOL_MISMATCH" => {
            "; the gateway speaks a protocol this clawmux does not: upgrade one of them"
        }
        _ => "",
    };
    AttemptError {
        error: ErrorShape::studio(
            StudioCode::UpstreamRejected,
            format!("the gateway refused the broker's connect: {message}{hint}"),
        )
        .with_details(error.clone()),
        rejected: true,
        retry_after: None,
    }
}

/// Reads what the broker needs from a `hello-ok` payload.
fn parse_hello(mut payload: Value) -> UpstreamHello {
    // The device token is the broker's own credential: never shown to clients.
    if let Some(auth) = payload.get_mut("auth").and_then(Value::as_object_mut) {
        auth.remove("deviceToken");
        auth.remove("deviceTokens");
    }
    let protocol = payload
        .get("protocol")
        .and_then(Value::as_u64)
        .unwrap_or(PROTOCOL_MAX);
    let server_version = payload
        .pointer("/server/version")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_owned();
    let granted: Option<Vec<String>> = payload
        .pointer("/auth/scopes")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        });
    let scopes =
        granted.unwrap_or_else(|| REQUESTED_SCOPES.iter().map(|s| s.to_string()).collect());
    let lost_scopes = REQUESTED_SCOPES
        .iter()
        .filter(|s| !scopes.iter().any(|g| g == *s))
        .map(|s| s.to_string())
        .collect();
    let max_payload = payload
        .pointer("/policy/maxPayload")
        .and_then(Value::as_u64);
    UpstreamHello {
        payload,
        protocol,
        server_version,
        scopes,
        lost_scopes,
        max_payload,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_parsing_detects_lost_scopes_and_hides_device_token() {
        let h = parse_hello(json!({
            "protocol": 4, "server": {"version": "v"},
            "auth": {"role": "operator", "scopes": ["operator.read"], "deviceToken": "dt"},
            "policy": {"maxPayload": 100}
        }));
        assert_eq!(h.protocol, 4);
        assert_eq!(h.max_payload, Some(100));
        assert!(h.lost_scopes.contains(&"operator.admin".to_string()));
        assert!(h.payload.pointer("/auth/deviceToken").is_none());
    }

    #[test]
    fn rejections_keep_the_gateway_error() {
        let e = rejection(
            json!({"code":"INVALID_REQUEST","message":"unauthorized: gateway token mismatch","details":{"code":"AUTH_TOKEN_MISMATCH"}}),
        );
        assert!(e.rejected);
        assert_eq!(e.error.code, "studio.upstream_rejected");
        assert_eq!(
            e.error.details.as_ref().unwrap()["details"]["code"],
            "AUTH_TOKEN_MISMATCH"
        );
        let e = rejection(
            json!({"code":"UNAVAILABLE","message":"gateway starting; retry shortly","retryable":true,"retryAfterMs":500}),
        );
        assert!(!e.rejected);
        assert_eq!(e.retry_after, Some(Duration::from_millis(500)));
    }
}
