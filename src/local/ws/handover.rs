//! A local client at a handover (design §11): stopped where it is, in
//! the middle of a message or of a frame, and left for the next instance
//! with what it had half read and half written ([`hand_over`]), and served
//! again there from exactly those bytes ([`take_over`]). Nothing waits for
//! the client to read or to finish sending.

use std::sync::Arc;
use std::task::Poll;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;

use super::{
    config, finish, handle_frame, poll_incoming, serve_requests, Conn, Incoming, Restarts, Served,
    WriterEnd,
};
use crate::context::Ctx;
use crate::dispatch::Registration;
use crate::local::preconnect::{Limited, PreconnectBudget};

/// What a client's socket carries from one instance to the next.
#[derive(Debug, Default)]
pub struct Carried {
    /// Read and not parsed: the message in progress from its first byte,
    /// then what followed.
    pub unread: Vec<u8>,
    /// Framed and not written, from inside a frame.
    pub unwritten: Vec<u8>,
}

/// One `/ws` client stopped for the next instance: its registration (the
/// client, its queue and what it holds), its socket, and what it had half
/// read and half written.
#[derive(Debug)]
pub struct ClientParcel {
    pub registration: crate::dispatch::Registration,
    pub fd: std::os::fd::OwnedFd,
    /// This instance's connection on the socket, as it stopped: let go
    /// with the registration once the handover is over, not inside the
    /// pause (closing it is a deregistration, a `close` and its buffers'
    /// frees, for each of a thousand clients).
    pub connection: crate::parcels::Leftover,
    /// Read from the socket and not parsed: the message in progress from
    /// its first byte, then what followed.
    pub unread: Vec<u8>,
    /// Framed for the socket and not written: from inside a frame, written
    /// first by the next instance.
    pub unwritten: Vec<u8>,
    /// It asked to be closed as a direct gateway connection would be
    /// (`restarts=mirror`): it keeps asking in the next instance.
    pub mirror: bool,
}

impl crate::parcels::Parcel for ClientParcel {
    fn client_id(&self) -> Option<u64> {
        Some(self.registration.client().id)
    }

    /// Its queue (whole now: the sessions have ended) and who it is; the
    /// registration and the connection are left over, dropped once the
    /// handover is over.
    fn pack(self: Box<Self>) -> crate::parcels::Entry {
        use crate::hub::Outgoing;
        use crate::parcels::{ClientEntry, Identity, Subscription};
        use base64::Engine as _;
        let parcel = *self;
        let client = Arc::clone(parcel.registration.client());
        let (items, next_seq) = client.take_all();
        let mut frames = Vec::with_capacity(items.len());
        for item in items {
            frames.push(match item {
                Outgoing::Event(head, seq) => head.with_seq(seq),
                Outgoing::Frame(bytes) => bytes,
                // A client being closed is not moved.
                Outgoing::Close(..) => break,
            });
        }
        let subscriptions = {
            let book = parcel.registration.member().book();
            let mut subs: Vec<Subscription> = book.subs.iter().map(Subscription::of).collect();
            subs.sort_by_cached_key(|s| format!("{s:?}"));
            subs
        };
        let identity = client.identity.get().cloned().unwrap_or_default();
        let access = client.access();
        let entry = ClientEntry {
            id: client.id,
            conn_id: client.conn_id.clone(),
            connected_at_ms: client.connected_at_ms,
            identity: Identity {
                client_id: identity.client_id,
                mode: identity.mode,
                version: identity.version,
                display_name: identity.display_name,
                peer_pid: identity.peer_pid,
            },
            tool_events: client
                .tool_events
                .load(std::sync::atomic::Ordering::Relaxed),
            scopes: access
                .map(|a| a.grant.scopes().to_vec())
                .unwrap_or_default(),
            socket: access.map_or_else(|| "default".into(), |a| a.socket.name.clone()),
            next_seq,
            subscriptions,
            queued: Vec::new(),
            queued_lengths: frames.iter().map(|f| f.len()).collect(),
            frames,
            unread: base64::engine::general_purpose::STANDARD.encode(&parcel.unread),
            unwritten: base64::engine::general_purpose::STANDARD.encode(&parcel.unwritten),
            mirror: parcel.mirror,
        };
        crate::parcels::Entry::Client(
            entry,
            parcel.fd,
            crate::parcels::Leftover::new((parcel.registration, parcel.connection)),
        )
    }
}

