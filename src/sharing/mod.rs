//! Sharing: the gateway's connection-scoped state (gateway-protocol.md §4.2)
//! held once upstream and shared by many local clients, so the broker decides
//! who sees what.
//!
//! - [`subscriptions`]: `sessions.subscribe` / `sessions.messages.subscribe{key}`
//!   reference-counted by canonical key; every change is decided and queued
//!   upstream in one ordered place, so no change can overtake another.
//! - [`runs`]: which local client started which run (tool-stream `agent`
//!   events go to it alone; `chat.abort` of someone else's run needs admin).
//! - [`Sharing::audience`]: who receives an upstream event.

pub mod runs;
pub mod subscriptions;

use std::collections::HashSet;
use std::sync::Mutex;

use serde_json::value::RawValue;
use serde_json::Value;

pub use runs::Runs;
pub use subscriptions::{SubKey, Subscriptions};

/// Who receives an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Audience {
    /// Every connected client (broadcast events).
    All,
    /// Only these clients (targeted events).
    Only(Vec<u64>),
}

/// The gateway's `snapshot.sessionDefaults`, to write session keys the way
/// the gateway does before comparing them (it canonicalizes `main` to
/// `agent:main:main`, and events always carry the canonical key).
#[derive(Debug, Clone)]
pub struct SessionDefaults {
    pub default_agent_id: String,
    pub main_key: String,
    pub main_session_key: String,
}

impl Default for SessionDefaults {
    fn default() -> Self {
        SessionDefaults {
            default_agent_id: "main".into(),
            main_key: "main".into(),
            main_session_key: "agent:main:main".into(),
        }
    }
}

impl SessionDefaults {
    /// Reads `sessionDefaults` from a `hello-ok` snapshot, keeping the
    /// defaults for anything missing.
    pub fn from_snapshot(snapshot: &Value) -> Self {
        let d = SessionDefaults::default();
        let get = |k: &str, fallback: String| {
            snapshot
                .pointer(&format!("/sessionDefaults/{k}"))
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
                .map_or(fallback, str::to_owned)
        };
        SessionDefaults {
            default_agent_id: get("defaultAgentId", d.default_agent_id),
            main_key: get("mainKey", d.main_key),
            main_session_key: get("mainSessionKey", d.main_session_key),
        }
    }

    /// `main` → the main session key; `x` → `agent:<default agent>:x`;
    /// `agent:…` keys are already canonical.
    pub fn canonical(&self, key: &str) -> String {
        let key = key.trim();
        if key == self.main_key {
            self.main_session_key.clone()
        } else if key.starts_with("agent:") {
            key.to_owned()
        } else {
            format!("agent:{}:{key}", self.default_agent_id)
        }
    }
}

/// The connection-scoped state the broker holds for its clients.
#[derive(Debug, Default)]
pub struct Sharing {
    pub subscriptions: Subscriptions,
    pub runs: Runs,
    defaults: Mutex<SessionDefaults>,
}

impl Sharing {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the gateway's session defaults from a new `hello-ok` snapshot.
    pub fn set_session_defaults(&self, defaults: SessionDefaults) {
        *self.defaults.lock().unwrap_or_else(|p| p.into_inner()) = defaults;
    }

    /// A session key as the gateway writes it.
    pub fn canonical(&self, key: &str) -> String {
        self.defaults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .canonical(key)
    }

    /// Who should receive this upstream event.
    pub fn audience(&self, name: &str, payload: Option<&RawValue>) -> Audience {
        match name {
            "session.tool" | "sessions.changed" => {
                Audience::Only(self.subscriptions.holders(&SubKey::Sessions))
            }
            "session.message" => {
                let key = payload
                    .and_then(|p| serde_json::from_str::<Value>(p.get()).ok())
                    .and_then(|p| {
                        p.get("sessionKey")
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    });
                let mut ids: HashSet<u64> = self
                    .subscriptions
                    .holders(&SubKey::Sessions)
                    .into_iter()
                    .collect();
                if let Some(key) = key {
                    ids.extend(self.subscriptions.holders(&SubKey::Messages(key)));
                }
                Audience::Only(ids.into_iter().collect())
            }
            "agent" => self.runs.agent_audience(payload),
            "chat" => {
                self.runs.end_on_terminal_chat(payload);
                Audience::All
            }
            _ => Audience::All,
        }
    }
}
