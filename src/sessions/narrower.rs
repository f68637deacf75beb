//! Narrower sessions: the answers the gateway tailors to the caller's
//! scopes (`status` redaction, `sharingRole`, which methods a probe
//! reports...) must be the ones a client holding only its own grant gets.
//! So the plain request/response methods of a client whose grant is
//! narrower than the main session's scopes run on a session that holds
//! exactly that grant: the broker's own connect (same credential, same
//! device, the same connect loop and backoff as the main session), asking
//! for those scopes.
//!
//! - One session per distinct grant, opened on the first request that
//!   needs it, shared by every client holding that grant, closed
//!   [`IDLE_LINGER`] after the last such client left. At most
//!   [`MAX_GRANT_SESSIONS`] at once.
//! - Opening one is rate-limited (`[limits] upstream_open_rate`/`_burst`
//!   per local process, `upstream_open_rate_total`/`_burst_total` in all, as
//!   for `/ws/dedicated`): a client rotating its scopes cannot make the
//!   broker churn upstream handshakes.
//! - It publishes no events: the main session's stream stays the one
//!   source. So subscriptions and runs ([`stays_on_main`]) stay on the main
//!   session, whose per-connection state delivers their events.
//! - One that cannot open, or drops, backs off and reconnects like the main
//!   session; meanwhile its clients' requests are answered with an error
//!   that names the narrower session and its cause.
//! - Its generations start at [`GENERATION_BASE`] plus a block per session,
//!   so they never equal one of the main session's (or another narrower
//!   session's) and the router fails exactly its requests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{narrower_error, Session};
use crate::config::Settings;
use crate::policy::Grant;
use crate::protocol::{ErrorShape, StudioCode, UpstreamFrame};
use crate::rate::{Exceeded, OpenLimiter};
use crate::router::Router;
use crate::upstream::identity::DeviceIdentity;
use crate::upstream::{SessionEnded, SessionOwner, SessionSpec, Upstream, UpstreamHello};

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
pub const GENERATION_BASE: u64 = 1 << 48;
/// Generations each narrower session may use (its reconnects).
const GENERATIONS_PER_SESSION: u64 = 1 << 24;

/// A generation as a person counts it: the main session's as it is, a
/// narrower session's from its own start (its first connection is 0).
pub fn generation_in_session(generation: u64) -> u64 {
    match generation.checked_sub(GENERATION_BASE) {
        Some(offset) => offset % GENERATIONS_PER_SESSION,
        None => generation,
    }
}

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

/// What opening a session needs.
#[derive(Debug)]
pub struct Factory {
    pub settings: Settings,
    /// The broker's device key, loaded once at start.
    pub identity: Option<Arc<DeviceIdentity>>,
    /// The main session's transport: narrower ones follow its target.
    pub main: Upstream,
    pub router: Arc<Router>,
    pub tracker: TaskTracker,
    pub cancel: CancellationToken,
}

