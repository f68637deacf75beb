//! A dedicated connection at a handover (design §11): both directions
//! stop at a message boundary once what they read is relayed, and the
//! connection moves whole to the next instance ([`Conn::hand_over`]),
//! which serves it from there ([`resume`]).

use std::sync::Arc;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

use super::{Client, ClientIo, Conn, End};
use crate::context::Ctx;
use crate::local::preconnect::{Limited, PreconnectBudget};
use crate::upstream::GatewaySocket;

/// The two readers' pauses for a handover (`gateway`: `None` when its
/// connection cannot move, `wss://`, or the client's socket is unknown).
pub(super) struct Pauses {
    pub client: crate::boundary::Pause,
    pub gateway: Option<crate::boundary::Pause>,
}

impl Conn {
    /// Relays until the connection ends (both sides closed) or moves to the
    /// next instance (left in the handoff).
    pub(super) async fn serve(
        mut self,
        up: GatewaySocket,
        connect_id: &str,
        answered: bool,
        pauses: Pauses,
        fd: Option<std::os::fd::RawFd>,
    ) {
        let ctx = Arc::clone(&self.ctx);
        let dedicated_id = self.slot.id;
        let cancel = ctx.cancel.clone();
        let serving = ctx.handoff.serving();
        let (mut up_tx, mut up_rx) = up.split();
        let end = tokio::select! {
            end = self.relay(&mut up_tx, &mut up_rx, connect_id, answered, &pauses) => end,
            _ = cancel.cancelled() => End::Shutdown,
        };
        let mut end = end;
        if matches!(end, End::HandedOver) {
            // What tungstenite still holds to write either way (an automatic
            // pong), so neither socket moves in the middle of a frame.
            let flushed = tokio::time::timeout(crate::local::ws::HANDOVER_PAUSE_TIMEOUT, async {
                self.local_tx.flush().await.is_ok() && up_tx.flush().await.is_ok()
            })
            .await;
            match (flushed, fd) {
                (Ok(true), Some(fd)) => {
                    self.hand_over(up_tx, up_rx, fd);
                    drop(serving);
                    return;
                }
                _ => end = End::Shutdown,
            }
        }
        drop(serving);
        ctx.dedicated.outcomes.ended(end.label());
        self.finish(end, up_tx, up_rx).await;
        tracing::info!(dedicated_id, "dedicated client disconnected");
    }

    /// Leaves the connection, both readers stopped at a message boundary,
    /// for the next instance: both sockets (copies) and the bytes read from
    /// each and not parsed. On a failure (a descriptor that cannot be
    /// copied) both sockets close without a close frame; the client
    /// reconnects.
    fn hand_over(
        self,
        up_tx: SplitSink<GatewaySocket, Message>,
        up_rx: SplitStream<GatewaySocket>,
        fd: std::os::fd::RawFd,
    ) {
        let Conn {
            local_tx,
            local_rx,
            ctx,
            slot,
            browser,
            peer_uid,
            ..
        } = self;
        let (Ok(mut local), Ok(mut up)) = (
            local_tx.reunite(local_rx.into_inner()),
            up_tx.reunite(up_rx),
        ) else {
            unreachable!("the two halves of one socket");
        };
        // SAFETY: `fd` is the descriptor of the client's socket under
        // `local`, which owns it and is alive here (dropped only below), so
        // borrowing it for the duplication cannot outlive or alias a closed
        // descriptor.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let client = match rustix::io::fcntl_dupfd_cloexec(borrowed, 3) {
            Ok(copy) => copy,
            Err(e) => {
                tracing::warn!(
                    dedicated_id = slot.id,
                    "handover: cannot copy a dedicated client's socket ({e}); closing it"
                );
                return;
            }
        };
        let gateway = match up.get_mut().take_for_handover() {
            Some(Ok(moved)) => moved,
            _ => {
                tracing::warn!(
                    dedicated_id = slot.id,
                    "handover: cannot copy a dedicated gateway socket; closing it"
                );
                return;
            }
        };
        ctx.handoff
            .leave_dedicated(crate::context::DedicatedParcel {
                client,
                client_unread: local.get_mut().take_unread(),
                gateway,
                peer_uid,
                browser,
            });
        tracing::debug!(
            dedicated_id = slot.id,
            "dedicated client left for the next instance"
        );
        // Dropping closes this instance's descriptors only.
        drop((local, up));
    }
}

/// Serves a dedicated connection taken over from the previous instance
/// ([`crate::handover`]): both sockets, from where that one stopped (its
/// `connect` was answered there).
pub async fn resume(parcel: crate::context::DedicatedParcel, ctx: Arc<Ctx>) {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let Some(slot) = ctx.dedicated.try_open() else {
        tracing::warn!("handover: too many dedicated connections; closing a moved one");
        return;
    };
    let crate::context::DedicatedParcel {
        client,
        client_unread,
        gateway,
        peer_uid,
        browser,
    } = parcel;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&client);
    let stream = std::os::unix::net::UnixStream::from(client);
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(stream))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("handover: a dedicated client's socket is unusable ({e})");
            return;
        }
    };
    let up = match crate::upstream::adopt_socket(gateway, &ctx.settings.upstream).await {
        Ok(up) => up,
        Err(e) => {
            tracing::warn!("handover: a dedicated gateway socket is unusable ({e})");
            return;
        }
    };
    let budget = PreconnectBudget::new(0);
    budget.lift();
    let io: Box<dyn ClientIo> = Box::new(stream);
    let io = Limited::with_unread(io, budget.clone(), client_unread);
    let client_pause = io.pause();
    let ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
        io,
        Role::Server,
        Some(crate::local::ws::config(&ctx)),
    )
    .await;
    let (local_tx, local_rx) = ws.split();
    tracing::info!(dedicated_id = slot.id, "dedicated client taken over");
    let client = Client {
        uid: peer_uid,
        browser,
        fd: Some(fd),
    };
    let conn = Conn::new(local_tx, local_rx, &ctx, slot, budget, client);
    let pauses = Pauses {
        client: client_pause,
        gateway: up.get_ref().pause(),
    };
    conn.serve(up, "", true, pauses, Some(fd)).await;
}

/// One direction's reads at a handover: until it is requested, a plain
/// read; once it is, and the connection moves, reads until the reader
/// stops at a message boundary.
#[derive(Default)]
pub(super) struct Watch {
    /// The handover was requested and the connection moves: pausing.
    pausing: bool,
}

/// What one direction's read gave.
pub(super) enum Next<T> {
    Item(Option<T>),
    /// Stopped at a message boundary for the handover.
    Paused,
    /// A handover was requested and this connection does not move (its
    /// `connect` is unanswered, or its gateway socket cannot move): it is
    /// closed now, as at a stop.
    Stop,
}

impl Watch {
    pub(super) async fn next<S: futures_util::Stream + Unpin>(
        &mut self,
        rx: &mut S,
        pause: Option<&crate::boundary::Pause>,
        requested: &tokio_util::sync::CancellationToken,
        decide: &impl Fn() -> bool,
    ) -> Next<S::Item> {
        if !self.pausing {
            tokio::select! {
                m = rx.next() => return Next::Item(m),
                _ = requested.cancelled() => {}
            }
            match pause {
                Some(pause) if decide() => {
                    pause.request();
                    self.pausing = true;
                }
                _ => return Next::Stop,
            }
        }
        let Some(pause) = pause else {
            return Next::Stop;
        };
        match pause.next_before_boundary(rx).await {
            Some(m) => Next::Item(m),
            None => Next::Paused,
        }
    }
}
