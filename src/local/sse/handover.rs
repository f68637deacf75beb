//! An event stream at a handover (design §11): stopped with every byte of
//! its response so far written, left for the next instance ([`watch`]),
//! and written on there from where it stopped ([`take_over`]).
//!
//! In the instance that answered the request, hyper writes the response,
//! and the connection's spool takes whatever the socket does not
//! ([`crate::local::stream_body::Spool`]): the stream stops between two
//! chunks once hyper has handed over every chunk it took
//! ([`crate::local::stream_body::Drained`]), which waits for nobody, and
//! the spool's bytes (the socket may be anywhere inside a chunk) travel
//! as they are, written first by the next instance. What the stream had not
//! written (the rest of its history, its queue) is formatted by the same
//! writer once the sessions have ended, and travels as bytes; its cursor,
//! its per-client `seq` and its filters travel with it. The next instance
//! has no HTTP connection to write through (hyper cannot take over a response
//! in the middle of its body), so it writes the chunked encoding itself:
//! a size line, the chunk, a CRLF, and `0` CRLF CRLF at the end, which is
//! all of it (RFC 9112 §7.1; hand-written, as no crate writes one chunk of
//! a body it did not start).

use crate::context::holding;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{EventStream, Registration, Step, CLOSE_LINGER};
use crate::context::Ctx;
use crate::hub::{Client, ClientIdentity, ClientKind, Outgoing};
use crate::local::stream_body::Drained;
use crate::local::ws::HANDOVER_PAUSE_TIMEOUT;
use crate::parcels::{Entry, Parcel, StreamEntry};
use crate::policy::{Access, Grant, SocketPolicy};

/// A body the broker writes chunk by chunk and that can move at a
/// handover: `/v1/events` ([`EventStream`]) and `/v1/hud`'s.
pub(crate) trait BodySource: Send + Sized + 'static {
    /// The next piece of the body ([`Step::Stop`] only while it moves).
    fn next_step(&mut self) -> impl Future<Output = Step> + Send;
    /// Resolves when a write that does not finish is to be given up on
    /// (the stream was closed, the broker stops, a handover asks), each
    /// after its grace.
    fn give_up(&self) -> impl Future<Output = ()> + Send;
    /// It stopped for a handover: it stops once at most.
    fn stopped(&mut self);
    /// Left for the next instance, with its socket.
    fn into_parcel(self, fd: OwnedFd) -> Box<dyn Parcel>;
    /// For the log.
    fn id(&self) -> u64;
    /// It stops for a handover (while it does, the handover waits for it).
    fn moves(&self) -> bool;
}

/// The body hyper writes: `first`, then what `source` gives. When it stops
/// for a handover it is handed to the receiver (its watch: [`watch`]), and
/// the body then never ends (its connection is cut once it has left).
pub(crate) fn body_of<S: BodySource>(
    first: Bytes,
    source: S,
) -> (
    impl futures_util::Stream<Item = Bytes> + Send + 'static,
    oneshot::Receiver<S>,
) {
    use futures_util::StreamExt;
    let (stopped, on_stop) = oneshot::channel();
    let chunks = futures_util::stream::once(async move { first }).chain(
        futures_util::stream::unfold((source, Some(stopped)), |(mut s, mut stopped)| async move {
            loop {
                match s.next_step().await {
                    Step::Chunk(chunk) => return Some((chunk, (s, stopped))),
                    Step::End => return None,
                    Step::Stop => {
                        s.stopped();
                        let Some(tx) = stopped.take() else { continue };
                        match tx.send(s) {
                            Ok(()) => {
                                match std::future::pending::<std::convert::Infallible>().await {}
                            }
                            // The handover gave up on it: it goes on here.
                            Err(back) => s = back,
                        }
                    }
                }
            }
        }),
    );
    (chunks, on_stop)
}

/// What a stream that can move hands its watch: its connection's socket,
/// the stream itself once it stopped, and what hyper has written of it.
pub(crate) struct Movable<S> {
    socket: super::super::ConnSocket,
    stopped: oneshot::Receiver<S>,
    drained: Drained,
}

