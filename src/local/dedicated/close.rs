//! Ending a dedicated connection: the close one side sent is mirrored to
//! the other, and the other's answer awaited briefly.

use std::sync::atomic::Ordering;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use super::DedicatedWs as Ws;
use super::{Conn, End, Read, CLOSE_LINGER};
use crate::upstream::GatewaySocket;

impl Conn {
    /// Closes both sides after the relay ended: the close one side sent is
    /// mirrored to the other, and the other's answer awaited briefly.
    pub(super) async fn finish(
        mut self,
        end: End,
        mut up_tx: SplitSink<GatewaySocket, Message>,
        mut up_rx: SplitStream<GatewaySocket>,
    ) {
        let id = self.slot.id;
        match end {
            End::Client(read) => {
                let to_gateway = match read {
                    Read::Closed(frame) => {
                        // Writes the echo of the client's close.
                        let _ = tokio::time::timeout(CLOSE_LINGER, self.local_tx.flush()).await;
                        frame
                    }
                    Read::TooLarge => {
                        send_close(&mut self.local_tx, 1009, "frame too large").await;
                        Some(close_frame(1009, "frame too large"))
                    }
                    Read::Invalid(code, reason) => {
                        send_close(&mut self.local_tx, code, reason).await;
                        Some(close_frame(code, reason))
                    }
                    Read::Ended | Read::Frame(_) | Read::Skip => {
                        Some(close_frame(1001, "going away"))
                    }
                };
                tracing::debug!(
                    dedicated_id = id,
                    "the client closed; mirroring to the gateway"
                );
                close_and_drain(&mut up_tx, &mut up_rx, to_gateway).await;
            }
            End::Gateway(read) => {
                let to_client = match read {
                    Read::Closed(frame) => {
                        let _ = tokio::time::timeout(CLOSE_LINGER, up_tx.flush()).await;
                        frame
                    }
                    Read::TooLarge => {
                        let frame = close_frame(1009, "frame too large");
                        let _ = tokio::time::timeout(
                            CLOSE_LINGER,
                            up_tx.send(Message::Close(Some(frame.clone()))),
                        )
                        .await;
                        Some(frame)
                    }
                    Read::Invalid(..) | Read::Ended | Read::Frame(_) | Read::Skip => {
                        Some(close_frame(1012, "upstream closed"))
                    }
                };
                tracing::debug!(
                    dedicated_id = id,
                    "the gateway closed; mirroring to the client"
                );
                close_and_drain(&mut self.local_tx, &mut self.local_rx, to_client).await;
            }
            End::Unanswered => {
                self.ctx
                    .dedicated
                    .outcomes
                    .failed
                    .fetch_add(1, Ordering::Relaxed);
                tokio::join!(
                    close_and_drain(
                        &mut up_tx,
                        &mut up_rx,
                        Some(close_frame(1000, "connect failed")),
                    ),
                    self.linger_then_close(),
                );
            }
            End::ClientGone => {
                close_and_drain(
                    &mut up_tx,
                    &mut up_rx,
                    Some(close_frame(1001, "going away")),
                )
                .await;
            }
            End::ClientSlow => {
                tracing::info!(
                    dedicated_id = id,
                    "dedicated client does not read; closing it"
                );
                let (code, reason) = crate::hub::client::SLOW_CONSUMER_CLOSE;
                tokio::join!(
                    close_and_drain(
                        &mut up_tx,
                        &mut up_rx,
                        Some(close_frame(1001, "going away")),
                    ),
                    send_close(&mut self.local_tx, code, reason),
                );
            }
            End::GatewayGone => {
                close_and_drain(
                    &mut self.local_tx,
                    &mut self.local_rx,
                    Some(close_frame(1012, "upstream closed")),
                )
                .await;
            }
            // (A connection that moved is not finished here; one whose move
            // failed half-way is closed as at a stop.)
            End::Shutdown | End::HandedOver => {
                let going = close_frame(1001, "going away");
                tokio::join!(
                    close_and_drain(&mut up_tx, &mut up_rx, Some(going.clone())),
                    close_and_drain(&mut self.local_tx, &mut self.local_rx, Some(going)),
                );
            }
        }
    }
}

pub(super) fn close_frame(code: u16, reason: &str) -> CloseFrame {
    CloseFrame {
        code: CloseCode::from(code),
        reason: Utf8Bytes::from(truncate_reason(reason)),
    }
}

/// Close reasons are limited to 123 bytes; cut on a character boundary.
pub(super) fn truncate_reason(reason: &str) -> &str {
    let mut end = reason.len().min(120);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

pub(super) fn text_message(bytes: bytes::Bytes) -> Message {
    Message::Text(Utf8Bytes::try_from(bytes).unwrap_or_else(|_| Utf8Bytes::from_static("{}")))
}

/// Sends a close frame to the client, never waiting on it for long.
pub(super) async fn send_close(local_tx: &mut SplitSink<Ws, Message>, code: u16, reason: &str) {
    // A pending echo of the peer's own close goes first; ours is then moot.
    let _ = tokio::time::timeout(CLOSE_LINGER, local_tx.flush()).await;
    let close = Message::Close(Some(close_frame(code, reason)));
    let _ = tokio::time::timeout(CLOSE_LINGER, local_tx.send(close)).await;
}

/// Sends `frame` as the close of one side (a close without a code when
/// `None`), then reads that side until its answer or [`CLOSE_LINGER`].
pub(super) async fn close_and_drain<S, R>(tx: &mut S, rx: &mut R, frame: Option<CloseFrame>)
where
    S: futures_util::Sink<Message> + Unpin,
    R: futures_util::Stream<Item = Result<Message, WsError>> + Unpin,
{
    let _ = tokio::time::timeout(CLOSE_LINGER, async {
        let _ = tx.flush().await;
        if tx.send(Message::Close(frame)).await.is_err() {
            return;
        }
        while let Some(Ok(m)) = rx.next().await {
            if matches!(m, Message::Close(_)) {
                let _ = tx.flush().await;
                return;
            }
        }
    })
    .await;
}
