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

/// The error a read past the budget fails with; the session closes `1009`.
pub const OVER_BUDGET: &str = "more bytes before connect than preconnect_max_bytes";

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

/// An I/O object whose reads stop at the budget.
#[derive(Debug)]
pub struct Limited<T> {
    inner: T,
    budget: PreconnectBudget,
}

impl<T> Limited<T> {
    pub fn new(inner: T, budget: PreconnectBudget) -> Self {
        Limited { inner, budget }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let left = self.budget.0.load(Ordering::Relaxed);
        if left == 0 {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, OVER_BUDGET)));
        }
        if left == u64::MAX {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let room = buf
            .remaining()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        let mut limited = buf.take(room);
        let res = Pin::new(&mut self.inner).poll_read(cx, &mut limited);
        let n = limited.filled().len();
        if let Poll::Ready(Ok(())) = &res {
            // SAFETY: `limited` reads into `buf`'s unfilled part, so these
            // `n` bytes of `buf` were initialized and filled by the inner read.
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            // Lifted meanwhile? Then u64::MAX stays (fetch_update keeps it).
            let _ = self
                .budget
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                    (b != u64::MAX).then(|| b.saturating_sub(n as u64))
                });
        }
        res
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Limited<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let res = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &res {
            self.budget.1.fetch_add(*n as u64, Ordering::Relaxed);
        }
        res
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let res = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &res {
            self.budget.1.fetch_add(*n as u64, Ordering::Relaxed);
        }
        res
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
