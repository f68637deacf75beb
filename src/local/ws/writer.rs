//! The writing half of a local client's connection: drains the client's
//! queue into its socket, polled by the client's own task beside its reads.

use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures_util::stream::SplitSink;
use futures_util::SinkExt;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;

use super::{truncate_reason, CLOSE_LINGER, WRITER_TURN_BATCHES};
use crate::hub::{Client, Outgoing};
use crate::local::preconnect::Limited;

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

/// Drains the client's queue into its socket, several frames per flush,
/// polled by the client's task beside its reads (no task of its own), at
/// most [`WRITER_TURN_BATCHES`] batches per turn.
pub(super) struct Writer<S = Limited<TokioIo<Upgraded>>> {
    pub(super) sink: SplitSink<WebSocketStream<S>, Message>,
    /// The batch being written: what the socket has not been given yet.
    batch: std::vec::IntoIter<Outgoing>,
    /// Taken from the batch, not yet accepted by the socket.
    next: Option<Message>,
    /// Given to the socket since the last flush.
    unflushed: bool,
    close: Option<CloseStep>,
    pub(super) ended: Option<WriterEnd>,
    /// Batches taken in the current turn.
    taken_this_turn: u32,
    /// Take no more batches (a handover leaves them queued).
    pub(super) hold: bool,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Writer<S> {
    pub(super) fn new(sink: SplitSink<WebSocketStream<S>, Message>) -> Self {
        Writer {
            sink,
            batch: Vec::new().into_iter(),
            next: None,
            unflushed: false,
            close: None,
            ended: None,
            taken_this_turn: 0,
            hold: false,
        }
    }

    /// For a handover: writes and flushes the batch already taken, and
    /// takes no other. `Ready(true)` once done; `Ready(false)` if the
    /// writer ended instead (a close, a failed socket).
    pub(super) fn poll_batch_written(
        &mut self,
        cx: &mut Context<'_>,
        client: &Client,
    ) -> Poll<bool> {
        if self.ended.is_some() {
            return Poll::Ready(false);
        }
        self.hold = true;
        match ready!(self.poll_write(cx, client)) {
            WriterEnd::Held => Poll::Ready(true),
            end => {
                self.ended = Some(end);
                Poll::Ready(false)
            }
        }
    }

    /// Writes until the queue is empty and flushed (`Pending`, woken by the
    /// next push or by the socket), or for one turn (`Pending`, woken at
    /// once), or until the writer ends (`Ready`, once).
    pub(super) fn poll_drive(&mut self, cx: &mut Context<'_>, client: &Client) -> Poll<WriterEnd> {
        if self.ended.is_some() {
            return Poll::Pending;
        }
        self.taken_this_turn = 0;
        let polled = self.poll_write(cx, client);
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
        self.next.is_some() || self.unflushed || self.batch.len() > 0 || self.close.is_some()
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, client: &Client) -> Poll<WriterEnd> {
        loop {
            if let Some(step) = self.close.take() {
                match step {
                    CloseStep::FlushFirst(frame) => {
                        if self.sink.poll_flush_unpin(cx).is_pending() {
                            self.close = Some(CloseStep::FlushFirst(frame));
                            return Poll::Pending;
                        }
                        self.close = Some(CloseStep::Send(frame));
                    }
                    CloseStep::Send(frame) => match self.sink.poll_ready_unpin(cx) {
                        Poll::Pending => {
                            self.close = Some(CloseStep::Send(frame));
                            return Poll::Pending;
                        }
                        Poll::Ready(Err(_)) => return Poll::Ready(WriterEnd::Closed),
                        Poll::Ready(Ok(())) => {
                            if self
                                .sink
                                .start_send_unpin(Message::Close(Some(frame)))
                                .is_err()
                            {
                                return Poll::Ready(WriterEnd::Closed);
                            }
                            self.close = Some(CloseStep::FlushLast);
                        }
                    },
                    CloseStep::FlushLast => {
                        if self.sink.poll_flush_unpin(cx).is_pending() {
                            self.close = Some(CloseStep::FlushLast);
                            return Poll::Pending;
                        }
                        return Poll::Ready(WriterEnd::Closed);
                    }
                }
                continue;
            }
            if let Some(msg) = self.next.take() {
                match self.sink.poll_ready_unpin(cx) {
                    Poll::Pending => {
                        self.next = Some(msg);
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(_)) => return Poll::Ready(WriterEnd::Failed),
                    Poll::Ready(Ok(())) => {
                        if self.sink.start_send_unpin(msg).is_err() {
                            return Poll::Ready(WriterEnd::Failed);
                        }
                        self.unflushed = true;
                    }
                }
                continue;
            }
            match self.batch.next() {
                Some(Outgoing::Event(head, seq)) => {
                    self.next = Some(text_message(head.with_seq(seq)))
                }
                Some(Outgoing::Frame(bytes)) => self.next = Some(text_message(bytes)),
                Some(Outgoing::Close(code, reason)) => {
                    self.close = Some(CloseStep::FlushFirst(CloseFrame {
                        code: CloseCode::from(code),
                        reason: Utf8Bytes::from(truncate_reason(&reason)),
                    }));
                }
                None if self.unflushed => match ready!(self.sink.poll_flush_unpin(cx)) {
                    Ok(()) => self.unflushed = false,
                    Err(_) => return Poll::Ready(WriterEnd::Failed),
                },
                None if self.hold => return Poll::Ready(WriterEnd::Held),
                // Turn over: let the caller poll the client's socket for
                // reads, and come back at once.
                None if self.taken_this_turn >= WRITER_TURN_BATCHES => {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                // Written and flushed: the next batch (taking it is the
                // client's progress).
                None => {
                    self.batch = ready!(client.poll_next_batch(cx)).into_iter();
                    self.taken_this_turn += 1;
                }
            }
        }
    }

    /// After a write was abandoned (slow consumer): the close frame queued
    /// behind what the socket already holds, briefly.
    pub(super) async fn send_slow_consumer_close(&mut self) {
        let (code, reason) = crate::hub::client::SLOW_CONSUMER_CLOSE;
        let frame = CloseFrame {
            code: CloseCode::from(code),
            reason: Utf8Bytes::from_static(reason),
        };
        let _ =
            tokio::time::timeout(CLOSE_LINGER, self.sink.send(Message::Close(Some(frame)))).await;
    }
}

pub(super) fn text_message(bytes: Bytes) -> Message {
    // Frames are built only from valid UTF-8 (JSON) pieces.
    Message::Text(Utf8Bytes::try_from(bytes).unwrap_or_else(|_| Utf8Bytes::from_static("{}")))
}
