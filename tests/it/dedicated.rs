//! `GET /ws/dedicated`: one gateway connection per local client, Claw3D
//! proxy semantics (token injection only without client auth, frames
//! verbatim, closes mirrored), its limits, and how it is listed.
//!
//! Most tests run against the gateway double; the ones that need to see
//! what the gateway receives on close (or a gateway that never answers) run
//! against a small scripted gateway in this file.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

use clawmux::upstream::identity::{ConnectProof, DeviceIdentity};

async fn dedicated(h: &Harness) -> WsClient {
    WsClient::open(&h.socket(), "/ws/dedicated").await
}

/// The double's record of connects from clients other than the broker's
/// own shared session.
fn client_connects(gw: &MockGateway) -> Vec<Value> {
    gw.connects()
        .into_iter()
        .filter(|c| c["client"]["id"] != "gateway-client")
        .collect()
}

/// Waits until `/metrics` counts `n` open dedicated connections.
async fn wait_dedicated_open(socket: &std::path::Path, n: usize, within: Duration) {
    let needle = format!("clawmux_dedicated_connections {n}\n");
    let what = format!("{n} dedicated connections within {within:?}");
    eventually_within(&what, within, || async {
        let m = metrics(socket).await;
        if m.contains(&needle) {
            Ok(())
        } else {
            Err(m)
        }
    })
    .await
}

async fn metrics(socket: &std::path::Path) -> String {
    let (status, _, body) = crate::http_api::request_text(socket, "GET", "/metrics", b"").await;
    assert_eq!(status, 200);
    body
}

#[tokio::test]
async fn the_host_token_is_injected_when_the_client_brings_no_auth() {
    init_test_log();
    let h = start().await;
    let mut c = dedicated(&h).await;
    // The gateway's own challenge, verbatim (its nonce is what a device signs).
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
    assert!(challenge["payload"]["nonce"].is_string());
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["ok"], true, "{res}");
    let sent = client_connects(&h.gw);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0]["auth"], json!({"token": "test-token"}));
    // Frames pass verbatim: the client's own id comes back unchanged.
    c.send_json(&json!({"type":"req","id":"same-id","method":"health"}))
        .await;
    let health = c.response("same-id").await;
    assert_eq!(health["ok"], true, "{health}");
    // Two gateway connections: the shared session and this one.
    assert_eq!(h.gw.ready_connections(), 2);
}

