//! The owners of the upstream sessions: what a transport's `ready`,
//! `frame` and `ended` mean, decided in one place per kind of session, and
//! the one path every request takes onto a session.
//!
//! - [`main_session`]: the broker's shared session. Its events are the one source
//!   for every local client (sequence gaps, the snapshot, the synthesized
//!   `session.tool`), its answers complete the pending table, and a new
//!   generation re-subscribes what local clients hold. Run ownership lasts
//!   until the run ends or the gateway restarts, not until any reconnect.
//! - [`narrower`]: sessions holding exactly a client's narrower grant, so the
//!   answers the gateway tailors to the caller's scopes are the right ones.
//!   Same connect loop and backoff as the main session; opened on demand,
//!   rate-limited, closed after an idle linger.
//! - [`own`]: the broker's own requests (re-subscribes, releases) and how
//!   they fared.
//! - [`Session::send`]: register in the pending table, encode once, queue on
//!   the session's transport; the same for every requester and session.

pub mod main_session;
pub mod narrower;
pub mod own;

use std::sync::Arc;

use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Settings;
use crate::hub::Hub;
use crate::protocol::frames::encode_req;
use crate::protocol::{ErrorShape, StudioCode};
use crate::router::{Requester, Router, Settle};
use crate::sharing::Sharing;
use crate::upstream::identity::DeviceIdentity;
use crate::upstream::{Phase, Refusal, SessionSpec, Upstream};

pub use narrower::Narrower;
pub use own::{OwnRequests, OwnStats};

/// A handle to one upstream session: its transport, and what differs
/// between the main session and a narrower one, as data.
#[derive(Debug, Clone)]
pub struct Session {
    pub upstream: Upstream,
    /// The scopes a narrower session holds, named in its errors; `None`
    /// for the main session, whose own status says why it is not ready.
    pub narrower_scopes: Option<Arc<[String]>>,
    /// A request sent while the session is opening is queued for it (a
    /// narrower session: its clients are already connected). The main
    /// session takes requests only when ready: its clients wait for it in
    /// their `connect`.
    pub queues_while_opening: bool,
}

/// A request on its way to a session: who asked, under which id, what.
#[derive(Debug, Clone, Copy)]
pub struct Outbound<'a> {
    pub requester: &'a Arc<Requester>,
    pub local_id: &'a str,
    pub method: &'a str,
    pub params: Option<&'a RawValue>,
}

/// What is left to do for a request once the caller let go of its locks:
/// answer a failure (answering runs the request's settle, which may take
/// them), or write what was queued in order under them.
#[must_use = "a failed request must be answered"]
#[derive(Debug, Default)]
pub struct Deferred {
    failed: Option<(String, ErrorShape)>,
    /// Queued without being written ([`Session::send_in_order`]): written
    /// now, when the socket is free, outside the caller's locks.
    flush: Option<Upstream>,
}

impl Deferred {
    /// Answers the failure, if there was one, and writes what was queued.
    pub fn answer(self, router: &Router) {
        if let Some((upstream_id, error)) = self.failed {
            router.fail(&upstream_id, &error);
        }
        if let Some(upstream) = self.flush {
            upstream.flush();
        }
    }

    fn failed(upstream_id: String, error: ErrorShape) -> Self {
        Deferred {
            failed: Some((upstream_id, error)),
            flush: None,
        }
    }
}

impl Session {
    /// The broker's shared session on `upstream`.
    pub fn main(upstream: Upstream) -> Self {
        Session {
            upstream,
            narrower_scopes: None,
            queues_while_opening: false,
        }
    }

    /// A narrower session holding `scopes` on `upstream`.
    pub fn narrower(upstream: Upstream, scopes: &[String]) -> Self {
        Session {
            upstream,
            narrower_scopes: Some(scopes.into()),
            queues_while_opening: true,
        }
    }

    /// The generation a request sent now goes out on, if any.
    fn generation(&self) -> Option<u64> {
        if self.queues_while_opening {
            self.upstream.next_generation()
        } else {
            self.upstream.ready_generation()
        }
    }