impl<S> Movable<S> {
    /// A stream hyper writes on `socket` that can move; its connection's
    /// spool takes hyper's writes from now on (before the response head).
    pub(crate) fn new(
        socket: super::super::ConnSocket,
        stopped: oneshot::Receiver<S>,
        drained: Drained,
        budget: &Arc<crate::hub::QueueBudget>,
    ) -> Self {
        socket.spool().start(&drained, budget);
        Movable {
            socket,
            stopped,
            drained,
        }
    }
}

/// A stream's parcel with the response bytes its socket had not taken.
struct ParcelWithUnwritten {
    parcel: Box<dyn Parcel>,
    unwritten: Vec<u8>,
}

impl std::fmt::Debug for ParcelWithUnwritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParcelWithUnwritten")
            .field("parcel", &self.parcel)
            .field("unwritten", &self.unwritten.len())
            .finish()
    }
}

impl Parcel for ParcelWithUnwritten {
    fn pack(self: Box<Self>) -> Entry {
        match self.parcel.pack() {
            Entry::Stream(mut entry, fd) => {
                entry.unwritten = base64::engine::general_purpose::STANDARD.encode(&self.unwritten);
                Entry::Stream(entry, fd)
            }
            other => other,
        }
    }
}

/// Leaves `parcel` for the next instance, with `unwritten` to write first.
fn leave(ctx: &Ctx, parcel: Box<dyn Parcel>, unwritten: Vec<u8>) {
    ctx.handover
        .leave(Box::new(ParcelWithUnwritten { parcel, unwritten }));
}

/// A moved stream's bytes to write first (`None`: not base64; it is closed).
pub(crate) fn unwritten_of(entry: &StreamEntry) -> Option<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(&entry.unwritten)
        .ok()
}

/// Watches one stream that hyper writes: at a handover, moves it
/// ([`stop`]); once it is closed (a slow consumer) or the broker stops, cuts
/// its connection if it does not end on its own within [`CLOSE_LINGER`]
/// (hyper stops polling a body while the socket is full, so such a stream
/// cannot notice its own close).
///
/// `client`: the stream's hub client, whose close this watch follows
/// (`None`: another watch does, the HUD's inner stream's).
pub(crate) async fn watch<S: BodySource>(
    ctx: Arc<Ctx>,
    client: Option<Arc<Client>>,
    done: CancellationToken,
    kill: CancellationToken,
    movable: Option<Movable<S>>,
) {
    // A stream that can move counts as serving until it has left.
    let serving = movable.as_ref().map(|_| ctx.handover.serving());
    let requested = ctx.handover.requested.clone();
    let killed = async {
        match &client {
            Some(client) => client.killed.cancelled().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = done.cancelled() => return,
        _ = killed => {}
        _ = ctx.cancel.cancelled(), if client.is_some() => {}
        _ = requested.cancelled(), if movable.is_some() => {
            let Some(movable) = movable else { return };
            movable.drained.open_gate();
            match stop(movable, &ctx).await {
                // Left for the next instance, or stopped but not written in
                // time (cut: the reader resumes by cursor): either way this
                // instance's connection ends here.
                Stopped::Moved | Stopped::Unwritten => kill.cancel(),
                Stopped::Ended => {}
                Stopped::NotInTime => {
                    // Its reader has not taken what hyper holds for a
                    // whole pause: a close record would not reach it
                    // either. Cut now (a linger would hold up the whole
                    // handover); it resumes by cursor.
                    tracing::info!(client_id = client.as_ref().map(|c| c.id), "handover: event stream not at a chunk boundary in time; cutting it");
                    drop(serving);
                    kill.cancel();
                }
            }
            return;
        }
    }
    drop(serving);
    tokio::select! {
        _ = done.cancelled() => {}
        _ = tokio::time::sleep(CLOSE_LINGER) => {
            tracing::info!(client_id = client.as_ref().map(|c| c.id), "cutting an event stream that does not drain");
            kill.cancel();
        }
    }
}

enum Stopped {
    /// Left for the next instance.
    Moved,
    /// Stopped, but hyper had not written all of it in time.
    Unwritten,
    /// Not stopped in time: it goes on here.
    NotInTime,
    /// It ended meanwhile.
    Ended,
}

/// Waits, at most [`HANDOVER_PAUSE_TIMEOUT`], for the body to stop between
/// two chunks and for hyper to hand over every chunk it took (to the
/// socket or the spool: nothing here waits for the reader); then leaves
/// the stream with a copy of its socket and the spool's bytes for the
/// next instance.
async fn stop<S: BodySource>(movable: Movable<S>, ctx: &Arc<Ctx>) -> Stopped {
    let Movable {
        socket,
        mut stopped,
        drained,
    } = movable;
    let until = tokio::time::Instant::now() + HANDOVER_PAUSE_TIMEOUT;
    let stream = match tokio::time::timeout_at(until, &mut stopped).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(_)) => return Stopped::Ended,
        Err(_) => {
            // Given up on: a body that stops from now on goes on instead.
            // One that stopped just now is taken all the same.
            stopped.close();
            match stopped.try_recv() {
                Ok(stream) => stream,
                Err(_) => return Stopped::NotInTime,
            }
        }
    };
    if tokio::time::timeout_at(until, drained.all_written())
        .await
        .is_err()
    {
        return Stopped::Unwritten;
    }
    let Some(fd) = socket.dup() else {
        return Stopped::Ended;
    };
    let unwritten = socket.spool().take();
    leave(ctx, stream.into_parcel(fd), unwritten);
    Stopped::Moved
}

