//! The handover's vocabulary at the ground floor (design §11): what each
//! moving thing leaves for the next instance, and the entries of the
//! clients document it is packed into. The local routes and `Ctx` use
//! these; the protocol that packs them and takes them over is
//! [`crate::handover`], above the local routes. The words, in code, logs
//! and docs alike:
//!
//! - a **handover** moves the broker's sockets and clients to its next
//!   instance (`SIGUSR2`, `clawmux upgrade`, or systemd's store);
//! - once it is requested ([`Handover::requested`]), each moving thing
//!   **stops** where it is, next to its own serving code, without waiting
//!   for its peer, and **leaves** a [`Parcel`] ([`Handover::leave`]);
//! - the parcels are **packed** into the clients document and the
//!   descriptors it names ([`Parcel::pack`]; `handover::clients::pack`);
//! - the next instance **takes over** each entry and serves it from where
//!   it stopped (`handover::clients::take_over`, then each thing's own
//!   `take_over`), behind its [`Gate`].

use std::os::fd::OwnedFd;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

pub use crate::gate::Gate;
use crate::sharing::subscriptions::SubKey;

/// A handover of the connected clients to the next instance: requested
/// before the broker stops; each client, stream and connection that can
/// move leaves a [`Parcel`] instead of closing.
#[derive(Debug)]
pub struct Handover {
    /// Cancelled when the clients are to be handed over.
    pub requested: CancellationToken,
    /// Closed while a `SIGUSR2` upgrade's old instance may still serve the
    /// moved sockets again; every task on a moved socket (and the accept
    /// loops) waits at it. Open from the start otherwise.
    pub gate: Gate,
    /// What the client tasks left for the next instance; `None` once
    /// taken (packed: nothing left later can move).
    parcels: std::sync::Mutex<Option<Vec<Box<dyn Parcel>>>>,
    /// Client tasks serving requests now (each leaves at a handover).
    serving: std::sync::atomic::AtomicUsize,
    left: tokio::sync::Notify,
}

/// Counts a client task as serving until dropped.
#[derive(Debug)]
pub struct Serving<'a>(&'a Handover);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        // Only the last one to leave wakes [`Handover::all_left`]: at a
        // handover a thousand clients leave at once, and waking the waiter
        // for each would only have it count again.
        let before = self
            .0
            .serving
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if before == 1 {
            self.0.left.notify_waiters();
        }
    }
}

/// What one moving thing leaves for the next instance, implemented next
/// to its own serving code: a `/ws` client, a `/ws/dedicated` pair, an
/// event stream, a HUD stream, a gateway connection (the main session's
/// or a narrower one's). Packed once the sessions have ended (every
/// answer to a client's requests is in its queue by then, but those of
/// the requests that move with the gateway session).
pub trait Parcel: Send + std::fmt::Debug {
    /// The hub client that moves with it, if any (a `/ws` client's): the
    /// runs and requests in flight it owns move with it.
    fn client_id(&self) -> Option<u64> {
        None
    }

    /// Its entry in the clients document, and its sockets.
    fn pack(self: Box<Self>) -> Entry;
}

/// A parcel packed: its entry in the clients document and its sockets.
#[derive(Debug)]
pub enum Entry {
    /// A `/ws` client, and what this instance held for it (let go once the
    /// handover is over, not inside the pause: [`Leftover`]).
    Client(ClientEntry, OwnedFd, Leftover),
    /// The client's socket, then the gateway's.
    Dedicated(DedicatedEntry, OwnedFd, OwnedFd),
    Stream(StreamEntry, OwnedFd),
    /// The main gateway session's connection.
    Upstream(Box<UpstreamEntry>, OwnedFd),
    /// A narrower gateway session's connection.
    Narrower(Box<NarrowerEntry>, OwnedFd),
}

