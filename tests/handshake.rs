//! Local connect enforcement and the synthesized hello-ok (design §2).

mod support;

use std::time::Duration;

use serde_json::json;
use support::*;

#[tokio::test]
async fn hello_ok_has_the_gateway_shape_with_a_fresh_conn_id() {
    let h = start().await;
    let (_a, hello_a) = h.connected().await;
    let (_b, hello_b) = h.connected().await;
    assert_eq!(hello_a["type"], "hello-ok");
    assert_eq!(hello_a["protocol"], 4);
    let (ca, cb) = (
        hello_a["server"]["connId"].as_str().unwrap(),
        hello_b["server"]["connId"].as_str().unwrap(),
    );
    assert_ne!(ca, cb, "each local client gets its own connId");
    assert!(hello_a["server"]["version"].is_string());
    assert!(hello_a["features"]["methods"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m == "chat.send"));
    assert!(hello_a["snapshot"]["presence"].is_array());
    assert!(hello_a["snapshot"]["stateVersion"]["presence"].is_u64());
    let policy = &hello_a["policy"];
    assert!(policy["maxPayload"].as_u64().unwrap() <= 26214400);
    assert!(policy["tickIntervalMs"].is_u64());
    assert_eq!(hello_a["auth"]["role"], "operator");
    assert!(hello_a["auth"]["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s == "operator.admin"));
    assert!(hello_a["auth"].get("deviceToken").is_none());
}

#[tokio::test]
async fn challenge_comes_first_without_seq() {
    let h = start().await;
    let mut c = h.client().await;
    let ch = c.recv_json().await;
    assert_eq!(ch["type"], "event");
    assert_eq!(ch["event"], "connect.challenge");
    assert!(ch["payload"]["nonce"].is_string());
    assert!(ch["payload"]["ts"].is_u64());
    assert!(ch.get("seq").is_none());
}

async fn first_frame_closes(text: &str) -> (u16, String) {
    let h = start().await;
    let mut c = h.client().await;
    c.recv_json().await; // challenge
    c.send_text(text).await;
    c.expect_close().await
}

#[tokio::test]
async fn invalid_json_first_closes_1003() {
    assert_eq!(
        first_frame_closes("{not json").await,
        (1003, "invalid json".into())
    );
    assert_eq!(
        first_frame_closes("[1,2,3]").await,
        (1003, "invalid json".into())
    );
}

#[tokio::test]
async fn non_connect_first_closes_1008_connect_required() {
    let r = first_frame_closes(r#"{"type":"req","id":"1","method":"health"}"#).await;
    assert_eq!(r, (1008, "connect required".into()));
    let r = first_frame_closes(r#"{"type":"event","event":"x"}"#).await;
    assert_eq!(r, (1008, "connect required".into()));
}

#[tokio::test]
async fn connect_without_id_closes_1008_connect_id_required() {
    let r = first_frame_closes(r#"{"type":"req","method":"connect","params":{}}"#).await;
    assert_eq!(r, (1008, "connect id required".into()));
    let r = first_frame_closes(r#"{"type":"req","id":"","method":"connect"}"#).await;
    assert_eq!(r, (1008, "connect id required".into()));
}

#[tokio::test]
async fn oversized_first_frame_closes_1009() {
    let big =
        json!({"type":"req","id":"c","method":"connect","params":{"pad":"x".repeat(70 * 1024)}});
    assert_eq!(
        first_frame_closes(&big.to_string()).await,
        (1009, "frame too large".into())
    );
}

#[tokio::test]
async fn oversized_frame_after_connect_closes_1009() {
    let h = start_with(mock_config(), |s| s.limits.max_frame_bytes = 4096).await;
    let (mut c, hello) = h.connected().await;
    assert_eq!(
        hello["policy"]["maxPayload"], 4096,
        "advertises the smaller of both limits"
    );
    c.send_json(
        &json!({"type":"req","id":"1","method":"health","params":{"pad":"x".repeat(8000)}}),
    )
    .await;
    assert_eq!(c.expect_close().await, (1009, "frame too large".into()));
}

#[tokio::test]
async fn silent_client_closes_1008_connect_timeout() {
    let h = start_with(mock_config(), |s| {
        s.limits.connect_timeout = Duration::from_millis(150)
    })
    .await;
    let mut c = h.client().await;
    c.recv_json().await;
    assert_eq!(c.expect_close().await, (1008, "connect timeout".into()));
}

#[tokio::test]
async fn protocol_mismatch_gets_the_gateway_error_and_1002() {
    let h = start().await;
    let mut c = h.client().await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["minProtocol"] = json!(5);
    frame["params"]["maxProtocol"] = json!(6);
    c.send_json(&frame).await;
    let res = c.response("c1").await;
    assert_eq!(res["ok"], false);
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(res["error"]["message"], "protocol mismatch");
    assert_eq!(res["error"]["details"]["expectedProtocol"], 4);
    assert_eq!(c.expect_close().await, (1002, "protocol mismatch".into()));
}

#[tokio::test]
async fn invalid_connect_params_are_refused_like_the_gateway() {
    let h = start().await;
    let mut c = h.client().await;
    c.recv_json().await;
    c.send_json(&json!({"type":"req","id":"c1","method":"connect","params":{"maxProtocol":4}}))
        .await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert!(res["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("invalid connect params"));
    assert_eq!(c.expect_close().await.0, 1008);
}

#[tokio::test]
async fn second_connect_is_invalid_request_and_socket_stays_open() {
    let h = start().await;
    let (mut c, _) = h.connected().await;
    c.send_json(&connect_frame("again")).await;
    let res = c.response("again").await;
    assert_eq!(res["ok"], false);
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(
        res["error"]["message"],
        "connect is only valid as the first request"
    );
    let health = c.request("health", json!({})).await;
    assert_eq!(health["ok"], true, "{health}");
}

#[tokio::test]
async fn malformed_frames_after_connect_answer_invalid_request() {
    let h = start().await;
    let (mut c, _) = h.connected().await;
    c.send_text("{garbage").await; // ignored, as the gateway does
    c.send_json(&json!({"type":"req","id":"x1","method":"health","extra":true}))
        .await;
    let res = c.response("x1").await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert!(res["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("invalid request frame"));
    c.send_json(&json!({"type":"res","ok":true})).await;
    let res = c.response("invalid").await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(c.request("health", json!({})).await["ok"], true);
}

#[tokio::test]
async fn every_websocket_path_and_http_routes() {
    let h = start().await;
    for path in ["/", "/ws", "/api/gateway/ws"] {
        let mut c = WsClient::open(&h.socket(), path).await;
        c.handshake().await;
    }
    let (status, body) = http_get(&h.socket(), "/healthz").await;
    assert_eq!(status, 200);
    assert_eq!(body["ok"], true);
    assert_eq!(body["upstream"], "ready");
    let (status, body) = http_get(&h.socket(), "/nope").await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "not_found");
    let (status, _) = http_get(&h.socket(), "/ws").await;
    assert_eq!(
        status, 426,
        "a plain GET on the WebSocket path asks for an upgrade"
    );
}

#[tokio::test]
async fn a_client_close_is_answered_at_once() {
    let h = start().await;
    let (mut c, _) = h.connected().await;
    let started = std::time::Instant::now();
    c.close().await;
    // The broker's close reply arrives well before its 2 s linger on silent peers.
    match c.recv().await {
        Got::Close(..) | Got::Eof => {}
        Got::Json(v) => panic!("unexpected frame {v}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "close answered in {:?}",
        started.elapsed()
    );
    eventually("client gone from the hub", || {
        h.broker.ctx().hub.client_count() == 0
    })
    .await;
}
