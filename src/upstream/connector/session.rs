//! One ready upstream session: a reader that hands every frame to the
//! session's owner, and the writer that finishes what requesters could not
//! write at once ([`crate::upstream::outlet`]). A write that waits (a gateway
//! that stopped reading) cannot stop the reader, the silence watchdog, a
//! reload or shutdown; a write that makes no progress for `write_timeout`
//! ends the session.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::{Connector, EarlyEvents, SessionEnd, Start};
use crate::protocol::{ErrorShape, StudioCode};
use crate::upstream::handshake::Ws;
use crate::upstream::outlet::WriterEnd;
use crate::upstream::{Phase, SessionEnded, UpstreamHello};

/// The gateway's `tickIntervalMs` when it sends none, or 0 (which would
/// make the watchdog end every session after a millisecond of silence).
const DEFAULT_TICK: Duration = Duration::from_secs(30);

/// The shortest tick interval believed: a smaller one is raised to this.
const MIN_TICK: Duration = Duration::from_millis(100);

/// The longest tick interval believed (the watchdog still fires after
/// twice this much silence).
const MAX_TICK: Duration = Duration::from_secs(3600);

/// The silence after which a session is taken for dead: twice the
/// gateway's tick interval, bounded (see [`MIN_TICK`], [`MAX_TICK`]).
fn silence_limit(hello: &UpstreamHello) -> Duration {
    let tick = match hello
        .payload
        .pointer("/policy/tickIntervalMs")
        .and_then(Value::as_u64)
    {
        None | Some(0) => DEFAULT_TICK,
        Some(ms) => Duration::from_millis(ms).clamp(MIN_TICK, MAX_TICK),
    };
    tick * 2
}

/// How long the broker waits to deliver its own close frame to the gateway
/// when it ends a session (the socket may be the very thing that is stuck).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