    /// Why a request cannot be sent now.
    pub fn not_ready_error(&self) -> ErrorShape {
        let status = self.upstream.status();
        let Some(scopes) = &self.narrower_scopes else {
            return status.not_ready_error();
        };
        narrower_error(
            scopes,
            status.last_error.as_ref(),
            status.retry_after_ms(),
            status.phase,
        )
    }

    /// The one send path: registers the request (its deadline, the
    /// requester's in-flight slot, `settle`), encodes it once and queues it
    /// on this session without waiting. `Err` is a refusal before anything
    /// was registered (`settle` dropped unrun); a failure after that is
    /// returned as [`Deferred`].
    ///
    /// Exactly once: a request the session's queue refuses was never
    /// queued, so it is answered "not sent" here; one it takes is written,
    /// or withdrawn and answered "not sent" by whoever closes its
    /// generation or expires it, never both (see [`crate::upstream`]).
    pub fn send(
        &self,
        router: &Router,
        request: Outbound<'_>,
        settle: Option<Settle>,
    ) -> Result<Deferred, ErrorShape> {
        self.send_with(router, request, settle, true)
    }

    /// [`Session::send`] for a request queued under a lock that orders it
    /// among others (subscription changes): it is queued now, keeping its
    /// place, but written only by [`Deferred::answer`], after the caller
    /// let go of that lock. (A write may also write other clients' queued
    /// requests; the one upstream reader needs the subscriptions lock to
    /// settle an answer, so fan-out must not wait behind it.)
    pub fn send_in_order(
        &self,
        router: &Router,
        request: Outbound<'_>,
        settle: Option<Settle>,
    ) -> Result<Deferred, ErrorShape> {
        self.send_with(router, request, settle, false)
    }

    fn send_with(
        &self,
        router: &Router,
        request: Outbound<'_>,
        settle: Option<Settle>,
        write_now: bool,
    ) -> Result<Deferred, ErrorShape> {
        let Some(generation) = self.generation() else {
            // A session in backoff tries sooner (a narrower one ignores it).
            let _ = self.upstream.nudge();
            router.metrics.record_refused(request.method);
            return Err(self.not_ready_error().with_sent(false));
        };
        let upstream_id = router.register(
            request.requester,
            request.local_id,
            request.method,
            generation,
            settle,
            Some(self.upstream.withdrawer()),
        )?;
        let text = encode_req(&upstream_id, request.method, request.params);
        router.tap.outbound(&text);
        let out = crate::upstream::Outbound {
            generation,
            id: upstream_id,
            text,
        };
        let queued = if write_now {
            self.upstream.try_send(out)
        } else {
            self.upstream.try_queue(out)
        };
        match queued {
            Ok(()) if write_now => Ok(Deferred::default()),
            Ok(()) => Ok(Deferred {
                failed: None,
                flush: Some(self.upstream.clone()),
            }),
            Err((Refusal::Full, out)) => Ok(Deferred::failed(
                out.id,
                crate::upstream::queue_full_error().with_sent(false),
            )),
            Err((Refusal::Closed, out)) => Ok(Deferred::failed(
                out.id,
                self.not_ready_error().with_sent(false),
            )),
        }
    }
}

/// The error a request on a narrower session gets while that session is
/// not open: it names the session and its cause, and says the broker
/// retries by itself (the host's token is not the problem when the main
/// session is up).
pub(crate) fn narrower_error(
    scopes: &[String],
    cause: Option<&ErrorShape>,
    retry_after_ms: Option<u64>,
    phase: Phase,
) -> ErrorShape {
    let what = format!(
        "the narrower gateway session for this client's scopes [{}]",
        scopes.join(",")
    );
    let message = match (cause, phase) {
        (_, Phase::Stopped) => format!("{what} is closed"),
        (Some(e), _) => format!(
            "{what} is not open ({}: {}); the broker retries it by itself",
            e.code, e.message
        ),
        (None, _) => format!("{what} is not open yet; the broker retries it by itself"),
    };
    let mut error = ErrorShape::studio(StudioCode::UpstreamClosed, message);
    if let Some(e) = cause {
        error = error.with_details(serde_json::json!({"cause": e.code, "session": "narrower"}));
    }
    error.with_retry_after_ms(retry_after_ms.or(Some(1000)))
}

