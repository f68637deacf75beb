//! Run ownership: the local client that started a run (`chat.send`/`agent`
//! with its `idempotencyKey`, which becomes the `runId`) owns it until the
//! run ends (lifecycle `end`/`error`, a terminal `chat` state), the client
//! leaves, or the upstream session is lost.

use dashmap::DashMap;
use serde_json::value::RawValue;
use serde_json::Value;

use super::Audience;

/// Who started a run.
#[derive(Debug, Clone)]
pub struct RunOwner {
    pub client_id: u64,
    /// The canonical session key it runs in, if the request named one.
    pub session_key: Option<String>,
    /// The owner asked for tool-stream events at connect.
    pub tool_events: bool,
}

/// Every run started through the broker and not yet ended.
#[derive(Debug, Default)]
pub struct Runs {
    owners: DashMap<String, RunOwner>,
}

impl Runs {
    /// Records a new run; false when the id is already taken (a duplicate
    /// idempotency key: the gateway answers it, ownership stays).
    pub fn start(&self, run_id: &str, owner: RunOwner) -> bool {
        match self.owners.entry(run_id.to_owned()) {
            dashmap::Entry::Occupied(_) => false,
            dashmap::Entry::Vacant(v) => {
                v.insert(owner);
                true
            }
        }
    }

    /// Ends a run if `client_id` still owns it (its start failed, or the
    /// client left).
    pub fn end_if_owned(&self, run_id: &str, client_id: u64) {
        self.owners
            .remove_if(run_id, |_, o| o.client_id == client_id);
    }

    /// Every live run whose owner `keep` accepts (for a handover).
    pub fn entries(&self, keep: impl Fn(u64) -> bool) -> Vec<(String, RunOwner)> {
        self.owners
            .iter()
            .filter(|e| keep(e.value().client_id))
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }

    /// Whether `run_id` is a live run, and who owns it.
    pub fn owner(&self, run_id: &str) -> Option<u64> {
        self.owners.get(run_id).map(|o| o.client_id)
    }

    /// The client that started `run_id` and asked for tool events, if any.
    pub fn tool_events_owner(&self, run_id: &str) -> Option<u64> {
        self.owners
            .get(run_id)
            .filter(|o| o.tool_events)
            .map(|o| o.client_id)
    }

    /// Whether a client other than `client_id` owns a run in `session_key`.
    pub fn foreign_run_in(&self, session_key: Option<&str>, client_id: u64) -> bool {
        self.owners
            .iter()
            .any(|o| o.client_id != client_id && o.session_key.as_deref() == session_key)
    }

    /// Forgets every run: the upstream session they were started on is gone
    /// (its tool-event registrations with it), and their ends may be missed.
    pub fn clear(&self) {
        self.owners.clear();
    }

    pub fn len(&self) -> usize {
        self.owners.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// Tool-stream `agent` events go to the run's owner alone (if it asked
    /// for them); the others are broadcast. A run's ownership ends with its
    /// lifecycle `end`/`error` event.
    pub fn agent_audience(&self, payload: Option<&RawValue>) -> Audience {
        self.agent_delivery(parsed(payload).as_ref()).0
    }

    /// [`Runs::agent_audience`] of the payload as parsed once by the
    /// caller, and for a tool-stream event of a run a local client
    /// started, that run's owner (the gateway counted the broker's
    /// connection as the starter, so it sent no `session.tool` for it: the
    /// broker delivers one to the other local subscribers).
    pub fn agent_delivery(&self, payload: Option<&Value>) -> (Audience, Option<RunOwner>) {
        let Some(head) = payload.filter(|p| p.is_object()) else {
            return (Audience::All, None);
        };
        let run_id = head.get("runId").and_then(Value::as_str);
        let audience = match (head.get("stream").and_then(Value::as_str), run_id) {
            (Some("tool"), Some(run_id)) => {
                return match self.owners.get(run_id) {
                    Some(o) if o.tool_events => {
                        (Audience::Only(vec![o.client_id]), Some(o.clone()))
                    }
                    Some(o) => (Audience::Only(Vec::new()), Some(o.clone())),
                    None => (Audience::Only(Vec::new()), None),
                }
            }
            (Some("tool"), None) => Audience::Only(Vec::new()),
            (Some("lifecycle"), Some(run_id)) => {
                let phase = head
                    .get("data")
                    .and_then(|d| d.get("phase"))
                    .and_then(Value::as_str);
                if matches!(phase, Some("end" | "error")) {
                    self.owners.remove(run_id);
                }
                Audience::All
            }
            _ => Audience::All,
        };
        (audience, None)
    }

    /// A run's ownership also ends with its terminal `chat` state, so a run
    /// whose lifecycle end the broker never sees does not linger.
    pub fn end_on_terminal_chat(&self, payload: Option<&Value>) {
        let Some(head) = payload else { return };
        let run_id = head.get("runId").and_then(Value::as_str);
        let state = head.get("state").and_then(Value::as_str);
        if let (Some(run_id), Some("final" | "aborted" | "error")) = (run_id, state) {
            self.owners.remove(run_id);
        }
    }
}

/// A payload parsed, for callers that have not parsed it already.
pub fn parsed(payload: Option<&RawValue>) -> Option<Value> {
    payload.and_then(|p| serde_json::from_str(p.get()).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    #[test]
    fn tool_events_go_to_the_owner_until_the_run_ends() {
        let runs = Runs::default();
        let owner = |id, tool_events| RunOwner {
            client_id: id,
            session_key: Some("agent:main:main".into()),
            tool_events,
        };
        assert!(runs.start("r1", owner(1, true)));
        assert!(
            !runs.start("r1", owner(2, true)),
            "duplicate key keeps the owner"
        );
        let tool = raw(serde_json::json!({"runId":"r1","stream":"tool"}));
        assert_eq!(runs.agent_audience(Some(&tool)), Audience::Only(vec![1]));
        assert!(runs.foreign_run_in(Some("agent:main:main"), 2));
        assert!(!runs.foreign_run_in(Some("agent:main:main"), 1));
        runs.end_on_terminal_chat(
            parsed(Some(&raw(
                serde_json::json!({"runId":"r1","state":"final"}),
            )))
            .as_ref(),
        );
        assert_eq!(runs.agent_audience(Some(&tool)), Audience::Only(vec![]));
        assert!(runs.start("r2", owner(1, false)));
        runs.end_if_owned("r2", 2);
        assert_eq!(runs.owner("r2"), Some(1));
        runs.end_if_owned("r2", 1);
        assert!(runs.is_empty());
    }
}
