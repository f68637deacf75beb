//! The pre-`connect` read limit, enforced under the WebSocket parser.
//!
//! tungstenite takes its frame-size limit once, at construction, and
//! tokio-tungstenite offers no way to change it afterwards; the limit after
//! `connect` is `max_frame_bytes` (25 MiB). Before `connect` a client may
//! send at most `preconnect_max_bytes` (64 KiB, the gateway's pre-auth cap),
//! so the socket under the parser stops reading past that many bytes (plus
//! room for frame headers): a client can never make the broker buffer more
//! than that before it is admitted. [`PreconnectBudget::lift`] ends the limit.
//! The same wrapper counts the bytes the socket accepts: a client taking a
//! large frame slowly is making progress, not stalled.
//! Hand-written: no crate wraps a reader with a byte budget that can be lifted.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes allowed on top of the payload limit for WebSocket frame headers
/// (14 bytes a frame at most) and a few control frames.
pub const FRAME_OVERHEAD_BYTES: u64 = 1024;

use super::ws_errors::OverBudget;

/// The remaining pre-`connect` read budget, shared with the session; and
/// the count of bytes the socket accepted from the writer (the client's
/// progress, see [`crate::hub::Client::count_written`]).
#[derive(Debug, Clone)]
pub struct PreconnectBudget(Arc<AtomicU64>, Arc<AtomicU64>);

impl PreconnectBudget {
    pub fn new(bytes: u64) -> Self {
        PreconnectBudget(
            Arc::new(AtomicU64::new(bytes.saturating_add(FRAME_OVERHEAD_BYTES))),
            Arc::new(AtomicU64::new(0)),
        )
    }

    /// The client was admitted: no pre-connect limit any more.
    pub fn lift(&self) {
        self.0.store(u64::MAX, Ordering::Relaxed);
    }

    /// Bytes written to the socket so far.
    pub fn written(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.1)
    }
}

use crate::boundary::Follower;
pub use crate::boundary::Pause;
/// A frame whose payload is larger than this does not fit the idle read
/// buffer (`read_buffer_size`, 2 KiB): its header is handed to the parser
/// alone (`crate::boundary::FrameCursor`), so the parser's buffer for it holds exactly the
/// payload and can be given back once the frame is handled
/// ([`ReleaseReadBuffer`]).
pub use crate::boundary::LARGE_FRAME_BYTES;

/// An I/O object whose reads stop at the budget, and stop at the end of a
/// large frame's header.
#[derive(Debug)]
pub struct Limited<T> {
    inner: T,
    budget: PreconnectBudget,
    /// The client's frames (a large frame's header is handed over alone),
    /// and for a handover the pause at the end of the current message
    /// ([`Pause`], design §11).
    follow: Follower,
    /// What tungstenite wrote while a frame of the broker's own was half
    /// written (see [`Limited::poll_write_frames`]).
    held: Held,
    /// The message being read, counted in the broker-wide queue budget.
    charge: Option<MessageCharge>,
}

/// A client's incoming message counted in the broker-wide budget
/// (`queue_total_bytes`) from its first frame's header, fragments
/// included, until it has been handled: many clients sending large
/// messages slowly, or in fragments, are held to the same memory bound as
/// queues. Under [`CHARGE_ABOVE_BYTES`] a message is not judged.
#[derive(Debug)]
struct MessageCharge {
    budget: std::sync::Arc<crate::hub::QueueBudget>,
    counted: u64,
}

/// A message at most this large is always read (requests are small).
pub const CHARGE_ABOVE_BYTES: u64 = 64 * 1024;

impl Drop for MessageCharge {
    fn drop(&mut self) {
        use crate::hub::client::BudgetCount;
        self.budget.count_sub(self.counted as usize);
    }
}

