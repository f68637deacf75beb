//! Handshake behaviour (gateway-protocol.md §2, §2.7, §11).

use std::time::Duration;

use serde_json::{json, Value};

use super::*;
use crate::{Faults, MockConfig, MockGateway, Rejection};

#[tokio::test]
async fn challenge_is_the_first_frame_and_has_no_seq() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut c = Client::open(&gw).await;
    let frame = c.recv_json().await;
    assert_eq!(frame["type"], "event");
    assert_eq!(frame["event"], "connect.challenge");
    assert!(frame.get("seq").is_none(), "{frame}");
    let nonce = frame["payload"]["nonce"].as_str().expect("nonce");
    assert!(uuid::Uuid::parse_str(nonce).is_ok());
    assert!(frame["payload"]["ts"].as_i64().expect("ts") > 1_700_000_000_000);
    assert!(gw.wait_until(WAIT, || gw.open_connections() == 1).await);
    assert_eq!(gw.ready_connections(), 0);
}

#[tokio::test]
async fn full_handshake_returns_complete_hello_ok() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let (_c, res) = ready_client(&gw, params(Some("secret"))).await;
    let hello = &res["payload"];
    assert_eq!(hello["type"], "hello-ok");
    assert_eq!(hello["protocol"], 4);
    assert_eq!(hello["server"]["version"], "2026.9.6-mock");
    assert!(uuid::Uuid::parse_str(hello["server"]["connId"].as_str().expect("connId")).is_ok());
    let methods = hello["features"]["methods"].as_array().expect("methods");
    assert!(methods.contains(&json!("chat.send")) && methods.contains(&json!("health")));
    assert!(hello["features"]["events"]
        .as_array()
        .expect("events")
        .contains(&json!("tick")));
    let snapshot = &hello["snapshot"];
    let presence = snapshot["presence"].as_array().expect("presence");
    assert_eq!(
        presence.len(),
        2,
        "the gateway's own row, then this connection"
    );
    assert_eq!(presence[0]["reason"], "self");
    assert_eq!(presence[1]["host"], "clawmux-test");
    assert_eq!(snapshot["health"], json!({}));
    assert!(
        snapshot["stateVersion"]["presence"]
            .as_u64()
            .expect("presence version")
            >= 2
    );
    assert_eq!(snapshot["stateVersion"]["health"], 1);
    assert!(snapshot["uptimeMs"].is_u64());
    assert_eq!(
        snapshot["sessionDefaults"]["mainSessionKey"],
        "agent:main:main"
    );
    assert_eq!(snapshot["authMode"], "token");
    assert_eq!(
        hello["policy"],
        json!({"maxPayload": 26214400, "maxBufferedBytes": 52428800, "tickIntervalMs": 30000})
    );
    assert_eq!(hello["auth"]["method"], "token");
    assert_eq!(hello["auth"]["role"], "operator");
    assert_eq!(hello["auth"]["scopes"], json!(ALL_SCOPES));
    assert!(hello["auth"].get("deviceToken").is_none());

    assert!(gw.wait_ready_connections(1, WAIT).await);
    assert_eq!(gw.total_connections(), 1);
    let connects = gw.connects();
    assert_eq!(connects.len(), 1);
    assert_eq!(connects[0]["auth"]["token"], "secret");
    assert_eq!(connects[0]["client"]["id"], "gateway-client");
}

#[tokio::test]
async fn wrong_token_is_rejected_with_auth_token_mismatch_and_1008() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let res = c.request("connect", params(Some("wrong"))).await;
    assert_eq!(res["ok"], false);
    let message = "unauthorized: gateway token mismatch (provide gateway auth token)";
    assert_eq!(res["error"]["code"], "INVALID_REQUEST");
    assert_eq!(res["error"]["message"], message);
    assert_eq!(
        res["error"]["details"],
        json!({"code": "AUTH_TOKEN_MISMATCH", "authReason": "token_mismatch",
               "canRetryWithDeviceToken": false, "recommendedNextStep": "update_auth_credentials"})
    );
    assert_eq!(c.expect_close().await, (1008, message.to_string()));
    assert_eq!(gw.ready_connections(), 0);
}

#[tokio::test]
async fn connect_without_any_auth_needs_a_device() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let res = c.request("connect", params(None)).await;
    assert_eq!(res["error"]["code"], "NOT_PAIRED");
    assert_eq!(res["error"]["message"], "device identity required");
    assert_eq!(
        c.expect_close().await,
        (1008, "device identity required".into())
    );
}

