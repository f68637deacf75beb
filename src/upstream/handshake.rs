//! The broker's side of the gateway handshake, apart from the socket: the
//! `connect` it sends (credentials, device proof), reading the challenge
//! and the `hello-ok`, and mapping every failure to a `studio.*` error.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::identity::{ConnectProof, DeviceIdentity};
use super::UpstreamHello;
use crate::config::Secret;
use crate::protocol::frames::string_array;
use crate::protocol::{now_ms, ErrorShape, StudioCode, PROTOCOL_MAX, PROTOCOL_MIN};

pub use super::movable::UpstreamIo;

pub type Ws = WebSocketStream<Box<dyn UpstreamIo>>;

/// The broker's `client` identity upstream (gateway-protocol.md §2.5: the
/// one that keeps its scopes on loopback with a token alone).
const CLIENT_ID: &str = "gateway-client";
const CLIENT_MODE: &str = "backend";
const ROLE: &str = "operator";

/// Why one connection attempt failed.
#[derive(Debug)]
pub(super) struct AttemptError {
    pub error: ErrorShape,
    /// The gateway refused us for a reason retrying will not fix (auth,
    /// pairing, protocol): retry only every `backoff_max`.
    pub rejected: bool,
    /// The gateway said when to retry (`retryAfterMs`).
    pub retry_after: Option<Duration>,
}

impl AttemptError {
    pub(super) fn new(code: StudioCode, message: String) -> Self {
        AttemptError {
            error: ErrorShape::studio(code, message),
            rejected: false,
            retry_after: None,
        }
    }
}

/// What the `connect.challenge` carried.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Challenge {
    pub nonce: Option<String>,
    /// The gateway's clock when it sent the challenge (`ts`).
    pub ts: Option<u64>,
    /// Everything else the gateway put in its challenge (e.g.
    /// `capabilities`), passed on in the challenge local clients get.
    pub extra: serde_json::Map<String, Value>,
}

impl Challenge {
    pub(super) fn parse(payload: Option<&serde_json::value::RawValue>) -> Challenge {
        let payload: Value = payload
            .and_then(|p| serde_json::from_str(p.get()).ok())
            .unwrap_or(Value::Null);
        Challenge {
            nonce: payload
                .get("nonce")
                .and_then(Value::as_str)
                .filter(|n| !n.trim().is_empty())
                .map(str::to_owned),
            ts: payload.get("ts").and_then(Value::as_u64),
            extra: match &payload {
                Value::Object(map) => map
                    .iter()
                    .filter(|(k, _)| k.as_str() != "nonce" && k.as_str() != "ts")
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                _ => Default::default(),
            },
        }
    }
}

/// The credentials of one `connect`.
///
/// The shared token wins when there is one, and the stored device token is
/// then not sent at all: the gateway ignores a device token once the shared
/// token matched, and when the shared token is wrong a (possibly stale)
/// device token would either hide that (the connect succeeds on a token the
/// operator believes revoked) or replace `AUTH_TOKEN_MISMATCH` by a device
/// token error that points at the wrong fix. This is also the Node
/// reference client's choice (`selectGatewayConnectAuth`). The device token
/// is used only when no shared token is configured.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Credentials<'a> {
    pub token: Option<&'a Secret>,
    pub device_token: Option<&'a Secret>,
    /// A password a local client supplied (the host has no token).
    pub password: Option<&'a Secret>,
}

