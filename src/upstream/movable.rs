//! The gateway socket as the connector reads it: through a
//! [`Follower`], so that at a handover its reader stops at a message
//! boundary and the socket moves to the broker's next instance with the
//! bytes read past that boundary (design §11). The gateway keeps one
//! connection, its `seq` and everything it holds per connection
//! (subscriptions, runs).
//!
//! Only a plaintext socket moves (`ws://` over TCP, or the configured unix
//! socket): a TLS session's keys and record counters live in this process,
//! so a `wss://` session ends and the next instance connects again.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::boundary::{Follower, Pause, WriteSpool};

/// What kind of socket a moved gateway connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SocketKind {
    Tcp,
    Unix,
}

/// A gateway socket stopped at a message boundary for the next instance.
#[derive(Debug)]
pub struct MovedSocket {
    /// A copy of its descriptor (close-on-exec).
    pub fd: OwnedFd,
    pub kind: SocketKind,
    /// Bytes read from it and not handed to the parser: the start of the
    /// gateway's next message, if any.
    pub unread: Vec<u8>,
    /// Bytes written to it and not taken (from inside a frame): the next
    /// instance writes them before anything of its own.
    pub unwritten: Vec<u8>,
}

/// A gateway message can move half read (its bytes so far go to the next
/// instance) up to this size; at a handover inside a larger one, the
/// reader waits for its end (bounded). Events are far smaller; this bounds
/// the copy kept of a message that spans reads.
pub const CARRY_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// A plaintext gateway socket whose reads follow the gateway's frames.
#[derive(Debug)]
pub struct Movable<T> {
    inner: T,
    kind: SocketKind,
    follow: Follower,
    /// What was written and not taken yet: left by the previous instance,
    /// held since the connection began to move, or a large request's frame
    /// written beside the parser ([`RawWrites`]).
    spool: Arc<Mutex<WriteSpool>>,
}

/// Whole frames written on a gateway socket beside its WebSocket writer,
/// before anything the writer writes next: a large request, framed and
/// masked by the outlet into a buffer of its own that goes once written.
/// Through tungstenite, every frame is first copied into its write buffer,
/// which keeps the size of the largest one for the life of the
/// connection. The caller pushes only when the writer holds nothing
/// unwritten (after a flush), so no frame is cut by another.
#[derive(Debug, Clone)]
pub struct RawWrites(Arc<Mutex<WriteSpool>>);

impl RawWrites {
    /// Queues `frame` (whole frames) to be written next; a flush of the
    /// socket writes it.
    pub fn push(&self, frame: Vec<u8>) {
        lock(&self.0).push(frame);
    }

    /// Bytes the socket has taken so far, through tungstenite or beside
    /// it: a write that waits while this grows is making progress.
    pub fn taken(&self) -> u64 {
        lock(&self.0).taken()
    }
}

fn lock(spool: &Mutex<WriteSpool>) -> std::sync::MutexGuard<'_, WriteSpool> {
    // Nothing is left half done under this lock: a poisoned one is usable.
    spool.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> Movable<T> {
    /// A socket just opened: the HTTP response to the upgrade comes first.
    /// A large frame's header reaches the parser alone, as on the local
    /// side, so its read buffer holds exactly the payload and is given back
    /// once the event is handled.
    pub fn new(inner: T, kind: SocketKind) -> Self {
        Movable {
            inner,
            kind,
            follow: Follower::after_http_response(true).carrying(CARRY_MESSAGE_BYTES),
            spool: Arc::default(),
        }
    }

    /// A socket moved from the previous instance, reading `unread` first
    /// (bytes it read and did not parse: they start at a message boundary)
    /// and writing `unwritten` first (bytes it wrote and the socket did not
    /// take: they end a frame). They are written as soon as the socket
    /// takes them, by whichever of its reads and writes comes first.
    pub fn moved(inner: T, kind: SocketKind, unread: Vec<u8>, unwritten: Vec<u8>) -> Self {
        Movable {
            inner,
            kind,
            follow: Follower::new(unread, true).carrying(CARRY_MESSAGE_BYTES),
            spool: Arc::new(Mutex::new(WriteSpool::with(unwritten))),
        }
    }
}