/// Every upstream session and its owner.
#[derive(Debug)]
pub struct Sessions {
    /// The shared session.
    pub main: Session,
    /// What the main session's owner keeps (the generation it resubscribed, counters).
    pub main_owner: Arc<main_session::MainSession>,
    /// Sessions for clients holding fewer scopes.
    pub narrower: Narrower,
    /// The broker's own requests.
    pub own: Arc<OwnRequests>,
    /// Started for a handover: the main connector waits for the word
    /// ([`Sessions::take_over`]) before its first attempt.
    takeover:
        std::sync::Mutex<Option<tokio::sync::oneshot::Sender<Option<crate::upstream::Takeover>>>>,
}

impl Sessions {
    /// Starts the main session's connector (tracked by `tracker`, stopped
    /// at `cancel`) and readies the narrower sessions. The device identity
    /// is loaded here, once, before any connector runs: no request ever
    /// waits on the state directory.
    pub fn start(
        settings: &Settings,
        hub: &Arc<Hub>,
        router: &Arc<Router>,
        sharing: &Arc<Sharing>,
        tracker: &TaskTracker,
        cancel: &CancellationToken,
        handed_over: bool,
    ) -> Sessions {
        let identity =
            DeviceIdentity::load_configured(settings.upstream.device_identity.as_deref())
                .map(Arc::new);
        let (upstream, mut seed) = Upstream::new(settings);
        let takeover = handed_over.then(|| seed.await_takeover());
        let parts = Parts {
            settings,
            hub,
            router,
            sharing,
            tracker,
            cancel,
        };
        let sessions = Self::assemble(&parts, upstream, identity.clone());
        *sessions.takeover.lock().unwrap_or_else(|p| p.into_inner()) = takeover;
        tracker.spawn(seed.run(
            settings,
            SessionSpec::main(),
            identity,
            Arc::clone(&sessions.main_owner) as Arc<dyn crate::upstream::SessionOwner>,
            cancel.clone(),
        ));
        tracker.spawn(Arc::clone(&sessions.own).drain_answers(cancel.clone()));
        sessions
    }

    /// The owners around the main session's transport `upstream`.
    fn assemble(
        p: &Parts<'_>,
        upstream: Upstream,
        identity: Option<Arc<DeviceIdentity>>,
    ) -> Sessions {
        let main = Session::main(upstream);
        let own = Arc::new(OwnRequests::new(p.hub, p.router));
        let main_owner = Arc::new(main_session::MainSession::new(
            main.clone(),
            Arc::clone(p.hub),
            Arc::clone(p.router),
            Arc::clone(p.sharing),
            Arc::clone(&own),
            identity.is_some(),
        ));
        let narrower = Narrower::new(narrower::Factory {
            settings: p.settings.clone(),
            identity,
            main: main.upstream.clone(),
            router: Arc::clone(p.router),
            tracker: p.tracker.clone(),
            cancel: p.cancel.clone(),
        });
        Sessions {
            main,
            main_owner,
            narrower,
            own,
            takeover: std::sync::Mutex::default(),
        }
    }

    /// Started for a handover: the main connector goes on with the gateway
    /// session the previous instance handed over, or connects itself when
    /// there is none (`None`). Once; later calls do nothing.
    pub fn take_over(&self, takeover: Option<crate::upstream::Takeover>) {
        if let Some(word) = self
            .takeover
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = word.send(takeover);
        }
    }

    /// Sessions around a main transport the test drives itself (no
    /// connector runs).
    #[cfg(test)]
    pub(crate) fn for_tests(
        settings: &Settings,
        hub: &Arc<Hub>,
        router: &Arc<Router>,
        upstream: Upstream,
    ) -> Sessions {
        let parts = Parts {
            settings,
            hub,
            router,
            sharing: &Arc::new(Sharing::new()),
            tracker: &TaskTracker::new(),
            cancel: &CancellationToken::new(),
        };
        Self::assemble(&parts, upstream, None)
    }
}

/// What the sessions are built from.
struct Parts<'a> {
    settings: &'a Settings,
    hub: &'a Arc<Hub>,
    router: &'a Arc<Router>,
    sharing: &'a Arc<Sharing>,
    tracker: &'a TaskTracker,
    cancel: &'a CancellationToken,
}
