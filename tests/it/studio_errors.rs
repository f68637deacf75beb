//! Every connect failure reaches the local client as a `studio.*` error on
//! its connect id, then close `1011 connect failed` (design §3).

use std::time::Duration;

use crate::support::*;
use serde_json::{json, Value};

/// Connects to a broker and returns the error of the refused connect.
async fn refused_connect(socket: &std::path::Path) -> Value {
    let mut c = WsClient::open(socket, "/ws").await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["ok"], false, "{res}");
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
    res["error"].clone()
}

#[tokio::test]
async fn gateway_url_invalid() {
    let (b, _d) = broker_only(|s| s.gateway_url = "http://localhost:18789".into()).await;
    let e = refused_connect(b.socket_path()).await;
    assert_eq!(e["code"], "studio.gateway_url_invalid");
    assert_eq!(e["retryable"], false);
    assert!(
        e["message"].as_str().unwrap().contains("ws://"),
        "says what to fix: {e}"
    );
}

#[tokio::test]
async fn gateway_url_missing() {
    let (b, _d) = broker_only(|s| s.gateway_url = "".into()).await;
    let e = refused_connect(b.socket_path()).await;
    assert_eq!(e["code"], "studio.gateway_url_missing");
}

#[tokio::test]
async fn gateway_token_missing() {
    let (b, _d) = broker_only(|s| s.token = None).await;
    let e = refused_connect(b.socket_path()).await;
    assert_eq!(e["code"], "studio.gateway_token_missing");
    assert!(e["message"].as_str().unwrap().contains("--token"), "{e}");
}

#[tokio::test]
async fn upstream_error_when_nothing_listens() {
    // Reserve a loopback port, then free it: connecting there is refused.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (b, _d) = broker_only(|s| {
        s.gateway_url = format!("ws://127.0.0.1:{port}");
        s.limits.connect_wait = Duration::from_millis(300);
    })
    .await;
    let e = refused_connect(b.socket_path()).await;
    assert_eq!(e["code"], "studio.upstream_error");
    assert_eq!(e["retryable"], true);
    assert!(
        e["retryAfterMs"].is_u64(),
        "the broker retries by itself and says when: {e}"
    );
    assert!(
        e["message"].as_str().unwrap().contains("openclaw gateway"),
        "{e}"
    );
    // The broker keeps serving.
    let (status, body) = http_get(b.socket_path(), "/healthz").await;
    assert_eq!(status, 200);
    assert_ne!(body["upstream"], "ready");
}

#[tokio::test]
async fn upstream_timeout_when_the_handshake_stalls() {
    let faults = Faults {
        no_challenge: true,
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.upstream.handshake_timeout = Duration::from_millis(200);
        s.limits.connect_wait = Duration::from_millis(600);
    })
    .await;
    let e = refused_connect(&h.socket()).await;
    assert_eq!(e["code"], "studio.upstream_timeout", "{e}");
    assert_eq!(e["retryable"], true);
    assert!(e["retryAfterMs"].is_u64(), "{e}");
}

#[tokio::test]
async fn upstream_rejected_keeps_the_gateway_error() {
    let h = start_with(mock_config(), |s| {
        s.token = Some(clawmux::config::Secret::new("wrong-token"))
    })
    .await;
    let e = refused_connect(&h.socket()).await;
    assert_eq!(e["code"], "studio.upstream_rejected", "{e}");
    assert_eq!(e["retryable"], false);
    assert_eq!(e["details"]["code"], "INVALID_REQUEST");
    assert_eq!(e["details"]["details"]["code"], "AUTH_TOKEN_MISMATCH");
    assert!(
        !e.to_string().contains("wrong-token"),
        "the token never appears: {e}"
    );
    // The phase is set as the attempt ends, just after its waiters are
    // answered.
    eventually_async("the upstream phase says rejected", || {
        let socket = h.socket();
        async move {
            let (_, health) = http_get(&socket, "/healthz").await;
            if health["upstream"] == "rejected" {
                Ok(())
            } else {
                Err(health.to_string())
            }
        }
    })
    .await;
}

#[tokio::test]
async fn upstream_rejected_for_pairing() {
    let cfg = MockConfig {
        require_device: true,
        ..mock_config()
    };
    // A gateway that wants a device, and a broker with device identity off.
    let h = start_with(cfg, |s| s.upstream.device_identity = None).await;
    let e = refused_connect(&h.socket()).await;
    assert_eq!(e["code"], "studio.upstream_rejected", "{e}");
    assert!(e["message"].as_str().unwrap().contains("approve"), "{e}");
    assert_eq!(e["details"]["code"], "NOT_PAIRED");
    assert_eq!(e["details"]["details"]["code"], "PAIRING_REQUIRED");
}