impl<T: AsFd> Movable<T> {
    /// Once stopped (and every whole message before it parsed), at a
    /// boundary or inside a message: a copy of the descriptor and the bytes
    /// the next instance's parser is given first.
    fn take(&mut self) -> io::Result<MovedSocket> {
        let fd = rustix::io::fcntl_dupfd_cloexec(self.inner.as_fd(), 3)?;
        let Some(unread) = self.follow.take_carried() else {
            return Err(io::Error::other(
                "stopped inside a message larger than the copy kept of it",
            ));
        };
        Ok(MovedSocket {
            fd,
            kind: self.kind,
            unread,
            unwritten: lock(&self.spool).take(),
        })
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Movable<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Movable {
            inner,
            follow,
            spool,
            ..
        } = &mut *self;
        if !follow.spooling() {
            let mut spool = lock(spool);
            if !spool.is_empty() {
                // Bytes the previous instance left unwritten are written as
                // soon as the socket takes them, even when nothing else is
                // written for a while (the peer waits for the rest of a
                // frame); a failure shows at the next write.
                let _ = spool.poll_drain(inner, cx);
            }
        }
        follow.poll_read(cx, buf, |cx, buf| Pin::new(inner).poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Movable<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let Movable {
            inner,
            follow,
            spool,
            ..
        } = &mut *self;
        lock(spool).poll_write(inner, cx, buf, follow.spooling())
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Movable {
            inner,
            follow,
            spool,
            ..
        } = &mut *self;
        lock(spool).poll_flush(inner, cx, follow.spooling())
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The byte stream under the upstream WebSocket: TCP, TLS, or a unix
/// socket (the demo's built-in double, `[upstream] unix_socket`).
pub trait UpstreamIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The pause of a socket that can move to the next instance (`None`:
    /// it cannot, e.g. TLS).
    fn pause(&self) -> Option<Pause> {
        None
    }

    /// Once stopped: what moves (`None`: it cannot move).
    fn take_for_handover(&mut self) -> Option<io::Result<MovedSocket>> {
        None
    }

    /// Whether, stopped now, it could move with what it read
    /// ([`crate::boundary::Follower::carries`]).
    fn carries(&self) -> bool {
        false
    }

    /// Where frames can be written beside the WebSocket writer (`None`:
    /// only through it).
    fn raw_writes(&self) -> Option<RawWrites> {
        None
    }
}

impl<T: AsyncRead + AsyncWrite + AsFd + Send + Unpin + 'static> UpstreamIo for Movable<T> {
    fn pause(&self) -> Option<Pause> {
        Some(self.follow.pause())
    }

    fn take_for_handover(&mut self) -> Option<io::Result<MovedSocket>> {
        Some(self.take())
    }

    fn carries(&self) -> bool {
        self.follow.carries()
    }

    fn raw_writes(&self) -> Option<RawWrites> {
        Some(RawWrites(Arc::clone(&self.spool)))
    }
}

/// A gateway stream that does not move (TLS) but whose buffers come back
/// as a plain socket's do. It takes a large request's frame beside its
/// WebSocket writer ([`RawWrites`]), so that tungstenite's write buffer
/// never takes a large request's size over `wss://` either: the frame is
/// written through the stream (encrypted as it goes, in records of the TLS
/// layer's own size) and freed once written. Its reads follow the frames
/// as [`Movable`]'s do, with a large frame's header handed to the parser
/// alone, so the parser's read buffer holds exactly the payload and is
/// given back once the event is handled (never paused: it does not move).
#[derive(Debug)]
pub struct Spooled<T> {
    inner: T,
    follow: Follower,
    spool: Arc<Mutex<WriteSpool>>,
}

impl<T> Spooled<T> {
    /// A stream just opened: the HTTP response to the upgrade comes first.
    pub fn new(inner: T) -> Self {
        Spooled {
            inner,
            follow: Follower::after_http_response(true),
            spool: Arc::default(),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Spooled<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Spooled { inner, follow, .. } = &mut *self;
        follow.poll_read(cx, buf, |cx, buf| Pin::new(inner).poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Spooled<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let Spooled { inner, spool, .. } = &mut *self;
        lock(spool).poll_write(inner, cx, buf, false)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Spooled { inner, spool, .. } = &mut *self;
        lock(spool).poll_flush(inner, cx, false)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl UpstreamIo for Spooled<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    fn raw_writes(&self) -> Option<RawWrites> {
        Some(RawWrites(Arc::clone(&self.spool)))
    }
}

/// A bare unix socket wrapped the same way (the outlet's unit tests).
#[cfg(test)]
impl UpstreamIo for Spooled<tokio::net::UnixStream> {
    fn raw_writes(&self) -> Option<RawWrites> {
        Some(RawWrites(Arc::clone(&self.spool)))
    }
}

/// A bare unix socket (the transport's unit tests): it never moves.
impl UpstreamIo for tokio::net::UnixStream {}

impl MovedSocket {
    /// The socket again, in this instance's runtime, reading `unread` first.
    pub fn into_io(self) -> io::Result<Box<dyn UpstreamIo>> {
        Ok(match self.kind {
            SocketKind::Tcp => {
                let s = std::net::TcpStream::from(self.fd);
                s.set_nonblocking(true)?;
                Box::new(Movable::moved(
                    tokio::net::TcpStream::from_std(s)?,
                    SocketKind::Tcp,
                    self.unread,
                    self.unwritten,
                ))
            }
            SocketKind::Unix => {
                let s = std::os::unix::net::UnixStream::from(self.fd);
                s.set_nonblocking(true)?;
                Box::new(Movable::moved(
                    tokio::net::UnixStream::from_std(s)?,
                    SocketKind::Unix,
                    self.unread,
                    self.unwritten,
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::WebSocketStream;

    /// Paused between two of the gateway's messages, the reader stops
    /// there: the parser has handed over every message before it, and the
    /// bytes after it (the next message) are what moves.
    #[tokio::test]
    async fn a_paused_gateway_socket_stops_between_messages() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let io: Box<dyn UpstreamIo> = Box::new(Movable::moved(
            ours,
            SocketKind::Unix,
            Vec::new(),
            Vec::new(),
        ));
        let pause = io.pause().unwrap();
        let mut ws = WebSocketStream::from_raw_socket(io, Role::Client, None).await;
        let mut gateway = WebSocketStream::from_raw_socket(theirs, Role::Server, None).await;
        for n in [3, 300, 70_000] {
            let text = "x".repeat(n);
            gateway.send(Message::text(text.clone())).await.unwrap();
            assert_eq!(ws.next().await.unwrap().unwrap(), Message::text(text));
            assert!(pause.at_boundary(), "after a message of {n} bytes");
        }
        pause.request();
        gateway.send(Message::text("two")).await.unwrap();
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(ws.poll_next_unpin(&mut cx).is_pending());
        assert!(pause.at_boundary());
        let moved = ws.get_mut().take_for_handover().unwrap().unwrap();
        assert!(moved.unread.is_empty() || moved.unread.ends_with(b"two"));
    }
}