/// Bytes tungstenite wrote (pongs, close frames: whole frames, in order)
/// that could not go on the socket at once, because the broker's own
/// writer was in the middle of a frame or the socket was full. They go
/// before the writer's next frame.
#[derive(Debug, Default)]
struct Held {
    /// (Written from its front: `advance` is O(1), however large.)
    bytes: bytes::BytesMut,
    /// The first bytes of `bytes` that a previous instance left unwritten
    /// (not tungstenite's: not counted against [`MAX_HELD_BYTES`]).
    carried: usize,
    /// The broker's writer has given the socket part of a frame.
    mid_frame: bool,
    /// The broker writes frames of its own on this socket.
    shared: bool,
    /// Every write is taken whole, held when the socket does not take it
    /// at once, and flushes do not wait ([`Limited::spool_writes`]).
    spool: bool,
}

/// The most bytes of tungstenite's own frames held back (see [`Held`]):
/// a client that sends pings and never reads the pongs is disconnected
/// past this.
pub const MAX_HELD_BYTES: usize = 64 * 1024;

impl<T> Limited<T> {
    pub fn new(inner: T, budget: PreconnectBudget) -> Self {
        Self::with_unread(inner, budget, Vec::new())
    }

    /// A reader whose first bytes are `unread`: read from the socket by the
    /// previous instance and not handed to its parser (they start at a
    /// message boundary, so the frames are followed from there).
    pub fn with_unread(inner: T, budget: PreconnectBudget, unread: Vec<u8>) -> Self {
        Limited {
            inner,
            budget,
            follow: Follower::new(unread, true).carrying(CARRY_MESSAGE_BYTES),
            held: Held::default(),
            charge: None,
        }
    }

    /// Hands a fragment of a message (a data frame of several) larger than
    /// the copy kept for a handover ([`CARRY_MESSAGE_BYTES`]), and at most
    /// `max_frame_bytes`, to the parser in pieces: the message it collects
    /// is then the only copy, the one the budgets count
    /// (`crate::boundary::Follower::fragments_in_pieces`).
    pub fn fragments_in_pieces(mut self, max_frame_bytes: usize) -> Self {
        self.follow
            .fragments_in_pieces(CARRY_MESSAGE_BYTES as u64, max_frame_bytes as u64);
        self
    }

    /// As [`Limited::with_unread`], on a socket to which the previous
    /// instance left `unwritten` bytes (the rest of a batch, from inside a
    /// frame): they are written first, before any frame of this instance.
    pub fn with_carried(
        inner: T,
        budget: PreconnectBudget,
        unread: Vec<u8>,
        unwritten: Vec<u8>,
    ) -> Self {
        let mut limited = Self::with_unwritten(inner, budget, unread, unwritten);
        limited.held.shared = true;
        limited
    }

    /// As [`Limited::with_unread`], on a socket only tungstenite writes on
    /// (a dedicated connection's), to which the previous instance left
    /// `unwritten` bytes (the rest of a frame): they are written before
    /// anything tungstenite writes, as soon as the socket takes them, by
    /// whichever of its reads and writes comes first.
    pub fn with_unwritten(
        inner: T,
        budget: PreconnectBudget,
        unread: Vec<u8>,
        unwritten: Vec<u8>,
    ) -> Self {
        let mut limited = Self::with_unread(inner, budget, unread);
        limited.held.carried = unwritten.len();
        limited.held.bytes = bytes::BytesMut::from(&unwritten[..]);
        limited
    }

    /// Counts each message read from here on in `budget`, from its first
    /// frame's header until [`Limited::message_handled`]; a message over
    /// [`CHARGE_ABOVE_BYTES`] that takes the budget past its limit ends
    /// the reads with [`OverBudget`] (the session closes `1009`).
    pub fn charge_messages_to(&mut self, budget: std::sync::Arc<crate::hub::QueueBudget>) {
        self.charge = Some(MessageCharge { budget, counted: 0 });
    }

    /// The message handed to the parser last has been handled: its count
    /// is given back (unless the next one has begun).
    pub fn message_handled(&mut self) {
        if let Some(c) = &mut self.charge {
            if self.follow.between_messages() {
                use crate::hub::client::BudgetCount;
                c.budget.count_sub(c.counted as usize);
                c.counted = 0;
            }
        }
    }

    /// The broker's writer is (or is no longer) in the middle of a frame:
    /// nothing tungstenite writes meanwhile goes on the socket.
    pub fn set_mid_frame(&mut self, mid: bool) {
        self.held.shared = true;
        self.held.mid_frame = mid;
    }

