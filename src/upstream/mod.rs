//! The one upstream session: a connector task that owns the gateway
//! WebSocket, and a cheap [`Upstream`] handle the rest of the broker uses to
//! see its phase and to send requests on it.
//!
//! Each successful handshake starts a new session *generation*. Requests are
//! tagged with the generation they were sent on, so a request meant for a
//! session that has since died is never replayed on the next one. (The
//! broker-life id of `/v1/events` is a different thing: the replay *epoch*.)
//!
//! The queue to the session is bounded ([`UPSTREAM_QUEUE_FRAMES`]) and never
//! waited on: a full queue fails the request at once with a retryable error.
//!
//! - [`aux`]: narrower sessions for clients holding fewer scopes.
//! - `connector`: the task, its reconnect loop, the session and its watchdog.
//! - `handshake`: the `connect` the broker sends and how answers map to `studio.*`.
//! - [`identity`]: the device key, the v3 signature, stored device tokens.
//! - `private_files`: the 0700/0600 state dir they live in.
//! - [`tls`]: `wss://` with rustls, certificate pins, the plaintext rule.

pub mod aux;
mod connector;
mod handshake;

pub(crate) use handshake::{closed_before_answer, handshake_timed_out, open_failed};
pub use handshake::{UpstreamIo, Ws as GatewaySocket};

/// Opens a gateway WebSocket to `target` exactly as the shared session
/// does: the same URL and transport checks (`ws://` only where plaintext is
/// allowed), TCP or the configured unix socket, TLS with the configured
/// trust and pin for `wss://`, frames bounded by `[upstream]
/// max_frame_bytes`. The dedicated route ([`crate::local::dedicated`])
/// calls this, so both routes reach the same gateways the same way.
pub async fn open_socket(
    target: &Target,
    opts: &crate::config::UpstreamOptions,
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
    )
    .await
    .map_err(|e| e.error)
}

pub mod identity;
pub(crate) mod private_files;
pub mod tls;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::config::{Secret, Settings, TlsSettings};
use crate::dispatch::Dispatcher;
use crate::hub::Hub;
use crate::protocol::{ErrorShape, StudioCode};
use crate::router::Router;
use crate::sharing::Sharing;

/// Requests queued for the gateway at most. One more is answered
/// `studio.too_many_requests` (retryable) at once: the gateway is not
/// reading as fast as clients send, and waiting would stall every client.
pub const UPSTREAM_QUEUE_FRAMES: usize = 1024;

/// The operator scopes the broker asks for (the full set, so that local
/// clients can do whatever a direct operator connection could).
pub const REQUESTED_SCOPES: [&str; 5] = [
    "operator.admin",
    "operator.read",
    "operator.write",
    "operator.approvals",
    "operator.pairing",
];

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

/// The connector, built but not started: it needs the dispatcher, which
/// needs the [`Upstream`] handle.
pub struct ConnectorSeed {
    nudge: Arc<tokio::sync::Notify>,
    status: watch::Sender<Status>,
    rx: mpsc::Receiver<Outbound>,
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
    pub(crate) fn fake_ready(
        self,
        generation: u64,
    ) -> (watch::Sender<Status>, mpsc::Receiver<Outbound>) {
        self.status.send_modify(|s| {
            s.phase = Phase::Ready;
            s.generation = generation;
        });
        (self.status, self.rx)
    }

    /// Starts the connector task.
    pub fn spawn(
        self,
        settings: &Settings,
        hub: Arc<Hub>,
        router: Arc<Router>,
        sharing: Arc<Sharing>,
        dispatcher: Arc<Dispatcher>,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        dispatcher.aux().init(aux::AuxFactory {
            settings: settings.clone(),
            hub: Arc::clone(&hub),
            router: Arc::clone(&router),
            sharing: Arc::clone(&sharing),
            dispatcher: Arc::downgrade(&dispatcher),
            cancel: cancel.clone(),
        });
        let connector = connector::Connector::new(
            settings,
            connector::Shared {
                hub,
                router,
                sharing,
                dispatcher,
            },
            connector::Channels {
                nudge: self.nudge,
                status: self.status,
                rx: self.rx,
                target: self.target,
                offers: self.offers,
                peer_certificate: self.peer_certificate,
            },
            cancel,
        );
        tokio::spawn(connector.run())
    }
}

