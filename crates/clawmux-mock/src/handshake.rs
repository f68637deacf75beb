//! Pure handshake rules of the gateway double: protocol/role/auth admission
//! and Ed25519 device proofs (gateway-protocol.md §2.2–§2.5, §2.7), applied
//! after the schema checks of `schema.rs`.
//!
//! Nothing here touches a socket; `connection.rs` feeds parsed JSON in and
//! turns a [`ConnectError`] into an error `res` plus a close frame. Error
//! texts and their order follow the real server (`message-handler.ts`,
//! `auth-messages.ts`), because clients and tests match on them.

use std::collections::HashMap;

use base64::Engine as _;
use ed25519_dalek::{Signature, Verifier as _, VerifyingKey};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use super::faults::Rejection;
use super::origin::Upgrade;
pub(crate) use super::schema::{validate_connect_params, validate_request_frame};

/// Pre-connect frames above this size close the socket with 1009
/// (`server-constants.ts`; see `connection.rs` for the reason text).
pub(crate) const PREAUTH_MAX_BYTES: usize = 64 * 1024;

/// The server truncates close reasons to this many bytes (`close-reason.ts`).
/// We cut at a UTF-8 boundary, since a WebSocket close reason must be UTF-8.
pub(crate) const CLOSE_REASON_MAX_BYTES: usize = 120;

/// A device signature's `signedAt` may be at most this far from server time.
pub(crate) const DEVICE_SIGNATURE_SKEW_MS: i64 = 2 * 60 * 1000;

/// A failed handshake: the `error` of the `res` frame, then a close frame.
#[derive(Clone, Debug)]
pub(crate) struct ConnectError {
    /// The complete `ErrorShape` object.
    pub error: Value,
    pub close_code: u16,
    pub close_reason: String,
}

impl ConnectError {
    pub(crate) fn new(
        code: &str,
        message: &str,
        details: Option<Value>,
        close_code: u16,
        reason: &str,
    ) -> Self {
        let mut error = json!({ "code": code, "message": message });
        if let Some(details) = details {
            error["details"] = details;
        }
        Self {
            error,
            close_code,
            close_reason: truncate_close_reason(reason),
        }
    }

    /// `INVALID_REQUEST` with `message`, closed 1008 with the same text.
    pub(crate) fn invalid(message: &str) -> Self {
        Self::new("INVALID_REQUEST", message, None, 1008, message)
    }

    /// The startup answer of a gateway whose sidecars are still loading.
    pub(crate) fn gateway_starting() -> Self {
        let mut e = Self::new(
            "UNAVAILABLE",
            "gateway starting; retry shortly",
            Some(json!({ "reason": "startup-sidecars" })),
            1013,
            "gateway starting",
        );
        e.error["retryable"] = Value::Bool(true);
        e.error["retryAfterMs"] = json!(500);
        e
    }
}

impl From<&Rejection> for ConnectError {
    fn from(r: &Rejection) -> Self {
        Self {
            error: r.error_shape(),
            close_code: r.close_code,
            close_reason: truncate_close_reason(&r.close_reason),
        }
    }
}