/// What this instance held for a moved thing and no longer needs (a `/ws`
/// client's registration with the hub and the dispatcher): kept until the
/// handover is over and dropped then, since letting a thousand of them go
/// takes the hub's and the router's locks a thousand times, and the
/// clients wait for nothing of it.
pub struct Leftover {
    _held: Box<dyn Send>,
}

impl Leftover {
    pub fn new(held: impl Send + 'static) -> Leftover {
        Leftover {
            _held: Box::new(held),
        }
    }
}

impl std::fmt::Debug for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Leftover")
    }
}

impl Handover {
    /// No handover requested yet; what moved in waits at `gate`.
    pub fn new(gate: Gate) -> Self {
        Handover {
            requested: CancellationToken::new(),
            gate,
            parcels: std::sync::Mutex::new(Some(Vec::new())),
            serving: Default::default(),
            left: Default::default(),
        }
    }

    /// A client task starts serving requests.
    pub fn serving(&self) -> Serving<'_> {
        self.serving
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Serving(self)
    }

    /// Waits until every client task has stopped serving (after
    /// [`Handover::requested`]); false if some had not by `until`.
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

    /// Leaves `parcel` for the next instance. One left after the parcels
    /// were taken cannot move: it is dropped, so its connection ends here
    /// (its client reconnects, and resumes by cursor).
    pub fn leave(&self, parcel: Box<dyn Parcel>) {
        let mut parcels = self.lock();
        let Some(parcels) = parcels.as_mut() else {
            // Dropped at the return, after the lock: its socket closes.
            tracing::warn!(
                "handover: a client stopped after the clients were packed; its connection ends"
            );
            return;
        };
        parcels.push(parcel);
    }

    /// The ids of the hub clients left for the next instance so far.
    pub fn client_ids(&self) -> std::collections::HashSet<u64> {
        self.lock()
            .iter()
            .flatten()
            .filter_map(|p| p.client_id())
            .collect()
    }

    /// Everything left, once: what is left after this cannot move.
    pub fn take(&self) -> Vec<Box<dyn Parcel>> {
        self.lock().take().unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<Box<dyn Parcel>>>> {
        self.parcels.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An event stream moved to the next instance: who it is for, what it
/// asked for, where it is, and the bytes of its body not written yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// A `/ws/dedicated` connection moved: the client's socket and its own
/// gateway connection's, each with the bytes read from it and not parsed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedicatedEntry {
    /// Bytes read from the client and not parsed (base64): a message half
    /// read from its first byte, then what followed.
    pub client_unread: String,
    /// Bytes written to the client and not taken (base64), from inside a
    /// frame: the next instance writes them first.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub client_unwritten: String,
    pub gateway_kind: crate::upstream::SocketKind,
    /// Bytes read from the gateway and not parsed (base64).
    pub gateway_unread: String,
    /// Bytes written to the gateway and not taken (base64).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gateway_unwritten: String,
    pub peer_uid: Option<u32>,
    pub browser: bool,
}

impl Subscription {
    pub fn of(key: &SubKey) -> Subscription {
        match key {
            SubKey::Sessions => Subscription::Sessions,
            SubKey::Messages(key) => Subscription::Messages { key: key.clone() },
        }
    }

    pub fn key(self) -> SubKey {
        match self {
            Subscription::Sessions => SubKey::Sessions,
            Subscription::Messages { key } => SubKey::Messages(key),
        }
    }
}

/// One moved client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientEntry {
    pub id: u64,
    pub conn_id: String,
    pub connected_at_ms: u64,
    pub identity: Identity,
    pub tool_events: bool,
    /// Its grant's scopes.
    pub scopes: Vec<String>,
    /// The socket it connected to (`[[sockets]]` name; `default`: the main one).
    pub socket: String,
    /// The `seq` its next event gets.
    pub next_seq: u64,
    pub subscriptions: Vec<Subscription>,
    /// Frames queued for it and not written yet, in order, as text (the
    /// documents of earlier versions; none now: see `queued_lengths`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queued: Vec<String>,
    /// The lengths of the frames queued for it and not written yet, in
    /// order. Their bytes travel beside the document, not in it: in the
    /// frames memfd, one client's after another in the document's order
    /// (`handover::clients::Clients::frames_memfd`), so neither instance
    /// escapes or parses them inside the pause.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queued_lengths: Vec<usize>,
    /// Those frames: packed here, or read back from the frames memfd.
    #[serde(skip)]
    pub frames: Vec<bytes::Bytes>,
    /// Bytes read from its socket and not parsed (base64): a message half
    /// read from its first byte, then what followed.
    pub unread: String,
    /// Bytes framed for its socket and not written (base64), from inside
    /// a frame: the next instance writes them before anything else.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unwritten: String,
    /// `restarts=mirror`: closed as a direct gateway connection would be.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mirror: bool,
}

