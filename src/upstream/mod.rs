//! The transport: one gateway WebSocket at a time, tagged with a session
//! *generation*, and a cheap [`Upstream`] handle the rest of the broker uses
//! to see its phase and to send requests on it.
//!
//! The connector owns the connect loop (backoff, retry hints, the gateway's
//! challenge and the broker's signed `connect`, TLS, the silence watchdog)
//! and knows nothing about what a session is used for: it reports
//! `ready`, every `frame`, and `ended` to the [`SessionOwner`] it was given
//! (`crate::sessions` holds the owners: the main session and the narrower
//! ones), which decides what they mean.
//!
//! Each successful handshake starts a new generation. Requests are tagged
//! with the generation they were sent on, so a request meant for a session
//! that has since died is never replayed on the next one. (The broker-life
//! id of `/v1/events` is a different thing: the replay *epoch*.)
//!
//! The queue to the session is bounded ([`UPSTREAM_QUEUE_FRAMES`]) and never
//! waited on: a full queue fails the request at once with a retryable error.
//!
//! - `connector`: the task, its reconnect loop, the session and its watchdog.
//! - `handshake`: the `connect` the broker sends and how answers map to `studio.*`.
//! - [`identity`]: the device key, the v3 signature, stored device tokens.
//! - the 0700/0600 state dir they live in: [`crate::private_files`].
//! - [`tls`]: `wss://` with rustls, certificate pins, the plaintext rule.

mod connector;
mod handshake;
mod outlet;

pub(crate) use handshake::warn_lost_scopes;
pub(crate) use handshake::{closed_before_answer, handshake_timed_out, open_failed};
pub use handshake::{UpstreamIo, Ws as GatewaySocket};

/// Opens a gateway WebSocket to `target` exactly as the shared session
/// does: the same URL and transport checks (`ws://` only where plaintext is
/// allowed), TCP or the configured unix socket, TLS with the configured
/// trust and pin for `wss://`, frames bounded by `[upstream]
/// max_frame_bytes`. The dedicated route ([`crate::local::dedicated`])
/// calls this, so both routes reach the same gateways the same way;
/// `origin` is the `Origin` header it sends for a browser client.
pub async fn open_socket(
    target: &Target,
    opts: &crate::config::UpstreamOptions,
    origin: Option<&str>,
) -> Result<GatewaySocket, ErrorShape> {
    let url = target.url.trim();
    if let Some(e) = &target.load_error {
        return Err(e.clone());
    }
    crate::config::validate_gateway_url(url)
        .and_then(|()| tls::check_transport(url, &target.tls, target.allow_insecure_private_ws))?;
    let mut tls_client = None;
    connector::open_socket(
        url,
        opts,
        &target.tls,
        &mut tls_client,
        &PeerCertificate::default(),
        origin,
    )
    .await
    .map_err(|e| e.error)
}

pub mod identity;

pub mod tls;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::config::{Secret, Settings, TlsSettings};
use crate::protocol::{ErrorShape, StudioCode};

/// Requests queued for the gateway at most. One more is answered
/// `studio.too_many_requests` (retryable) at once: the gateway is not
/// reading as fast as clients send, and waiting would stall every client.
pub const UPSTREAM_QUEUE_FRAMES: usize = 1024;

/// Where the upstream session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Opening the TCP/WebSocket connection.
    Connecting,
    /// Socket open; waiting for the challenge or the `hello-ok`.
    Handshaking,
    /// `hello-ok` received; requests and events flow.
    Ready,
    /// The last attempt failed or the session dropped; retrying at `retry_at`.
    Backoff,
    /// The settings cannot work as they are (bad URL, no credential), the
    /// gateway refused the broker (auth, pairing, protocol), or the broker
    /// refused the gateway's TLS certificate. Local connects fail at once; a
    /// refused connect is retried only every `backoff_max`.
    Rejected,
    /// The broker is shutting down.
    Stopped,
}

