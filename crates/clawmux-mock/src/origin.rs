//! The gateway's browser-origin rules, as the double applies them (gateway
//! 2026.9.6: `origin-check.ts`, `ws-origin-policy.ts`, `message-handler.ts`,
//! `node-connect-reconcile.ts`).
//!
//! - A browser UI (`client.id` `openclaw-control-ui` or `webchat-ui`, or
//!   `client.mode` `webchat`), and any client whose upgrade request carried
//!   an `Origin`, must show an acceptable origin, else `INVALID_REQUEST`
//!   `details.code:"CONTROL_UI_ORIGIN_NOT_ALLOWED"`, close 1008. Every
//!   client of the double is on loopback, so a loopback origin is accepted
//!   (`local-loopback`), as is one whose host is the `Host` header
//!   (`private-same-origin`); the double has no allowlist.
//! - A Control UI whose origin is the `Host` header itself is taken for a
//!   page the gateway served, and refused unless it is of the gateway's
//!   build ([`BUILD_ID`]) or `dev`: `UNAVAILABLE` "protocol mismatch:
//!   Control UI updated; …", close 1008.
//! - A device that is new to the gateway is paired silently on loopback,
//!   except for a client with an `Origin` that is no browser UI: `NOT_PAIRED`
//!   "pairing required: device is not approved yet", close 1008.
//!
//! The texts are the real gateway's, measured with the probe of
//! `shared/peers`.

use serde_json::{json, Value};

use super::handshake::ConnectError;

/// The gateway build a Control UI page must come from when its origin is
/// the gateway's own (`client.buildId`).
pub(crate) const BUILD_ID: &str = "2026.9.6-mock";

/// What the double knows of a connection's upgrade request.
#[derive(Clone, Debug, Default)]
pub(crate) struct Upgrade {
    /// Its `Origin` header.
    pub origin: Option<String>,
    /// Its `Host` header.
    pub host: Option<String>,
}

/// `client.id` / `client.mode` name a browser UI whose origin is checked.
pub(crate) fn is_browser_ui(client_id: &str, mode: &str) -> bool {
    matches!(client_id, "openclaw-control-ui" | "webchat-ui") || mode == "webchat"
}

impl Upgrade {
    /// A non-empty `Origin`: the gateway's `hasBrowserOriginHeader`.
    pub(crate) fn has_origin(&self) -> bool {
        self.origin.as_deref().is_some_and(|o| !o.trim().is_empty())
    }

    /// The origin check of the admission phase.
    pub(crate) fn check(&self, client_id: &str, mode: &str) -> Result<(), ConnectError> {
        if !is_browser_ui(client_id, mode) && !self.has_origin() {
            return Ok(());
        }
        let reason = match parse(self.origin.as_deref()) {
            None => "origin missing or invalid",
            Some((host, hostname)) => {
                if is_loopback(&hostname) || self.host.as_deref() == Some(host.as_str()) {
                    return Ok(());
                }
                "origin not allowed"
            }
        };
        let message = "origin not allowed (open the Control UI from the gateway host or allow it in gateway.controlUi.allowedOrigins)";
        Err(ConnectError::new(
            "INVALID_REQUEST",
            message,
            Some(json!({"code": "CONTROL_UI_ORIGIN_NOT_ALLOWED", "reason": reason})),
            1008,
            message,
        ))
    }

    /// The Control UI build check (after authentication).
    pub(crate) fn check_build(&self, params: &Value) -> Result<(), ConnectError> {
        let client_id = params.pointer("/client/id").and_then(Value::as_str);
        let build = params.pointer("/client/buildId").and_then(Value::as_str);
        let own_page = parse(self.origin.as_deref())
            .is_some_and(|(host, _)| self.host.as_deref() == Some(host.as_str()));
        if client_id != Some("openclaw-control-ui")
            || !own_page
            || matches!(build.map(str::trim), Some("dev" | BUILD_ID))
        {
            return Ok(());
        }
        let message = "protocol mismatch: Control UI updated; reload this page to continue";
        let mut e = ConnectError::new(
            "UNAVAILABLE",
            message,
            Some(
                json!({"code": "PROTOCOL_MISMATCH", "gatewayBuildId": BUILD_ID, "reloadRequired": true}),
            ),
            1008,
            message,
        );
        e.error["retryable"] = Value::Bool(false);
        Err(e)
    }

