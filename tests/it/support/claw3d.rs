//! A test client that reproduces Claw3D's gateway client: its connect, its
//! close after a failed connect answer, and its retry policy. Claw3D cannot
//! be installed from the registries here, so this follows its source,
//! iamlukethedev/Claw3D at eeb6f31f06c6c9a9f32bf359339fe547d5b92c47:
//!
//! - `src/lib/gateway/openclaw/GatewayBrowserClient.ts` 569-585 (the connect
//!   params), 612-631 (a failed connect answer: close `4008` with
//!   `connect failed: CODE MESSAGE`), 404-420 (that reason cut to 123 UTF-8
//!   bytes);
//! - `src/lib/gateway/GatewayClient.ts` 103-118 (`parseConnectFailedCloseReason`),
//!   311-337 (`onClose`: a `4008` close becomes the connect error, any other
//!   close `Gateway closed (CODE): REASON`), 347-358 (13 s connect timeout),
//!   425-437 (`isGatewayDisconnectLikeError`: only `1012` among closes),
//!   638-650 (`isAuthError`), 652-699 (`NON_RETRYABLE_CONNECT_ERROR_CODES`
//!   and `resolveGatewayAutoRetryDelayMs`: 2 s × 1.5^attempt up to 30 s,
//!   at most 20 attempts, none for a final code or an auth-like message).
//!
//! Include with `#[path = "support/claw3d.rs"]`.

#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

use crate::differential::{Conn, Frame};

/// GatewayClient.ts 656-664.
pub const NON_RETRYABLE_CONNECT_ERROR_CODES: [&str; 7] = [
    "studio.gateway_url_missing",
    "studio.gateway_token_missing",
    "studio.gateway_url_invalid",
    "studio.settings_load_failed",
    "studio.upstream_error",
    "studio.upstream_timeout",
    "studio.upstream_rejected",
];

/// GatewayClient.ts 103.
pub const CONNECT_FAILED_CLOSE_CODE: u16 = 4008;
/// GatewayClient.ts 104.
pub const GATEWAY_CONNECT_TIMEOUT: Duration = Duration::from_millis(13_000);

/// GatewayClient.ts 666-670.
pub fn is_non_retryable(code: Option<&str>) -> bool {
    let code = code.unwrap_or("").trim().to_lowercase();
    !code.is_empty() && NON_RETRYABLE_CONNECT_ERROR_CODES.contains(&code.as_str())
}

/// GatewayClient.ts 638-650.
pub fn is_auth_error(message: &str) -> bool {
    let l = message.to_lowercase();
    l.contains("auth")
        || l.contains("unauthorized")
        || l.contains("forbidden")
        || l.contains("invalid token")
        || l.contains("token required")
        || (l.contains("token") && l.contains("not configured"))
        || l.contains("gateway_token_missing")
}

/// GatewayClient.ts 676-699 (`resolveGatewayAutoRetryDelayMs`, for a
/// client that had connected once): `None` = Claw3D stops retrying.
pub fn auto_retry_delay(
    connect_error_code: Option<&str>,
    error_message: &str,
    last_close: u16,
    attempt: u32,
) -> Option<Duration> {
    if attempt >= 20 || is_non_retryable(connect_error_code) {
        return None;
    }
    if connect_error_code.is_none() && is_auth_error(error_message) {
        return None;
    }
    let base = if last_close == 1008 {
        15_000.0
    } else {
        2_000.0
    };
    Some(Duration::from_millis(
        (base * 1.5f64.powi(attempt as i32)).min(30_000.0) as u64,
    ))
}

/// GatewayClient.ts 106-118.
pub fn parse_connect_failed_close_reason(reason: &str) -> Option<(String, String)> {
    let t = reason.trim();
    if !t.to_lowercase().starts_with("connect failed:") {
        return None;
    }
    let rest = t["connect failed:".len()..].trim();
    if rest.is_empty() {
        return None;
    }
    let (code, message) = rest.split_once(' ').unwrap_or((rest, ""));
    let message = if message.trim().is_empty() {
        "connect failed"
    } else {
        message.trim()
    };
    Some((code.trim().to_owned(), message.to_owned()))
}

/// GatewayBrowserClient.ts 407-420: cut to 123 UTF-8 bytes.
pub fn truncate_close_reason(reason: &str) -> String {
    let t = reason.trim();
    if t.is_empty() {
        return "connect failed".into();
    }
    let mut end = t.len().min(123);
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    let out = t[..end].trim_end();
    if out.is_empty() {
        "connect failed".into()
    } else {
        out.to_owned()
    }
}

