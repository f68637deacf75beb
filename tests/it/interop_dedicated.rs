//! `/ws/dedicated` against a REAL OpenClaw Gateway (npm `openclaw`), started
//! on loopback by `../shared/peers/openclaw-gateway.sh`: a device-signed
//! client through the dedicated route is paired silently on loopback and
//! keeps its own device identity (it is not the broker's device); Claw3D's
//! device-signed `openclaw-control-ui` gets `hello-ok` with the `Origin` the
//! route sets for browser clients.
//!
//! Ignored by default (a ~1 GB gateway, 12-19 s to start): `.ci/interop`
//! runs it with `--ignored`.

use std::time::{Duration, Instant};

use crate::real_gateway::*;
use crate::support::*;
use clawmux::config::DedicatedOrigin;
use clawmux::upstream::identity::{ConnectProof, DeviceIdentity};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

#[tokio::test]
#[ignore = "needs a real OpenClaw gateway: run by .ci/interop"]
async fn a_device_signed_client_keeps_its_own_identity_through_the_dedicated_route() {
    assert!(
        script().exists(),
        "{} is missing (CI clones shared/ beside the repo)",
        script().display()
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let gw = Gateway::start(port, dir.path().join("gateway.log"));
    let mut settings = test_settings(
        &dir.path().join("broker"),
        &format!("ws://127.0.0.1:{port}"),
        Some(TOKEN),
    );
    settings.upstream.backoff_initial = Duration::from_secs(1);
    settings.upstream.backoff_max = Duration::from_secs(4);
    settings.upstream.handshake_timeout = Duration::from_secs(15);
    let broker = RunningBroker::start(settings).await.expect("broker starts");
    let sock = broker.socket_path().to_owned();

    // The gateway is up once the broker's shared session is.
    let deadline = Instant::now() + FIRST_START;
    let broker_device = loop {
        let (_, health) = http_get(&sock, "/healthz").await;
        if health["upstream"] == "ready" {
            break health["deviceId"].as_str().unwrap_or_default().to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "the gateway did not come up: {health}\n{}",
            gw.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // A client with a key of its own, signing the gateway's own nonce.
    let key_dir = tempfile::tempdir().unwrap();
    let identity = DeviceIdentity::load_or_create(key_dir.path()).unwrap();
    assert_ne!(identity.device_id(), broker_device);
    let mut c = WsClient::open(&sock, "/ws/dedicated").await;
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
    let scopes = ["operator.read", "operator.write"];
    let device = identity.sign_connect(&ConnectProof {
        client_id: "cli",
        client_mode: "cli",
        role: "operator",
        scopes: &scopes,
        signed_at_ms: challenge["payload"]["ts"].as_u64().unwrap(),
        token: TOKEN,
        nonce: challenge["payload"]["nonce"].as_str().unwrap(),
        platform: "linux",
        device_family: "",
    });
    c.send_json(
        &json!({"type":"req","id":"dedicated-1","method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"cli","version":"interop","platform":"linux","mode":"cli"},
        "role":"operator","scopes":scopes,"auth":{"token":TOKEN},"device":device}}),
    )
    .await;
    let res = c.response("dedicated-1").await;
    assert_eq!(res["ok"], true, "{res}\n{}", gw.log_tail());
    // Paired silently on loopback: the gateway minted a device token for
    // this device, and passed it to the client (the route does not filter).
    assert!(
        res["payload"]["auth"]["deviceToken"].is_string(),
        "a device token for the client's own device: {res}"
    );
    assert_eq!(
        res["payload"]["auth"]["scopes"],
        json!(scopes),
        "scopes kept: {res}"
    );
    let health = c.request("health", json!({})).await;
    assert_eq!(health["ok"], true, "{health}");

    // The gateway knows the client's device as paired (silently) and
    // connected. (The broker's own session, `gateway-client`/`backend` with
    // the token on loopback, is not in the list: it skips pairing.)
    let (status, list) =
        crate::http_api::rpc(&sock, r#"{"method":"device.pair.list","params":{}}"#).await;
    assert_eq!(status, 200, "{list}");
    let paired = list["payload"]["paired"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let own = paired
        .iter()
        .find(|d| d["deviceId"] == identity.device_id())
        .unwrap_or_else(|| panic!("the client's device is paired: {list}"));
    assert_eq!(own["connected"], true, "{own}");
    assert_eq!(own["approvedVia"], "silent", "{own}");
    assert_eq!(own["clientId"], "cli", "{own}");

    // Listed by the broker with its identity, never a secret.
    let (_, state) = http_get(&sock, "/v1/state").await;
    let listed = &state["dedicated"][0];
    assert_eq!(listed["device_id"], identity.device_id(), "{state}");
    assert_eq!(listed["auth"], "token", "{state}");
    assert_eq!(listed["phase"], "connected", "{state}");
    assert!(!state.to_string().contains(TOKEN));

    // A normal close completes.
    c.ws_mut()
        .close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "done".into(),
        }))
        .await
        .unwrap();
    let closed = loop {
        match c.recv().await {
            Got::Json(_) => continue,
            other => break other,
        }
    };
    assert!(matches!(closed, Got::Close(1000, _)), "{closed:?}");
    eprintln!(
        "interop: dedicated route: device {} paired and connected under its own identity",
        &identity.device_id()[..12]
    );
    broker.shutdown(Duration::from_secs(5)).await;
    drop(gw);
}

/// Claw3D's device-signed browser connect (`GatewayBrowserClient.ts`:
/// `openclaw-control-ui`, mode `webchat`, its scopes, the token in `auth`)
/// through `/ws/dedicated`, its upgrade request carrying `origin` as a
/// browser's (or Claw3D's proxy's) does; `signed: false` leaves the device
/// out (an insecure context). Returns the gateway's answer, and the client
/// (its connection stays listed in `/v1/state` while it is open).
async fn control_ui_connect(
    sock: &std::path::Path,
    origin: Option<&str>,
    signed: bool,
) -> (Value, WsClient) {
    let key_dir = tempfile::tempdir().unwrap();
    let identity = DeviceIdentity::load_or_create(key_dir.path()).unwrap();
    let headers: Vec<(&str, &str)> = origin.map(|o| ("Origin", o)).into_iter().collect();
    let mut c = WsClient::open_with_headers(sock, "/ws/dedicated", &headers).await;
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
    let scopes = [
        "operator.read",
        "operator.admin",
        "operator.approvals",
        "operator.pairing",
    ];
    let device = signed.then(|| {
        identity.sign_connect(&ConnectProof {
            client_id: "openclaw-control-ui",
            client_mode: "webchat",
            role: "operator",
            scopes: &scopes,
            signed_at_ms: challenge["payload"]["ts"].as_u64().unwrap(),
            token: TOKEN,
            nonce: challenge["payload"]["nonce"].as_str().unwrap(),
            platform: "web",
            device_family: "",
        })
    });
    let mut frame = json!({"type":"req","id":"claw3d-1","method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"openclaw-control-ui","version":"dev","platform":"web","mode":"webchat"},
        "role":"operator","scopes":scopes,"caps":[],"auth":{"token":TOKEN}}});
    if let Some(device) = device {
        frame["params"]["device"] = device;
    }
    c.send_json(&frame).await;
    (c.response("claw3d-1").await, c)
}

