//! The cheap [`Upstream`] handle the rest of the broker holds (its phase,
//! its request queue, its target), and the connector seed it comes with.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

pub use super::outlet::Refused as Refusal;
use super::{
    backoff::NUDGE_SETTLE, connector, identity, outlet, tls, ClientCredential, Outbound,
    PeerCertificate, Phase, SessionOwner, SessionSpec, Status, Target, UpstreamHello,
    UPSTREAM_QUEUE_BYTES, UPSTREAM_QUEUE_FRAMES,
};
use crate::config::Settings;
use crate::protocol::{ErrorShape, StudioCode};

/// The connector, built but not started: the owner of its sessions is
/// usually built around the [`Upstream`] handle, so it is given at start.
pub struct ConnectorSeed {
    handover: mpsc::Receiver<super::HandoverRequest>,
    takeover: Option<tokio::sync::oneshot::Receiver<Option<super::Takeover>>>,
    nudge: Arc<tokio::sync::Notify>,
    status: watch::Sender<Status>,
    outlet: Arc<outlet::Outlet>,
    target: watch::Receiver<Target>,
    offers: mpsc::Receiver<ClientCredential>,
    peer_certificate: PeerCertificate,
}

impl ConnectorSeed {
    /// For unit tests of what sits on top of the handle: marks a session of
    /// `generation` ready (no connector runs) and hands out the request queue.
    #[cfg(test)]
    pub(crate) fn fake_ready(self, generation: u64) -> (watch::Sender<Status>, FakeQueue) {
        self.status.send_modify(|s| {
            s.phase = Phase::Ready;
            s.generation = generation;
        });
        (self.status, FakeQueue(self.outlet))
    }

    /// The connector will go on with a session the previous instance handed
    /// over (design §11), or connect itself when told `None`: it waits for
    /// the word before its first attempt.
    pub fn await_takeover(&mut self) -> tokio::sync::oneshot::Sender<Option<super::Takeover>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.takeover = Some(rx);
        tx
    }

    /// The connector's loop, to be spawned (and tracked) by the caller: it
    /// connects as `spec` says, with the broker's device `identity` (loaded
    /// once, at start), reports to `owner`, and stops at `cancel`.
    pub fn run(
        self,
        settings: &Settings,
        spec: SessionSpec,
        identity: Option<Arc<identity::DeviceIdentity>>,
        owner: Arc<dyn SessionOwner>,
        cancel: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let connector = connector::Connector::new(
            settings,
            spec,
            identity,
            owner,
            connector::Channels {
                handover: self.handover,
                takeover: self.takeover,
                nudge: self.nudge,
                status: self.status,
                outlet: self.outlet,
                target: self.target,
                offers: self.offers,
                peer_certificate: self.peer_certificate,
            },
            cancel,
        );
        connector.run()
    }
}

/// The handle to the upstream session.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Asks the connector to hand its session over ([`Upstream::hand_over`]).
    handover: mpsc::Sender<super::HandoverRequest>,
    /// Asks the connector to try now instead of at the end of its backoff
    /// (a local client is waiting); rate-limited by the connector.
    nudge: Arc<tokio::sync::Notify>,
    status: watch::Receiver<Status>,
    outlet: Arc<outlet::Outlet>,
    target: Arc<watch::Sender<Target>>,
    offers: mpsc::Sender<ClientCredential>,
    peer_certificate: PeerCertificate,
}

impl Upstream {
    /// The handle, and the connector to start once its owner exists.
    pub fn new(settings: &Settings) -> (Upstream, ConnectorSeed) {
        Self::with_target(Target::from_settings(settings), 0)
    }