    /// For a socket only tungstenite writes on, that must be able to move
    /// at any moment: every write tungstenite makes is taken whole (what
    /// the socket does not take at once is held, in order), and a flush
    /// writes what it can without waiting, so tungstenite never holds a
    /// half-written frame. The caller drains the held bytes
    /// ([`Limited::poll_write_held`]) and bounds them ([`Limited::held_len`]).
    pub fn spool_writes(&mut self) {
        self.held.spool = true;
    }

    /// Bytes held back from the socket (see [`Limited::spool_writes`]).
    pub fn held_len(&self) -> usize {
        self.held.bytes.len()
    }

    /// Bytes written to the socket so far (its progress).
    pub fn written(&self) -> u64 {
        self.budget.1.load(Ordering::Relaxed)
    }

    /// Whether tungstenite's bytes wait to be written (before the next frame).
    pub fn has_held(&self) -> bool {
        !self.held.bytes.is_empty()
    }

    /// The handle that pauses this reader at a message boundary.
    pub fn pause(&self) -> Pause {
        self.follow.pause()
    }

    /// After a pause: the bytes read from the socket and not handed to the
    /// parser (the start of the client's next message, if any).
    pub fn take_unread(&mut self) -> Vec<u8> {
        self.follow.take_unread()
    }

    /// After [`Pause::stop`]: the message in progress as read so far and
    /// the bytes not handed to the parser (see `Follower::take_carried`).
    pub fn take_carried(&mut self) -> Option<Vec<u8>> {
        self.follow.take_carried()
    }

    /// tungstenite's frames not written yet (they go after the broker's
    /// frame in progress), taken for the next instance.
    pub fn take_held(&mut self) -> Vec<u8> {
        self.held.carried = 0;
        std::mem::take(&mut self.held.bytes).to_vec()
    }
}

/// A message a client is sending can move half read (its bytes so far go
/// to the next instance) up to this size; a larger one is read to its end
/// first. Requests are small; this bounds the copy kept per client.
pub const CARRY_MESSAGE_BYTES: usize = CHARGE_ABOVE_BYTES as usize;

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.drains_first() {
            // A failure shows at the next write.
            let _ = self.poll_write_held(cx);
        }
        let Limited {
            inner,
            budget,
            follow,
            charge,
            ..
        } = &mut *self;
        let polled = follow.poll_read(cx, buf, |cx, buf| poll_read_socket(inner, budget, cx, buf));
        if let (Poll::Ready(Ok(())), Some(c)) = (&polled, charge) {
            use crate::hub::client::BudgetCount;
            let now = follow.message_bytes();
            if now != c.counted {
                // A new message begun: the last one's count was given back
                // when it was handled, or goes now.
                c.budget.count_sub(c.counted as usize);
                c.budget.count_add(now as usize);
                c.counted = now;
                if now > CHARGE_ABOVE_BYTES && c.budget.is_over() {
                    return Poll::Ready(Err(OverBudget.into()));
                }
            }
        }
        polled
    }
}

/// A read from the socket, within the pre-`connect` budget.
fn poll_read_socket<T: AsyncRead + Unpin>(
    inner: &mut T,
    budget: &PreconnectBudget,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    let left = budget.0.load(Ordering::Relaxed);
    if left == 0 {
        // The session closes `1009` on it (see `ws_errors::classify`).
        return Poll::Ready(Err(OverBudget.into()));
    }
    if left == u64::MAX {
        return Pin::new(inner).poll_read(cx, buf);
    }
    let room = buf
        .remaining()
        .min(usize::try_from(left).unwrap_or(usize::MAX));
    let mut limited = buf.take(room);
    let res = Pin::new(inner).poll_read(cx, &mut limited);
    let n = limited.filled().len();
    if let Poll::Ready(Ok(())) = &res {
        // SAFETY: `limited` reads into `buf`'s unfilled part, so these
        // `n` bytes of `buf` were initialized and filled by the inner read.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        // Lifted meanwhile? Then u64::MAX stays (fetch_update keeps it).
        let _ = budget
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b != u64::MAX).then(|| b.saturating_sub(n as u64))
            });
    }
    res
}

