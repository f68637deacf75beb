//! A client request, parsed once into what the broker needs to decide its
//! path: the kind (subscription change, run start, abort-like, plain) and
//! the few params it reads. The policy check and the dispatch both use the
//! same parse.

use serde_json::value::RawValue;
use serde_json::Value;

use crate::policy::methods::{reads_params, ABORT_LIKE};
use crate::policy::stop::{is_stop_message, touch, Touch};
use crate::sharing::SessionDefaults;
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
        /// The canonical session key it runs in: the one named, or for an
        /// `agent` request without one, its agent's main session (where
        /// the gateway runs it).
        session_key: Option<String>,
        /// What it does to the session's running run ([`touch`]): one that
        /// steers or interrupts it on purpose carries the owner rule,
        /// session-wide, before it starts; one that names no mode is
        /// queued behind another client's run ([`Kind::StartRun`] in the
        /// dispatcher). Always [`Touch::Leaves`] for `agent`.
        touch: Touch,
    },
    /// A method that stops or redirects a run ([`ABORT_LIKE`]), or a
    /// `chat.send`/`sessions.send` whose message the gateway reads as
    /// "stop" ([`is_stop_message`]), or a `sessions.send` (which has no
    /// queue mode: it steers by default) or a `chat.send` without a run id
    /// that steers or interrupts ([`touch`]): the owner rule.
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
#[derive(Debug, Default)]
struct Fields {
    key: Option<String>,
    session_key: Option<String>,
    run_id: Option<String>,
    idempotency_key: Option<String>,
    message: Option<String>,
    queue_mode: Option<String>,
    agent_id: Option<String>,
}

impl Fields {
    /// Each field read on its own, as a string: one of another type (which
    /// the gateway's schema refuses anyway) does not hide the others, so a
    /// stop message cannot slip by with a stray `"runId": 5` beside it.
    fn read(parsed: &Value) -> Fields {
        let text = |name: &str| parsed.get(name).and_then(Value::as_str).map(str::to_owned);
        Fields {
            key: text("key"),
            session_key: text("sessionKey"),
            run_id: text("runId"),
            idempotency_key: text("idempotencyKey"),
            message: text("message"),
            queue_mode: text("queueMode"),
            agent_id: text("agentId"),
        }
    }
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

/// Whether the broker reads `method`'s params itself.
fn broker_reads(method: &str) -> bool {
    matches!(
        method,
        "sessions.messages.subscribe"
            | "sessions.messages.unsubscribe"
            | "chat.send"
            | "agent"
            | "sessions.send"
    ) || ABORT_LIKE.contains(&method)
}

impl<'a> Request<'a> {
    /// Parses `params` once (only for the methods whose params the broker
    /// or the policy reads). Session keys are resolved the way the gateway
    /// with these defaults does ([`crate::sharing::session_key`]).
    pub fn parse(
        id: &'a str,
        method: &'a str,
        params: Option<&'a RawValue>,
        defaults: &SessionDefaults,
    ) -> Self {
        let reads = broker_reads(method);
        let parsed: Value = params
            .filter(|_| reads || reads_params(method))
            .and_then(|p| serde_json::from_str(p.get()).ok())
            .unwrap_or(Value::Null);
        let fields = if reads {
            Fields::read(&parsed)
        } else {
            Fields::default()
        };
        let kind = Self::kind(method, &fields, defaults);
        Request {
            id,
            method,
            params,
            parsed,
            kind,
        }
    }