    /// A handle whose sessions are numbered from `generation_base + 1`, on
    /// `target` (a narrower session: its own numbers, the main session's
    /// current target).
    pub fn with_target(target: Target, generation_base: u64) -> (Upstream, ConnectorSeed) {
        let mut initial = Status::initial();
        // The first attempt's generation.
        initial.generation = generation_base + 1;
        let (status_tx, status_rx) = watch::channel(initial);
        let outlet = Arc::new(outlet::Outlet::new(
            UPSTREAM_QUEUE_FRAMES,
            UPSTREAM_QUEUE_BYTES,
        ));
        let (target_tx, target_rx) = watch::channel(target);
        let (offer_tx, offer_rx) = mpsc::channel(16);
        let nudge = Arc::new(tokio::sync::Notify::new());
        let peer_certificate = PeerCertificate::default();
        let (handover_tx, handover_rx) = mpsc::channel(1);
        (
            Upstream {
                handover: handover_tx,
                nudge: Arc::clone(&nudge),
                status: status_rx,
                outlet: Arc::clone(&outlet),
                target: Arc::new(target_tx),
                offers: offer_tx,
                peer_certificate: Arc::clone(&peer_certificate),
            },
            ConnectorSeed {
                handover: handover_rx,
                takeover: None,
                nudge,
                status: status_tx,
                outlet,
                target: target_rx,
                offers: offer_rx,
                peer_certificate,
            },
        )
    }

    /// A handle for another session on the same target as this one (a
    /// narrower session follows the main session's settings, reloads
    /// included), its sessions numbered from `generation_base + 1`.
    pub fn follow(&self, generation_base: u64) -> (Upstream, ConnectorSeed) {
        let (mut upstream, mut seed) = Self::with_target(self.target(), generation_base);
        seed.target = self.target.subscribe();
        upstream.target = Arc::clone(&self.target);
        (upstream, seed)
    }