impl Phase {
    /// Every phase, for metrics that list them all.
    pub const ALL: [Phase; 6] = [
        Phase::Connecting,
        Phase::Handshaking,
        Phase::Ready,
        Phase::Backoff,
        Phase::Rejected,
        Phase::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Connecting => "connecting",
            Phase::Handshaking => "handshaking",
            Phase::Ready => "ready",
            Phase::Backoff => "backoff",
            Phase::Rejected => "rejected",
            Phase::Stopped => "stopped",
        }
    }
}

/// What the gateway said in its `hello-ok`, as the broker uses it.
#[derive(Debug, Clone)]
pub struct UpstreamHello {
    /// The whole `hello-ok` payload (without the device token).
    pub payload: Value,
    /// The gateway's protocol version.
    pub protocol: u64,
    pub server_version: String,
    /// The scopes the gateway granted (`auth.scopes`), or the requested ones
    /// when an older gateway does not say.
    pub scopes: Vec<String>,
    /// Requested scopes the gateway did not grant.
    pub lost_scopes: Vec<String>,
    /// `policy.maxPayload`, if the gateway sent one.
    pub max_payload: Option<u64>,
    /// The gateway's own fields of its `connect.challenge` besides `nonce`
    /// and `ts` (e.g. `capabilities`), for the challenge local clients get.
    pub challenge_extra: serde_json::Map<String, Value>,
}

impl UpstreamHello {
    /// Whether the gateway lists `method` in `hello-ok.features.methods`
    /// (true when it sends no list: an older gateway is not second-guessed).
    pub fn supports(&self, method: &str) -> bool {
        match self
            .payload
            .pointer("/features/methods")
            .and_then(Value::as_array)
        {
            Some(methods) => methods.iter().any(|m| m.as_str() == Some(method)),
            None => true,
        }
    }
}

/// A snapshot of the connector's state.
#[derive(Debug, Clone)]
pub struct Status {
    pub phase: Phase,
    /// The session generation: increments with every successful handshake.
    pub generation: u64,
    pub hello: Option<Arc<UpstreamHello>>,
    /// Why the last attempt or session ended (already in `studio.*` form).
    pub last_error: Option<ErrorShape>,
    /// When the next attempt starts (in `Backoff`).
    pub retry_at: Option<Instant>,
    /// Successful handshakes after the first.
    pub reconnects: u64,
    /// The host has no credential (or the one a client offered was
    /// refused): a local client's own `auth` may open the session.
    pub awaiting_credential: bool,
    /// The session runs on a local client's own credential (kept in the
    /// connector's memory only): no narrower sessions are opened with it.
    pub on_client_credential: bool,
    /// The broker's device id, when device identity is on and usable.
    pub device_id: Option<String>,
    /// How the last session ended, as a close a local client mirroring the
    /// gateway should get: the gateway's own close code and reason when it
    /// sent one that may be sent on (else `1012 service restart`).
    pub last_close: Option<(u16, String)>,
    /// A session has been ready before: a failure to reach the gateway now
    /// is an outage being ridden through, not a gateway never reached.
    pub had_session: bool,
}

impl Status {
    /// The status before the first attempt.
    pub(crate) fn initial() -> Self {
        Status {
            phase: Phase::Connecting,
            generation: 0,
            hello: None,
            last_error: None,
            retry_at: None,
            reconnects: 0,
            awaiting_credential: false,
            on_client_credential: false,
            device_id: None,
            had_session: false,
            last_close: None,
        }
    }

    /// Milliseconds until the next attempt, if one is scheduled.
    pub fn retry_after_ms(&self) -> Option<u64> {
        self.retry_at
            .map(|at| at.saturating_duration_since(Instant::now()).as_millis() as u64)
    }

