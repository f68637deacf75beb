//! The driver: what the broker decides or answers itself, because the
//! gateway's connection-scoped state (gateway-protocol.md §4.2) would be
//! wrong if it were simply shared by every local client.
//!
//! - **Subscriptions** (`sessions.subscribe`, `sessions.messages.subscribe{key}`)
//!   are reference-counted: the first subscriber's request goes upstream, the
//!   others are answered here; the last unsubscribe (or disconnect) goes
//!   upstream. Targeted events reach only local subscribers.
//! - **Runs**: the client that started a run (`chat.send`/`agent` with its
//!   `idempotencyKey`, which becomes the `runId`) owns it: tool-stream `agent`
//!   events go to it alone (if it asked for `tool-events`), and other clients
//!   may not `chat.abort` it without `operator.admin`.
//! - **Node-only methods** are refused here: every refusal upstream would count
//!   toward the gateway's shared "repeated unauthorized calls" close.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::hub::Client;
use crate::protocol::{ErrorShape, StudioCode};

/// Who receives an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Audience {
    /// Every connected client (broadcast events).
    All,
    /// Only these clients (targeted events).
    Only(Vec<u64>),
}

/// Runs once with a forwarded request's outcome (`true`: its final answer
/// was `ok`), so the driver can confirm or undo what it recorded for it.
pub type Settle = Box<dyn FnOnce(bool) + Send + Sync>;

/// What to do with a local request.
pub enum Decision {
    /// Send it upstream.
    Forward(Option<Settle>),
    /// Answer it here with this payload (`ok:true`).
    Answer(Value),
    /// Answer it here with this error.
    Refuse(ErrorShape),
}

impl std::fmt::Debug for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decision::Forward(r) => write!(f, "Forward(settle: {})", r.is_some()),
            Decision::Answer(v) => write!(f, "Answer({v})"),
            Decision::Refuse(e) => write!(f, "Refuse({e})"),
        }
    }
}

/// Methods only a `role:"node"` connection may call.
fn is_node_only(method: &str) -> bool {
    matches!(method, "node.invoke.result" | "node.event" | "skills.bins")
        || method.starts_with("node.pending.")
}

#[derive(Debug, Clone)]
struct RunOwner {
    client_id: u64,
    session_key: Option<String>,
    tool_events: bool,
}

#[derive(Debug, Default)]
struct Subscriptions {
    /// Clients subscribed with `sessions.subscribe`.
    sessions: HashSet<u64>,
    /// The gateway answered a `sessions.subscribe` `ok` on this session.
    /// Until then every subscribe is forwarded (the gateway's set is
    /// idempotent), so one failed upstream subscribe cannot leave others
    /// believing they are subscribed.
    sessions_confirmed: bool,
    /// Clients subscribed with `sessions.messages.subscribe`, by canonical key.
    messages: HashMap<String, HashSet<u64>>,
    /// Keys the gateway confirmed (as above).
    messages_confirmed: HashSet<String>,
}

/// The driver's state; shared by every session and the connector.
#[derive(Debug, Default)]
pub struct Driver {
    subs: Mutex<Subscriptions>,
    runs: DashMap<String, RunOwner>,
    defaults: Mutex<SessionDefaults>,
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

fn param_str<'a>(params: &'a Value, key: &str) -> Option<&'a str> {
    params
        .get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

impl Driver {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the gateway's session defaults from a new `hello-ok` snapshot.
    pub fn set_session_defaults(&self, defaults: SessionDefaults) {
        *self.defaults.lock().unwrap_or_else(|p| p.into_inner()) = defaults;
    }

    fn canonical(&self, key: &str) -> String {
        self.defaults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .canonical(key)
    }