/// A client taken over from the previous instance ([`crate::handover`]):
/// serves it from where that one stopped, on its socket: the bytes it
/// had left unwritten go first, and its parser starts with the bytes it
/// had read and not parsed.
pub async fn take_over(
    stream: tokio::net::UnixStream,
    carried: Carried,
    registration: Registration,
    restarts: Restarts,
    ctx: Arc<Ctx>,
) {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let budget = PreconnectBudget::new(0);
    budget.lift();
    let client = Arc::clone(registration.client());
    client.count_written(budget.written());
    // The unread bytes go through the reader, which follows their frames;
    // the unwritten ones go before any frame of this instance.
    let continues = !carried.unwritten.is_empty();
    let io = Limited::with_carried(stream, budget, carried.unread, carried.unwritten)
        .fragments_in_pieces(ctx.settings.limits.max_frame_bytes);
    let config = config(&ctx);
    let pause = io.pause();
    let ws = WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await;
    let mut conn = Conn::new(ws, Arc::clone(&client), pause);
    if continues {
        conn.writer.continue_carried();
    }
    conn.ws
        .get_mut()
        .charge_messages_to(Arc::clone(client.budget()));
    tracing::debug!(client_id = client.id, "local client taken over");
    let serving = ctx.handover.serving();
    // The gateway session is taken over (or opened again) right after the
    // clients: a request read before it is ready would be refused, so the
    // client waits for it as a connecting client does (`connect_wait`).
    // Events queued meanwhile are written once it is.
    // (A stop or another handover meanwhile is seen by `serve_requests`.)
    // Set up before the gate, so the commit wakes only I/O; nothing is
    // read or written before it (a stop before then writes nothing).
    tokio::select! {
        biased;
        _ = ctx.cancel.cancelled() => return,
        _ = ctx.handover.gate.passed() => {}
    }
    let deadline = std::time::Instant::now() + ctx.settings.limits.connect_wait;
    tokio::select! {
        _ = ctx.upstream().wait_ready(deadline) => {}
        _ = ctx.handover.requested.cancelled() => {}
        _ = ctx.cancel.cancelled() => {}
    }
    let served = serve_requests(&mut conn, &registration, &ctx, restarts).await;
    if served == Served::HandOver {
        // Every client moves, a mirror one too: a direct gateway connection
        // would see nothing of the broker's handover (when the gateway
        // connection cannot move, the next instance closes it).
        match hand_over(conn, registration, fd, restarts, &ctx).await {
            Ok(()) => return,
            Err((conn, registration)) => {
                client.close(1012, "service restart");
                drop(serving);
                return finish(conn, registration).await;
            }
        }
    }
    drop(serving);
    finish(conn, registration).await
}