    /// The error a request or connect gets while the session is not ready.
    pub fn not_ready_error(&self) -> ErrorShape {
        // While an attempt is under way its outcome is not known yet: a short
        // hint, since the broker retries by itself either way.
        let in_progress = matches!(self.phase, Phase::Connecting | Phase::Handshaking);
        let retry = self
            .retry_after_ms()
            .or(in_progress.then_some(ATTEMPT_IN_PROGRESS_RETRY_MS));
        match (&self.last_error, self.phase) {
            // A gateway that worked and is briefly unreachable (restarting)
            // is reported as the session being down, which clients such as
            // Claw3D retry; `upstream_error`/`upstream_timeout` (which they
            // treat as final) stay for a gateway never reached.
            (Some(e), Phase::Connecting | Phase::Handshaking | Phase::Backoff)
                if self.had_session
                    && matches!(
                        e.code.as_str(),
                        "studio.upstream_error" | "studio.upstream_timeout"
                    ) =>
            {
                ErrorShape::studio(
                    StudioCode::UpstreamClosed,
                    format!(
                        "the gateway session is down and the broker is reconnecting: {}",
                        e.message
                    ),
                )
                .with_details(serde_json::json!({"cause": e.code}))
                .with_retry_after_ms(retry.or(e.retry_after_ms))
            }
            (Some(e), _) if e.retryable == Some(true) => {
                e.clone().with_retry_after_ms(retry.or(e.retry_after_ms))
            }
            (Some(e), _) => e.clone().with_retry_after_ms(self.retry_after_ms()),
            (None, Phase::Stopped) => {
                ErrorShape::studio(StudioCode::UpstreamClosed, "the broker is shutting down")
            }
            (None, _) => ErrorShape::studio(
                StudioCode::UpstreamClosed,
                "the gateway session is not open yet; try again shortly",
            )
            .with_retry_after_ms(retry),
        }
    }
}

/// The `retryAfterMs` hint given while a connection attempt is in progress.
const ATTEMPT_IN_PROGRESS_RETRY_MS: u64 = 1000;

/// What the connector connects to; changed by a settings reload.
#[derive(Debug, Clone)]
pub struct Target {
    pub url: String,
    pub token: Option<Secret>,
    pub password: Option<Secret>,
    /// The certificate pin and CA file for a `wss://` URL.
    pub tls: TlsSettings,
    /// OpenClaw's break-glass for plaintext to host names ([`tls::BREAK_GLASS_ENV`]).
    pub allow_insecure_private_ws: bool,
    /// The settings could not be loaded (`studio.settings_load_failed`).
    pub load_error: Option<ErrorShape>,
}

impl Target {
    pub fn from_settings(settings: &Settings) -> Self {
        Target {
            url: settings.gateway_url.clone(),
            token: settings.token.clone(),
            password: settings.password.clone(),
            tls: settings.tls.clone(),
            allow_insecure_private_ws: settings.allow_insecure_private_ws,
            load_error: settings.load_error.clone(),
        }
    }
}

/// A local client's own `auth`, offered when the host has no credential.
#[derive(Debug, Clone)]
pub struct ClientCredential {
    pub token: Option<Secret>,
    pub password: Option<Secret>,
}

impl ClientCredential {
    /// Reads `auth.token` / `auth.password` from a client's connect params.
    pub fn from_auth(auth: &Value) -> Option<Self> {
        let secret = |key: &str| {
            auth.get(key)
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(Secret::new)
        };
        let c = ClientCredential {
            token: secret("token"),
            password: secret("password"),
        };
        (c.token.is_some() || c.password.is_some()).then_some(c)
    }
}

/// A request on its way upstream, tagged with its session generation.
#[derive(Debug)]
pub struct Outbound {
    pub generation: u64,
    pub text: String,
}

