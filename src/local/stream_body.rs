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

/// The stream's unwritten chunks are its client's, held outside its queue:
/// once the client is closed the budget's shedder knows they are leaving.
impl crate::hub::HeldOutside for Drained {
    fn held(&self) -> usize {
        self.0.load()
    }
}

impl Drained {
    /// Resolves once hyper holds none of the stream's chunks.
    pub async fn all_written(&self) {
        std::future::poll_fn(|cx| poll_all_written(&*self.0, cx)).await
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
        if this.unwritten.bytes.load(Ordering::Acquire) >= UNWRITTEN_BYTES {
            // Registered before looking again, so a drop in between wakes us.
            this.unwritten.waker.register(cx.waker());
            if this.unwritten.bytes.load(Ordering::Acquire) >= UNWRITTEN_BYTES {
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
}