#[derive(Debug)]
struct Entry {
    session: Session,
    /// Clients that sent a request on it and are still connected.
    holders: usize,
    /// Counts the times `holders` fell to 0 (a linger timer closes the
    /// session only if no client came and went since it started).
    idled: u64,
    /// Stops its connector.
    cancel: CancellationToken,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[derive(Debug)]
struct State {
    entries: HashMap<Grant, Entry>,
}

/// The narrower sessions, by grant.
#[derive(Debug)]
pub struct Narrower {
    factory: Factory,
    /// How fast local clients may cause narrower sessions to open (the
    /// `[limits] upstream_open_*` rates, per local process and in total).
    opens: OpenLimiter<u64>,
    state: Arc<Mutex<State>>,
    /// Sessions opened since start.
    opened: AtomicU64,
    /// Requests that ran on the main session because of the cap.
    fallbacks: AtomicU64,
    /// Opens refused by the rate limit.
    throttled: AtomicU64,
}

/// What a client's request runs on.
#[derive(Debug)]
pub enum Choice {
    /// The main session (its grant is not narrower, or the cap is reached).
    Main,
    /// This narrower session.
    Narrower(Session),
}

impl Narrower {
    pub fn new(factory: Factory) -> Self {
        Narrower {
            opens: OpenLimiter::from_limits(&factory.settings.limits),
            factory,
            state: Arc::new(Mutex::new(State {
                entries: HashMap::new(),
            })),
            opened: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The session a request of a client holding `grant` runs on, given
    /// the main session's `hello`: the main one when the grant covers the
    /// main session's scopes or `method` must stay there; else the
    /// grant's narrower session, opened if needed, with the client (whose
    /// slot is `holder`, whose process is `peer`) recorded as holding it.
    /// `Err`: too many narrower sessions opened lately.
    pub fn choose(
        &self,
        grant: &Grant,
        main_hello: Option<&UpstreamHello>,
        method: &str,
        holder: &OnceLock<Grant>,
        peer: u64,
    ) -> Result<Choice, ErrorShape> {
        let Some(hello) = main_hello else {
            return Ok(Choice::Main);
        };
        if hello.scopes.iter().all(|s| grant.scopes().contains(s))
            || stays_on_main(method)
            || self.factory.main.on_client_credential()
        {
            return Ok(Choice::Main);
        }
        let mut state = self.lock();
        if !state.entries.contains_key(grant) {
            if state.entries.len() >= MAX_GRANT_SESSIONS {
                // Make room by closing one no client holds, if any.
                let idle = state
                    .entries
                    .iter()
                    .find(|(_, e)| e.holders == 0)
                    .map(|(g, _)| g.clone());
                if let Some(idle) = idle {
                    state.entries.remove(&idle);
                }
            }
            if state.entries.len() >= MAX_GRANT_SESSIONS {
                drop(state);
                let n = self.fallbacks.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    scopes = %grant.scopes().join(","),
                    fallbacks = n,
                    "{MAX_GRANT_SESSIONS} narrower upstream sessions are open already: this request runs on the main session (its answer is tailored to the broker's scopes)"
                );
                return Ok(Choice::Main);
            }
            // tokio's clock: the system's in a broker, a test's own on paused time.
            let now = tokio::time::Instant::now().into_std();
            if let Err(limited) = self.opens.try_acquire(&peer, now) {
                drop(state);
                self.throttled.fetch_add(1, Ordering::Relaxed);
                let limits = &self.factory.settings.limits;
                let (setting, rate) = match limited.exceeded {
                    Exceeded::Peer => ("upstream_open_rate", limits.upstream_open_rate),
                    Exceeded::Total => {
                        ("upstream_open_rate_total", limits.upstream_open_rate_total)
                    }
                };
                return Err(ErrorShape::studio(
                    StudioCode::TooManyRequests,
                    format!(
                        "too many gateway sessions opened lately ([limits] {setting} = {rate}/s): this client's scopes [{}] need a narrower session of their own; try again shortly",
                        grant.scopes().join(",")
                    ),
                )
                .with_retry_after_ms(Some(limited.retry_after_ms())));
            }
            let entry = self.open(grant);
            state.entries.insert(grant.clone(), entry);
        }
        let entry = state
            .entries
            .get_mut(grant)
            .expect("inserted above if absent");
        if holder.set(grant.clone()).is_ok() {
            entry.holders += 1;
        }
        Ok(Choice::Narrower(entry.session.clone()))
    }

    /// Starts a session for `grant` (its connector is tracked, and stops
    /// when the entry is dropped or the broker stops).
    fn open(&self, grant: &Grant) -> Entry {
        self.open_with(grant, None)
    }

    /// [`Narrower::open`], going on with `taken_over` when given.
    fn open_with(&self, grant: &Grant, taken_over: Option<crate::upstream::Takeover>) -> Entry {
        let n = self.opened.fetch_add(1, Ordering::Relaxed);
        let base = GENERATION_BASE + n * GENERATIONS_PER_SESSION;
        let (upstream, mut seed) = self.factory.main.follow(base);
        let scopes = grant.scopes().to_vec();
        match taken_over {
            Some(takeover) => {
                tracing::info!(scopes = %scopes.join(","), "taking a narrower upstream session over from the previous instance");
                let _ = seed.await_takeover().send(Some(takeover));
            }
            None => {
                tracing::info!(scopes = %scopes.join(","), "opening a narrower upstream session")
            }
        }
        let session = Session::narrower(upstream, &scopes);
        let cancel = self.factory.cancel.child_token();
        let owner = Arc::new(NarrowerSession {
            scopes: scopes.clone(),
            router: Arc::clone(&self.factory.router),
        });
        self.factory.tracker.spawn(seed.run(
            &self.factory.settings,
            SessionSpec::narrower(&scopes),
            self.factory.identity.clone(),
            owner,
            cancel.clone(),
        ));
        Entry {
            session,
            holders: 0,
            idled: 0,
            cancel,
        }
    }

    /// Stops every ready narrower session for the broker's next instance
    /// ([`Upstream::hand_over`]): each that stops at a message boundary
    /// within `within`, with its grant. The others end as at any stop.
    pub async fn hand_over(&self, within: Duration) -> Vec<(Grant, crate::upstream::HandedOver)> {
        let sessions: Vec<(Grant, Upstream)> = self
            .lock()
            .entries
            .iter()
            .map(|(grant, e)| (grant.clone(), e.session.upstream.clone()))
            .collect();
        // All at once: each waits on its own connector (up to `within`),
        // and the clients' pause lasts until the last one stopped.
        let stops = sessions.into_iter().map(|(grant, upstream)| async move {
            upstream.hand_over(within).await.map(|h| (grant, h))
        });
        futures_util::future::join_all(stops)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Goes on with `grant`'s session the previous instance handed over
    /// (its connector takes the connection as it is, or connects itself
    /// if it cannot); no client holds it yet, so it lingers as an idle
    /// one does. The generation its requests in flight wait on.
    pub fn take_over(&self, grant: &Grant, takeover: crate::upstream::Takeover) -> u64 {
        let mut entry = self.open_with(grant, Some(takeover));
        let generation = entry.session.upstream.status().generation;
        entry.holders = 1;
        self.lock().entries.insert(grant.clone(), entry);
        // As if its last holder just left: closed after the linger unless
        // a moved client uses it again.
        self.release(grant);
        generation
    }

    /// A moved client (`holder`) held `grant`'s session in the previous
    /// instance: it holds the one taken over here, as from its first
    /// request on it (so the session stays open while the client does).
    pub fn hold(&self, grant: &Grant, holder: &OnceLock<Grant>) {
        let mut state = self.lock();
        if let Some(entry) = state.entries.get_mut(grant) {
            if holder.set(grant.clone()).is_ok() {
                entry.holders += 1;
            }
        }
    }

    /// A client that held `grant`'s session left; [`IDLE_LINGER`] after
    /// the last one, it is closed (the timer is tracked, and ends with the
    /// broker).
    pub fn release(&self, grant: &Grant) {
        let mut state = self.lock();
        let Some(entry) = state.entries.get_mut(grant) else {
            return;
        };
        entry.holders = entry.holders.saturating_sub(1);
        if entry.holders > 0 {
            return;
        }
        entry.idled += 1;
        let idled = entry.idled;
        if tokio::runtime::Handle::try_current().is_err() || self.factory.tracker.is_closed() {
            state.entries.remove(grant);
            return;
        }
        let shared = Arc::clone(&self.state);
        let grant = grant.clone();
        let cancel = self.factory.cancel.clone();
        self.factory.tracker.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(IDLE_LINGER) => {}
            }
            let mut state = lock(&shared);
            if state
                .entries
                .get(&grant)
                .is_some_and(|e| e.holders == 0 && e.idled == idled)
            {
                tracing::info!(scopes = %grant.scopes().join(","), "closing a narrower upstream session: no client has held its scopes for {} s", IDLE_LINGER.as_secs());
                state.entries.remove(&grant);
            }
        });
    }