/// How long a client may take, at a handover, to finish sending a message
/// larger than the copy kept of it ([`crate::local::preconnect::CARRY_MESSAGE_BYTES`]),
/// before it is closed instead of moved (`1012`; it reconnects and
/// resumes by cursor). Any other client moves at once.
pub const HANDOVER_PAUSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Stops a client for the next instance (design §11), where it is: the
/// messages its parser was handed whole are handled as usual, nothing more
/// is read, and its socket goes with the message it was sending as read so
/// far and the batch being written as far as the socket took it, with the
/// registration (the queue not yet taken). Nothing waits for the client,
/// except to finish a message too large to copy. On failure the
/// connection is given back to be closed as at any stop.
pub(super) async fn hand_over<T>(
    mut conn: Conn<T>,
    registration: Registration,
    fd: std::os::fd::RawFd,
    restarts: Restarts,
    ctx: &Arc<Ctx>,
) -> Result<(), (Conn<T>, Registration)>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // What is queued goes out first, as far as the socket takes it now
    // (one poll of the writer, which waits for nothing): the events a
    // reading client was about to get reach it before the pause, not after.
    std::future::poll_fn(|cx| {
        // A writer that ends here ends as it would have at its next turn:
        // the client then cannot move (below).
        let _ = conn.writer.poll_drive(cx, &mut conn.ws, &conn.client);
        Poll::Ready(())
    })
    .await;
    let pause = conn.pause.clone();
    let member = Arc::clone(registration.member());
    pause.stop();
    let mut stopped = handle_parsed(&mut conn, &member, ctx);
    let mut unread = stopped.then(|| conn.ws.get_mut().take_carried()).flatten();
    if stopped && unread.is_none() {
        // A large message in progress: read to its end, then stop there.
        pause.resume_reads();
        pause.request();
        stopped = read_to_boundary(&mut conn, &member, ctx).await;
        unread = stopped.then(|| conn.ws.get_mut().take_unread());
    }
    let carried = unread.and_then(|unread| {
        let unwritten = conn.writer.take_unwritten(&mut conn.ws)?;
        Some(Carried { unread, unwritten })
    });
    let Some(carried) = carried else {
        tracing::info!(
            client_id = conn.client.id,
            "handover: a client could not move (it was closing, or did not finish a large message in time); closing it"
        );
        conn.writer.hold = false;
        if conn.writer.ended == Some(WriterEnd::Held) {
            conn.writer.ended = None;
        }
        return Err((conn, registration));
    };
    // SAFETY: `fd` is the descriptor of the socket under `conn`, which
    // owns it and is alive here (it is dropped only below), so borrowing
    // it for the duplication cannot outlive or alias a closed descriptor.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let Ok(copy) = rustix::io::fcntl_dupfd_cloexec(borrowed, 3) else {
        return Err((conn, registration));
    };
    let Conn { ws, .. } = conn;
    // The socket stays open through the copy for the next instance, and
    // through `ws`, this instance's descriptor, until the handover is over.
    ctx.handover.leave(Box::new(ClientParcel {
        registration,
        fd: copy,
        connection: crate::parcels::Leftover::new(ws),
        unread: carried.unread,
        unwritten: carried.unwritten,
        mirror: restarts == Restarts::Mirror,
    }));
    Ok(())
}

/// With reads stopped: handles the messages the parser already holds
/// whole, without waiting for anything. `false` if the client left or
/// broke the protocol meanwhile.
fn handle_parsed<T>(
    conn: &mut Conn<T>,
    member: &Arc<crate::dispatch::Member>,
    ctx: &Arc<Ctx>,
) -> bool
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        match crate::boundary::poll_now(|cx| poll_incoming(&mut conn.ws, cx)) {
            Poll::Pending => return true,
            Poll::Ready(Incoming::Text(text)) => handle_frame(&text, member, ctx),
            Poll::Ready(_) => return false,
        }
    }
}

/// Reads and handles messages up to the end of the one in progress
/// (the pause is requested), writing meanwhile, for at most
/// [`HANDOVER_PAUSE_TIMEOUT`]. `false` if that did not happen.
async fn read_to_boundary<T>(
    conn: &mut Conn<T>,
    member: &Arc<crate::dispatch::Member>,
    ctx: &Arc<Ctx>,
) -> bool
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let pause = conn.pause.clone();
    let reached = tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, async {
        loop {
            let read = std::future::poll_fn(|cx| {
                if let Poll::Ready(end) = conn.writer.poll_drive(cx, &mut conn.ws, &conn.client) {
                    return Poll::Ready(Err(end));
                }
                match poll_incoming(&mut conn.ws, cx) {
                    Poll::Ready(i) => Poll::Ready(Ok(Some(i))),
                    Poll::Pending if pause.at_boundary() => Poll::Ready(Ok(None)),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match read {
                Ok(Some(Incoming::Text(text))) => handle_frame(&text, member, ctx),
                Ok(None) => return true,
                // The client left or broke the protocol meanwhile.
                Ok(Some(_)) | Err(_) => return false,
            }
        }
    })
    .await;
    reached == Ok(true)
}