#[tokio::test]
async fn upstream_closed_while_the_gateway_is_starting() {
    let faults = Faults {
        unavailable_connects: 1_000_000,
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.limits.connect_wait = Duration::from_millis(400)
    })
    .await;
    let e = refused_connect(&h.socket()).await;
    assert_eq!(e["code"], "studio.upstream_closed", "{e}");
    assert_eq!(e["retryable"], true);
    assert_eq!(e["details"]["code"], "UNAVAILABLE");
    assert!(e["retryAfterMs"].is_u64(), "{e}");
}

#[tokio::test]
async fn pending_requests_fail_at_once_when_upstream_drops_and_work_after() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    let (mut b, _) = h.connected().await;
    h.gw.set_faults(Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    });
    a.send_json(&json!({"type":"req","id":"s1","method":"status","params":{}}))
        .await;
    b.send_json(&json!({"type":"req","id":"s2","method":"status","params":{}}))
        .await;
    for _ in 0..2 {
        h.gw.wait_request("status", PATIENCE)
            .await
            .expect("double saw the request");
    }
    eventually("both requests reached the double", || {
        h.gw.requests().len() >= 2
    })
    .await;
    h.gw.drop_all();
    for (c, id) in [(&mut a, "s1"), (&mut b, "s2")] {
        let res = c.response(id).await;
        assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
        assert_eq!(res["error"]["retryable"], true);
        assert!(res["error"]["retryAfterMs"].is_u64());
    }
    h.gw.set_faults(Faults::default());
    // Clients stay connected, are told, and requests work after the reconnect.
    let ev = a.event("clawmux.upstream").await;
    assert_eq!(ev["payload"]["phase"], "backoff");
    let ev = a.event("clawmux.upstream").await;
    assert_eq!(ev["payload"]["phase"], "ready");
    assert_eq!(a.request("health", json!({})).await["ok"], true);
    assert_eq!(h.gw.total_connections(), 2);
}

#[tokio::test]
async fn request_timeout_answers_and_discards_the_late_answer() {
    let h = start_with(mock_config(), |s| {
        s.limits.request_timeout = Duration::from_millis(200)
    })
    .await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        hold_methods: vec!["status".into()],
        ..Faults::default()
    });
    let res = a.request("status", json!({})).await;
    assert_eq!(res["error"]["code"], "studio.request_timeout", "{res}");
    assert_eq!(res["error"]["retryable"], true);
    assert_eq!(a.request("health", json!({})).await["ok"], true);
}

#[tokio::test]
async fn requests_while_upstream_is_down_fail_fast() {
    let h = start().await;
    let (mut a, _) = h.connected().await;
    h.gw.set_faults(Faults {
        unavailable_connects: 1_000_000,
        ..Faults::default()
    });
    h.gw.drop_all();
    a.event("clawmux.upstream").await;
    let res = a.request("health", json!({})).await;
    assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    assert_eq!(res["error"]["retryable"], true);
}

/// After a failed connect answer the client may close first (Claw3D closes
/// 4008 "connect failed: CODE MESSAGE" and shows that close); its close is
/// echoed instead of racing it with 1011.
#[tokio::test]
async fn a_client_closing_after_a_failed_connect_keeps_its_close() {
    use futures_util::SinkExt;
    let (b, _d) = broker_only(|s| s.gateway_url = "http://localhost:18789".into()).await;
    let mut c = WsClient::open(b.socket_path(), "/ws").await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["ok"], false, "{res}");
    let reason = "connect failed: studio.gateway_url_invalid bad url";
    c.ws_mut()
        .send(tokio_tungstenite::tungstenite::Message::Close(Some(
            tokio_tungstenite::tungstenite::protocol::CloseFrame {
                code: 4008.into(),
                reason: reason.into(),
            },
        )))
        .await
        .unwrap();
    assert_eq!(c.expect_close().await, (4008, reason.to_owned()));
}

/// A gateway that worked and is now unreachable (restarting) is reported to
/// a connecting client as `studio.upstream_closed`, which Claw3D retries;
/// `studio.upstream_error` (which it treats as final) is kept for a gateway
/// never reached.
#[tokio::test]
async fn an_outage_after_a_working_session_is_transient() {
    let h = start_with(mock_config(), |s| {
        s.limits.connect_wait = Duration::from_millis(300);
    })
    .await;
    let (_a, _) = h.connected().await;
    let Harness { gw, broker, dir } = h;
    gw.stop().await;
    let e = refused_connect(broker.socket_path()).await;
    assert_eq!(e["code"], "studio.upstream_closed", "{e}");
    assert_eq!(e["retryable"], true);
    assert!(e["retryAfterMs"].is_u64(), "{e}");
    assert_eq!(e["details"]["cause"], "studio.upstream_error", "{e}");
    drop((broker, dir));
}
