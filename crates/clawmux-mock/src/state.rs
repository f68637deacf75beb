//! State shared by the listener, the connection tasks and the test-facing
//! [`MockGateway`](super::MockGateway) handle.
//!
//! Everything sits behind one small [`Inner`] with short-lived std mutexes
//! (never held across an `.await`). Frames reach a connection only through
//! its writer queue, so per-connection ordering and `seq` stamping live in
//! exactly one place (`connection.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Notify};

use super::faults::Faults;
use super::MockConfig;

/// Locks a mutex, recovering from poisoning: a panicking test thread must not
/// wedge the double for every other connection.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Resolves once the double is shutting down (or its state is gone).
pub(crate) async fn until_shutdown(rx: &mut watch::Receiver<bool>) {
    // The returned guard is not `Send`; drop it here, not across an await.
    let _ = rx.wait_for(|stop| *stop).await.map(|_| ());
}

/// Wall-clock milliseconds since the Unix epoch (the unit of every `ts`).
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A `res` frame with `type` first, as the real server orders its keys.
pub(crate) fn res_frame(id: &Value, result: Result<&Value, &Value>) -> String {
    match result {
        Ok(payload) => {
            format!("{{\"type\":\"res\",\"id\":{id},\"ok\":true,\"payload\":{payload}}}")
        }
        Err(error) => format!("{{\"type\":\"res\",\"id\":{id},\"ok\":false,\"error\":{error}}}"),
    }
}

/// An event serialized once and shared by every recipient; each writer adds
/// its own `seq` when it frames it.
#[derive(Debug)]
pub(crate) struct EncodedEvent {
    /// JSON string literal of the event name.
    pub name_json: String,
    /// Serialized payload.
    pub payload_json: String,
    /// Serialized `stateVersion`, if the event carries one.
    pub state_version_json: Option<String>,
}

impl EncodedEvent {
    pub(crate) fn new(
        name: &str,
        payload: &Value,
        state_version: Option<StateVersion>,
    ) -> Arc<Self> {
        Arc::new(Self {
            name_json: Value::from(name).to_string(),
            payload_json: payload.to_string(),
            state_version_json: state_version.map(|sv| sv.to_json().to_string()),
        })
    }

    /// Approximate frame size, for the per-connection buffered-bytes budget.
    pub(crate) fn approx_len(&self) -> usize {
        self.name_json.len() + self.payload_json.len() + 64
    }

    /// The complete event frame with `seq`.
    pub(crate) fn frame(&self, seq: u64) -> String {
        let sv = self
            .state_version_json
            .as_ref()
            .map(|s| format!(",\"stateVersion\":{s}"))
            .unwrap_or_default();
        format!(
            "{{\"type\":\"event\",\"event\":{},\"payload\":{},\"seq\":{seq}{sv}}}",
            self.name_json, self.payload_json
        )
    }
}

/// What a connection's writer task is asked to do, in order.
#[derive(Debug)]
pub(crate) enum Outbound {
    /// A complete frame without `seq` (responses, `connect.challenge`).
    Frame(String),
    /// The first fragment of a text message whose rest never follows (a
    /// gateway stalled inside a message).
    FragmentStart(String),
    /// The last fragment of the message a [`Outbound::FragmentStart`] began.
    FragmentEnd(String),
    /// A sequenced event; the writer stamps the connection's next `seq`.
    Event(Arc<EncodedEvent>),
    /// Consume one `seq` without sending anything: a seq gap, or an event
    /// dropped for a slow consumer (gateway ≥ PR #123999).
    SkipSeq,
    /// The handshake succeeded: start the `tick` timer.
    StartTicks,
    /// Send a close frame and stop writing.
    Close { code: u16, reason: String },
}

/// The two global `stateVersion` counters (§3.4), each starting at 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StateVersion {
    pub presence: u64,
    pub health: u64,
}

impl StateVersion {
    pub(crate) fn to_json(self) -> Value {
        json!({ "presence": self.presence, "health": self.health })
    }
}

/// Per-connection signals shared between its tasks and the registry.
#[derive(Debug, Default)]
pub(crate) struct ConnCtl {
    /// Abrupt termination: the reader returns at once, dropping the socket.
    pub kill: Notify,
    /// A close frame was queued by someone other than the reader: start the
    /// bounded wait for the peer's close reply.
    pub closing: Notify,
    /// Set once a close frame is queued; nothing is queued after it, and
    /// the connection no longer counts as ready.
    pub close_queued: AtomicBool,
    /// Set once the writer has written the close frame.
    pub close_sent: AtomicBool,
    /// Bytes queued for the writer and not yet written (≈ `bufferedAmount`).
    pub queued_bytes: AtomicUsize,
}

/// What the handshake established about a ready connection.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub role: String,
    pub scopes: Vec<String>,
    pub caps: Vec<String>,
    pub device_id: Option<String>,
    /// This connection's row in `snapshot.presence` / `presence` events.
    pub presence: Value,
}

