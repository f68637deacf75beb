//! Auxiliary upstream sessions: the answers the gateway tailors to the
//! caller's scopes (`status` redaction, `sharingRole`, which methods a probe
//! reports...) must be the ones a client holding only its own grant gets.
//! So the plain request/response methods of a client whose grant is
//! narrower than the main session's scopes run on a session that holds
//! exactly that grant: the broker's own connect (same credential, same
//! device), asking for those scopes.
//!
//! - One session per distinct grant, opened on the first request that
//!   needs it, shared by every client holding that grant, closed
//!   [`IDLE_LINGER`] after the last such client left. At most
//!   [`MAX_GRANT_SESSIONS`] at once.
//! - It publishes no events: the main session's stream stays the one
//!   source. So subscriptions and runs ([`stays_on_main`]) stay on the main
//!   session, whose per-connection state delivers their events.
//! - It never reconnects: one lost (or never opened) fails the requests
//!   sent on it (`studio.upstream_closed`, or the handshake's error) and
//!   the next request opens a new one.
//! - Its generations start at [`AUX_GENERATION_BASE`], so they never equal
//!   one of the main session's and the router fails exactly its requests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Phase, Target, Upstream};
use crate::config::Settings;
use crate::dispatch::Dispatcher;
use crate::hub::Hub;
use crate::policy::Grant;
use crate::router::Router;
use crate::sharing::Sharing;

/// Narrower sessions open at once at most (one per distinct grant). A
/// client with yet another grant has its requests run on the main session
/// (what it could already do before narrower sessions existed: the answers
/// are tailored to the main session's scopes); each such request is
/// counted (`fallbacks` in `/v1/state`) and logged.
pub const MAX_GRANT_SESSIONS: usize = 8;

/// How long a narrower session no client holds stays open (so that
/// `/v1/rpc` calls, each a client of its own, do not open one per call);
/// then it is closed. At the cap, an idle one is closed at once to make
/// room.
pub const IDLE_LINGER: Duration = Duration::from_secs(5);

/// The first generation of a narrower session; the main session counts
/// from 1 and would need 2^48 reconnects to get here.
pub const AUX_GENERATION_BASE: u64 = 1 << 48;

/// Methods that keep running on the main session whatever the grant:
/// subscriptions are per-connection state for the events the main session
/// publishes, and a run sends its tool events to the connection that
/// started it. (Any `*subscribe` method is kept on the main session too.)
const MAIN_SESSION_METHODS: [&str; 8] = [
    "chat.send",
    "chat.abort",
    "agent",
    "send",
    "sessions.send",
    "sessions.steer",
    "sessions.abort",
    "sessions.create",
];

/// Whether `method` runs on the main session even for a narrower grant.
pub fn stays_on_main(method: &str) -> bool {
    method.ends_with("subscribe") || MAIN_SESSION_METHODS.contains(&method)
}

/// What opening a session needs; set once the connector starts.
#[derive(Debug)]
pub(crate) struct AuxFactory {
    pub settings: Settings,
    pub hub: Arc<Hub>,
    pub router: Arc<Router>,
    pub sharing: Arc<Sharing>,
    /// Weak: the dispatcher owns this factory.
    pub dispatcher: Weak<Dispatcher>,
    pub cancel: CancellationToken,
}

