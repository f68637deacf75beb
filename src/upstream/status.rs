//! Where a gateway session is in its life, as the handle and `/v1/state`
//! see it: its phase, the gateway's `hello-ok`, and why it is not ready.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::protocol::{ErrorShape, StudioCode};

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

/// What the gateway said in its `hello-ok`, as the broker uses it (and
/// passes to its next instance with a moved session).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// The generation of the session that is open, or of the attempt
    /// under way (or last made): every attempt takes a new one.
    pub generation: u64,
    /// Sessions opened (successful handshakes) by this connector.
    pub sessions: u64,
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
            sessions: 0,
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
