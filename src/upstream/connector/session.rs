//! One ready upstream session: a reader that publishes events and routes
//! answers, and a separate writer that drains the request queue. A write that
//! waits (a gateway that stopped reading) cannot stop the reader, the silence
//! watchdog, a reload or shutdown; a write that makes no progress for
//! `write_timeout` ends the session.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::{Connector, EarlyEvents, SessionEnd};
use crate::protocol::{ErrorShape, EventSeq, StudioCode, UpstreamFrame};
use crate::upstream::handshake::Ws;
use crate::upstream::{Outbound, Phase, UpstreamHello};

/// Requests written per flush at most.
const WRITE_BATCH: usize = 64;

/// How long the broker waits to deliver its own close frame to the gateway
/// when it ends a session (the socket may be the very thing that is stuck).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the writer stopped.
enum WriterEnd {
    /// The request queue closed: the broker is stopping.
    QueueClosed,
    /// A write did not complete within `write_timeout`.
    Stalled(Duration),
    Failed(WsError),
}

/// Drains the request queue into the socket, dropping requests meant for
/// another session generation.
async fn write_loop(
    sink: &mut SplitSink<Ws, Message>,
    rx: &mut mpsc::Receiver<Outbound>,
    generation: u64,
    write_timeout: Duration,
) -> WriterEnd {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    loop {
        let Some(first) = rx.recv().await else {
            return WriterEnd::QueueClosed;
        };
        batch.clear();
        batch.push(first);
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(out) => batch.push(out),
                Err(_) => break,
            }
        }
        let write = async {
            for out in batch.drain(..).filter(|o| o.generation == generation) {
                sink.feed(Message::text(out.text)).await?;
            }
            sink.flush().await
        };
        match tokio::time::timeout(write_timeout, write).await {
            Err(_) => return WriterEnd::Stalled(write_timeout),
            Ok(Err(e)) => return WriterEnd::Failed(e),
            Ok(Ok(())) => {}
        }
    }
}