#[tokio::test]
async fn the_clients_own_token_is_forwarded_and_the_gateways_close_mirrored() {
    init_test_log();
    let h = start().await;
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["auth"] = json!({"token": "not-the-token"});
    c.send_json(&frame).await;
    // The gateway's own answer, not a studio.* one: it answered.
    let res = c.response("c1").await;
    assert_eq!(res["ok"], false, "{res}");
    assert_eq!(res["error"]["code"], "INVALID_REQUEST", "{res}");
    let (code, reason) = c.expect_close().await;
    assert_eq!(code, 1008, "{reason}");
    assert_eq!(
        client_connects(&h.gw)[0]["auth"],
        json!({"token": "not-the-token"})
    );
    let m = metrics(&h.socket()).await;
    assert!(
        m.contains("clawmux_dedicated_total{outcome=\"rejected\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn a_device_signed_connect_passes_untouched() {
    init_test_log();
    // Auth mode `none`: a device signature alone is enough, and the broker
    // must not add the host token to it.
    let cfg = MockConfig {
        token: None,
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let key_dir = tempfile::tempdir().unwrap();
    let identity = DeviceIdentity::load_or_create(key_dir.path()).unwrap();
    let mut c = dedicated(&h).await;
    let challenge = c.recv_json().await;
    let nonce = challenge["payload"]["nonce"].as_str().unwrap().to_owned();
    let scopes = ["operator.read"];
    let device = identity.sign_connect(&ConnectProof {
        client_id: "cli",
        client_mode: "cli",
        role: "operator",
        scopes: &scopes,
        signed_at_ms: clawmux::protocol::now_ms(),
        token: "",
        nonce: &nonce,
        platform: "linux",
        device_family: "",
    });
    let params = json!({
        "minProtocol": 3, "maxProtocol": 4,
        "client": {"id": "cli", "version": "test", "platform": "linux", "mode": "cli"},
        "role": "operator", "scopes": scopes, "device": device,
    });
    c.send_json(&json!({"type":"req","id":"c1","method":"connect","params":params}))
        .await;
    let res = c.response("c1").await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(client_connects(&h.gw), vec![params]);
    let state = crate::http_api::state(&h.socket()).await;
    let listed = &state["dedicated"][0];
    assert_eq!(listed["device_id"], identity.device_id(), "{state}");
    assert_eq!(listed["auth"], "device", "{state}");
}

#[tokio::test]
async fn without_a_host_token_a_client_without_auth_gets_gateway_token_missing() {
    init_test_log();
    let h = start_with(mock_config(), |s| s.token = None).await;
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(
        res["error"]["code"], "studio.gateway_token_missing",
        "{res}"
    );
    assert_eq!(res["error"]["retryable"], false, "{res}");
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
    assert!(client_connects(&h.gw).is_empty());
}

#[tokio::test]
async fn an_unreachable_gateway_is_studio_upstream_error_as_on_the_shared_route() {
    init_test_log();
    let (broker, _dir) = broker_only(|_| {}).await;
    let mut c = WsClient::open(broker.socket_path(), "/ws/dedicated").await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.upstream_error", "{res}");
    assert_eq!(res["error"]["retryable"], true, "{res}");
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
    let m = metrics(broker.socket_path()).await;
    assert!(
        m.contains("clawmux_dedicated_total{outcome=\"failed\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn the_cap_refuses_one_more_with_a_clear_close_and_frees_slots() {
    init_test_log();
    let h = start_with(mock_config(), |s| s.limits.max_dedicated = 1).await;
    let mut first = dedicated(&h).await;
    first.recv_json().await;
    first.send_json(&connect_frame("c1")).await;
    assert_eq!(first.response("c1").await["ok"], true);
    let mut second = dedicated(&h).await;
    let (code, reason) = second.expect_close().await;
    assert_eq!(code, 1013);
    assert!(reason.contains("max_dedicated"), "{reason}");
    // Nothing was opened upstream for it.
    assert_eq!(client_connects(&h.gw).len(), 1);
    let m = metrics(&h.socket()).await;
    assert!(
        m.contains("clawmux_dedicated_total{outcome=\"refused\"} 1"),
        "{m}"
    );
    first.close().await;
    let socket = h.socket();
    wait_dedicated_open(&socket, 0, PATIENCE).await;
    let mut third = dedicated(&h).await;
    assert_eq!(third.recv_json().await["event"], "connect.challenge");
}

/// Waits until `/metrics` has `needle` (a whole sample line).
async fn wait_metric(socket: &std::path::Path, needle: &str) -> String {
    eventually_async(&format!("{needle:?} in /metrics"), || async {
        let m = metrics(socket).await;
        if m.contains(needle) {
            Ok(m)
        } else {
            Err(m)
        }
    })
    .await
}

/// The gateway double's connection count once the shared session is up.
async fn connections_once_ready(gw: &MockGateway) -> usize {
    eventually("a shared session", || gw.ready_connections() >= 1).await;
    gw.total_connections()
}

/// Before: opening and closing `/ws/dedicated` without a `connect` made
/// an upstream connection each time (41.6 per second) and counted nothing.
/// Now the gateway connection waits for the client's `connect` (or for
/// the client to wait for the challenge): a client that leaves at once
/// costs the gateway nothing, and is counted.
#[tokio::test]
async fn opening_and_closing_without_a_connect_opens_nothing_upstream() {
    init_test_log();
    let h = start().await;
    let before = connections_once_ready(&h.gw).await;
    for _ in 0..20 {
        let mut c = dedicated(&h).await;
        c.close().await;
    }
    let socket = h.socket();
    let m = wait_metric(
        &socket,
        "clawmux_dedicated_total{outcome=\"abandoned\"} 20\n",
    )
    .await;
    assert!(
        m.contains("clawmux_dedicated_upstream_opens_total 0\n"),
        "{m}"
    );
    assert_eq!(h.gw.total_connections(), before, "no gateway connection");
    // A client that waits for the gateway's challenge still gets it.
    let mut waiting = dedicated(&h).await;
    assert_eq!(waiting.recv_json().await["event"], "connect.challenge");
    assert_eq!(h.gw.total_connections(), before + 1);
}

/// Opens beyond `[limits] upstream_open_rate` (per peer) are answered
/// `studio.too_many_requests` with `retryAfterMs`, and open nothing; every
/// outcome is counted.
#[tokio::test]
async fn opens_over_the_rate_are_refused_with_retry_after() {
    init_test_log();
    let h = start_with(mock_config(), |s| {
        s.limits.upstream_open_rate = 1;
        s.limits.upstream_open_burst = 1;
    })
    .await;
    let before = connections_once_ready(&h.gw).await;
    let mut first = dedicated(&h).await;
    first.send_json(&connect_frame("c1")).await;
    assert_eq!(first.response("c1").await["ok"], true);
    let mut second = dedicated(&h).await;
    second.send_json(&connect_frame("c2")).await;
    let res = second.response("c2").await;
    assert_eq!(res["ok"], false, "{res}");
    assert_eq!(res["error"]["code"], "studio.too_many_requests", "{res}");
    let retry = res["error"]["retryAfterMs"].as_u64().expect("retryAfterMs");
    assert!(retry > 0 && retry <= 1_001, "{res}");
    let message = res["error"]["message"].as_str().unwrap();
    assert!(message.contains("upstream_open_rate"), "{message}");
    let (code, _) = second.expect_close().await;
    assert_eq!(code, 1011);
    assert_eq!(
        h.gw.total_connections(),
        before + 1,
        "nothing opened for it"
    );
    first.close().await;
    let socket = h.socket();
    let m = wait_metric(
        &socket,
        "clawmux_dedicated_ends_total{reason=\"client_closed\"} 1\n",
    )
    .await;
    for line in [
        "clawmux_dedicated_total{outcome=\"connected\"} 1\n",
        "clawmux_dedicated_total{outcome=\"rate_limited\"} 1\n",
        "clawmux_dedicated_upstream_opens_total 1\n",
    ] {
        assert!(m.contains(line), "{line}: {m}");
    }
}

#[tokio::test]
async fn state_and_metrics_list_dedicated_clients_without_secrets() {
    init_test_log();
    let h = start().await;
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let hello = c.response("c1").await;
    let state = crate::http_api::state(&h.socket()).await;
    let listed = &state["dedicated"][0];
    assert_eq!(listed["phase"], "connected", "{state}");
    assert_eq!(listed["client"]["id"], "cli", "{state}");
    assert_eq!(listed["client"]["mode"], "cli", "{state}");
    assert_eq!(listed["role"], "operator", "{state}");
    assert_eq!(listed["auth"], "host-token", "{state}");
    assert_eq!(
        listed["conn_id"], hello["payload"]["server"]["connId"],
        "{state}"
    );
    assert_eq!(state["limits"]["max_dedicated"], 64);
    assert!(!state.to_string().contains("test-token"));
    // Not a shared-session client.
    assert_eq!(state["clients"].as_array().map(Vec::len), Some(0));
    let m = metrics(&h.socket()).await;
    assert!(m.contains("clawmux_dedicated_connections 1"), "{m}");
    assert!(
        m.contains("clawmux_dedicated_total{outcome=\"connected\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn the_client_must_connect_within_the_deadline() {
    init_test_log();
    let h = start_with(mock_config(), |s| {
        s.limits.connect_timeout = Duration::from_millis(300)
    })
    .await;
    let mut c = dedicated(&h).await;
    assert_eq!(c.expect_close().await, (1008, "connect timeout".into()));
    // Its gateway connection is closed too: only the shared one remains.
    let gw = &h.gw;
    eventually("the dedicated gateway connection closes", || {
        gw.open_connections() == 1
    })
    .await;
}

#[tokio::test]
async fn the_first_frame_must_be_a_connect() {
    init_test_log();
    let h = start().await;
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    c.send_json(&json!({"type":"req","id":"h","method":"health"}))
        .await;
    assert_eq!(c.expect_close().await, (1008, "connect required".into()));
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    c.send_text("{not json").await;
    assert_eq!(c.expect_close().await, (1003, "invalid json".into()));
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    c.send_text(&"x".repeat(70 * 1024)).await;
    assert_eq!(c.expect_close().await.0, 1009);
}

#[tokio::test]
async fn the_shared_route_refuses_role_node_and_points_to_dedicated() {
    init_test_log();
    let h = start().await;
    let mut c = h.client().await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["role"] = json!("node");
    c.send_json(&frame).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "INVALID_REQUEST", "{res}");
    let message = res["error"]["message"].as_str().unwrap();
    assert!(message.contains("/ws/dedicated"), "{message}");
    let (code, reason) = c.expect_close().await;
    assert_eq!(code, 1008);
    assert!(reason.contains("/ws/dedicated"), "{reason}");
    // A node on the dedicated route reaches the gateway with its role.
    let mut node = dedicated(&h).await;
    node.recv_json().await;
    node.send_json(&frame).await;
    node.response("c1").await;
    assert_eq!(client_connects(&h.gw)[0]["role"], "node");
}

// ------------------------------------------------------------------
// A scripted gateway: records what each connection receives, and closes a
// connection on demand. It answers every connect `hello-ok` except from a
// client named "silent".

/// What the scripted gateway saw on one connection.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Connect(Value),
    Text(String),
    Closed(Option<(u16, String)>),
}

/// What a test asks of one scripted gateway connection.
#[derive(Debug)]
enum Control {
    /// Close with this code and reason.
    Close(u16, String),
    /// Send this many events of about this many bytes, as fast as the
    /// socket takes them.
    Blast(usize, usize),
    /// Drop the connection without a close frame (a crash).
    Drop,
}

/// Per connection: where to send its [`Control`]s.
type Closers = Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Control>>>>;

struct Scripted {
    url: String,
    seen: mpsc::UnboundedReceiver<(u64, Seen)>,
    closers: Closers,
    /// Connection index → the client id its connect named.
    names: HashMap<u64, String>,
}

fn hello_ok(id: &str, conn: u64) -> String {
    json!({"type":"res","id":id,"ok":true,"payload":{
        "type":"hello-ok","protocol":4,
        "server":{"version":"scripted","connId":format!("conn-{conn}")},
        "features":{"methods":["health"],"events":["tick"]},
        "snapshot":{"presence":[],"health":{},"stateVersion":{"presence":0,"health":0},"uptimeMs":0},
        "policy":{"maxPayload":26214400,"maxBufferedBytes":52428800,"tickIntervalMs":30000},
        "auth":{"role":"operator","scopes":["operator.read"]}}})
    .to_string()
}

impl Scripted {
    async fn start() -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}", listener.local_addr().unwrap());
        let (tx, seen) = mpsc::unbounded_channel();
        let closers: Closers = Arc::default();
        let registry = Arc::clone(&closers);
        tokio::spawn(async move {
            let mut next = 0u64;
            while let Ok((tcp, _)) = listener.accept().await {
                next += 1;
                let conn = next;
                let tx = tx.clone();
                let (close_tx, close_rx) = mpsc::unbounded_channel::<Control>();
                registry.lock().unwrap().insert(conn, close_tx);
                tokio::spawn(serve_scripted(tcp, conn, tx, close_rx));
            }
        });
        Scripted {
            url,
            seen,
            closers,
            names: HashMap::new(),
        }
    }

    /// The next thing a connection from a client named `client` saw.
    async fn next_from(&mut self, client: &str) -> (u64, Seen) {
        loop {
            let (conn, seen) = tokio::time::timeout(PATIENCE, self.seen.recv())
                .await
                .expect("the scripted gateway sees something in time")
                .expect("scripted gateway runs");
            if let Seen::Connect(p) = &seen {
                let name = p["client"]["id"].as_str().unwrap_or_default().to_owned();
                self.names.insert(conn, name);
            }
            if self.names.get(&conn).map(String::as_str) == Some(client) {
                return (conn, seen);
            }
        }
    }

    fn close(&self, conn: u64, code: u16, reason: &str) {
        let closers = self.closers.lock().unwrap();
        closers[&conn]
            .send(Control::Close(code, reason.into()))
            .unwrap();
    }
}

impl Scripted {
    fn drop_connection(&self, conn: u64) {
        let closers = self.closers.lock().unwrap();
        closers[&conn].send(Control::Drop).unwrap();
    }

    fn blast(&self, conn: u64, n: usize, bytes: usize) {
        let closers = self.closers.lock().unwrap();
        closers[&conn].send(Control::Blast(n, bytes)).unwrap();
    }
}

/// One scripted gateway connection: a reader that records what arrives,
/// and a writer task, so a blast that fills the socket never stops the
/// reader from seeing a close.
async fn serve_scripted(
    tcp: tokio::net::TcpStream,
    conn: u64,
    seen: mpsc::UnboundedSender<(u64, Seen)>,
    mut controls: mpsc::UnboundedReceiver<Control>,
) {
    let Ok(ws) = tokio_tungstenite::accept_async(tcp).await else {
        return;
    };
    let (mut sink, mut stream) = ws.split();
    let (out, mut out_rx) = mpsc::unbounded_channel::<Message>();
    tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            let last = matches!(m, Message::Close(_));
            if sink.send(m).await.is_err() || last {
                return;
            }
        }
    });
    let challenge = json!({"type":"event","event":"connect.challenge",
        "payload":{"nonce":format!("nonce-{conn}"),"ts":1}});
    let _ = out.send(Message::text(challenge.to_string()));
    loop {
        tokio::select! {
            msg = stream.next() => match msg {
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                    if v["method"] == "connect" {
                        let _ = seen.send((conn, Seen::Connect(v["params"].clone())));
                        if v["params"]["client"]["id"] != "silent" {
                            let id = v["id"].as_str().unwrap_or_default();
                            let _ = out.send(Message::text(hello_ok(id, conn)));
                        }
                    } else {
                        let _ = seen.send((conn, Seen::Text(t.as_str().to_owned())));
                    }
                }
                Some(Ok(Message::Close(f))) => {
                    let f = f.map(|f| (u16::from(f.code), f.reason.as_str().to_owned()));
                    let _ = seen.send((conn, Seen::Closed(f)));
                    return;
                }
                Some(Ok(_)) => {}
                _ => {
                    let _ = seen.send((conn, Seen::Closed(None)));
                    return;
                }
            },
            Some(control) = controls.recv() => match control {
                Control::Blast(n, bytes) => {
                    let event = json!({"type":"event","event":"blast",
                        "payload":{"pad":"x".repeat(bytes)}}).to_string();
                    for _ in 0..n {
                        let _ = out.send(Message::text(event.clone()));
                    }
                }
                Control::Drop => return,
                Control::Close(code, reason) => {
                    let frame = CloseFrame { code: CloseCode::from(code), reason: reason.into() };
                    let _ = out.send(Message::Close(Some(frame)));
                }
            },
        }
    }
}

