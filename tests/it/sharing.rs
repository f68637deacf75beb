//! What sharing one session changes, and what the broker does so clients do
//! not notice: subscriptions, targeted events, run ownership, refusals, caps.

use std::time::Duration;

use crate::support::*;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// A front end's scopes without admin (aborting another's run needs admin).
const READ_WRITE: [&str; 2] = ["operator.read", "operator.write"];

fn upstream_methods(h: &Harness, method: &str) -> usize {
    h.gw.requests()
        .iter()
        .filter(|(_, r)| r["method"] == method)
        .count()
}

/// Whether the double's view of the broker connection is "subscribed":
/// the last sessions.(un)subscribe it saw.
fn upstream_subscribed(h: &Harness) -> bool {
    h.gw.requests()
        .iter()
        .rev()
        .find(|(_, r)| r["method"] == "sessions.subscribe" || r["method"] == "sessions.unsubscribe")
        .is_some_and(|(_, r)| r["method"] == "sessions.subscribe")
}

#[tokio::test]
async fn subscriptions_are_reference_counted() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    assert_eq!(
        a.request("sessions.subscribe", json!({})).await["payload"]["subscribed"],
        true
    );
    assert_eq!(
        b.request("sessions.subscribe", json!({})).await["payload"]["subscribed"],
        true
    );
    assert_eq!(
        upstream_methods(&h, "sessions.subscribe"),
        1,
        "only the first goes upstream"
    );
    assert_eq!(
        a.request("sessions.unsubscribe", json!({})).await["payload"]["subscribed"],
        false
    );
    assert_eq!(
        upstream_methods(&h, "sessions.unsubscribe"),
        0,
        "b still holds it"
    );
    drop(b); // the last holder disconnects
    eventually("release sent upstream", || {
        upstream_methods(&h, "sessions.unsubscribe") == 1
    })
    .await;
    // Per-key message subscriptions, likewise.
    let key = json!({"key": "agent:main:main"});
    let (mut c, _) = h.connected().await;
    assert_eq!(
        a.request("sessions.messages.subscribe", key.clone()).await["payload"]["key"],
        "agent:main:main"
    );
    c.request("sessions.messages.subscribe", key.clone()).await;
    assert_eq!(upstream_methods(&h, "sessions.messages.subscribe"), 1);
    a.request("sessions.messages.unsubscribe", key.clone())
        .await;
    c.request("sessions.messages.unsubscribe", key.clone())
        .await;
    assert_eq!(upstream_methods(&h, "sessions.messages.unsubscribe"), 1);
}

/// Random orders of subscribe/unsubscribe/disconnect by three clients: the
/// gateway is subscribed exactly when at least one local client is.
#[tokio::test]
async fn subscription_refcounts_hold_in_any_order() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for round in 0..12 {
        let h = start().await;
        let mut clients: Vec<Option<WsClient>> = Vec::new();
        for _ in 0..3 {
            clients.push(Some(h.connected().await.0));
        }
        let mut local = [false; 3];
        for step in 0..8 {
            let who = rng.random_range(0..3);
            let op = rng.random_range(0..3);
            match (op, clients[who].as_mut()) {
                (0, Some(c)) => {
                    c.request("sessions.subscribe", json!({})).await;
                    local[who] = true;
                }
                (1, Some(c)) => {
                    c.request("sessions.unsubscribe", json!({})).await;
                    local[who] = false;
                }
                (2, Some(_)) => {
                    clients[who] = None;
                    local[who] = false;
                }
                _ => continue,
            }
            let want = local.iter().any(|s| *s);
            let what = format!("round {round} step {step}: upstream subscribed == {want}");
            eventually(&what, || upstream_subscribed(&h) == want).await;
            // Exactly as many upstream requests as transitions: never a duplicate.
            let subs = upstream_methods(&h, "sessions.subscribe");
            let unsubs = upstream_methods(&h, "sessions.unsubscribe");
            assert!(
                subs == unsubs || subs == unsubs + 1,
                "{what}: {subs} subscribes, {unsubs} unsubscribes"
            );
        }
    }
}

