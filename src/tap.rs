//! The request tap: a broker-side copy of what passes between the broker
//! and the gateway that no single local client sees whole — every request
//! sent upstream (any client's, `/v1/rpc`'s, the broker's own), every
//! answer, and the events the broker delivers only to some clients
//! (`session.tool`, tool-stream `agent` events, …). `clawmux record
//! --requests` reads it through `GET /v1/events?tap=1`.
//!
//! Two hooks feed it: [`Tap::outbound`] on the one dispatch path
//! (`crate::dispatch`) and [`Tap::inbound`] in the upstream reader. Both
//! cost one atomic load while nobody listens. A listener is an SSE stream's
//! hub [`Client`]: tapped frames go into its own bounded queue as
//! `Outgoing::Frame`s, in order with the events it receives, under the same
//! slow-consumer rules. Secrets are redacted ([`redact`]) before a frame
//! leaves the broker.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::Value;

use crate::hub::Client;

/// What replaces a secret's value.
pub const REDACTED: &str = "[redacted]";

/// Whether a JSON key names a secret: tokens of every kind, passwords,
/// secrets, API and private keys, signatures, nonces, authorization and
/// cookie headers, and the gateway's `recoveryScope` (a hash of the
/// connection's credential). Session keys, idempotency keys and token
/// *counts* are not.
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase().replace(['_', '-'], "");
    matches!(
        k.as_str(),
        "nonce"
            | "signature"
            | "authorization"
            | "cookie"
            | "setcookie"
            | "passphrase"
            | "recoveryscope"
    ) || ["token", "password", "secret", "apikey", "privatekey"]
        .iter()
        .any(|suffix| k.ends_with(suffix))
}

/// Replaces, in place, every string or number held under a secret key
/// (at any depth) with [`REDACTED`].
pub fn redact(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if is_secret_key(key) && !matches!(v, Value::Null | Value::Bool(_)) {
                    if v.is_object() || v.is_array() {
                        redact_all(v);
                    } else {
                        *v = Value::String(REDACTED.into());
                    }
                } else {
                    redact(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

/// Everything below a secret key is secret.
fn redact_all(value: &mut Value) {
    match value {
        Value::Object(map) => map.values_mut().for_each(redact_all),
        Value::Array(items) => items.iter_mut().for_each(redact_all),
        Value::String(_) | Value::Number(_) => *value = Value::String(REDACTED.into()),
        _ => {}
    }
}

/// The listeners of the tap.
#[derive(Debug, Default)]
pub struct Tap {
    active: AtomicBool,
    listeners: Mutex<Vec<Arc<Client>>>,
}

impl Tap {
    /// Starts copying frames into `client`'s queue.
    pub fn attach(&self, client: Arc<Client>) {
        let mut listeners = self.lock();
        listeners.push(client);
        self.active.store(true, Ordering::Release);
    }

    /// Stops copying frames to client `id`.
    pub fn detach(&self, id: u64) {
        let mut listeners = self.lock();
        listeners.retain(|c| c.id != id);
        self.active.store(!listeners.is_empty(), Ordering::Release);
    }

    /// A frame the broker sends to the gateway (a `req`).
    pub fn outbound(&self, frame: &str) {
        self.copy("out", frame);
    }

    /// A frame from the gateway the tap carries (a `res`, or an event not
    /// every client receives).
    pub fn inbound(&self, frame: &str) {
        self.copy("in", frame);
    }

    fn copy(&self, dir: &str, frame: &str) {
        if !self.active.load(Ordering::Acquire) {
            return;
        }
        let Ok(mut frame) = serde_json::from_str::<Value>(frame) else {
            return;
        };
        redact(&mut frame);
        let record = Bytes::from(serde_json::json!({"dir": dir, "frame": frame}).to_string());
        for client in self.lock().iter() {
            client.push_frame(record.clone());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Client>>> {
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn secrets_are_redacted_at_any_depth() {
        let mut v = json!({
            "auth": {"token": "T", "password": "P", "deviceToken": "D", "signature": "S", "nonce": "N", "recoveryScope": "R"},
            "params": {"apiKey": "K", "api_key": "K", "client_secret": "C", "headers": {"Authorization": "Bearer T"}},
            "sessionKey": "agent:main:main", "idempotencyKey": "k1",
            "usage": {"totalTokens": 12, "maxTokens": 4096},
            "list": [{"bootstrapToken": "B"}],
            "privateKey": {"d": "X", "n": [1, 2]},
            "token": null,
        });
        redact(&mut v);
        let text = v.to_string();
        for secret in [
            "\"T\"", "\"P\"", "\"D\"", "\"S\"", "\"N\"", "\"K\"", "\"C\"", "Bearer", "\"B\"",
            "\"X\"", "\"R\"",
        ] {
            assert!(!text.contains(secret), "{secret} left in {text}");
        }
        assert_eq!(v["sessionKey"], "agent:main:main");
        assert_eq!(v["idempotencyKey"], "k1");
        assert_eq!(v["usage"]["totalTokens"], 12);
        assert_eq!(v["auth"]["token"], REDACTED);
        assert_eq!(v["token"], Value::Null);
    }
}
