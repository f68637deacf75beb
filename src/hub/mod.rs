//! Fan-out: the registry of connected local clients and the gateway snapshot
//! they are greeted with.
//!
//! An upstream event is encoded once ([`EventHead`]) and the same bytes are
//! queued for every client; only the per-client `seq` differs. Admitting a
//! client (building its `hello-ok` from the snapshot) and publishing an event
//! (which may update the snapshot) happen under one lock, so a new client
//! sees every event after its snapshot and none before it.

pub mod about;
pub mod client;
pub mod replay;
mod shed;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::Value;

pub use client::{
    Backlog, Client, ClientIdentity, ClientKind, Growth, HeldOutside, Outgoing, Pushed,
    QueueBudget, QueueLimits, SharedEvent, Stall,
};
pub use replay::{ReplayLimits, ReplayWindow, SubscribeError};

use crate::protocol::EventHead;
use crate::sharing::{Audience, Visibility};

/// Counters for `/healthz`, logs and (later) metrics.
#[derive(Debug, Default)]
pub struct HubStats {
    /// Events published to clients.
    pub events: AtomicU64,
    /// Event deliveries dropped at a client's soft limit.
    pub drops: AtomicU64,
    /// Clients closed as slow consumers.
    pub slow_closes: AtomicU64,
}

#[derive(Debug, Default)]
struct HubInner {
    clients: HashMap<u64, Arc<Client>>,
    /// The current gateway snapshot (`hello-ok.snapshot`, kept fresh from
    /// `presence` and `health` events); `Null` until the first upstream hello.
    /// Shared: a reader takes it under the lock as a pointer and copies it,
    /// if at all, after (a snapshot can be megabytes, and this lock is the
    /// fan-out's).
    snapshot: Arc<Value>,
    /// The snapshot encoded for the clients' hellos, once per change
    /// (`None`: not since it last changed).
    encoded_snapshot: Option<EncodedSnapshot>,
    /// Recent events with their broker-wide cursors, for `/v1/events`.
    replay: replay::ReplayLog,
    /// Queues that receive no events but count in the budget (a HUD
    /// stream's copy of the request tap): shed and swept like the clients'.
    watched: HashMap<u64, Arc<Client>>,
    /// The activity projection of every logged event (as an observer's,
    /// from history: gateway times only), for the runs in flight
    /// `/v1/state` gives with its cursor: a feed's, which keeps what the
    /// runs in flight need and stays within a feed's bounds.
    activity: crate::activity::Activity,
}

/// The gateway snapshot as every client's `hello-ok` carries it, encoded
/// once for all of them (a snapshot can be megabytes: a copy and an
/// encoding per client would be paid under the hub's lock).
#[derive(Debug)]
pub struct EncodedSnapshot {
    /// The whole snapshot.
    pub whole: Box<RawValue>,
    /// The same with `presence` emptied (`[]`) and `health` emptied (`{}`)
    /// and both their `stateVersion`s 0, so the next `presence` and
    /// `health` events apply: for a hello the whole snapshot would make
    /// larger than the frames the client is told it may be sent.
    pub without_presence_and_health: Box<RawValue>,
}

impl EncodedSnapshot {
    fn encode(snapshot: &Value) -> Option<Self> {
        let Value::Object(members) = snapshot else {
            return None;
        };
        let whole = serde_json::value::to_raw_value(snapshot).ok()?;
        let mut cut = serde_json::Map::new();
        for (key, value) in members {
            let value = match key.as_str() {
                "presence" => Value::Array(Vec::new()),
                "health" => Value::Object(Default::default()),
                "stateVersion" => serde_json::json!({"presence": 0, "health": 0}),
                _ => value.clone(),
            };
            cut.insert(key.clone(), value);
        }
        let without_presence_and_health =
            serde_json::value::to_raw_value(&Value::Object(cut)).ok()?;
        Some(EncodedSnapshot {
            whole,
            without_presence_and_health,
        })
    }
}

/// The client registry and event fan-out.
#[derive(Debug)]
pub struct Hub {
    inner: Mutex<HubInner>,
    next_client_id: AtomicU64,
    queue_limits: QueueLimits,
    /// Queued bytes broker-wide (see [`QueueBudget`] for what counts); over
    /// its limit the clients that have gone longest without reading are
    /// closed first ([`Hub::shed`]).
    queue_budget: Arc<QueueBudget>,
    max_clients: usize,
    /// The number of admitted clients, for watchers (the systemd `STATUS=` line).
    client_count: tokio::sync::watch::Sender<usize>,
    pub stats: HubStats,
}