/// What a client declared at connect (for `/v1/state`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub client_id: Option<String>,
    pub mode: Option<String>,
    pub version: Option<String>,
    pub display_name: Option<String>,
    pub peer_pid: Option<u32>,
}

/// A subscription a client holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Subscription {
    Sessions,
    Messages { key: String },
}

/// A narrower gateway session (one client grant's), moving with its
/// connection as the main session does ([`UpstreamEntry`]); it carries
/// only requests and answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NarrowerEntry {
    /// The grant it holds.
    pub scopes: Vec<String>,
    /// The gateway URL, redacted (taken over only if the settings name it).
    pub url: String,
    pub kind: crate::upstream::SocketKind,
    pub hello: crate::upstream::UpstreamHello,
    /// Bytes read from the socket and not parsed (base64).
    pub unread: String,
    /// Bytes written to the socket and not taken (base64), from inside a
    /// frame: the next instance writes them first.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unwritten: String,
    /// The next upstream request id's number (as [`UpstreamEntry`]'s: the
    /// ids its requests in flight hold are never given out again).
    pub next_request_id: u64,
    /// Requests written on the connection and not answered yet.
    pub pending: Vec<crate::router::MovedRequest>,
}

/// The main gateway session, moving with its connection (design §11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamEntry {
    /// The gateway URL, redacted: the next instance takes the connection
    /// over only if its settings name the same gateway.
    pub url: String,
    pub kind: crate::upstream::SocketKind,
    /// Its `hello-ok`, with the gateway snapshot as the broker last knew it.
    pub hello: crate::upstream::UpstreamHello,
    /// Bytes read from the socket and not parsed (base64).
    pub unread: String,
    /// Bytes written to the socket and not taken (base64), from inside a
    /// frame: the next instance writes them first.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unwritten: String,
    /// The gateway's last event `seq` on the connection.
    pub last_seq: Option<u64>,
    /// The subscriptions the gateway confirmed on the connection.
    pub confirmed: Vec<Subscription>,
    /// The next upstream request id's number.
    pub next_request_id: u64,
    /// Requests written on the connection and not answered yet.
    pub pending: Vec<crate::router::MovedRequest>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A parcel that counts its drops (its socket closing, for a real one).
    #[derive(Debug)]
    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Parcel for Counted {
        fn pack(self: Box<Self>) -> Entry {
            unreachable!("not packed here")
        }
    }

    #[test]
    fn a_parcel_left_after_the_parcels_were_taken_is_dropped_not_kept() {
        let handover = Handover::new(Gate::opened());
        let dropped = Arc::new(AtomicUsize::new(0));
        handover.leave(Box::new(Counted(Arc::clone(&dropped))));
        let taken = handover.take();
        assert_eq!(taken.len(), 1);
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        handover.leave(Box::new(Counted(Arc::clone(&dropped))));
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "its connection ends now");
        assert!(handover.take().is_empty(), "taken once");
        drop(taken);
        assert_eq!(dropped.load(Ordering::SeqCst), 2);
    }
}