    /// Silent pairing of a device new to the gateway on loopback.
    pub(crate) fn check_pairing(&self, client_id: &str, mode: &str) -> Result<(), ConnectError> {
        if !self.has_origin() || is_browser_ui(client_id, mode) {
            return Ok(());
        }
        let message = "pairing required: device is not approved yet";
        Err(ConnectError::new(
            "NOT_PAIRED",
            message,
            Some(json!({"code": "PAIRING_REQUIRED", "reason": "not-paired"})),
            1008,
            message,
        ))
    }
}

/// `(host[:port], hostname)` of an origin `scheme://host[:port]`, lowercased;
/// `None` for a missing, `null` or malformed one.
fn parse(origin: Option<&str>) -> Option<(String, String)> {
    let origin = origin?.trim();
    let (scheme, rest) = origin.split_once("://")?;
    let host = rest.strip_suffix('/').unwrap_or(rest);
    let valid_scheme = !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c));
    if !valid_scheme || host.is_empty() || host.contains(['/', '?', '#', '\\', '@']) {
        return None;
    }
    let host = host.to_ascii_lowercase();
    let hostname = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default().to_owned(),
        None => host
            .rsplit_once(':')
            .map_or(host.as_str(), |(h, _)| h)
            .to_owned(),
    };
    Some((host, hostname))
}

fn is_loopback(hostname: &str) -> bool {
    hostname == "localhost" || hostname == "::1" || hostname.starts_with("127.")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upgrade(origin: Option<&str>, host: &str) -> Upgrade {
        Upgrade {
            origin: origin.map(str::to_owned),
            host: Some(host.to_owned()),
        }
    }

    #[test]
    fn browser_uis_need_an_acceptable_origin() {
        let ui = ("openclaw-control-ui", "webchat");
        let check = |o: Option<&str>, id: &str, mode: &str| {
            upgrade(o, "127.0.0.1:18789")
                .check(id, mode)
                .map_err(|e| e.error["details"]["reason"].clone())
        };
        assert_eq!(
            check(None, ui.0, ui.1),
            Err(json!("origin missing or invalid"))
        );
        assert_eq!(
            check(Some("null"), ui.0, ui.1),
            Err(json!("origin missing or invalid"))
        );
        assert_eq!(
            check(Some("http://example.com"), ui.0, ui.1),
            Err(json!("origin not allowed"))
        );
        assert_eq!(check(Some("http://localhost:18789"), ui.0, ui.1), Ok(()));
        assert_eq!(
            check(Some("http://[::1]:3000"), "webchat-ui", "webchat"),
            Ok(())
        );
        // Any client with an Origin is checked; without one, only browser UIs.
        assert_eq!(check(None, "cli", "cli"), Ok(()));
        assert_eq!(
            check(Some("http://example.com"), "cli", "cli"),
            Err(json!("origin not allowed"))
        );
    }

    #[test]
    fn a_control_ui_on_the_gateways_own_origin_must_be_its_build() {
        let p = |build: Option<&str>| {
            let mut p = json!({"client": {"id": "openclaw-control-ui", "mode": "webchat"}});
            if let Some(b) = build {
                p["client"]["buildId"] = json!(b);
            }
            p
        };
        let own = upgrade(Some("http://127.0.0.1:18789"), "127.0.0.1:18789");
        let e = own.check_build(&p(None)).unwrap_err();
        assert!(e.error["message"]
            .as_str()
            .unwrap()
            .starts_with("protocol mismatch: Control UI updated"));
        assert_eq!(e.close_code, 1008);
        assert!(own.check_build(&p(Some(BUILD_ID))).is_ok());
        assert!(own.check_build(&p(Some("dev"))).is_ok());
        let cross = upgrade(Some("http://localhost:18789"), "127.0.0.1:18789");
        assert!(cross.check_build(&p(None)).is_ok());
    }
}