/// What the transport tells the owner of a session, in order, on the
/// connector's task (so an event is handled on the thread that read it).
/// The owner decides what each means; the transport only connects.
pub trait SessionOwner: Send + Sync + 'static {
    /// Session `generation` is ready: `hello` is what the gateway said.
    /// `reconnected`: a session of this connector was ready before.
    /// Events that arrived before `hello-ok` follow as [`SessionOwner::frame`]s.
    fn ready(&self, generation: u64, hello: &Arc<UpstreamHello>, reconnected: bool);
    /// One text frame of session `generation` (an event or an answer).
    /// Returns the delay the gateway announced before it restarts, when
    /// this frame was its `shutdown` event (the next attempt waits for it).
    fn frame(&self, generation: u64, text: &str) -> Option<Duration>;
    /// More events arrived before `hello-ok` than the transport keeps: some
    /// of session `generation`'s events were lost.
    fn early_events_lost(&self, generation: u64);
    /// Session `generation` ended.
    fn ended(&self, generation: u64, end: &SessionEnded);
    /// The attempt that would have opened session `generation` failed
    /// (requests queued for it while it was connecting must be failed).
    fn attempt_failed(&self, generation: u64, error: &ErrorShape);
}

/// An owner that does nothing with what it is told (`clawmux doctor`'s
/// one attempt: only the handle's status matters).
#[derive(Debug)]
pub struct NoOwner;

impl SessionOwner for NoOwner {
    fn ready(&self, _: u64, _: &Arc<UpstreamHello>, _: bool) {}
    fn frame(&self, _: u64, _: &str) -> Option<Duration> {
        None
    }
    fn early_events_lost(&self, _: u64) {}
    fn ended(&self, _: u64, _: &SessionEnded) {}
    fn attempt_failed(&self, _: u64, _: &ErrorShape) {}
}

/// How a ready session ended, for its owner.
#[derive(Debug, Clone)]
pub struct SessionEnded {
    /// Why, in words (logged, and shown to clients).
    pub reason: String,
    /// The broker is stopping.
    pub cancelled: bool,
    /// The delay the gateway announced before restarting (its `shutdown`
    /// event), if it did.
    pub restart_hint: Option<Duration>,
    /// The close code the gateway sent, if it closed the socket itself.
    pub gateway_close_code: Option<u16>,
    /// What requests still waiting on this session are answered with.
    pub error: ErrorShape,
}

/// What one connector asks for and keeps; the same connect loop serves the
/// main session and the narrower ones, with these as its only differences.
#[derive(Debug, Clone)]
pub struct SessionSpec {
    /// The scopes its `connect` asks for.
    pub scopes: Vec<String>,
    /// Keep a device token the gateway mints (the main session's only: a
    /// narrower session's token must not replace the broker's).
    pub keep_device_token: bool,
    /// Nudges from waiting clients shorten its backoff (the main session:
    /// local connects wait for it; a narrower session just backs off).
    pub nudgeable: bool,
    /// For logs: `main`, or the narrower session's scopes.
    pub label: String,
}

impl SessionSpec {
    /// The main session: every operator scope.
    pub fn main() -> Self {
        SessionSpec {
            scopes: crate::policy::scopes::REQUESTED_SCOPES
                .iter()
                .map(|s| s.to_string())
                .collect(),
            keep_device_token: true,
            nudgeable: true,
            label: "main".into(),
        }
    }

    /// A narrower session holding exactly `scopes`.
    pub fn narrower(scopes: &[String]) -> Self {
        SessionSpec {
            scopes: scopes.to_vec(),
            keep_device_token: false,
            nudgeable: false,
            label: format!("narrower [{}]", scopes.join(",")),
        }
    }
}

/// The connector, built but not started: the owner of its sessions is
/// usually built around the [`Upstream`] handle, so it is given at start.
pub struct ConnectorSeed {
    nudge: Arc<tokio::sync::Notify>,
    status: watch::Sender<Status>,
    outlet: Arc<outlet::Outlet>,
    target: watch::Receiver<Target>,
    offers: mpsc::Receiver<ClientCredential>,
    peer_certificate: PeerCertificate,
}

