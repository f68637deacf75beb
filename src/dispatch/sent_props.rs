//! Property: every error of the broker's own (`studio.*`) answering a
//! forwarded request says `details.sent`, whichever path failed it — refused at dispatch (not
//! ready, in-flight cap, policy, ownership), refused by the session's
//! queue (its generation closed), failed with its session (queued or
//! written), timed out (queued or written), handed over — and that its
//! message says the same.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::sync::watch;

use super::{Dispatcher, Registration};
use crate::config::Settings;
use crate::hub::{Hub, Outgoing, QueueLimits};
use crate::protocol::{ErrorShape, StudioCode};
use crate::router::Router;
use crate::sessions::Sessions;
use crate::sharing::Sharing;
use crate::upstream::{FakeQueue, Phase, Status};

/// What the test does next.
#[derive(Debug, Clone)]
enum Op {
    /// Client `c` sends request kind `k`.
    Send { c: usize, k: usize },
    /// The gateway socket takes the `n` oldest queued requests (written).
    Write { n: usize },
    /// The gateway answers the oldest written request (ok or with its own error).
    Answer { ok: bool },
    /// The session ends (a 1012 close): its queue is withdrawn, then
    /// whatever it had is failed; the status may lag behind (still ready
    /// on the closed generation), or the next attempt is under way.
    End { status_lags: bool },
    /// The next session is ready.
    Ready,
    /// Every deadline passes.
    Expire,
    /// The session is handed over; clients `moves` of them move with it.
    Handover { moves: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, 0..REQUESTS.len()).prop_map(|(c, k)| Op::Send { c, k }),
        3 => (1..4usize).prop_map(|n| Op::Write { n }),
        2 => any::<bool>().prop_map(|ok| Op::Answer { ok }),
        1 => any::<bool>().prop_map(|status_lags| Op::End { status_lags }),
        2 => Just(Op::Ready),
        1 => Just(Op::Expire),
        1 => any::<bool>().prop_map(|moves| Op::Handover { moves }),
    ]
}

