//! The writing half of a local client's connection: drains the client's
//! queue into its socket, polled by the client's own task beside its reads.
//!
//! Events and responses are framed here ([`super::frames`]): a batch is
//! handed to the socket as vectored writes of headers, `seq` digits and
//! slices of the shared encoded events, with no copy per client.
//! tungstenite, which reads the socket, still writes the close frames and
//! answers pings; [`Limited`] keeps its frames and ours apart.

use std::io::IoSlice;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;

use super::frames::{Framed, Frames, Payload, MAX_SLICES};
use super::{truncate_reason, CLOSE_LINGER, WRITER_TURN_BATCHES};
use crate::hub::{Client, Outgoing};
use crate::local::preconnect::Limited;
use crate::protocol::frames::EVENT_SUFFIX;

/// How the writer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriterEnd {
    /// A close frame was written: nothing may follow it.
    Closed,
    /// The socket failed.
    Failed,
    /// The client was closed as a slow consumer while a write waited.
    Killed,
    /// Held for a handover: the batch taken is written and flushed, and no
    /// other is taken.
    Held,
}

/// The steps of writing a close frame.
enum CloseStep {
    /// If the peer closed first, tungstenite has queued the echo of its
    /// close frame (same code, as the gateway answers): a flush writes it,
    /// and our own close is then refused unwritten.
    FlushFirst(CloseFrame),
    Send(CloseFrame),
    FlushLast,
}

/// Drains the client's queue into its socket, several frames per write,
/// polled by the client's task beside its reads (no task of its own), at
/// most [`WRITER_TURN_BATCHES`] batches per turn.
pub(super) struct Writer {
    /// The frames of the batch being written, and how far the socket took them.
    frames: Frames<Outgoing>,
    /// The rest of the batch: items not framed yet (after a close).
    batch: std::vec::IntoIter<Outgoing>,
    /// Given to the socket since the last flush.
    unflushed: bool,
    close: Option<CloseStep>,
    /// tungstenite has been given a close frame: nothing of ours may follow.
    close_started: bool,
    pub(super) ended: Option<WriterEnd>,
    /// Batches taken in the current turn.
    taken_this_turn: u32,
    /// Take no more batches (a handover leaves them queued).
    pub(super) hold: bool,
    /// For a socket without vectored writes: the bytes of one write.
    copy: Vec<u8>,
}

/// A socket without vectored writes is given at most this much per write
/// (copied from the batch).
const COPY_WRITE_BYTES: usize = 64 * 1024;

/// A batch's scratch buffer (headers and digits) larger than this after a
/// batch is not kept.
const KEEP_SCRATCH_BYTES: usize = 16 * 1024;

impl Framed for Outgoing {
    fn payload(&self) -> Payload<'_> {
        match self {
            Outgoing::Event(head, seq) => Payload::Event {
                prefix: head.prefix(),
                seq: *seq,
                suffix: EVENT_SUFFIX,
            },
            Outgoing::Frame(bytes) => Payload::Text(bytes),
            // Closes are written by tungstenite, never framed here.
            Outgoing::Close(..) => Payload::Text(&[]),
        }
    }
}

/// Whether dropping `item` frees a large allocation (this batch holds
/// the last reference to it).
fn last_large_holder(item: &Outgoing) -> bool {
    match item {
        Outgoing::Event(head, _) => {
            head.len() >= crate::bounds::MAPPED_BLOCK_BYTES
                && std::sync::Arc::strong_count(head) == 1
        }
        Outgoing::Frame(bytes) => {
            bytes.len() >= crate::bounds::MAPPED_BLOCK_BYTES && bytes.is_unique()
        }
        Outgoing::Close(..) => false,
    }
}

type Socket<T> = WebSocketStream<Limited<T>>;

impl Writer {
    pub(super) fn new() -> Self {
        Writer {
            frames: Frames::default(),
            batch: Vec::new().into_iter(),
            unflushed: false,
            close: None,
            close_started: false,
            ended: None,
            taken_this_turn: 0,
            hold: false,
            copy: Vec::new(),
        }
    }

