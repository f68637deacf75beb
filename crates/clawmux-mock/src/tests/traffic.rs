//! Post-handshake behaviour: seq, methods, runs, subscriptions and the
//! connection-level faults (gateway-protocol.md §3, §4, §9, §11).

use std::time::Duration;

use serde_json::{json, Value};

use super::*;
use crate::{Faults, MockConfig, MockGateway};

fn seq(frame: &Value) -> u64 {
    frame["seq"]
        .as_u64()
        .unwrap_or_else(|| panic!("no seq in {frame}"))
}

#[tokio::test]
async fn seq_is_per_connection_contiguous_and_can_gap() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut a, _) = ready_client(&gw, params(Some("secret"))).await;
    gw.broadcast("custom.one", json!({"n": 1}));
    let (mut b, _) = ready_client(&gw, params(Some("secret"))).await;
    gw.broadcast("custom.two", json!({"n": 2}));
    gw.broadcast_with_state_version("presence", json!({"presence": []}));

    assert_eq!(seq(&a.event("custom.one").await), 1);
    assert_eq!(seq(&a.event("custom.two").await), 2);
    let presence = a.event("presence").await;
    assert_eq!(seq(&presence), 3);
    assert!(
        presence["stateVersion"]["presence"]
            .as_u64()
            .expect("version")
            >= 3
    );

    assert_eq!(
        seq(&b.event("custom.two").await),
        1,
        "a newcomer starts at 1"
    );
    assert_eq!(seq(&b.event("presence").await), 2);

    gw.skip_seq();
    gw.broadcast("custom.three", json!({}));
    assert_eq!(seq(&a.event("custom.three").await), 5, "one seq skipped");
    assert_eq!(seq(&b.event("custom.three").await), 4);
}

