//! A client request, parsed once into what the broker needs to decide its
//! path: the kind (subscription change, run start, abort-like, plain) and
//! the few params it reads. The policy check and the dispatch both use the
//! same parse.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::policy::methods::{reads_params, ABORT_LIKE};
use crate::sharing::SubKey;

/// What the broker does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// `sessions.subscribe` / `sessions.messages.subscribe{key}`: reference-counted.
    Subscribe(Subscription),
    /// The matching unsubscribes.
    Unsubscribe(Subscription),
    /// `chat.send` / `agent` with an `idempotencyKey` (the run id): the
    /// requester owns the run.
    StartRun {
        run_id: String,
        /// The canonical session key it runs in, if named.
        session_key: Option<String>,
    },
    /// A method that stops or redirects a run ([`ABORT_LIKE`]): the owner rule.
    Abort {
        run_id: Option<String>,
        /// The canonical session key, if named.
        session_key: Option<String>,
    },
    /// Anything else: forwarded as it is.
    Plain,
}

/// A subscription change: the canonical key, and the key as the client
/// wrote it (echoed in the broker's own answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub key: SubKey,
    pub asked: Option<String>,
}

/// One client request.
#[derive(Debug)]
pub struct Request<'a> {
    pub id: &'a str,
    pub method: &'a str,
    /// The params as the client sent them (forwarded untouched).
    pub params: Option<&'a RawValue>,
    /// The params as a value, when the broker or the policy reads them
    /// (`Null` otherwise).
    pub parsed: Value,
    pub kind: Kind,
}

/// The params the broker itself reads.
#[derive(Debug, Default, Deserialize)]
struct Fields {
    #[serde(default)]
    key: Option<String>,
    #[serde(rename = "sessionKey", default)]
    session_key: Option<String>,
    #[serde(rename = "runId", default)]
    run_id: Option<String>,
    #[serde(rename = "idempotencyKey", default)]
    idempotency_key: Option<String>,
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

/// Whether the broker reads `method`'s params itself.
fn broker_reads(method: &str) -> bool {
    matches!(
        method,
        "sessions.messages.subscribe" | "sessions.messages.unsubscribe" | "chat.send" | "agent"
    ) || ABORT_LIKE.contains(&method)
}

impl<'a> Request<'a> {
    /// Parses `params` once (only for the methods whose params the broker
    /// or the policy reads). `canonical` writes a session key the way the
    /// gateway does.
    pub fn parse(
        id: &'a str,
        method: &'a str,
        params: Option<&'a RawValue>,
        canonical: impl Fn(&str) -> String,
    ) -> Self {
        let reads = broker_reads(method);
        let parsed: Value = params
            .filter(|_| reads || reads_params(method))
            .and_then(|p| serde_json::from_str(p.get()).ok())
            .unwrap_or(Value::Null);
        let fields = if reads {
            Fields::deserialize(&parsed).unwrap_or_default()
        } else {
            Fields::default()
        };
        let kind = Self::kind(method, &fields, &canonical);
        Request {
            id,
            method,
            params,
            parsed,
            kind,
        }
    }

    fn kind(method: &str, f: &Fields, canonical: &impl Fn(&str) -> String) -> Kind {
        let messages = |subscribe: bool| match non_empty(&f.key) {
            // Without a key, the gateway words the schema error.
            None => Kind::Plain,
            Some(k) => {
                let sub = Subscription {
                    key: SubKey::Messages(canonical(k)),
                    asked: Some(k.to_owned()),
                };
                if subscribe {
                    Kind::Subscribe(sub)
                } else {
                    Kind::Unsubscribe(sub)
                }
            }
        };
        let sessions = Subscription {
            key: SubKey::Sessions,
            asked: None,
        };
        match method {
            "sessions.subscribe" => Kind::Subscribe(sessions),
            "sessions.unsubscribe" => Kind::Unsubscribe(sessions),
            "sessions.messages.subscribe" => messages(true),
            "sessions.messages.unsubscribe" => messages(false),
            "chat.send" | "agent" => match non_empty(&f.idempotency_key) {
                Some(run_id) => Kind::StartRun {
                    run_id: run_id.to_owned(),
                    session_key: non_empty(&f.session_key).map(canonical),
                },
                None => Kind::Plain,
            },
            m if ABORT_LIKE.contains(&m) => Kind::Abort {
                run_id: non_empty(&f.run_id).map(str::to_owned),
                // `chat.abort` names it `sessionKey`; the `sessions.*` methods `key`.
                session_key: non_empty(&f.session_key)
                    .or(non_empty(&f.key))
                    .map(canonical),
            },
            _ => Kind::Plain,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(method: &str, params: &str) -> Kind {
        let raw = RawValue::from_string(params.to_owned()).unwrap();
        Request::parse("1", method, Some(&raw), |k| format!("agent:main:{k}")).kind
    }

    #[test]
    fn each_method_gets_its_kind_from_one_parse() {
        assert_eq!(
            parse("sessions.messages.subscribe", r#"{"key":"x"}"#),
            Kind::Subscribe(Subscription {
                key: SubKey::Messages("agent:main:x".into()),
                asked: Some("x".into())
            })
        );
        assert_eq!(parse("sessions.messages.subscribe", "{}"), Kind::Plain);
        assert_eq!(
            parse(
                "chat.send",
                r#"{"idempotencyKey":"r1","sessionKey":"main"}"#
            ),
            Kind::StartRun {
                run_id: "r1".into(),
                session_key: Some("agent:main:main".into())
            }
        );
        assert_eq!(parse("chat.send", r#"{"message":"hi"}"#), Kind::Plain);
        for (method, params) in [
            ("chat.abort", r#"{"sessionKey":"s"}"#),
            ("sessions.abort", r#"{"key":"s"}"#),
            ("sessions.steer", r#"{"key":"s","message":"stop"}"#),
        ] {
            assert_eq!(
                parse(method, params),
                Kind::Abort {
                    run_id: None,
                    session_key: Some("agent:main:s".into())
                },
                "{method}"
            );
        }
        assert_eq!(parse("status", r#"{"key":"s"}"#), Kind::Plain);
    }
}
