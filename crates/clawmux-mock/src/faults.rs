//! Fault-injection knobs of the gateway double.
//!
//! Every knob models something a real OpenClaw Gateway does to its clients
//! (gateway-protocol.md §2.7, §3.5, §11), so broker tests can provoke each
//! failure on demand instead of waiting for a real gateway to misbehave.

use std::time::Duration;

use serde_json::{json, Value};

/// Faults applied by a [`MockGateway`](super::MockGateway) from now on.
///
/// Replace them atomically with [`MockGateway::set_faults`](super::MockGateway::set_faults);
/// connections read the current value at the moment each fault matters
/// (connect time, response time, tick time), so changes take effect at once.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Every `connect` is answered with this error and the socket is closed
    /// with its close code, until the fault is cleared. Use
    /// [`Rejection::pairing_required`] or [`Rejection::token_mismatch`] for the
    /// shapes a real gateway sends.
    pub reject_connect: Option<Rejection>,
    /// The next N connects get the startup answer of a gateway whose sidecars
    /// are not ready yet: `UNAVAILABLE` "gateway starting; retry shortly",
    /// `retryable:true`, `retryAfterMs:500`, then close 1013 "gateway starting".
    /// Decremented once per affected connect.
    pub unavailable_connects: u32,
    /// Do not send `connect.challenge` on open (an old or broken gateway).
    /// A device-signed connect then fails with "device nonce mismatch", because
    /// the server still holds a nonce the client never saw.
    pub no_challenge: bool,
    /// Wait this long before answering `connect` (a gateway under load). The
    /// handshake timeout keeps running meanwhile.
    pub hello_delay: Option<Duration>,
    /// A wedged gateway: no `tick`/`health` events and no responses to
    /// requests. Requests are still recorded, so tests can see what was sent.
    pub silent: bool,
    /// Requests with these methods are recorded but never answered (a stuck
    /// handler), e.g. to exercise a client's per-request timeout.
    pub hold_methods: Vec<String>,
    /// Requests with these methods are answered with this error shape
    /// (`{code, message, details?}`) exactly as given: a gateway whose
    /// errors carry whatever text it likes (e.g. terminal escapes).
    pub fail_methods: Vec<(String, Value)>,
    /// Delay every response by this much (requests are still handled in
    /// arrival order relative to each other's start).
    pub response_delay: Option<Duration>,
    /// If set, hello-ok `auth.scopes` (and the scopes enforced afterwards) are
    /// this list instead of what the client asked for: simulates the silent
    /// scope loss of gateway-protocol.md §2.5.
    pub grant_scopes: Option<Vec<String>>,
    /// The gateway stops reading its sockets (a stuck event loop): what the
    /// broker writes piles up in the socket buffers, while the gateway keeps
    /// sending events. Cleared: reading resumes.
    pub stop_reading: bool,
    /// Close every connection (1012 "service restart") right after its
    /// hello-ok: a gateway that accepts and immediately drops the session.
    pub close_after_hello: bool,
    /// Send this many `tick` events (without `seq`) before each hello-ok.
    pub early_events: usize,
}

/// A handshake rejection: the error `res` sent to the `connect` request,
/// followed by a close frame.
#[derive(Clone, Debug)]
pub struct Rejection {
    /// `error.code`, e.g. `NOT_PAIRED` or `INVALID_REQUEST`.
    pub code: String,
    /// `error.message`.
    pub message: String,
    /// `error.details`, omitted from the frame when `None`.
    pub details: Option<Value>,
    /// WebSocket close code sent right after the error response.
    pub close_code: u16,
    /// Close reason (truncated to 120 bytes like the real gateway does).
    pub close_reason: String,
}

impl Rejection {
    /// An unknown device on a non-local connection (gateway-protocol.md §2.4,
    /// §2.7): `NOT_PAIRED` "pairing required" with
    /// `details {code:"PAIRING_REQUIRED", reason:"not-paired", requestId}`,
    /// close 1008 "pairing required".
    pub fn pairing_required() -> Self {
        Self {
            code: "NOT_PAIRED".into(),
            message: "pairing required".into(),
            details: Some(json!({
                "code": "PAIRING_REQUIRED",
                "reason": "not-paired",
                "requestId": uuid::Uuid::new_v4().to_string(),
            })),
            close_code: 1008,
            close_reason: "pairing required".into(),
        }
    }

    /// A wrong shared token, exactly as in gateway-protocol.md §9 for a
    /// non-CLI, non-browser client; close 1008 with the message as reason.
    pub fn token_mismatch() -> Self {
        let message = "unauthorized: gateway token mismatch (provide gateway auth token)";
        Self {
            code: "INVALID_REQUEST".into(),
            message: message.into(),
            details: Some(json!({
                "code": "AUTH_TOKEN_MISMATCH",
                "authReason": "token_mismatch",
                "canRetryWithDeviceToken": false,
                "recommendedNextStep": "update_auth_credentials",
            })),
            close_code: 1008,
            close_reason: message.into(),
        }
    }

    /// The error object (`ErrorShape`) of the response frame.
    pub(crate) fn error_shape(&self) -> Value {
        let mut error = json!({ "code": self.code, "message": self.message });
        if let Some(details) = &self.details {
            error["details"] = details.clone();
        }
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_mismatch_matches_protocol_example() {
        let r = Rejection::token_mismatch();
        let e = r.error_shape();
        assert_eq!(e["code"], "INVALID_REQUEST");
        assert_eq!(e["details"]["code"], "AUTH_TOKEN_MISMATCH");
        assert_eq!(e["details"]["authReason"], "token_mismatch");
        assert_eq!(r.close_code, 1008);
    }

    #[test]
    fn pairing_required_shape() {
        let r = Rejection::pairing_required();
        assert_eq!(r.code, "NOT_PAIRED");
        assert_eq!(r.error_shape()["details"]["code"], "PAIRING_REQUIRED");
        assert_eq!(r.close_reason, "pairing required");
    }
}
