//! The open dedicated connections (`/ws/dedicated`): the cap, the `/v1/state` listing, and
//! the counters `/metrics` shows.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use serde_json::{json, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::rate::OpenLimiter;

/// The open dedicated connections: the cap, what `/v1/state` lists, and
/// the counters `/metrics` shows.
#[derive(Debug)]
pub struct Dedicated {
    /// One permit per open connection (`limits.max_dedicated`).
    slots: Arc<Semaphore>,
    pub(crate) max: usize,
    open: Mutex<BTreeMap<u64, Listing>>,
    next_id: AtomicU64,
    /// How connections went, for `/metrics`.
    pub outcomes: Outcomes,
    /// The upstream-open rates (`[limits] upstream_open_*`), built from the
    /// settings at the first open.
    opens: OnceLock<OpenLimiter<u32>>,
}

/// Counters of dedicated connections by how they went, for `/metrics`.
#[derive(Debug, Default)]
pub struct Outcomes {
    /// The gateway answered the client's `connect` `ok`.
    pub connected: AtomicU64,
    /// The gateway answered the client's `connect` with an error.
    pub rejected: AtomicU64,
    /// A `studio.*` error before the gateway answered.
    pub failed: AtomicU64,
    /// Closed at once: `max_dedicated` connections were already open.
    pub refused: AtomicU64,
    /// Answered `studio.too_many_requests`: over an upstream-open rate
    /// (`[limits] upstream_open_*`); no gateway connection was opened.
    pub rate_limited: AtomicU64,
    /// The client left before its `connect` was forwarded.
    pub abandoned: AtomicU64,
    /// The client's first frame was not a usable `connect`.
    pub invalid: AtomicU64,
    /// No `connect` within `limits.connect_timeout`.
    pub timed_out: AtomicU64,
    /// Gateway connections opened for the route (whatever came of them).
    pub upstream_opens: AtomicU64,
    /// Connections that got as far as the relay, by how it ended.
    ends: Mutex<BTreeMap<&'static str, u64>>,
}

impl Outcomes {
    /// `(outcome label, count)` for every outcome.
    pub fn counts(&self) -> [(&'static str, u64); 8] {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("connected", n(&self.connected)),
            ("rejected", n(&self.rejected)),
            ("failed", n(&self.failed)),
            ("refused", n(&self.refused)),
            ("rate_limited", n(&self.rate_limited)),
            ("abandoned", n(&self.abandoned)),
            ("invalid", n(&self.invalid)),
            ("timed_out", n(&self.timed_out)),
        ]
    }

    /// Counts a relay that ended (`reason`: a fixed label).
    pub(crate) fn ended(&self, reason: &'static str) {
        *self
            .ends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason)
            .or_default() += 1;
    }

    /// `(reason, count)` of ended relays, sorted.
    pub fn ends(&self) -> Vec<(&'static str, u64)> {
        let ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        ends.iter().map(|(k, v)| (*k, *v)).collect()
    }
}

/// One open dedicated connection as `/v1/state` shows it: who the client
/// says it is (never its credentials), and how far it got.
#[derive(Debug, Clone)]
pub(crate) struct Listing {
    pub(crate) opened: Instant,
    /// `opening` (no `connect` forwarded yet), `connecting` (waiting for the
    /// gateway's answer), `connected`, or `rejected`.
    pub(crate) phase: &'static str,
    /// `client` of its connect params: id, mode, version, platform, …
    pub(crate) client: Value,
    pub(crate) role: Option<String>,
    pub(crate) device_id: Option<String>,
    /// Which credential went upstream: `host-token` (injected by the
    /// broker), or the client's own `token`, `password`, `device-token`,
    /// `device` (a signature alone).
    pub(crate) auth: Option<&'static str>,
    /// The gateway's `server.connId` and granted scopes, from its `hello-ok`.
    pub(crate) conn_id: Option<String>,
    pub(crate) scopes: Option<Value>,
    /// The `Origin` the gateway connection was opened with (browser
    /// clients only).
    pub(crate) origin: Option<String>,
}

impl Dedicated {
    pub fn new(max: usize) -> Dedicated {
        Dedicated {
            slots: Arc::new(Semaphore::new(max)),
            max,
            open: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
            outcomes: Outcomes::default(),
            opens: OnceLock::new(),
        }
    }

    /// The upstream-open rate limiter, keyed by the peer's uid.
    pub fn opens(&self, limits: &crate::config::Limits) -> &OpenLimiter<u32> {
        self.opens.get_or_init(|| OpenLimiter::from_limits(limits))
    }

    /// Dedicated connections open now.
    pub fn count(&self) -> usize {
        self.listings().len()
    }

    fn listings(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Listing>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `/v1/state` list, oldest first.
    pub fn to_json(&self) -> Value {
        let now = Instant::now();
        let list: Vec<Value> = self
            .listings()
            .iter()
            .map(|(id, l)| {
                json!({
                    "id": id,
                    "phase": l.phase,
                    "open_ms": now.saturating_duration_since(l.opened).as_millis() as u64,
                    "client": l.client,
                    "role": l.role,
                    "device_id": l.device_id,
                    "auth": l.auth,
                    "conn_id": l.conn_id,
                    "scopes": l.scopes,
                    "origin": l.origin,
                })
            })
            .collect();
        Value::Array(list)
    }

    /// Takes a slot, or `None` at the cap.
    pub(crate) fn try_open(self: &Arc<Self>) -> Option<Slot> {
        let permit = Arc::clone(&self.slots).try_acquire_owned().ok()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.listings().insert(
            id,
            Listing {
                opened: Instant::now(),
                phase: "opening",
                client: Value::Null,
                role: None,
                device_id: None,
                auth: None,
                conn_id: None,
                scopes: None,
                origin: None,
            },
        );
        Some(Slot {
            registry: Arc::clone(self),
            id,
            _permit: permit,
        })
    }
}

/// One connection's slot; dropping it frees the slot and its listing.
pub(crate) struct Slot {
    registry: Arc<Dedicated>,
    pub(crate) id: u64,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    pub(crate) fn update(&self, f: impl FnOnce(&mut Listing)) {
        if let Some(l) = self.registry.listings().get_mut(&self.id) {
            f(l);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.registry.listings().remove(&self.id);
    }
}
