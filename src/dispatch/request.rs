//! A client request, parsed once into what the broker needs to decide its
//! path: the kind (subscription change, run start, abort-like, plain) and
//! the few params it reads. The policy check and the dispatch both use the
//! same parse.

use serde_json::value::RawValue;
use serde_json::Value;

use crate::policy::methods::{reads_params, ABORT_LIKE};
use crate::policy::stop::{interrupts_run, is_stop_message};
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
        /// It aborts the session's running run first ([`interrupts_run`]:
        /// `queueMode: "interrupt"`, or a `/queue interrupt` directive): the
        /// owner rule, session-wide, before it starts.
        interrupts: bool,
    },
    /// A method that stops or redirects a run ([`ABORT_LIKE`]), or a
    /// `chat.send`/`sessions.send` whose message the gateway reads as
    /// "stop" ([`is_stop_message`]), or a `sessions.send` (or a `chat.send`
    /// without a run id) that interrupts ([`interrupts_run`]): the owner rule.
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
            Fields::read(&parsed)
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
        let stops = f.message.as_deref().is_some_and(is_stop_message);
        let interrupts = matches!(method, "chat.send" | "sessions.send")
            && interrupts_run(f.queue_mode.as_deref(), f.message.as_deref());
        let starts = method != "sessions.send" && non_empty(&f.idempotency_key).is_some();
        match method {
            // The gateway aborts the session's runs instead of starting one;
            // or aborts the running one and starts its own, which the broker
            // does not track for `sessions.send` (as for any of its runs).
            "chat.send" | "sessions.send" if stops || (interrupts && !starts) => Kind::Abort {
                run_id: None,
                // `chat.send` names it `sessionKey`, `sessions.send` `key`.
                session_key: non_empty(&f.session_key)
                    .or(non_empty(&f.key))
                    .map(canonical),
            },
            "sessions.subscribe" => Kind::Subscribe(sessions),
            "sessions.unsubscribe" => Kind::Unsubscribe(sessions),
            "sessions.messages.subscribe" => messages(true),
            "sessions.messages.unsubscribe" => messages(false),
            "chat.send" | "agent" => match non_empty(&f.idempotency_key) {
                Some(run_id) => Kind::StartRun {
                    run_id: run_id.to_owned(),
                    session_key: non_empty(&f.session_key).map(canonical),
                    interrupts,
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
                session_key: Some("agent:main:main".into()),
                interrupts: false,
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
                interrupts: false,
            }
        );
        // Not a stop, or not a string: as before.
        assert_eq!(
            parse("sessions.send", r#"{"key":"s","message":"stop the music"}"#),
            Kind::Plain
        );
        assert_eq!(
            parse("chat.send", r#"{"sessionKey":"s","message":["stop"]}"#),
            Kind::Plain
        );
    }

    #[test]
    fn an_interrupting_send_carries_the_owner_rule() {
        let starts = |interrupts| Kind::StartRun {
            run_id: "r1".into(),
            session_key: Some("agent:main:s".into()),
            interrupts,
        };
        for params in [
            r#"{"sessionKey":"s","message":"hi","queueMode":"interrupt","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"/queue interrupt hi","idempotencyKey":"r1"}"#,
        ] {
            assert_eq!(parse("chat.send", params), starts(true), "{params}");
        }
        for params in [
            r#"{"sessionKey":"s","message":"hi","queueMode":"steer","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"hi","queueMode":"followup","idempotencyKey":"r1"}"#,
            r#"{"sessionKey":"s","message":"hi","idempotencyKey":"r1"}"#,
        ] {
            assert_eq!(parse("chat.send", params), starts(false), "{params}");
        }
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
            starts(false)
        );
    }
}
