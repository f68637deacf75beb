//! Narrower upstream sessions: a client holding fewer scopes than the
//! broker's session gets the answers the gateway tailors to its own scopes,
//! from a session that holds exactly its grant (`src/upstream/aux.rs`).

use crate::support::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

/// `status` as a direct connection to the double holding `scopes` gets it.
async fn direct_status(gw: &MockGateway, scopes: &[&str]) -> Value {
    let (mut ws, _) = tokio::time::timeout(PATIENCE, tokio_tungstenite::connect_async(gw.url()))
        .await
        .expect("connect in time")
        .expect("the double accepts");
    let mut connect = connect_frame("c1");
    connect["params"]["scopes"] = json!(scopes);
    connect["params"]["auth"] = json!({"token": "test-token"});
    let mut sent_status = false;
    loop {
        let frame = tokio::time::timeout(PATIENCE, ws.next())
            .await
            .expect("a frame in time");
        let Some(Ok(Message::Text(text))) = frame else {
            continue;
        };
        let v: Value = serde_json::from_str(text.as_str()).unwrap();
        if v["event"] == "connect.challenge" {
            ws.send(Message::text(connect.to_string())).await.unwrap();
        } else if v["id"] == "c1" && !sent_status {
            assert_eq!(v["ok"], true, "{v}");
            sent_status = true;
            let req = json!({"type": "req", "id": "s1", "method": "status", "params": {}});
            ws.send(Message::text(req.to_string())).await.unwrap();
        } else if v["id"] == "s1" {
            assert_eq!(v["ok"], true, "{v}");
            let _ = ws.close(None).await;
            return v["payload"].clone();
        }
    }
}

/// `status` without what changes from one call to the next.
fn stable(mut status: Value) -> Value {
    for volatile in ["ts", "uptimeMs", "connections"] {
        status.as_object_mut().unwrap().remove(volatile);
    }
    status
}

async fn narrower_state(h: &Harness) -> Value {
    let (code, state) = http_get(&h.socket(), "/v1/state").await;
    assert_eq!(code, 200, "{state}");
    state["upstream"]["narrower_sessions"].clone()
}

#[tokio::test]
async fn a_read_only_client_gets_what_a_direct_read_only_connection_gets() {
    let h = start().await;
    let (mut reader, _) = h.connected_as(&["operator.read"]).await;
    let (mut admin, _) = h.connected().await;
    let through_broker = reader.request("status", json!({})).await;
    assert_eq!(through_broker["ok"], true, "{through_broker}");
    let direct = direct_status(&h.gw, &["operator.read"]).await;
    assert_eq!(stable(through_broker["payload"].clone()), stable(direct));
    assert!(
        through_broker["payload"]["sessions"].get("paths").is_none(),
        "redacted for a reader: {through_broker}"
    );
    // An admin client still gets the admin answer, on the main session.
    let full = admin.request("status", json!({})).await;
    assert!(full["payload"]["sessions"]["paths"].is_array(), "{full}");
    assert_eq!(
        stable(full["payload"].clone()),
        stable(direct_status(&h.gw, &FULL_SCOPES).await)
    );
}

#[tokio::test]
async fn one_session_per_grant_closed_when_its_last_client_leaves() {
    let h = start().await;
    let (mut a, _) = h.connected_as(&["operator.read"]).await;
    let (mut b, _) = h.connected_as(&["operator.read"]).await;
    assert_eq!(
        h.gw.total_connections(),
        1,
        "nothing opened before a request"
    );
    for c in [&mut a, &mut b] {
        assert_eq!(c.request("status", json!({})).await["ok"], true);
        assert_eq!(c.request("sessions.list", json!({})).await["ok"], true);
    }
    assert_eq!(h.gw.total_connections(), 2, "one narrower session for both");
    let state = narrower_state(&h).await;
    assert_eq!(state["opened"], 1, "{state}");
    assert_eq!(state["sessions"][0]["scopes"], json!(["operator.read"]));
    assert_eq!(state["sessions"][0]["holders"], 2, "{state}");
    assert_eq!(state["sessions"][0]["phase"], "ready", "{state}");
    let connect = &h.gw.connects()[1];
    assert_eq!(connect["scopes"], json!(["operator.read"]));
    assert!(connect["device"].is_object(), "signed: {connect}");
    a.close().await;
    drop(a);
    let aux = || h.broker.ctx().sessions.narrower.to_json();
    eventually("a's departure is seen", || {
        aux()["sessions"][0]["holders"] == 1
    })
    .await;
    assert_eq!(h.gw.open_connections(), 2, "b still holds it");
    b.close().await;
    drop(b);
    // It lingers IDLE_LINGER (5 s) in case another client comes.
    let patience = clawmux::sessions::narrower::IDLE_LINGER + std::time::Duration::from_secs(20);
    eventually_within("the narrower session closed", patience, || {
        let open = h.gw.open_connections();
        async move {
            if open > 1 {
                Err(open)
            } else {
                Ok(())
            }
        }
    })
    .await;
    assert_eq!(narrower_state(&h).await["sessions"], json!([]));
}