async fn scripted_broker(
    tweak: impl FnOnce(&mut Settings),
) -> (Scripted, RunningBroker, tempfile::TempDir) {
    let gw = Scripted::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut settings = test_settings(dir.path(), &gw.url, Some("test-token"));
    tweak(&mut settings);
    let broker = RunningBroker::start(settings).await.unwrap();
    (gw, broker, dir)
}

/// A dedicated client connected through the scripted gateway, and its
/// gateway connection's index.
async fn connected_dedicated(gw: &mut Scripted, broker: &RunningBroker) -> (WsClient, u64) {
    let mut c = WsClient::open(broker.socket_path(), "/ws/dedicated").await;
    assert_eq!(c.recv_json().await["event"], "connect.challenge");
    c.send_json(&connect_frame("c1")).await;
    assert_eq!(c.response("c1").await["ok"], true);
    let (conn, seen) = gw.next_from("cli").await;
    assert!(matches!(seen, Seen::Connect(_)), "{seen:?}");
    (c, conn)
}

#[tokio::test]
async fn a_clients_close_reaches_the_gateway_with_its_code_and_reason() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|_| {}).await;
    let (mut c, _) = connected_dedicated(&mut gw, &broker).await;
    // Frames reach the gateway byte for byte.
    let raw = r#"{"type":"req", "id":"x1","method":"health" ,"params":{}}"#;
    c.send_text(raw).await;
    assert_eq!(gw.next_from("cli").await.1, Seen::Text(raw.into()));
    c.ws_mut()
        .close(Some(CloseFrame {
            code: CloseCode::from(4321),
            reason: "client says bye".into(),
        }))
        .await
        .unwrap();
    assert_eq!(
        gw.next_from("cli").await.1,
        Seen::Closed(Some((4321, "client says bye".into())))
    );
    // The client gets the close handshake completed.
    assert!(matches!(c.recv().await, Got::Close(4321, _) | Got::Eof));
}