/// Waits for `marker` and returns every event name seen before it.
async fn events_until_marker(c: &mut WsClient) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        let e = c.event_any().await;
        let name = e["event"].as_str().unwrap_or_default().to_owned();
        if name == "test.marker" {
            return names;
        }
        names.push(name);
    }
}

#[tokio::test]
async fn targeted_events_reach_only_subscribers() {
    let h = start().await;
    let (mut a, _) = h.connected().await; // sessions.subscribe
    let (mut b, _) = h.connected().await; // messages of one key
    let (mut c, _) = h.connected().await; // nothing
    a.request("sessions.subscribe", json!({})).await;
    b.request(
        "sessions.messages.subscribe",
        json!({"key": "agent:main:main"}),
    )
    .await;
    h.gw.emit_sessions_changed(json!({"sessionKey": "agent:main:main"}));
    h.gw.emit_session_message(
        "agent:main:main",
        json!({"sessionKey": "agent:main:main", "message": {"role": "user"}}),
    );
    h.gw.emit_session_message(
        "agent:other:main",
        json!({"sessionKey": "agent:other:main", "message": {"role": "user"}}),
    );
    h.gw.broadcast("test.marker", json!({}));
    let seen_a = events_until_marker(&mut a).await;
    let seen_b = events_until_marker(&mut b).await;
    let seen_c = events_until_marker(&mut c).await;
    let count = |v: &[String], n: &str| v.iter().filter(|e| *e == n).count();
    assert_eq!(count(&seen_a, "sessions.changed"), 1);
    assert_eq!(count(&seen_a, "session.message"), 2);
    assert_eq!(count(&seen_b, "sessions.changed"), 0);
    assert_eq!(count(&seen_b, "session.message"), 1, "only its key");
    assert_eq!(
        count(&seen_c, "session.message") + count(&seen_c, "sessions.changed"),
        0
    );
}

