//! Which dedicated clients the gateway connection is opened for with an
//! `Origin` header ([`crate::config::DedicatedOrigin`]).
//!
//! Claw3D's studio proxy opens every gateway connection with an `Origin`
//! derived from the gateway URL (`resolveOriginForUpstream` in
//! `server/gateway-proxy.js`): every client of that proxy is Claw3D's own
//! browser page, and the gateway refuses a browser UI without an `Origin`
//! (`CONTROL_UI_ORIGIN_NOT_ALLOWED`, close 1008). The dedicated route also
//! serves clients that are not browsers (device-signed CLIs and apps,
//! `role: "node"`), and to the gateway an `Origin` makes any connection a
//! browser's (`hasBrowserOriginHeader` in its handshake): the origin check
//! then applies to it, and on loopback a device of a client that is neither
//! a Control UI nor a webchat page is no longer paired silently (a
//! device-signed `cli` with an `Origin` is answered `NOT_PAIRED` "pairing
//! required", measured against gateway 2026.9.6). So the route does what
//! Claw3D does for the clients Claw3D serves, browser clients, and leaves
//! the others as they would connect directly. A client is a browser client
//! when
//!
//! - its own upgrade request carried an `Origin` (every browser sends one,
//!   and so does Claw3D's proxy), or
//! - its `connect` arrived before the gateway connection was opened and
//!   names a browser UI ([`names_browser_ui`]).
//!
//! A client that waits for the gateway's `connect.challenge` before it
//! sends its `connect` (a device-signed one) is known only by its upgrade
//! request: the connection is opened before its `connect` is seen.

use serde_json::Value;

/// Whether `connect` params name a browser UI the gateway checks the origin
/// of: `client.id` `openclaw-control-ui` or `webchat-ui`, or `client.mode`
/// `webchat` (the gateway's `isBrowserOperatorUiClient` and
/// `isWebchatClient`; Claw3D's browser client is `openclaw-control-ui` in
/// mode `webchat`, or `webchat-ui` once its proxy renames a Control UI that
/// has no device).
pub(super) fn names_browser_ui(params: &Value) -> bool {
    let field = |pointer: &str| {
        params
            .pointer(pointer)
            .and_then(Value::as_str)
            .map(|s| s.trim().to_ascii_lowercase())
            .unwrap_or_default()
    };
    matches!(
        field("/client/id").as_str(),
        "openclaw-control-ui" | "webchat-ui"
    ) || field("/client/mode") == "webchat"
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn browser_uis_are_named_by_id_or_webchat_mode() {
        let named =
            |id: &str, mode: &str| names_browser_ui(&json!({"client": {"id": id, "mode": mode}}));
        assert!(named("openclaw-control-ui", "webchat"));
        assert!(named("openclaw-control-ui", "ui"));
        assert!(named("webchat-ui", "webchat"));
        assert!(named("Webchat-UI ", "x"));
        assert!(named("my-page", "webchat"));
        assert!(!named("cli", "cli"));
        assert!(!named("gateway-client", "backend"));
        assert!(!named("node-host", "node"));
        assert!(!names_browser_ui(&json!({})));
    }
}