#[tokio::test]
#[ignore = "needs a real OpenClaw gateway: run by .ci/interop"]
async fn claw3ds_control_ui_connects_through_the_dedicated_route() {
    assert!(
        script().exists(),
        "{} is missing (CI clones shared/ beside the repo)",
        script().display()
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut gw = Gateway::start(port, dir.path().join("gateway.log"));
    gw.wait_ready(FIRST_START).await;
    // One broker per setting, all on the one gateway.
    let broker = |name: &str, url: String, origin: DedicatedOrigin| {
        let mut s = broker_settings(&dir.path().join(name), port, TOKEN);
        s.gateway_url = url;
        s.upstream.dedicated_origin = origin;
        RunningBroker::start(s)
    };
    let loopback = format!("ws://127.0.0.1:{port}");
    let default = broker("default", loopback.clone(), DedicatedOrigin::Derived)
        .await
        .unwrap();
    let sock = default.socket_path().to_owned();
    wait_phase(&sock, "ready", FIRST_START, &gw).await;

    // The default origin, `http://localhost:P` for `ws://127.0.0.1:P`: hello-ok.
    let (res, _client) = control_ui_connect(&sock, Some("http://localhost:3000"), true).await;
    assert_eq!(res["ok"], true, "{res}\n{}", gw.log_tail());
    assert_eq!(res["payload"]["type"], "hello-ok", "{res}");
    let (_, state) = http_get(&sock, "/v1/state").await;
    assert_eq!(
        state["dedicated"][0]["origin"],
        json!(format!("http://localhost:{port}")),
        "{state}"
    );
    // Without a device signature: the gateway's own refusal.
    let (res, _client) = control_ui_connect(&sock, Some("http://localhost:3000"), false).await;
    assert_eq!(res["ok"], false, "{res}");
    let message = res["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("control ui requires device identity"),
        "{res}"
    );

    // The gateway's own address as the origin (Claw3D's rule for a
    // `ws://localhost:P` URL): taken for a page of another build.
    let own = broker(
        "own",
        loopback.clone(),
        DedicatedOrigin::Fixed(format!("http://127.0.0.1:{port}")),
    )
    .await
    .unwrap();
    wait_phase(own.socket_path(), "ready", FIRST_START, &gw).await;
    let (res, _client) =
        control_ui_connect(own.socket_path(), Some("http://localhost:3000"), true).await;
    let message = res["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("protocol mismatch: Control UI updated"),
        "{res}"
    );

    // No Origin at all: refused, close 1008.
    let off = broker("off", loopback.clone(), DedicatedOrigin::Off)
        .await
        .unwrap();
    wait_phase(off.socket_path(), "ready", FIRST_START, &gw).await;
    let (res, _client) =
        control_ui_connect(off.socket_path(), Some("http://localhost:3000"), true).await;
    assert_eq!(
        res["error"]["details"]["code"], "CONTROL_UI_ORIGIN_NOT_ALLOWED",
        "{res}"
    );

    // A `ws://localhost:P` URL: the derived origin is `http://127.0.0.1:P`.
    let named = broker(
        "named",
        format!("ws://localhost:{port}"),
        DedicatedOrigin::Derived,
    )
    .await
    .unwrap();
    wait_phase(named.socket_path(), "ready", FIRST_START, &gw).await;
    let (res, _client) =
        control_ui_connect(named.socket_path(), Some("http://localhost:3000"), true).await;
    assert_eq!(res["ok"], true, "{res}\n{}", gw.log_tail());
    eprintln!("interop: Claw3D's control UI through the dedicated route: hello-ok with the derived Origin; the measured refusals hold");
    for b in [default, own, off, named] {
        b.shutdown(Duration::from_secs(5)).await;
    }
    drop(gw);
}
