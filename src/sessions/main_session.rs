//! The main session's owner: what each of its transport's reports means
//! for the broker's clients.
//!
//! - `ready`: the gateway's snapshot and session defaults are taken; on a
//!   reconnect clients see a gap (what happened meanwhile is unknown) and a
//!   `clawmux.upstream` event saying why; every subscription local clients
//!   hold is sent again, first, in the one ordered place.
//! - `frame`: events are published to their audience (gaps in the
//!   gateway's `seq` become gaps for clients; a tool event of a run a local
//!   client started is also delivered as `session.tool` to the other local
//!   subscribers, as the gateway would have); answers complete the pending
//!   table.
//! - `ended`: requests of the lost generation fail; run ownership is
//!   dropped only when the gateway restarted (it forgot the runs too),
//!   since a reconnect leaves them running.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::{OwnRequests, Session};
use crate::hub::Hub;
use crate::protocol::{ErrorShape, EventSeq, UpstreamFrame};
use crate::router::{Router, Settle};
use crate::sharing::{Audience, Sharing};
use crate::upstream::{SessionEnded, SessionOwner, UpstreamHello};

/// The main session's owner.
#[derive(Debug)]
pub struct MainSession {
    session: Session,
    hub: Arc<Hub>,
    router: Arc<Router>,
    sharing: Arc<Sharing>,
    own: Arc<OwnRequests>,
    /// The last `seq` of the current session's events.
    last_seq: Mutex<Option<u64>>,
    /// The gateway sent its `shutdown` event on the current session.
    shutdown_seen: AtomicBool,
    /// Gateway events whose `seq` was not a non-negative integer.
    invalid_seqs: AtomicU64,
    /// Whether the broker has a device identity (for the lost-scope advice).
    has_device: AtomicBool,
    /// The current session's gateway version (for the event at its end).
    server_version: Mutex<String>,
    /// Clients were taken over from the previous instance: its session
    /// ended for them, so this one's first is a reconnect to them (unless
    /// it is that very session, handed over: [`SessionOwner::taken_over`]).
    took_over: AtomicBool,
    /// What the previous instance knew of the gateway session it handed
    /// over, for [`SessionOwner::taken_over`].
    continued: Mutex<Option<Continued>>,
}

/// What the main session's owner knew of a gateway session, passed to the
/// next instance with the connection (design §11).
#[derive(Debug, Clone, Default)]
pub struct Continued {
    /// The gateway's last event `seq` on the connection.
    pub last_seq: Option<u64>,
    /// The subscriptions the gateway confirmed on it.
    pub confirmed: Vec<crate::sharing::SubKey>,
}

impl MainSession {
    pub fn new(
        session: Session,
        hub: Arc<Hub>,
        router: Arc<Router>,
        sharing: Arc<Sharing>,
        own: Arc<OwnRequests>,
        has_device: bool,
    ) -> Self {
        MainSession {
            session,
            hub,
            router,
            sharing,
            own,
            last_seq: Mutex::new(None),
            shutdown_seen: AtomicBool::new(false),
            invalid_seqs: AtomicU64::new(0),
            has_device: AtomicBool::new(has_device),
            server_version: Mutex::default(),
            took_over: AtomicBool::new(false),
            continued: Mutex::default(),
        }
    }

    /// What this owner knows of the current session, for the next
    /// instance it is handed over to.
    pub fn continued(&self) -> Continued {
        Continued {
            last_seq: *self.last_seq.lock().unwrap_or_else(|p| p.into_inner()),
            confirmed: self.sharing.subscriptions.lock().confirmed_keys(),
        }
    }

    /// The session the previous instance handed over will go on here
    /// (before the connector takes it: see [`SessionOwner::taken_over`]).
    pub fn will_continue(&self, continued: Continued) {
        *self.continued.lock().unwrap_or_else(|p| p.into_inner()) = Some(continued);
    }

    /// Gateway events whose `seq` was not a non-negative integer (delivered all the same).
    pub fn invalid_seqs(&self) -> u64 {
        self.invalid_seqs.load(Ordering::Relaxed)
    }