impl Session {
    pub(crate) fn has_scope(&self, scope: &str) -> bool {
        self.scopes.iter().any(|s| s == scope)
    }
}

/// One open WebSocket as the registry sees it.
#[derive(Debug)]
pub(crate) struct ConnEntry {
    pub index: u64,
    pub tx: mpsc::UnboundedSender<Outbound>,
    pub ctl: Arc<ConnCtl>,
    /// `Some` once hello-ok was queued.
    pub session: Option<Session>,
    /// `sessions.subscribe` flag (connection-scoped, not reference-counted).
    pub sessions_subscribed: bool,
    /// `sessions.messages.subscribe` keys.
    pub message_keys: HashSet<String>,
}

impl ConnEntry {
    /// Past hello-ok and not closing.
    pub(crate) fn is_ready(&self) -> bool {
        self.session.is_some() && !self.ctl.close_queued.load(Ordering::Acquire)
    }

    /// Queues a frame unless a close frame already went out.
    pub(crate) fn send(&self, out: Outbound, bytes: usize) {
        if self.ctl.close_queued.load(Ordering::Acquire) {
            return;
        }
        self.ctl.queued_bytes.fetch_add(bytes, Ordering::AcqRel);
        // A closed queue means the writer is gone; the connection is ending anyway.
        let _ = self.tx.send(out);
    }

    /// Queues a close frame (once) and tells the reader to start draining.
    pub(crate) fn close(&self, code: u16, reason: &str) {
        if self.ctl.close_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.tx.send(Outbound::Close {
            code,
            reason: reason.to_string(),
        });
        self.ctl.closing.notify_one();
    }
}

/// Which events need which scope before a connection may receive them
/// (`server-broadcast.ts`, gateway-protocol.md §3.2). Node-role connections
/// never receive guarded events.
fn event_allowed(event: &str, session: &Session) -> bool {
    let guard: Option<&[&str]> =
        if event.starts_with("exec.approval.") || event.starts_with("plugin.approval.") {
            Some(&["operator.approvals"])
        } else if event.starts_with("device.pair.") || event.starts_with("node.pair.") {
            Some(&["operator.pairing"])
        } else if matches!(
            event,
            "sessions.changed" | "session.message" | "session.tool"
        ) {
            Some(&["operator.read", "operator.write"])
        } else {
            None
        };
    match guard {
        None => true,
        Some(_) if session.role == "node" => false,
        Some(needed) => {
            session.has_scope("operator.admin") || needed.iter().any(|s| session.has_scope(s))
        }
    }
}

/// Recorded traffic, for test assertions.
#[derive(Debug, Default)]
pub(crate) struct Records {
    pub connects: Vec<Value>,
    /// The `Origin` of the connection of each of `connects`.
    pub connect_origins: Vec<Option<String>>,
    pub requests: Vec<(u64, Value)>,
}

/// Shared state of one running double.
#[derive(Debug)]
pub(crate) struct Inner {
    pub cfg: MockConfig,
    pub started: Instant,
    pub faults: Mutex<Faults>,
    pub conns: Mutex<HashMap<u64, ConnEntry>>,
    pub next_index: AtomicU64,
    pub total_connections: AtomicUsize,
    pub records: Mutex<Records>,
    pub state_version: Mutex<StateVersion>,
    /// The last health summary broadcast, served in `snapshot.health`.
    pub last_health: Mutex<Option<Value>>,
    /// Device tokens this double minted: token → device id.
    pub device_tokens: Mutex<HashMap<String, String>>,
    /// Transcripts and runs (see `runs.rs`).
    pub chats: Mutex<super::runs::ChatState>,
    /// Bumped on every observable change, so waiters need no polling.
    pub changed: watch::Sender<u64>,
    /// Tells the background tasks (listener, demo, health) to stop.
    pub shutdown: watch::Sender<bool>,
    /// Numbers demo runs.
    pub demo_runs: AtomicU64,
    /// The gateway's own presence row (`reason:"self"`), always listed first.
    pub self_presence: Value,
}

impl Inner {
    pub(crate) fn new(cfg: MockConfig) -> Arc<Self> {
        let version = cfg.server_version.clone();
        let self_presence = json!({
            "host": "mock-gateway", "version": version, "platform": std::env::consts::OS,
            "mode": "gateway", "reason": "self", "instanceId": uuid::Uuid::new_v4().to_string(),
            "text": format!("Gateway: mock-gateway · app {version} · mode gateway · reason self"),
            "ts": now_ms(),
        });
        Arc::new(Self {
            cfg,
            started: Instant::now(),
            faults: Mutex::new(Faults::default()),
            conns: Mutex::new(HashMap::new()),
            next_index: AtomicU64::new(0),
            total_connections: AtomicUsize::new(0),
            records: Mutex::new(Records::default()),
            state_version: Mutex::new(StateVersion {
                presence: 1,
                health: 1,
            }),
            last_health: Mutex::new(None),
            device_tokens: Mutex::new(HashMap::new()),
            chats: Mutex::new(Default::default()),
            changed: watch::channel(0).0,
            shutdown: watch::channel(false).0,
            demo_runs: AtomicU64::new(0),
            self_presence,
        })
    }

