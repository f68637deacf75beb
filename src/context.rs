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

/// A handover of the connected clients to the next instance
/// ([`crate::handover`]): requested before the broker stops; each client
/// that can move leaves a [`Parcel`] instead of closing.
#[derive(Debug, Default)]
pub struct Handoff {
    /// Cancelled when the clients are to be handed over.
    pub requested: CancellationToken,
    /// What the client tasks left for the next instance.
    pub parcels: std::sync::Mutex<Vec<Parcel>>,
    /// The `/ws/dedicated` connections left for the next instance.
    pub dedicated: std::sync::Mutex<Vec<DedicatedParcel>>,
    /// The event streams (`/v1/events`) left for the next instance.
    pub streams: std::sync::Mutex<Vec<Box<dyn StreamParcel>>>,
    /// Client tasks serving requests now (each leaves at a handover).
    serving: std::sync::atomic::AtomicUsize,
    left: tokio::sync::Notify,
}

/// Counts a client task as serving until dropped.
#[derive(Debug)]
pub struct Serving<'a>(&'a Handoff);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        self.0
            .serving
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.0.left.notify_waiters();
    }
}

/// One local WebSocket client, stopped at a message boundary for the next
/// instance: its registration (the client, its queue and what it holds),
/// its socket and the bytes read from it that its parser was not given.
#[derive(Debug)]
pub struct Parcel {
    pub registration: crate::dispatch::Registration,
    pub fd: std::os::fd::OwnedFd,
    /// Read from the socket and not parsed: the message in progress from
    /// its first byte, then what followed.
    pub unread: Vec<u8>,
    /// Framed for the socket and not written: from inside a frame, written
    /// first by the next instance.
    pub unwritten: Vec<u8>,
    /// It asked to be closed as a direct gateway connection would be
    /// (`restarts=mirror`): it keeps asking in the next instance.
    pub mirror: bool,
}

/// One `/ws/dedicated` connection, stopped where it was for the next
/// instance: the client's socket and the gateway's, each with the bytes
/// read from it that its parser was not given (a message half read, from
/// its first byte) and the bytes written to it that it did not take.
#[derive(Debug)]
pub struct DedicatedParcel {
    pub client: std::os::fd::OwnedFd,
    pub client_unread: Vec<u8>,
    pub client_unwritten: Vec<u8>,
    pub gateway: crate::upstream::MovedSocket,
    pub peer_uid: Option<u32>,
    pub browser: bool,
}

/// An event stream (`/v1/events`), stopped for the next instance with
/// every byte of its response so far written: what it has not written yet
/// is made into its [`StreamEntry`] once the sessions have ended (its
/// queue is whole then). A trait object, so the local layer that knows
/// the stream's format fills in the entry the handover (above it) sends.
pub trait StreamParcel: Send + std::fmt::Debug {
    /// Its part of the clients document, and its socket.
    fn pack(self: Box<Self>) -> (StreamEntry, std::os::fd::OwnedFd);
}

/// An event stream moved to the next instance: who it is for, what it
/// asked for, where it is, and the bytes of its body not written yet.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamEntry {
    pub id: u64,
    pub conn_id: String,
    pub connected_at_ms: u64,
    pub peer_pid: Option<u32>,
    /// Its grant's scopes.
    pub scopes: Vec<String>,
    /// The socket it connected to (`[[sockets]]` name; `default`: the main one).
    pub socket: String,
    /// Its `/v1/events` query, as it was opened with (filters, tap).
    pub query: String,
    /// The per-client `seq` its next event gets.
    pub next_seq: u64,
    /// The newest cursor it received (written or filtered out).
    pub last_cursor: u64,
    /// The per-client `seq` of the last live event it received.
    pub last_seq: u64,
    /// A gap comes before its next event.
    pub gap_pending: bool,
    /// Body bytes not written yet (SSE records, base64), in order.
    pub unsent: String,
    /// Response bytes written and not taken by the socket (base64), from
    /// inside a chunk: the next instance writes them first, as they are.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unwritten: String,
    /// The stream ended: `unsent` holds its last record.
    pub finished: bool,
    /// It was still writing its history: the next instance reads the rest
    /// (and what it had queued) from the log, after `last_cursor`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_log: bool,
    /// A `/v1/hud` stream's feed (then `last_cursor` is the newest cursor
    /// its feed applied, and the per-client fields are unused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hud: Option<HudEntry>,
}

/// A `/v1/hud` stream's feed, moving with it: its projection, and which
/// of what it applies it sends.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HudEntry {
    /// Records up to this cursor are applied but not sent.
    pub quiet_until: Option<u64>,
    /// Records up to this cursor are flagged `replay`.
    pub newest: Option<u64>,
    /// The activity projection ([`crate::activity::Activity`], as JSON).
    pub activity: serde_json::Value,
    /// A `/ws/hud` client (its `unsent` is one HUD event per line).
    #[serde(default)]
    pub websocket: bool,
    /// Bytes read from a `/ws/hud` client and not parsed (base64).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unread: String,
}

impl Handoff {
    /// A client task starts serving requests.
    pub fn serving(&self) -> Serving<'_> {
        self.serving
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Serving(self)
    }

    /// Waits until every client task has stopped serving (after
    /// [`Handoff::requested`]); false if some had not by `until`.
    pub async fn all_left(&self, until: tokio::time::Instant) -> bool {
        loop {
            let left = self.left.notified();
            tokio::pin!(left);
            left.as_mut().enable();
            if self.serving.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(until, left).await.is_err() {
                return false;
            }
        }
    }

    pub fn leave(&self, parcel: Parcel) {
        self.parcels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(parcel);
    }

    /// The ids of the clients left for the next instance so far.
    pub fn client_ids(&self) -> std::collections::HashSet<u64> {
        self.parcels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|p| p.registration.client().id)
            .collect()
    }

    pub fn leave_dedicated(&self, parcel: DedicatedParcel) {
        self.dedicated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(parcel);
    }

    pub fn take_dedicated(&self) -> Vec<DedicatedParcel> {
        std::mem::take(&mut *self.dedicated.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn leave_stream(&self, parcel: Box<dyn StreamParcel>) {
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(parcel);
    }

    pub fn take_streams(&self) -> Vec<Box<dyn StreamParcel>> {
        std::mem::take(&mut *self.streams.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn take(&self) -> Vec<Parcel> {
        std::mem::take(&mut *self.parcels.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

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
    pub handoff: Handoff,
    /// Every connection and session task, so shutdown can wait for them.
    pub tracker: TaskTracker,
    /// The cap on open connections (`max_connections`, within the
    /// open-file limit), shared out between the sockets
    /// ([`crate::slots`]): held by every connection the accept loop
    /// takes, and by every moved one.
    pub slots: SocketSlots,
    /// Closed while a `SIGUSR2` upgrade's old instance may still serve the
    /// moved sockets again; every task on a moved socket (and the accept
    /// loops) waits at it. Open from the start otherwise.
    pub gate: crate::gate::Gate,
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
        let gate = self.gate.clone();
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