/// Cuts `reason` to at most [`CLOSE_REASON_MAX_BYTES`] on a char boundary.
pub(crate) fn truncate_close_reason(reason: &str) -> String {
    let mut end = reason.len().min(CLOSE_REASON_MAX_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

// ---------------------------------------------------------------- admission

/// Everything the admission rules need besides the (schema-valid) params.
pub(crate) struct AdmissionInput<'a> {
    pub params: &'a Value,
    /// The nonce this connection's challenge carried (or would have carried).
    pub nonce: &'a str,
    pub now_ms: i64,
    /// The shared gateway token; `None` means auth mode `none`.
    pub expected_token: Option<&'a str>,
    pub server_protocol: u32,
    pub verify_device: bool,
    pub require_device: bool,
    /// Device tokens minted by this double: token → device id.
    pub device_tokens: &'a HashMap<String, String>,
    /// The connection's upgrade request (its `Origin` and `Host`).
    pub upgrade: &'a Upgrade,
}

/// A connect that passed every check.
#[derive(Clone, Debug)]
pub(crate) struct Admitted {
    pub role: String,
    /// The effective scopes (after the device-less scope clearing of §2.5).
    pub scopes: Vec<String>,
    pub caps: Vec<String>,
    /// The verified (or, with verification off, claimed) device id.
    pub device_id: Option<String>,
    /// hello-ok `auth.method`: `token`, `device-token` or `none`.
    pub auth_method: &'static str,
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> Option<&'a str> {
    v.pointer(pointer).and_then(Value::as_str)
}

fn string_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Applies protocol, role, auth and device rules in the order of the real
/// `message-handler.ts`. `params` must already satisfy the schema.
pub(crate) fn admit(input: &AdmissionInput<'_>) -> Result<Admitted, ConnectError> {
    let p = input.params;
    let min = p["minProtocol"].as_u64().unwrap_or(0);
    let max = p["maxProtocol"].as_u64().unwrap_or(0);
    let server = u64::from(input.server_protocol);
    if max < server || min > server {
        let details = json!({
            "code": "PROTOCOL_MISMATCH",
            "expectedProtocol": server,
            "clientMinProtocol": min,
            "clientMaxProtocol": max,
            "minimumProbeProtocol": server.saturating_sub(1),
        });
        return Err(ConnectError::new(
            "INVALID_REQUEST",
            "protocol mismatch",
            Some(details),
            1002,
            "protocol mismatch",
        ));
    }

    let role = str_at(p, "/role").unwrap_or("operator");
    if role != "operator" && role != "node" {
        return Err(ConnectError::invalid("invalid role"));
    }
    let requested_scopes = string_list(p.get("scopes"));
    let client_id = str_at(p, "/client/id").unwrap_or_default();
    let client_mode = str_at(p, "/client/mode").unwrap_or_default();
    let device = p.get("device").filter(|d| d.is_object());
    input.upgrade.check(client_id, client_mode)?;

    // Shared-secret auth state (token mode only; `none` admits everyone).
    let token = str_at(p, "/auth/token").filter(|t| !t.is_empty());
    let password = str_at(p, "/auth/password").filter(|t| !t.is_empty());
    let has_shared = token.is_some() || password.is_some();
    let mut auth_method = if input.expected_token.is_some() {
        "token"
    } else {
        "none"
    };
    let (mut auth_ok, shared_ok, mut reason) = match input.expected_token {
        None => (true, true, ""),
        Some(expected) => match token {
            Some(t) if t == expected => (true, true, ""),
            Some(_) => (false, false, "token_mismatch"),
            None => (false, false, "token_missing"),
        },
    };

    if device.is_none() {
        if client_id == "openclaw-control-ui" {
            let msg = "control ui requires device identity (use HTTPS or localhost secure context)";
            let details = json!({ "code": "CONTROL_UI_DEVICE_IDENTITY_REQUIRED" });
            return Err(ConnectError::new(
                "INVALID_REQUEST",
                msg,
                Some(details),
                1008,
                msg,
            ));
        }
        let may_skip_device = role == "operator" && shared_ok && !input.require_device;
        if !may_skip_device {
            if !auth_ok && has_shared {
                return Err(unauthorized(reason, p, false));
            }
            // The [new] source sends `details.code:"DEVICE_IDENTITY_REQUIRED"`
            // here; the double keeps the `PAIRING_REQUIRED` family code of
            // gateway-protocol.md §2.7, which the broker's tests rely on.
            return Err(ConnectError::new(
                "NOT_PAIRED",
                "device identity required",
                Some(json!({ "code": "PAIRING_REQUIRED" })),
                1008,
                "device identity required",
            ));
        }
    }

    let mut device_id = None;
    if let Some(device) = device {
        if input.verify_device {
            verify_device_proof(input, device, role, &requested_scopes)?;
        }
        let id = device["id"].as_str().unwrap_or_default().to_string();
        // A device this double minted a token for is paired.
        if !input.device_tokens.values().any(|owner| *owner == id) {
            input.upgrade.check_pairing(client_id, client_mode)?;
        }
        if !auth_ok {
            let provided_device_token = str_at(p, "/auth/deviceToken").filter(|t| !t.is_empty());
            let candidate = provided_device_token.or(token);
            let minted_for_this_device = candidate
                .and_then(|t| input.device_tokens.get(t))
                .is_some_and(|owner| *owner == id);
            if minted_for_this_device {
                auth_ok = true;
                auth_method = "device-token";
            } else if provided_device_token.is_some() {
                reason = "device_token_mismatch";
            }
        }
        device_id = Some(id);
    }
    if !auth_ok {
        return Err(unauthorized(reason, p, device.is_some()));
    }
    input.upgrade.check_build(p)?;

    // §2.5 [new]: device-less clients keep their self-declared scopes only as
    // gateway-client/backend or cli/cli (on loopback, which the double always is).
    let keeps_scopes = device.is_some()
        || (client_id == "gateway-client" && client_mode == "backend")
        || (client_id == "cli" && client_mode == "cli");
    Ok(Admitted {
        role: role.to_string(),
        scopes: if keeps_scopes {
            requested_scopes
        } else {
            Vec::new()
        },
        caps: string_list(p.get("caps")),
        device_id,
        auth_method,
    })
}

/// The shared-secret failure of `rejectUnauthorized`, with the client-kind
/// hint of `auth-messages.ts` and the structured details of [new] builds.
fn unauthorized(reason: &str, params: &Value, has_device: bool) -> ConnectError {
    let client_id = str_at(params, "/client/id").unwrap_or_default();
    let mode = str_at(params, "/client/mode").unwrap_or_default();
    let is_browser = matches!(client_id, "openclaw-control-ui" | "webchat-ui") || mode == "webchat";
    let hint = if mode == "cli" {
        "use this gateway's gateway.auth.token or pair the device"
    } else if is_browser {
        "open the dashboard URL and paste the token in Control UI settings"
    } else {
        "provide gateway auth token"
    };
    let message = match reason {
        "token_missing" => format!("unauthorized: gateway token missing ({hint})"),
        "token_mismatch" => format!("unauthorized: gateway token mismatch ({hint})"),
        "device_token_mismatch" => {
            "unauthorized: device token mismatch (rotate/reissue device token)".to_string()
        }
        _ => "unauthorized".to_string(),
    };
    let code = match reason {
        "token_missing" => "AUTH_TOKEN_MISSING",
        "token_mismatch" => "AUTH_TOKEN_MISMATCH",
        "device_token_mismatch" => "AUTH_DEVICE_TOKEN_MISMATCH",
        _ => "AUTH_UNAUTHORIZED",
    };
    let provided_device_token = str_at(params, "/auth/deviceToken").is_some_and(|t| !t.is_empty());
    let can_retry = reason == "token_mismatch" && has_device && !provided_device_token;
    let next_step = if can_retry {
        "retry_with_device_token"
    } else if reason == "token_missing" {
        "update_auth_configuration"
    } else {
        "update_auth_credentials"
    };
    let details = json!({
        "code": code,
        "authReason": reason,
        "canRetryWithDeviceToken": can_retry,
        "recommendedNextStep": next_step,
    });
    ConnectError::new("INVALID_REQUEST", &message, Some(details), 1008, &message)
}

fn device_error(reason: &str, message: &str) -> ConnectError {
    let code = match reason {
        "device-id-mismatch" => "DEVICE_AUTH_DEVICE_ID_MISMATCH",
        "device-signature-stale" => "DEVICE_AUTH_SIGNATURE_EXPIRED",
        "device-nonce-missing" => "DEVICE_AUTH_NONCE_REQUIRED",
        "device-nonce-mismatch" => "DEVICE_AUTH_NONCE_MISMATCH",
        "device-signature" => "DEVICE_AUTH_SIGNATURE_INVALID",
        "device-public-key" => "DEVICE_AUTH_PUBLIC_KEY_INVALID",
        _ => "DEVICE_AUTH_INVALID",
    };
    let details = json!({ "code": code, "reason": reason });
    ConnectError::new("INVALID_REQUEST", message, Some(details), 1008, message)
}

/// Decodes base64url leniently (padding and the standard alphabet are
/// tolerated, as Node's `Buffer.from(…, "base64")` does).
pub(crate) fn decode_base64url(s: &str) -> Option<Vec<u8>> {
    let normalized: String = s
        .trim()
        .trim_end_matches('=')
        .chars()
        .map(|c| match c {
            '+' => '-',
            '/' => '_',
            c => c,
        })
        .collect();
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(normalized)
        .ok()
}

/// Lowercase hex SHA-256 of the raw public key: the device id of §2.4.
pub(crate) fn device_id_for_public_key(raw: &[u8]) -> String {
    Sha256::digest(raw)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `|`-joined string a device signs (§2.4). `v3` appends the normalized
/// platform and device family to the `v2` fields.
pub(crate) fn device_auth_payload(
    version: &str,
    params: &Value,
    role: &str,
    scopes: &[String],
    signed_at_ms: i64,
    nonce: &str,
) -> String {
    let device_id = str_at(params, "/device/id").unwrap_or_default();
    let client_id = str_at(params, "/client/id").unwrap_or_default();
    let client_mode = str_at(params, "/client/mode").unwrap_or_default();
    let token = str_at(params, "/auth/token")
        .or_else(|| str_at(params, "/auth/deviceToken"))
        .or_else(|| str_at(params, "/auth/bootstrapToken"))
        .unwrap_or_default();
    let mut parts = vec![
        version.to_string(),
        device_id.to_string(),
        client_id.to_string(),
        client_mode.to_string(),
        role.to_string(),
        scopes.join(","),
        signed_at_ms.to_string(),
        token.to_string(),
        nonce.to_string(),
    ];
    if version == "v3" {
        let norm = |ptr: &str| {
            str_at(params, ptr)
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        };
        parts.push(norm("/client/platform"));
        parts.push(norm("/client/deviceFamily"));
    }
    parts.join("|")
}

/// Verifies the device block: id derivation, freshness, nonce, then the
/// signature over the v3 payload and, failing that, the v2 payload.
fn verify_device_proof(
    input: &AdmissionInput<'_>,
    device: &Value,
    role: &str,
    scopes: &[String],
) -> Result<(), ConnectError> {
    let claimed_id = device["id"].as_str().unwrap_or_default();
    let public_key = device["publicKey"].as_str().and_then(decode_base64url);
    let derived = public_key.as_deref().map(device_id_for_public_key);
    if derived.as_deref() != Some(claimed_id) {
        return Err(device_error(
            "device-id-mismatch",
            "device identity mismatch",
        ));
    }
    let signed_at = device["signedAt"]
        .as_f64()
        .map(|f| f as i64)
        .unwrap_or(i64::MIN / 2);
    if (input.now_ms - signed_at).abs() > DEVICE_SIGNATURE_SKEW_MS {
        return Err(device_error(
            "device-signature-stale",
            "device signature expired",
        ));
    }
    let nonce = device["nonce"].as_str().unwrap_or_default().trim();
    if nonce.is_empty() {
        return Err(device_error(
            "device-nonce-missing",
            "device nonce required",
        ));
    }
    if nonce != input.nonce {
        return Err(device_error(
            "device-nonce-mismatch",
            "device nonce mismatch",
        ));
    }
    let key_bytes: Option<[u8; 32]> = public_key.and_then(|k| k.try_into().ok());
    let Some(key) = key_bytes.and_then(|b| VerifyingKey::from_bytes(&b).ok()) else {
        return Err(device_error(
            "device-public-key",
            "device public key invalid",
        ));
    };
    let signature = device["signature"]
        .as_str()
        .and_then(decode_base64url)
        .and_then(|s| Signature::from_slice(&s).ok());
    let valid = signature.is_some_and(|sig| {
        ["v3", "v2"].iter().any(|version| {
            let payload =
                device_auth_payload(version, input.params, role, scopes, signed_at, nonce);
            key.verify(payload.as_bytes(), &sig).is_ok()
        })
    });
    if !valid {
        return Err(device_error("device-signature", "device signature invalid"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Value {
        json!({
            "minProtocol": 3, "maxProtocol": 4,
            "client": {"id": "gateway-client", "version": "1", "platform": "linux", "mode": "backend"},
            "role": "operator", "scopes": ["operator.read"], "auth": {"token": "t"}
        })
    }

    static NO_UPGRADE: Upgrade = Upgrade {
        origin: None,
        host: None,
    };

    fn input<'a>(p: &'a Value, tokens: &'a HashMap<String, String>) -> AdmissionInput<'a> {
        AdmissionInput {
            params: p,
            nonce: "n",
            now_ms: 0,
            expected_token: Some("t"),
            server_protocol: 4,
            verify_device: true,
            require_device: false,
            device_tokens: tokens,
            upgrade: &NO_UPGRADE,
        }
    }

    #[test]
    fn admission_rules() {
        let tokens = HashMap::new();
        let p = params();
        let ok = admit(&input(&p, &tokens)).expect("admitted");
        assert_eq!(ok.scopes, vec!["operator.read".to_string()]);

        let mut p = params();
        p["auth"]["token"] = json!("wrong");
        let err = admit(&input(&p, &tokens)).unwrap_err();
        assert_eq!(err.error["details"]["code"], "AUTH_TOKEN_MISMATCH");
        assert_eq!(err.close_code, 1008);

        let mut p = params();
        p.as_object_mut().map(|o| o.remove("auth"));
        let err = admit(&input(&p, &tokens)).unwrap_err();
        assert_eq!(err.error["code"], "NOT_PAIRED");

        let mut p = params();
        p["client"]["id"] = json!("test");
        p["client"]["mode"] = json!("test");
        assert!(admit(&input(&p, &tokens))
            .expect("admitted")
            .scopes
            .is_empty());

        let mut p = params();
        p["maxProtocol"] = json!(3);
        assert_eq!(admit(&input(&p, &tokens)).unwrap_err().close_code, 1002);

        let mut p = params();
        p["role"] = json!("admin");
        assert_eq!(
            admit(&input(&p, &tokens)).unwrap_err().error["message"],
            "invalid role"
        );
    }

    #[test]
    fn close_reason_is_cut_on_char_boundary() {
        let long = "é".repeat(100);
        let cut = truncate_close_reason(&long);
        assert!(cut.len() <= CLOSE_REASON_MAX_BYTES);
        assert_eq!(cut.len() % 2, 0);
    }
}