#[tokio::test]
async fn a_gateway_close_reaches_the_client_with_its_code_and_reason() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|_| {}).await;
    let (mut c, conn) = connected_dedicated(&mut gw, &broker).await;
    gw.close(conn, 4002, "gateway says bye");
    assert_eq!(c.expect_close().await, (4002, "gateway says bye".into()));
    let socket = broker.socket_path().to_owned();
    wait_dedicated_open(&socket, 0, PATIENCE).await;
}

#[tokio::test]
async fn a_frame_over_the_limit_closes_both_sides_1009() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|s| s.limits.max_frame_bytes = 70 * 1024).await;
    let (mut c, _) = connected_dedicated(&mut gw, &broker).await;
    // Over the pre-connect limit is fine after the gateway's hello-ok ...
    let big =
        json!({"type":"req","id":"b","method":"health","params":{"pad":"x".repeat(66 * 1024)}});
    c.send_json(&big).await;
    assert!(matches!(gw.next_from("cli").await.1, Seen::Text(_)));
    // ... over max_frame_bytes is not.
    c.send_text(&"x".repeat(71 * 1024)).await;
    assert_eq!(c.expect_close().await, (1009, "frame too large".into()));
    assert_eq!(
        gw.next_from("cli").await.1,
        Seen::Closed(Some((1009, "frame too large".into())))
    );
}