#[tokio::test]
async fn tool_events_go_to_the_client_that_started_the_run() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    a.request(
        "chat.send",
        json!({"sessionKey": "agent:main:main", "message": "run a tool", "idempotencyKey": key}),
    )
    .await;
    let mut a_tools = 0;
    loop {
        let e = a.event("agent").await;
        if e["payload"]["stream"] == "tool" {
            a_tools += 1;
        }
        if e["payload"]["stream"] == "lifecycle" && e["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
    assert!(a_tools > 0, "the starter gets its tool stream");
    loop {
        let e = b.event("agent").await;
        assert_ne!(
            e["payload"]["stream"], "tool",
            "another client never gets it"
        );
        if e["payload"]["stream"] == "lifecycle" && e["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
}

/// A local `sessions.subscribe` holder gets `session.tool` for a run
/// another local client started, as a direct subscriber of the gateway
/// would: the gateway counted the broker's connection as the starter and
/// sent it `agent` tool events instead, so the broker delivers them to the
/// other subscribers as `session.tool` (same payload), and the starter
/// keeps its `agent` tool stream only.
#[tokio::test]
async fn broker_subscribers_get_session_tool_for_another_clients_run() {
    let h = start().await;
    let (mut starter, _) = h.connected().await;
    let (mut watcher, _) = h.connected().await;
    for c in [&mut starter, &mut watcher] {
        assert_eq!(c.request("sessions.subscribe", json!({})).await["ok"], true);
    }
    let key = uuid::Uuid::new_v4().to_string();
    starter
        .request(
            "chat.send",
            json!({"sessionKey": "agent:main:main", "message": "run a tool", "idempotencyKey": key}),
        )
        .await;
    let mut agent_tools = Vec::new();
    loop {
        let e = starter.event("agent").await;
        if e["payload"]["stream"] == "tool" {
            agent_tools.push(e["payload"].clone());
        }
        if e["payload"]["stream"] == "lifecycle" && e["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
    assert!(!agent_tools.is_empty());
    let mut session_tools = Vec::new();
    while session_tools.len() < agent_tools.len() {
        let e = watcher.event("session.tool").await;
        assert_eq!(e["payload"]["runId"], key.as_str(), "{e}");
        session_tools.push(e["payload"].clone());
    }
    assert_eq!(session_tools, agent_tools, "the same payloads, in order");
    // The starter got none as session.tool (its own run comes as agent).
    let (mut probe, _) = h.connected().await;
    assert_eq!(probe.request("health", json!({})).await["ok"], true);
    assert_eq!(starter.request("health", json!({})).await["ok"], true);
    assert!(
        !starter.events.iter().any(|e| e["event"] == "session.tool"),
        "{:?}",
        starter.events
    );
}

#[tokio::test]
async fn chat_abort_of_another_clients_run_is_forbidden_unless_admin() {
    let cfg = MockConfig {
        run_step_delay: Duration::from_secs(30),
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (mut owner, _) = h.connected_as(&READ_WRITE).await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    let mut admin = h.client().await;
    admin.recv_json().await;
    let mut frame = connect_frame("c-admin");
    frame["params"]["scopes"] = json!(["operator.admin"]);
    admin.send_json(&frame).await;
    assert_eq!(admin.response("c-admin").await["ok"], true);
    let key = uuid::Uuid::new_v4().to_string();
    let session = "agent:main:main";
    owner
        .request(
            "chat.send",
            json!({"sessionKey": session, "message": "long", "idempotencyKey": key}),
        )
        .await;
    let refused = other
        .request("chat.abort", json!({"sessionKey": session, "runId": key}))
        .await;
    assert_eq!(refused["error"]["code"], "studio.forbidden", "{refused}");
    let refused = other
        .request("chat.abort", json!({"sessionKey": session}))
        .await;
    assert_eq!(
        refused["error"]["code"], "studio.forbidden",
        "a session-wide abort would hit it too"
    );
    assert_eq!(upstream_methods(&h, "chat.abort"), 0, "refused locally");
    let by_admin = admin
        .request("chat.abort", json!({"sessionKey": session, "runId": key}))
        .await;
    assert_eq!(by_admin["ok"], true, "{by_admin}");
    let key2 = uuid::Uuid::new_v4().to_string();
    owner
        .request(
            "chat.send",
            json!({"sessionKey": session, "message": "again", "idempotencyKey": key2}),
        )
        .await;
    let own = owner
        .request("chat.abort", json!({"sessionKey": session, "runId": key2}))
        .await;
    assert_eq!(own["ok"], true, "{own}");
}

/// A broker whose gateway double plays runs slowly (a run stays live), and
/// a read+write client that has started one in `main`: the client and the
/// run's id.
async fn a_live_run() -> (Harness, WsClient, String) {
    let cfg = MockConfig {
        run_step_delay: Duration::from_secs(30),
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (mut owner, _) = h.connected_as(&READ_WRITE).await;
    let key = uuid::Uuid::new_v4().to_string();
    owner
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "long", "idempotencyKey": key}),
        )
        .await;
    (h, owner, key)
}

/// `sessions.abort` and `sessions.steer` stop or redirect a run just as
/// `chat.abort` does: the same ownership rule, by run id or session-wide.
#[tokio::test]
async fn every_abort_like_method_checks_run_ownership() {
    let (h, mut owner, key) = a_live_run().await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    for (method, params) in [
        ("sessions.abort", json!({"key": "main"})),
        (
            "sessions.abort",
            json!({"key": "agent:main:main", "runId": key}),
        ),
        (
            "sessions.steer",
            json!({"key": "main", "message": "stop that"}),
        ),
    ] {
        let refused = other.request(method, params.clone()).await;
        assert_eq!(
            refused["error"]["code"], "studio.forbidden",
            "{method} {params}: {refused}"
        );
    }
    assert_eq!(upstream_methods(&h, "sessions.abort"), 0, "refused locally");
    assert_eq!(upstream_methods(&h, "sessions.steer"), 0, "refused locally");
    // The run's owner may.
    owner
        .request("sessions.abort", json!({"key": "main", "runId": key}))
        .await;
    assert_eq!(upstream_methods(&h, "sessions.abort"), 1);
}

/// A `chat.send` or `sessions.send` whose message the gateway reads as
/// "stop" (`/stop`, "stop", "please stop", …) aborts every run in that
/// session: the same ownership rule and error as a session-wide
/// `chat.abort` . `agent` reads no stop word at the gateway
/// (its message starts a run), so it is forwarded.
#[tokio::test]
async fn a_stop_message_to_another_clients_run_is_forbidden_unless_its_own() {
    let (h, mut owner, _key) = a_live_run().await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    for (method, params) in [
        (
            "chat.send",
            json!({"sessionKey": "main", "message": "/stop",
                "idempotencyKey": uuid::Uuid::new_v4().to_string()}),
        ),
        (
            "chat.send",
            json!({"sessionKey": "agent:main:main", "message": "Stop!",
                "idempotencyKey": uuid::Uuid::new_v4().to_string()}),
        ),
        (
            "sessions.send",
            json!({"key": "main", "message": "please stop"}),
        ),
        ("sessions.send", json!({"key": "main", "message": "/STOP:"})),
    ] {
        let refused = other.request(method, params.clone()).await;
        assert_eq!(
            refused["error"]["code"], "studio.forbidden",
            "{method} {params}: {refused}"
        );
        assert!(
            refused["error"]["message"]
                .as_str()
                .unwrap()
                .contains("started by another local client"),
            "the abort rule's own error: {refused}"
        );
    }
    assert_eq!(upstream_methods(&h, "chat.send"), 1, "only the owner's run");
    assert_eq!(upstream_methods(&h, "sessions.send"), 0, "refused locally");
    // `agent` with the same message starts a run at the gateway.
    let started = other
        .request(
            "agent",
            json!({"sessionKey": "main", "message": "/stop",
                "idempotencyKey": uuid::Uuid::new_v4().to_string()}),
        )
        .await;
    assert_eq!(started["ok"], true, "{started}");
    assert_eq!(upstream_methods(&h, "agent"), 1);
    // An ordinary message is not a stop.
    let chat = other
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "stop the music",
                "idempotencyKey": uuid::Uuid::new_v4().to_string()}),
        )
        .await;
    assert_ne!(chat["error"]["code"], "studio.forbidden", "{chat}");
    assert_eq!(upstream_methods(&h, "chat.send"), 2);
    // The run's owner may stop its session by message (the other's `agent`
    // and chat runs are live there too: the owner needs admin for those).
    let (h2, mut owner2, _) = a_live_run().await;
    let own = owner2
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "/stop",
                "idempotencyKey": uuid::Uuid::new_v4().to_string()}),
        )
        .await;
    assert_ne!(own["error"]["code"], "studio.forbidden", "{own}");
    assert_eq!(upstream_methods(&h2, "chat.send"), 2, "forwarded");
    let refused = owner
        .request("sessions.send", json!({"key": "main", "message": "stop"}))
        .await;
    assert_eq!(
        refused["error"]["code"], "studio.forbidden",
        "the other client's runs are live in main now: {refused}"
    );
}