/// How one connect attempt ended, as Claw3D's `GatewayClient` sees it.
pub enum Outcome {
    /// `onHello`: connected; the open connection.
    Connected(Box<Conn>, Value),
    /// `onClose` before hello: the error Claw3D shows, and the code it
    /// classifies (`Some` only for a parsed `4008` close).
    Failed {
        close: u16,
        error: String,
        code: Option<String>,
    },
}

/// One `GatewayBrowserClient` connect on the broker's socket (`path`, e.g.
/// `/api/gateway/ws`).
pub async fn connect_once(socket: &Path, path: &str, token: &str) -> Outcome {
    let mut c = Conn::unix(socket, path).await;
    // Reads wait longer than the connect timeout: the timeout below decides.
    let wait = GATEWAY_CONNECT_TIMEOUT * 2;
    let attempt = async {
        loop {
            match c.read(wait).await {
                Some(Frame::Json(v)) if v["event"] == "connect.challenge" => break,
                Some(Frame::Json(_)) => continue,
                Some(Frame::Close(code, reason)) => return Err((code, reason)),
                Some(Frame::Eof) | None => return Err((1006, String::new())),
            }
        }
        // GatewayBrowserClient.ts 569-585 (no device in an insecure context).
        c.send(&json!({"type": "req", "id": "claw3d-connect", "method": "connect", "params": {
            "minProtocol": 3, "maxProtocol": 4,
            "client": {"id": "openclaw-control-ui", "version": "dev", "platform": "web", "mode": "ui"},
            "role": "operator",
            "scopes": ["operator.admin", "operator.read", "operator.write", "operator.approvals", "operator.pairing"],
            "caps": [], "auth": {"token": token}, "userAgent": "claw3d-test", "locale": "en"}}))
            .await;
        loop {
            match c.read(wait).await {
                Some(Frame::Json(v)) if v["type"] == "res" && v["id"] == "claw3d-connect" => {
                    return Ok::<Value, (u16, String)>(v)
                }
                Some(Frame::Json(_)) => continue,
                Some(Frame::Close(code, reason)) => return Err((code, reason)),
                Some(Frame::Eof) | None => return Err((1006, String::new())),
            }
        }
    };
    let res = match tokio::time::timeout(GATEWAY_CONNECT_TIMEOUT, attempt).await {
        Ok(Ok(res)) => res,
        Ok(Err((close, reason))) => return failed_by_close(close, &reason),
        Err(_) => {
            // GatewayClient.ts 347-358: stop the client, show the timeout.
            c.close().await;
            return Outcome::Failed {
                close: 1005,
                error: "Timed out connecting to the gateway.".into(),
                code: None,
            };
        }
    };
    if res["ok"] == true {
        let hello = res["payload"].clone();
        return Outcome::Connected(Box::new(c), hello);
    }
    // GatewayBrowserClient.ts 612-631: close 4008 "connect failed: CODE MESSAGE".
    let reason = truncate_close_reason(&format!(
        "connect failed: {} {}",
        res["error"]["code"].as_str().unwrap_or(""),
        res["error"]["message"].as_str().unwrap_or("")
    ));
    c.close_with(CloseFrame {
        code: CloseCode::from(CONNECT_FAILED_CLOSE_CODE),
        reason: reason.clone().into(),
    })
    .await;
    // The close event carries the server's answer to our close.
    let (close, echoed) = c.closed(Duration::from_secs(5)).await;
    failed_by_close(close, &echoed)
}

/// GatewayClient.ts 311-337.
fn failed_by_close(close: u16, reason: &str) -> Outcome {
    let parsed = (close == CONNECT_FAILED_CLOSE_CODE)
        .then(|| parse_connect_failed_close_reason(reason))
        .flatten();
    match parsed {
        Some((code, message)) => Outcome::Failed {
            close,
            error: message,
            code: Some(code),
        },
        None => Outcome::Failed {
            close,
            error: format!("Gateway closed ({close}): {reason}"),
            code: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claw3d_policy_as_in_its_source() {
        assert_eq!(
            parse_connect_failed_close_reason(
                "connect failed: studio.upstream_rejected the gateway refused"
            ),
            Some((
                "studio.upstream_rejected".into(),
                "the gateway refused".into()
            ))
        );
        assert_eq!(parse_connect_failed_close_reason("bye"), None);
        assert_eq!(truncate_close_reason(&"x".repeat(200)).len(), 123);
        assert!(is_non_retryable(Some("studio.upstream_rejected")));
        assert!(!is_non_retryable(Some("studio.upstream_closed")));
        assert_eq!(
            auto_retry_delay(None, "Gateway closed (1012): service restart", 1012, 0),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            auto_retry_delay(Some("studio.upstream_error"), "x", 4008, 0),
            None
        );
        assert_eq!(auto_retry_delay(None, "unauthorized", 1008, 0), None);
    }
}