#[tokio::test]
async fn protocol_mismatch_closes_1002() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let mut p = params(Some("secret"));
    p["minProtocol"] = json!(2);
    p["maxProtocol"] = json!(3);
    let res = c.request("connect", p).await;
    assert_eq!(res["error"]["message"], "protocol mismatch");
    let details = &res["error"]["details"];
    assert_eq!(details["code"], "PROTOCOL_MISMATCH");
    assert_eq!(details["expectedProtocol"], 4);
    assert_eq!(
        (
            details["clientMinProtocol"].clone(),
            details["clientMaxProtocol"].clone()
        ),
        (json!(2), json!(3))
    );
    assert_eq!(c.expect_close().await, (1002, "protocol mismatch".into()));
}

#[tokio::test]
async fn first_request_must_be_connect() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let res = c.request("health", json!({})).await;
    let text = "invalid handshake: first request must be connect";
    assert_eq!(
        res["error"],
        json!({"code": "INVALID_REQUEST", "message": text})
    );
    assert_eq!(c.expect_close().await, (1008, text.into()));
}

#[tokio::test]
async fn bad_frames_before_connect_close_without_response() {
    let gw = MockGateway::start(fast_config()).await.expect("start");

    let mut c = Client::open(&gw).await;
    c.challenge().await;
    c.send_text("{not json").await;
    assert_eq!(c.expect_close().await, (1000, String::new()));

    let mut c = Client::open(&gw).await;
    c.challenge().await;
    c.send_json(&json!({"type": "req", "id": "1", "method": "connect", "extra": true}))
        .await;
    assert_eq!(
        c.expect_close().await,
        (1008, "invalid request frame".into())
    );

    let mut c = Client::open(&gw).await;
    c.challenge().await;
    c.send_text(&"x".repeat(70 * 1024)).await;
    assert_eq!(
        c.expect_close().await,
        (1009, String::new()),
        "the ws limit fires first on a real 2026.9.6 gateway"
    );
    assert!(gw.wait_no_connections(WAIT).await);
}

#[tokio::test]
async fn invalid_connect_params_name_the_violation() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let mut p = params(Some("secret"));
    p["client"]["id"] = json!("clawmux");
    let res = c.request("connect", p).await;
    let message = res["error"]["message"]
        .as_str()
        .expect("message")
        .to_string();
    assert!(
        message.starts_with("invalid connect params: at /client/id: "),
        "{message}"
    );
    let (code, reason) = c.expect_close().await;
    assert_eq!(code, 1008);
    assert!(reason.len() <= 120 && message.starts_with(&reason));
}

#[tokio::test]
async fn handshake_timeout_closes_1000_without_reason() {
    let cfg = MockConfig {
        handshake_timeout: Duration::from_millis(150),
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    assert_eq!(c.expect_close().await, (1000, String::new()));
}

#[tokio::test]
async fn unavailable_connects_answer_1013_then_recover() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    gw.set_faults(Faults {
        unavailable_connects: 1,
        ..Faults::default()
    });
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let res = c.request("connect", params(Some("secret"))).await;
    assert_eq!(
        res["error"],
        json!({"code": "UNAVAILABLE", "message": "gateway starting; retry shortly", "retryable": true,
               "retryAfterMs": 500, "details": {"reason": "startup-sidecars"}})
    );
    assert_eq!(c.expect_close().await, (1013, "gateway starting".into()));
    assert_eq!(gw.faults().unavailable_connects, 0);
    ready_client(&gw, params(Some("secret"))).await;
}

#[tokio::test]
async fn reject_connect_fault_sends_the_rejection() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    gw.set_faults(Faults {
        reject_connect: Some(Rejection::pairing_required()),
        ..Faults::default()
    });
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let res = c.request("connect", params(Some("secret"))).await;
    assert_eq!(res["error"]["code"], "NOT_PAIRED");
    assert_eq!(res["error"]["details"]["code"], "PAIRING_REQUIRED");
    assert_eq!(c.expect_close().await, (1008, "pairing required".into()));
}