    /// Stops the ready session for the broker's next instance (design
    /// §11): its reader stops at a message boundary, what was queued and
    /// can be written now is written, the rest withdrawn ([`HandedOver`]'s
    /// `unsent`), and the socket is left as it is for the next instance;
    /// the connector then stops. `None`: no session is ready, or it did
    /// not stop within `within` (the session goes on, and ends as at any
    /// stop), or its socket cannot move (`wss://`, a message too large to
    /// carry): the session has then ended, every request in flight on it
    /// answered, before `None` comes.
    ///
    /// [`HandedOver`]: super::HandedOver
    pub async fn hand_over(&self, within: std::time::Duration) -> Option<super::HandedOver> {
        if self.status.borrow().phase != Phase::Ready {
            return None;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.handover.try_send(tx).ok()?;
        tokio::time::timeout(within, rx).await.ok()?.ok()?
    }

    /// Points the connector at new settings (SIGHUP). Returns whether
    /// anything changed; if so, the session is re-opened with them.
    pub fn retarget(&self, target: Target) -> bool {
        self.target.send_if_modified(|current| {
            let changed = current.differs(&target);
            if changed {
                *current = target;
            } else {
                current.discovery = target.discovery;
            }
            changed
        })
    }

    /// Like [`Upstream::wait_ready`], but when the host has no credential
    /// and this client brought its own `auth`, offers it to open the shared
    /// session first (design §2).
    pub async fn wait_ready_with_auth(
        &self,
        deadline: Instant,
        auth: Option<&Value>,
    ) -> Result<Arc<UpstreamHello>, ErrorShape> {
        let Some(credential) = auth.and_then(ClientCredential::from_auth) else {
            return self.wait_ready(deadline).await;
        };
        // Until the connector has decided whether the host has a credential
        // (its first attempt may still be under way), watch: offer this one
        // as soon as it asks for one.
        let mut rx = self.status.clone();
        loop {
            let needs_credential = {
                let s = rx.borrow_and_update();
                match s.phase {
                    Phase::Connecting | Phase::Handshaking if !s.had_session => None,
                    Phase::Rejected if s.awaiting_credential => Some(true),
                    _ => Some(false),
                }
            };
            match needs_credential {
                Some(true) => {
                    if self.offers.try_send(credential).is_ok() {
                        // Wait until the connector picked it up (its phase moves on).
                        let _ = tokio::time::timeout_at(deadline.into(), rx.changed()).await;
                    }
                    break;
                }
                Some(false) => break,
                None => {
                    if tokio::time::timeout_at(deadline.into(), rx.changed())
                        .await
                        .map_or(true, |changed| changed.is_err())
                    {
                        break;
                    }
                }
            }
        }
        self.wait_ready(deadline).await
    }

    /// Waits for the outcome of the first connection attempt: the session,
    /// or the error of that one attempt (for `clawmux doctor`).
    pub async fn wait_first_attempt(
        &self,
        deadline: Instant,
    ) -> Result<Arc<UpstreamHello>, ErrorShape> {
        let mut rx = self.status.clone();
        loop {
            {
                let s = rx.borrow_and_update();
                match (s.phase, &s.hello, &s.last_error) {
                    (Phase::Ready, Some(h), _) => return Ok(Arc::clone(h)),
                    (Phase::Backoff | Phase::Rejected | Phase::Stopped, _, Some(e)) => {
                        return Err(e.clone())
                    }
                    _ => {}
                }
            }
            if tokio::time::timeout_at(deadline.into(), rx.changed())
                .await
                .is_err()
            {
                return Err(self.status().not_ready_error());
            }
        }
    }

    /// The ready session's `hello-ok`, if one is ready.
    pub fn hello(&self) -> Option<Arc<UpstreamHello>> {
        self.status.borrow().hello.clone()
    }

    /// The settings the connector is pointed at now (after any reload).
    pub fn target(&self) -> Target {
        self.target.borrow().clone()
    }

    /// The gateway URL the connector is pointed at now (after any reload).
    pub fn target_url(&self) -> String {
        self.target.borrow().url.clone()
    }

    /// Settings files discovery passed over because they point at this
    /// broker, in words.
    pub fn target_discovery(&self) -> Vec<String> {
        self.target.borrow().discovery.clone()
    }

    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// The certificate a `wss://` gateway showed on the last TLS handshake,
    /// whether or not it was accepted (for `clawmux doctor`).
    pub fn peer_certificate(&self) -> Option<tls::CertificateInfo> {
        self.peer_certificate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Follows the session's status as it changes (phase, epoch, last error).
    pub fn subscribe(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    pub fn phase(&self) -> Phase {
        self.status.borrow().phase
    }

    /// Whether the session runs on a credential a local client supplied
    /// (read per request: no copy of the whole status).
    pub fn on_client_credential(&self) -> bool {
        self.status.borrow().on_client_credential
    }

    /// A local client wants the session: during backoff (not after a
    /// rejection) the connector tries again now, at most every
    /// [`NUDGE_MIN_INTERVAL`], instead of waiting out a long backoff while
    /// the gateway may be back.
    pub fn nudge(&self) -> bool {
        let backoff = self.status.borrow().phase == Phase::Backoff;
        if backoff {
            self.nudge.notify_one();
        }
        backoff
    }

    /// The generation of the ready session, if one is ready.
    pub fn ready_generation(&self) -> Option<u64> {
        let s = self.status.borrow();
        (s.phase == Phase::Ready).then_some(s.generation)
    }

    /// The generation a request sent now would go out on: the ready
    /// session's, or, while an attempt is under way, the attempt's
    /// (requests queued for it are written once it is ready, or withdrawn
    /// and answered "not sent" if it fails: never both).
    pub fn next_generation(&self) -> Option<u64> {
        let s = self.status.borrow();
        match s.phase {
            Phase::Ready | Phase::Connecting | Phase::Handshaking => Some(s.generation),
            _ => None,
        }
    }

    /// Waits until the session is ready, or fails with the reason it is not.
    ///
    /// Fails early, without waiting for `deadline`, when waiting cannot help:
    /// the settings are rejected, or the next attempt is scheduled after the
    /// deadline. A local `connect` uses this (design §2, issue: connect wait).
    pub async fn wait_ready(&self, deadline: Instant) -> Result<Arc<UpstreamHello>, ErrorShape> {
        let mut rx = self.status.clone();
        rx.borrow_and_update();
        if self.nudge() {
            // Let the connector move its next attempt up before judging
            // whether waiting can help.
            let _ = tokio::time::timeout(NUDGE_SETTLE, rx.changed()).await;
        }
        loop {
            {
                let s = rx.borrow_and_update();
                match s.phase {
                    Phase::Ready => {
                        if let Some(h) = &s.hello {
                            return Ok(Arc::clone(h));
                        }
                    }
                    Phase::Rejected | Phase::Stopped => return Err(s.not_ready_error()),
                    Phase::Backoff if s.retry_at.is_some_and(|at| at > deadline) => {
                        return Err(s.not_ready_error())
                    }
                    _ => {}
                }
            }
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return Err(ErrorShape::studio(StudioCode::UpstreamClosed, "the broker is shutting down"));
                    }
                }
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let s = rx.borrow();
                    return Err(match &s.last_error {
                        Some(_) => s.not_ready_error(),
                        None => ErrorShape::studio(
                            StudioCode::UpstreamTimeout,
                            "the gateway did not complete its handshake in time; is it running? (openclaw gateway)",
                        ),
                    });
                }
            }
        }
    }

    /// Queues a request for the session of `generation`, never waiting, and
    /// writes it on the caller's thread when the socket is free and has room
    /// ([`outlet`]). A refusal means it was never queued (so never written):
    /// [`Refusal::Full`] (answer `studio.too_many_requests`, retryable) or
    /// [`Refusal::Closed`] (its session ended or never opened).
    pub fn try_send(&self, out: Outbound) -> Result<(), (Refusal, Outbound)> {
        self.outlet.push(out)
    }

    /// Queues a request like [`Upstream::try_send`] but never writes it
    /// here: [`Upstream::flush`] does, later, outside the caller's locks.
    pub fn try_queue(&self, out: Outbound) -> Result<(), (Refusal, Outbound)> {
        self.outlet.queue(out)
    }

    /// Writes what is queued if the socket is free (see [`Upstream::try_queue`]).
    pub fn flush(&self) {
        self.outlet.flush();
    }

    /// Takes request `id` out of this session's queue if it was not
    /// written yet: true means it never will be.
    pub fn withdraw(&self, id: &str) -> bool {
        self.outlet.withdraw(id)
    }

    /// The queue as the pending table sees it (to withdraw a request that
    /// expires unwritten); a pointer copy, no allocation.
    pub fn withdrawer(&self) -> Arc<dyn crate::router::Withdraw> {
        Arc::clone(&self.outlet) as Arc<dyn crate::router::Withdraw>
    }
}

/// The answer to a request the queue refused as [`Refusal::Full`].
pub fn queue_full_error() -> ErrorShape {
    ErrorShape::studio(
        StudioCode::TooManyRequests,
        format!(
            "too many requests are already waiting to be written to the gateway (at most {UPSTREAM_QUEUE_FRAMES}, {} MiB; it is not reading fast enough); try again shortly",
            UPSTREAM_QUEUE_BYTES >> 20
        ),
    )
    .with_retry_after_ms(Some(QUEUE_FULL_RETRY_MS))
}

/// What a test sees of the request queue of a session no connector runs.
#[cfg(test)]
pub(crate) struct FakeQueue(Arc<outlet::Outlet>);

#[cfg(test)]
impl FakeQueue {
    /// The next request queued, if any.
    pub fn try_recv(&mut self) -> Result<Outbound, ()> {
        self.0.pop_queued().ok_or(())
    }

    /// Closes `generation` as a session's end does: the ids withdrawn unwritten.
    pub fn close(&mut self, generation: u64) -> Vec<String> {
        self.0.close(generation)
    }
}

/// The `retryAfterMs` hint when the upstream queue is full.
const QUEUE_FULL_RETRY_MS: u64 = 100;