/// A `chat.send` with `queueMode: "interrupt"`, or whose message carries a
/// `/queue interrupt` directive (or is a `/new` or `/reset`), aborts the session's running run before
/// its own starts (gateway 2026.9.6 `chat-send-handler.ts`): the abort
/// ownership rule applies to it, session-wide. `followup`/`collect` queue
/// behind it: forwarded (`steer`: `run_ownership`). The owner's own interrupt is forwarded, and its new run is
/// its own.
#[tokio::test]
async fn an_interrupting_send_to_another_clients_run_is_forbidden_unless_its_own() {
    let (h, mut owner, _key) = a_live_run().await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    let run = || uuid::Uuid::new_v4().to_string();
    for (method, params) in [
        (
            "chat.send",
            json!({"sessionKey": "main", "message": "do this instead",
                "queueMode": "interrupt", "idempotencyKey": run()}),
        ),
        (
            "chat.send",
            json!({"sessionKey": "agent:main:main", "message": "/queue interrupt do this instead",
                "idempotencyKey": run()}),
        ),
        (
            "sessions.send",
            json!({"key": "main", "message": "/queue: abort now"}),
        ),
        // A session reset interrupts the running run too.
        (
            "chat.send",
            json!({"sessionKey": "main", "message": "/reset", "idempotencyKey": run()}),
        ),
    ] {
        let refused = other.request(method, params.clone()).await;
        assert_eq!(
            refused["error"]["code"], "studio.forbidden",
            "{method} {params}: {refused}"
        );
    }
    assert_eq!(upstream_methods(&h, "chat.send"), 1, "only the owner's run");
    assert_eq!(upstream_methods(&h, "sessions.send"), 0, "refused locally");
    for mode in ["followup", "collect"] {
        let sent = other
            .request(
                "chat.send",
                json!({"sessionKey": "main", "message": "also this",
                    "queueMode": mode, "idempotencyKey": run()}),
            )
            .await;
        assert_ne!(sent["error"]["code"], "studio.forbidden", "{mode}: {sent}");
    }
    assert_eq!(upstream_methods(&h, "chat.send"), 3);
    // The owner may interrupt its own run, in a session where no other
    // client's run is live; its new run is then its own.
    let (h2, mut owner2, _) = a_live_run().await;
    let again = run();
    let own = owner2
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "instead",
                "queueMode": "interrupt", "idempotencyKey": again}),
        )
        .await;
    assert_ne!(own["error"]["code"], "studio.forbidden", "{own}");
    assert_eq!(upstream_methods(&h2, "chat.send"), 2, "forwarded");
    let (mut third, _) = h2.connected_as(&READ_WRITE).await;
    let refused = third
        .request("chat.abort", json!({"sessionKey": "main", "runId": again}))
        .await;
    assert_eq!(
        refused["error"]["code"], "studio.forbidden",
        "the interrupting run is owned: {refused}"
    );
    // In `main` of the first broker the other client's runs are live now:
    // the first owner's interrupt is refused there.
    let refused = owner
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "x", "queueMode": "interrupt",
                "idempotencyKey": run()}),
        )
        .await;
    assert_eq!(refused["error"]["code"], "studio.forbidden", "{refused}");
}