#[tokio::test]
async fn a_gateway_that_never_answers_the_connect_is_studio_upstream_timeout() {
    init_test_log();
    let (mut gw, broker, _dir) =
        scripted_broker(|s| s.upstream.handshake_timeout = Duration::from_millis(500)).await;
    let mut c = WsClient::open(broker.socket_path(), "/ws/dedicated").await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["client"]["id"] = json!("silent");
    c.send_json(&frame).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.upstream_timeout", "{res}");
    assert_eq!(res["error"]["retryable"], true, "{res}");
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
    // The gateway connection is closed, not left behind.
    loop {
        if let (_, Seen::Closed(_)) = gw.next_from("silent").await {
            break;
        }
    }
}

#[tokio::test]
async fn a_gateway_that_closes_before_answering_is_studio_upstream_closed() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|_| {}).await;
    let mut c = WsClient::open(broker.socket_path(), "/ws/dedicated").await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["client"]["id"] = json!("silent");
    c.send_json(&frame).await;
    let (conn, _) = gw.next_from("silent").await;
    gw.close(conn, 1013, "gateway starting");
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.upstream_closed", "{res}");
    assert_eq!(res["error"]["retryable"], true, "{res}");
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
}

#[tokio::test]
async fn a_client_that_does_not_read_is_closed_and_its_gateway_connection_too() {
    init_test_log();
    let (mut gw, broker, _dir) =
        scripted_broker(|s| s.limits.slow_grace = Duration::from_millis(300)).await;
    let (c, conn) = connected_dedicated(&mut gw, &broker).await;
    // 16 MiB: more than the socket buffers between gateway and client hold.
    gw.blast(conn, 256, 64 * 1024);
    // The client reads nothing; the broker gives up on it and closes the
    // gateway side as a client that went away.
    assert_eq!(
        gw.next_from("cli").await.1,
        Seen::Closed(Some((1001, "going away".into())))
    );
    let socket = broker.socket_path().to_owned();
    // Closing a client that does not read may take the close lingers
    // (2 s each) on top.
    wait_dedicated_open(&socket, 0, PATIENCE * 2).await;
    drop(c);
}

