//! `/ws/dedicated` and the `Origin` header: a browser client (Claw3D's
//! device-signed `openclaw-control-ui`, a `webchat-ui` page) gets the
//! gateway connection opened with `[upstream] dedicated_origin` (by default
//! derived from the gateway URL, as Claw3D's proxy derives it); a client
//! that is no browser gets none, so its device is still paired silently.
//! The gateway double checks origins as the real gateway does.

use serde_json::{json, Value};

use crate::support::*;
use clawmux::config::DedicatedOrigin;
use clawmux::upstream::identity::{ConnectProof, DeviceIdentity};

/// The connects the double received from dedicated clients, with the
/// `Origin` each connection carried (the broker's own session left out).
fn client_connects(gw: &MockGateway) -> Vec<(Value, Option<String>)> {
    gw.connects()
        .into_iter()
        .zip(gw.connect_origins())
        .filter(|(c, _)| c["client"]["id"] != "gateway-client")
        .collect()
}

/// The origin the broker derives for the double's URL (`ws://127.0.0.1:P`).
fn derived(gw: &MockGateway) -> String {
    let port = gw.addr().port();
    assert!(gw.url().starts_with("ws://127.0.0.1:"), "{}", gw.url());
    format!("http://localhost:{port}")
}

/// Signs and sends the connect Claw3D's browser client sends
/// (`GatewayBrowserClient.ts`: `openclaw-control-ui`, mode `webchat`, its
/// scopes, the token in `auth`), over the gateway's challenge nonce.
async fn claw3d_connect(c: &mut WsClient, identity: &DeviceIdentity, id: &str) -> Value {
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
    let scopes = [
        "operator.read",
        "operator.admin",
        "operator.approvals",
        "operator.pairing",
    ];
    let device = identity.sign_connect(&ConnectProof {
        client_id: "openclaw-control-ui",
        client_mode: "webchat",
        role: "operator",
        scopes: &scopes,
        signed_at_ms: clawmux::protocol::now_ms(),
        token: "test-token",
        nonce: challenge["payload"]["nonce"].as_str().unwrap(),
        platform: "web",
        device_family: "",
    });
    c.send_json(&json!({"type":"req","id":id,"method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"openclaw-control-ui","version":"dev","platform":"web","mode":"webchat"},
        "role":"operator","scopes":scopes,"device":device,"caps":[],
        "auth":{"token":"test-token"}}}))
        .await;
    c.response(id).await
}

#[tokio::test]
async fn claw3ds_device_signed_control_ui_gets_the_origin_claw3d_sets() {
    init_test_log();
    let h = start().await;
    let key_dir = tempfile::tempdir().unwrap();
    let identity = DeviceIdentity::load_or_create(key_dir.path()).unwrap();
    // A browser (or Claw3D's proxy for one) sends an Origin of its own; the
    // broker sends the gateway the configured one instead, as Claw3D does.
    let mut c = WsClient::open_with_headers(
        &h.socket(),
        "/ws/dedicated",
        &[("Origin", "http://localhost:3000")],
    )
    .await;
    let res = claw3d_connect(&mut c, &identity, "c1").await;
    assert_eq!(res["ok"], true, "{res}");
    let sent = client_connects(&h.gw);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].1.as_deref(), Some(derived(&h.gw).as_str()));
    let state = crate::http_api::state(&h.socket()).await;
    let listed = &state["dedicated"][0];
    assert_eq!(listed["origin"], json!(derived(&h.gw)), "{state}");
    assert_eq!(listed["device_id"], identity.device_id(), "{state}");
}

#[tokio::test]
async fn a_browser_ui_connect_sent_at_once_gets_the_origin_without_one_of_its_own() {
    init_test_log();
    let h = start().await;
    // `webchat-ui` (what Claw3D's proxy makes of a Control UI without a
    // device), its connect sent before the gateway connection is opened.
    let mut c = WsClient::open(&h.socket(), "/ws/dedicated").await;
    c.send_json(&json!({"type":"req","id":"w1","method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"webchat-ui","version":"dev","platform":"web","mode":"webchat"},
        "role":"operator","scopes":["operator.read"],"caps":[]}}))
        .await;
    let res = c.response("w1").await;
    assert_eq!(res["ok"], true, "{res}");
    let sent = client_connects(&h.gw);
    assert_eq!(sent[0].1.as_deref(), Some(derived(&h.gw).as_str()));
    // The host token was injected as before.
    assert_eq!(sent[0].0["auth"], json!({"token": "test-token"}));
}