// Two writers share the socket: the broker's own (its frames, written
// whole by `poll_write_frames`, many per vectored write) and tungstenite
// (pongs and close frames, through `AsyncWrite`). Bytes from one never go
// inside a frame of the other: tungstenite's go on the socket only when
// the broker's writer is between frames and nothing is held, and are held
// otherwise (they are whole frames: tungstenite hands its buffer over
// from its start, and once the broker writes frames of its own, a write
// of part of tungstenite's buffer takes the rest too, so nothing of its
// frames is left half in its own buffer).
impl<T: AsyncWrite + Unpin> Limited<T> {
    /// The broker's own frames: a vectored write of `bufs`, straight to
    /// the socket (the caller writes held bytes first, between frames).
    pub fn poll_write_frames(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let res = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &res {
            self.budget.1.fetch_add(*n as u64, Ordering::Relaxed);
        }
        res
    }

    /// Whether the socket takes several slices in one write.
    pub fn frames_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    /// Writes what tungstenite wrote meanwhile (call between frames).
    pub fn poll_write_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.held.bytes.is_empty() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.held.bytes))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.budget.1.fetch_add(n as u64, Ordering::Relaxed);
            crate::bounds::written(&mut self.held.bytes, n);
            self.held.carried = self.held.carried.saturating_sub(n);
        }
        Poll::Ready(Ok(()))
    }

    /// Every write is taken whole: [`Limited::spool_writes`], or the
    /// connection is moving ([`Pause::spool_writes`]).
    fn spooling(&self) -> bool {
        self.held.spool || self.follow.spooling()
    }

    /// Held bytes a previous instance left on a socket only tungstenite
    /// writes on: written before tungstenite's, waiting for the socket.
    fn drains_first(&self) -> bool {
        !self.held.shared && !self.spooling() && !self.held.bytes.is_empty()
    }

    fn hold(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> io::Result<()> {
        if !self.spooling()
            && self.held.bytes.len() - self.held.carried + bytes.len() > MAX_HELD_BYTES
        {
            return Err(io::Error::other(
                "the client does not read the broker's pongs",
            ));
        }
        self.held.bytes.extend_from_slice(bytes);
        // The task that writes held bytes is the one polling tungstenite.
        cx.waker().wake_by_ref();
        Ok(())
    }
}

use std::task::ready;

