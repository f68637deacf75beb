//! Error shapes: the gateway's `ErrorShape` and the broker's own `studio.*` codes.

use serde::Serialize;
use serde_json::Value;

/// The gateway's `ErrorShape` (`code` and `message` required; the rest optional).
///
/// Broker errors use the same shape so that a local client cannot tell a
/// broker answer from a gateway answer by its structure, only by its `code`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorShape {
    pub code: String,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    #[serde(rename = "retryAfterMs", skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl ErrorShape {
    /// A gateway-style `INVALID_REQUEST`, used where the gateway itself would answer the same way.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        ErrorShape {
            code: "INVALID_REQUEST".into(),
            message: message.into(),
            details: None,
            retryable: None,
            retry_after_ms: None,
        }
    }

    /// A broker error in the `studio.*` namespace.
    pub fn studio(code: StudioCode, message: impl Into<String>) -> Self {
        ErrorShape {
            code: code.as_str().into(),
            message: message.into(),
            details: None,
            retryable: Some(code.retryable()),
            retry_after_ms: None,
        }
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    /// Says whether the request this error answers reached the gateway, so
    /// a client knows whether a retry could run it twice: `sent: false` (it
    /// was never written to a gateway socket: retrying runs it once) or
    /// `sent: true` (it was written, or may have been, before the session
    /// ended: the gateway may have run it). Merged into `details`; a message
    /// sentence says the same for people.
    pub fn with_sent(mut self, sent: bool) -> Self {
        let mut details = match self.details.take() {
            Some(Value::Object(map)) => map,
            Some(other) => {
                let mut map = serde_json::Map::new();
                map.insert("details".into(), other);
                map
            }
            None => serde_json::Map::new(),
        };
        details.insert("sent".into(), Value::Bool(sent));
        self.details = Some(Value::Object(details));
        self.message.push_str(if sent {
            " (the request had been sent: the gateway may have run it)"
        } else {
            " (the request was not sent to the gateway)"
        });
        self
    }

    /// [`ErrorShape::with_sent`] unless the error already says it.
    pub fn or_sent(self, sent: bool) -> Self {
        if self.says_sent() {
            self
        } else {
            self.with_sent(sent)
        }
    }

    /// Whether `details.sent` is set.
    pub fn says_sent(&self) -> bool {
        self.details
            .as_ref()
            .and_then(|d| d.get("sent"))
            .is_some_and(Value::is_boolean)
    }

    pub fn with_retry_after_ms(mut self, ms: Option<u64>) -> Self {
        self.retry_after_ms = ms;
        self
    }

    pub fn with_retryable(mut self, retryable: bool) -> Self {
        self.retryable = Some(retryable);
        self
    }

    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

impl std::fmt::Display for ErrorShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// The broker's own error vocabulary (design §3). Each code names one cause
/// and therefore one fix; the README's troubleshooting table lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StudioCode {
    /// A settings file exists but cannot be read or parsed.
    SettingsLoadFailed,
    /// Configuration explicitly leaves the gateway URL empty.
    GatewayUrlMissing,
    /// The gateway URL is not a `ws://` or `wss://` URL.
    GatewayUrlInvalid,
    /// No host credential and the client sent no auth.
    GatewayTokenMissing,
    /// TCP/TLS/WebSocket failure opening the upstream connection.
    UpstreamError,
    /// The upstream did not finish its handshake in time.
    UpstreamTimeout,
    /// The gateway refused the broker's connect (auth, pairing, protocol).
    UpstreamRejected,
    /// The upstream closed (before the connect answer, or mid-session for pending requests).
    UpstreamClosed,
    /// A local client was closed because it did not read its events.
    SlowConsumer,
    /// The broker is at its client limit.
    TooManyClients,
    /// A local client has too many requests in flight.
    TooManyRequests,
    /// A request got no answer before its deadline.
    RequestTimeout,
    /// A replay cursor is older than the replay window.
    ReplayUnavailable,
    /// The broker refuses the request for this client.
    Forbidden,
}

impl StudioCode {
    pub const ALL: [StudioCode; 14] = [
        StudioCode::SettingsLoadFailed,
        StudioCode::GatewayUrlMissing,
        StudioCode::GatewayUrlInvalid,
        StudioCode::GatewayTokenMissing,
        StudioCode::UpstreamError,
        StudioCode::UpstreamTimeout,
        StudioCode::UpstreamRejected,
        StudioCode::UpstreamClosed,
        StudioCode::SlowConsumer,
        StudioCode::TooManyClients,
        StudioCode::TooManyRequests,
        StudioCode::RequestTimeout,
        StudioCode::ReplayUnavailable,
        StudioCode::Forbidden,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StudioCode::SettingsLoadFailed => "studio.settings_load_failed",
            StudioCode::GatewayUrlMissing => "studio.gateway_url_missing",
            StudioCode::GatewayUrlInvalid => "studio.gateway_url_invalid",
            StudioCode::GatewayTokenMissing => "studio.gateway_token_missing",
            StudioCode::UpstreamError => "studio.upstream_error",
            StudioCode::UpstreamTimeout => "studio.upstream_timeout",
            StudioCode::UpstreamRejected => "studio.upstream_rejected",
            StudioCode::UpstreamClosed => "studio.upstream_closed",
            StudioCode::SlowConsumer => "studio.slow_consumer",
            StudioCode::TooManyClients => "studio.too_many_clients",
            StudioCode::TooManyRequests => "studio.too_many_requests",
            StudioCode::RequestTimeout => "studio.request_timeout",
            StudioCode::ReplayUnavailable => "studio.replay_unavailable",
            StudioCode::Forbidden => "studio.forbidden",
        }
    }

    /// Whether trying again later, unchanged, can succeed. Configuration
    /// problems are not retryable: something must be fixed first.
    pub fn retryable(self) -> bool {
        !matches!(
            self,
            StudioCode::SettingsLoadFailed
                | StudioCode::GatewayUrlMissing
                | StudioCode::GatewayUrlInvalid
                | StudioCode::GatewayTokenMissing
                | StudioCode::UpstreamRejected
                | StudioCode::Forbidden
                | StudioCode::ReplayUnavailable
        )
    }
}

impl std::fmt::Display for StudioCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_namespaced_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for c in StudioCode::ALL {
            assert!(c.as_str().starts_with("studio."));
            assert!(seen.insert(c.as_str()));
        }
    }

    #[test]
    fn shape_omits_absent_fields() {
        let e = ErrorShape::invalid_request("nope");
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"code":"INVALID_REQUEST","message":"nope"}"#
        );
        let e = ErrorShape::studio(StudioCode::UpstreamClosed, "gone").with_retry_after_ms(Some(5));
        let v = e.to_json();
        assert_eq!(v["retryable"], true);
        assert_eq!(v["retryAfterMs"], 5);
    }
}