#[tokio::test]
async fn a_client_that_is_no_browser_gets_no_origin_and_keeps_silent_pairing() {
    init_test_log();
    let h = start().await;
    let key_dir = tempfile::tempdir().unwrap();
    let identity = DeviceIdentity::load_or_create(key_dir.path()).unwrap();
    // A device-signed CLI waits for the challenge: the gateway connection
    // is opened before its connect is seen, and it sent no Origin.
    let mut c = WsClient::open(&h.socket(), "/ws/dedicated").await;
    let challenge = c.recv_json().await;
    let scopes = ["operator.read"];
    let device = identity.sign_connect(&ConnectProof {
        client_id: "cli",
        client_mode: "cli",
        role: "operator",
        scopes: &scopes,
        signed_at_ms: clawmux::protocol::now_ms(),
        token: "test-token",
        nonce: challenge["payload"]["nonce"].as_str().unwrap(),
        platform: "linux",
        device_family: "",
    });
    c.send_json(&json!({"type":"req","id":"c1","method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"cli","version":"test","platform":"linux","mode":"cli"},
        "role":"operator","scopes":scopes,"device":device,"auth":{"token":"test-token"}}}))
        .await;
    // With an Origin the gateway would ask for pairing approval instead.
    let res = c.response("c1").await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(client_connects(&h.gw)[0].1, None);
    let state = crate::http_api::state(&h.socket()).await;
    assert_eq!(state["dedicated"][0]["origin"], Value::Null, "{state}");
}

#[tokio::test]
async fn the_origin_is_configurable_and_can_be_turned_off() {
    init_test_log();
    // A configured origin is sent as it is.
    let h = start_with(mock_config(), |s| {
        s.upstream.dedicated_origin = DedicatedOrigin::Fixed("http://localhost:5173".into());
    })
    .await;
    let key_dir = tempfile::tempdir().unwrap();
    let identity = DeviceIdentity::load_or_create(key_dir.path()).unwrap();
    let mut c =
        WsClient::open_with_headers(&h.socket(), "/ws/dedicated", &[("Origin", "null")]).await;
    let res = claw3d_connect(&mut c, &identity, "c1").await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(
        client_connects(&h.gw)[0].1.as_deref(),
        Some("http://localhost:5173")
    );

    // The gateway's own address as the origin: the gateway takes the page
    // for one it served, of another build (what Claw3D's rule would send
    // for a `ws://localhost:P` URL, and why the broker's default does not).
    let own = start_with(mock_config(), |s| {
        let url = s.gateway_url.replace("ws://", "http://");
        s.upstream.dedicated_origin = DedicatedOrigin::Fixed(url);
    })
    .await;
    let mut c = WsClient::open_with_headers(
        &own.socket(),
        "/ws/dedicated",
        &[("Origin", "http://localhost:3000")],
    )
    .await;
    let res = claw3d_connect(&mut c, &identity, "c2").await;
    assert_eq!(res["ok"], false, "{res}");
    assert!(
        res["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("protocol mismatch: Control UI updated"),
        "{res}"
    );

    // Off: no Origin for anyone, and the gateway refuses the Control UI.
    let off = start_with(mock_config(), |s| {
        s.upstream.dedicated_origin = DedicatedOrigin::Off;
    })
    .await;
    let mut c = WsClient::open_with_headers(
        &off.socket(),
        "/ws/dedicated",
        &[("Origin", "http://localhost:3000")],
    )
    .await;
    let res = claw3d_connect(&mut c, &identity, "c3").await;
    assert_eq!(res["ok"], false, "{res}");
    assert_eq!(
        res["error"]["details"]["code"], "CONTROL_UI_ORIGIN_NOT_ALLOWED",
        "{res}"
    );
    let (code, _) = c.expect_close().await;
    assert_eq!(code, 1008);
    assert_eq!(client_connects(&off.gw)[0].1, None);
}
