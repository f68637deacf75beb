//! The shared context every task of a running broker is handed: the
//! settings, the core's parts, the local side's caps, and shutdown's
//! signals. Built by [`crate::broker`]; the local routes, `/metrics` and
//! systemd's notifier take it (they never reach into the assembly).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Settings;
use crate::dedicated_registry::Dedicated;
use crate::dispatch::Dispatcher;
use crate::hub::Hub;
use crate::router::Router;
use crate::sessions::Sessions;
use crate::sharing::Sharing;
pub use crate::slots::SocketSlots;
use crate::upstream::Upstream;

/// Local WebSocket clients that may be in their handshake (before `hello-ok`)
/// at once; one more is closed `1013 try again later` at once. A handshake
/// holds a task and up to `preconnect_max_bytes` for up to `connect_timeout`
/// (plus `connect_wait`), so this bounds what unauthenticated-protocol
/// clients (all of the broker's own uid) can hold.
pub const MAX_HANDSHAKES: usize = 128;

/// What every task of a running broker shares.
#[derive(Debug)]
pub struct Ctx {
    pub settings: Settings,
    pub hub: Arc<Hub>,
    pub router: Arc<Router>,
    pub sharing: Arc<Sharing>,
    /// The upstream sessions and their owners.
    pub sessions: Arc<Sessions>,
    /// The one path every request takes upstream.
    pub dispatcher: Arc<Dispatcher>,
    /// Local WebSocket clients still before their `connect` is answered,
    /// [`MAX_HANDSHAKES`] shared out between the sockets
    /// ([`crate::slots`]); a client over its socket's share is
    /// closed `1013` at once.
    pub handshakes: SocketSlots,
    /// The open `/ws/dedicated` connections and their cap.
    pub dedicated: Arc<Dedicated>,
    /// Other uids (besides the broker's own) allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// Cancelled at shutdown: every task reaches a safe point and ends.
    pub cancel: CancellationToken,
    /// A handover of the clients, before the shutdown.
    pub handover: crate::parcels::Handover,
    /// Every connection and session task, so shutdown can wait for them.
    pub tracker: TaskTracker,
    /// The cap on open connections (`max_connections`, within the
    /// open-file limit), shared out between the sockets
    /// ([`crate::slots`]): held by every connection the accept loop
    /// takes, and by every moved one.
    pub slots: SocketSlots,
}

/// Runs `task` holding `slot` (a connection slot, or none) until it ends.
pub async fn holding<S, F: std::future::Future>(slot: S, task: F) -> F::Output {
    let _slot = slot;
    task.await
}

impl Ctx {
    /// Spawns a task on a moved socket: tracked, and first polled once the
    /// gate is open (so it reads and writes nothing before). A stop before
    /// then drops it unpolled, closing this instance's copy of the socket.
    pub fn spawn_moved<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let gate = self.handover.gate.clone();
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {}
                _ = gate.passed() => task.await,
            }
        });
    }

    /// The main session's transport (its phase, its `hello-ok`, reloads).
    pub fn upstream(&self) -> &Upstream {
        &self.sessions.main.upstream
    }
}