impl<T: AsyncWrite + Unpin> AsyncWrite for Limited<T> {
    /// tungstenite's writes: every byte is taken (written, or held for
    /// [`Limited::poll_write_held`]).
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.drains_first() {
            ready!(this.poll_write_held(cx))?;
        }
        if this.spooling() && !this.held.mid_frame && !this.held.bytes.is_empty() {
            // What the socket takes now goes first.
            if let Poll::Ready(Err(e)) = this.poll_write_held(cx) {
                return Poll::Ready(Err(e));
            }
        }
        if this.held.mid_frame || !this.held.bytes.is_empty() {
            this.hold(cx, buf)?;
            return Poll::Ready(Ok(buf.len()));
        }
        let n = match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Pending if this.spooling() => {
                this.hold(cx, buf)?;
                return Poll::Ready(Ok(buf.len()));
            }
            polled => ready!(polled)?,
        };
        this.budget.1.fetch_add(n as u64, Ordering::Relaxed);
        // Part of a frame written: the rest is taken too when the broker
        // writes frames of its own beside tungstenite's, so that no half
        // frame is left in tungstenite's buffer (a full socket, instead,
        // leaves tungstenite its whole frames, to write later).
        if (this.held.shared || this.spooling()) && n > 0 && n < buf.len() {
            this.hold(cx, &buf[n..])?;
            return Poll::Ready(Ok(buf.len()));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.spooling() {
            // What the socket takes now; the rest waits for the caller's
            // drain, not for this flush.
            if let Poll::Ready(Err(e)) = self.poll_write_held(cx) {
                return Poll::Ready(Err(e));
            }
        } else if !self.held.mid_frame {
            ready!(self.poll_write_held(cx))?;
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boundary::Releasing;

    /// After a large frame, the parser's read buffer no longer shares the
    /// frame's allocation once it has been polled again: when the frame is
    /// dropped, its memory is freed (before: the buffer kept it for the
    /// connection's life). A small request before and after still reads.
    #[tokio::test]
    async fn a_large_frame_leaves_no_share_of_its_buffer_behind() {
        use futures_util::{SinkExt, StreamExt};
        use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
        use tokio_tungstenite::tungstenite::Message;
        use tokio_tungstenite::WebSocketStream;
        let (ours, theirs) = tokio::io::duplex(4 << 20);
        let budget = PreconnectBudget::new(0);
        budget.lift();
        let config = WebSocketConfig::default().read_buffer_size(2048);
        let ws = WebSocketStream::from_raw_socket(
            Limited::new(ours, budget),
            Role::Server,
            Some(config),
        )
        .await;
        let mut peer = WebSocketStream::from_raw_socket(theirs, Role::Client, None).await;
        let mut rx = Releasing::new(ws);
        for round in 0..3 {
            peer.send(Message::text("small")).await.unwrap();
            peer.send(Message::text("x".repeat(1 << 20))).await.unwrap();
            let small = rx.next().await.unwrap().unwrap();
            assert_eq!(small, Message::text("small"));
            let Message::Text(large) = rx.next().await.unwrap().unwrap() else {
                panic!("a text frame");
            };
            let kept = bytes::Bytes::from(large);
            assert_eq!(kept.len(), 1 << 20);
            // The next poll: nothing more to read.
            let waker = futures_util::task::noop_waker();
            let mut cx = Context::from_waker(&waker);
            assert!(rx.poll_next_unpin(&mut cx).is_pending());
            assert!(
                kept.is_unique(),
                "round {round}: the read buffer still holds the frame's allocation"
            );
        }
    }

    /// Paused for a handover, the reader hands the parser whole messages
    /// only (a fragmented one up to its final frame, control frames
    /// between fragments included) and keeps the rest as unread.
    #[tokio::test]
    async fn a_paused_reader_stops_at_a_message_boundary_and_keeps_the_rest() {
        use tokio::io::AsyncReadExt;
        let text = |fin: bool, opcode: u8, payload: &[u8]| {
            let mut f = vec![if fin { 0x80 } else { 0 } | opcode, payload.len() as u8];
            f.extend_from_slice(payload);
            f
        };
        let mut wire = Vec::new();
        wire.extend(text(false, 0x1, b"he")); // a fragmented message…
        wire.extend(text(true, 0x9, b"")); // …a ping between its fragments…
        wire.extend(text(true, 0x0, b"llo")); // …and its final frame
        let next = text(true, 0x1, b"next");
        wire.extend(&next);
        let (mut tx, rx) = tokio::io::duplex(1024);
        let budget = PreconnectBudget::new(1 << 20);
        budget.lift();
        let mut reader = Limited::new(rx, budget);
        let pause = reader.pause();
        // The first 3 bytes arrive before the pause: a message has begun.
        tokio::io::AsyncWriteExt::write_all(&mut tx, &wire[..3])
            .await
            .unwrap();
        let mut got = vec![0u8; 1024];
        assert_eq!(reader.read(&mut got).await.unwrap(), 3);
        assert!(!pause.at_boundary(), "inside the first message");
        pause.request();
        tokio::io::AsyncWriteExt::write_all(&mut tx, &wire[3..])
            .await
            .unwrap();
        let n = reader.read(&mut got).await.unwrap();
        assert_eq!(
            n,
            wire.len() - next.len() - 3,
            "the rest of the first message, nothing more"
        );
        assert!(pause.at_boundary());
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut buf = [0u8; 16];
        let mut rb = ReadBuf::new(&mut buf);
        assert!(Pin::new(&mut reader)
            .poll_read(&mut cx, &mut rb)
            .is_pending());
        assert_eq!(
            reader.take_unread(),
            next,
            "the next message is the next instance's"
        );
    }
}