/// A stream left for the next instance.
struct StreamParcel {
    stream: EventStream,
    fd: OwnedFd,
}

impl std::fmt::Debug for StreamParcel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamParcel")
            .field("client_id", &self.stream.client.id)
            .finish_non_exhaustive()
    }
}

impl Parcel for StreamParcel {
    /// What it has not written, formatted as it would have written it: the
    /// rest of its history, then its queue (whole now: the sessions have
    /// ended). It then leaves the hub.
    fn pack(self: Box<Self>) -> Entry {
        let StreamParcel { mut stream, fd } = *self;
        let mut out = BytesMut::new();
        stream.write_backlog(&mut out, MOVED_HISTORY_BYTES);
        let (items, mut next_seq) = stream.client.take_all();
        // More history than travels: the next instance reads the rest, and
        // the events queued after it, from the log (which the handover
        // continues), after the last cursor written here. What the queue
        // holds that the log does not (the request tap's records) travels.
        let mut from_log = stream.backlog.len() > 0;
        if from_log {
            for item in items {
                match item {
                    Outgoing::Frame(frame) if stream.tapped => {
                        crate::local::tap_stream::write_tapped(&mut out, &frame);
                    }
                    // A close queued (a slow consumer's): the stream ends
                    // after what it wrote, told so, and its reader resumes
                    // by cursor from the last event it got (each once).
                    Outgoing::Close(code, reason) => {
                        super::write_close(&mut out, code, &reason);
                        stream.finished = true;
                        from_log = false;
                        break;
                    }
                    _ => {}
                }
            }
            // Its queue's events are not written: the next instance's
            // per-client `seq` starts afresh with what it reads.
            next_seq = 0;
            stream.last_seq = 0;
        } else if !stream.finished {
            stream.write_batch(&mut out, items);
        }
        stream.registration.moved = true;
        let client = &stream.client;
        let access = client.access();
        let entry = StreamEntry {
            id: client.id,
            conn_id: client.conn_id.clone(),
            connected_at_ms: client.connected_at_ms,
            peer_pid: stream.peer_pid,
            scopes: access
                .map(|a| a.grant.scopes().to_vec())
                .unwrap_or_default(),
            socket: access.map_or_else(|| "default".into(), |a| a.socket.name.clone()),
            query: stream.query.clone(),
            next_seq,
            last_cursor: stream.last_cursor,
            last_seq: stream.last_seq,
            gap_pending: stream.gap_pending,
            unsent: base64::engine::general_purpose::STANDARD.encode(&out),
            unwritten: String::new(),
            finished: stream.finished,
            from_log,
            hud: None,
        };
        Entry::Stream(entry, fd)
    }
}

