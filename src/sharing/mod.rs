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
//! - [`Sharing::observe_tools`]: the observers' opt-in (`/v1/events?tool_events=all`)
//!   to every tool-stream event the broker receives, for dashboards such as
//!   `clawmux top`; ordinary clients' audiences are unchanged.

pub mod runs;
pub mod subscriptions;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

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

/// `sessions.changed` reasons the gateway sends to every connection with
/// read access, not only to `sessions.subscribe` subscribers (openclaw
/// 2026.9.6: server-cron.ts `cron-bindings-loaded`, `cron-binding`; the node
/// session runtime `runner-availability`; runtime subscriptions
/// `activity-summary`).
pub const BROADCAST_SESSIONS_CHANGED_REASONS: [&str; 4] = [
    "cron-bindings-loaded",
    "cron-binding",
    "runner-availability",
    "activity-summary",
];

/// The fields of a session event that decide who gets it.
#[derive(Debug, Default, serde::Deserialize)]
struct SessionEventHead {
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    phase: Option<String>,
    #[serde(rename = "sessionKey", default)]
    session_key: Option<String>,
    #[serde(rename = "runId", default)]
    run_id: Option<String>,
}

impl SessionEventHead {
    fn parse(payload: Option<&RawValue>) -> Self {
        payload
            .and_then(|p| serde_json::from_str(p.get()).ok())
            .unwrap_or_default()
    }
}

/// The connection-scoped state the broker holds for its clients.
#[derive(Debug, Default)]
pub struct Sharing {
    pub subscriptions: Subscriptions,
    pub runs: Runs,
    defaults: Mutex<SessionDefaults>,
    /// Clients that opted in to every tool-stream event (`agent`
    /// `stream:"tool"`, `session.tool`) the broker receives, not only those
    /// of runs they started. Held by a [`ToolObserver`] guard.
    tool_observers: Mutex<HashSet<u64>>,
}

/// A client's opt-in to every tool-stream event; dropping it ends the opt-in
/// (the client's stream closed).
#[derive(Debug)]
pub struct ToolObserver {
    sharing: Arc<Sharing>,
    client_id: u64,
}

impl Drop for ToolObserver {
    fn drop(&mut self) {
        self.sharing.observers().remove(&self.client_id);
    }
}

impl Sharing {
    pub fn new() -> Self {
        Self::default()
    }