/// A reconnect that is not a gateway restart leaves runs running: their
/// ownership survives it (a restart forgets them, as the gateway does).
#[tokio::test]
async fn run_ownership_survives_a_reconnect_but_not_a_restart() {
    let (h, _owner, key) = a_live_run().await;
    // The connection drops without a restart (an abnormal close).
    assert!(h.gw.close_connection(0, 1011, "internal error"));
    eventually("the broker reconnects", || {
        h.broker.ctx().upstream().status().generation == 2
            && h.broker.ctx().upstream().ready_generation().is_some()
    })
    .await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    let refused = other
        .request("chat.abort", json!({"sessionKey": "main", "runId": key}))
        .await;
    assert_eq!(refused["error"]["code"], "studio.forbidden", "{refused}");
    // A restart: the gateway forgot the run, and so does the broker.
    let conn = h.gw.total_connections() as u64 - 1;
    assert!(h.gw.close_connection(conn, 1012, "service restart"));
    eventually("the broker reconnects again", || {
        h.broker.ctx().upstream().status().generation == 3
            && h.broker.ctx().upstream().ready_generation().is_some()
    })
    .await;
    assert!(h.broker.ctx().sharing.runs.is_empty());
}

#[tokio::test]
async fn node_only_methods_are_refused_locally() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    for method in [
        "node.invoke.result",
        "node.event",
        "node.pending.pull",
        "skills.bins",
    ] {
        let res = a.request(method, json!({})).await;
        assert_eq!(res["error"]["code"], "INVALID_REQUEST");
        assert_eq!(res["error"]["message"], "unauthorized role: operator");
    }
    assert!(
        h.gw.requests().is_empty(),
        "nothing reached the gateway's unauthorized-flood guard"
    );
}

