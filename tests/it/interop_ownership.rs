//! Against a REAL OpenClaw Gateway (2026.9.6, from `../shared/peers`), with
//! the mock provider making a real run that stays live (its exec tool
//! sleeps): the spellings of the run's session the gateway merges are
//! refused by the broker before they reach it; the ones it keeps apart
//! (`agent::main:main`, `agent:main:main:`) are forwarded, and the gateway
//! stops nothing with them — the run is still live, and the owner's stop
//! spelled `AGENT:MAIN:MAIN` is the one that stops it at the gateway. Run
//! by `.ci/interop` (`--ignored`); skips with a note when the peers script
//! is absent.

use std::time::Duration;

use crate::differential::Conn;
use crate::interop_diff::{connect_params, use_provider};
use crate::real_gateway::*;
use serde_json::{json, Value};

const ANSWER: Duration = Duration::from_secs(30);
const RUN: Duration = Duration::from_secs(90);

async fn req(c: &mut Conn, id: &str, method: &str, params: Value) -> Value {
    c.send(&json!({"type": "req", "id": id, "method": method, "params": params}))
        .await;
    c.response(id, ANSWER).await
}

/// A client through the broker holding read and write, not admin.
async fn read_write(sock: &std::path::Path, name: &str) -> Conn {
    let mut c = Conn::unix(sock, "/ws").await;
    c.until(ANSWER, "connect.challenge", |v| {
        v["event"] == "connect.challenge"
    })
    .await;
    let mut params = connect_params();
    params["scopes"] = json!(["operator.read", "operator.write"]);
    let hello = req(&mut c, &format!("connect-{name}"), "connect", params).await;
    assert_eq!(hello["ok"], true, "{hello}");
    c
}

#[tokio::test]
#[ignore = "needs a real OpenClaw gateway (~1 GB, installed from npm): run by .ci/interop"]
async fn the_gateway_stops_a_run_only_where_the_broker_guards_it() {
    if !peers_present("the_gateway_stops_a_run_only_where_the_broker_guards_it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let provider =
        clawmux_mock::provider::MockProvider::start(clawmux_mock::provider::ProviderConfig {
            tool_name: Some("exec".into()),
            tool_arguments: json!({"command": "sleep 60"}),
            ..Default::default()
        })
        .await
        .expect("provider starts");
    let port = free_port();
    let mut gw = Gateway::start(port, dir.path().join("gateway.log"));
    gw.wait_ready(FIRST_START).await;
    use_provider(port, &provider).await;
    let broker = clawmux::RunningBroker::start(broker_settings(&dir.path().join("b"), port, TOKEN))
        .await
        .expect("broker starts");
    let sock = broker.socket_path().to_owned();
    wait_phase(&sock, "ready", ANSWER, &gw).await;

    let mut owner = read_write(&sock, "owner").await;
    let mut other = read_write(&sock, "other").await;
    let run = format!("own-interop-{}", uuid::Uuid::new_v4());
    let res = req(
        &mut owner,
        "chat-1",
        "chat.send",
        json!({"sessionKey": "main", "message": "please [[use-a-tool]]", "idempotencyKey": run}),
    )
    .await;
    assert_eq!(res["ok"], true, "chat.send: {res}");
    // Live: its exec call has started (and sleeps).
    owner
        .until(RUN, "the run's tool start", |v| {
            v["event"] == "agent"
                && v["payload"]["runId"] == run.as_str()
                && v["payload"]["stream"] == "tool"
                && v["payload"]["data"]["phase"] == "start"
        })
        .await;

    for (n, (method, params)) in [
        ("chat.abort", json!({"sessionKey": "MAIN"})),
        ("chat.abort", json!({"sessionKey": "AGENT:MAIN:MAIN"})),
        ("sessions.abort", json!({"key": "agent:Main:main"})),
        (
            "chat.send",
            json!({"sessionKey": "Main", "message": "/stop", "idempotencyKey": format!("{run}-stop")}),
        ),
        (
            "chat.send",
            json!({"sessionKey": "main", "message": "go elsewhere", "queueMode": "steer",
                "idempotencyKey": format!("{run}-steer")}),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let res = req(&mut other, &format!("guarded-{n}"), method, params.clone()).await;
        assert_eq!(res["error"]["code"], "studio.forbidden", "{method} {params}: {res}");
    }
    // Other sessions at the gateway: forwarded, and they stop nothing of it.
    for (n, key) in ["agent::main:main", "agent:main:main:"]
        .into_iter()
        .enumerate()
    {
        let res = req(
            &mut other,
            &format!("apart-{n}"),
            "chat.abort",
            json!({"sessionKey": key}),
        )
        .await;
        assert_ne!(res["error"]["code"], "studio.forbidden", "{key}: {res}");
        let stopped = res["payload"]["runIds"]
            .as_array()
            .is_some_and(|ids| ids.iter().any(|id| id == run.as_str()));
        assert!(!stopped, "{key} stopped the run at the gateway: {res}");
    }
    // Still live: the owner's stop, spelled another way, stops it there.
    let res = req(
        &mut owner,
        "own-stop",
        "chat.abort",
        json!({"sessionKey": "AGENT:MAIN:MAIN"}),
    )
    .await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(
        res["payload"]["aborted"], true,
        "the run was still live: {res}"
    );
    gw.stop().await;
}