#[derive(Debug)]
struct Entry {
    upstream: Upstream,
    generation: u64,
    /// Clients that sent a request on it and are still connected.
    holders: usize,
    /// Counts the times `holders` fell to 0 (a linger timer closes the
    /// session only if no client came and went since it started).
    idled: u64,
    cancel: CancellationToken,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The narrower sessions, by grant.
#[derive(Debug, Default)]
pub struct AuxSessions {
    factory: OnceLock<AuxFactory>,
    entries: Arc<Mutex<HashMap<Grant, Entry>>>,
    /// Generations handed out after [`AUX_GENERATION_BASE`].
    issued: AtomicU64,
    /// Sessions opened since start.
    opened: AtomicU64,
    /// Requests that ran on the main session because of the cap.
    fallbacks: AtomicU64,
}

impl AuxSessions {
    pub(crate) fn init(&self, factory: AuxFactory) {
        let _ = self.factory.set(factory);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Grant, Entry>> {
        lock(&self.entries)
    }

    /// The session for `grant` and its generation, opened if needed;
    /// records the client (whose slot is `holder`) as holding it. `None`:
    /// use the main session (at the cap, or none can be opened here).
    pub fn session_for(
        &self,
        grant: &Grant,
        holder: &OnceLock<Grant>,
        target: impl FnOnce() -> watch::Receiver<Target>,
    ) -> Option<(Upstream, u64)> {
        let factory = self.factory.get()?;
        let mut entries = self.lock();
        if !entries.contains_key(grant) && entries.len() >= MAX_GRANT_SESSIONS {
            // Make room by closing one no client holds, if any.
            let idle = entries
                .iter()
                .find(|(_, e)| e.holders == 0)
                .map(|(g, _)| g.clone());
            if let Some(idle) = idle {
                entries.remove(&idle);
            }
        }
        if !entries.contains_key(grant) && entries.len() >= MAX_GRANT_SESSIONS {
            drop(entries);
            let n = self.fallbacks.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::warn!(
                scopes = %grant.scopes().join(","),
                fallbacks = n,
                "{MAX_GRANT_SESSIONS} narrower upstream sessions are open already: this request runs on the main session (its answer is tailored to the broker's scopes)"
            );
            return None;
        }
        let stale = entries
            .get(grant)
            .is_some_and(|e| e.upstream.phase() == Phase::Stopped);
        if stale || !entries.contains_key(grant) {
            let holders = if stale { entries[grant].holders } else { 0 };
            let generation = AUX_GENERATION_BASE + self.issued.fetch_add(1, Ordering::Relaxed);
            let cancel = factory.cancel.child_token();
            let upstream = super::open_aux(factory, target(), grant, generation, cancel.clone())?;
            self.opened.fetch_add(1, Ordering::Relaxed);
            tracing::info!(scopes = %grant.scopes().join(","), generation, "opening a narrower upstream session");
            entries.insert(
                grant.clone(),
                Entry {
                    upstream,
                    generation,
                    holders,
                    idled: 0,
                    cancel,
                },
            );
        }
        let entry = entries.get_mut(grant)?;
        if holder.set(grant.clone()).is_ok() {
            entry.holders += 1;
        }
        Some((entry.upstream.clone(), entry.generation))
    }

    /// A client that held `grant`'s session left; [`IDLE_LINGER`] after
    /// the last one, it is closed.
    pub fn release(&self, grant: &Grant) {
        let mut entries = self.lock();
        let Some(entry) = entries.get_mut(grant) else {
            return;
        };
        entry.holders = entry.holders.saturating_sub(1);
        if entry.holders > 0 {
            return;
        }
        entry.idled += 1;
        let idled = entry.idled;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            entries.remove(grant);
            return;
        };
        let shared = Arc::clone(&self.entries);
        let grant = grant.clone();
        runtime.spawn(async move {
            tokio::time::sleep(IDLE_LINGER).await;
            let mut entries = lock(&shared);
            if entries
                .get(&grant)
                .is_some_and(|e| e.holders == 0 && e.idled == idled)
            {
                tracing::info!(scopes = %grant.scopes().join(","), "closing a narrower upstream session: no client has held its scopes for {} s", IDLE_LINGER.as_secs());
                entries.remove(&grant);
            }
        });
    }

    /// Sessions open, opened since start, requests run on the main session
    /// because of the cap (for `/metrics`).
    pub fn counts(&self) -> (usize, u64, u64) {
        (
            self.lock().len(),
            self.opened.load(Ordering::Relaxed),
            self.fallbacks.load(Ordering::Relaxed),
        )
    }

    /// For `/v1/state`.
    pub fn to_json(&self) -> Value {
        let sessions: Vec<Value> = self
            .lock()
            .iter()
            .map(|(grant, e)| {
                let s = e.upstream.status();
                json!({
                    "scopes": grant,
                    "phase": s.phase.as_str(),
                    "session": e.generation,
                    "holders": e.holders,
                    "granted": s.hello.as_ref().map(|h| &h.scopes),
                    "last_error": s.last_error.as_ref().map(|e| e.to_json()),
                })
            })
            .collect();
        json!({
            "sessions": sessions,
            "max": MAX_GRANT_SESSIONS,
            "opened": self.opened.load(Ordering::Relaxed),
            "fallbacks": self.fallbacks.load(Ordering::Relaxed),
        })
    }
}

fn lock(
    entries: &Mutex<HashMap<Grant, Entry>>,
) -> std::sync::MutexGuard<'_, HashMap<Grant, Entry>> {
    entries.lock().unwrap_or_else(|p| p.into_inner())
}