#[tokio::test]
async fn ticks_arrive_with_seq_unless_silent() {
    let cfg = MockConfig {
        tick_interval_ms: 40,
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    let first = c.event("tick").await;
    let second = c.event("tick").await;
    assert_eq!(seq(&second), seq(&first) + 1);
    assert!(first["payload"]["ts"].is_i64());

    gw.set_faults(Faults {
        silent: true,
        ..Faults::default()
    });
    c.send_json(&json!({"type": "req", "id": "s-1", "method": "health"}))
        .await;
    let held = gw
        .wait_request("health", WAIT)
        .await
        .expect("request recorded");
    assert_eq!(held["id"], "s-1");
    // Silent: nothing at all for a few tick periods.
    let quiet = tokio::time::timeout(Duration::from_millis(200), c.recv()).await;
    assert!(quiet.is_err(), "expected silence, got {quiet:?}");
}

#[tokio::test]
async fn chat_send_acks_then_streams_events_to_everyone() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut sender, _) = ready_client(&gw, params(Some("secret"))).await;
    let mut p = params(Some("secret"));
    p["caps"] = json!([]);
    let (mut watcher, _) = ready_client(&gw, p).await;

    let send =
        json!({"sessionKey": "agent:main:main", "message": "hi there", "idempotencyKey": "run-1"});
    let ack = sender.request("chat.send", send.clone()).await;
    assert_eq!(
        ack["payload"],
        json!({"runId": "run-1", "status": "started"})
    );
    let dup = sender.request("chat.send", send).await;
    assert_eq!(dup["payload"]["status"], "in_flight");

    // The sender (caps tool-events) sees the tool stream; full order check.
    let mut kinds = Vec::new();
    let mut last_seq = 0;
    loop {
        let f = sender.recv_json().await;
        if f["type"] != "event" {
            continue;
        }
        assert_eq!(seq(&f), last_seq + 1, "contiguous seq");
        last_seq = seq(&f);
        let p = &f["payload"];
        let kind = match f["event"].as_str() {
            Some("agent") => format!(
                "agent:{}:{}",
                p["stream"].as_str().unwrap_or(""),
                p["data"]["phase"].as_str().unwrap_or("")
            ),
            Some("chat") => format!("chat:{}", p["state"].as_str().unwrap_or("")),
            other => panic!("unexpected event {other:?}"),
        };
        if kind == "chat:delta" {
            assert!(p["deltaText"].is_string() && p["message"]["role"] == "assistant");
        }
        if kind == "chat:final" {
            assert_eq!(p["message"]["content"][0]["text"], "Echo: hi there");
        }
        let done = kind == "agent:lifecycle:end";
        kinds.push(kind);
        if done {
            break;
        }
    }
    assert_eq!(kinds[0], "agent:lifecycle:start");
    assert_eq!(
        kinds[1..7],
        [
            "agent:thinking:",
            "agent:thinking:",
            "agent:tool:start",
            "agent:tool:start",
            "agent:tool:result",
            "agent:tool:result"
        ]
        .map(String::from),
        "thinking, then two tool calls in parallel"
    );
    assert!(
        kinds.contains(&"agent:assistant:".to_string())
            && kinds.contains(&"chat:delta".to_string())
    );
    assert_eq!(kinds[kinds.len() - 2], "chat:final");

    // The watcher gets the run, but no tool events.
    loop {
        let f = watcher.recv_json().await;
        assert_ne!(f["payload"]["stream"], "tool", "tool events are targeted");
        if f["event"] == "agent" && f["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
    let history = watcher
        .request("chat.history", json!({"sessionKey": "main"}))
        .await;
    assert_eq!(history["payload"]["sessionKey"], "main", "echoed as sent");
    let messages = history["payload"]["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 2);
    assert_eq!(
        (messages[0]["role"].clone(), messages[1]["role"].clone()),
        (json!("user"), json!("assistant"))
    );
    let missing = watcher
        .request("chat.send", json!({"sessionKey": "main", "message": "x"}))
        .await;
    assert_eq!(
        missing["error"]["message"],
        "invalid chat.send params: must have required property 'idempotencyKey'"
    );
}

#[tokio::test]
async fn agent_answers_twice_with_the_same_id() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    c.send_json(&json!({"type": "req", "id": "a-1", "method": "agent",
                        "params": {"message": "do it", "idempotencyKey": "agent-run"}}))
        .await;
    let first = c.response("a-1").await;
    assert_eq!(first["payload"]["status"], "accepted");
    assert_eq!(first["payload"]["runId"], "agent-run");
    let second = c.response("a-1").await;
    assert_eq!(second["payload"]["status"], "ok");
    assert_eq!(second["payload"]["runId"], "agent-run");
    assert!(second["payload"]["summary"].is_string());
}

#[tokio::test]
async fn chat_abort_stops_a_run() {
    let cfg = MockConfig {
        run_step_delay: Duration::from_millis(200),
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    let ack = c
        .request(
            "chat.send",
            json!({"sessionKey": "s", "message": "long", "idempotencyKey": "r"}),
        )
        .await;
    assert_eq!(ack["ok"], true);
    let res = c.request("chat.abort", json!({"sessionKey": "s"})).await;
    assert_eq!(
        res["payload"],
        json!({"ok": true, "aborted": true, "runIds": ["r"]})
    );
    let aborted = c.event("chat").await;
    assert_eq!(aborted["payload"]["state"], "aborted");
    assert_eq!(
        aborted["payload"]["sessionKey"], "agent:main:s",
        "canonical key in events"
    );
    let again = c
        .request("chat.abort", json!({"sessionKey": "s", "runId": "r"}))
        .await;
    assert_eq!(again["payload"]["aborted"], false);
}

#[tokio::test]
async fn method_errors_follow_the_scope_and_role_rules() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    let res = c.request("does.not.exist", json!({})).await;
    assert_eq!(
        res["error"],
        json!({"code": "INVALID_REQUEST", "message": "unknown method: does.not.exist"})
    );
    let res = c.request("node.invoke.result", json!({})).await;
    assert_eq!(res["error"]["message"], "unauthorized role: operator");
    let res = c.request("connect", params(Some("secret"))).await;
    assert_eq!(
        res["error"]["message"],
        "connect is only valid as the first request"
    );

    // Bad frames after hello get an error res and the socket stays open.
    c.send_json(&json!({"type": "req", "id": "x-1", "method": "health", "extra": 1}))
        .await;
    let res = c.response("x-1").await;
    assert_eq!(
        res["error"]["message"],
        "invalid request frame: at root: unexpected property 'extra'"
    );
    c.send_text("not json at all").await;
    let health = c.request("health", json!({})).await;
    assert_eq!(health["payload"]["ok"], true);
    assert_eq!(c.request("status", json!({})).await["ok"], true);
    assert_eq!(
        c.request("sessions.list", json!({})).await["payload"]["sessions"][0]["key"],
        "agent:main:main"
    );

    let recorded: Vec<String> = gw
        .requests()
        .iter()
        .map(|(_, r)| r["method"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        recorded[..3],
        ["does.not.exist", "node.invoke.result", "connect"]
    );
}

#[tokio::test]
async fn session_subscriptions_filter_session_events() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut all, _) = ready_client(&gw, params(Some("secret"))).await;
    let (mut one, _) = ready_client(&gw, params(Some("secret"))).await;
    assert_eq!(
        all.request("sessions.subscribe", json!({})).await["payload"],
        json!({"subscribed": true})
    );
    let res = one
        .request("sessions.messages.subscribe", json!({"key": "k1"}))
        .await;
    assert_eq!(res["payload"], json!({"subscribed": true, "key": "k1"}));

    gw.emit_session_message("k2", json!({"sessionKey": "k2"}));
    gw.emit_session_message("k1", json!({"sessionKey": "k1"}));
    gw.emit_sessions_changed(json!({"reason": "test"}));
    gw.broadcast("marker", json!({}));

    assert_eq!(
        all.event("session.message").await["payload"]["sessionKey"],
        "k2"
    );
    assert_eq!(
        all.event("session.message").await["payload"]["sessionKey"],
        "k1"
    );
    assert_eq!(
        all.event("sessions.changed").await["payload"]["reason"],
        "test"
    );
    let mut seen = Vec::new();
    loop {
        let f = one.recv_json().await;
        if f["event"] == "marker" {
            break;
        }
        seen.push(
            f["event"].as_str().unwrap_or("").to_string()
                + ":"
                + f["payload"]["sessionKey"].as_str().unwrap_or(""),
        );
    }
    assert_eq!(seen, ["session.message:k1"]);
}