    fn subs(&self) -> std::sync::MutexGuard<'_, Subscriptions> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides what happens to `method` from `client`.
    pub fn decide(
        self: &Arc<Self>,
        client: &Client,
        method: &str,
        params: Option<&RawValue>,
    ) -> Decision {
        if is_node_only(method) {
            return Decision::Refuse(ErrorShape::invalid_request("unauthorized role: operator"));
        }
        let interesting = matches!(
            method,
            "sessions.subscribe"
                | "sessions.unsubscribe"
                | "sessions.messages.subscribe"
                | "sessions.messages.unsubscribe"
                | "chat.send"
                | "agent"
                | "chat.abort"
        );
        if !interesting {
            return Decision::Forward(None);
        }
        let params: Value = params
            .and_then(|p| serde_json::from_str(p.get()).ok())
            .unwrap_or(Value::Null);
        let id = client.id;
        match method {
            "sessions.subscribe" => {
                let mut subs = self.subs();
                subs.sessions.insert(id);
                if subs.sessions_confirmed {
                    return Decision::Answer(json!({"subscribed": true}));
                }
                let me = Arc::clone(self);
                Decision::Forward(Some(Box::new(move |ok| {
                    let mut subs = me.subs();
                    if ok {
                        subs.sessions_confirmed = !subs.sessions.is_empty();
                    } else {
                        subs.sessions.remove(&id);
                    }
                })))
            }
            "sessions.unsubscribe" => {
                let mut subs = self.subs();
                if subs.sessions.remove(&id) && subs.sessions.is_empty() {
                    subs.sessions_confirmed = false;
                    Decision::Forward(None)
                } else {
                    Decision::Answer(json!({"subscribed": false}))
                }
            }
            "sessions.messages.subscribe" | "sessions.messages.unsubscribe" => {
                let Some(asked) = param_str(&params, "key").map(str::to_owned) else {
                    // Let the gateway word the schema error.
                    return Decision::Forward(None);
                };
                // Counted by canonical key; answered with the key as asked.
                let key = self.canonical(&asked);
                let mut subs = self.subs();
                if method == "sessions.messages.subscribe" {
                    subs.messages.entry(key.clone()).or_default().insert(id);
                    if subs.messages_confirmed.contains(&key) {
                        return Decision::Answer(json!({"subscribed": true, "key": asked}));
                    }
                    let me = Arc::clone(self);
                    Decision::Forward(Some(Box::new(move |ok| {
                        if ok {
                            let mut subs = me.subs();
                            if subs.messages.contains_key(&key) {
                                subs.messages_confirmed.insert(key);
                            }
                        } else {
                            me.remove_message_sub(&key, id);
                        }
                    })))
                } else {
                    let removed = subs
                        .messages
                        .get_mut(&key)
                        .is_some_and(|set| set.remove(&id));
                    let now_empty = subs.messages.get(&key).is_none_or(HashSet::is_empty);
                    if now_empty {
                        subs.messages.remove(&key);
                        subs.messages_confirmed.remove(&key);
                    }
                    if removed && now_empty {
                        Decision::Forward(None)
                    } else {
                        Decision::Answer(json!({"subscribed": false, "key": asked}))
                    }
                }
            }
            "chat.send" | "agent" => {
                let Some(run_id) = param_str(&params, "idempotencyKey").map(str::to_owned) else {
                    return Decision::Forward(None);
                };
                if self.runs.contains_key(&run_id) {
                    // A duplicate key: the gateway answers it (in_flight / cached).
                    return Decision::Forward(None);
                }
                self.runs.insert(
                    run_id.clone(),
                    RunOwner {
                        client_id: id,
                        session_key: param_str(&params, "sessionKey").map(|k| self.canonical(k)),
                        tool_events: client
                            .tool_events
                            .load(std::sync::atomic::Ordering::Relaxed),
                    },
                );
                let me = Arc::clone(self);
                Decision::Forward(Some(Box::new(move |ok| {
                    if !ok {
                        me.runs.remove_if(&run_id, |_, o| o.client_id == id);
                    }
                })))
            }
            "chat.abort" => {
                if client.admin.load(std::sync::atomic::Ordering::Relaxed) {
                    return Decision::Forward(None);
                }
                let foreign = match param_str(&params, "runId") {
                    Some(run_id) => self.runs.get(run_id).is_some_and(|o| o.client_id != id),
                    None => {
                        let key = param_str(&params, "sessionKey").map(|k| self.canonical(k));
                        self.runs
                            .iter()
                            .any(|o| o.client_id != id && o.session_key == key)
                    }
                };
                if foreign {
                    Decision::Refuse(ErrorShape::studio(
                        StudioCode::Forbidden,
                        "this run was started by another local client; only that client or one connected with operator.admin may abort it",
                    ))
                } else {
                    Decision::Forward(None)
                }
            }
            _ => Decision::Forward(None),
        }
    }

    fn remove_message_sub(&self, key: &str, id: u64) {
        let mut subs = self.subs();
        if let Some(set) = subs.messages.get_mut(key) {
            set.remove(&id);
            if set.is_empty() {
                subs.messages.remove(key);
                subs.messages_confirmed.remove(key);
            }
        }
    }

