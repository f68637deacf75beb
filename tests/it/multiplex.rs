//! Many local clients, one upstream session (design §4).

use crate::support::*;
use serde_json::{json, Value};

#[tokio::test]
async fn two_and_fifty_clients_share_one_upstream_socket() {
    let h = start().await;
    let mut clients = Vec::new();
    for _ in 0..2 {
        clients.push(h.connected().await.0);
    }
    assert_eq!(h.gw.open_connections(), 1);
    for _ in 0..48 {
        clients.push(h.connected().await.0);
    }
    assert_eq!(h.gw.open_connections(), 1);
    assert_eq!(
        h.gw.total_connections(),
        1,
        "no reconnects, no extra sockets"
    );
    for c in clients.iter_mut().step_by(7) {
        assert_eq!(c.request("health", json!({})).await["ok"], true);
    }
}

#[tokio::test]
async fn host_token_is_injected_upstream_when_the_client_sent_none() {
    let h = start().await;
    let (_c, _) = h.connected().await;
    let connects = h.gw.connects();
    assert_eq!(connects.len(), 1);
    let p = &connects[0];
    assert_eq!(p["auth"]["token"], "test-token");
    assert_eq!(p["client"]["id"], "gateway-client");
    assert_eq!(p["client"]["mode"], "backend");
    assert_eq!(p["role"], "operator");
    assert_eq!(p["caps"], json!(["tool-events"]));
    assert_eq!(
        (p["minProtocol"].as_u64(), p["maxProtocol"].as_u64()),
        (Some(3), Some(4))
    );
    for scope in [
        "operator.admin",
        "operator.read",
        "operator.write",
        "operator.approvals",
        "operator.pairing",
    ] {
        assert!(
            p["scopes"].as_array().unwrap().iter().any(|s| s == scope),
            "{scope}"
        );
    }
    assert!(
        connect_frame("x")["params"].get("auth").is_none(),
        "the local client sent no auth"
    );
}

#[tokio::test]
async fn same_request_id_from_two_clients_gets_two_answers() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    a.send_json(&json!({"type":"req","id":"same","method":"alpha.unknown","params":{}}))
        .await;
    b.send_json(&json!({"type":"req","id":"same","method":"beta.unknown","params":{}}))
        .await;
    let ra = a.response("same").await;
    let rb = b.response("same").await;
    assert!(
        ra["error"]["message"]
            .as_str()
            .unwrap()
            .contains("alpha.unknown"),
        "{ra}"
    );
    assert!(
        rb["error"]["message"]
            .as_str()
            .unwrap()
            .contains("beta.unknown"),
        "{rb}"
    );
    // Each upstream request carried a distinct broker id.
    let ids: Vec<Value> =
        h.gw.requests()
            .iter()
            .map(|(_, r)| r["id"].clone())
            .collect();
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1]);
    assert_ne!(ids[0], "same");
}

fn seqs(events: &[Value]) -> Vec<u64> {
    events.iter().filter_map(|e| e["seq"].as_u64()).collect()
}

#[tokio::test]
async fn events_arrive_in_order_with_contiguous_seq_per_client() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    for n in 0..200 {
        h.gw.broadcast("test.event", json!({"n": n}));
    }
    for c in [&mut a, &mut b] {
        let mut got = Vec::new();
        while got.len() < 200 {
            let e = c.event("test.event").await;
            got.push(e);
        }
        let ns: Vec<u64> = got
            .iter()
            .map(|e| e["payload"]["n"].as_u64().unwrap())
            .collect();
        assert_eq!(ns, (0..200).collect::<Vec<_>>());
        let s = seqs(&got);
        assert!(s.windows(2).all(|w| w[1] == w[0] + 1), "contiguous: {s:?}");
    }
    // A client that joins later starts at seq 1.
    let (mut late, _) = h.connected().await;
    h.gw.broadcast("test.event", json!({"n": 200}));
    assert_eq!(late.event("test.event").await["seq"], 1);
}

#[tokio::test]
async fn upstream_seq_gap_becomes_a_local_gap() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.broadcast("test.event", json!({"n": 1}));
    let first = a.event("test.event").await["seq"].as_u64().unwrap();
    h.gw.skip_seq();
    h.gw.broadcast("test.event", json!({"n": 2}));
    let second = a.event("test.event").await["seq"].as_u64().unwrap();
    assert_eq!(second, first + 2, "one skipped number");
    h.gw.broadcast("test.event", json!({"n": 3}));
    assert_eq!(
        a.event("test.event").await["seq"].as_u64().unwrap(),
        second + 1
    );
}

#[tokio::test]
async fn chat_send_ack_and_events_reach_every_client() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    let res = a
        .request(
            "chat.send",
            json!({"sessionKey":"agent:main:main","message":"hi","idempotencyKey":key}),
        )
        .await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(res["payload"]["runId"], key.as_str());
    for c in [&mut a, &mut b] {
        loop {
            let e = c.event("chat").await;
            if e["payload"]["state"] == "final" {
                assert_eq!(e["payload"]["runId"], key.as_str());
                break;
            }
        }
    }
}

#[tokio::test]
async fn agent_answers_twice_through_the_broker() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    a.send_json(&json!({"type":"req","id":"run1","method":"agent","params":{"message":"go","idempotencyKey":key}}))
        .await;
    let first = a.response("run1").await;
    assert_eq!(first["payload"]["status"], "accepted", "{first}");
    let second = a.response("run1").await;
    assert_eq!(second["ok"], true);
    assert_eq!(second["payload"]["status"], "ok", "{second}");
}

/// The broker reads local frames through an 8 KiB buffer (so idle clients
/// stay small); a frame many times larger must still arrive whole.
#[tokio::test]
async fn a_request_larger_than_the_read_buffer_arrives_whole() {
    let h = start().await;
    let (mut c, _) = h.connected().await;
    let pad = "x".repeat(300 * 1024);
    let answer = c.request("health", json!({ "pad": pad })).await;
    assert_eq!(answer["ok"], true, "{answer}");
    let forwarded =
        h.gw.wait_request("health", PATIENCE)
            .await
            .expect("the request reached the gateway");
    assert_eq!(
        forwarded["params"]["pad"].as_str().map(str::len),
        Some(300 * 1024)
    );
}
