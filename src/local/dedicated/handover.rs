//! A dedicated connection at a handover (design §11): both directions
//! stop where they are, once the messages their parsers hold whole are
//! relayed, and the connection moves to the next instance
//! ([`Conn::hand_over`]) with, for each socket, the message it was
//! sending as read so far and the bytes written to it that it had not
//! taken; the next instance serves it from there ([`take_over`]). Nothing
//! waits for either peer, except to finish a message too large to carry.

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

impl Pauses {
    /// The connection moves: from now on both sockets take every write
    /// whole, so that neither writer waits for its peer or keeps half a
    /// frame (what a socket has not taken moves with it).
    pub(super) fn spool_writes(&self) {
        self.client.spool_writes();
        if let Some(gateway) = &self.gateway {
            gateway.spool_writes();
        }
    }
}

/// A write (a relayed message, a flush) that waits for its peer until a
/// handover is requested; then, if the connection moves (`decide`: its
/// writes are taken whole from then on), it is polled again and done at
/// once.
pub(super) async fn write_until_moving<F: std::future::Future>(
    write: F,
    requested: &tokio_util::sync::CancellationToken,
    decide: &impl Fn() -> bool,
) -> F::Output {
    tokio::pin!(write);
    tokio::select! {
        biased;
        out = &mut write => return out,
        _ = requested.cancelled() => {}
    }
    decide();
    write.await
}

/// One `/ws/dedicated` connection, stopped where it was for the next
/// instance: the client's socket and the gateway's, each with the bytes
/// read from it that its parser was not given (a message half read, from
/// its first byte) and the bytes written to it that it did not take.
#[derive(Debug)]
pub struct DedicatedParcel {
    pub client: std::os::fd::OwnedFd,
    pub client_unread: Vec<u8>,
    pub client_unwritten: Vec<u8>,
    pub gateway: crate::upstream::MovedSocket,
    pub peer_uid: Option<u32>,
    pub browser: bool,
}

impl crate::parcels::Parcel for DedicatedParcel {
    fn pack(self: Box<Self>) -> crate::parcels::Entry {
        use base64::Engine as _;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
        let d = *self;
        let entry = crate::parcels::DedicatedEntry {
            client_unread: b64(&d.client_unread),
            client_unwritten: b64(&d.client_unwritten),
            gateway_kind: d.gateway.kind,
            gateway_unread: b64(&d.gateway.unread),
            gateway_unwritten: b64(&d.gateway.unwritten),
            peer_uid: d.peer_uid,
            browser: d.browser,
        };
        crate::parcels::Entry::Dedicated(entry, d.client, d.gateway.fd)
    }
}

impl Conn {
    /// Relays until the connection ends (both sides closed) or moves to the
    /// next instance (left in the handover).
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
        let serving = ctx.handover.serving();
        let (mut up_tx, mut up_rx) = up.split();
        let end = tokio::select! {
            end = self.relay(&mut up_tx, &mut up_rx, connect_id, answered, &pauses) => end,
            _ = cancel.cancelled() => End::Shutdown,
        };
        let mut end = end;
        if matches!(end, End::HandedOver) {
            // What tungstenite still holds to write either way (an automatic
            // pong, the rest of a frame): the spools take it at once.
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

    /// Leaves the connection, both readers stopped, for the next instance:
    /// both sockets (copies), the bytes read from each and not parsed (a
    /// message half read, from its first byte), and the bytes written to
    /// each and not taken. On a failure (a descriptor that cannot be
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
        let Some(client_unread) = local.get_mut().take_carried() else {
            tracing::warn!(
                dedicated_id = slot.id,
                "handover: a dedicated client stopped inside a message too large to carry; closing it"
            );
            return;
        };
        ctx.handover.leave(Box::new(DedicatedParcel {
            client,
            client_unread,
            client_unwritten: local.get_mut().take_held(),
            gateway,
            peer_uid,
            browser,
        }));
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
pub async fn take_over(parcel: DedicatedParcel, ctx: Arc<Ctx>) {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let Some(slot) = ctx.dedicated.try_open() else {
        tracing::warn!("handover: too many dedicated connections; closing a moved one");
        return;
    };
    let DedicatedParcel {
        client,
        client_unread,
        client_unwritten,
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
    let up = match crate::upstream::take_over_socket(gateway, &ctx.settings.upstream).await {
        Ok(up) => up,
        Err(e) => {
            tracing::warn!("handover: a dedicated gateway socket is unusable ({e})");
            return;
        }
    };
    let budget = PreconnectBudget::new(0);
    budget.lift();
    let io: Box<dyn ClientIo> = Box::new(stream);
    let io = Limited::with_unwritten(io, budget.clone(), client_unread, client_unwritten)
        .fragments_in_pieces(ctx.settings.limits.max_frame_bytes);
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
/// read; once it is, and the connection moves, the reader is stopped where
/// it is and gives the messages its parser holds whole, then stops; inside
/// a message too large to carry, it reads on to that message's end.
#[derive(Default)]
pub(super) struct Watch {
    /// The handover was requested and the connection moves: stopped.
    stopped: bool,
    /// Reading on to the end of a message too large to carry.
    to_boundary: bool,
}

/// What one direction's read gave.
pub(super) enum Next<T> {
    Item(Option<T>),
    /// Stopped for the handover, with nothing parsed left to relay.
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
        if !self.stopped {
            tokio::select! {
                m = rx.next() => return Next::Item(m),
                _ = requested.cancelled() => {}
            }
            match pause {
                Some(pause) if decide() => {
                    pause.stop();
                    self.stopped = true;
                }
                _ => return Next::Stop,
            }
        }
        let Some(pause) = pause else {
            return Next::Stop;
        };
        if !self.to_boundary {
            // (Both directions run in one task: the other half of `rx` is
            // free whenever this runs.)
            if let std::task::Poll::Ready(m) =
                crate::boundary::poll_now(|cx| rx.poll_next_unpin(cx))
            {
                return Next::Item(m);
            }
            if pause.carries() {
                return Next::Paused;
            }
            pause.resume_reads();
            pause.request();
            self.to_boundary = true;
        }
        match pause.next_before_boundary(rx).await {
            Some(m) => Next::Item(m),
            None => Next::Paused,
        }
    }
}
