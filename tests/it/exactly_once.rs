//! Exactly once : a request is either written to a gateway
//! socket or answered as failed, never both. Before the fix, a request
//! queued for a narrower session that was still connecting was answered
//! `studio.upstream_closed` when that attempt failed, yet stayed queued and
//! was written by the next attempt: the client's retry then ran it twice
//! (12 of 12 mutations, measured).

use std::collections::HashMap;
use std::time::Duration;

use crate::support::*;
use serde_json::{json, Value};

/// How often each `sessions.patch` label reached the gateway.
fn arrivals(gw: &MockGateway) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for (_, r) in gw.requests() {
        if r["method"] == "sessions.patch" {
            let label = r["params"]["label"].as_str().unwrap_or_default().to_owned();
            *seen.entry(label).or_insert(0) += 1;
        }
    }
    seen
}

/// A narrower session whose first handshake fails: the mutations queued
/// for it are answered "not sent" (`details.sent: false`), and each one a
/// client then retries until it succeeds arrives at the gateway once.
#[tokio::test]
async fn mutations_queued_for_a_failed_attempt_run_once_after_retries() {
    const N: usize = 12;
    let h = start().await;
    let (mut admin, _) = h.connected().await;
    assert_eq!(admin.request("health", json!({})).await["ok"], true);
    // The narrower session's first connect is refused as a starting
    // gateway's is; its answer comes late, so every mutation is queued for
    // the attempt first.
    h.gw.set_faults(Faults {
        unavailable_connects: 1,
        hello_delay: Some(Duration::from_millis(300)),
        ..Faults::default()
    });
    let (mut writer, _) = h.connected_as(&["operator.read", "operator.write"]).await;
    for i in 0..N {
        writer
            .send_json(
                &json!({"type": "req", "id": format!("m{i}"), "method": "sessions.patch",
                "params": {"key": "main", "label": format!("m{i}")}}),
            )
            .await;
    }
    let mut not_sent = 0;
    let mut pending: Vec<usize> = Vec::new();
    for i in 0..N {
        let res = writer.response(&format!("m{i}")).await;
        if res["error"]["code"] == "studio.upstream_closed" {
            assert_eq!(res["error"]["details"]["sent"], false, "{res}");
            not_sent += 1;
            pending.push(i);
        }
    }
    assert!(
        not_sent > 0,
        "the failed attempt answered none of the mutations"
    );
    h.gw.set_faults(Faults::default());
    // The client retries what it was told was not sent, as Claw3D does.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut attempt = 0;
    while !pending.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "retries never succeeded: {pending:?}"
        );
        attempt += 1;
        let mut still = Vec::new();
        for &i in &pending {
            let id = format!("m{i}-retry{attempt}");
            writer
                .send_json(&json!({"type": "req", "id": id, "method": "sessions.patch",
                    "params": {"key": "main", "label": format!("m{i}")}}))
                .await;
            let res = writer.response(&id).await;
            if res["error"]["code"] == "studio.upstream_closed" {
                assert_eq!(res["error"]["details"]["sent"], false, "{res}");
                still.push(i);
            }
        }
        pending = still;
        if !pending.is_empty() {
            // The session backs off after the failed attempt (retryAfterMs).
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Every mutation has been answered by the gateway once; a late second
    // copy would be written right behind the retries: a health request on
    // the same session after them orders the check.
    assert_eq!(writer.request("status", json!({})).await["ok"], true);
    let seen = arrivals(&h.gw);
    for i in 0..N {
        assert_eq!(
            seen.get(&format!("m{i}")),
            Some(&1),
            "m{i} arrived {seen:?}"
        );
    }
}

