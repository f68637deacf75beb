//! Relaying a dedicated connection's frames both ways, verbatim, and
//! stopping both directions for a handover.

use std::sync::atomic::Ordering;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

use super::handover::{write_until_moving, Next, Pauses, Watch};
use super::{classify, connect_answer, unanswered, Conn, End, Read};
use crate::upstream::{closed_before_answer, handshake_timed_out, GatewaySocket};

impl Conn {
    /// Relays frames both ways until one side ends. Until the gateway
    /// answers the connect, its frames are looked at for that answer, and a
    /// close or silence becomes a `studio.*` error for the client.
    ///
    /// At a handover (a connection whose `connect` was answered, and whose
    /// gateway socket can move), both sockets take every write whole from
    /// then on, and each direction stops reading where it is once the
    /// messages its parser holds whole are relayed (inside a message too
    /// large to carry, at its end); the relay ends [`End::HandedOver`]
    /// when both have. `answered`: the gateway answered the `connect`
    /// already (a connection taken over).
    pub(super) async fn relay(
        &mut self,
        up_tx: &mut SplitSink<GatewaySocket, Message>,
        up_rx: &mut SplitStream<GatewaySocket>,
        connect_id: &str,
        answered: bool,
        pauses: &Pauses,
    ) -> End {
        let handshake_timeout = self.ctx.settings.upstream.handshake_timeout;
        let write_timeout = self.ctx.settings.upstream.write_timeout;
        let slow_grace = self.ctx.settings.limits.slow_grace;
        let url = self.ctx.upstream().target_url();
        let Conn {
            local_tx,
            local_rx,
            slot,
            budget,
            ctx,
            ..
        } = self;
        let outcomes = &ctx.dedicated.outcomes;
        let answered_now = std::sync::atomic::AtomicBool::new(answered);
        // Whether this connection moves at the handover, decided once by
        // the direction that sees the request first.
        let decided: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let decide = || {
            *decided.get_or_init(|| {
                let moves = answered_now.load(Ordering::Relaxed) && pauses.gateway.is_some();
                if moves {
                    pauses.spool_writes();
                }
                moves
            })
        };
        let requested = &ctx.handover.requested;
        let down = async {
            let answer_deadline = tokio::time::Instant::now() + handshake_timeout;
            let mut answered = answered;
            let mut watch = Watch::default();
            loop {
                let read = if answered {
                    match watch
                        .next(up_rx, pauses.gateway.as_ref(), requested, &decide)
                        .await
                    {
                        Next::Item(m) => classify(m, "gateway"),
                        Next::Paused => return End::HandedOver,
                        Next::Stop => return End::Shutdown,
                    }
                } else {
                    match tokio::time::timeout_at(answer_deadline, up_rx.next()).await {
                        Ok(read) => classify(read, "gateway"),
                        Err(_) => {
                            return unanswered(
                                local_tx,
                                connect_id,
                                handshake_timed_out(&url, handshake_timeout),
                            )
                            .await
                        }
                    }
                };
                let msg = match read {
                    Read::Frame(m) => m,
                    Read::Skip => continue,
                    Read::Closed(frame) if !answered => {
                        let (code, reason) = frame
                            .map(|f| (u16::from(f.code), f.reason.to_string()))
                            .unwrap_or((1005, String::new()));
                        return unanswered(
                            local_tx,
                            connect_id,
                            closed_before_answer(code, &reason),
                        )
                        .await;
                    }
                    Read::Ended if !answered => {
                        return unanswered(
                            local_tx,
                            connect_id,
                            closed_before_answer(1006, "the connection ended"),
                        )
                        .await;
                    }
                    other => return End::Gateway(other),
                };
                if !answered {
                    if let Message::Text(t) = &msg {
                        if let Some(ok) = connect_answer(t.as_str(), connect_id, slot) {
                            answered = true;
                            answered_now.store(true, Ordering::Relaxed);
                            if ok {
                                budget.lift();
                                outcomes.connected.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(
                                    dedicated_id = slot.id,
                                    "dedicated client connected"
                                );
                            } else {
                                outcomes.rejected.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
                let send = write_until_moving(local_tx.send(msg), requested, &decide);
                match tokio::time::timeout(slow_grace, send).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return End::ClientGone,
                    Err(_) => return End::ClientSlow,
                }
            }
        };
        let up = async {
            let mut watch = Watch::default();
            loop {
                let read = match watch
                    .next(local_rx, Some(&pauses.client), requested, &decide)
                    .await
                {
                    Next::Item(m) => m,
                    Next::Paused => return End::HandedOver,
                    Next::Stop => return End::Shutdown,
                };
                match classify(read, "dedicated client") {
                    Read::Frame(m) => {
                        let send = write_until_moving(up_tx.send(m), requested, &decide);
                        match tokio::time::timeout(write_timeout, send).await {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) | Err(_) => return End::GatewayGone,
                        }
                    }
                    Read::Skip => {}
                    other => return End::Client(other),
                }
            }
        };
        tokio::pin!(down, up);
        let (end, down_left) = tokio::select! {
            end = &mut down => (end, false),
            end = &mut up => (end, true),
        };
        if !matches!(end, End::HandedOver) {
            return end;
        }
        // One direction stopped for the handover: the other stops too, at
        // once unless inside a message too large to carry (bounded like a
        // `/ws` client's pause).
        let other = if down_left {
            tokio::time::timeout(crate::local::ws::HANDOVER_PAUSE_TIMEOUT, &mut down).await
        } else {
            tokio::time::timeout(crate::local::ws::HANDOVER_PAUSE_TIMEOUT, &mut up).await
        };
        match other {
            Ok(end) => end,
            Err(_) => {
                tracing::info!(
                    dedicated_id = slot.id,
                    "handover: a dedicated connection not at a boundary in time; closing it"
                );
                End::Shutdown
            }
        }
    }
}
