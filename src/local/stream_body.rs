//! The body of an event stream (`/v1/events`, `/v1/hud`), within the
//! broker-wide queue budget.
//!
//! hyper asks a body for its next chunk whenever its own write buffer holds
//! less than ~400 KiB (and fewer than 16 pieces), so it took up to ~650 KB
//! of a stream whose reader does not read: outside every queue, and so
//! outside `queue_total_bytes` (before: 900 such `/v1/events` readers
//! peaked at 890 MiB). Here a chunk handed to hyper is counted in the queue
//! budget until hyper has written it (it drops the chunk then), and the
//! stream is asked for its next chunk only while hyper holds less than
//! [`UNWRITTEN_BYTES`] of it. A stream whose reader stops reading stops
//! taking batches from its queue, so its backlog, its stall and the
//! budget's shedder judge it as they judge a WebSocket client.
//!
//! What hyper writes of such a response is taken whole by the connection's
//! [`Spool`] when the socket cannot take it at once: hyper never holds a
//! half-written chunk, so a handover moves the stream at once with the
//! spool's bytes, whether its reader reads or not. The spool's bytes count
//! with the chunks against [`UNWRITTEN_BYTES`] and in the budget.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use futures_util::Stream;

use crate::hub::client::BudgetHold;
use crate::hub::QueueBudget;

/// The most bytes of one event stream that hyper may hold unwritten before
/// the stream is asked for another chunk (which may be up to one batch,
/// 256 KiB, or one larger event): a stream holds at most this plus one
/// chunk outside its queue, all of it counted in the budget.
pub const UNWRITTEN_BYTES: usize = 64 * 1024;

/// Bytes of a stream's chunks that hyper holds, and its waker (woken when
/// hyper lets go of one), and a second for [`Drained`].
#[derive(Debug, Default)]
struct Unwritten {
    bytes: AtomicUsize,
    waker: AtomicWaker,
    drained: AtomicWaker,
    /// Bytes the connection's [`Spool`] holds (they count against the
    /// bound, not in [`Drained`]: they are off hyper's hands).
    spooled: AtomicUsize,
    /// A handover asks the body to stop: it is polled whatever is unwritten.
    stopping: std::sync::atomic::AtomicBool,
}

impl Unwritten {
    fn gated(&self) -> bool {
        !self.stopping.load(Ordering::Acquire)
            && self.bytes.load(Ordering::Acquire) + self.spooled.load(Ordering::Acquire)
                >= UNWRITTEN_BYTES
    }
}

/// What a handover's wait for an event stream's chunks runs on: a count
/// of bytes hyper holds and a waker. The protocol (register, then look;
/// take off, then wake) is here once, generic, so the loom model in
/// `stream_body/model.rs` checks these very functions.
pub(crate) trait Held {
    fn add(&self, n: usize);
    /// Takes `n` off; what was held before.
    fn sub(&self, n: usize) -> usize;
    fn load(&self) -> usize;
    fn register(&self, waker: &std::task::Waker);
    fn wake(&self);
}

impl Held for Unwritten {
    fn add(&self, n: usize) {
        self.bytes.fetch_add(n, Ordering::AcqRel);
    }

    fn sub(&self, n: usize) -> usize {
        self.bytes.fetch_sub(n, Ordering::AcqRel)
    }

    fn load(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    fn register(&self, waker: &std::task::Waker) {
        self.drained.register(waker);
    }

    fn wake(&self) {
        self.drained.wake();
    }
}

/// hyper let go of a chunk of `n` bytes: it is off the count, then the
/// watcher is woken (after: it looks at the count when woken).
pub(crate) fn let_go<H: Held>(held: &H, n: usize) {
    held.sub(n);
    held.wake();
}

/// Ready once nothing is held. The waker is registered before the count is
/// read, so a `let_go` between the two still wakes it.
pub(crate) fn poll_all_written<H: Held>(held: &H, cx: &mut Context<'_>) -> Poll<()> {
    held.register(cx.waker());
    if held.load() == 0 {
        Poll::Ready(())
    } else {
        Poll::Pending
    }
}

/// One chunk as hyper holds it: counted until hyper drops it.
struct Chunk {
    bytes: Bytes,
    _hold: BudgetHold,
    unwritten: Arc<Unwritten>,
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let_go(&*self.unwritten, self.bytes.len());
        self.unwritten.waker.wake();
    }
}