/// A request that times out while still queued (its session is still
/// connecting) is withdrawn before it is answered `studio.request_timeout`
/// with `sent: false`, and the session, once open, never writes it.
#[tokio::test]
async fn a_request_that_expires_unwritten_is_never_written() {
    let h = start_with(mock_config(), |s| {
        s.limits.request_timeout = Duration::from_millis(300);
    })
    .await;
    let (mut admin, _) = h.connected().await;
    assert_eq!(admin.request("health", json!({})).await["ok"], true);
    h.gw.set_faults(Faults {
        hello_delay: Some(Duration::from_millis(1500)),
        ..Faults::default()
    });
    let (mut writer, _) = h.connected_as(&["operator.read", "operator.write"]).await;
    let res = writer
        .request("sessions.patch", json!({"key": "main", "label": "late"}))
        .await;
    assert_eq!(res["error"]["code"], "studio.request_timeout", "{res}");
    assert_eq!(res["error"]["details"]["sent"], false, "{res}");
    // The session opens; a request after it shows what it wrote.
    eventually("the narrower session opens", || {
        h.broker.ctx().sessions.narrower.to_json()["sessions"][0]["phase"] == "ready"
    })
    .await;
    let after = writer
        .request("sessions.patch", json!({"key": "main", "label": "after"}))
        .await;
    assert_ne!(after["error"]["code"], "studio.request_timeout", "{after}");
    let seen = arrivals(&h.gw);
    assert_eq!(seen.get("after"), Some(&1), "{seen:?}");
    assert_eq!(
        seen.get("late"),
        None,
        "answered as timed out, then written: {seen:?}"
    );
}

/// A request in flight when its session ends is answered `sent: true`: the
/// gateway may have run it, and a client must not take it for unsent.
#[tokio::test]
async fn a_request_lost_with_its_session_says_it_was_sent() {
    let h = start_faulty(
        mock_config(),
        Faults {
            hold_methods: vec!["status".into()],
            ..Faults::default()
        },
        |_| {},
    )
    .await;
    let (mut client, _) = h.connected().await;
    client
        .send_json(&json!({"type": "req", "id": "held", "method": "status", "params": {}}))
        .await;
    h.gw.wait_request("status", PATIENCE)
        .await
        .expect("forwarded");
    assert!(h.gw.close_connection(0, 1012, "service restart"));
    let res: Value = client.response("held").await;
    assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    assert_eq!(res["error"]["details"]["sent"], true, "{res}");
}

/// A gateway restart (close 1012) with mutations in flight, and more sent
/// while the broker waits to reconnect: every answer says `details.sent`,
/// `true` for the written ones, `false` for those refused since (the
/// session's own close reason is their message).
#[tokio::test]
async fn every_answer_around_a_restart_says_whether_it_was_sent() {
    let h = start_faulty(
        mock_config(),
        Faults {
            hold_methods: vec!["chat.send".into()],
            ..Faults::default()
        },
        |_| {},
    )
    .await;
    let (mut client, _) = h.connected().await;
    for i in 0..3 {
        client
            .send_json(&json!({"type": "req", "id": format!("held-{i}"), "method": "chat.send",
                "params": {"sessionKey": "main", "message": "x", "idempotencyKey": format!("k-{i}")}}))
            .await;
    }
    eventually("three are in flight", || {
        h.gw.requests()
            .iter()
            .filter(|(_, r)| r["method"] == "chat.send")
            .count()
            == 3
    })
    .await;
    // The gateway comes back slowly: the broker waits, not ready.
    h.gw.set_faults(Faults {
        unavailable_connects: u32::MAX,
        ..Faults::default()
    });
    assert!(h.gw.close_connection(0, 1012, "restart"));
    for i in 0..3 {
        let res = client.response(&format!("held-{i}")).await;
        assert_eq!(res["error"]["details"]["sent"], true, "{res}");
    }
    for i in 0..5 {
        let id = format!("after-{i}");
        client
            .send_json(&json!({"type": "req", "id": id, "method": "chat.send",
                "params": {"sessionKey": "main", "message": "x", "idempotencyKey": format!("a-{i}")}}))
            .await;
        let res = client.response(&id).await;
        assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
        assert_eq!(res["error"]["details"]["sent"], false, "{res}");
    }
}