/// Serves a stream moved from the previous instance: admitted now (before
/// the gateway connection is taken over, so no event is missed), written
/// on by its own task. False when it cannot be (its socket policy is gone,
/// the client limit): its socket is closed, and the reader resumes by
/// cursor.
pub(crate) fn take_over(
    ctx: &Arc<Ctx>,
    policies: &[Arc<SocketPolicy>],
    entry: StreamEntry,
    fd: OwnedFd,
    slot: crate::slots::Slot,
) -> bool {
    let Some(access) = moved_access(policies, &entry) else {
        return false;
    };
    let Ok(unsent) = base64::engine::general_purpose::STANDARD.decode(&entry.unsent) else {
        return false;
    };
    let Some(unwritten) = unwritten_of(&entry) else {
        return false;
    };
    let wanted = match super::parse_query(Some(&entry.query), None, |k| ctx.sharing.canonical(k)) {
        Ok(wanted) => wanted,
        Err(why) => {
            tracing::warn!(client_id = entry.id, %why, "handover: an event stream's query does not parse here; closing it");
            return false;
        }
    };
    let Some(stream) = take_over_socket(fd) else {
        return false;
    };
    // Checked again: the settings may have changed with the handover (a
    // socket that may no longer observe, a narrower ceiling).
    let refused =
        crate::local::tap_stream::observer_refusal(&access, wanted.tap, wanted.observe_tools)
            .or_else(|| {
                (wanted.tap && !access.grant.is_admin())
                    .then(|| "tap=1 needs operator.admin".to_owned())
            });
    if let Some(why) = refused {
        tracing::warn!(client_id = entry.id, %why, "handover: an event stream may no longer read what it asked for; closing it");
        ctx.spawn_moved(holding(slot, end_with(stream, unwritten, Vec::new(), true)));
        return false;
    }
    let client = ctx.hub.restored_client(
        entry.id,
        entry.conn_id,
        entry.connected_at_ms,
        ClientKind::Sse,
    );
    let _ = client.identity.set(ClientIdentity {
        peer_pid: entry.peer_pid,
        ..Default::default()
    });
    client.set_access(access);
    client
        .observer
        .store(wanted.observe_tools, std::sync::atomic::Ordering::Relaxed);
    // Names and sessions are filtered as events are queued (history, as
    // it is written).
    super::want_filters(&client, &wanted);
    let mut backlog = Vec::new().into_iter();
    let mut gap_after_backlog = false;
    if entry.from_log {
        // The rest of its history, and what it had queued, from the log.
        let cursor = crate::hub::replay::EventId {
            epoch: None,
            cursor: entry.last_cursor,
        };
        let from = crate::hub::replay::ResumePoint::new(None, Some(cursor), None);
        match ctx.hub.admit_at_cursor(&client, &from) {
            Ok((history, _)) => {
                tracing::info!(
                    client_id = entry.id,
                    after = entry.last_cursor,
                    events = history.events.len(),
                    "handover: an event stream's history goes on from the log"
                );
                backlog = history.events.into_iter();
                gap_after_backlog = history.gap_after;
            }
            Err(e) => {
                tracing::warn!(
                    client_id = entry.id,
                    "handover: an event stream's history cannot go on here ({e}); closing it"
                );
                ctx.spawn_moved(holding(slot, end_with(stream, unwritten, unsent, true)));
                return false;
            }
        }
    } else {
        client.continue_seq(entry.next_seq);
        if ctx.hub.admit_restored(&client).is_err() {
            return false;
        }
    }
    if wanted.tap {
        ctx.router.tap.attach(Arc::clone(&client));
    }
    let stream_state = EventStream {
        client: Arc::clone(&client),
        last_cursor: entry.last_cursor,
        last_seq: entry.last_seq,
        gap_pending: entry.gap_pending,
        hole: None,
        gap_after_backlog,
        backlog,
        tapped: wanted.tap,
        keepalive: ctx.settings.limits.sse_keepalive,
        last_write: std::time::Instant::now(),
        cancel: ctx.cancel.clone(),
        handover: ctx.handover.requested.clone(),
        moves: true,
        query: entry.query,
        peer_pid: entry.peer_pid,
        finished: entry.finished,
        registration: Registration {
            ctx: Arc::clone(ctx),
            client_id: client.id,
            done: CancellationToken::new(),
            tapped: wanted.tap,
            moved: false,
        },
    };
    tracing::debug!(client_id = client.id, "event stream taken over");
    ctx.spawn_moved(holding(
        slot,
        write_on(
            Arc::clone(ctx),
            stream,
            stream_state,
            unwritten,
            Bytes::from(unsent),
        ),
    ));
    true
}

