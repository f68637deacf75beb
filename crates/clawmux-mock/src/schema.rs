//! The closed JSON schemas the gateway validates frames against
//! (gateway-protocol.md §1, §2.3), with Ajv-style error texts.
//!
//! The real server validates with Ajv and formats errors with
//! `formatValidationErrors` ("at /client/id: must be equal to constant",
//! "at root: unexpected property 'x'"); clients show and match these texts,
//! so the double reproduces them for the first violation (Ajv stops there).
//! The texts were checked against a real 2026.9.6 gateway.

use serde_json::{Map, Value};

/// `client.id` enum of `protocol/client-info.ts`, including the [new] additions.
pub(crate) const CLIENT_IDS: &[&str] = &[
    "webchat-ui",
    "openclaw-control-ui",
    "webchat",
    "cli",
    "gateway-client",
    "openclaw-macos",
    "openclaw-ios",
    "openclaw-android",
    "node-host",
    "test",
    "fingerprint",
    "openclaw-probe",
    "openclaw-browser-copilot",
    "openclaw-tui",
    "openclaw-linux",
    "openclaw-watchos",
    "openclaw-worker",
];

/// `client.mode` enum, including the [new] `worker`.
pub(crate) const CLIENT_MODES: &[&str] = &[
    "webchat", "cli", "ui", "backend", "node", "probe", "test", "worker",
];

/// What a schema property accepts; mirrors the TypeBox types of `frames.ts`
/// and `schema/frames.ts` closely enough to reproduce Ajv's messages.
enum Kind {
    Any,
    Str,
    NonEmptyStr,
    Const(&'static str),
    Int {
        min: i64,
    },
    StrArray,
    BoolRecord,
    /// A string enum (Ajv `enum`).
    OneOf(&'static [&'static str]),
    Object(&'static [Field]),
}

struct Field {
    name: &'static str,
    required: bool,
    kind: Kind,
}

const fn req(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        required: true,
        kind,
    }
}

const fn opt(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        required: false,
        kind,
    }
}

const REQUEST_FRAME: &[Field] = &[
    req("type", Kind::Const("req")),
    req("id", Kind::NonEmptyStr),
    req("method", Kind::NonEmptyStr),
    opt("params", Kind::Any),
];

const CLIENT_INFO: &[Field] = &[
    req("id", Kind::OneOf(CLIENT_IDS)),
    opt("displayName", Kind::NonEmptyStr),
    req("version", Kind::NonEmptyStr),
    req("platform", Kind::NonEmptyStr),
    opt("deviceFamily", Kind::NonEmptyStr),
    opt("modelIdentifier", Kind::NonEmptyStr),
    req("mode", Kind::OneOf(CLIENT_MODES)),
    opt("instanceId", Kind::NonEmptyStr),
];

const DEVICE: &[Field] = &[
    req("id", Kind::NonEmptyStr),
    req("publicKey", Kind::NonEmptyStr),
    req("signature", Kind::NonEmptyStr),
    req("signedAt", Kind::Int { min: 0 }),
    req("nonce", Kind::NonEmptyStr),
];

const AUTH: &[Field] = &[
    opt("token", Kind::Str),
    opt("bootstrapToken", Kind::Str),
    opt("deviceToken", Kind::Str),
    opt("password", Kind::Str),
    opt("approvalRuntimeToken", Kind::Str),
    opt("agentRuntimeIdentityToken", Kind::Str),
];

const CONNECT_PARAMS: &[Field] = &[
    req("minProtocol", Kind::Int { min: 1 }),
    req("maxProtocol", Kind::Int { min: 1 }),
    req("client", Kind::Object(CLIENT_INFO)),
    opt("caps", Kind::StrArray),
    opt("commands", Kind::StrArray),
    opt("permissions", Kind::BoolRecord),
    opt("pathEnv", Kind::Str),
    opt("role", Kind::NonEmptyStr),
    opt("scopes", Kind::StrArray),
    opt("device", Kind::Object(DEVICE)),
    opt("auth", Kind::Object(AUTH)),
    opt("locale", Kind::Str),
    opt("userAgent", Kind::Str),
];

/// Ajv-style message for an error at JSON pointer `path`.
fn at(path: &str, message: &str) -> String {
    if path.is_empty() {
        message.to_string()
    } else {
        format!("at {path}: {message}")
    }
}

fn is_integer(v: &Value) -> bool {
    v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0)
}