/// Watches a stream's chunks until hyper has written every one it took
/// (a handover moves an event stream only then: [`super::sse`]).
///
/// hyper drops a chunk once its last byte, and with it the chunk's framing
/// (size line, trailing CRLF), is written to the socket: it queues each
/// encoded chunk whole when the socket takes vectored writes, which the
/// accept loop asks for (`writev(true)`). So when no chunk is held, every
/// byte of the response so far is on the socket, its head included (the
/// head is written before the first chunk, and the first chunk is taken
/// before anything can wait here).
#[derive(Debug, Clone)]
pub struct Drained(Arc<Unwritten>);

/// The stream's unwritten chunks, and what its connection's spool keeps,
/// are its client's, held outside its queue: once the client is closed the
/// budget's shedder knows they are leaving.
impl crate::hub::HeldOutside for Drained {
    fn held(&self) -> usize {
        self.0.load() + self.0.spooled.load(Ordering::Acquire)
    }
}

impl Drained {
    /// Resolves once hyper holds none of the stream's chunks.
    pub async fn all_written(&self) {
        std::future::poll_fn(|cx| poll_all_written(&*self.0, cx)).await
    }

    /// For a handover: the body is polled from now on however much is
    /// unwritten, so that it can stop (it is woken to).
    pub fn open_gate(&self) {
        self.0.stopping.store(true, Ordering::Release);
        self.0.waker.wake();
    }
}

/// What hyper wrote of an event stream's response that the socket has not
/// taken yet (see the module docs). Off until the stream's response begins
/// ([`Spool::start`]): then every write hyper makes is taken whole, and
/// written on by hyper's flushes.
#[derive(Debug, Default)]
pub struct Spool(std::sync::Mutex<SpoolState>);

#[derive(Debug, Default)]
struct SpoolState {
    /// On: the stream's count and the budget the bytes are counted in.
    counted: Option<(Arc<Unwritten>, Arc<QueueBudget>)>,
    bytes: bytes::BytesMut,
    /// Taken for the next instance: nothing more is written here.
    taken: bool,
}

impl SpoolState {
    fn keep(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.bytes.extend_from_slice(bytes);
        if let Some((count, budget)) = &self.counted {
            use crate::hub::client::BudgetCount;
            count.spooled.fetch_add(bytes.len(), Ordering::AcqRel);
            budget.count_add(bytes.len());
        }
    }

    fn written(&mut self, n: usize) {
        crate::bounds::written(&mut self.bytes, n);
        if let Some((count, budget)) = &self.counted {
            use crate::hub::client::BudgetCount;
            count.spooled.fetch_sub(n, Ordering::AcqRel);
            budget.count_sub(n);
            count.waker.wake();
        }
    }