#[tokio::test]
async fn deviceless_clients_lose_scopes_unless_backend_or_cli() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let mut p = params(Some("secret"));
    p["client"]["id"] = json!("test");
    p["client"]["mode"] = json!("test");
    let (mut c, hello) = ready_client(&gw, p).await;
    assert_eq!(hello["payload"]["auth"]["scopes"], json!([]));
    let res = c.request("status", json!({})).await;
    assert_eq!(
        res["error"],
        json!({"code": "FORBIDDEN", "message": "missing scope: operator.read",
               "details": {"code": "MISSING_SCOPE", "missingScope": "operator.read",
                           "requiredScopes": ["operator.read"]}})
    );
    assert_eq!(c.request("health", json!({})).await["ok"], true);

    gw.set_faults(Faults {
        grant_scopes: Some(vec!["operator.read".into()]),
        ..Faults::default()
    });
    let (mut c, hello) = ready_client(&gw, params(Some("secret"))).await;
    assert_eq!(hello["payload"]["auth"]["scopes"], json!(["operator.read"]));
    let res = c
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "hi", "idempotencyKey": "k"}),
        )
        .await;
    assert_eq!(res["error"]["message"], "missing scope: operator.write");
}

/// Edits signed connect params (given the challenge nonce) to break the proof.
type Tamper = fn(&mut Value, &str);

/// Completes a device-signed connect; returns the response frame.
async fn device_connect(
    gw: &MockGateway,
    device: &Device,
    mut p: Value,
    tamper: impl FnOnce(&mut Value, &str),
) -> (Client, Value) {
    let mut c = Client::open(gw).await;
    let nonce = c.challenge().await;
    device.sign(&mut p, &nonce, super::super::state::now_ms());
    tamper(&mut p, &nonce);
    let res = c.request("connect", p).await;
    (c, res)
}

#[tokio::test]
async fn device_signatures_are_verified_and_mint_a_device_token() {
    let gw = MockGateway::start(fast_config()).await.expect("start");
    let device = Device::generate();

    let mut p = params(Some("secret"));
    p["client"]["id"] = json!("test");
    p["client"]["mode"] = json!("test");
    p["client"]["deviceFamily"] = json!(" Desktop ");
    let (_c, res) = device_connect(&gw, &device, p.clone(), |_, _| {}).await;
    assert_eq!(res["ok"], true, "{res}");
    let auth = &res["payload"]["auth"];
    assert_eq!(
        auth["scopes"],
        json!(ALL_SCOPES),
        "a device keeps its scopes"
    );
    let device_token = auth["deviceToken"]
        .as_str()
        .expect("device token")
        .to_string();
    assert!(auth["issuedAtMs"].is_i64());
    assert_eq!(
        res["payload"]["snapshot"]["presence"][1]["deviceId"],
        json!(device.id())
    );

    // Reconnect with the minted device token instead of the shared token.
    let mut p2 = p.clone();
    p2["auth"] = json!({ "deviceToken": device_token });
    let (_c, res) = device_connect(&gw, &device, p2, |_, _| {}).await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(res["payload"]["auth"]["method"], "device-token");

    let cases: [(&str, Tamper); 4] = [
        ("device signature invalid", |p, _| {
            p["scopes"] = json!(["operator.read"])
        }),
        ("device nonce mismatch", |p, _| {
            p["device"]["nonce"] = json!("other")
        }),
        ("device identity mismatch", |p, _| {
            p["device"]["id"] = json!("00".repeat(32))
        }),
        ("device signature expired", |p, _| {
            p["device"]["signedAt"] = json!(1_000)
        }),
    ];
    for (message, tamper) in cases {
        let (mut c, res) = device_connect(&gw, &device, p.clone(), tamper).await;
        assert_eq!(res["error"]["message"], message, "{res}");
        assert!(res["error"]["details"]["code"]
            .as_str()
            .expect("code")
            .starts_with("DEVICE_AUTH_"));
        assert_eq!(c.expect_close().await, (1008, message.to_string()));
    }
}

#[tokio::test]
async fn auth_mode_none_and_require_device() {
    let gw = MockGateway::start(MockConfig {
        token: None,
        ..fast_config()
    })
    .await
    .expect("start");
    let (_c, hello) = ready_client(&gw, params(None)).await;
    assert_eq!(hello["payload"]["snapshot"]["authMode"], "none");

    let cfg = MockConfig {
        require_device: true,
        ..fast_config()
    };
    let gw = MockGateway::start(cfg).await.expect("start");
    let mut c = Client::open(&gw).await;
    c.challenge().await;
    let res = c.request("connect", params(Some("secret"))).await;
    assert_eq!(res["error"]["message"], "device identity required");
    assert_eq!(c.expect_close().await.0, 1008);
    let (_c, res) =
        device_connect(&gw, &Device::generate(), params(Some("secret")), |_, _| {}).await;
    assert_eq!(res["ok"], true, "{res}");
}

#[tokio::test]
async fn start_on_rejects_non_loopback_addresses() {
    let addr = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
    let err = MockGateway::start_on(addr, fast_config())
        .await
        .expect_err("must refuse");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}
