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

pub use accept::accept_loop;
