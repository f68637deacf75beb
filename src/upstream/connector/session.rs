//! One ready upstream session: publishes events, routes answers, writes
//! requests, and watches for silence, a reload or shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

use super::{Connector, SessionEnd};
use crate::protocol::frames::encode_req;
use crate::protocol::{ErrorShape, StudioCode, UpstreamFrame};
use crate::upstream::handshake::Ws;
use crate::upstream::{Outbound, Phase, UpstreamHello};

impl Connector {
    pub(super) async fn run_session(
        &mut self,
        ws: Ws,
        hello: UpstreamHello,
        early: Vec<String>,
        reconnected: bool,
    ) -> SessionEnd {
        let hello = Arc::new(hello);
        if !hello.lost_scopes.is_empty() {
            crate::upstream::handshake::warn_lost_scopes(&hello, self.identity.is_some());
        }
        let tick = hello
            .payload
            .pointer("/policy/tickIntervalMs")
            .and_then(Value::as_u64)
            .unwrap_or(30_000);
        let silence_limit = Duration::from_millis(tick.saturating_mul(2).max(1));
        self.driver
            .set_session_defaults(crate::driver::SessionDefaults::from_snapshot(
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
            let mut event = json!({"phase": "ready", "serverVersion": hello.server_version, "reason": "reconnected"});
            if !hello.lost_scopes.is_empty() {
                event["lostScopes"] = json!(hello.lost_scopes);
            }
            self.hub.publish_local("clawmux.upstream", &event);
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
        let mut retargeted = false;
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
                changed = self.target.changed(), if !retargeted => {
                    if changed.is_ok() {
                        retargeted = true;
                        end_reason = "settings reloaded".into();
                        let _ = sink.send(Message::Close(Some(CloseFrame { code: CloseCode::Normal, reason: "settings reloaded".into() }))).await;
                        break;
                    }
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
        self.driver.forget_runs();
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
            retargeted,
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
