//! Sharing: the gateway's connection-scoped state (gateway-protocol.md §4.2)
//! held once upstream and shared by many local clients, so the broker decides
//! who sees what.
//!
//! - [`subscriptions`]: `sessions.subscribe` / `sessions.messages.subscribe{key}`
//!   reference-counted by canonical key; every change is decided and queued
//!   upstream in one ordered place, so no change can overtake another.
//! - [`runs`]: which local client started which run (tool-stream `agent`
//!   events go to it alone; `chat.abort` of someone else's run needs admin).
//! - [`Sharing::audience`]: who receives an upstream event, recorded with it
//!   in the replay log.
//! - [`may_see`]: the one rule, for live delivery and for history alike,
//!   deciding whether a reader (its grant, its subscriptions as the
//!   audience names them, whether it observes) may see an event.

pub mod runs;
pub mod session_key;
pub mod subscriptions;

use std::collections::HashSet;
use std::sync::Mutex;

use serde_json::value::RawValue;
use serde_json::Value;

pub use runs::Runs;
pub use subscriptions::{SubKey, Subscriptions};

/// Who receives an event: decided once, when the broker receives it, and
/// kept with it in the replay log (design §11 "One log, one filter").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Audience {
    /// Every connected client (broadcast events).
    All,
    /// A targeted event (a tool stream, `session.*`, most `sessions.changed`):
    /// the clients of this broker life the gateway's rules address it to
    /// (the run's starter that asked for `tool-events`, the holders of
    /// `sessions.subscribe` or of the session's messages), and every
    /// observer ([`Reader::observer`]). The ids mean nothing to another
    /// broker life: a log read back from disk keeps the event as targeted,
    /// with no ids.
    Only(Vec<u64>),
}

impl Audience {
    /// Whether the event is targeted.
    pub fn is_targeted(&self) -> bool {
        matches!(self, Audience::Only(_))
    }
}

/// Who asks to see an event: live (a connected client) or in history (a
/// `/v1/events` stream resuming from a cursor).
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    /// The client's id in this broker life.
    pub id: u64,
    /// Its scopes: the gateway's per-connection event guards apply.
    pub grant: &'a crate::policy::Grant,
    /// It observes every targeted event the broker receives
    /// (`/v1/events?tool_events=all`, `/v1/hud`): allowed only on a socket
    /// that allows observers ([`crate::policy::may_observe`]).
    pub observer: bool,
}

/// The one filter: may `reader` see event `name` addressed to `audience`?
/// Live delivery asks it of every connected client, and history asks it
/// of a resuming reader for every logged event, so history never gives a
/// reader anything it would not have received live: the event's scope
/// guard for the reader's grant, then broadcast, or one of the clients the
/// event was addressed to, or an observer.
pub fn may_see(reader: &Reader<'_>, name: &str, audience: &Audience) -> bool {
    Visibility::of(name, audience).admits(reader)
}

/// [`may_see`] for one event, asked of many readers: the event's guard is
/// looked up once (a fan-out asks every connected client).
#[derive(Debug, Clone, Copy)]
pub struct Visibility<'a> {
    need: crate::policy::events::Need,
    audience: &'a Audience,
}

impl<'a> Visibility<'a> {
    pub fn of(name: &str, audience: &'a Audience) -> Self {
        Visibility {
            need: crate::policy::events::guard(name).need(),
            audience,
        }
    }

    /// Whether `reader` may see the event.
    pub fn admits(&self, reader: &Reader<'_>) -> bool {
        if !self.need.allows(reader.grant) {
            return false;
        }
        match self.audience {
            Audience::All => true,
            Audience::Only(ids) => reader.observer || ids.contains(&reader.id),
        }
    }
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

    /// A session key as the gateway resolves it ([`session_key::resolve`]):
    /// lowercased, `main` and its aliases → the main session key, `x` →
    /// `agent:<default agent>:x`.
    pub fn canonical(&self, key: &str) -> String {
        session_key::resolve(key, self)
    }

    /// [`SessionDefaults::canonical`] for a request naming its `agentId`.
    pub fn canonical_for(&self, key: &str, agent_id: Option<&str>) -> String {
        session_key::resolve_for_agent(key, agent_id, self)
    }

    /// The session an `agent` request without a `sessionKey` runs in: its
    /// `agentId`'s main session, or the default agent's.
    pub fn agent_main(&self, agent_id: Option<&str>) -> String {
        session_key::agent_main(agent_id, self)
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
    defaults: Mutex<std::sync::Arc<SessionDefaults>>,
}

impl Sharing {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the gateway's session defaults from a new `hello-ok` snapshot.
    pub fn set_session_defaults(&self, defaults: SessionDefaults) {
        *self.defaults.lock().unwrap_or_else(|p| p.into_inner()) = std::sync::Arc::new(defaults);
    }