    /// Who should receive this upstream event.
    pub fn audience(&self, name: &str, payload: Option<&RawValue>) -> Audience {
        match name {
            "session.tool" | "sessions.changed" => {
                Audience::Only(self.subs().sessions.iter().copied().collect())
            }
            "session.message" => {
                let key = payload
                    .and_then(|p| serde_json::from_str::<Value>(p.get()).ok())
                    .and_then(|p| {
                        p.get("sessionKey")
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    });
                let subs = self.subs();
                let mut ids: HashSet<u64> = subs.sessions.clone();
                if let Some(set) = key.and_then(|k| subs.messages.get(&k)) {
                    ids.extend(set.iter().copied());
                }
                Audience::Only(ids.into_iter().collect())
            }
            "agent" => self.agent_audience(payload),
            "chat" => {
                self.end_run_on_terminal_chat(payload);
                Audience::All
            }
            _ => Audience::All,
        }
    }

    /// Tool-stream `agent` events go to the run's owner alone (if it asked
    /// for them); the others are broadcast. A run's ownership ends with its
    /// lifecycle `end`/`error` event.
    fn agent_audience(&self, payload: Option<&RawValue>) -> Audience {
        #[derive(serde::Deserialize)]
        struct AgentHead {
            #[serde(rename = "runId", default)]
            run_id: Option<String>,
            #[serde(default)]
            stream: Option<String>,
            #[serde(default)]
            data: Option<Value>,
        }
        let Some(head) = payload.and_then(|p| serde_json::from_str::<AgentHead>(p.get()).ok())
        else {
            return Audience::All;
        };
        match (head.stream.as_deref(), head.run_id) {
            (Some("tool"), Some(run_id)) => match self.runs.get(&run_id) {
                Some(o) if o.tool_events => Audience::Only(vec![o.client_id]),
                _ => Audience::Only(Vec::new()),
            },
            (Some("tool"), None) => Audience::Only(Vec::new()),
            (Some("lifecycle"), Some(run_id)) => {
                let phase = head
                    .data
                    .as_ref()
                    .and_then(|d| d.get("phase"))
                    .and_then(Value::as_str);
                if matches!(phase, Some("end" | "error")) {
                    self.runs.remove(&run_id);
                }
                Audience::All
            }
            _ => Audience::All,
        }
    }

    /// A run's ownership also ends with its terminal `chat` state, so a run
    /// whose lifecycle end the broker never sees does not linger.
    fn end_run_on_terminal_chat(&self, payload: Option<&RawValue>) {
        #[derive(serde::Deserialize)]
        struct ChatHead {
            #[serde(rename = "runId", default)]
            run_id: Option<String>,
            #[serde(default)]
            state: Option<String>,
        }
        let Some(head) = payload.and_then(|p| serde_json::from_str::<ChatHead>(p.get()).ok())
        else {
            return;
        };
        if let (Some(run_id), Some("final" | "aborted" | "error")) =
            (head.run_id, head.state.as_deref())
        {
            self.runs.remove(&run_id);
        }
    }

    /// Forgets every run: the upstream session they were started on is gone
    /// (its tool-event registrations with it), and their ends may be missed.
    pub fn forget_runs(&self) {
        self.runs.clear();
    }

    /// Forgets a disconnected client; returns the unsubscribes to send
    /// upstream for subscriptions it was the last holder of.
    pub fn forget_client(&self, id: u64) -> Vec<(&'static str, Value)> {
        self.runs.retain(|_, o| o.client_id != id);
        let mut subs = self.subs();
        let mut upstream = Vec::new();
        if subs.sessions.remove(&id) && subs.sessions.is_empty() {
            subs.sessions_confirmed = false;
            upstream.push(("sessions.unsubscribe", json!({})));
        }
        let mut emptied = Vec::new();
        for (key, set) in subs.messages.iter_mut() {
            if set.remove(&id) && set.is_empty() {
                emptied.push(key.clone());
            }
        }
        for key in emptied {
            subs.messages.remove(&key);
            subs.messages_confirmed.remove(&key);
            upstream.push(("sessions.messages.unsubscribe", json!({"key": key})));
        }
        upstream
    }

    /// The subscriptions to re-issue on a new upstream session.
    pub fn resubscribe(&self) -> Vec<(&'static str, Value)> {
        let mut subs = self.subs();
        // Their answers go to nobody; until a client's own subscribe is
        // answered `ok` again, subscribes are forwarded (idempotent upstream).
        subs.sessions_confirmed = false;
        subs.messages_confirmed.clear();
        let mut out = Vec::new();
        if !subs.sessions.is_empty() {
            out.push(("sessions.subscribe", json!({})));
        }
        for key in subs.messages.keys() {
            out.push(("sessions.messages.subscribe", json!({"key": key})));
        }
        out
    }

    /// Local subscription counts, for state reporting and tests.
    pub fn subscription_counts(&self) -> (usize, HashMap<String, usize>) {
        let subs = self.subs();
        (
            subs.sessions.len(),
            subs.messages
                .iter()
                .map(|(k, v)| (k.clone(), v.len()))
                .collect(),
        )
    }
}