/// How much of a moving stream's history it writes into the clients
/// document; past this, the next instance reads the rest from the log.
pub const MOVED_HISTORY_BYTES: usize = 1024 * 1024;

/// Ends a moved stream that cannot go on here: the bytes the previous
/// instance left unwritten, what it had not written, then (when `close`) a
/// `clawmux.close` record saying so, then the end of its body (bounded:
/// the reader may not read). It resumes by cursor.
pub(crate) async fn end_with(
    mut socket: UnixStream,
    unwritten: Vec<u8>,
    unsent: Vec<u8>,
    close: bool,
) {
    let mut body = unsent;
    if close {
        super::write_close_to(&mut body, 1012, "service restart");
    }
    let mut out = unwritten;
    if !body.is_empty() {
        out.extend_from_slice(format!("{:X}\r\n", body.len()).as_bytes());
        out.extend_from_slice(&body);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    let _ = tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, socket.write_all(&out)).await;
}

/// What a moved stream may do here: its grant, within its socket's
/// ceiling (as a moved client's). `None` when its `[[sockets]]` entry is
/// gone: it is closed, and resumes by cursor.
pub(crate) fn moved_access(policies: &[Arc<SocketPolicy>], entry: &StreamEntry) -> Option<Access> {
    let Some(policy) = policies.iter().find(|p| p.name == entry.socket) else {
        tracing::warn!(socket = %entry.socket, "handover: an event stream's socket is no longer configured; closing it");
        return None;
    };
    let asked = Grant::new(&entry.scopes);
    Some(Access {
        grant: asked.within(&policy.ceiling(&asked)),
        socket: Arc::clone(policy),
    })
}

/// A moved stream's socket, for tokio.
pub(crate) fn take_over_socket(fd: OwnedFd) -> Option<UnixStream> {
    let stream = std::os::unix::net::UnixStream::from(fd);
    match stream
        .set_nonblocking(true)
        .and_then(|()| UnixStream::from_std(stream))
    {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("handover: an event stream's socket is unusable ({e})");
            None
        }
    }
}