/// The broker's `connect` params. The device block is added when there is
/// an identity and the challenge carried a nonce to sign.
pub(super) fn connect_params(
    instance_id: &str,
    credentials: Credentials<'_>,
    identity: Option<&DeviceIdentity>,
    challenge: &Challenge,
    scopes: &[&str],
) -> Value {
    let platform = std::env::consts::OS;
    let mut params = json!({
        "minProtocol": PROTOCOL_MIN,
        "maxProtocol": PROTOCOL_MAX,
        "client": {
            "id": CLIENT_ID,
            "displayName": "clawmux",
            "version": env!("CARGO_PKG_VERSION"),
            "platform": platform,
            "mode": CLIENT_MODE,
            "instanceId": instance_id,
        },
        "role": ROLE,
        "scopes": scopes,
        "caps": ["tool-events"],
        "userAgent": concat!("clawmux/", env!("CARGO_PKG_VERSION")),
    });
    let (signed_token, auth) = match (credentials.token, credentials.device_token) {
        (Some(token), _) => (token.expose(), Some(json!({ "token": token.expose() }))),
        (None, Some(dt)) if identity.is_some() => {
            (dt.expose(), Some(json!({ "deviceToken": dt.expose() })))
        }
        _ => match credentials.password {
            Some(pw) => ("", Some(json!({ "password": pw.expose() }))),
            None => ("", None),
        },
    };
    if let Some(auth) = auth {
        params["auth"] = auth;
    }
    if let (Some(identity), Some(nonce)) = (identity, challenge.nonce.as_deref()) {
        // The gateway's own clock (the challenge `ts`) keeps the signature
        // inside its ±2 min window even when this host's clock is off, as
        // the Node reference client does.
        let proof = ConnectProof {
            client_id: CLIENT_ID,
            client_mode: CLIENT_MODE,
            role: ROLE,
            scopes,
            signed_at_ms: challenge.ts.unwrap_or_else(now_ms),
            token: signed_token,
            nonce,
            platform,
            device_family: "",
        };
        params["device"] = identity.sign_connect(&proof);
    }
    params
}

/// Reads the next text frame during the handshake; a close or error becomes
/// the matching `studio.*` failure.
pub(super) async fn next_text(ws: &mut Ws) -> Result<String, AttemptError> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(t))) => return Ok(t.as_str().to_owned()),
            Some(Ok(Message::Close(frame))) => {
                let (code, reason) = frame
                    .map(|f| (u16::from(f.code), f.reason.as_str().to_owned()))
                    .unwrap_or((1005, String::new()));
                return Err(AttemptError {
                    error: closed_before_answer(code, &reason),
                    rejected: code == 1008,
                    retry_after: None,
                });
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                return Err(AttemptError::new(
                    StudioCode::UpstreamClosed,
                    format!("the gateway connection failed during the handshake: {e}"),
                ))
            }
            None => {
                return Err(AttemptError::new(
                    StudioCode::UpstreamClosed,
                    "the gateway closed the connection during the handshake".into(),
                ))
            }
        }
    }
}

/// The gateway closed before answering a `connect`: `1008` is a refusal
/// (`studio.upstream_rejected`, Claw3D's mapping), anything else
/// `studio.upstream_closed`. Shared with the dedicated route.
pub(crate) fn closed_before_answer(code: u16, reason: &str) -> ErrorShape {
    if code == 1008 {
        ErrorShape::studio(
            StudioCode::UpstreamRejected,
            format!("Upstream gateway rejected connect (1008): {reason}"),
        )
        .with_details(json!({"closeCode": code, "closeReason": reason}))
    } else {
        ErrorShape::studio(
            StudioCode::UpstreamClosed,
            format!("Upstream gateway closed ({code}): {reason}"),
        )
    }
}

/// Opening the gateway connection failed (TCP, TLS, WebSocket upgrade).
pub(crate) fn open_failed(url: &str, e: impl std::fmt::Display) -> ErrorShape {
    ErrorShape::studio(
        StudioCode::UpstreamError,
        format!(
            "cannot open the gateway connection to {}: {e}; is the gateway running? (start it: openclaw gateway)",
            crate::config::redact_url(url)
        ),
    )
}

/// The gateway did not complete its handshake within `timeout`.
pub(crate) fn handshake_timed_out(url: &str, timeout: Duration) -> ErrorShape {
    ErrorShape::studio(
        StudioCode::UpstreamTimeout,
        format!(
            "the gateway at {} did not complete its handshake within {} ms",
            crate::config::redact_url(url),
            timeout.as_millis()
        ),
    )
}