#[tokio::test]
async fn in_flight_cap() {
    let h = start_with(mock_config(), |s| s.limits.max_inflight = 2).await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    });
    for id in ["s1", "s2"] {
        a.send_json(&json!({"type":"req","id":id,"method":"status"}))
            .await;
    }
    let res = a.request("status", json!({})).await;
    assert_eq!(res["error"]["code"], "studio.too_many_requests", "{res}");
    let (mut b, _) = h.connected().await;
    assert_eq!(
        b.request("health", json!({})).await["ok"],
        true,
        "the cap is per client"
    );
}

#[tokio::test]
async fn frame_rate_cap_answers_with_retry_after() {
    let h = start_with(mock_config(), |s| {
        s.limits.request_rate = 1;
        s.limits.request_burst = 2;
    })
    .await;
    let (mut a, _) = h.connected().await;
    for id in ["r1", "r2", "r3"] {
        a.send_json(&json!({"type":"req","id":id,"method":"health"}))
            .await;
    }
    let r1 = a.response("r1").await;
    assert_eq!(r1["ok"], true, "{r1} {:?}", a.events);
    assert_eq!(a.response("r2").await["ok"], true);
    let r3 = a.response("r3").await;
    assert_eq!(r3["error"]["code"], "studio.too_many_requests", "{r3}");
    assert!(r3["error"]["retryAfterMs"].as_u64().unwrap() > 0);
    assert_eq!(upstream_methods(&h, "health"), 2);
}

#[tokio::test]
async fn client_cap_refuses_with_1013() {
    let h = start_with(mock_config(), |s| s.limits.max_clients = 2).await;
    let _a = h.connected().await;
    let _b = h.connected().await;
    let mut c = h.client().await;
    c.recv_json().await;
    c.send_json(&connect_frame("c3")).await;
    let res: Value = c.response("c3").await;
    assert_eq!(res["error"]["code"], "studio.too_many_clients", "{res}");
    assert_eq!(c.expect_close().await, (1013, "too many clients".into()));
}

