//! Which credential a client's `connect` carries, and the host token
//! injection when it carries none (Claw3D's rule).

use serde_json::{json, Value};

/// The credential a client's connect params carry, by Claw3D's rule: a
/// non-empty `auth.token`, `auth.password` or `auth.deviceToken`, or a
/// complete `device` block (`id`, `publicKey`, `signature`, `nonce` non-empty
/// strings and `signedAt` a number ≥ 0). `None`: the host token is injected.
pub fn client_auth(params: &Value) -> Option<&'static str> {
    let non_empty = |key: &str| {
        params
            .pointer(&format!("/auth/{key}"))
            .and_then(Value::as_str)
            .is_some_and(|s| !s.trim().is_empty())
    };
    if non_empty("token") {
        Some("token")
    } else if non_empty("password") {
        Some("password")
    } else if non_empty("deviceToken") {
        Some("device-token")
    } else if has_complete_device(params) {
        Some("device")
    } else {
        None
    }
}

fn has_complete_device(params: &Value) -> bool {
    let Some(device) = params.get("device").filter(|d| d.is_object()) else {
        return false;
    };
    let filled = |key: &str| {
        device
            .get(key)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.trim().is_empty())
    };
    ["id", "publicKey", "signature", "nonce"]
        .iter()
        .all(|k| filled(k))
        && device
            .get("signedAt")
            .and_then(Value::as_f64)
            .is_some_and(|t| t >= 0.0)
}

/// The connect frame with `params.auth.token` set (Claw3D's
/// `injectAuthToken`: other `auth` fields and params are kept; params or
/// auth that are not objects become objects). `None` if `text` is not a
/// JSON object.
pub(super) fn inject_token(text: &str, token: &str) -> Option<String> {
    let mut frame: serde_json::Map<String, Value> = serde_json::from_str(text).ok()?;
    let params = frame.entry("params").or_insert_with(|| json!({}));
    if !params.is_object() {
        *params = json!({});
    }
    let auth = params
        .as_object_mut()?
        .entry("auth")
        .or_insert_with(|| json!({}));
    if !auth.is_object() {
        *auth = json!({});
    }
    auth.as_object_mut()?.insert("token".into(), json!(token));
    serde_json::to_string(&frame).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_follows_claw3ds_rule() {
        assert_eq!(client_auth(&json!({})), None);
        assert_eq!(client_auth(&json!({"auth": {"token": "  "}})), None);
        assert_eq!(client_auth(&json!({"auth": {"token": "t"}})), Some("token"));
        assert_eq!(
            client_auth(&json!({"auth": {"password": "p"}})),
            Some("password")
        );
        assert_eq!(
            client_auth(&json!({"auth": {"deviceToken": "d"}})),
            Some("device-token")
        );
        let device =
            json!({"id": "i", "publicKey": "k", "signature": "s", "nonce": "n", "signedAt": 5});
        assert_eq!(client_auth(&json!({"device": device})), Some("device"));
        let mut partial = device.clone();
        partial["signature"] = json!("");
        assert_eq!(client_auth(&json!({"device": partial})), None);
        let mut negative = device;
        negative["signedAt"] = json!(-1);
        assert_eq!(client_auth(&json!({"device": negative})), None);
    }

    #[test]
    fn injection_keeps_everything_else() {
        let text = r#"{"type":"req","id":"c","method":"connect","params":{"minProtocol":3,"auth":{"bootstrapToken":"b"},"x":[1]}}"#;
        let out: Value = serde_json::from_str(&inject_token(text, "T").unwrap()).unwrap();
        assert_eq!(
            out["params"]["auth"],
            json!({"bootstrapToken": "b", "token": "T"})
        );
        assert_eq!(out["params"]["x"], json!([1]));
        assert_eq!(out["id"], "c");
        let bare: Value = serde_json::from_str(
            &inject_token(
                r#"{"type":"req","id":"c","method":"connect","params":7}"#,
                "T",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(bare["params"], json!({"auth": {"token": "T"}}));
        assert_eq!(inject_token("[1]", "T"), None);
    }
}