impl Connector {
    pub(super) async fn run_session(
        &mut self,
        ws: Ws,
        hello: UpstreamHello,
        early: EarlyEvents,
        reconnected: bool,
    ) -> SessionEnd {
        let hello = Arc::new(hello);
        let aux = self.aux.is_some();
        if !aux && !hello.lost_scopes.is_empty() {
            crate::upstream::handshake::warn_lost_scopes(&hello, self.identity.is_some());
        }
        let tick = hello
            .payload
            .pointer("/policy/tickIntervalMs")
            .and_then(Value::as_u64)
            .unwrap_or(30_000);
        let silence_limit = Duration::from_millis(tick.saturating_mul(2).max(1));
        if !aux {
            self.adopt_session(&hello);
        }
        let mut generation = 0;
        self.status.send_modify(|s| {
            // An auxiliary session's generation was chosen when it was opened.
            if !aux {
                s.generation += 1;
            }
            generation = s.generation;
            s.phase = Phase::Ready;
            s.had_session = true;
            s.on_client_credential =
                self.offered.is_some() && self.token.is_none() && self.password.is_none();
            s.hello = Some(Arc::clone(&hello));
            s.last_error = None;
            s.retry_at = None;
            if reconnected {
                s.reconnects += 1;
            }
        });
        tracing::info!(upstream_phase = "ready", generation, aux, server_version = %hello.server_version, protocol = hello.protocol, "upstream session ready");
        if reconnected {
            // Everything that happened while we were away is unknown to the
            // clients: a gap makes them resync, the event says why.
            self.hub.gap();
            let mut event = json!({"phase": "ready", "serverVersion": hello.server_version, "reason": "reconnected"});
            if !hello.lost_scopes.is_empty() {
                event["lostScopes"] = json!(hello.lost_scopes);
            }
            // The gateway mints these per connection: the ones connected
            // clients got in their hello-ok died with the old session.
            if let Some(urls) = hello.payload.get("pluginSurfaceUrls") {
                event["pluginSurfaceUrls"] = urls.clone();
            }
            self.hub.publish_local("clawmux.upstream", &event);
        }
        let mut last_seq: Option<u64> = None;
        let mut restart_expected = None;
        for text in &early.frames {
            self.on_frame(text, &mut last_seq, &mut restart_expected);
        }
        if early.overflowed {
            tracing::warn!("the gateway sent more events before hello-ok than the broker keeps; clients see a gap");
            self.hub.gap();
        }
        // Connection-scoped subscriptions died with the old session; they are
        // queued first, in the same ordered place as every client's change.
        if !aux {
            self.dispatcher.resubscribe(generation);
        }
        let (mut sink, mut stream) = ws.split();
        let mut rx = self
            .rx
            .take()
            .expect("the request queue is back between sessions");
        let mut last_rx = Instant::now();
        let end_reason: String;
        let mut cancelled = false;
        let mut retargeted = false;
        let mut close: Option<CloseFrame> = None;
        let mut gateway_close: Option<(u16, String)> = None;
        {
            let writer = write_loop(&mut sink, &mut rx, generation, self.opts.write_timeout);
            tokio::pin!(writer);
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
                                gateway_close = frame.as_ref().map(|f| (u16::from(f.code), f.reason.as_str().to_owned()));
                                end_reason = match frame {
                                    Some(f) => format!("gateway closed the connection ({}): {}", u16::from(f.code), f.reason),
                                    None => "gateway closed the connection".into(),
                                };
                                break;
                            }
                            Some(Ok(_)) => {}
                            Some(Err(WsError::Capacity(e))) => {
                                end_reason = format!("the gateway sent a frame over the broker's limit of {} bytes ({e})", self.opts.max_frame_bytes);
                                close = Some(CloseFrame { code: CloseCode::Size, reason: "frame too large".into() });
                                break;
                            }
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
                    end = &mut writer => {
                        match end {
                            WriterEnd::QueueClosed => {
                                end_reason = "broker stopping".into();
                                cancelled = true;
                            }
                            WriterEnd::Stalled(after) => {
                                end_reason = format!("a write to the gateway made no progress for {} ms (it is not reading)", after.as_millis());
                                close = Some(CloseFrame { code: CloseCode::Away, reason: "write timeout".into() });
                            }
                            WriterEnd::Failed(e) => end_reason = format!("cannot write to the gateway: {e}"),
                        }
                        break;
                    }
                    _ = watchdog => {
                        end_reason = format!("no frame from the gateway for {} ms (2 x tickIntervalMs)", silence_limit.as_millis());
                        close = Some(CloseFrame { code: CloseCode::from(4000), reason: "tick timeout".into() });
                        break;
                    }
                    changed = self.target.changed(), if !retargeted => {
                        if changed.is_ok() {
                            retargeted = true;
                            end_reason = "settings reloaded".into();
                            close = Some(CloseFrame { code: CloseCode::Normal, reason: "settings reloaded".into() });
                            break;
                        }
                    }
                    _ = self.cancel.cancelled() => {
                        end_reason = "broker stopping".into();
                        cancelled = true;
                        close = Some(CloseFrame { code: CloseCode::Normal, reason: "broker stopping".into() });
                        break;
                    }
                }
            }
        }
        self.rx = Some(rx);
        if let Some(frame) = close {
            // Bounded: the socket may be the very thing that is stuck.
            let _ =
                tokio::time::timeout(CLOSE_TIMEOUT, sink.send(Message::Close(Some(frame)))).await;
        }
        if cancelled {
            // Our own stop (Ctrl-C, SIGTERM): expected, not a warning.
            tracing::info!(generation, "upstream session ended: {end_reason}");
        } else {
            tracing::warn!(generation, "upstream session ended: {end_reason}");
        }
        let retry_ms = crate::upstream::clamp_hint(
            restart_expected.unwrap_or(self.opts.backoff_initial),
            self.opts.backoff_initial,
            self.opts.backoff_max,
            1,
        )
        .as_millis() as u64;
        let error = ErrorShape::studio(
            StudioCode::UpstreamClosed,
            format!("the gateway session ended before the answer: {end_reason}"),
        )
        .with_retry_after_ms((!cancelled).then_some(retry_ms));
        self.status.send_modify(|s| {
            s.phase = if cancelled || aux {
                Phase::Stopped
            } else {
                Phase::Backoff
            };
            s.hello = None;
            // What a client mirroring the gateway is closed with: the
            // gateway's own close where it may be sent on, else a restart.
            s.last_close = Some(match gateway_close.take() {
                Some((code, reason)) if matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999) => {
                    (code, reason)
                }
                _ => (1012, "service restart".to_owned()),
            });
            s.last_error = Some(ErrorShape::studio(
                StudioCode::UpstreamClosed,
                end_reason.clone(),
            ));
        });
        let failed = self.router.fail_generation(generation, &error);
        if !aux {
            self.sharing.runs.clear();
        }
        if failed > 0 {
            tracing::info!(
                generation,
                failed,
                "failed pending requests of the lost session"
            );
        }
        if !cancelled && !aux {
            self.hub.publish_local(
                "clawmux.upstream",
                &json!({"phase": "backoff", "serverVersion": hello.server_version, "reason": end_reason}),
            );
        }
        SessionEnd {
            restart_expected,
            cancelled,
            retargeted,
        }
    }

    /// Takes what a new main session tells about the gateway.
    fn adopt_session(&self, hello: &UpstreamHello) {
        self.sharing
            .set_session_defaults(crate::sharing::SessionDefaults::from_snapshot(
                hello.payload.get("snapshot").unwrap_or(&Value::Null),
            ));
        self.hub.set_upstream_max_buffered(
            hello
                .payload
                .pointer("/policy/maxBufferedBytes")
                .and_then(Value::as_u64),
        );
        self.hub.reset_snapshot(
            hello
                .payload
                .get("snapshot")
                .cloned()
                .unwrap_or(Value::Null),
        );
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
                if self.aux.is_some() {
                    // The main session's events are the one source.
                    return;
                }
                match seq {
                    EventSeq::Valid(seq) => {
                        if let Some(last) = *last_seq {
                            if seq > last.saturating_add(1) {
                                tracing::info!(
                                    expected = last + 1,
                                    received = seq,
                                    "upstream seq gap"
                                );
                                self.hub.gap();
                            }
                        }
                        *last_seq = Some(seq);
                    }
                    EventSeq::Invalid => {
                        // Delivered all the same (clients get the broker's own
                        // seq); counted and logged, never lost silently.
                        let n = self
                            .invalid_seqs
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                            + 1;
                        tracing::warn!(event = %name, invalid_seqs = n, "the gateway sent an event whose seq is not a non-negative integer; delivering it");
                    }
                    EventSeq::Absent => {}
                }
                if name == "shutdown" {
                    *restart_expected = payload
                        .and_then(|p| serde_json::from_str::<Value>(p.get()).ok())
                        .and_then(|p| p.get("restartExpectedMs").and_then(Value::as_u64))
                        .map(Duration::from_millis);
                }
                let audience = self.sharing.audience(&name, payload);
                if matches!(audience, crate::sharing::Audience::Only(_)) {
                    self.router.tap.inbound(text);
                }
                self.hub.publish(&name, payload, state_version, &audience);
            }
            Some(UpstreamFrame::Res {
                id,
                ok,
                payload,
                error,
            }) => {
                self.router.tap.inbound(text);
                if !self.router.complete(&id, ok, payload, error) {
                    tracing::debug!(upstream_id = %id, "answer for an unknown or expired request");
                }
            }
            None => tracing::debug!("ignoring a malformed frame from the gateway"),
        }
    }
}