#[tokio::test]
async fn a_gateway_frame_over_the_upstream_limit_closes_both_sides_1009() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|s| s.upstream.max_frame_bytes = 8 * 1024).await;
    let (mut c, conn) = connected_dedicated(&mut gw, &broker).await;
    gw.blast(conn, 1, 16 * 1024);
    assert_eq!(c.expect_close().await, (1009, "frame too large".into()));
    assert!(c.events.iter().all(|e| e["event"] != "blast"));
    assert_eq!(
        gw.next_from("cli").await.1,
        Seen::Closed(Some((1009, "frame too large".into())))
    );
}

#[tokio::test]
async fn a_client_that_vanishes_is_a_going_away_for_the_gateway() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|_| {}).await;
    let (c, _) = connected_dedicated(&mut gw, &broker).await;
    drop(c);
    assert_eq!(
        gw.next_from("cli").await.1,
        Seen::Closed(Some((1001, "going away".into())))
    );
}

#[tokio::test]
async fn a_stopping_broker_closes_both_sides_going_away() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|_| {}).await;
    let (mut c, _) = connected_dedicated(&mut gw, &broker).await;
    let stopping = tokio::spawn(broker.shutdown(Duration::from_secs(5)));
    assert_eq!(c.expect_close().await, (1001, "going away".into()));
    assert_eq!(
        gw.next_from("cli").await.1,
        Seen::Closed(Some((1001, "going away".into())))
    );
    assert!(stopping.await.unwrap(), "a clean shutdown");
}