/// The certificate the `wss://` gateway showed on the last TLS handshake
/// (accepted or not), shared between the connector and the handle.
type PeerCertificate = Arc<std::sync::Mutex<Option<tls::CertificateInfo>>>;

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
        initial.generation = generation_base;
        let (status_tx, status_rx) = watch::channel(initial);
        let outlet = Arc::new(outlet::Outlet::new(UPSTREAM_QUEUE_FRAMES));
        let (target_tx, target_rx) = watch::channel(target);
        let (offer_tx, offer_rx) = mpsc::channel(16);
        let nudge = Arc::new(tokio::sync::Notify::new());
        let peer_certificate = PeerCertificate::default();
        (
            Upstream {
                nudge: Arc::clone(&nudge),
                status: status_rx,
                outlet: Arc::clone(&outlet),
                target: Arc::new(target_tx),
                offers: offer_tx,
                peer_certificate: Arc::clone(&peer_certificate),
            },
            ConnectorSeed {
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

    /// Points the connector at new settings (SIGHUP). Returns whether
    /// anything changed; if so, the session is re-opened with them.
    pub fn retarget(&self, target: Target) -> bool {
        self.target.send_if_modified(|current| {
            let changed = current.url != target.url
                || current.token != target.token
                || current.password != target.password
                || current.tls != target.tls
                || current.allow_insecure_private_ws != target.allow_insecure_private_ws
                || current.load_error != target.load_error;
            if changed {
                *current = target;
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

    /// Follows what the connector is pointed at (narrower sessions follow
    /// the main session's target).
    pub fn target_watch(&self) -> watch::Receiver<Target> {
        self.target.subscribe()
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
    /// session's, or, while an attempt is under way, the one it will open
    /// (requests queued for it are written once it is ready, and failed
    /// through [`SessionOwner::attempt_failed`] if it never is).
    pub fn next_generation(&self) -> Option<u64> {
        let s = self.status.borrow();
        match s.phase {
            Phase::Ready => Some(s.generation),
            Phase::Connecting | Phase::Handshaking => Some(s.generation + 1),
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
    /// ([`outlet`]). A full queue is `studio.too_many_requests` (retryable); a
    /// request for a session that has ended is dropped (its pending entry is
    /// failed by whoever ended it).
    pub fn try_send(&self, generation: u64, text: String) -> Result<(), ErrorShape> {
        match self.outlet.push(Outbound { generation, text }) {
            Ok(()) => Ok(()),
            Err(outlet::Full) => Err(ErrorShape::studio(
                StudioCode::TooManyRequests,
                format!(
                    "{UPSTREAM_QUEUE_FRAMES} requests are already waiting to be written to the gateway (it is not reading fast enough); try again shortly"
                ),
            )
            .with_retry_after_ms(Some(QUEUE_FULL_RETRY_MS))),
        }
    }
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
}

/// The `retryAfterMs` hint when the upstream queue is full.
const QUEUE_FULL_RETRY_MS: u64 = 100;

/// Attempts started because a local client was waiting are at least this
/// far apart.
pub const NUDGE_MIN_INTERVAL: Duration = Duration::from_millis(250);

/// How long a waiting connect gives the connector to act on its nudge.
const NUDGE_SETTLE: Duration = Duration::from_millis(50);

/// The longest wait between attempts for a gateway on loopback (not after a
/// rejection): probing it is cheap, and a restarted local gateway should be
/// used within this long of becoming ready.
pub const LOOPBACK_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Whether the URL's host is this machine.
pub fn is_loopback_url(url: &str) -> bool {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return false;
    };
    let host = uri.host().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The least delay taken from a gateway's hint (`shutdown.restartExpectedMs`,
/// an error's `retryAfterMs`): a hint of 0 must not become a reconnect loop.
pub const RETRY_HINT_FLOOR: Duration = Duration::from_millis(250);

/// A session that ends sooner than this counts as a failed attempt, so a
/// gateway that closes right after `hello-ok` is retried with growing
/// delays, not at a fixed rate forever.
pub const STABLE_SESSION: Duration = Duration::from_secs(10);

/// A gateway-supplied delay, bounded: never above `max` (`backoff_max`: a
/// hint of a day must not park the broker), never below a floor that starts
/// at [`RETRY_HINT_FLOOR`] and doubles with consecutive failures up to
/// `max(initial, RETRY_HINT_FLOOR)` (and never above `max`).
pub fn clamp_hint(hint: Duration, initial: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(10);
    let floor = RETRY_HINT_FLOOR
        .saturating_mul(1u32 << exp)
        .min(initial.max(RETRY_HINT_FLOOR))
        .min(max);
    hint.clamp(floor, max)
}

/// The delay before reconnecting after a ready session ended, the
/// `failures`-th in a row: the gateway's hint (clamped) or the backoff; and
/// for a session that did not last [`STABLE_SESSION`], never less than the
/// backoff, so a gateway that drops every session right after `hello-ok`
/// (with `restartExpectedMs: 0`, say) is retried at growing intervals.
pub fn delay_after_session(
    hint: Option<Duration>,
    stable: bool,
    initial: Duration,
    max: Duration,
    failures: u32,
) -> Duration {
    let backoff = backoff_delay(initial, max, failures);
    let delay = hint.map_or(backoff, |h| clamp_hint(h, initial, max, failures));
    if stable {
        delay
    } else {
        delay.max(backoff)
    }
}

/// The backoff delay after `failures` consecutive failures: initial × 2^(n-1),
/// capped, with up to 20 % jitter taken off so many brokers do not retry in step.
pub fn backoff_delay(initial: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(20);
    let base = initial.saturating_mul(1u32 << exp).min(max);
    let jitter = rand::random::<f64>() * 0.2;
    base.mul_f64(1.0 - jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_hints_are_clamped() {
        let (i, m) = (Duration::from_secs(1), Duration::from_secs(30));
        let ms = |n| Duration::from_millis(n);
        assert_eq!(clamp_hint(ms(0), i, m, 1), ms(250));
        assert_eq!(clamp_hint(ms(0), i, m, 2), ms(500));
        assert_eq!(
            clamp_hint(ms(0), i, m, 9),
            ms(1000),
            "the floor stops at backoff_initial"
        );
        assert_eq!(
            clamp_hint(ms(86_400_000), i, m, 1),
            m,
            "a day becomes backoff_max"
        );
        assert_eq!(clamp_hint(Duration::MAX, i, m, 1), m);
        assert_eq!(clamp_hint(ms(5000), i, m, 1), ms(5000));
        // A backoff_max below the floor wins (tests use 200 ms).
        assert_eq!(clamp_hint(ms(0), ms(20), ms(200), 1), ms(200));
    }

    #[test]
    fn short_sessions_back_off_whatever_the_hint() {
        let (i, m) = (Duration::from_secs(1), Duration::from_secs(30));
        let zero = Some(Duration::ZERO);
        for (n, least) in [(1, 0.8), (3, 3.2), (5, 12.8), (8, 24.0)] {
            let d = delay_after_session(zero, false, i, m, n).as_secs_f64();
            assert!(d >= least, "failures={n}: {d} s");
        }
        // A session that lasted honours the gateway's hint.
        let hint = Some(Duration::from_secs(5));
        assert_eq!(
            delay_after_session(hint, true, i, m, 1),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let (i, m) = (Duration::from_secs(1), Duration::from_secs(30));
        for (n, want) in [
            (1, 1.0),
            (2, 2.0),
            (3, 4.0),
            (5, 16.0),
            (6, 30.0),
            (40, 30.0),
        ] {
            let d = backoff_delay(i, m, n).as_secs_f64();
            assert!(d <= want && d >= want * 0.8, "failures={n}: {d}");
        }
    }
}