/// Maps a gateway `connect` error to the broker's failure. A retryable error
/// (`UNAVAILABLE` while the gateway starts, auth rate limiting) is
/// transient; anything else is a rejection that needs a fix. The gateway's
/// error is kept whole in `details`.
pub(super) fn rejection(error: Value) -> AttemptError {
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("connect refused");
    let retryable = error.get("retryable").and_then(Value::as_bool) == Some(true);
    let retry_after = error
        .get("retryAfterMs")
        .and_then(Value::as_u64)
        .map(Duration::from_millis);
    if retryable {
        return AttemptError {
            error: ErrorShape::studio(
                StudioCode::UpstreamClosed,
                format!("the gateway is not ready yet: {message}"),
            )
            .with_details(error.clone()),
            rejected: false,
            retry_after,
        };
    }
    let detail_code = error
        .pointer("/details/code")
        .and_then(Value::as_str)
        .unwrap_or("");
    // What to do and the gateway's own words come first, short: clients
    // such as Claw3D show the message in a close reason, which the
    // WebSocket spec cuts at 123 bytes ("connect failed: <code> " takes 41
    // of them).
    let first = match detail_code {
        "AUTH_DEVICE_TOKEN_MISMATCH" => "set clawmux's gateway token (--token-file)",
        c if c.starts_with("AUTH_") => "check clawmux's gateway token",
        "PAIRING_REQUIRED" => "approve clawmux's device on the gateway host",
        "DEVICE_IDENTITY_REQUIRED" => "turn clawmux's device identity on",
        c if c.starts_with("DEVICE_AUTH_") => "check this host's clock",
        "PROTOCOL_MISMATCH" => "upgrade clawmux or the gateway",
        _ => "see clawmux's log",
    };
    // A remote gateway asks for the broker's device to be approved: name
    // the exact command (the gateway's own remediation, with this request).
    let pairing_hint;
    let hint = match detail_code {
        "AUTH_DEVICE_TOKEN_MISMATCH" => {
            "; the stored device token is no longer valid: configure the gateway token (--token-file)"
        }
        c if c.starts_with("AUTH_") => {
            "; check the token (gateway.auth.token in the gateway's openclaw.json)"
        }
        "PAIRING_REQUIRED" => {
            let approve = match error.pointer("/details/requestId").and_then(Value::as_str) {
                Some(id) if !id.is_empty() && id.len() <= 128 => {
                    format!("openclaw devices approve {id}")
                }
                _ => "openclaw devices approve --latest (then the printed command)".into(),
            };
            pairing_hint = format!(
                "; approve this broker's device on the gateway host: `{approve}`; clawmux retries on its own and is ready once it is approved"
            );
            pairing_hint.as_str()
        }
        "DEVICE_IDENTITY_REQUIRED" => {
            "; the gateway needs a device identity: keep device identity on (no --no-device-identity, upstream.device_identity = true)"
        }
        c if c.starts_with("DEVICE_AUTH_") => {
            "; the gateway refused the broker's device proof (is this host's clock right?)"
        }
        "PROTOCOL_MISMATCH" => {
            "; the gateway speaks a protocol this clawmux does not: upgrade one of them"
        }
        _ => "",
    };
    // The gateway suggests a device-token retry to a device-signed client
    // with a wrong shared token; for the broker the fix is the token.
    let next_step = match error.pointer("/details/recommendedNextStep").and_then(Value::as_str) {
        Some("retry_with_device_token") if detail_code.starts_with("AUTH_") => {
            " (ignore the gateway's recommendedNextStep \"retry_with_device_token\": it is meant for a paired client app; the broker needs the right shared token)"
        }
        _ => "",
    };
    AttemptError {
        error: ErrorShape::studio(
            StudioCode::UpstreamRejected,
            format!(
                "{first}: {message}; the gateway refused the broker's connect{hint}{next_step}"
            ),
        )
        .with_details(error.clone()),
        rejected: true,
        retry_after: None,
    }
}

