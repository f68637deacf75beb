//! The connector task: opens the upstream WebSocket, performs the gateway
//! handshake with the host credential, runs the session (`session.rs`), and
//! reconnects. The same loop, with the same backoff and retry-hint
//! clamping, serves the main session and every narrower one; what differs
//! is only their [`SessionSpec`] and their [`SessionOwner`].

mod session;
mod socket;

pub(crate) use socket::{open_socket, take_over_socket};

use std::sync::Arc;
use std::time::Duration;
// tokio's clock, which every timer here sleeps on: the system's in a broker, a
// test's own on paused time.
use tokio::time::Instant;

use futures_util::SinkExt;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::handshake::{
    connect_params, next_text, parse_hello, rejection, AttemptError, Challenge, Credentials,
    MintedToken, Ws,
};
use super::identity::DeviceIdentity;
use super::tls::{check_transport, TlsClient};
use super::{
    backoff_delay, clamp_hint, ClientCredential, PeerCertificate, Phase, SessionOwner, SessionSpec,
    Status, Target, UpstreamHello, STABLE_SESSION,
};
use crate::config::{
    redact_url, validate_gateway_url, Secret, Settings, TlsSettings, UpstreamOptions,
};
use crate::protocol::frames::encode_req;
use crate::protocol::{ErrorShape, StudioCode, UpstreamFrame};

/// Events the gateway sends between `connect` and `hello-ok` that are kept
/// to publish after it; beyond this count (or [`EARLY_EVENTS_MAX_BYTES`])
/// they are dropped and clients see a gap instead.
const EARLY_EVENTS_MAX: usize = 256;
/// Bytes of early events kept at most (see [`EARLY_EVENTS_MAX`]).
const EARLY_EVENTS_MAX_BYTES: usize = 1024 * 1024;

/// Events that arrived before `hello-ok`, bounded.
#[derive(Debug, Default)]
struct EarlyEvents {
    frames: Vec<String>,
    bytes: usize,
    /// Some were dropped: clients must see a gap.
    overflowed: bool,
}

impl EarlyEvents {
    fn push(&mut self, text: String) {
        if self.frames.len() >= EARLY_EVENTS_MAX || self.bytes + text.len() > EARLY_EVENTS_MAX_BYTES
        {
            self.overflowed = true;
            return;
        }
        self.bytes += text.len();
        self.frames.push(text);
    }
}

/// How a ready session ended, as the connect loop needs it.
struct SessionEnd {
    /// The session was handed over to the next instance: the connector stops.
    handed_over: bool,
    /// The gateway announced a restart (`shutdown` with `restartExpectedMs`).
    restart_expected: Option<Duration>,
    cancelled: bool,
    /// The settings changed: reconnect at once with the new ones.
    retargeted: bool,
}

/// The channels between the connector and the [`super::Upstream`] handle.
pub(super) struct Channels {
    pub handover: mpsc::Receiver<super::HandoverRequest>,
    pub takeover: Option<tokio::sync::oneshot::Receiver<Option<super::Takeover>>>,
    pub nudge: Arc<tokio::sync::Notify>,
    pub status: watch::Sender<Status>,
    pub outlet: Arc<super::outlet::Outlet>,
    pub target: watch::Receiver<Target>,
    pub offers: mpsc::Receiver<ClientCredential>,
    pub peer_certificate: PeerCertificate,
}

/// How waiting for settings ended.
enum Parked {
    Cancelled,
    Retargeted,
    Offered,
}