    fn poll_drain<W: tokio::io::AsyncWrite + Unpin>(
        &mut self,
        io: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        while !self.bytes.is_empty() {
            let n = ready!(Pin::new(&mut *io).poll_write(cx, &self.bytes))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.written(n);
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for SpoolState {
    fn drop(&mut self) {
        let n = self.bytes.len();
        self.written(n);
    }
}

impl Spool {
    fn lock(&self) -> std::sync::MutexGuard<'_, SpoolState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// From now on, hyper's writes on this connection are taken whole,
    /// counted with `drained`'s stream and in `budget`.
    pub fn start(&self, drained: &Drained, budget: &Arc<QueueBudget>) {
        self.lock().counted = Some((Arc::clone(&drained.0), Arc::clone(budget)));
    }

    /// For a handover, once hyper holds no chunk ([`Drained::all_written`]):
    /// the bytes the socket has not taken, for the next instance to write
    /// first. Nothing more is written on this connection here.
    pub fn take(&self) -> Vec<u8> {
        let mut st = self.lock();
        st.taken = true;
        let out = st.bytes.to_vec();
        let n = out.len();
        st.written(n);
        st.bytes = bytes::BytesMut::new();
        out
    }

    /// Whether the spool was taken for the next instance.
    pub fn is_taken(&self) -> bool {
        self.lock().taken
    }

    /// hyper's write, when spooling (`None`: not spooling, write it
    /// directly): what the socket takes now goes, the rest is kept; all of
    /// it is taken.
    pub fn poll_write_vectored<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        io: &mut W,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Option<Poll<std::io::Result<usize>>> {
        let mut st = self.lock();
        st.counted.as_ref()?;
        let total = bufs.iter().map(|b| b.len()).sum();
        if st.taken {
            return Some(Poll::Ready(Ok(total)));
        }
        if let Poll::Ready(Err(e)) = st.poll_drain(io, cx) {
            return Some(Poll::Ready(Err(e)));
        }
        let mut skip = 0;
        if st.bytes.is_empty() {
            match Pin::new(&mut *io).poll_write_vectored(cx, bufs) {
                Poll::Ready(Ok(n)) => skip = n,
                Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
                Poll::Pending => {}
            }
        }
        for buf in bufs {
            let b: &[u8] = buf;
            let from = skip.min(b.len());
            skip -= from;
            st.keep(&b[from..]);
        }
        Some(Poll::Ready(Ok(total)))
    }

    /// hyper's flush, when spooling: the kept bytes first.
    pub fn poll_flush<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        io: &mut W,
        cx: &mut Context<'_>,
    ) -> Option<Poll<std::io::Result<()>>> {
        let mut st = self.lock();
        st.counted.as_ref()?;
        if st.taken {
            return Some(Poll::Ready(Ok(())));
        }
        match st.poll_drain(io, cx) {
            Poll::Pending => Some(Poll::Pending),
            Poll::Ready(Err(e)) => Some(Poll::Ready(Err(e))),
            Poll::Ready(Ok(())) => Some(Pin::new(&mut *io).poll_flush(cx)),
        }
    }
}

/// An event stream's chunks, counted and bounded (see the module docs).
pub struct Counted<S> {
    inner: Pin<Box<S>>,
    budget: Arc<QueueBudget>,
    unwritten: Arc<Unwritten>,
}

impl<S: Stream<Item = Bytes>> Counted<S> {
    pub fn new(inner: S, budget: Arc<QueueBudget>) -> Self {
        Counted {
            inner: Box::pin(inner),
            budget,
            unwritten: Arc::default(),
        }
    }

    /// A watch on this stream's chunks ([`Drained`]).
    pub fn drained(&self) -> Drained {
        Drained(Arc::clone(&self.unwritten))
    }

    /// Bytes of this stream's chunks that are not written yet.
    #[cfg(test)]
    fn unwritten(&self) -> usize {
        self.unwritten.bytes.load(Ordering::Acquire)
    }
}

impl<S: Stream<Item = Bytes>> Stream for Counted<S> {
    type Item = Bytes;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let this = &mut *self;
        if this.unwritten.gated() {
            // Registered before looking again, so a drop in between wakes us.
            this.unwritten.waker.register(cx.waker());
            if this.unwritten.gated() {
                return Poll::Pending;
            }
        }
        let Some(bytes) = ready!(this.inner.as_mut().poll_next(cx)) else {
            return Poll::Ready(None);
        };
        this.unwritten.add(bytes.len());
        let chunk = Chunk {
            _hold: this.budget.hold(bytes.len()),
            bytes,
            unwritten: Arc::clone(&this.unwritten),
        };
        Poll::Ready(Some(Bytes::from_owner(chunk)))
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    /// Chunks count in the budget until dropped (written), and no chunk is
    /// taken from the stream while those not yet written reach the bound.
    #[tokio::test]
    async fn unwritten_chunks_count_and_bound_the_stream() {
        let budget = Arc::new(QueueBudget::new());
        let chunk = Bytes::from(vec![b'x'; 40 * 1024]);
        let source = futures_util::stream::iter(vec![chunk; 10]);
        let mut body = Counted::new(source, Arc::clone(&budget));
        let first = body.next().await.unwrap();
        let second = body.next().await.unwrap();
        assert_eq!(budget.used(), 80 * 1024, "held by hyper: counted");
        assert_eq!(body.unwritten(), 80 * 1024);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(
            body.poll_next_unpin(&mut cx).is_pending(),
            "{} bytes unwritten: no more taken",
            body.unwritten()
        );
        drop(first);
        assert_eq!(budget.used(), 40 * 1024, "written: uncounted");
        assert!(body.poll_next_unpin(&mut cx).is_ready());
        drop(second);
        let mut rest = 0;
        while let Some(chunk) = body.next().await {
            assert_eq!(budget.used(), chunk.len());
            rest += 1;
        }
        assert_eq!(rest, 7);
        assert_eq!(budget.used(), 0);
    }

    /// A socket that takes at most `room` bytes in all.
    struct Tight {
        room: usize,
        wrote: Vec<u8>,
    }

    impl tokio::io::AsyncWrite for Tight {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let n = buf.len().min(self.room);
            if n == 0 {
                return Poll::Pending;
            }
            self.room -= n;
            self.wrote.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Spooling, every write is taken whole however little the socket
    /// takes: what it did not take is kept in order, counted against the
    /// stream's bound and in the budget, written first by the next flush,
    /// and at a handover taken whole (nothing more is written after).
    #[test]
    fn a_spool_takes_every_write_whole_and_gives_the_rest_at_a_handover() {
        let budget = Arc::new(QueueBudget::new());
        let body = Counted::new(futures_util::stream::empty::<Bytes>(), Arc::clone(&budget));
        let drained = body.drained();
        let spool = Spool::default();
        let mut socket = Tight {
            room: 10,
            wrote: Vec::new(),
        };
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let one = std::io::IoSlice::new(b"HTTP/1.1 200 OK\r\n\r\n");
        assert!(
            spool
                .poll_write_vectored(&mut socket, &mut cx, &[one])
                .is_none(),
            "off until the stream's response begins"
        );
        spool.start(&drained, &budget);
        let head = b"0123456789abcdef";
        let chunk = vec![b'x'; 70 * 1024];
        let wrote = spool.poll_write_vectored(
            &mut socket,
            &mut cx,
            &[std::io::IoSlice::new(head), std::io::IoSlice::new(&chunk)],
        );
        assert!(matches!(wrote, Some(Poll::Ready(Ok(n))) if n == head.len() + chunk.len()));
        assert_eq!(socket.wrote, b"0123456789");
        let kept = head.len() + chunk.len() - 10;
        assert_eq!(budget.used(), kept, "kept bytes are counted");
        assert!(
            drained.0.gated(),
            "the stream takes no more chunks meanwhile"
        );
        // The socket takes 100 more bytes at the next flush.
        socket.room = 100;
        assert!(matches!(
            spool.poll_flush(&mut socket, &mut cx),
            Some(Poll::Pending)
        ));
        assert_eq!(socket.wrote.len(), 110);
        let rest = spool.take();
        assert_eq!(rest.len(), kept - 100);
        let mut all = socket.wrote.clone();
        all.extend_from_slice(&rest);
        let mut expected = head.to_vec();
        expected.extend_from_slice(&chunk);
        assert_eq!(
            all, expected,
            "written then carried: the response, in order"
        );
        assert_eq!(budget.used(), 0, "taken: uncounted");
        assert!(!drained.0.gated());
        socket.room = 1000;
        let after =
            spool.poll_write_vectored(&mut socket, &mut cx, &[std::io::IoSlice::new(b"late")]);
        assert!(matches!(after, Some(Poll::Ready(Ok(4)))));
        assert_eq!(socket.wrote.len(), 110, "nothing is written once taken");
    }
}