    fn kind(method: &str, f: &Fields, defaults: &SessionDefaults) -> Kind {
        // The session a request names, as the gateway resolves it (with
        // its `agentId`, where it names one).
        let agent_id = non_empty(&f.agent_id);
        let canonical = |key: &str| defaults.canonical_for(key, agent_id);
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
        let stops = f.message.as_deref().is_some_and(is_stop_message);
        let touch = match method {
            "chat.send" => touch(f.queue_mode.as_deref(), f.message.as_deref()),
            // No queue mode in its schema: the session's own (`steer` by
            // default), or what its message says.
            "sessions.send" => match touch(None, f.message.as_deref()) {
                Touch::Default => Touch::Takes,
                t => t,
            },
            _ => Touch::Leaves,
        };
        let starts = method != "sessions.send" && non_empty(&f.idempotency_key).is_some();
        match method {
            // The gateway aborts the session's runs instead of starting one;
            // or steers or aborts the running one and starts its own, which
            // the broker does not track for `sessions.send` (as for any of
            // its runs).
            "chat.send" | "sessions.send" if stops || (touch == Touch::Takes && !starts) => {
                Kind::Abort {
                    run_id: None,
                    // `chat.send` names it `sessionKey`, `sessions.send` `key`.
                    session_key: non_empty(&f.session_key)
                        .or(non_empty(&f.key))
                        .map(canonical),
                }
            }
            "sessions.subscribe" => Kind::Subscribe(sessions),
            "sessions.unsubscribe" => Kind::Unsubscribe(sessions),
            "sessions.messages.subscribe" => messages(true),
            "sessions.messages.unsubscribe" => messages(false),
            "chat.send" | "agent" => match non_empty(&f.idempotency_key) {
                Some(run_id) => Kind::StartRun {
                    run_id: run_id.to_owned(),
                    session_key: match non_empty(&f.session_key) {
                        Some(key) => Some(canonical(key)),
                        // `agent` without a key runs in its agent's main
                        // session (`chat.send` requires one).
                        None if method == "agent" => Some(defaults.agent_main(agent_id)),
                        None => None,
                    },
                    touch,
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
        Request::parse("1", method, Some(&raw), &SessionDefaults::default()).kind
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
                session_key: Some("agent:main:main".into()),
                touch: Touch::Default,
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

    #[test]
    fn a_stop_message_is_a_session_wide_abort_where_the_gateway_reads_one() {
        let abort = Kind::Abort {
            run_id: None,
            session_key: Some("agent:main:s".into()),
        };
        for (method, params) in [
            (
                "chat.send",
                r#"{"sessionKey":"s","message":"/stop","idempotencyKey":"r1"}"#,
            ),
            ("chat.send", r#"{"sessionKey":"s","message":"Stop!"}"#),
            ("sessions.send", r#"{"key":"s","message":"please stop"}"#),
            // A field of another type does not hide the message.
            (
                "chat.send",
                r#"{"sessionKey":"s","message":"/stop","runId":5}"#,
            ),
        ] {
            assert_eq!(parse(method, params), abort, "{method} {params}");
        }
        // `agent` reads no stop word: its message starts a run.
        assert_eq!(
            parse(
                "agent",
                r#"{"sessionKey":"s","message":"/stop","idempotencyKey":"r1"}"#
            ),
            Kind::StartRun {
                run_id: "r1".into(),
                session_key: Some("agent:main:s".into()),
                touch: Touch::Leaves,
            }
        );
        // Not a stop, or not a string: as before.
        assert_eq!(
            parse(
                "sessions.send",
                r#"{"key":"s","message":"/queue followup stop the music"}"#
            ),
            Kind::Plain
        );
        assert_eq!(
            parse("chat.send", r#"{"sessionKey":"s","message":["stop"]}"#),
            Kind::Plain
        );
    }

    #[test]
    fn an_interrupting_send_carries_the_owner_rule() {
        let starts = |touch| Kind::StartRun {
            run_id: "r1".into(),
            session_key: Some("agent:main:s".into()),
            touch,
        };
        for params in [
            r#"{"sessionKey":"s","message":"hi","queueMode":"interrupt","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"/queue interrupt hi","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"hi","queueMode":"steer","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"/queue steer hi","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"/steer hi","idempotencyKey":"r1"}"#,
        ] {
            assert_eq!(parse("chat.send", params), starts(Touch::Takes), "{params}");
        }
        for params in [
            r#"{"sessionKey":"s","message":"hi","queueMode":"followup","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"hi","queueMode":"steer-backlog","idempotencyKey":"r1"}"#,
        ] {
            assert_eq!(
                parse("chat.send", params),
                starts(Touch::Leaves),
                "{params}"
            );
        }
        assert_eq!(
            parse(
                "chat.send",
                r#"{"sessionKey":"s","message":"hi","idempotencyKey":"r1"}"#
            ),
            starts(Touch::Default)
        );
        // `sessions.send` (its run untracked) and a `chat.send` without a
        // run id: a session-wide abort.
        let abort = Kind::Abort {
            run_id: None,
            session_key: Some("agent:main:s".into()),
        };
        assert_eq!(
            parse(
                "sessions.send",
                r#"{"key":"s","message":"/queue abort now"}"#
            ),
            abort
        );
        assert_eq!(
            parse(
                "chat.send",
                r#"{"sessionKey":"s","message":"x","queueMode":"interrupt"}"#
            ),
            abort
        );
        // `agent` has no queue mode and reads no directive.
        assert_eq!(
            parse(
                "agent",
                r#"{"sessionKey":"s","message":"/queue interrupt","queueMode":"interrupt","idempotencyKey":"r1"}"#
            ),
            starts(Touch::Leaves)
        );
    }

    #[test]
    fn sessions_are_named_as_the_gateway_resolves_them() {
        let run = |params: &str| match parse("chat.send", params) {
            Kind::StartRun { session_key, .. } => session_key,
            other => panic!("{other:?}"),
        };
        for key in ["MAIN", "AGENT:MAIN:MAIN", "agent:Main:main"] {
            assert_eq!(
                run(&format!(
                    r#"{{"sessionKey":"{key}","message":"x","idempotencyKey":"r"}}"#
                )),
                Some("agent:main:main".into()),
                "{key}"
            );
        }
        assert_eq!(
            run(r#"{"sessionKey":"main","agentId":"ops","message":"x","idempotencyKey":"r"}"#),
            Some("agent:ops:main".into())
        );
        // An `agent` request without a key runs in the main session of its
        // agent, or of the default one.
        for (params, key) in [
            (r#"{"message":"x","idempotencyKey":"r"}"#, "agent:main:main"),
            (
                r#"{"message":"x","agentId":"Ops","idempotencyKey":"r"}"#,
                "agent:ops:main",
            ),
        ] {
            assert_eq!(
                parse("agent", params),
                Kind::StartRun {
                    run_id: "r".into(),
                    session_key: Some(key.into()),
                    touch: Touch::Leaves,
                },
                "{params}"
            );
        }
        assert_eq!(
            parse("chat.abort", r#"{"sessionKey":"Agent:Main:Main"}"#),
            Kind::Abort {
                run_id: None,
                session_key: Some("agent:main:main".into())
            }
        );
    }
}