/// Starts a narrower session ([`aux`]): the connector code of the main
/// session, asking for `grant`'s scopes, on the main session's current
/// target. `None` when the broker is going away.
fn open_aux(
    factory: &aux::AuxFactory,
    target: watch::Receiver<Target>,
    grant: &crate::policy::Grant,
    generation: u64,
    cancel: CancellationToken,
) -> Option<Upstream> {
    let dispatcher = factory.dispatcher.upgrade()?;
    let (upstream, seed) = Upstream::new(&factory.settings);
    let connector = connector::Connector::new(
        &factory.settings,
        connector::Shared {
            hub: Arc::clone(&factory.hub),
            router: Arc::clone(&factory.router),
            sharing: Arc::clone(&factory.sharing),
            dispatcher,
        },
        connector::Channels {
            nudge: seed.nudge,
            status: seed.status,
            rx: seed.rx,
            target,
            offers: seed.offers,
            peer_certificate: seed.peer_certificate,
        },
        cancel,
    )
    .into_aux(connector::AuxRole {
        scopes: grant.scopes().to_vec(),
        generation,
    });
    tokio::spawn(connector.run_aux());
    Some(upstream)
}

/// The handle to the upstream session.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Asks the connector to try now instead of at the end of its backoff
    /// (a local client is waiting); rate-limited by the connector.
    nudge: Arc<tokio::sync::Notify>,
    status: watch::Receiver<Status>,
    tx: mpsc::Sender<Outbound>,
    target: Arc<watch::Sender<Target>>,
    offers: mpsc::Sender<ClientCredential>,
    peer_certificate: PeerCertificate,
}

impl Upstream {
    /// The handle, and the connector to start once the dispatcher exists.
    pub fn new(settings: &Settings) -> (Upstream, ConnectorSeed) {
        let (status_tx, status_rx) = watch::channel(Status::initial());
        let (tx, rx) = mpsc::channel(UPSTREAM_QUEUE_FRAMES);
        let (target_tx, target_rx) = watch::channel(Target::from_settings(settings));
        let (offer_tx, offer_rx) = mpsc::channel(16);
        let nudge = Arc::new(tokio::sync::Notify::new());
        let peer_certificate = PeerCertificate::default();
        (
            Upstream {
                nudge: Arc::clone(&nudge),
                status: status_rx,
                tx,
                target: Arc::new(target_tx),
                offers: offer_tx,
                peer_certificate: Arc::clone(&peer_certificate),
            },
            ConnectorSeed {
                nudge,
                status: status_tx,
                rx,
                target: target_rx,
                offers: offer_rx,
                peer_certificate,
            },
        )
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
        let mut rx = self.status.clone();
        let needs_credential = {
            let s = rx.borrow_and_update();
            s.phase == Phase::Rejected && s.awaiting_credential
        };
        if let (true, Some(credential)) =
            (needs_credential, auth.and_then(ClientCredential::from_auth))
        {
            if self.offers.try_send(credential).is_ok() {
                // Wait until the connector picked it up (its phase moves on).
                let _ = tokio::time::timeout_at(deadline.into(), rx.changed()).await;
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

    /// Follows what the connector is pointed at (a narrower session ends
    /// when it changes).
    pub(crate) fn target_watch(&self) -> watch::Receiver<Target> {
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

    /// Queues a request for the session of `generation`, never waiting. A
    /// full queue is `studio.too_many_requests` (retryable); a request for a
    /// session that has ended is dropped by the connector (its pending entry
    /// is failed by whoever ended it).
    pub fn try_send(&self, generation: u64, text: String) -> Result<(), ErrorShape> {
        match self.tx.try_send(Outbound { generation, text }) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(ErrorShape::studio(
                StudioCode::TooManyRequests,
                format!(
                    "{UPSTREAM_QUEUE_FRAMES} requests are already waiting to be written to the gateway (it is not reading fast enough); try again shortly"
                ),
            )
            .with_retry_after_ms(Some(QUEUE_FULL_RETRY_MS))),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ErrorShape::studio(
                StudioCode::UpstreamClosed,
                "the broker is shutting down",
            )),
        }
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