    /// A session key as the gateway writes it.
    pub fn canonical(&self, key: &str) -> String {
        self.defaults().canonical(key)
    }

    /// The gateway's session defaults, as its last `hello-ok` said.
    pub fn defaults(&self) -> std::sync::Arc<SessionDefaults> {
        std::sync::Arc::clone(&self.defaults.lock().unwrap_or_else(|p| p.into_inner()))
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
    /// `parsed` is the payload as the caller parsed it for the hub's
    /// projection (`agent` and `chat` payloads are parsed once).
    pub fn audience_with_echo(
        &self,
        name: &str,
        payload: Option<&RawValue>,
        parsed: Option<&Value>,
    ) -> (Audience, Option<Audience>) {
        if name != "agent" {
            return (self.audience_parsed(name, payload, parsed), None);
        }
        let (audience, local_run) = self.runs.agent_delivery(parsed);
        let echo = local_run.and_then(|owner| {
            let mut ids = self.subscriptions.holders(&SubKey::Sessions);
            if owner.tool_events {
                ids.retain(|id| *id != owner.client_id);
            }
            (!ids.is_empty()).then_some(Audience::Only(ids))
        });
        (audience, echo)
    }

    /// Who should receive this upstream event.
    pub fn audience(&self, name: &str, payload: Option<&RawValue>) -> Audience {
        let parsed = matches!(name, "agent" | "chat")
            .then(|| runs::parsed(payload))
            .flatten();
        self.audience_parsed(name, payload, parsed.as_ref())
    }

    /// [`Sharing::audience`], with `agent` and `chat` payloads parsed already.
    fn audience_parsed(
        &self,
        name: &str,
        payload: Option<&RawValue>,
        parsed: Option<&Value>,
    ) -> Audience {
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
                Audience::Only(ids)
            }
            "session.message" => {
                self.sessions_and_key_holders(SessionEventHead::parse(payload).session_key)
            }
            // Only tool streams are targeted (`Only`).
            "agent" => self.runs.agent_delivery(parsed).0,
            "chat" => {
                self.runs.end_on_terminal_chat(parsed);
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

    /// One rule for every reader: the guard of its grant, then broadcast,
    /// the addressed clients, or an observer.
    #[test]
    fn observers_see_every_targeted_event_and_nobody_else_gains_anything() {
        let sharing = Sharing::new();
        sharing.subscriptions.lock().subscribe(&SubKey::Sessions, 1);
        let owner = |client_id, tool_events| runs::RunOwner {
            client_id,
            session_key: None,
            tool_events,
        };
        // Client 2 started r1 without asking for tool events; 3 asked.
        sharing.runs.start("r1", owner(2, false));
        sharing.runs.start("r3", owner(3, true));
        let tool =
            |run: &str| raw(json!({"runId": run, "stream": "tool", "data": {"phase": "start"}}));
        let full = crate::policy::Grant::new(crate::policy::scopes::REQUESTED_SCOPES);
        let none = crate::policy::Grant::new(Vec::<&str>::new());
        let reader = |id, observer| Reader {
            id,
            grant: &full,
            observer,
        };
        let sees = |r: Reader<'_>, name: &str, payload: &RawValue| {
            may_see(&r, name, &sharing.audience(name, Some(payload)))
        };
        assert!(
            !sees(reader(2, false), "agent", &tool("r1")),
            "asked for none"
        );
        assert!(sees(reader(3, false), "agent", &tool("r3")), "its own");
        assert!(!sees(reader(3, false), "agent", &tool("r1")), "another's");
        for run in ["r1", "r3", "gone"] {
            assert!(
                sees(reader(9, true), "agent", &tool(run)),
                "observer: {run}"
            );
        }
        assert!(sees(reader(1, false), "session.tool", &tool("x")));
        assert!(!sees(reader(4, false), "session.tool", &tool("x")));
        let message = raw(json!({"sessionKey": "agent:main:main"}));
        assert!(sees(reader(1, false), "session.message", &message));
        assert!(sees(reader(9, true), "session.message", &message));
        assert!(!sees(reader(4, false), "session.message", &message));
        // Broadcast events go to everyone the guard lets through.
        let text = raw(json!({"runId": "r1", "stream": "assistant"}));
        assert_eq!(sharing.audience("agent", Some(&text)), Audience::All);
        assert!(sees(reader(4, false), "agent", &text));
        // Without operator.read nothing targeted or read-guarded, observer or not.
        let blind = Reader {
            id: 9,
            grant: &none,
            observer: true,
        };
        assert!(!may_see(&blind, "agent", &Audience::Only(vec![9])));
        assert!(!may_see(&blind, "agent", &Audience::All));
        assert!(may_see(&blind, "tick", &Audience::All));
    }
}