/// A device token from `hello-ok.auth`: the broker's own credential, kept
/// in the state dir and never shown to local clients.
#[derive(Debug, Clone)]
pub(super) struct MintedToken {
    pub token: Secret,
    pub role: String,
    pub issued_at_ms: Option<u64>,
}

/// Reads what the broker needs from a `hello-ok` payload, and takes the
/// device token out of it. `requested`: the scopes the connect asked for
/// (what a gateway that does not list its grant is taken to have granted,
/// and what `lost_scopes` is measured against).
pub(super) fn parse_hello(
    mut payload: Value,
    requested: &[String],
) -> (UpstreamHello, Option<MintedToken>) {
    let mut minted = None;
    if let Some(auth) = payload.get_mut("auth").and_then(Value::as_object_mut) {
        let token = auth.remove("deviceToken");
        auth.remove("deviceTokens");
        minted = token
            .as_ref()
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(|t| MintedToken {
                token: Secret::new(t),
                role: auth
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or(ROLE)
                    .to_owned(),
                issued_at_ms: auth.get("issuedAtMs").and_then(Value::as_u64),
            });
    }
    let protocol = payload
        .get("protocol")
        .and_then(Value::as_u64)
        .unwrap_or(PROTOCOL_MAX);
    let server_version = payload
        .pointer("/server/version")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_owned();
    let granted = string_array(payload.pointer("/auth/scopes"));
    let scopes = granted.unwrap_or_else(|| requested.to_vec());
    let lost_scopes = requested
        .iter()
        .filter(|s| !scopes.contains(s))
        .cloned()
        .collect();
    let max_payload = payload
        .pointer("/policy/maxPayload")
        .and_then(Value::as_u64);
    let hello = UpstreamHello {
        payload,
        protocol,
        server_version,
        scopes,
        lost_scopes,
        max_payload,
        challenge_extra: Default::default(),
    };
    (hello, minted)
}