#[tokio::test]
async fn restart_notice_sends_shutdown_then_1012() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    gw.restart_notice(Some(1500)).await;
    let shutdown = c.event("shutdown").await;
    assert_eq!(
        shutdown["payload"],
        json!({"reason": "service restart", "restartExpectedMs": 1500})
    );
    assert_eq!(c.expect_close().await, (1012, "service restart".into()));
    assert!(gw.wait_no_connections(WAIT).await);
}

#[tokio::test]
async fn drop_all_is_an_abrupt_crash_and_reconnect_works() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    gw.drop_all();
    assert_eq!(gw.ready_connections(), 0);
    loop {
        match c.recv().await {
            Incoming::Json(_) => continue,
            Incoming::Gone => break,
            Incoming::Close(code, _) => panic!("expected no close frame, got {code}"),
        }
    }
    ready_client(&gw, params(Some("secret"))).await;
    assert!(gw.wait_ready_connections(1, WAIT).await);
    assert_eq!(gw.total_connections(), 2);
}

#[tokio::test]
async fn slow_consumer_close_and_hold_methods() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    gw.set_faults(Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    });
    c.send_json(&json!({"type": "req", "id": "held", "method": "status"}))
        .await;
    assert!(gw.wait_request("status", WAIT).await.is_some());
    assert_eq!(
        c.request("health", json!({})).await["ok"],
        true,
        "other methods still answer"
    );
    gw.slow_consumer_close().await;
    assert_eq!(c.expect_close().await, (1008, "slow consumer".into()));
}

#[tokio::test]
async fn stop_frees_the_port_for_a_restart() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let addr = gw.addr();
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    // The client reads concurrently, as a real one would, so stop() sees
    // its close reply instead of waiting out the grace period.
    let client = async {
        assert_eq!(
            c.event("shutdown").await["payload"]["reason"],
            "gateway stopping"
        );
        assert_eq!(c.expect_close().await.0, 1012);
    };
    tokio::join!(gw.stop(), client);
    let again = MockGateway::start_on(addr, fast_config())
        .await
        .expect("restart on the same port");
    assert_eq!(again.addr(), addr);
    ready_client(&again, params(Some("secret"))).await;
}

#[tokio::test]
async fn simulated_runs_reach_every_ready_connection() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    let run_id = gw.simulate_run("agent:main:main", "Hello from the mock gateway (run 1)");
    loop {
        let f = c.event("chat").await;
        if f["payload"]["state"] == "final" {
            assert_eq!(f["payload"]["runId"], json!(run_id));
            break;
        }
    }
    assert_eq!(gw.chat_history("agent:main:main").len(), 1);
}

