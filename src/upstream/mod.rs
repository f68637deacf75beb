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
//! Each attempt to open a session takes a new *generation*, and keeps it if
//! it succeeds. Requests are tagged with the generation they were sent on;
//! when a session ends, or the attempt that would have opened it fails, its
//! generation is closed in the outlet: its requests still queued are taken
//! out (their clients are answered "not sent") and any request for it that
//! comes later is refused. So a request is either written to a gateway
//! socket or answered as failed, never both, and a request meant for a
//! session that never opened or has died is never written on the next one.
//! (The broker-life id of `/v1/events` is a different thing: the replay
//! *epoch*.)
//!
//! The queue to the session is bounded in requests
//! ([`UPSTREAM_QUEUE_FRAMES`]) and bytes ([`UPSTREAM_QUEUE_BYTES`]) and never
//! waited on: a full queue fails the request at once with a retryable error.
//!
//! - `connector`: the task, its reconnect loop, the session and its watchdog.
//! - `handshake`: the `connect` the broker sends and how answers map to `studio.*`.
//! - [`identity`]: the device key, the v3 signature, stored device tokens.
//! - the 0700/0600 state dir they live in: [`crate::private_files`].
//! - [`tls`]: `wss://` with rustls, certificate pins, the plaintext rule.

mod backoff;
mod connector;
mod handle;
mod handshake;
mod movable;
mod outlet;
mod status;

pub use backoff::{
    backoff_delay, clamp_hint, delay_after_session, is_loopback_url, LOOPBACK_BACKOFF_MAX,
    NUDGE_MIN_INTERVAL, RETRY_HINT_FLOOR, STABLE_SESSION,
};
#[cfg(test)]
pub(crate) use handle::FakeQueue;
pub use handle::{queue_full_error, ConnectorSeed, Refusal, Upstream};
pub use status::{Phase, Status, UpstreamHello};

pub(crate) use handshake::warn_lost_scopes;
pub(crate) use handshake::{closed_before_answer, handshake_timed_out, open_failed};
pub use handshake::{UpstreamIo, Ws as GatewaySocket};
pub use movable::{MovedSocket, SocketKind};

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

/// A gateway socket moved from the previous instance, as a WebSocket again
/// (a `/ws/dedicated` connection's: its frames go on where they stopped).
pub async fn take_over_socket(
    socket: MovedSocket,
    opts: &crate::config::UpstreamOptions,
) -> std::io::Result<GatewaySocket> {
    connector::take_over_socket(socket, opts).await
}

pub mod identity;

pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::config::{Secret, Settings, TlsSettings};
use crate::protocol::ErrorShape;

/// The certificate the `wss://` gateway showed on the last TLS handshake
/// (accepted or not), shared between the connector and the handle.
pub(crate) type PeerCertificate = Arc<std::sync::Mutex<Option<tls::CertificateInfo>>>;

/// Requests queued for the gateway at most. One more is answered
/// `studio.too_many_requests` (retryable) at once: the gateway is not
/// reading as fast as clients send, and waiting would stall every client.
pub const UPSTREAM_QUEUE_FRAMES: usize = 1024;

/// Bytes of requests queued for one gateway session at most (before: a
/// count alone let 250 requests of 8 MiB hold 1,658 MiB while the gateway
/// did not read). A request that does not fit is answered
/// `studio.too_many_requests` (retryable); one request of any size (up to
/// the frame limit) fits an empty queue. With the main session and
/// [`crate::sessions::narrower::MAX_GRANT_SESSIONS`] narrower ones, queued
/// requests hold at most 9 × this plus one frame each.
pub const UPSTREAM_QUEUE_BYTES: usize = 16 * 1024 * 1024;

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
    /// Settings files discovery passed over (they point at this broker).
    /// Shown by `/v1/state`; a change alone does not reconnect.
    pub discovery: Vec<String>,
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
            discovery: settings.discovery.clone(),
        }
    }

    /// Whether connecting to `other` is not connecting to this (what a
    /// reload compares; the settings files discovery passed over are only
    /// shown).
    pub fn differs(&self, other: &Target) -> bool {
        self.url != other.url
            || self.token != other.token
            || self.password != other.password
            || self.tls != other.tls
            || self.allow_insecure_private_ws != other.allow_insecure_private_ws
            || self.load_error != other.load_error
    }

    /// Puts this target into `settings`: what a broker serving again
    /// starts from is what it last served (a reload included), not what it
    /// was started with.
    pub fn apply_to(self, settings: &mut Settings) {
        let Target {
            url,
            token,
            password,
            tls,
            allow_insecure_private_ws,
            load_error,
            discovery,
        } = self;
        settings.gateway_url = url;
        settings.token = token;
        settings.password = password;
        settings.tls = tls;
        settings.allow_insecure_private_ws = allow_insecure_private_ws;
        settings.load_error = load_error;
        settings.discovery = discovery;
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
    /// Its id on the gateway session (the pending table's key).
    pub id: String,
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
    /// Session `generation` is a gateway connection the previous instance
    /// handed over (design §11): the same connection, its `seq` and what
    /// the gateway holds for it go on. An owner that keeps nothing of the
    /// previous instance takes it as a first session.
    fn taken_over(&self, generation: u64, hello: &Arc<UpstreamHello>) {
        self.ready(generation, hello, false);
    }
    /// One text frame of session `generation` (an event or an answer).
    /// Returns the delay the gateway announced before it restarts, when
    /// this frame was its `shutdown` event (the next attempt waits for it).
    fn frame(&self, generation: u64, text: &str) -> Option<Duration>;
    /// More events arrived before `hello-ok` than the transport keeps: some
    /// of session `generation`'s events were lost.
    fn early_events_lost(&self, generation: u64);
    /// Session `generation` ended. Its requests that were still queued
    /// were withdrawn unwritten: `end.unsent`.
    fn ended(&self, generation: u64, end: &SessionEnded);
    /// The attempt that would have opened session `generation` failed:
    /// requests queued for it while it was connecting were withdrawn (none
    /// was written: there was no socket), and any request still registered
    /// for it must be answered "not sent".
    fn attempt_failed(&self, generation: u64, error: &ErrorShape);
}

/// A gateway session stopped for the next instance ([`Upstream::hand_over`]):
/// its socket at a message boundary, what the gateway said in its
/// `hello-ok`, and the requests that were still queued and are now
/// withdrawn unwritten (their clients must be answered "not sent").
#[derive(Debug)]
pub struct HandedOver {
    pub socket: MovedSocket,
    pub hello: UpstreamHello,
    pub generation: u64,
    pub unsent: Vec<String>,
}

/// A request to hand the session over: answered with what moves, or `None`.
pub(crate) type HandoverRequest = tokio::sync::oneshot::Sender<Option<HandedOver>>;

/// A gateway session the previous instance handed over, for this
/// instance's connector to go on with.
#[derive(Debug)]
pub struct Takeover {
    pub socket: MovedSocket,
    pub hello: UpstreamHello,
    /// The gateway URL it is connected to, redacted: the connector takes over
    /// it only if its own settings name the same gateway.
    pub url: String,
    /// The connector reads and writes the socket only once this is open
    /// (the previous instance may still serve it again until then).
    pub gate: crate::gate::Gate,
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
    /// The requests that were still queued, withdrawn unwritten (answered
    /// `sent: false`; every other request of the session `sent: true`).
    pub unsent: Vec<String>,
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