    /// Takes what a new session tells about the gateway.
    fn take_over(&self, hello: &UpstreamHello) {
        let snapshot = hello.payload.get("snapshot").unwrap_or(&Value::Null);
        self.sharing
            .set_session_defaults(crate::sharing::SessionDefaults::from_snapshot(snapshot));
        self.hub.set_upstream_max_buffered(
            hello
                .payload
                .pointer("/policy/maxBufferedBytes")
                .and_then(Value::as_u64),
        );
        self.hub.reset_snapshot(snapshot.clone());
    }

    /// A session begins (`last_seq`: the gateway's last event `seq` on it,
    /// when it goes on from the previous instance).
    fn begin(&self, hello: &UpstreamHello, last_seq: Option<u64>) {
        *self.last_seq.lock().unwrap_or_else(|p| p.into_inner()) = last_seq;
        self.shutdown_seen.store(false, Ordering::Relaxed);
        hello.server_version.clone_into(
            &mut self
                .server_version
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        self.take_over(hello);
    }

    /// Clients were taken over from the previous instance (a handover):
    /// the first session is a reconnect to them (a gap, `clawmux.upstream
    /// {phase: ready, reason: reconnected}`, their subscriptions sent
    /// again), unless it is the very session they were on
    /// ([`SessionOwner::taken_over`]). Called before the connector may open a
    /// session: a handed-over start holds it until the clients are taken
    /// over ([`crate::sessions::Sessions::take_over`]).
    pub fn clients_taken_over(&self) {
        self.took_over.store(true, Ordering::SeqCst);
    }

    /// A new session: every held subscription is sent again, before any
    /// client's change can reach it (all under the subscription lock).
    fn resubscribe(&self) {
        let mut st = self.sharing.subscriptions.lock();
        let again = st.resubscribe();
        self.send_changes(st, again, Vec::new());
    }

    /// Sends `subscribe` (each key with its generation) and `release`
    /// upstream in the one ordered place, then lets go of the lock.
    fn send_changes(
        &self,
        mut st: std::sync::MutexGuard<'_, crate::sharing::subscriptions::SubscriptionState>,
        subscribe: Vec<(crate::sharing::SubKey, u64)>,
        release: Vec<crate::sharing::SubKey>,
    ) {
        let mut deferred = Vec::new();
        for (key, gen) in subscribe {
            let sharing = Arc::clone(&self.sharing);
            let settle_key = key.clone();
            let settle: Settle = Box::new(move |ok| {
                sharing
                    .subscriptions
                    .lock()
                    .settle_subscribe(&settle_key, None, gen, ok);
            });
            deferred.push(self.own.subscription_change(
                &mut st,
                &self.session,
                "resubscribe",
                &key,
                true,
                Some(settle),
            ));
        }
        for key in release {
            deferred.push(self.own.subscription_change(
                &mut st,
                &self.session,
                "release",
                &key,
                false,
                None,
            ));
        }
        drop(st);
        for d in deferred {
            d.answer(&self.router);
        }
    }

    /// Follows the gateway's `seq`: a jump is a gap for every client.
    fn follow_seq(&self, name: &str, seq: EventSeq) {
        match seq {
            EventSeq::Valid(seq) => {
                let mut last = self.last_seq.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(last) = *last {
                    if seq > last.saturating_add(1) {
                        tracing::info!(expected = last + 1, received = seq, "upstream seq gap");
                        self.hub.gap();
                    }
                }
                *last = Some(seq);
            }
            EventSeq::Invalid => {
                // Delivered all the same (clients get the broker's own seq);
                // counted and logged, never lost silently.
                let n = self.invalid_seqs.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(event = %name, invalid_seqs = n, "the gateway sent an event whose seq is not a non-negative integer; delivering it");
            }
            EventSeq::Absent => {}
        }
    }

    fn on_event(
        &self,
        text: &str,
        name: &str,
        payload: Option<&RawValue>,
        state_version: Option<&RawValue>,
    ) -> Option<Duration> {
        let restart = if name == "shutdown" {
            self.shutdown_seen.store(true, Ordering::Relaxed);
            restart_hint(payload)
        } else {
            None
        };
        // Parsed once, for who gets it and for the hub's projection.
        let projected = crate::hub::Projected::parse(name, payload);
        let (audience, session_tool) =
            self.sharing
                .audience_with_echo(name, payload, projected.value());
        if matches!(audience, Audience::Only(_)) {
            self.router.tap.inbound(text);
        }
        self.hub
            .publish_parsed(name, payload, state_version, &audience, projected);
        if let Some(Audience::Only(ids)) = session_tool {
            self.hub.deliver_copy("session.tool", payload, &ids);
        }
        restart
    }
}

/// `restartExpectedMs` of a `shutdown` event.
fn restart_hint(payload: Option<&RawValue>) -> Option<Duration> {
    #[derive(serde::Deserialize)]
    struct Shutdown {
        #[serde(rename = "restartExpectedMs")]
        restart_expected_ms: Option<u64>,
    }
    payload
        .and_then(|p| serde_json::from_str::<Shutdown>(p.get()).ok())
        .and_then(|s| s.restart_expected_ms)
        .map(Duration::from_millis)
}

impl SessionOwner for MainSession {
    fn ready(&self, _generation: u64, hello: &Arc<UpstreamHello>, reconnected: bool) {
        let reconnected = reconnected || self.took_over.swap(false, Ordering::SeqCst);
        self.begin(hello, None);
        if !hello.lost_scopes.is_empty() {
            crate::upstream::warn_lost_scopes(hello, self.has_device.load(Ordering::Relaxed));
        }
        if reconnected {
            // Everything that happened while we were away is unknown to the
            // clients: a gap makes them resync, the event says why.
            self.hub.gap();
            let mut event = json!({"phase": "ready", "serverVersion": hello.server_version, "reason": "reconnected"});
            if !hello.lost_scopes.is_empty() {
                event["lostScopes"] = json!(hello.lost_scopes);
            }
            // The gateway mints these per connection: the ones connected
            // clients got in their hello-ok died with the old session.
            if let Some(urls) = hello.payload.get("pluginSurfaceUrls") {
                event["pluginSurfaceUrls"] = urls.clone();
            }
            self.hub.publish_local("clawmux.upstream", &event);
        }
        // Connection-scoped subscriptions died with the old session.
        self.resubscribe();
    }