fn pointer_escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// Checks `v` against `kind`, returning the first violation (Ajv stops at the
/// first error by default).
fn check(v: &Value, path: &str, kind: &Kind) -> Result<(), String> {
    match kind {
        Kind::Any => Ok(()),
        Kind::Str => v
            .is_string()
            .then_some(())
            .ok_or_else(|| at(path, "must be string")),
        Kind::NonEmptyStr => match v.as_str() {
            None => Err(at(path, "must be string")),
            Some("") => Err(at(path, "must not have fewer than 1 characters")),
            Some(_) => Ok(()),
        },
        Kind::Const(c) => (v.as_str() == Some(c))
            .then_some(())
            .ok_or_else(|| at(path, "must be equal to constant")),
        Kind::Int { min } => {
            if !is_integer(v) {
                Err(at(path, "must be integer"))
            } else if v.as_f64().unwrap_or(0.0) < *min as f64 {
                Err(at(path, &format!("must be >= {min}")))
            } else {
                Ok(())
            }
        }
        Kind::StrArray => {
            let items = v.as_array().ok_or_else(|| at(path, "must be array"))?;
            for (i, item) in items.iter().enumerate() {
                if !item.is_string() {
                    return Err(at(&format!("{path}/{i}"), "must be string"));
                }
            }
            Ok(())
        }
        Kind::BoolRecord => {
            let map = v.as_object().ok_or_else(|| at(path, "must be object"))?;
            for (k, item) in map {
                if !item.is_boolean() {
                    return Err(at(
                        &format!("{path}/{}", pointer_escape(k)),
                        "must be boolean",
                    ));
                }
            }
            Ok(())
        }
        Kind::OneOf(allowed) => match v.as_str() {
            Some(s) if allowed.contains(&s) => Ok(()),
            _ => Err(at(path, "must be equal to one of the allowed values")),
        },
        Kind::Object(fields) => check_object(v, path, fields),
    }
}

fn check_object(v: &Value, path: &str, fields: &[Field]) -> Result<(), String> {
    let map: &Map<String, Value> = v.as_object().ok_or_else(|| at(path, "must be object"))?;
    if let Some(missing) = fields
        .iter()
        .find(|f| f.required && !map.contains_key(f.name))
    {
        return Err(at(
            path,
            &format!("must have required property '{}'", missing.name),
        ));
    }
    if let Some(extra) = map
        .keys()
        .find(|k| !fields.iter().any(|f| f.name == k.as_str()))
    {
        let place = if path.is_empty() { "root" } else { path };
        return Err(format!("at {place}: unexpected property '{extra}'"));
    }
    for field in fields {
        if let Some(value) = map.get(field.name) {
            check(value, &format!("{path}/{}", field.name), &field.kind)?;
        }
    }
    Ok(())
}

/// Validates the closed `req` frame schema; `Err` carries the Ajv-style text
/// that follows "invalid request frame: ".
pub(crate) fn validate_request_frame(v: &Value) -> Result<(), String> {
    check_object(v, "", REQUEST_FRAME)
}

/// Validates `ConnectParams` (closed object, §2.3); `Err` carries the text
/// that follows "invalid connect params: ".
pub(crate) fn validate_connect_params(v: &Value) -> Result<(), String> {
    check_object(v, "", CONNECT_PARAMS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params() -> Value {
        json!({
            "minProtocol": 3, "maxProtocol": 4,
            "client": {"id": "gateway-client", "version": "1", "platform": "linux", "mode": "backend"},
            "role": "operator", "scopes": ["operator.read"], "auth": {"token": "t"}
        })
    }

    #[test]
    fn request_frame_schema_messages() {
        assert!(validate_request_frame(&json!({"type":"req","id":"1","method":"x"})).is_ok());
        assert_eq!(
            validate_request_frame(&json!({"type":"req","id":"1","method":"x","extra":1})),
            Err("at root: unexpected property 'extra'".into())
        );
        assert_eq!(
            validate_request_frame(&json!({"type":"req","id":"","method":"x"})),
            Err("at /id: must not have fewer than 1 characters".into())
        );
        assert_eq!(
            validate_request_frame(&json!({"type":"req","method":"x"})),
            Err("must have required property 'id'".into())
        );
        assert!(validate_request_frame(&json!([1])).is_err());
    }

    #[test]
    fn connect_params_schema_messages() {
        assert!(validate_connect_params(&params()).is_ok());
        let mut p = params();
        p["client"]["id"] = json!("nope");
        assert_eq!(
            validate_connect_params(&p),
            Err("at /client/id: must be equal to one of the allowed values".into())
        );
        let mut p = params();
        p["bogus"] = json!(true);
        assert_eq!(
            validate_connect_params(&p),
            Err("at root: unexpected property 'bogus'".into())
        );
        let mut p = params();
        p["client"].as_object_mut().map(|c| c.remove("version"));
        assert_eq!(
            validate_connect_params(&p),
            Err("at /client: must have required property 'version'".into())
        );
        let mut p = params();
        p["minProtocol"] = json!(0);
        assert_eq!(
            validate_connect_params(&p),
            Err("at /minProtocol: must be >= 1".into())
        );
    }
}