    /// Sessions open, opened since start, requests run on the main session
    /// because of the cap (for `/metrics`).
    pub fn counts(&self) -> (usize, u64, u64) {
        (
            self.lock().entries.len(),
            self.opened.load(Ordering::Relaxed),
            self.fallbacks.load(Ordering::Relaxed),
        )
    }

    /// For `/v1/state` on the main socket: every session, and the counters.
    pub fn to_json(&self) -> Value {
        self.to_json_where(|_| true)
    }

    /// For `/v1/state`: the sessions whose grant `visible` accepts (on a
    /// further socket, the grants its own clients hold), and the counters.
    pub fn to_json_where(&self, visible: impl Fn(&Grant) -> bool) -> Value {
        let sessions: Vec<Value> = self
            .lock()
            .entries
            .iter()
            .filter(|(grant, _)| visible(grant))
            .map(|(grant, e)| {
                let s = e.session.upstream.status();
                json!({
                    "scopes": grant,
                    "phase": s.phase.as_str(),
                    "session": s.sessions,
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
            "throttled": self.throttled.load(Ordering::Relaxed),
        })
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// A narrower session's owner: its answers complete the pending table; its
/// events are not published (the main session's are the one source).
#[derive(Debug)]
struct NarrowerSession {
    scopes: Vec<String>,
    router: Arc<Router>,
}

impl SessionOwner for NarrowerSession {
    fn ready(&self, _generation: u64, _hello: &Arc<UpstreamHello>, _reconnected: bool) {}

    fn frame(&self, _generation: u64, text: &str) -> Option<Duration> {
        if let Some(UpstreamFrame::Res {
            id,
            ok,
            payload,
            error,
        }) = UpstreamFrame::parse(text)
        {
            self.router.tap.inbound(text);
            if !self.router.complete(&id, ok, payload, error) {
                tracing::debug!(upstream_id = %id, "answer for an unknown or expired request");
            }
        }
        None
    }

    fn early_events_lost(&self, _generation: u64) {}

    fn ended(&self, generation: u64, end: &SessionEnded) {
        self.router
            .fail_generation(generation, &end.unsent, &end.error);
    }

    fn attempt_failed(&self, generation: u64, error: &ErrorShape) {
        let named = narrower_error(
            &self.scopes,
            Some(error),
            error.retry_after_ms,
            crate::upstream::Phase::Backoff,
        );
        self.router.fail_generation_unsent(generation, &named);
    }
}