#[tokio::test]
async fn a_gateway_that_vanishes_closes_the_client_1012() {
    init_test_log();
    let (mut gw, broker, _dir) = scripted_broker(|_| {}).await;
    let (mut c, conn) = connected_dedicated(&mut gw, &broker).await;
    gw.drop_connection(conn);
    assert_eq!(c.expect_close().await, (1012, "upstream closed".into()));
}

/// The route relays frames unchecked: a socket whose policy limits scopes
/// or methods does not serve it (it would hand out what the policy withholds).
#[tokio::test]
async fn a_restricted_policy_socket_refuses_the_dedicated_route() {
    use clawmux::policy::{Grant, MethodFilter, SocketPolicy};
    init_test_log();
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro.sock");
    let policy = SocketPolicy {
        name: "dashboard".into(),
        path: ro.clone(),
        mode: 0o600,
        uids: Vec::new(),
        gids: Vec::new(),
        scopes: Some(Grant::new(["operator.read"])),
        methods: MethodFilter::default(),
        observe: false,
    };
    let h = start_with(mock_config(), |s| s.sockets = vec![policy]).await;
    let upgrade = [
        ("connection", "Upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("sec-websocket-version", "13"),
    ];
    let (status, _, resp) =
        crate::http_api::request(&ro, "GET", "/ws/dedicated", &upgrade, b"").await;
    assert_eq!(status, 403);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["code"], "studio.forbidden", "{body}");
    assert!(client_connects(&h.gw).is_empty());
    // The main socket serves it.
    let mut c = dedicated(&h).await;
    assert_eq!(c.recv_json().await["event"], "connect.challenge");
}

/// A self-signed gateway certificate for `localhost` and its pin.
fn self_signed_localhost() -> (String, String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let pin = clawmux::upstream::tls::fingerprint_of(cert.der());
    let pin = clawmux::upstream::tls::normalize_fingerprint(&pin).unwrap();
    (cert.pem(), key.serialize_pem(), pin)
}

/// `wss://` works on the dedicated route as on the shared one: same trust
/// settings, same pin, same refusal when the certificate is not the pinned one.
#[tokio::test]
async fn a_tls_gateway_is_reached_with_the_shared_sessions_trust_and_pin() {
    init_test_log();
    let (pem, key_pem, pin) = self_signed_localhost();
    let cfg = MockConfig {
        tls: Some(clawmux_mock::tls_server_config(&pem, &key_pem).unwrap()),
        ..mock_config()
    };
    let h = start_with(cfg, |s| {
        s.gateway_url = s.gateway_url.replace("127.0.0.1", "localhost");
        s.tls.fingerprint = Some(pin);
    })
    .await;
    assert!(h.gw.url().starts_with("wss://"));
    let mut c = dedicated(&h).await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    assert_eq!(c.response("c1").await["ok"], true);
    assert_eq!(client_connects(&h.gw)[0]["auth"]["token"], "test-token");

    // Another certificate than the pinned one: refused before any connect.
    let (pem, key_pem, _) = self_signed_localhost();
    let (_, _, other_pin) = self_signed_localhost();
    let cfg = MockConfig {
        tls: Some(clawmux_mock::tls_server_config(&pem, &key_pem).unwrap()),
        ..mock_config()
    };
    let h = start_with(cfg, |s| {
        s.gateway_url = s.gateway_url.replace("127.0.0.1", "localhost");
        s.tls.fingerprint = Some(other_pin);
    })
    .await;
    let mut c = dedicated(&h).await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.upstream_error", "{res}");
    assert!(res["error"]["details"]["tls"].is_string(), "{res}");
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
    assert!(client_connects(&h.gw).is_empty());
}