    /// Wakes every waiter (`wait_*` methods re-check their condition).
    pub(crate) fn notify_changed(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn faults(&self) -> Faults {
        lock(&self.faults).clone()
    }

    pub(crate) fn state_version(&self) -> StateVersion {
        *lock(&self.state_version)
    }

    /// Bumps the presence counter and returns the new versions.
    pub(crate) fn bump_presence(&self) -> StateVersion {
        let mut sv = lock(&self.state_version);
        sv.presence += 1;
        *sv
    }

    /// Bumps the health counter and returns the new versions.
    pub(crate) fn bump_health(&self) -> StateVersion {
        let mut sv = lock(&self.state_version);
        sv.health += 1;
        *sv
    }

    /// The presence list: the gateway's own row, then every ready
    /// connection's row in connection order.
    pub(crate) fn presence_list(&self) -> Vec<Value> {
        self.presence_rows(&lock(&self.conns), None)
    }

    /// [`presence_list`](Self::presence_list) over an already locked
    /// registry, optionally with a connection that is becoming ready.
    pub(crate) fn presence_rows(
        &self,
        conns: &HashMap<u64, ConnEntry>,
        joining: Option<(u64, &Value)>,
    ) -> Vec<Value> {
        let mut rows: Vec<(u64, &Value)> = conns
            .values()
            .filter_map(|c| c.session.as_ref().map(|s| (c.index, &s.presence)))
            .chain(joining)
            .collect();
        rows.sort_by_key(|(i, _)| *i);
        std::iter::once(self.self_presence.clone())
            .chain(rows.into_iter().map(|(_, v)| v.clone()))
            .collect()
    }

    /// Queues an event for one ready connection, applying the scope guard and
    /// the slow-consumer rule of §3.5: over `max_buffered_bytes`, a droppable
    /// event is skipped (consuming a `seq`), anything else closes the socket
    /// with 1008 "slow consumer".
    pub(crate) fn deliver(
        &self,
        entry: &ConnEntry,
        event: &str,
        encoded: &Arc<EncodedEvent>,
        droppable: bool,
    ) {
        let Some(session) = &entry.session else {
            return;
        };
        if !event_allowed(event, session) {
            return;
        }
        let buffered = entry.ctl.queued_bytes.load(Ordering::Acquire) as u64;
        if buffered > self.cfg.max_buffered_bytes {
            if droppable {
                entry.send(Outbound::SkipSeq, 0);
            } else {
                entry.close(1008, "slow consumer");
            }
            return;
        }
        entry.send(Outbound::Event(encoded.clone()), encoded.approx_len());
    }

    /// Sends an event to every ready connection accepted by `filter`.
    pub(crate) fn broadcast_filtered(
        &self,
        event: &str,
        payload: &Value,
        state_version: Option<StateVersion>,
        droppable: bool,
        filter: impl Fn(&ConnEntry) -> bool,
    ) {
        let encoded = EncodedEvent::new(event, payload, state_version);
        let conns = lock(&self.conns);
        for entry in conns.values().filter(|c| filter(c)) {
            self.deliver(entry, event, &encoded, droppable);
        }
    }

    /// Sends an event to every ready connection.
    pub(crate) fn broadcast(
        &self,
        event: &str,
        payload: &Value,
        state_version: Option<StateVersion>,
        droppable: bool,
    ) {
        self.broadcast_filtered(event, payload, state_version, droppable, |_| true);
    }

    /// Queues a complete frame (a response) for connection `index`, if open.
    pub(crate) fn send_frame(&self, index: u64, frame: String) {
        if let Some(entry) = lock(&self.conns).get(&index) {
            let len = frame.len();
            entry.send(Outbound::Frame(frame), len);
        }
    }

    /// Removes a connection from the registry; returns whether it was there.
    /// A ready connection's departure bumps presence and tells the others,
    /// as the real server does when a socket closes.
    pub(crate) fn deregister(&self, index: u64) -> bool {
        let removed = lock(&self.conns).remove(&index);
        let Some(entry) = removed else { return false };
        if entry.session.is_some() {
            let sv = self.bump_presence();
            let presence = json!({ "presence": self.presence_list() });
            self.broadcast("presence", &presence, Some(sv), true);
        }
        self.notify_changed();
        true
    }

    /// (open, ready) connection counts. A connection whose close frame is
    /// queued is still open but no longer ready.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let conns = lock(&self.conns);
        let ready = conns.values().filter(|c| c.is_ready()).count();
        (conns.len(), ready)
    }
}
