//! What a reader keeps by session (`/v1/events?session=`, `agent=`), and
//! what an event is about: read from its payload once, for every reader
//! that asks, as the event is queued.

use std::cell::OnceCell;
use std::collections::HashSet;

use serde::Deserialize;
use serde_json::value::RawValue;

/// Which sessions a reader keeps (`session=`, `agent=`): events that name
/// no session are left out, the broker's own `clawmux.*` records kept.
#[derive(Debug, Default, Clone)]
pub struct SessionFilter {
    /// Session keys, as the gateway spells them.
    pub sessions: Option<HashSet<String>>,
    /// Agent ids (`agent:<id>:…`).
    pub agents: Option<HashSet<String>>,
}

impl SessionFilter {
    pub fn is_empty(&self) -> bool {
        self.sessions.is_none() && self.agents.is_none()
    }

    /// Whether an event named `name`, about `about`, is kept.
    pub fn keeps(&self, name: &str, about: &About<'_>) -> bool {
        if self.is_empty() || name.starts_with("clawmux.") {
            return true;
        }
        let Some(subject) = about.subject() else {
            return false;
        };
        let session_ok = self
            .sessions
            .as_ref()
            .is_none_or(|s| subject.session_key.as_ref().is_some_and(|k| s.contains(k)));
        let agent_ok = self
            .agents
            .as_ref()
            .is_none_or(|a| subject.agent.as_ref().is_some_and(|id| a.contains(id)));
        session_ok && agent_ok
    }
}

/// The session an event's payload names (`sessionKey`), and its agent
/// (`agentId`, or the `<id>` of an `agent:<id>:…` key).
#[derive(Debug)]
struct Subject {
    session_key: Option<String>,
    agent: Option<String>,
}

/// An event's payload, read for the session it names the first time a
/// reader's filter asks, and only then (most readers filter by nothing).
#[derive(Debug)]
pub struct About<'a> {
    payload: Option<&'a RawValue>,
    read: OnceCell<Option<Subject>>,
}

impl<'a> About<'a> {
    pub fn new(payload: Option<&'a RawValue>) -> Self {
        About {
            payload,
            read: OnceCell::new(),
        }
    }

    /// `None`: no payload, or not an object.
    fn subject(&self) -> Option<&Subject> {
        self.read
            .get_or_init(|| {
                #[derive(Deserialize)]
                struct Payload {
                    #[serde(rename = "sessionKey", default)]
                    session_key: Option<String>,
                    #[serde(rename = "agentId", default)]
                    agent_id: Option<String>,
                }
                let p: Payload = serde_json::from_str(self.payload?.get()).ok()?;
                let agent = p.agent_id.or_else(|| {
                    p.session_key
                        .as_deref()
                        .and_then(|k| k.strip_prefix("agent:"))
                        .and_then(|rest| rest.split(':').next())
                        .map(str::to_owned)
                });
                Some(Subject {
                    session_key: p.session_key,
                    agent,
                })
            })
            .as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn raw(v: serde_json::Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    #[test]
    fn a_filter_keeps_the_sessions_and_agents_it_names_and_the_brokers_records() {
        let filter = SessionFilter {
            sessions: None,
            agents: Some(["ops".to_owned()].into()),
        };
        let by_key = raw(json!({"sessionKey": "agent:ops:main", "x": [1, 2]}));
        let by_id = raw(json!({"agentId": "ops"}));
        let other = raw(json!({"sessionKey": "agent:main:main"}));
        assert!(filter.keeps("chat", &About::new(Some(&by_key))));
        assert!(filter.keeps("agent", &About::new(Some(&by_id))));
        assert!(!filter.keeps("chat", &About::new(Some(&other))));
        assert!(!filter.keeps("tick", &About::new(None)));
        assert!(filter.keeps("clawmux.upstream", &About::new(None)));
        let sessions = SessionFilter {
            sessions: Some(["agent:main:main".to_owned()].into()),
            agents: None,
        };
        assert!(sessions.keeps("chat", &About::new(Some(&other))));
        assert!(!sessions.keeps("chat", &About::new(Some(&by_key))));
        assert!(SessionFilter::default().keeps("tick", &About::new(None)));
    }
}