/// Session keys are compared the way the gateway writes them: `main` and
/// `agent:main:main` are one session.
#[tokio::test]
async fn session_keys_are_compared_in_canonical_form() {
    let cfg = MockConfig {
        run_step_delay: Duration::from_secs(30),
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (mut a, _) = h.connected_as(&READ_WRITE).await;
    let (mut b, _) = h.connected_as(&READ_WRITE).await;
    let ra = a
        .request("sessions.messages.subscribe", json!({"key": "main"}))
        .await;
    assert_eq!(
        ra["payload"]["key"], "main",
        "answered with the key as asked"
    );
    b.request(
        "sessions.messages.subscribe",
        json!({"key": "agent:main:main"}),
    )
    .await;
    assert_eq!(upstream_methods(&h, "sessions.messages.subscribe"), 1);
    h.gw.emit_session_message(
        "agent:main:main",
        json!({"sessionKey": "agent:main:main", "message": {"role": "user"}}),
    );
    a.event("session.message").await;
    b.event("session.message").await;
    a.request("sessions.messages.unsubscribe", json!({"key": "main"}))
        .await;
    assert_eq!(
        upstream_methods(&h, "sessions.messages.unsubscribe"),
        0,
        "b still holds it"
    );
    // A session-wide abort written with the short key still protects b's run.
    let key = uuid::Uuid::new_v4().to_string();
    b.request(
        "chat.send",
        json!({"sessionKey": "agent:main:main", "message": "long", "idempotencyKey": key}),
    )
    .await;
    let refused = a.request("chat.abort", json!({"sessionKey": "main"})).await;
    assert_eq!(refused["error"]["code"], "studio.forbidden", "{refused}");
}

/// Until the gateway confirms a subscription, every subscribe goes upstream:
/// a failed first subscribe never leaves others believing they are subscribed.
#[tokio::test]
async fn unconfirmed_subscriptions_are_forwarded_until_the_gateway_says_ok() {
    let h = start_with(mock_config(), |s| {
        s.limits.request_timeout = Duration::from_millis(300)
    })
    .await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    h.gw.set_faults(Faults {
        hold_methods: vec!["sessions.subscribe".into()],
        ..Faults::default()
    });
    a.send_json(&json!({"type":"req","id":"sa","method":"sessions.subscribe","params":{}}))
        .await;
    b.send_json(&json!({"type":"req","id":"sb","method":"sessions.subscribe","params":{}}))
        .await;
    eventually("both forwarded", || {
        upstream_methods(&h, "sessions.subscribe") == 2
    })
    .await;
    for (c, id) in [(&mut a, "sa"), (&mut b, "sb")] {
        assert_eq!(
            c.response(id).await["error"]["code"],
            "studio.request_timeout"
        );
    }
    assert_eq!(
        h.broker.ctx().sharing.subscriptions.counts().0,
        0,
        "both undone"
    );
    h.gw.set_faults(Faults::default());
    let (mut c, _) = h.connected().await;
    assert_eq!(c.request("sessions.subscribe", json!({})).await["ok"], true);
    assert_eq!(upstream_methods(&h, "sessions.subscribe"), 3);
    let (mut d, _) = h.connected().await;
    d.request("sessions.subscribe", json!({})).await;
    assert_eq!(
        upstream_methods(&h, "sessions.subscribe"),
        3,
        "confirmed: answered here"
    );
}

/// A gateway without `sessions.unsubscribe` (2026.9.6: not in
/// `hello-ok.features.methods`) is not sent one when the last holder leaves:
/// it would only answer "unknown method" and the broker would log a failure.
#[tokio::test]
async fn no_release_is_sent_for_a_method_the_gateway_lacks() {
    let cfg = MockConfig {
        without_methods: vec!["sessions.unsubscribe".into()],
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (mut a, _) = h.connected().await;
    assert_eq!(a.request("sessions.subscribe", json!({})).await["ok"], true);
    drop(a);
    let (mut b, _) = h.connected().await;
    eventually("the departure is released", || {
        h.broker.ctx().sharing.subscriptions.counts().0 == 0
    })
    .await;
    assert_eq!(b.request("health", json!({})).await["ok"], true);
    let unsubscribes =
        h.gw.requests()
            .iter()
            .filter(|(_, r)| r["method"] == "sessions.unsubscribe")
            .count();
    assert_eq!(unsubscribes, 0);
    let state = h.broker.ctx().sessions.own.snapshot();
    assert_eq!(state.failed, 0, "{state:?}");
}

/// `sessions.changed` with a reason the gateway sends to everyone (e.g.
/// `cron-bindings-loaded`) reaches unsubscribed clients too, as on a direct
/// connection; other reasons only subscribers.
#[tokio::test]
async fn broadcast_sessions_changed_reasons_reach_everyone() {
    let h = start().await;
    let (mut subscribed, _) = h.connected().await;
    let (mut other, _) = h.connected().await;
    assert_eq!(
        subscribed.request("sessions.subscribe", json!({})).await["ok"],
        true
    );
    h.gw.emit_sessions_changed(
        json!({"reason": "patch", "sessionKey": "agent:main:main", "ts": 1}),
    );
    h.gw.emit_sessions_changed(json!({"reason": "cron-bindings-loaded", "ts": 2}));
    for _ in 0..2 {
        subscribed.event("sessions.changed").await;
    }
    let ev = other.event("sessions.changed").await;
    assert_eq!(ev["payload"]["reason"], "cron-bindings-loaded", "{ev}");
    h.gw.broadcast("custom.marker", json!({}));
    other.event("custom.marker").await;
    assert!(
        other
            .events
            .iter()
            .all(|e| e["event"] != "sessions.changed"),
        "the unsubscribed client got only the broadcast reason: {:?}",
        other.events
    );
}
