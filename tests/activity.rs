//! Watching agents: the observers' opt-in to tool-stream events
//! (`/v1/events?tool_events=all`), who `/v1/state` says each client is, and
//! `clawmux tail --tree/--hud` and `clawmux top` against the gateway double.

#[path = "support/http_api.rs"]
mod http_api;
mod support;

use http_api::{open_events, state, Item};
use serde_json::{json, Value};
use support::*;

/// The tool-stream events on an SSE stream until the run's lifecycle end;
/// panics on a logged (`id:`) tool event: they are not in the replay log.
async fn tool_events_until_end(sse: &mut http_api::Sse) -> Vec<Value> {
    let mut tools = Vec::new();
    loop {
        match sse.next_item().await {
            Item::Event { name, data, .. } => {
                assert_ne!(
                    data["payload"]["stream"], "tool",
                    "{name}: tool events have no cursor"
                );
                if data["payload"]["stream"] == "lifecycle"
                    && data["payload"]["data"]["phase"] == "end"
                {
                    return tools;
                }
            }
            Item::Other(record) => {
                if let Some(data) = record.lines().find_map(|l| l.strip_prefix("data: ")) {
                    let frame: Value = serde_json::from_str(data).expect("one JSON line");
                    assert!(frame.get("seq").is_none(), "no cursor: {frame}");
                    tools.push(frame);
                }
            }
            Item::Comment(_) => {}
        }
    }
}

#[tokio::test]
async fn an_observer_stream_sees_the_tool_calls_of_runs_started_through_the_broker() {
    let h = start().await;
    let socket = h.socket();
    let mut observer = open_events(&socket, "/v1/events?tool_events=all", &[])
        .await
        .expect("observer stream");
    let mut plain = open_events(&socket, "/v1/events?tool_events=own", &[])
        .await
        .expect("plain stream");
    // The starter did not ask for tool events: nobody but the observer gets them.
    let mut starter = h.client().await;
    starter.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["caps"] = json!([]);
    starter.send_json(&frame).await;
    assert_eq!(starter.response("c1").await["ok"], true);
    let st = state(&socket).await;
    let observers: Vec<bool> = st["clients"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["kind"] == "sse")
        .map(|c| c["tool_observer"].as_bool().unwrap())
        .collect();
    assert_eq!(observers.iter().filter(|o| **o).count(), 1, "{st}");
    let key = uuid::Uuid::new_v4().to_string();
    starter
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "hi", "idempotencyKey": key}),
        )
        .await;
    let tools = tool_events_until_end(&mut observer).await;
    let phases: Vec<(String, String)> = tools
        .iter()
        .map(|f| {
            assert_eq!(f["event"], "agent");
            assert_eq!(f["payload"]["runId"], key.as_str());
            let d = &f["payload"]["data"];
            (
                d["name"].as_str().unwrap().to_owned(),
                d["phase"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        phases,
        [
            ("exec", "start"),
            ("read", "start"),
            ("read", "result"),
            ("exec", "result")
        ]
        .map(|(n, p)| (n.to_owned(), p.to_owned())),
        "both tool calls, in the order they happened"
    );
    assert!(
        tool_events_until_end(&mut plain).await.is_empty(),
        "an ordinary stream gets none"
    );
    while let Some(e) = starter.events.pop() {
        assert_ne!(
            e["payload"]["stream"], "tool",
            "the starter did not ask for them"
        );
    }
    loop {
        let e = starter.event("agent").await;
        assert_ne!(
            e["payload"]["stream"], "tool",
            "the starter did not ask for them"
        );
        if e["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
}

#[tokio::test]
async fn a_bad_tool_events_value_is_refused_with_what_to_send() {
    let h = start().await;
    let err = match open_events(&h.socket(), "/v1/events?tool_events=yes", &[]).await {
        Err(e) => e,
        Ok(_) => panic!("tool_events=yes opened a stream"),
    };
    assert_eq!(err.0, 400);
    let message = err.1["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("tool_events=own or tool_events=all"),
        "{}",
        err.1
    );
}

#[tokio::test]
async fn state_lists_each_clients_declared_identity_peer_pid_and_connection_time() {
    let h = start().await;
    let before = clawmux::protocol::now_ms();
    let mut c = h.client().await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["client"] = json!({"id": "cli", "version": "9.8.7", "platform": "linux", "mode": "cli", "displayName": "watcher"});
    c.send_json(&frame).await;
    assert_eq!(c.response("c1").await["ok"], true);
    let _sse = open_events(&h.socket(), "/v1/events", &[])
        .await
        .expect("stream");
    let st = state(&h.socket()).await;
    let clients = st["clients"].as_array().expect("clients");
    let ws = clients
        .iter()
        .find(|c| c["kind"] == "ws")
        .expect("ws client");
    assert_eq!(
        ws["declared"],
        json!({"client_id": "cli", "mode": "cli", "version": "9.8.7", "display_name": "watcher"})
    );
    // This test process is the peer on both connections.
    assert_eq!(ws["peer_pid"], std::process::id());
    let at = ws["connected_at_ms"].as_u64().expect("connected_at_ms");
    assert!(at >= before && at <= clawmux::protocol::now_ms(), "{ws}");
    let sse = clients
        .iter()
        .find(|c| c["kind"] == "sse")
        .expect("sse client");
    assert_eq!(sse["peer_pid"], std::process::id());
    assert_eq!(sse["declared"]["client_id"], Value::Null);
    assert_eq!(sse["tool_observer"], false);
}