/// The gateway granted fewer scopes than the broker asked for: every local
/// client will get "missing scope" errors for the methods behind them. Said
/// loudly, with the likely fix; `/healthz` also lists them (`lostScopes`).
pub(crate) fn warn_lost_scopes(hello: &UpstreamHello, has_device: bool) {
    let fix = if has_device {
        "approve the broker's scope upgrade on the gateway (openclaw devices list / approve)"
    } else {
        "turn device identity on (drop --no-device-identity) or connect over loopback"
    };
    tracing::warn!(
        lost_scopes = %hello.lost_scopes.join(","),
        granted = %hello.scopes.join(","),
        "SCOPES LOST: the gateway granted fewer scopes than the broker requested; local clients will get \"missing scope\" errors for {}; fix: {fix}",
        hello.lost_scopes.join(", ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::scopes::REQUESTED_SCOPES;

    fn requested() -> Vec<String> {
        REQUESTED_SCOPES.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn hello_parsing_detects_lost_scopes_and_takes_the_device_token() {
        let (h, minted) = parse_hello(
            json!({
                "protocol": 4, "server": {"version": "v"},
                "auth": {"role": "operator", "scopes": ["operator.read"], "deviceToken": "dt", "issuedAtMs": 7},
                "policy": {"maxPayload": 100}
            }),
            &requested(),
        );
        assert_eq!(h.protocol, 4);
        assert_eq!(h.max_payload, Some(100));
        assert!(h.lost_scopes.contains(&"operator.admin".to_string()));
        assert!(h.payload.pointer("/auth/deviceToken").is_none());
        let minted = minted.expect("device token taken");
        assert_eq!(minted.token.expose(), "dt");
        assert_eq!(minted.issued_at_ms, Some(7));
        // Without `auth` (v3.24 without a device token) nothing is lost.
        let (h, minted) = parse_hello(json!({"protocol": 3}), &requested());
        assert!(h.lost_scopes.is_empty() && minted.is_none());
    }

    #[test]
    fn rejections_keep_the_gateway_error() {
        let e = rejection(
            json!({"code":"INVALID_REQUEST","message":"unauthorized: gateway token mismatch","details":{"code":"AUTH_TOKEN_MISMATCH"}}),
        );
        assert!(e.rejected);
        assert_eq!(e.error.code, "studio.upstream_rejected");
        assert_eq!(
            e.error.details.as_ref().unwrap()["details"]["code"],
            "AUTH_TOKEN_MISMATCH"
        );
        // The fix comes first and fits a close reason as Claw3D builds it
        // (`connect failed: <code> <message>`, cut at 123 bytes).
        let reason = format!("connect failed: {} {}", e.error.code, e.error.message);
        let cut = &reason[..123];
        assert!(cut.contains("check clawmux's gateway token"), "{cut}");
        assert!(
            cut.contains("unauthorized: gateway token mismatch"),
            "the gateway's own words survive the cut: {cut}"
        );
        let e = rejection(
            json!({"code":"UNAVAILABLE","message":"gateway starting; retry shortly","retryable":true,"retryAfterMs":500}),
        );
        assert!(!e.rejected);
        assert_eq!(e.retry_after, Some(Duration::from_millis(500)));
    }

    /// A remote gateway's pairing request names the exact approval command.
    #[test]
    fn pairing_required_names_the_approval_command() {
        let e = rejection(json!({"code":"NOT_PAIRED","message":"pairing required",
            "details":{"code":"PAIRING_REQUIRED","reason":"not-paired","requestId":"req-42"}}));
        assert!(e.rejected);
        assert!(
            e.error
                .message
                .contains("`openclaw devices approve req-42`"),
            "{}",
            e.error.message
        );
        assert!(e.error.message.contains("retries on its own"));
        let e = rejection(json!({"code":"NOT_PAIRED","message":"pairing required",
            "details":{"code":"PAIRING_REQUIRED"}}));
        assert!(e
            .error
            .message
            .contains("openclaw devices approve --latest"));
    }

    #[test]
    fn the_shared_token_wins_over_the_device_token() {
        let tmp = tempfile::tempdir().unwrap();
        let id = DeviceIdentity::load_or_create(tmp.path()).unwrap();
        let (token, dt) = (Secret::new("shared"), Secret::new("dt_1"));
        let challenge = Challenge {
            nonce: Some("n-1".into()),
            ts: Some(1234),
            extra: Default::default(),
        };
        let both = Credentials {
            token: Some(&token),
            device_token: Some(&dt),
            password: None,
        };
        let p = connect_params("i", both, Some(&id), &challenge, &REQUESTED_SCOPES);
        assert_eq!(p["auth"], json!({"token": "shared"}));
        assert_eq!(p["device"]["nonce"], "n-1");
        assert_eq!(
            p["device"]["signedAt"], 1234,
            "signed on the gateway's clock"
        );
        let only_dt = Credentials {
            token: None,
            device_token: Some(&dt),
            password: None,
        };
        let p = connect_params("i", only_dt, Some(&id), &challenge, &REQUESTED_SCOPES);
        assert_eq!(p["auth"], json!({"deviceToken": "dt_1"}));
        // No identity: no device block, and a device token alone is useless.
        let p = connect_params("i", only_dt, None, &challenge, &REQUESTED_SCOPES);
        assert!(p.get("device").is_none() && p.get("auth").is_none());
        // No nonce to sign: no device block.
        let p = connect_params(
            "i",
            both,
            Some(&id),
            &Challenge::default(),
            &REQUESTED_SCOPES,
        );
        assert!(p.get("device").is_none());
        assert_eq!(p["client"]["id"], "gateway-client");
        assert_eq!(p["client"]["mode"], "backend");
    }
}