#[tokio::test]
async fn a_scripted_runs_thinking_is_broadcast_and_its_tools_reach_session_subscribers() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (mut subscriber, _) = ready_client(&gw, params(Some("secret"))).await;
    let (mut other, _) = ready_client(&gw, params(Some("secret"))).await;
    let ok = subscriber.request("sessions.subscribe", json!({})).await;
    assert_eq!(ok["ok"], true, "{ok}");
    let run_id = gw.simulate_run("agent:main:main", "Hello");
    // Nobody started it: tool events go as session.tool (the agent payload)
    // to sessions.subscribe holders, never as agent stream "tool".
    let mut tools = Vec::new();
    let mut thinking = 0;
    loop {
        let f = subscriber.recv_json().await;
        let p = &f["payload"];
        match (f["event"].as_str(), p["stream"].as_str()) {
            (Some("session.tool"), _) => {
                assert_eq!(
                    (p["runId"].clone(), p["stream"].clone()),
                    (json!(run_id), json!("tool"))
                );
                tools.push(format!(
                    "{}:{}",
                    p["data"]["name"].as_str().unwrap(),
                    p["data"]["phase"].as_str().unwrap()
                ));
            }
            (Some("agent"), Some("thinking")) => thinking += 1,
            (Some("agent"), Some("tool")) => panic!("a run nobody started has no tool recipient"),
            (Some("agent"), Some("lifecycle")) if p["data"]["phase"] == "end" => break,
            _ => {}
        }
    }
    assert_eq!(
        tools,
        ["exec:start", "read:start", "read:result", "exec:result"]
    );
    assert_eq!(thinking, 2);
    loop {
        let f = other.recv_json().await;
        assert_ne!(f["event"], "session.tool", "not subscribed");
        if f["event"] == "agent" && f["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
}

#[tokio::test]
async fn demo_mode_plays_runs_for_newcomers() {
    let cfg = MockConfig {
        demo: true,
        demo_interval: Duration::from_millis(50),
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    loop {
        let f = c.event("chat").await;
        if f["payload"]["state"] == "final" {
            let text = f["payload"]["message"]["content"][0]["text"]
                .as_str()
                .unwrap_or("");
            assert!(
                text.starts_with("Hello from the mock gateway (run "),
                "{text}"
            );
            break;
        }
    }
}

#[tokio::test]
async fn health_broadcasts_bump_state_version_and_feed_the_snapshot() {
    let cfg = MockConfig {
        health_interval_ms: Some(30),
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    let first = c.event("health").await;
    let second = c.event("health").await;
    let version = |f: &Value| {
        f["stateVersion"]["health"]
            .as_u64()
            .expect("health version")
    };
    assert!(version(&second) > version(&first) && version(&first) >= 2);
    assert_eq!(first["payload"]["ok"], true);
    let (_, hello) = ready_client(&gw, params(Some("secret"))).await;
    assert_eq!(
        hello["payload"]["snapshot"]["health"]["ok"], true,
        "snapshot carries the last health"
    );
}

#[tokio::test]
async fn oversized_frames_after_hello_close_1009() {
    let cfg = MockConfig {
        max_payload: 1024,
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let (mut c, hello) = ready_client(&gw, params(Some("secret"))).await;
    assert_eq!(hello["payload"]["policy"]["maxPayload"], 1024);
    let big = json!({"type": "req", "id": "big", "method": "health", "params": {"pad": "x".repeat(2000)}});
    c.send_json(&big).await;
    assert_eq!(c.expect_close().await.0, 1009);
}

#[tokio::test]
async fn a_consumer_over_its_buffer_budget_is_closed_1008() {
    let cfg = MockConfig {
        max_buffered_bytes: 8 * 1024,
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let (mut c, _) = ready_client(&gw, params(Some("secret"))).await;
    // The test task does not yield, so the writer cannot drain meanwhile:
    // the queue outgrows the budget and the next non-droppable event closes.
    for n in 0..32 {
        gw.broadcast("bulk", json!({"n": n, "pad": "x".repeat(1024)}));
    }
    let mut delivered = 0;
    let close = loop {
        match c.recv().await {
            Incoming::Json(_) => delivered += 1,
            Incoming::Close(code, reason) => break (code, reason),
            Incoming::Gone => panic!("no close frame"),
        }
    };
    assert_eq!(close, (1008, "slow consumer".into()));
    assert!((1..32).contains(&delivered), "delivered {delivered}");
}