/// The broker is at its client limit.
#[derive(Debug, thiserror::Error)]
#[error("too many clients (limit {0})")]
pub struct TooManyClients(pub usize);

/// Events a slow client may miss: periodic or superseded by the next one
/// (design §5; gateway-protocol.md §3.5).
fn is_droppable(name: &str, payload: Option<&RawValue>) -> bool {
    match name {
        "tick" | "presence" | "heartbeat" => true,
        "chat" => {
            #[derive(serde::Deserialize)]
            struct State<'a> {
                #[serde(borrow, default)]
                state: Option<std::borrow::Cow<'a, str>>,
            }
            payload
                .and_then(|p| serde_json::from_str::<State>(p.get()).ok())
                .and_then(|s| s.state)
                .is_some_and(|s| s == "delta")
        }
        _ => false,
    }
}

impl Hub {
    pub fn new(queue_limits: QueueLimits, max_clients: usize) -> Self {
        Hub {
            inner: Mutex::new(HubInner {
                activity: crate::activity::Activity::for_feed(),
                ..HubInner::default()
            }),
            next_client_id: AtomicU64::new(1),
            queue_limits,
            queue_budget: Arc::new(QueueBudget::new()),
            max_clients,
            client_count: tokio::sync::watch::Sender::new(0),
            stats: HubStats::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HubInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new client, not yet receiving events (it is still handshaking).
    pub fn new_client(&self) -> Arc<Client> {
        let id = self.next_client_id.fetch_add(1, Ordering::Relaxed);
        Arc::new(self.client_with_id(id))
    }

    /// A client taken over from the previous instance, with its own id,
    /// `connId` and connection time (later clients get higher ids).
    pub fn restored_client(
        &self,
        id: u64,
        conn_id: String,
        connected_at_ms: u64,
        kind: ClientKind,
    ) -> Arc<Client> {
        self.next_client_id.fetch_max(id + 1, Ordering::Relaxed);
        let client = Client::with_connection(
            id,
            conn_id,
            connected_at_ms,
            self.queue_limits,
            Arc::clone(&self.queue_budget),
        );
        Arc::new(client.with_kind(kind))
    }

    /// Keeps the ids up to `top` for clients taken over from the previous
    /// instance: clients made from now on get higher ones.
    pub fn reserve_ids_through(&self, top: u64) {
        self.next_client_id.fetch_max(top + 1, Ordering::Relaxed);
    }

    /// Admits a client taken over from the previous instance: it had its
    /// `hello-ok` there, so none is queued here.
    pub fn admit_restored(&self, client: &Arc<Client>) -> Result<(), TooManyClients> {
        let mut inner = self.lock();
        if inner.clients.len() >= self.max_clients {
            return Err(TooManyClients(self.max_clients));
        }
        inner.clients.insert(client.id, Arc::clone(client));
        self.client_count.send_replace(inner.clients.len());
        Ok(())
    }

    fn client_with_id(&self, id: u64) -> Client {
        Client::with_budget(id, self.queue_limits, Arc::clone(&self.queue_budget))
    }

    /// Sets the broker-wide limit on queued bytes (unlimited until set).
    pub fn set_queue_budget(&self, bytes: usize) {
        self.queue_budget.set_limit(bytes);
    }

    /// The broker-wide queued-bytes account.
    pub fn queue_budget(&self) -> &Arc<QueueBudget> {
        &self.queue_budget
    }

    /// Records the gateway's `policy.maxBufferedBytes` from its `hello-ok`:
    /// no client's hard limit is below it (the broker is never stricter
    /// than a direct connection to that gateway).
    pub fn set_upstream_max_buffered(&self, bytes: Option<u64>) {
        self.queue_budget.set_upstream_hard(bytes);
    }

    /// Starts delivering events to `client`. `hello` builds the client's
    /// `hello-ok` from the current snapshot, encoded (`None` before the
    /// first upstream hello); it is queued before any event.
    pub fn admit(
        &self,
        client: &Arc<Client>,
        hello: impl FnOnce(Option<&EncodedSnapshot>) -> Bytes,
    ) -> Result<(), TooManyClients> {
        let mut inner = self.lock();
        if inner.clients.len() >= self.max_clients {
            return Err(TooManyClients(self.max_clients));
        }
        if inner.encoded_snapshot.is_none() {
            inner.encoded_snapshot = EncodedSnapshot::encode(&inner.snapshot);
        }
        client.push_frame(hello(inner.encoded_snapshot.as_ref()));
        inner.clients.insert(client.id, Arc::clone(client));
        self.client_count.send_replace(inner.clients.len());
        Ok(())
    }

    /// Stops delivering events to a client (it disconnected), or watching
    /// its queue.
    pub fn remove(&self, client_id: u64) {
        let mut inner = self.lock();
        inner.watched.remove(&client_id);
        if inner.clients.remove(&client_id).is_some() {
            self.client_count.send_replace(inner.clients.len());
        }
    }

    /// Watches a queue that gets no events but counts in the budget (a HUD
    /// stream's request tap): the budget's shedder and the stall sweep judge
    /// it like a client's, so a stream that does not read cannot hold
    /// counted bytes they cannot reach. Until [`Hub::remove`].
    pub fn watch(&self, client: &Arc<Client>) {
        self.lock().watched.insert(client.id, Arc::clone(client));
    }

    /// Follows the number of admitted clients as it changes.
    pub fn watch_client_count(&self) -> tokio::sync::watch::Receiver<usize> {
        self.client_count.subscribe()
    }

    pub fn client_count(&self) -> usize {
        self.lock().clients.len()
    }

    pub fn clients(&self) -> Vec<Arc<Client>> {
        self.lock().clients.values().cloned().collect()
    }

    /// Replaces the snapshot after a new upstream `hello-ok`.
    pub fn reset_snapshot(&self, snapshot: Value) {
        let snapshot = Arc::new(snapshot);
        let mut inner = self.lock();
        inner.snapshot = snapshot;
        inner.encoded_snapshot = None;
    }

    /// The current gateway snapshot (copied after the lock is let go).
    pub fn snapshot(&self) -> Value {
        let shared = Arc::clone(&self.lock().snapshot);
        Value::clone(&shared)
    }

    /// Publishes a gateway event: logs it with its audience (every event
    /// the broker receives, broadcast or targeted, so history holds what
    /// any client could have seen live) and delivers it to every admitted
    /// client that [`crate::sharing::may_see`] it, the same rule history
    /// applies. A run's event is parsed for the broker's projection before
    /// the lock is taken: fan-out never waits on a parse.
    pub fn publish(
        &self,
        name: &str,
        payload: Option<&RawValue>,
        state_version: Option<&RawValue>,
        audience: &Audience,
    ) {
        let projected = Projected::parse(name, payload);
        self.publish_parsed(name, payload, state_version, audience, projected);
    }

    /// [`Hub::publish`], the payload parsed for the projection already
    /// (the upstream reader parses it once, for the audience too).
    pub(crate) fn publish_parsed(
        &self,
        name: &str,
        payload: Option<&RawValue>,
        state_version: Option<&RawValue>,
        audience: &Audience,
        projected: Projected,
    ) {
        let head = EventHead::encode(name, payload, state_version);
        let cut = replay::cut_for_the_log(name, payload, state_version, &head);
        let droppable = is_droppable(name, payload);
        let change = SnapshotChange::parse(name, payload, state_version);
        let mut inner = self.lock();
        if let Some(change) = change {
            // Copied first only while a reader still holds the one before.
            change.apply(Arc::make_mut(&mut inner.snapshot));
            inner.encoded_snapshot = None;
        }
        let head = inner.replay.append_cut(head, cut, audience);
        let cursor = head.cursor();
        projected.apply(&mut inner.activity, name);
        let event = SharedEvent::new(head, &self.queue_budget);
        let visibility = Visibility::of(name, audience);
        // Read for the session it names once, if a reader filters by one.
        let about = about::About::new(payload);
        let visible =
            |c: &&Arc<Client>| visibility.admits(&c.reader()) && c.wants(name, cursor, &about);
        self.deliver(
            &inner,
            inner.clients.values().filter(visible),
            &event,
            droppable,
        );
        drop(event);
        self.shed(&inner, 0);
    }

    /// Delivers a copy the broker makes of an event it has already logged
    /// to other clients (a tool event of a run a local client started, as
    /// the `session.tool` the gateway would have sent the other local
    /// subscribers): to `ids` only (observers have the original), not
    /// logged again, scope guards applied.
    pub fn deliver_copy(&self, name: &str, payload: Option<&RawValue>, ids: &[u64]) {
        let head = EventHead::encode(name, payload, None);
        let about = about::About::new(payload);
        let need = crate::policy::events::guard(name).need();
        let inner = self.lock();
        let event = SharedEvent::new(head, &self.queue_budget);
        let clients = ids.iter().filter_map(|id| inner.clients.get(id));
        self.deliver(
            &inner,
            clients.filter(|c| need.allows(c.grant()) && c.wants(name, 0, &about)),
            &event,
            false,
        );
        drop(event);
        self.shed(&inner, 0);
    }

    /// Publishes an event the broker itself originates (e.g. `clawmux.upstream`).
    pub fn publish_local(&self, name: &str, payload: &Value) {
        let head = EventHead::from_value(name, payload);
        let projected = Projected::of_value(name, payload);
        let mut inner = self.lock();
        let head = inner.replay.append(head, &Audience::All);
        let cursor = head.cursor();
        projected.apply(&mut inner.activity, name);
        let event = SharedEvent::new(head, &self.queue_budget);
        let visibility = Visibility::of(name, &Audience::All);
        let about = about::About::new(event.payload());
        let visible =
            |c: &&Arc<Client>| visibility.admits(&c.reader()) && c.wants(name, cursor, &about);
        self.deliver(
            &inner,
            inner.clients.values().filter(visible),
            &event,
            false,
        );
    }

    /// Pushes `event` to `clients`. A backlog whose ring buffer must grow
    /// past what the budget has left gets the room made first, by the
    /// budget's one rule ([`Hub::shed`]): the client closed for it is the
    /// one that has gone longest without reading, not the one that grows.
    fn deliver<'a>(
        &self,
        inner: &HubInner,
        clients: impl Iterator<Item = &'a Arc<Client>>,
        event: &Arc<SharedEvent>,
        droppable: bool,
    ) {
        self.stats.events.fetch_add(1, Ordering::Relaxed);
        for client in clients {
            let mut pushed = client.push_event(event, droppable);
            if pushed == Pushed::NoRoom {
                self.shed(inner, client.ring_growth());
                pushed = client.push_event_with(event, droppable, Growth::Always);
            }
            match pushed {
                Pushed::Queued | Pushed::Closed | Pushed::NoRoom => {}
                Pushed::Dropped => {
                    self.stats.drops.fetch_add(1, Ordering::Relaxed);
                }
                Pushed::SlowConsumer => {
                    self.stats.slow_closes.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Closes clients that have had a backlog and made no progress for
    /// longer than their grace, and enforces the broker-wide budget for
    /// bytes queued by responses (events enforce it as they are published).
    /// Called periodically by the broker.
    pub fn sweep_stalled(&self, now: std::time::Instant) {
        let inner = self.lock();
        for client in inner.clients.values().chain(inner.watched.values()) {
            if client.sweep_stall(now) == Stall::Closed {
                tracing::warn!(client_id = client.id, "no progress within the grace");
                self.stats.slow_closes.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.shed(&inner, 0);
    }

    /// Makes every client see a gap (a skipped `seq`): after an upstream gap
    /// or reconnect, so unmodified clients resync. The replay cursor skips a
    /// number too, so `/v1/events` streams (live or replayed) see a skipped id.
    pub fn gap(&self) {
        let mut inner = self.lock();
        inner.replay.skip();
        inner.activity.forget_unfinished();
        for client in inner.clients.values() {
            client.skip_seq();
        }
    }
}

/// What an event does to the broker's activity projection, decided (and
/// its payload parsed) before the hub's lock is taken.
pub(crate) enum Projected {
    /// Not about runs: nothing (the payload is not parsed).
    Nothing,
    /// A gap: runs whose end was not seen are set aside.
    Gap,
    /// A run's event, parsed.
    Apply(Value),
}

impl Projected {
    fn is_about_runs(name: &str) -> bool {
        matches!(
            name,
            "agent" | "chat" | "session.tool" | "clawmux.upstream" | replay::GAP_EVENT
        )
    }

    pub(crate) fn parse(name: &str, payload: Option<&RawValue>) -> Self {
        if !Self::is_about_runs(name) {
            return Projected::Nothing;
        }
        if name == replay::GAP_EVENT {
            return Projected::Gap;
        }
        payload
            .and_then(|p| serde_json::from_str::<Value>(p.get()).ok())
            .map_or(Projected::Nothing, Projected::Apply)
    }

    fn of_value(name: &str, payload: &Value) -> Self {
        if !Self::is_about_runs(name) {
            Projected::Nothing
        } else if name == replay::GAP_EVENT {
            Projected::Gap
        } else {
            Projected::Apply(payload.clone())
        }
    }

    /// The parsed payload of a run's event (`agent`, `chat`, …).
    pub(crate) fn value(&self) -> Option<&Value> {
        match self {
            Projected::Apply(v) => Some(v),
            _ => None,
        }
    }

    pub(crate) fn apply(&self, activity: &mut crate::activity::Activity, name: &str) {
        match self {
            Projected::Nothing => {}
            Projected::Gap => {
                activity.forget_unfinished();
            }
            Projected::Apply(payload) => {
                activity.apply(crate::activity::Observed {
                    name,
                    payload,
                    received_ms: None,
                });
            }
        }
    }
}

/// A `presence` or `health` event's change to the gateway snapshot, parsed
/// before the hub's lock is taken (a `health` payload can be large).
struct SnapshotChange {
    name: &'static str,
    payload: Value,
    state_version: Option<Value>,
}

impl SnapshotChange {
    fn parse(
        name: &str,
        payload: Option<&RawValue>,
        state_version: Option<&RawValue>,
    ) -> Option<SnapshotChange> {
        let name = match name {
            "presence" => "presence",
            "health" => "health",
            _ => return None,
        };
        let payload = serde_json::from_str::<Value>(payload?.get()).ok()?;
        let state_version = state_version.and_then(|s| serde_json::from_str::<Value>(s.get()).ok());
        Some(SnapshotChange {
            name,
            payload,
            state_version,
        })
    }

    /// Applies it, only if its `stateVersion` is newer than the one held
    /// (gateway-protocol.md §3.4).
    fn apply(self, snapshot: &mut Value) {
        let SnapshotChange {
            name,
            payload,
            state_version: new_sv,
        } = self;
        let Value::Object(snap) = snapshot else {
            return;
        };
        let held = |key: &str| {
            snap.get("stateVersion")
                .and_then(|sv| sv.get(key))
                .and_then(Value::as_u64)
        };
        if let (Some(new), Some(old)) = (
            new_sv
                .as_ref()
                .and_then(|sv| sv.get(name))
                .and_then(Value::as_u64),
            held(name),
        ) {
            if new <= old {
                return;
            }
        }
        match name {
            "presence" => {
                if let Some(list) = payload.get("presence") {
                    snap.insert("presence".into(), list.clone());
                }
            }
            _ => {
                snap.insert("health".into(), payload);
            }
        }
        if let Some(Value::Object(new_sv)) = new_sv {
            let entry = snap
                .entry("stateVersion")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(sv) = entry {
                if let Some(v) = new_sv.get(name) {
                    sv.insert(name.into(), v.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod accounting_props;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::Duration;

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    fn hub() -> Hub {
        Hub::new(
            QueueLimits {
                soft_bytes: 1 << 20,
                hard_bytes: 8 << 20,
                grace: Duration::from_secs(10),
            },
            2,
        )
    }

    #[test]
    fn droppable_events() {
        assert!(is_droppable("tick", None));
        assert!(is_droppable("chat", Some(&raw(json!({"state":"delta"})))));
        assert!(!is_droppable("chat", Some(&raw(json!({"state":"final"})))));
        assert!(!is_droppable("health", None));
        assert!(!is_droppable("agent", None));
    }

    fn apply_to_snapshot(
        snapshot: &mut Value,
        name: &str,
        payload: Option<&RawValue>,
        state_version: Option<&RawValue>,
    ) {
        if let Some(change) = SnapshotChange::parse(name, payload, state_version) {
            change.apply(snapshot);
        }
    }

    #[test]
    fn snapshot_applies_only_newer_versions() {
        let mut snap = json!({"presence":[],"health":{},"stateVersion":{"presence":5,"health":3}});
        apply_to_snapshot(
            &mut snap,
            "presence",
            Some(&raw(json!({"presence":[{"host":"a"}]}))),
            Some(&raw(json!({"presence":6,"health":3}))),
        );
        assert_eq!(snap["presence"][0]["host"], "a");
        assert_eq!(snap["stateVersion"]["presence"], 6);
        apply_to_snapshot(
            &mut snap,
            "presence",
            Some(&raw(json!({"presence":[]}))),
            Some(&raw(json!({"presence":4,"health":3}))),
        );
        assert_eq!(snap["presence"][0]["host"], "a", "older version ignored");
        apply_to_snapshot(
            &mut snap,
            "health",
            Some(&raw(json!({"ok":true}))),
            Some(&raw(json!({"presence":6,"health":4}))),
        );
        assert_eq!(snap["health"]["ok"], true);
        assert_eq!(snap["stateVersion"], json!({"presence":6,"health":4}));
    }

    /// A reader of the snapshot takes the hub's one copy, not a copy of
    /// its own under the lock; an event that changes it meanwhile leaves
    /// the reader's as it was and the hub's with the change.
    #[test]
    fn a_snapshot_read_is_shared_and_a_change_after_leaves_it_as_read() {
        let hub = hub();
        hub.reset_snapshot(json!({"presence": [], "stateVersion": {"presence": 1}}));
        let (read, _, _) = hub.snapshot_with_runs();
        let (again, _, _) = hub.snapshot_with_runs();
        assert!(Arc::ptr_eq(&read, &again), "shared, not copied");
        hub.publish(
            "presence",
            Some(&raw(json!({"presence": [{"host": "b"}]}))),
            Some(&raw(json!({"presence": 2}))),
            &Audience::All,
        );
        assert_eq!(read["presence"], json!([]), "the reader's, as it read it");
        assert_eq!(hub.snapshot()["presence"], json!([{"host": "b"}]));
        assert_eq!(hub.snapshot()["stateVersion"]["presence"], 2);
    }

    #[test]
    fn the_encoded_snapshot_follows_the_snapshot_and_has_a_cut_without_presence_and_health() {
        let hub = hub();
        let encoded = |hub: &Hub| {
            let c = hub.new_client();
            let mut got = None;
            hub.admit(&c, |snap| {
                let snap = snap.unwrap();
                got = Some((
                    serde_json::from_str::<Value>(snap.whole.get()).unwrap(),
                    serde_json::from_str::<Value>(snap.without_presence_and_health.get()).unwrap(),
                ));
                Bytes::new()
            })
            .unwrap();
            got.unwrap()
        };
        hub.reset_snapshot(json!({
            "presence": [{"host": "a"}],
            "health": {"ok": true},
            "stateVersion": {"presence": 3, "health": 2},
            "uptimeMs": 5,
        }));
        let (whole, cut) = encoded(&hub);
        assert_eq!(whole["presence"], json!([{"host": "a"}]));
        assert_eq!(
            cut,
            json!({
                "presence": [],
                "health": {},
                "stateVersion": {"presence": 0, "health": 0},
                "uptimeMs": 5,
            })
        );
        hub.publish(
            "presence",
            Some(&raw(json!({"presence": [{"host": "b"}]}))),
            Some(&raw(json!({"presence": 4, "health": 2}))),
            &Audience::All,
        );
        let (whole, _) = encoded(&hub);
        assert_eq!(whole["presence"], json!([{"host": "b"}]), "{whole}");
        assert_eq!(whole["stateVersion"]["presence"], 4);
    }

    #[tokio::test]
    async fn admitted_clients_get_hello_first_then_events() {
        let hub = hub();
        hub.reset_snapshot(json!({"presence":[]}));
        let a = hub.new_client();
        a.set_access(crate::policy::Access::unrestricted());
        hub.admit(&a, |snap| Bytes::from(snap.unwrap().whole.get().to_owned()))
            .unwrap();
        hub.publish("tick", Some(&raw(json!({"ts":1}))), None, &Audience::All);
        hub.gap();
        hub.publish(
            "tick",
            Some(&raw(json!({"ts":2}))),
            None,
            &Audience::Only(vec![a.id]),
        );
        hub.publish(
            "tick",
            Some(&raw(json!({"ts":3}))),
            None,
            &Audience::Only(vec![]),
        );
        hub.publish("tick", Some(&raw(json!({"ts":4}))), None, &Audience::All);
        let batch = a.next_batch().await;
        assert!(matches!(&batch[0], Outgoing::Frame(b) if &b[..] == br#"{"presence":[]}"#));
        assert!(matches!(&batch[1], Outgoing::Event(_, 1)));
        assert!(matches!(&batch[2], Outgoing::Event(_, 3)));
        assert!(
            matches!(&batch[3], Outgoing::Event(_, 4)),
            "not addressed: no seq used"
        );
        assert_eq!(batch.len(), 4);
        let b = hub.new_client();
        b.set_access(crate::policy::Access::unrestricted());
        hub.admit(&b, |_| Bytes::new()).unwrap();
        let c = hub.new_client();
        c.set_access(crate::policy::Access::unrestricted());
        assert!(hub.admit(&c, |_| Bytes::new()).is_err());
        hub.remove(a.id);
        assert_eq!(hub.client_count(), 1);
    }

    /// A reader that wants some names is queued only those (and gaps):
    /// twice its hard limit of other events, with nothing read, takes none
    /// of its queue, closes nothing and uses no `seq`.
    #[tokio::test]
    async fn a_reader_that_wants_some_names_is_queued_only_those() {
        let hub = Hub::new(
            QueueLimits {
                soft_bytes: 64 * 1024,
                hard_bytes: 64 * 1024,
                grace: Duration::from_secs(600),
            },
            2,
        );
        let picky = hub.new_client();
        picky.set_access(crate::policy::Access::unrestricted());
        picky.want_only(["test.wanted"]);
        hub.admit(&picky, |_| Bytes::new()).unwrap();
        let hello = picky.queued_bytes();
        let pad = "x".repeat(1024);
        for i in 0..128 {
            hub.publish(
                "test.other",
                Some(&raw(json!({"i": i, "pad": pad}))),
                None,
                &Audience::All,
            );
        }
        hub.publish_local("clawmux.upstream", &json!({"state": "ready"}));
        assert_eq!(
            picky.queued_bytes(),
            hello,
            "nothing it did not want is queued"
        );
        assert!(!picky.is_closing() && !picky.killed.is_cancelled());
        hub.publish(
            "test.wanted",
            Some(&raw(json!({"i": 0}))),
            None,
            &Audience::All,
        );
        hub.publish_local(replay::GAP_EVENT, &json!({"after": 1, "next": 2}));
        let batch = picky.next_batch().await;
        let names: Vec<_> = batch
            .iter()
            .filter_map(|item| match item {
                Outgoing::Event(head, seq) => Some((head.name().to_string(), *seq)),
                _ => None,
            })
            .collect();
        assert_eq!(
            names,
            [
                ("test.wanted".to_owned(), 1),
                (replay::GAP_EVENT.to_owned(), 2)
            ],
            "only what it wants, in seq order with no hole"
        );
    }

    /// A gap among events a reader was not given: it is told where the
    /// gap lies by the cursors of the events it passed over around it.
    #[tokio::test]
    async fn a_reader_given_some_names_learns_where_a_gap_lies() {
        let hub = hub();
        let picky = hub.new_client();
        picky.set_access(crate::policy::Access::unrestricted());
        picky.want_only(["test.wanted"]);
        hub.admit(&picky, |_| Bytes::new()).unwrap();
        let other = |i: i64| {
            hub.publish(
                "test.other",
                Some(&raw(json!({"i": i}))),
                None,
                &Audience::All,
            )
        };
        other(1);
        other(2);
        assert_eq!(picky.take_hole(), None, "no gap yet");
        hub.gap();
        other(3);
        other(4);
        hub.publish("test.wanted", Some(&raw(json!({}))), None, &Audience::All);
        let batch = picky.next_batch().await;
        let Some(Outgoing::Event(wanted, 2)) = batch.last() else {
            panic!("the wanted event, its seq after the skipped one: {batch:?}");
        };
        let (before, after) = picky.take_hole().expect("the gap is marked");
        assert!(
            before > 0 && after.is_some_and(|a| a > before + 1 && a < wanted.cursor()),
            "{before} {after:?} {}",
            wanted.cursor()
        );
        assert_eq!(picky.take_hole(), None, "told once");
    }
}