/// Requests of every kind the dispatcher tells apart.
const REQUESTS: [(&str, &str); 8] = [
    ("status", "{}"),
    (
        "chat.send",
        r#"{"sessionKey":"main","message":"x","idempotencyKey":"RUN"}"#,
    ),
    (
        "chat.send",
        r#"{"sessionKey":"MAIN","message":"/stop","idempotencyKey":"RUN"}"#,
    ),
    ("chat.abort", r#"{"sessionKey":"main"}"#),
    ("sessions.messages.subscribe", r#"{"key":"main"}"#),
    ("sessions.subscribe", "{}"),
    ("node.event", "{}"),
    ("agent", r#"{"message":"x","idempotencyKey":"RUN"}"#),
];

/// The code the double's own errors carry (passed through untouched).
const GATEWAY_ERROR: &str = "GATEWAY_SAID_NO";

struct World {
    dispatcher: Arc<Dispatcher>,
    router: Arc<Router>,
    queue: FakeQueue,
    status: watch::Sender<Status>,
    clients: Vec<Registration>,
    generation: u64,
    /// Upstream ids taken for writing, oldest first, not yet answered.
    written: Vec<String>,
    runs: u64,
}

impl World {
    fn new() -> World {
        let limits = QueueLimits {
            soft_bytes: 1 << 20,
            hard_bytes: 1 << 23,
            grace: Duration::from_secs(10),
        };
        let hub = Arc::new(Hub::new(limits, 16));
        let router = Arc::new(Router::new(
            Duration::from_secs(5),
            Duration::from_secs(5),
            4,
        ));
        let settings = Settings::new("/nonexistent.sock");
        let (upstream, seed) = crate::upstream::Upstream::new(&settings);
        let (status, queue) = seed.fake_ready(1);
        let sessions = Arc::new(Sessions::for_tests(&settings, &hub, &router, upstream));
        let dispatcher = Arc::new(Dispatcher::new(
            hub,
            Arc::clone(&router),
            Arc::new(Sharing::new()),
            sessions,
        ));
        let clients = (0..3)
            .map(|i| {
                let client = dispatcher.hub.new_client();
                let scopes: &[&str] = if i == 0 {
                    &["operator.admin"]
                } else {
                    &["operator.read", "operator.write"]
                };
                client.set_access(crate::policy::Access {
                    grant: crate::policy::Grant::new(scopes.iter().copied()),
                    socket: Arc::new(crate::policy::SocketPolicy::main("/x".into())),
                });
                dispatcher.register(client)
            })
            .collect();
        World {
            dispatcher,
            router,
            queue,
            status,
            clients,
            generation: 1,
            written: Vec::new(),
            runs: 0,
        }
    }

    fn closed_error(&self) -> ErrorShape {
        ErrorShape::studio(
            StudioCode::UpstreamClosed,
            "gateway closed the connection (1012): restart",
        )
    }

    /// Applies `op`; the refusals dispatch answered at once.
    fn apply(&mut self, op: &Op) -> Vec<ErrorShape> {
        let mut refused = Vec::new();
        match *op {
            Op::Send { c, k } => {
                let (method, params) = REQUESTS[k];
                self.runs += 1;
                let params = params.replace("RUN", &format!("run-{}", self.runs));
                let raw = RawValue::from_string(params).unwrap();
                if let Err(e) = self.dispatcher.dispatch(
                    self.clients[c].member(),
                    &format!("local-{}", self.runs),
                    method,
                    Some(&raw),
                ) {
                    refused.push(e);
                }
            }
            Op::Write { n } => {
                for _ in 0..n {
                    let Ok(out) = self.queue.try_recv() else {
                        break;
                    };
                    self.written.push(out.id);
                }
            }
            Op::Answer { ok } => {
                if !self.written.is_empty() {
                    let id = self.written.remove(0);
                    let error = RawValue::from_string(format!(
                        r#"{{"code":"{GATEWAY_ERROR}","message":"no"}}"#
                    ))
                    .unwrap();
                    let payload = RawValue::from_string("{}".into()).unwrap();
                    self.router.complete(
                        &id,
                        ok,
                        ok.then_some(&*payload),
                        (!ok).then_some(&*error),
                    );
                }
            }
            Op::End { status_lags } => {
                let unsent = self.queue.close(self.generation);
                self.router
                    .fail_generation(self.generation, &unsent, &self.closed_error());
                self.written.clear();
                self.generation += 1;
                let generation = self.generation;
                if !status_lags {
                    self.status.send_modify(|s| {
                        s.phase = Phase::Backoff;
                        s.generation = generation;
                        s.last_error = Some(ErrorShape::studio(
                            StudioCode::UpstreamClosed,
                            "gateway closed the connection (1012): restart",
                        ));
                    });
                }
            }
            Op::Ready => {
                let generation = self.generation;
                self.status.send_modify(|s| {
                    s.phase = Phase::Ready;
                    s.generation = generation;
                });
            }
            Op::Expire => {
                self.router
                    .expire(Instant::now() + Duration::from_secs(3600));
                self.written.clear();
            }
            Op::Handover { moves } => {
                let unsent = self.queue.close(self.generation);
                self.router
                    .take_for_handover(self.generation, |_| moves, &unsent);
                self.written.clear();
                self.generation += 1;
            }
        }
        refused
    }

    /// Every error answer in the clients' queues, by local id.
    fn answered_errors(&self) -> Vec<Value> {
        let mut errors = Vec::new();
        for client in &self.clients {
            let (items, _) = client.client().take_all();
            for item in items {
                if let Outgoing::Frame(bytes) = item {
                    let v: Value = serde_json::from_slice(&bytes).unwrap();
                    if v["ok"] == false {
                        errors.push(v);
                    }
                }
            }
        }
        errors
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_broker_error_for_a_forwarded_request_says_whether_it_was_sent(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        let mut w = World::new();
        for op in &ops {
            for e in w.apply(op) {
                if !e.code.starts_with("studio.") {
                    // In the gateway's own words, as the gateway refuses it.
                    prop_assert!(e.details.as_ref().and_then(|d| d.get("sent")).is_none());
                    continue;
                }
                prop_assert_eq!(
                    e.details.as_ref().and_then(|d| d.get("sent")),
                    Some(&Value::Bool(false)),
                    "refused at dispatch: {:?} after {:?}", e, op
                );
            }
            for frame in w.answered_errors() {
                let error = &frame["error"];
                if error["code"] == GATEWAY_ERROR {
                    continue;
                }
                let sent = &error["details"]["sent"];
                prop_assert!(sent.is_boolean(), "no details.sent: {} after {:?}", frame, op);
                prop_assert_eq!(
                    error["message"].as_str().unwrap().ends_with("gateway may have run it)"),
                    sent == true,
                    "the message says the same: {}", frame
                );
            }
        }
        // The last session ends with whatever it still holds.
        let _ = w.apply(&Op::End { status_lags: false });
        for frame in w.answered_errors() {
            prop_assert!(
                frame["error"]["code"] == GATEWAY_ERROR || frame["error"]["details"]["sent"].is_boolean(),
                "{}", frame
            );
        }
    }
}