pub(super) struct Connector {
    /// Requests to hand the session over ([`super::Upstream::hand_over`]).
    handover: mpsc::Receiver<super::HandoverRequest>,
    /// A session the previous instance may hand over: waited for before
    /// the first attempt.
    takeover: Option<tokio::sync::oneshot::Receiver<Option<super::Takeover>>>,
    url: String,
    token: Option<Secret>,
    password: Option<Secret>,
    tls: TlsSettings,
    /// OpenClaw's break-glass for plaintext `ws://` to host names.
    allow_insecure_private_ws: bool,
    /// The trust store and pin for `wss://`, loaded on the first attempt
    /// after the target changed.
    tls_client: Option<Arc<TlsClient>>,
    /// The certificate the gateway showed last (for `doctor`).
    peer_certificate: PeerCertificate,
    /// A credential a local client supplied when the host has none
    /// (design §2); kept in memory only, dropped if the gateway refuses it.
    offered: Option<ClientCredential>,
    target: watch::Receiver<Target>,
    offers: mpsc::Receiver<ClientCredential>,
    opts: UpstreamOptions,
    /// What this connector's sessions ask for and keep.
    spec: SessionSpec,
    /// Who is told about each session.
    owner: Arc<dyn SessionOwner>,
    status: watch::Sender<Status>,
    /// Rung when a local client is waiting for the session.
    nudge: Arc<tokio::sync::Notify>,
    /// The queue of requests, and the socket of the open session.
    outlet: Arc<super::outlet::Outlet>,
    cancel: CancellationToken,
    instance_id: String,
    next_connect_id: u64,
    /// The broker's device key, loaded once at start; `None` when device
    /// identity is off or the state dir cannot be used (logged then).
    identity: Option<Arc<DeviceIdentity>>,
}

impl Connector {
    pub(super) fn new(
        settings: &Settings,
        spec: SessionSpec,
        identity: Option<Arc<DeviceIdentity>>,
        owner: Arc<dyn SessionOwner>,
        channels: Channels,
        cancel: CancellationToken,
    ) -> Self {
        let Channels {
            handover,
            takeover,
            nudge,
            status,
            outlet,
            target,
            offers,
            peer_certificate,
        } = channels;
        let device_id = identity.as_ref().map(|i| i.device_id().to_owned());
        status.send_modify(|s| s.device_id = device_id);
        Connector {
            handover,
            takeover,
            identity,
            url: settings.gateway_url.trim().to_owned(),
            token: settings.token.clone(),
            password: settings.password.clone(),
            tls: settings.tls.clone(),
            allow_insecure_private_ws: settings.allow_insecure_private_ws,
            tls_client: None,
            peer_certificate,
            offered: None,
            target,
            offers,
            opts: settings.upstream.clone(),
            spec,
            owner,
            status,
            outlet,
            nudge,
            cancel,
            instance_id: uuid::Uuid::new_v4().to_string(),
            next_connect_id: 0,
        }
    }

    fn set_phase(&self, phase: Phase) {
        self.status.send_modify(|s| {
            s.phase = phase;
            s.awaiting_credential = false;
            if phase != Phase::Backoff {
                s.retry_at = None;
            }
        });
    }

    /// Settings that cannot work: stay `Rejected` until they change (SIGHUP),
    /// a local client offers a credential (when `accept_offer`), or shutdown.
    async fn park(&mut self, error: ErrorShape, accept_offer: bool) -> Parked {
        tracing::error!(code = %error.code, "{}", error.message);
        self.status.send_modify(|s| {
            s.phase = Phase::Rejected;
            s.retry_at = None;
            s.last_error = Some(error);
            s.awaiting_credential = accept_offer;
        });
        tokio::select! {
            _ = self.cancel.cancelled() => Parked::Cancelled,
            changed = self.target.changed() => {
                if changed.is_ok() { Parked::Retargeted } else { Parked::Cancelled }
            }
            offer = self.offers.recv(), if accept_offer => match offer {
                Some(credential) => {
                    self.offered = Some(credential);
                    Parked::Offered
                }
                None => Parked::Cancelled,
            },
        }
    }

    /// Takes the current settings as they are.
    fn load_target(&mut self) -> Target {
        let target = self.target.borrow_and_update().clone();
        self.url = target.url.trim().to_owned();
        self.token = target.token.clone();
        self.password = target.password.clone();
        self.tls = target.tls.clone();
        self.allow_insecure_private_ws = target.allow_insecure_private_ws;
        target
    }

