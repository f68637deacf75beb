//! Run ownership as the gateway reads it: every spelling of a session the
//! gateway resolves onto another client's running run, every way of
//! stopping or steering it, and however the run was started, carries the
//! owner rule; what the gateway takes for another session, or for no stop,
//! is forwarded.

use std::time::Duration;

use crate::http_api::rpc;
use crate::support::*;
use serde_json::{json, Value};

/// A front end's scopes without admin.
const READ_WRITE: [&str; 2] = ["operator.read", "operator.write"];

fn upstream(h: &Harness, method: &str) -> Vec<Value> {
    h.gw.requests()
        .into_iter()
        .filter(|(_, r)| r["method"] == method)
        .map(|(_, r)| r)
        .collect()
}

fn run_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A broker whose double plays runs slowly (a run stays live).
async fn slow_runs() -> Harness {
    let cfg = MockConfig {
        run_step_delay: Duration::from_secs(30),
        ..mock_config()
    };
    start_with(cfg, |_| {}).await
}

fn forbidden(answer: &Value) -> bool {
    answer["error"]["code"] == "studio.forbidden"
}

/// The gateway (2026.9.6 `resolveSessionStoreKey`) trims and lowercases a
/// key and reads `main` as the main session: each of these names the run's
/// session. It keeps empty segments in the key it stores and aborts by, so
/// `agent::main:main` and `agent:main:main:` are other sessions: a stop
/// there stops nothing of the run, and is forwarded.
#[tokio::test]
async fn every_spelling_of_the_runs_session_carries_the_owner_rule() {
    let h = slow_runs().await;
    let (mut owner, _) = h.connected_as(&READ_WRITE).await;
    owner
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "long", "idempotencyKey": run_id()}),
        )
        .await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    for key in ["MAIN", " main ", "AGENT:MAIN:MAIN", "agent:Main:main"] {
        for (method, params) in [
            ("chat.abort", json!({"sessionKey": key})),
            ("sessions.abort", json!({"key": key})),
            ("sessions.steer", json!({"key": key, "message": "x"})),
            (
                "chat.send",
                json!({"sessionKey": key, "message": "/stop", "idempotencyKey": run_id()}),
            ),
            ("sessions.send", json!({"key": key, "message": "stop"})),
        ] {
            let answer = other.request(method, params.clone()).await;
            assert!(forbidden(&answer), "{method} {params}: {answer}");
        }
    }
    assert!(upstream(&h, "chat.abort").is_empty(), "refused locally");
    assert_eq!(upstream(&h, "chat.send").len(), 1, "only the owner's run");
    for key in ["agent::main:main", "agent:main:main:"] {
        let answer = other
            .request("chat.abort", json!({"sessionKey": key}))
            .await;
        assert!(!forbidden(&answer), "{key}: another session: {answer}");
    }
    assert_eq!(upstream(&h, "chat.abort").len(), 2, "forwarded");
}

/// `queueMode: "steer"`, a `/queue steer` directive and the `/steer`
/// (`/tell`) command inject into the running run, as `sessions.steer`
/// does: the owner rule. `followup` and `collect` queue behind it, and a
/// mode the gateway's schema refuses (`steer-backlog`) runs nothing: those
/// are forwarded as they are. A send naming no mode would take the
/// session's mode (`steer` unless an admin set another): it is forwarded
/// with `queueMode: "followup"`, so it waits behind the other client's run.
/// A fullwidth `／ｓｔｏｐ` is no stop at the gateway (it does not fold
/// widths): a plain message, queued behind the run too.
#[tokio::test]
async fn steering_another_clients_run_carries_the_owner_rule() {
    let h = slow_runs().await;
    let (mut owner, _) = h.connected_as(&READ_WRITE).await;
    owner
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "long", "idempotencyKey": run_id()}),
        )
        .await;
    // The owner's own send takes the session's mode: untouched.
    owner
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "more", "idempotencyKey": run_id()}),
        )
        .await;
    let sent = upstream(&h, "chat.send");
    assert_eq!(sent.last().unwrap()["params"].get("queueMode"), None);
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    for (mode, message) in [
        (Some("steer"), "do this"),
        (Some("interrupt"), "do this"),
        (None, "/queue steer do this"),
        (None, "/steer do this"),
        (None, "/tell: do this"),
    ] {
        let mut params =
            json!({"sessionKey": "MAIN", "message": message, "idempotencyKey": run_id()});
        if let Some(mode) = mode {
            params["queueMode"] = json!(mode);
        }
        let answer = other.request("chat.send", params.clone()).await;
        assert!(forbidden(&answer), "{params}: {answer}");
    }
    assert_eq!(upstream(&h, "chat.send").len(), 2, "only the owner's runs");
    for mode in ["followup", "collect", "steer-backlog"] {
        let answer = other
            .request(
                "chat.send",
                json!({"sessionKey": "main", "message": "also", "queueMode": mode,
                    "idempotencyKey": run_id()}),
            )
            .await;
        assert!(!forbidden(&answer), "{mode}: {answer}");
        let sent = upstream(&h, "chat.send");
        assert_eq!(
            sent.last().unwrap()["params"]["queueMode"],
            mode,
            "untouched"
        );
    }
    for message in ["and this", "／ｓｔｏｐ"] {
        let answer = other
            .request(
                "chat.send",
                json!({"sessionKey": "main", "message": message, "idempotencyKey": run_id()}),
            )
            .await;
        assert!(!forbidden(&answer), "{message}: {answer}");
        let sent = upstream(&h, "chat.send");
        let last = &sent.last().unwrap()["params"];
        assert_eq!(last["queueMode"], "followup", "queued behind: {last}");
        assert_eq!(last["message"], message);
    }
}

/// An `agent` request without a `sessionKey` runs in the default agent's
/// main session; a `chat.send` through `/v1/rpc` (`clawmux call`) runs on
/// after its answer. Both are owned: the other client cannot stop them.
#[tokio::test]
async fn a_run_is_owned_however_it_was_started() {
    let h = slow_runs().await;
    let (mut owner, _) = h.connected_as(&READ_WRITE).await;
    owner
        .send_json(&json!({"type": "req", "id": "a1", "method": "agent",
            "params": {"message": "long", "idempotencyKey": run_id()}}))
        .await;
    let accepted = owner.response("a1").await;
    assert_eq!(accepted["ok"], true, "{accepted}");
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    let answer = other
        .request("chat.abort", json!({"sessionKey": "agent:main:main"}))
        .await;
    assert!(forbidden(&answer), "the agent request's run: {answer}");

    let h = slow_runs().await;
    let (mut other, _) = h.connected_as(&READ_WRITE).await;
    let body = json!({"method": "chat.send", "params": {"sessionKey": "main",
        "message": "long", "idempotencyKey": run_id()}});
    let (status, answer) = rpc(&h.socket(), &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    for (method, params) in [
        ("chat.abort", json!({"sessionKey": "main"})),
        (
            "chat.send",
            json!({"sessionKey": "main", "message": "/stop", "idempotencyKey": run_id()}),
        ),
    ] {
        let answer = other.request(method, params.clone()).await;
        assert!(forbidden(&answer), "the /v1/rpc run: {method}: {answer}");
    }
    assert!(upstream(&h, "chat.abort").is_empty());
}