    fn taken_over(&self, _generation: u64, hello: &Arc<UpstreamHello>) {
        // The very session the clients were on: no gap, no event; its `seq`
        // and what the gateway holds for the connection go on.
        self.took_over.store(false, Ordering::SeqCst);
        let continued = self
            .continued
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        self.begin(hello, continued.last_seq);
        // Subscriptions the gateway holds stay; a held one it does not is
        // sent; one it holds that no moved client does is released.
        let mut st = self.sharing.subscriptions.lock();
        let (subscribe, release) = st.continue_session(&continued.confirmed);
        self.send_changes(st, subscribe, release);
    }

    fn frame(&self, _generation: u64, text: &str) -> Option<Duration> {
        match UpstreamFrame::parse(text) {
            Some(UpstreamFrame::Event {
                name,
                payload,
                seq,
                state_version,
            }) => {
                self.follow_seq(&name, seq);
                self.on_event(text, &name, payload, state_version)
            }
            Some(UpstreamFrame::Res {
                id,
                ok,
                payload,
                error,
            }) => {
                self.router.tap.inbound(text);
                if !self.router.complete(&id, ok, payload, error) {
                    tracing::debug!(upstream_id = %id, "answer for an unknown or expired request");
                }
                None
            }
            None => {
                tracing::debug!("ignoring a malformed frame from the gateway");
                None
            }
        }
    }

    fn early_events_lost(&self, _generation: u64) {
        self.hub.gap();
    }

    fn ended(&self, generation: u64, end: &SessionEnded) {
        let failed = self
            .router
            .fail_generation(generation, &end.unsent, &end.error);
        if failed > 0 {
            tracing::info!(
                generation,
                failed,
                "failed pending requests of the lost session"
            );
        }
        // The gateway forgets its runs when it restarts; a connection that
        // merely dropped leaves them running, and their owners keep them.
        let restarted = self.shutdown_seen.load(Ordering::Relaxed)
            || end.restart_hint.is_some()
            || end.gateway_close_code == Some(1012);
        if restarted {
            self.sharing.runs.clear();
        }
        if !end.cancelled {
            let server_version = self
                .server_version
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            self.hub.publish_local(
                "clawmux.upstream",
                &json!({"phase": "backoff", "serverVersion": server_version, "reason": end.reason}),
            );
        }
    }

    fn attempt_failed(&self, generation: u64, error: &ErrorShape) {
        // Only a ready main session takes requests; nothing can be waiting
        // on one that never opened, but the rule is the same for all.
        self.router.fail_generation_unsent(generation, error);
    }
}