    /// Takes the current settings; returns the reason they cannot work, if any.
    async fn take_target(&mut self) -> Option<(ErrorShape, bool)> {
        let target = self.load_target();
        if let Some(e) = target.load_error {
            return Some((e, false));
        }
        if let Err(e) = validate_gateway_url(&self.url)
            .and_then(|()| check_transport(&self.url, &self.tls, self.allow_insecure_private_ws))
        {
            return Some((e, false));
        }
        if self.token.is_none()
            && self.password.is_none()
            && self.offered.is_none()
            && self.stored_device_token().await.is_none()
        {
            let e = ErrorShape::studio(
                StudioCode::GatewayTokenMissing,
                crate::config::NO_TOKEN_ADVICE,
            );
            return Some((e, true));
        }
        None
    }

    pub(super) async fn run(mut self) {
        let mut failures: u32 = 0;
        let mut had_session = false;
        let mut takeover = None;
        if let Some(word) = self.takeover.take() {
            tokio::select! {
                _ = self.cancel.cancelled() => {
                    self.set_phase(Phase::Stopped);
                    return;
                }
                word = word => takeover = word.ok().flatten(),
            }
            // Clients were handed over: whatever session comes next is a
            // reconnect to them unless it is the one they were on.
            had_session = true;
        }
        if let Some(takeover) = takeover {
            // Authenticated already: no credential is checked (one a client
            // offered to the previous instance is not here to offer again).
            self.load_target();
            match self.take_over(takeover).await {
                Some((ws, hello)) => {
                    let end = self
                        .run_session(ws, hello, EarlyEvents::default(), Start::Adopted)
                        .await;
                    if end.cancelled || end.handed_over {
                        self.set_phase(Phase::Stopped);
                        return;
                    }
                }
                // Stopped before the gate opened: nothing was taken.
                None if self.cancel.is_cancelled() => {
                    self.set_phase(Phase::Stopped);
                    return;
                }
                None => self.takeover_refused(),
            }
        }
        'attempts: loop {
            if let Some((error, accept_offer)) = self.take_target().await {
                match self.park(error, accept_offer).await {
                    Parked::Cancelled => break,
                    Parked::Retargeted | Parked::Offered => {
                        failures = 0;
                        continue;
                    }
                }
            }
            self.set_phase(Phase::Connecting);
            let attempt_started = Instant::now();
            let cancel = self.cancel.clone();
            let attempt = tokio::select! {
                _ = cancel.cancelled() => {
                    self.attempt_failed(ErrorShape::studio(
                        StudioCode::UpstreamClosed,
                        "the broker is shutting down",
                    ));
                    break;
                }
                r = tokio::time::timeout(self.opts.handshake_timeout, self.attempt()) => r,
            };
            let mut phase_after = Phase::Backoff;
            let delay = match attempt {
                Ok(Ok((ws, hello, early))) => {
                    // A credential that worked is kept for reconnects; later offers are moot.
                    while self.offers.try_recv().is_ok() {}
                    let started = Instant::now();
                    let start = if had_session {
                        Start::Reconnect
                    } else {
                        Start::First
                    };
                    let end = self.run_session(ws, hello, early, start).await;
                    had_session = true;
                    if end.cancelled || end.handed_over {
                        break;
                    }
                    if end.retargeted {
                        failures = 0;
                        continue 'attempts;
                    }
                    // A session that ended soon counts as a failed attempt,
                    // and its delay grows like one whatever the gateway hinted
                    // (a gateway that closes right after `hello-ok` with
                    // `restartExpectedMs: 0` must not be reconnected to at a
                    // fixed rate forever).
                    let stable = started.elapsed() >= STABLE_SESSION;
                    if stable {
                        failures = 0;
                    }
                    failures += 1;
                    super::delay_after_session(
                        end.restart_expected,
                        stable,
                        self.opts.backoff_initial,
                        self.opts.backoff_max,
                        failures,
                    )
                }
                Ok(Err(e)) => {
                    failures += 1;
                    self.log_failure(&e.error, failures);
                    // (A refused TLS certificate says nothing about the credential.)
                    let gateway_refused = e.error.code == StudioCode::UpstreamRejected.as_str();
                    if e.rejected
                        && gateway_refused
                        && self.token.is_none()
                        && self.offered.take().is_some()
                    {
                        // The client's own credential was refused: do not keep
                        // retrying it; wait for settings or another client's.
                        match self.park(e.error, true).await {
                            Parked::Cancelled => break,
                            _ => continue 'attempts,
                        }
                    }
                    let delay = if e.rejected {
                        phase_after = Phase::Rejected;
                        tracing::error!(
                            code = %e.error.code,
                            "the gateway rejected the broker; retrying only every {} s until the settings are fixed",
                            self.opts.backoff_max.as_secs()
                        );
                        self.opts.backoff_max
                    } else {
                        self.retry_delay(e.retry_after, failures)
                    };
                    let mut error = e.error;
                    if error.retry_after_ms.is_some() {
                        // The gateway's own hint, as the broker will honour it.
                        error.retry_after_ms = Some(delay.as_millis() as u64);
                    }
                    self.attempt_failed(error.clone());
                    self.status.send_modify(|s| s.last_error = Some(error));
                    delay
                }
                Err(_) => {
                    failures += 1;
                    let e = super::handshake::handshake_timed_out(
                        &self.url,
                        self.opts.handshake_timeout,
                    );
                    self.log_failure(&e, failures);
                    self.attempt_failed(e.clone());
                    self.status.send_modify(|s| s.last_error = Some(e));
                    backoff_delay(self.opts.backoff_initial, self.opts.backoff_max, failures)
                }
            };
            let rejected = phase_after == Phase::Rejected;
            let delay = if !rejected && super::is_loopback_url(&self.url) {
                delay.min(super::LOOPBACK_BACKOFF_MAX)
            } else {
                delay
            };
            let mut retry_at = Instant::now() + delay;
            self.status.send_modify(|s| {
                s.phase = phase_after;
                s.retry_at = Some(retry_at.into_std());
            });
            tracing::debug!(
                session = %self.spec.label,
                upstream_phase = phase_after.as_str(),
                delay_ms = delay.as_millis() as u64,
                "next upstream attempt scheduled"
            );
            // A nudge left over from before this wait is stale.
            let nudge = Arc::clone(&self.nudge);
            loop {
                tokio::select! {
                    _ = self.cancel.cancelled() => break 'attempts,
                    _ = tokio::time::sleep_until(retry_at) => break,
                    _ = nudge.notified(), if !rejected && self.spec.nudgeable => {
                        let earliest = (attempt_started + super::NUDGE_MIN_INTERVAL).max(Instant::now());
                        if earliest < retry_at {
                            tracing::debug!("a local client is waiting: trying the gateway sooner");
                            retry_at = earliest;
                            self.status.send_modify(|s| s.retry_at = Some(retry_at.into_std()));
                        }
                    }
                    changed = self.target.changed() => {
                        if changed.is_err() {
                            break 'attempts;
                        }
                        tracing::info!("settings changed: reconnecting now");
                        failures = 0;
                        break;
                    }
                }
            }
        }
        self.set_phase(Phase::Stopped);
    }

    /// The session handed over was not taken: it ends here, as a session
    /// of its own generation, so the requests in flight on it (waiting for
    /// answers that will not come) are answered once, failed with
    /// `sent: true`, and the next attempt opens the next generation.
    fn takeover_refused(&mut self) {
        let mut generation = 0;
        self.status.send_modify(|s| {
            generation = s.generation;
            s.generation += 1;
        });
        let reason =
            "the gateway connection handed over by the previous instance could not be taken over"
                .to_owned();
        self.owner.ended(
            generation,
            &super::SessionEnded {
                error: ErrorShape::studio(
                    StudioCode::UpstreamClosed,
                    format!("the gateway session ended before the answer: {reason}"),
                ),
                reason,
                cancelled: false,
                restart_hint: None,
                gateway_close_code: None,
                unsent: Vec::new(),
            },
        );
    }

    /// The session the previous instance handed over, if this connector's
    /// settings name the same gateway (else its socket is closed and the
    /// connector connects itself: a reconnect for the moved clients).
    async fn take_over(&self, takeover: super::Takeover) -> Option<(Ws, UpstreamHello)> {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => return None,
            // Ahead of the moved clients, which wait for its session next.
            _ = takeover.gate.passed_first() => {}
        }
        if takeover.url != redact_url(&self.url) {
            tracing::info!(
                "handover: the settings name another gateway; not taking the gateway connection over"
            );
            return None;
        }
        match take_over_socket(takeover.socket, &self.opts).await {
            Ok(ws) => Some((ws, takeover.hello)),
            Err(e) => {
                tracing::warn!("handover: the gateway connection cannot be taken over ({e})");
                None
            }
        }
    }

    /// Opens the socket and performs the handshake. Events that arrive
    /// before `hello-ok` are returned so they can be published after it.
    async fn attempt(&mut self) -> Result<(Ws, UpstreamHello, EarlyEvents), AttemptError> {
        let mut ws = open_socket(
            &self.url,
            &self.opts,
            &self.tls,
            &mut self.tls_client,
            &self.peer_certificate,
            // The backend connection is no browser: no `Origin`.
            None,
        )
        .await?;
        self.set_phase(Phase::Handshaking);
        let challenge = loop {
            let text = next_text(&mut ws).await?;
            if let Some(UpstreamFrame::Event { name, payload, .. }) = UpstreamFrame::parse(&text) {
                if name == "connect.challenge" {
                    break Challenge::parse(payload);
                }
            }
        };
        if challenge.nonce.is_none() && self.identity.is_some() {
            tracing::warn!(
                "the gateway's challenge has no nonce: connecting without the device identity"
            );
        }
        self.next_connect_id += 1;
        let connect_id = format!("clawmux-connect-{}", self.next_connect_id);
        // The stored device token is read per attempt (only needed when no
        // shared token is configured), so a token another broker sharing
        // the state dir just received is used.
        let device_token = match self.token {
            None => self.stored_device_token().await,
            Some(_) => None,
        };
        let offered = self.offered.as_ref();
        let credentials = Credentials {
            token: self
                .token
                .as_ref()
                .or(offered.and_then(|o| o.token.as_ref())),
            device_token: device_token.as_ref(),
            password: self
                .password
                .as_ref()
                .or(offered.and_then(|o| o.password.as_ref())),
        };
        let scopes: Vec<&str> = self.spec.scopes.iter().map(String::as_str).collect();
        let params = connect_params(
            &self.instance_id,
            credentials,
            self.identity.as_deref(),
            &challenge,
            &scopes,
        );
        tracing::debug!(
            device = params.get("device").is_some(),
            auth = if self.token.is_some() {
                "token"
            } else if device_token.is_some() {
                "deviceToken"
            } else {
                "none"
            },
            "sending the upstream connect"
        );
        let raw = serde_json::value::to_raw_value(&params).map_err(|e| {
            AttemptError::new(
                StudioCode::UpstreamError,
                format!("cannot encode connect: {e}"),
            )
        })?;
        ws.send(Message::text(encode_req(
            &connect_id,
            "connect",
            Some(&raw),
        )))
        .await
        .map_err(|e| {
            AttemptError::new(
                StudioCode::UpstreamError,
                format!("cannot send connect: {e}"),
            )
        })?;
        let mut early = EarlyEvents::default();
        loop {
            let text = next_text(&mut ws).await?;
            match UpstreamFrame::parse(&text) {
                Some(UpstreamFrame::Res {
                    id,
                    ok,
                    payload,
                    error,
                }) if id == connect_id => {
                    if ok {
                        let payload: Value = payload
                            .and_then(|p| serde_json::from_str(p.get()).ok())
                            .unwrap_or(Value::Null);
                        let (mut hello, minted) = parse_hello(payload, &self.spec.scopes);
                        hello.challenge_extra = challenge.extra.clone();
                        if let Some(minted) = minted.filter(|_| self.spec.keep_device_token) {
                            self.keep_device_token(minted, hello.scopes.clone()).await;
                        }
                        return Ok((ws, hello, early));
                    }
                    let error: Value = error
                        .and_then(|e| serde_json::from_str(e.get()).ok())
                        .unwrap_or(Value::Null);
                    return Err(rejection(error));
                }
                Some(UpstreamFrame::Event { .. }) => early.push(text),
                _ => {}
            }
        }
    }

    /// The device token stored for this gateway, read off the runtime's
    /// threads (it is a file; another broker sharing the state dir may
    /// have just stored one).
    async fn stored_device_token(&self) -> Option<Secret> {
        let identity = self.identity.clone()?;
        let url = self.url.clone();
        tokio::task::spawn_blocking(move || identity.stored_token(&url))
            .await
            .ok()
            .flatten()
    }

    /// The attempt under way failed: its generation is closed (requests
    /// queued for it are withdrawn unwritten and answered "not sent", later
    /// ones refused), and the next attempt takes a new one, so nothing meant
    /// for this attempt is ever written on a later session.
    fn attempt_failed(&self, error: ErrorShape) {
        let generation = self.status.borrow().generation;
        // No socket was installed: whatever was queued is withdrawn unwritten.
        let _withdrawn = self.outlet.close(generation);
        self.status.send_modify(|s| s.generation = generation + 1);
        self.owner.attempt_failed(generation, &error);
    }

    /// Logs a failed attempt: the first of a run of failures, a change of
    /// cause, and then a summary at 2, 4, 8… failures (a gateway that is
    /// down for an hour costs a dozen lines, not thousands).
    fn log_failure(&self, error: &ErrorShape, failures: u32) {
        let changed = self
            .status
            .borrow()
            .last_error
            .as_ref()
            .is_none_or(|last| last.code != error.code);
        if failures == 1 || changed {
            tracing::warn!(session = %self.spec.label, code = %error.code, "upstream connect failed: {}", error.message);
        } else if failures.is_power_of_two() {
            tracing::warn!(session = %self.spec.label, code = %error.code, failures, "upstream connect still failing after {failures} attempts: {}", error.message);
        } else {
            tracing::debug!(session = %self.spec.label, code = %error.code, failures, "upstream connect failed: {}", error.message);
        }
    }

    /// The delay before the next attempt after `failures` failures in a
    /// row: the gateway's own hint, clamped, or exponential backoff.
    fn retry_delay(&self, hint: Option<Duration>, failures: u32) -> Duration {
        let (initial, max) = (self.opts.backoff_initial, self.opts.backoff_max);
        match hint {
            Some(hint) => clamp_hint(hint, initial, max, failures),
            None => backoff_delay(initial, max, failures),
        }
    }

    /// Persists the device token the gateway minted, so a later connect
    /// without a shared token can still authenticate. The store syncs the
    /// file to disk, so it runs off the runtime's threads.
    async fn keep_device_token(&self, minted: MintedToken, scopes: Vec<String>) {
        let Some(identity) = self.identity.clone() else {
            return;
        };
        let url = self.url.clone();
        let device_id = identity.device_id().to_owned();
        let stored = tokio::task::spawn_blocking(move || {
            identity.store_token(
                &url,
                &minted.role,
                &minted.token,
                &scopes,
                minted.issued_at_ms,
            )
        })
        .await;
        match stored {
            Ok(Ok(true)) => tracing::info!(device_id, "stored the device token the gateway issued"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(device_id, "cannot store the device token: {e}"),
            Err(e) => tracing::warn!(device_id, "cannot store the device token: {e}"),
        }
    }
}

/// How a session began, for its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// The connector's first.
    First,
    /// A session of this connector was ready before.
    Reconnect,
    /// The previous instance handed it over (design §11).
    Adopted,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_events_are_kept_up_to_their_bounds() {
        let mut early = EarlyEvents::default();
        for _ in 0..EARLY_EVENTS_MAX + 5 {
            early.push("{}".into());
        }
        assert_eq!(early.frames.len(), EARLY_EVENTS_MAX);
        assert!(early.overflowed);
        let mut big = EarlyEvents::default();
        big.push("x".repeat(EARLY_EVENTS_MAX_BYTES - 10));
        big.push("x".repeat(11));
        assert_eq!((big.frames.len(), big.overflowed), (1, true));
    }
}