    /// For a handover: takes no more batches, and gives the bytes of the
    /// batch not written yet (from inside a frame, with tungstenite's
    /// frames waiting for a boundary in their place), without waiting for
    /// the socket. `None` if the writer ended or a close is on its way
    /// (the client is leaving: it does not move).
    pub(super) fn take_unwritten<T>(&mut self, ws: &mut Socket<T>) -> Option<Vec<u8>>
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        if self.ended.is_some()
            || self.close.is_some()
            || self.close_started
            || self.batch.len() > 0
        {
            return None;
        }
        self.hold = true;
        let held = ws.get_mut().take_held();
        let unwritten = self.frames.take_unwritten(&held);
        self.unflushed = false;
        self.copy = Vec::new();
        Some(unwritten)
    }

    /// On a socket the previous instance left bytes unwritten on (held by
    /// [`Limited`]): they are written first, as a flush.
    pub(super) fn continue_carried(&mut self) {
        self.unflushed = true;
    }

    /// Writes until the queue is empty and flushed (`Pending`, woken by the
    /// next push or by the socket), or for one turn (`Pending`, woken at
    /// once), or until the writer ends (`Ready`, once).
    pub(super) fn poll_drive<T>(
        &mut self,
        cx: &mut Context<'_>,
        ws: &mut Socket<T>,
        client: &Client,
    ) -> Poll<WriterEnd>
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        if self.ended.is_some() {
            return Poll::Pending;
        }
        self.taken_this_turn = 0;
        let polled = self.poll_write(cx, ws, client);
        let polled = match polled {
            // A write waiting on a client that does not read is abandoned
            // once it is closed as a slow consumer.
            Poll::Pending if self.mid_batch() && client.poll_killed(cx) => {
                Poll::Ready(WriterEnd::Killed)
            }
            other => other,
        };
        if let Poll::Ready(end) = polled {
            self.ended = Some(end);
        }
        polled
    }

    fn mid_batch(&self) -> bool {
        !self.frames.is_empty() || self.unflushed || self.batch.len() > 0 || self.close.is_some()
    }

    /// Gives the socket what it takes of the batch's frames.
    fn poll_frames<T>(&mut self, cx: &mut Context<'_>, io: &mut Limited<T>) -> Poll<Result<(), ()>>
    where
        T: AsyncWrite + Unpin,
    {
        while !self.frames.is_empty() {
            if self.frames.at_frame_boundary()
                && io.has_held()
                && ready!(io.poll_write_held(cx)).is_err()
            {
                return Poll::Ready(Err(()));
            }
            let written = if io.frames_vectored() {
                let mut slices = [IoSlice::new(&[]); MAX_SLICES];
                let n = self.frames.slices(&mut slices);
                ready!(io.poll_write_frames(cx, &slices[..n]))
            } else {
                self.copy.clear();
                self.frames.copy_into(&mut self.copy, COPY_WRITE_BYTES);
                let written = ready!(io.poll_write_frames(cx, &[IoSlice::new(&self.copy)]));
                if self.copy.capacity() > COPY_WRITE_BYTES {
                    self.copy = Vec::new();
                }
                written
            };
            match written {
                Ok(0) | Err(_) => return Poll::Ready(Err(())),
                Ok(n) => {
                    self.frames.advance(n);
                    self.unflushed = true;
                    io.set_mid_frame(!self.frames.at_frame_boundary());
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    fn poll_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        ws: &mut Socket<T>,
        client: &Client,
    ) -> Poll<WriterEnd>
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        use futures_util::SinkExt;
        loop {
            if !self.frames.is_empty() {
                if ready!(self.poll_frames(cx, ws.get_mut())).is_err() {
                    return Poll::Ready(WriterEnd::Failed);
                }
                let frees_large = self.frames.items().iter().any(last_large_holder);
                self.frames.clear(KEEP_SCRATCH_BYTES);
                if frees_large {
                    // A large block served from free heap space (not
                    // mapped on its own) stays resident otherwise.
                    crate::bounds::return_free_memory();
                }
                continue;
            }
            if let Some(step) = self.close.take() {
                match step {
                    CloseStep::FlushFirst(frame) => {
                        if ws.poll_flush_unpin(cx).is_pending() {
                            self.close = Some(CloseStep::FlushFirst(frame));
                            return Poll::Pending;
                        }
                        self.close = Some(CloseStep::Send(frame));
                    }
                    CloseStep::Send(frame) => match ws.poll_ready_unpin(cx) {
                        Poll::Pending => {
                            self.close = Some(CloseStep::Send(frame));
                            return Poll::Pending;
                        }
                        Poll::Ready(Err(_)) => return Poll::Ready(WriterEnd::Closed),
                        Poll::Ready(Ok(())) => {
                            self.close_started = true;
                            if ws.start_send_unpin(Message::Close(Some(frame))).is_err() {
                                return Poll::Ready(WriterEnd::Closed);
                            }
                            self.close = Some(CloseStep::FlushLast);
                        }
                    },
                    CloseStep::FlushLast => {
                        if ws.poll_flush_unpin(cx).is_pending() {
                            self.close = Some(CloseStep::FlushLast);
                            return Poll::Pending;
                        }
                        return Poll::Ready(WriterEnd::Closed);
                    }
                }
                continue;
            }
            if self.batch.len() > 0 {
                self.frame_batch(client);
                continue;
            }
            if self.unflushed {
                // tungstenite's held frames go too.
                match ready!(std::pin::Pin::new(ws.get_mut()).poll_flush(cx)) {
                    Ok(()) => self.unflushed = false,
                    Err(_) => return Poll::Ready(WriterEnd::Failed),
                }
                continue;
            }
            if self.hold {
                return Poll::Ready(WriterEnd::Held);
            }
            // Turn over: let the caller poll the client's socket for
            // reads, and come back at once.
            if self.taken_this_turn >= WRITER_TURN_BATCHES {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            // Written and flushed: the next batch (taking it is the
            // client's progress).
            match client.poll_next_batch(cx) {
                Poll::Ready(batch) => self.batch = batch.into_iter(),
                Poll::Pending => {
                    // Idle: an idle client keeps no batch buffers.
                    self.frames.clear(0);
                    self.copy = Vec::new();
                    return Poll::Pending;
                }
            }
            self.taken_this_turn += 1;
        }
    }

    /// Frames the batch's items up to its close, if any (which is written
    /// after them, by tungstenite).
    fn frame_batch(&mut self, client: &Client) {
        for item in self.batch.by_ref() {
            match item {
                Outgoing::Close(code, reason) => {
                    self.close = Some(CloseStep::FlushFirst(CloseFrame {
                        code: CloseCode::from(code),
                        reason: Utf8Bytes::from(truncate_reason(&reason)),
                    }));
                    return;
                }
                Outgoing::Frame(ref bytes) if std::str::from_utf8(bytes).is_err() => {
                    // Every frame is built from JSON text; one that is not
                    // would make the client close the connection (1007).
                    tracing::warn!(
                        client_id = client.id,
                        bytes = bytes.len(),
                        "not sending a frame that is not UTF-8"
                    );
                }
                item => self.frames.push(item),
            }
        }
    }

    /// After a write was abandoned (slow consumer): the rest of the frame
    /// in progress, then the close frame, briefly.
    pub(super) async fn send_slow_consumer_close<T>(&mut self, ws: &mut Socket<T>)
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        if self.close_started {
            // tungstenite has a close frame of its own on the way.
            return;
        }
        let (code, reason) = crate::hub::client::SLOW_CONSUMER_CLOSE;
        self.frames.cut_after_current();
        self.frames.push_close(code, reason);
        let io = ws.get_mut();
        let _ = tokio::time::timeout(
            CLOSE_LINGER,
            std::future::poll_fn(|cx| self.poll_frames(cx, io)),
        )
        .await;
    }
}