/// Writes a moved stream's body, chunk by chunk, until it ends, its reader
/// leaves, or it moves again: `unwritten` (response bytes the previous
/// instance left, from inside a chunk) first, then `unsent` as a chunk.
/// At a handover it moves at once, with what its socket has not taken.
pub(crate) async fn write_on<S: BodySource>(
    ctx: Arc<Ctx>,
    mut socket: UnixStream,
    mut stream: S,
    unwritten: Vec<u8>,
    unsent: Bytes,
) {
    let serving = stream.moves().then(|| ctx.handover.serving());
    let mut pending = BytesMut::from(&unwritten[..]);
    frame_chunk(&mut pending, &unsent);
    loop {
        if !pending.is_empty() {
            let (moves, give_up) = (stream.moves(), stream.give_up());
            match write_pending(&mut socket, &mut pending, moves, give_up, &ctx).await {
                Written::All => continue,
                Written::GaveUp => {
                    tracing::info!(
                        client_id = stream.id(),
                        "cutting an event stream that does not drain"
                    );
                    return;
                }
                // The stream stops next (it sees the handover first).
                Written::HandingOver => {}
            }
        }
        let step = if pending.is_empty() {
            let (mut read, _) = socket.split();
            tokio::select! {
                step = stream.next_step() => step,
                () = reader_left(&mut read) => return,
            }
        } else {
            stream.next_step().await
        };
        match step {
            Step::Chunk(bytes) => frame_chunk(&mut pending, &bytes),
            Step::End => {
                // The last chunk: the body ends (the connection with it).
                pending.extend_from_slice(b"0\r\n\r\n");
                let _ = tokio::time::timeout(CLOSE_LINGER, socket.write_all(&pending)).await;
                return;
            }
            Step::Stop => {
                // The socket moves as it is, with what it has not taken.
                match socket.into_std() {
                    Ok(std) => {
                        stream.stopped();
                        let fd = OwnedFd::from(std);
                        leave(&ctx, stream.into_parcel(fd), pending.to_vec());
                    }
                    Err(e) => {
                        tracing::warn!("handover: cannot take an event stream's socket ({e})")
                    }
                }
                drop(serving);
                return;
            }
        }
    }
}

/// Appends `bytes` as one chunk of the chunked body (none if empty: a
/// chunk of size 0 would end the body).
fn frame_chunk(out: &mut BytesMut, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    out.extend_from_slice(format!("{:X}\r\n", bytes.len()).as_bytes());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// How [`write_pending`] ended.
enum Written {
    All,
    /// The reader did not take it before the stream was closed (a slow
    /// consumer) or the broker stopped (each with its grace).
    GaveUp,
    /// A handover asks: what is left moves with the stream.
    HandingOver,
}

/// Writes `pending` (counted in the queue budget while it is written),
/// keeping what the socket has not taken.
async fn write_pending(
    socket: &mut UnixStream,
    pending: &mut BytesMut,
    moves: bool,
    give_up: impl Future<Output = ()>,
    ctx: &Arc<Ctx>,
) -> Written {
    let _hold = ctx.hub.queue_budget().hold(pending.len());
    let write = async {
        while !pending.is_empty() {
            match socket.write(pending).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => bytes::Buf::advance(pending, n),
            }
        }
        true
    };
    tokio::select! {
        biased;
        written = write => if written { Written::All } else { Written::GaveUp },
        _ = ctx.handover.requested.cancelled(), if moves => Written::HandingOver,
        () = give_up => Written::GaveUp,
    }
}

/// Resolves when the reader has closed its side (or its socket failed).
/// A reader sends nothing after its request (the response said
/// `connection: close`); whatever it sends is read and dropped.
async fn reader_left(read: &mut tokio::net::unix::ReadHalf<'_>) {
    let mut sink = [0u8; 512];
    while let Ok(n) = read.read(&mut sink).await {
        if n == 0 {
            return;
        }
    }
}

impl BodySource for EventStream {
    fn next_step(&mut self) -> impl Future<Output = Step> + Send {
        EventStream::next(self)
    }

    fn give_up(&self) -> impl Future<Output = ()> + Send {
        let (client, cancel, handover, moves) = (
            Arc::clone(&self.client),
            self.cancel.clone(),
            self.handover.clone(),
            self.moves,
        );
        async move {
            tokio::select! {
                _ = client.killed.cancelled() => tokio::time::sleep(CLOSE_LINGER).await,
                _ = cancel.cancelled() => tokio::time::sleep(CLOSE_LINGER).await,
                _ = handover.cancelled(), if moves => {
                    tokio::time::sleep(HANDOVER_PAUSE_TIMEOUT).await
                }
            }
        }
    }

    fn stopped(&mut self) {
        self.moves = false;
    }

    fn into_parcel(self, fd: OwnedFd) -> Box<dyn Parcel> {
        Box::new(StreamParcel { stream: self, fd })
    }

    fn id(&self) -> u64 {
        self.client.id
    }

    fn moves(&self) -> bool {
        self.moves
    }
}