#[tokio::test]
async fn a_full_scope_client_never_opens_a_narrower_session() {
    let h = start().await;
    let (mut c, _) = h.connected().await;
    for method in ["status", "sessions.list", "config.get", "health"] {
        assert_eq!(c.request(method, json!({})).await["ok"], true, "{method}");
    }
    assert_eq!(h.gw.total_connections(), 1);
    assert_eq!(narrower_state(&h).await["opened"], 0);
}

#[tokio::test]
async fn beyond_the_cap_requests_run_on_the_main_session() {
    let h = start().await;
    let pool = [
        "operator.read",
        "operator.write",
        "operator.approvals",
        "operator.pairing",
    ];
    // Nine distinct grants: one more than MAX_GRANT_SESSIONS.
    let grants: Vec<Vec<&str>> = (1u32..10)
        .map(|bits| {
            (0..4)
                .filter(|i| bits & (1 << i) != 0)
                .map(|i| pool[i])
                .collect()
        })
        .collect();
    let mut clients = Vec::new();
    for g in &grants {
        let (mut c, _) = h.connected_as(g).await;
        let res = c.request("health", json!({})).await;
        assert_eq!(res["ok"], true, "{g:?}: {res}");
        clients.push(c);
    }
    assert_eq!(clawmux::sessions::narrower::MAX_GRANT_SESSIONS, 8);
    assert_eq!(h.gw.total_connections(), 1 + 8);
    let state = narrower_state(&h).await;
    assert_eq!(
        (state["opened"].as_u64(), state["fallbacks"].as_u64()),
        (Some(8), Some(1)),
        "{state}"
    );
    let (code, _, metrics) =
        crate::http_api::request_text(&h.socket(), "GET", "/metrics", b"").await;
    assert_eq!(code, 200);
    assert!(
        metrics.contains("clawmux_narrower_session_fallbacks_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("clawmux_narrower_sessions 8"), "{metrics}");
    // The ninth grant's request went to the main session (connection 0).
    let last =
        h.gw.requests()
            .into_iter()
            .rfind(|(_, r)| r["method"] == "health")
            .unwrap();
    assert_eq!(last.0, 0, "{last:?}");
}

/// A narrower session that drops fails what was in flight on it, then
/// reconnects by itself (the main session's connect loop and backoff):
/// the next request runs on it again, and the main session is untouched.
#[tokio::test]
async fn a_lost_narrower_session_fails_its_requests_and_reconnects() {
    let h = start_faulty(
        mock_config(),
        Faults {
            hold_methods: vec!["status".into()],
            ..Faults::default()
        },
        |_| {},
    )
    .await;
    let (mut reader, _) = h.connected_as(&["operator.read"]).await;
    reader
        .send_json(&json!({"type": "req", "id": "held", "method": "status", "params": {}}))
        .await;
    h.gw.wait_request("status", PATIENCE)
        .await
        .expect("forwarded");
    let (conn, _) =
        h.gw.requests()
            .into_iter()
            .find(|(_, r)| r["method"] == "status")
            .unwrap();
    assert_ne!(conn, 0, "sent on the narrower session");
    assert!(h.gw.close_connection(conn, 1012, "service restart"));
    let res = reader.response("held").await;
    assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    h.gw.set_faults(Faults::default());
    eventually("the narrower session reconnects", || {
        let s = h.broker.ctx().sessions.narrower.to_json();
        s["sessions"][0]["phase"] == "ready" && h.gw.total_connections() == 3
    })
    .await;
    let again = reader.request("status", json!({})).await;
    assert_eq!(again["ok"], true, "{again}");
    let state = narrower_state(&h).await;
    assert_eq!(state["opened"], 1, "the same session, reconnected: {state}");
    assert_eq!(state["sessions"][0]["holders"], 1, "{state}");
    // The main session was not touched.
    let (mut admin, _) = h.connected().await;
    assert_eq!(admin.request("health", json!({})).await["ok"], true);
    assert_eq!(h.broker.ctx().upstream().status().generation, 1);
}

/// A narrower session the gateway refuses backs off like the main session
/// instead of being reopened by every request, and its clients are told
/// which session failed (not to check a token the main session uses fine).
#[tokio::test]
async fn a_refused_narrower_session_backs_off_and_names_itself() {
    let h = start().await;
    let (mut admin, _) = h.connected().await;
    assert_eq!(admin.request("health", json!({})).await["ok"], true);
    h.gw.set_faults(Faults {
        reject_connect: Some(clawmux_mock::Rejection::token_mismatch()),
        ..Faults::default()
    });
    let (mut reader, _) = h.connected_as(&["operator.read"]).await;
    for i in 0..10 {
        let res = reader.request("status", json!({})).await;
        assert_eq!(res["ok"], false, "{i}: {res}");
        let message = res["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("narrower gateway session"), "{res}");
        assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    }
    assert!(
        h.gw.total_connections() <= 3,
        "ten requests, {} upstream connections",
        h.gw.total_connections()
    );
    // The main session still answers.
    assert_eq!(admin.request("health", json!({})).await["ok"], true);
}

/// Rotating scope sets cannot churn upstream handshakes: opening narrower
/// sessions is rate-limited per local process and in total.
#[tokio::test(start_paused = true)]
async fn rotating_scope_sets_are_rate_limited() {
    // One open per second, a burst of two, on tokio's paused clock: the
    // opens stay under burst + rate × elapsed, and fifteen grants tried in
    // less than thirteen seconds must meet the limit.
    let h = start_with(mock_config(), |s| {
        s.limits.upstream_open_rate = 1;
        s.limits.upstream_open_burst = 2;
    })
    .await;
    let pool = [
        "operator.read",
        "operator.write",
        "operator.approvals",
        "operator.pairing",
    ];
    let started = tokio::time::Instant::now();
    let mut throttled = 0;
    // Fifteen distinct grants, one client after another (each leaves, so
    // its idle session makes room for the next).
    for bits in 1u32..16 {
        let g: Vec<&str> = (0..4)
            .filter(|i| bits & (1 << i) != 0)
            .map(|i| pool[i])
            .collect();
        let (mut c, _) = h.connected_as(&g).await;
        let res = c.request("status", json!({})).await;
        if res["error"]["code"] == "studio.too_many_requests" {
            assert!(res["error"]["retryAfterMs"].as_u64().is_some(), "{res}");
            throttled += 1;
        }
        drop(c);
        eventually("the client's hold is released", || {
            let s = h.broker.ctx().sessions.narrower.to_json();
            s["sessions"]
                .as_array()
                .is_some_and(|v| v.iter().all(|e| e["holders"] == 0))
        })
        .await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let state = narrower_state(&h).await;
    let opened = state["opened"].as_u64().unwrap() as f64;
    assert!(
        opened <= 2.0 + elapsed.ceil(),
        "{opened} narrower sessions opened in {elapsed:.1} s: {state}"
    );
    assert!(
        elapsed < 13.0,
        "fifteen grants took {elapsed:.1} s of the paused clock"
    );
    assert!(throttled > 0, "no open was refused in {elapsed:.1} s");
    assert!(state["throttled"].as_u64() > Some(0), "{state}");
}

/// `/v1/rpc` callers are a client per call: a narrowed one's session
/// lingers, so calls in a row share it.
#[tokio::test]
async fn narrowed_rpc_calls_share_one_lingering_session() {
    let h = start().await;
    let _ready = h.connected().await;
    for _ in 0..3 {
        let (code, _, resp) = crate::http_api::request(
            &h.socket(),
            "POST",
            "/v1/rpc",
            &[("x-clawmux-scopes", "operator.read")],
            br#"{"method":"status"}"#,
        )
        .await;
        assert_eq!(code, 200);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert!(v["payload"]["sessions"].get("paths").is_none(), "{v}");
    }
    let state = narrower_state(&h).await;
    assert_eq!(state["opened"], 1, "{state}");
    assert_eq!(h.gw.total_connections(), 2);
}

/// Shutdown waits for the narrower sessions too: their connectors are
/// tracked, so each has closed its gateway connection (phase `stopped`)
/// by the time `shutdown` returns.
#[tokio::test]
async fn shutdown_closes_narrower_sessions_before_it_returns() {
    let h = start().await;
    let (mut reader, _) = h.connected_as(&["operator.read"]).await;
    assert_eq!(reader.request("status", json!({})).await["ok"], true);
    let narrower = h.broker.ctx().sessions.narrower.to_json();
    assert_eq!(narrower["sessions"][0]["phase"], "ready", "{narrower}");
    let Harness {
        gw,
        broker,
        dir: _dir,
        ..
    } = h;
    let ctx = std::sync::Arc::clone(broker.ctx());
    assert!(broker.shutdown(std::time::Duration::from_secs(5)).await);
    let narrower = ctx.sessions.narrower.to_json();
    for s in narrower["sessions"].as_array().unwrap() {
        assert_eq!(s["phase"], "stopped", "{narrower}");
    }
    eventually("the gateway saw every connection close", || {
        gw.open_connections() == 0
    })
    .await;
    drop(reader);
}
