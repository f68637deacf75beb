//! The local side: the unix listener, peer-credential check, HTTP routes,
//! WebSocket sessions, and the HTTP API (`/v1/state`, `/v1/events`, `/v1/rpc`).

mod accept;
pub mod dedicated;
pub mod fdlimit;
pub mod http;
pub mod hud;
pub mod metrics;
pub mod preconnect;
pub mod respond;
pub mod rpc;
pub mod socket;
pub mod sse;
pub mod state;
pub mod stream_body;
pub mod tap_stream;
pub mod ws;
pub mod ws_errors;

/// Cancelling it drops one HTTP connection at once: for a response stream
/// stuck behind a reader that does not read (hyper will not poll its body
/// again until the socket drains). Handlers find it in the request extensions.
#[derive(Debug, Clone)]
pub struct ConnectionKill(pub tokio_util::sync::CancellationToken);

/// The process id of the peer of a local connection, from `SO_PEERCRED`
/// (the kernel, not the peer), for `/v1/state`; and its uid (the second
/// field), which keys its share of the upstream-open rates. Handlers find it
/// in the request extensions.
#[derive(Debug, Clone, Copy)]
pub struct PeerPid(pub Option<u32>, pub Option<u32>);

/// The connection's socket descriptor, in the request extensions: a
/// handover passes a copy of it to the next instance. Valid while the
/// connection's stream lives (the connection owns it).
#[derive(Debug, Clone, Copy)]
pub struct ConnFd(pub std::os::fd::RawFd);

/// The connection's socket, in the request extensions, for a route that
/// answers with a body hyper writes and that may move at a handover (an
/// event stream): a copy of it can be taken for as long as the connection
/// owns it. The connection's task forgets the descriptor, under the same
/// lock, before it closes it, so a copy is never taken of a descriptor
/// that was closed (and perhaps reused).
#[derive(Debug, Clone)]
pub struct ConnSocket(
    std::sync::Arc<std::sync::Mutex<Option<std::os::fd::RawFd>>>,
    std::sync::Arc<stream_body::Spool>,
);

impl ConnSocket {
    pub fn new(fd: std::os::fd::RawFd) -> ConnSocket {
        ConnSocket(
            std::sync::Arc::new(std::sync::Mutex::new(Some(fd))),
            std::sync::Arc::default(),
        )
    }

    /// What hyper wrote on the connection and the socket has not taken
    /// (spooled once an event stream's response begins).
    pub fn spool(&self) -> &std::sync::Arc<stream_body::Spool> {
        &self.1
    }

    /// A copy of the socket (close-on-exec), if the connection still owns it.
    pub fn dup(&self) -> Option<std::os::fd::OwnedFd> {
        let fd = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let raw = (*fd)?;
        // SAFETY: `raw` is open while the lock is held: the connection's
        // task clears it under this lock before it closes the socket
        // ([`ConnSocket::closing`]), and the lock is held until the copy is
        // made, so the borrow cannot outlive or alias a closed descriptor.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
        rustix::io::fcntl_dupfd_cloexec(borrowed, 3).ok()
    }

    /// Forgets the descriptor when dropped: made right after the connection
    /// (so it is dropped before it, which closes the socket).
    pub fn closing(&self) -> impl Drop + '_ {
        struct Closing<'a>(&'a ConnSocket);
        impl Drop for Closing<'_> {
            fn drop(&mut self) {
                *self.0 .0.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }
        }
        Closing(self)
    }
}

/// The socket of a request whose streamed answer can move at a handover:
/// an HTTP/1.1 one, whose body is chunked (the next instance writes the
/// rest of it in chunks). An HTTP/1.0 reader's body ends with the
/// connection, unframed: it does not move (it is closed, and resumes by
/// cursor).
pub(crate) fn movable_socket<B>(req: &::http::Request<B>) -> Option<ConnSocket> {
    (req.version() == ::http::Version::HTTP_11)
        .then(|| req.extensions().get::<ConnSocket>().cloned())
        .flatten()
}

pub use accept::accept_loop;