impl Connector {
    pub(super) async fn run_session(
        &mut self,
        ws: Ws,
        hello: UpstreamHello,
        early: EarlyEvents,
        start: Start,
    ) -> SessionEnd {
        let reconnected = start == Start::Reconnect;
        let hello = Arc::new(hello);
        let silence_limit = silence_limit(&hello);
        let mut generation = 0;
        self.status.send_modify(|s| {
            // The attempt's generation becomes the session's.
            generation = s.generation;
            s.sessions += 1;
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
        if start == Start::Adopted {
            tracing::info!(session = %self.spec.label, upstream_phase = "ready", generation, server_version = %hello.server_version, "upstream session taken over from the previous instance");
            self.owner.taken_over(generation, &hello);
        } else {
            tracing::info!(session = %self.spec.label, upstream_phase = "ready", generation, server_version = %hello.server_version, protocol = hello.protocol, "upstream session ready");
            self.owner.ready(generation, &hello, reconnected);
        }
        let mut restart_expected = None;
        for text in &early.frames {
            if let Some(hint) = self.owner.frame(generation, text) {
                restart_expected = Some(hint);
            }
        }
        if early.overflowed {
            tracing::warn!(session = %self.spec.label, "the gateway sent more events before hello-ok than the broker keeps");
            self.owner.early_events_lost(generation);
        }
        let pause = ws.get_ref().pause();
        let raw = ws.get_ref().raw_writes();
        let (sink, stream) = ws.split();
        // A large event's read buffer is given back once it is handled.
        let mut stream = crate::boundary::Releasing::new(stream);
        let outlet = Arc::clone(&self.outlet);
        outlet.install(super::super::outlet::UpSink::new(sink, raw), generation);
        let mut last_rx = Instant::now();
        let end_reason: String;
        let mut cancelled = false;
        let mut retargeted = false;
        let mut close: Option<CloseFrame> = None;
        let mut gateway_close: Option<(u16, String)> = None;
        let mut handover: Option<crate::upstream::HandoverRequest> = None;
        {
            let writer = outlet.writer(self.opts.write_timeout);
            tokio::pin!(writer);
            // One timer for the session, not one per frame: when it fires
            // it looks at the last frame's time and, if the gateway spoke
            // since, sleeps again until the new deadline.
            let watchdog = tokio::time::sleep_until((last_rx + silence_limit).into());
            tokio::pin!(watchdog);
            loop {
                tokio::select! {
                    msg = stream.next() => {
                        last_rx = Instant::now();
                        match msg {
                            Some(Ok(Message::Text(text))) => {
                                if let Some(hint) = self.owner.frame(generation, text.as_str()) {
                                    restart_expected = Some(hint);
                                }
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
                            WriterEnd::Stalled(after) => {
                                end_reason = format!("a write to the gateway made no progress for {} ms (it is not reading)", after.as_millis());
                                close = Some(CloseFrame { code: CloseCode::Away, reason: "write timeout".into() });
                            }
                            WriterEnd::Failed(e) => end_reason = format!("cannot write to the gateway: {e}"),
                        }
                        break;
                    }
                    _ = &mut watchdog => {
                        let deadline = last_rx + silence_limit;
                        if deadline > Instant::now() {
                            watchdog.as_mut().reset(deadline.into());
                            continue;
                        }
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
                    request = self.handover.recv() => {
                        let Some(request) = request else { continue };
                        handover = Some(request);
                        end_reason = "handed over to the next instance".into();
                        break;
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
        let mut end_reason = end_reason;
        let mut unsent_before = Vec::new();
        // A session that cannot move ends here, and the handover hears so
        // only once its requests in flight are answered: their answers are
        // in their clients' queues before those are packed.
        let mut not_moved = None;
        if let Some(request) = handover {
            let tried = match pause {
                Some(pause) => {
                    let tried = self
                        .hand_over(generation, &pause, stream.into_inner(), &hello, request)
                        .await;
                    if let Err((why, _, _)) = &tried {
                        tracing::warn!(session = %self.spec.label, "handover: the gateway connection cannot move ({why}); closing it");
                    }
                    tried
                }
                // A TLS session's keys and record counters stay in this
                // process.
                None => {
                    tracing::info!(session = %self.spec.label, "handover: a TLS gateway connection does not move; closing it (the next instance connects again)");
                    Err(("it is a TLS session".into(), Vec::new(), request))
                }
            };
            match tried {
                Ok(()) => {
                    return SessionEnd {
                        handed_over: true,
                        restart_expected: None,
                        cancelled: true,
                        retargeted: false,
                    };
                }
                Err((why, withdrawn, request)) => {
                    unsent_before = withdrawn;
                    not_moved = Some(request);
                    end_reason =
                        format!("broker stopping (the gateway connection could not move: {why})");
                    cancelled = true;
                    close = Some(CloseFrame {
                        code: CloseCode::Normal,
                        reason: "broker stopping".into(),
                    });
                }
            }
        }
        self.end_session(
            generation,
            Ending {
                reason: end_reason,
                close,
                cancelled,
                retargeted,
                restart_expected,
                gateway_close,
                withdrawn: unsent_before,
            },
            not_moved,
        )
        .await
    }

    /// Ends session `generation`: its requests still queued are withdrawn
    /// and failed "not sent" (with `withdrawn`, those a handover that
    /// could not finish withdrew), the status and the owner are told (every
    /// request in flight is answered), a handover that asked (`not_moved`)
    /// hears that the connection does not move, and only then the gateway
    /// gets `close` (bounded): no answer waits for the gateway to read.
    async fn end_session(
        &mut self,
        generation: u64,
        ending: Ending,
        not_moved: Option<crate::upstream::HandoverRequest>,
    ) -> SessionEnd {
        let Ending {
            reason: end_reason,
            close,
            cancelled,
            retargeted,
            restart_expected,
            mut gateway_close,
            withdrawn,
        } = ending;
        let outlet = Arc::clone(&self.outlet);
        // Closed first: from here a request for this generation is refused
        // (answered "not sent"), and those still queued are withdrawn.
        let mut unsent = outlet.close(generation);
        unsent.extend(withdrawn);
        if cancelled {
            tracing::info!(session = %self.spec.label, generation, "upstream session closed: {end_reason}");
        } else {
            tracing::warn!(session = %self.spec.label, generation, "upstream session ended: {end_reason}");
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
        let gateway_close_code = gateway_close.as_ref().map(|(code, _)| *code);
        self.status.send_modify(|s| {
            s.phase = if cancelled {
                Phase::Stopped
            } else {
                Phase::Backoff
            };
            // The next attempt's generation.
            s.generation = generation + 1;
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
        // A debug build's test hook: the answers below come late, so a
        // handover that did not wait for them would pack without them.
        if not_moved.is_some() {
            crate::test_hook::pause_at("pause-before-answers").await;
        }
        self.owner.ended(
            generation,
            &SessionEnded {
                reason: end_reason,
                cancelled,
                restart_hint: restart_expected,
                gateway_close_code,
                error,
                unsent,
            },
        );
        // Answered: a handover that asked may pack their clients' queues.
        if let Some(request) = not_moved {
            let _ = request.send(None);
        }
        let end = SessionEnd {
            handed_over: false,
            restart_expected,
            cancelled,
            retargeted,
        };
        // Last, bounded: the socket may be the very thing that is stuck,
        // and nothing above waits for it.
        let sink = outlet.uninstall(generation).await;
        if let (Some(frame), Some(sink)) = (close, sink) {
            let mut sink = sink.into_inner();
            let _ =
                tokio::time::timeout(CLOSE_TIMEOUT, sink.send(Message::Close(Some(frame)))).await;
        }
        end
    }

    /// Stops the session for the next instance (design §11): the reader
    /// stops at a message boundary (every whole message before it goes to
    /// the owner as usual), what is queued and can be written now is
    /// written, the rest withdrawn, the writing half is flushed; then the
    /// socket is left, unclosed, with the bytes read past the boundary.
    /// Each request of this session is then either written (its answer
    /// reaches the next instance on this same connection) or withdrawn
    /// unwritten (`unsent`, for the caller to answer "not sent"), never
    /// both. `Err`: the session cannot move; the caller ends it as at any
    /// stop (its requests fail as they would then).
    async fn hand_over(
        &mut self,
        generation: u64,
        pause: &crate::boundary::Pause,
        stream: futures_util::stream::SplitStream<Ws>,
        hello: &Arc<UpstreamHello>,
        request: crate::upstream::HandoverRequest,
    ) -> Result<(), (String, Vec<String>, crate::upstream::HandoverRequest)> {
        // Nothing more is handed to the parser: the message in progress, if
        // any, moves as the bytes read of it so far; and every write from
        // here on is taken whole, so what the gateway has not taken moves
        // too, and nothing waits for it to read.
        pause.stop();
        pause.spool_writes();
        // Written now if it can be (the socket is free: the writer was
        // dropped), else withdrawn: sent or answered "not sent", never both.
        // Then nobody else can touch the socket: the reader is read whole
        // (an unsplit stream: a split one also says "pending" while its
        // other half is being written, with whole messages still parsed
        // and not returned).
        self.outlet.flush();
        let unsent = self.outlet.close(generation);
        let Some(sink) = self.outlet.uninstall(generation).await else {
            return Err(("its writing half did not come back".into(), unsent, request));
        };
        // A request the writing half took and had not passed on yet (its
        // one-message slot, which reuniting would drop) goes on first: with
        // every write taken whole, this waits for nothing.
        let mut sink = sink.into_inner();
        if let Err(e) = futures_util::SinkExt::flush(&mut sink).await {
            return Err((format!("the last write failed ({e})"), unsent, request));
        }
        let Ok(mut ws) = sink.reunite(stream) else {
            unreachable!("the two halves of one socket");
        };
        let owner = Arc::clone(&self.owner);
        let stopped = tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, async {
            // The whole messages the parser holds are handled; nothing is
            // waited for.
            handle_parsed(&mut ws, &owner, generation)?;
            if !ws.get_ref().carries() {
                // Inside a message too large to carry: read to its end.
                pause.resume_reads();
                pause.request();
            }
            while !ws.get_ref().carries() {
                match pause.next_before_boundary(&mut ws).await {
                    None => break,
                    Some(Some(Ok(Message::Text(text)))) => {
                        owner.frame(generation, text.as_str());
                    }
                    Some(Some(Ok(Message::Close(_)))) | Some(None) => {
                        return Err("the gateway closed the connection meanwhile".to_owned())
                    }
                    Some(Some(Ok(_))) => {}
                    Some(Some(Err(e))) => return Err(format!("the connection failed ({e})")),
                }
            }
            // What tungstenite still holds to write (an automatic pong, the
            // rest of a frame): taken by the spool at once.
            ws.flush()
                .await
                .map_err(|e| format!("the last write failed ({e})"))
        })
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "the gateway did not finish a message too large to carry within {} ms",
                HANDOVER_PAUSE_TIMEOUT.as_millis()
            ))
        });
        let result = match stopped {
            Err(why) => Err((why, unsent)),
            Ok(()) => match ws.get_mut().take_for_handover() {
                Some(Ok(socket)) => Ok((socket, unsent)),
                Some(Err(e)) => Err((format!("cannot copy its descriptor ({e})"), unsent)),
                None => Err(("its socket cannot move".into(), unsent)),
            },
        };
        match result {
            Ok((socket, unsent)) => {
                let handed = crate::upstream::HandedOver {
                    socket,
                    hello: (**hello).clone(),
                    generation,
                    unsent,
                };
                self.status.send_modify(|s| {
                    s.phase = Phase::Stopped;
                    s.generation = generation + 1;
                    s.hello = None;
                });
                if let Err(Some(handed)) = request.send(Some(handed)) {
                    // The broker stopped waiting: the connection closes
                    // (dropped), and its requests fail as at any end.
                    tracing::warn!(session = %self.spec.label, "handover: nobody took the gateway connection; closing it");
                    self.owner.ended(
                        generation,
                        &SessionEnded {
                            reason: "broker stopping".into(),
                            cancelled: true,
                            restart_hint: None,
                            gateway_close_code: None,
                            error: ErrorShape::studio(
                                StudioCode::UpstreamClosed,
                                "the gateway session ended before the answer: broker stopping",
                            ),
                            unsent: handed.unsent,
                        },
                    );
                }
                tracing::info!(session = %self.spec.label, generation, "upstream session handed over to the next instance");
                Ok(())
            }
            Err((why, unsent)) => Err((why, unsent, request)),
        }
    }
}

/// With reads stopped: hands the owner the messages the parser already
/// holds whole, without waiting for anything.
fn handle_parsed<S>(
    ws: &mut S,
    owner: &Arc<dyn crate::upstream::SessionOwner>,
    generation: u64,
) -> Result<(), String>
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    use std::task::Poll;
    loop {
        match crate::boundary::poll_now(|cx| futures_util::StreamExt::poll_next_unpin(ws, cx)) {
            Poll::Pending => return Ok(()),
            Poll::Ready(Some(Ok(Message::Text(text)))) => {
                owner.frame(generation, text.as_str());
            }
            Poll::Ready(Some(Ok(Message::Close(_)))) | Poll::Ready(None) => {
                return Err("the gateway closed the connection meanwhile".to_owned())
            }
            Poll::Ready(Some(Ok(_))) => {}
            Poll::Ready(Some(Err(e))) => return Err(format!("the connection failed ({e})")),
        }
    }
}

/// How a session ends (see [`Connector::end_session`]).
struct Ending {
    reason: String,
    /// The close frame to send the gateway, if any.
    close: Option<CloseFrame>,
    cancelled: bool,
    retargeted: bool,
    restart_expected: Option<Duration>,
    /// The gateway's own close, if it closed.
    gateway_close: Option<(u16, String)>,
    /// Requests a handover that could not finish withdrew unwritten.
    withdrawn: Vec<String>,
}

/// How long a gateway session may take, at a handover, to finish the
/// message it is sending and to take the last write, before it is closed
/// instead of moved (the next instance then connects again).
pub const HANDOVER_PAUSE_TIMEOUT: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(tick: Value) -> UpstreamHello {
        UpstreamHello {
            payload: serde_json::json!({"policy": {"tickIntervalMs": tick}}),
            protocol: 4,
            server_version: "v".into(),
            scopes: Vec::new(),
            lost_scopes: Vec::new(),
            max_payload: None,
            challenge_extra: Default::default(),
        }
    }

    #[test]
    fn the_gateways_tick_interval_is_bounded() {
        let ms = Duration::from_millis;
        assert_eq!(
            silence_limit(&hello(0.into())),
            DEFAULT_TICK * 2,
            "0: the default"
        );
        assert_eq!(silence_limit(&hello(Value::Null)), DEFAULT_TICK * 2);
        assert_eq!(silence_limit(&hello(1.into())), ms(200));
        assert_eq!(silence_limit(&hello(30_000.into())), ms(60_000));
        assert_eq!(silence_limit(&hello(u64::MAX.into())), MAX_TICK * 2);
    }
}