    fn observers(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.tool_observers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// `client_id` sees every tool-stream event the broker receives while
    /// the returned guard lives. Runs started through the broker deliver
    /// theirs as `agent` `stream:"tool"` (the broker advertises
    /// `tool-events` upstream); others as `session.tool`, which the gateway
    /// sends only while some local client holds `sessions.subscribe`.
    pub fn observe_tools(self: &Arc<Self>, client_id: u64) -> ToolObserver {
        self.observers().insert(client_id);
        ToolObserver {
            sharing: Arc::clone(self),
            client_id,
        }
    }

    /// Whether `client_id` observes every tool-stream event.
    pub fn observes_tools(&self, client_id: u64) -> bool {
        self.observers().contains(&client_id)
    }

    /// A tool-stream audience widened to the observers.
    fn with_tool_observers(&self, audience: Audience) -> Audience {
        match audience {
            Audience::Only(mut ids) => {
                let observers = self.observers();
                ids.extend(
                    observers
                        .iter()
                        .filter(|o| !ids.contains(o))
                        .collect::<Vec<_>>(),
                );
                Audience::Only(ids)
            }
            all => all,
        }
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

    /// `sessions.subscribe` holders, and the holders of `key`'s messages.
    fn sessions_and_key_holders(&self, key: Option<String>) -> Audience {
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

    /// Who should receive this upstream event and, for a tool event of a
    /// run a local client started, who should also receive it as
    /// `session.tool`: the local `sessions.subscribe` holders other than
    /// the run's own tool-events client (the gateway's rule,
    /// server-chat.ts `excludeConnIds`; it sent the broker none, because the
    /// broker's connection started the run).
    pub fn audience_with_echo(
        &self,
        name: &str,
        payload: Option<&RawValue>,
    ) -> (Audience, Option<Audience>) {
        if name != "agent" {
            return (self.audience(name, payload), None);
        }
        let (audience, local_run) = self.runs.agent_delivery(payload);
        let echo = local_run.and_then(|owner| {
            let mut ids = self.subscriptions.holders(&SubKey::Sessions);
            if owner.tool_events {
                ids.retain(|id| *id != owner.client_id);
            }
            (!ids.is_empty()).then_some(Audience::Only(ids))
        });
        (self.with_tool_observers(audience), echo)
    }

    /// Who should receive this upstream event.
    pub fn audience(&self, name: &str, payload: Option<&RawValue>) -> Audience {
        // The gateway's own rules (openclaw 2026.9.6,
        // src/gateway/server-session-events.ts, server-chat.ts, server-cron.ts;
        // gateway-protocol.md §3.2).
        match name {
            "sessions.changed" => {
                let head = SessionEventHead::parse(payload);
                if head
                    .reason
                    .as_deref()
                    .is_some_and(|r| BROADCAST_SESSIONS_CHANGED_REASONS.contains(&r))
                {
                    return Audience::All;
                }
                // A transcript update without a projectable message goes to
                // the per-key subscribers too (the broker cannot tell the two
                // `phase:"message"` cases apart: the union is the safe side).
                let per_key = (head.phase.as_deref() == Some("message"))
                    .then_some(head.session_key)
                    .flatten();
                self.sessions_and_key_holders(per_key)
            }
            "session.tool" => {
                // The run's own tool-events client gets `agent` stream:"tool"
                // events instead (server-chat.ts: excludeConnIds).
                let owner = SessionEventHead::parse(payload)
                    .run_id
                    .and_then(|r| self.runs.tool_events_owner(&r));
                let mut ids = self.subscriptions.holders(&SubKey::Sessions);
                ids.retain(|id| Some(*id) != owner);
                self.with_tool_observers(Audience::Only(ids))
            }
            "session.message" => {
                self.sessions_and_key_holders(SessionEventHead::parse(payload).session_key)
            }
            // Only tool streams are targeted (`Only`); observers get them too.
            "agent" => self.with_tool_observers(self.runs.agent_audience(payload)),
            "chat" => {
                self.runs.end_on_terminal_chat(payload);
                Audience::All
            }
            _ => Audience::All,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    fn sorted(a: Audience) -> Audience {
        match a {
            Audience::Only(mut ids) => {
                ids.sort();
                Audience::Only(ids)
            }
            all => all,
        }
    }

    #[test]
    fn session_events_follow_the_gateways_delivery_rules() {
        let sharing = Sharing::new();
        {
            let mut st = sharing.subscriptions.lock();
            st.subscribe(&SubKey::Sessions, 1);
            st.subscribe(&SubKey::Messages("agent:main:main".into()), 2);
        }
        let changed = |p: Value| sorted(sharing.audience("sessions.changed", Some(&raw(p))));
        assert_eq!(
            changed(json!({"reason": "cron-bindings-loaded"})),
            Audience::All
        );
        assert_eq!(
            changed(json!({"reason": "patch", "sessionKey": "agent:main:main"})),
            Audience::Only(vec![1])
        );
        assert_eq!(
            changed(json!({"phase": "message", "sessionKey": "agent:main:main"})),
            Audience::Only(vec![1, 2])
        );
        let message = sorted(sharing.audience(
            "session.message",
            Some(&raw(json!({"sessionKey": "agent:main:main"}))),
        ));
        assert_eq!(message, Audience::Only(vec![1, 2]));
        // session.tool skips the run's own tool-events client.
        sharing.runs.start(
            "r1",
            runs::RunOwner {
                client_id: 1,
                session_key: None,
                tool_events: true,
            },
        );
        let tool = sharing.audience("session.tool", Some(&raw(json!({"runId": "r1"}))));
        assert_eq!(tool, Audience::Only(vec![]));
        let other = sharing.audience("session.tool", Some(&raw(json!({"runId": "r2"}))));
        assert_eq!(other, Audience::Only(vec![1]));
    }

    #[test]
    fn tool_observers_see_every_tool_stream_and_nothing_else_changes() {
        let sharing = Arc::new(Sharing::new());
        sharing.subscriptions.lock().subscribe(&SubKey::Sessions, 1);
        // Client 2 started r1 without asking for tool events; 3 asked.
        let owner = |client_id, tool_events| runs::RunOwner {
            client_id,
            session_key: None,
            tool_events,
        };
        sharing.runs.start("r1", owner(2, false));
        sharing.runs.start("r3", owner(3, true));
        let tool =
            |run: &str| raw(json!({"runId": run, "stream": "tool", "data": {"phase": "start"}}));
        let agent = |run: &str| sorted(sharing.audience("agent", Some(&tool(run))));
        let session_tool = |run: &str| sorted(sharing.audience("session.tool", Some(&tool(run))));
        assert_eq!(agent("r1"), Audience::Only(vec![]));
        assert_eq!(agent("r3"), Audience::Only(vec![3]));
        let observer = sharing.observe_tools(9);
        assert!(sharing.observes_tools(9));
        assert_eq!(
            agent("r1"),
            Audience::Only(vec![9]),
            "a run that asked for none"
        );
        assert_eq!(
            agent("r3"),
            Audience::Only(vec![3, 9]),
            "the owner keeps its own"
        );
        assert_eq!(
            agent("gone"),
            Audience::Only(vec![9]),
            "an ended or foreign run"
        );
        assert_eq!(session_tool("x"), Audience::Only(vec![1, 9]));
        // Broadcast and other targeted events are untouched.
        let text = raw(json!({"runId": "r1", "stream": "assistant"}));
        assert_eq!(sharing.audience("agent", Some(&text)), Audience::All);
        let message = sharing.audience(
            "session.message",
            Some(&raw(json!({"sessionKey": "agent:main:main"}))),
        );
        assert_eq!(message, Audience::Only(vec![1]));
        drop(observer);
        assert!(!sharing.observes_tools(9));
        assert_eq!(
            agent("r1"),
            Audience::Only(vec![]),
            "the opt-in ends with its guard"
        );
        assert_eq!(session_tool("x"), Audience::Only(vec![1]));
    }
}
