//! A handover against a REAL OpenClaw Gateway : the real binary,
//! upgraded twice by `SIGUSR2` with a client connected. The client stays
//! connected, keeps its `connId`, and its requests are answered by the real
//! gateway through each new instance, on the one gateway connection the
//! instances hand over to each other (`ws://` on loopback).
//!
//! Run by `.ci/interop` (`--ignored`); skips with a note when the peers
//! script is absent.

use std::time::{Duration, Instant};

use crate::differential::Conn;
use crate::interop_diff::connect_params;
use crate::real_gateway::*;
use serde_json::json;

const ANSWER: Duration = Duration::from_secs(30);

async fn broker_pid(socket: &std::path::Path) -> Option<u64> {
    let (status, _, text) = crate::http_api::request_text(socket, "GET", "/v1/state", b"").await;
    (status == 200)
        .then(|| serde_json::from_str::<serde_json::Value>(&text).ok())
        .flatten()
        .and_then(|s| s["broker"]["pid"].as_u64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real OpenClaw gateway (~1 GB, installed from npm): run by .ci/interop"]
async fn sigusr2_keeps_a_client_of_the_real_gateway_connected() {
    if !peers_present("sigusr2_keeps_a_client_of_the_real_gateway_connected") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut gw = Gateway::start(port, dir.path().join("gateway.log"));
    gw.wait_ready(FIRST_START).await;
    let socket = dir.path().join("c.sock");
    let log = std::fs::File::create(dir.path().join("broker.log")).unwrap();
    let mut first = crate::support::ChildGuard(
        std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"))
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args([
                "--gateway-url",
                &format!("ws://127.0.0.1:{port}"),
                "--token",
                TOKEN,
            ])
            .env("HOME", dir.path())
            .env("XDG_STATE_HOME", dir.path().join("state"))
            .env_remove("CLAWMUX_CONFIG")
            .env_remove("NOTIFY_SOCKET")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let broker_log = || std::fs::read_to_string(dir.path().join("broker.log")).unwrap_or_default();
    let deadline = Instant::now() + ANSWER;
    while !socket.exists() {
        assert!(Instant::now() < deadline, "no socket\n{}", broker_log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_phase(&socket, "ready", ANSWER, &gw).await;
    let mut c = Conn::unix(&socket, "/ws").await;
    c.until(ANSWER, "connect.challenge", |v| {
        v["event"] == "connect.challenge"
    })
    .await;
    c.send(
        &json!({"type": "req", "id": "connect-1", "method": "connect", "params": connect_params()}),
    )
    .await;
    let hello = c.response("connect-1", ANSWER).await;
    assert_eq!(hello["ok"], true, "{hello}");
    let conn_id = hello["payload"]["server"]["connId"].clone();
    // An event stream moves too, on the same response.
    let _events = crate::http_api::open_events(&socket, "/v1/events", &[])
        .await
        .expect("an event stream");
    let mut pid = broker_pid(&socket).await.unwrap();
    for round in 1..=2 {
        let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
        rustix::process::kill_process(p, rustix::process::Signal::USR2).unwrap();
        let deadline = Instant::now() + ANSWER;
        let next = loop {
            if let Some(next) = broker_pid(&socket).await.filter(|n| *n != pid) {
                break next;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: no new instance\n{}",
                broker_log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if round == 1 {
            let status = first.0.wait().unwrap();
            assert!(status.success(), "{status}\n{}", broker_log());
        }
        pid = next;
        let id = format!("health-{round}");
        c.send(&json!({"type": "req", "id": id, "method": "health", "params": {}}))
            .await;
        let res = c.response(&id, ANSWER).await;
        assert_eq!(res["ok"], true, "round {round}: {res}\n{}", broker_log());
        // The gateway connection moved with the client: no reconnect.
        let log = broker_log();
        assert_eq!(
            log.matches("upstream session taken over from the previous instance")
                .count(),
            round,
            "round {round}\n{log}"
        );
        assert_eq!(
            log.matches("upstream session ready session=main").count(),
            1,
            "one handshake with the gateway\n{log}"
        );
        assert_eq!(
            log.matches("streams=1").count(),
            round,
            "round {round}: the event stream moved\n{log}"
        );
        let state = crate::http_api::state(&socket).await;
        assert!(
            state["clients"]
                .as_array()
                .unwrap()
                .iter()
                .any(|cl| cl["conn_id"] == conn_id),
            "round {round}: {state}"
        );
        assert!(
            state["clients"]
                .as_array()
                .unwrap()
                .iter()
                .any(|cl| cl["kind"] == "sse"),
            "round {round}: the event stream is served: {state}"
        );
    }
    let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
    let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
    gw.stop().await;
}
