//! End-to-end tests of the gateway double through a real WebSocket client
//! (tokio-tungstenite over loopback TCP). Every wait is bounded.

mod handshake;
mod traffic;

use std::collections::VecDeque;
use std::time::Duration;

use base64::Engine as _;
use ed25519_dalek::{Signer as _, SigningKey};
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::{MockConfig, MockGateway};

/// Upper bound for any single wait in these tests.
pub(super) const WAIT: Duration = Duration::from_secs(3);

pub(super) const ALL_SCOPES: &[&str] = &[
    "operator.admin",
    "operator.read",
    "operator.write",
    "operator.approvals",
    "operator.pairing",
];

/// A config that keeps tests fast and deterministic: token auth, no ticks
/// during the test, quick scripted runs.
pub(super) fn fast_config() -> MockConfig {
    MockConfig {
        token: Some("secret".into()),
        run_step_delay: Duration::from_millis(1),
        ..MockConfig::default()
    }
}

/// Connect params of a broker-like client (gateway-client/backend keeps its
/// scopes without a device).
pub(super) fn params(token: Option<&str>) -> Value {
    let mut p = json!({
        "minProtocol": 3, "maxProtocol": 4,
        "client": {"id": "gateway-client", "displayName": "clawmux-test", "version": "0.1.0",
                   "platform": "linux", "mode": "backend", "instanceId": "t-1"},
        "role": "operator",
        "scopes": ALL_SCOPES,
        "caps": ["tool-events"],
        "locale": "en-US", "userAgent": "clawmux-test/0.1.0",
    });
    if let Some(t) = token {
        p["auth"] = json!({ "token": t });
    }
    p
}

/// What the server sent next.
#[derive(Debug)]
pub(super) enum Incoming {
    Json(Value),
    /// A close frame with code and reason.
    Close(u16, String),
    /// The stream ended or failed without a close frame.
    Gone,
}

pub(super) struct Client {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: u64,
    /// Frames read while looking for something else.
    backlog: VecDeque<Value>,
}

impl Client {
    pub(super) async fn open(gw: &MockGateway) -> Client {
        let (ws, _) = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(gw.url()))
            .await
            .expect("connect in time")
            .expect("websocket handshake");
        Client {
            ws,
            next_id: 0,
            backlog: VecDeque::new(),
        }
    }

    /// The next frame from the socket (not the backlog).
    pub(super) async fn recv(&mut self) -> Incoming {
        loop {
            let next = tokio::time::timeout(WAIT, self.ws.next())
                .await
                .expect("server frame in time");
            return match next {
                Some(Ok(Message::Text(t))) => {
                    Incoming::Json(serde_json::from_str(t.as_str()).expect("json frame"))
                }
                Some(Ok(Message::Close(Some(f)))) => {
                    Incoming::Close(f.code.into(), f.reason.to_string())
                }
                Some(Ok(Message::Close(None))) => Incoming::Close(1005, String::new()),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => Incoming::Gone,
            };
        }
    }

    pub(super) async fn recv_json(&mut self) -> Value {
        if let Some(v) = self.backlog.pop_front() {
            return v;
        }
        match self.recv().await {
            Incoming::Json(v) => v,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// Reads until the server closes; returns the close code and reason.
    /// Keeps reading afterwards so tungstenite sends the close reply, as a
    /// well-behaved client does.
    pub(super) async fn expect_close(&mut self) -> (u16, String) {
        loop {
            match self.recv().await {
                Incoming::Json(_) => continue,
                Incoming::Close(code, reason) => {
                    while let Ok(Some(Ok(_))) = tokio::time::timeout(WAIT, self.ws.next()).await {}
                    return (code, reason);
                }
                Incoming::Gone => panic!("socket ended without a close frame"),
            }
        }
    }

    pub(super) async fn send_text(&mut self, text: &str) {
        self.ws
            .send(Message::text(text.to_string()))
            .await
            .expect("send");
    }

    pub(super) async fn send_json(&mut self, v: &Value) {
        self.send_text(&v.to_string()).await;
    }

    /// Reads the challenge and returns its nonce.
    pub(super) async fn challenge(&mut self) -> String {
        let frame = self.recv_json().await;
        assert_eq!(frame["event"], "connect.challenge", "{frame}");
        frame["payload"]["nonce"]
            .as_str()
            .expect("nonce")
            .to_string()
    }

    /// Sends a request and returns its (first) response; events that arrive
    /// meanwhile stay in the backlog.
    pub(super) async fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = format!("t-{}", self.next_id);
        self.send_json(&json!({ "type": "req", "id": id, "method": method, "params": params }))
            .await;
        self.response(&id).await
    }

    /// Waits for the `res` with `id`, keeping other frames in the backlog.
    pub(super) async fn response(&mut self, id: &str) -> Value {
        if let Some(pos) = self
            .backlog
            .iter()
            .position(|f| f["type"] == "res" && f["id"] == id)
        {
            return self.backlog.remove(pos).expect("present");
        }
        loop {
            match self.recv().await {
                Incoming::Json(f) if f["type"] == "res" && f["id"] == id => return f,
                Incoming::Json(f) => self.backlog.push_back(f),
                other => panic!("expected res {id}, got {other:?}"),
            }
        }
    }

    /// The next event named `name`, skipping (and dropping) other frames.
    pub(super) async fn event(&mut self, name: &str) -> Value {
        loop {
            let f = self.recv_json().await;
            if f["type"] == "event" && f["event"] == name {
                return f;
            }
        }
    }
}

/// Opens a client and completes the handshake with `params`; returns the
/// client and the hello-ok response frame.
pub(super) async fn ready_client(gw: &MockGateway, params: Value) -> (Client, Value) {
    let mut c = Client::open(gw).await;
    c.challenge().await;
    let hello = c.request("connect", params).await;
    assert_eq!(hello["ok"], true, "{hello}");
    (c, hello)
}

/// An Ed25519 device identity signing connects the way the reference client does.
pub(super) struct Device {
    key: SigningKey,
}

impl Device {
    pub(super) fn generate() -> Device {
        Device {
            key: SigningKey::from_bytes(&rand::random()),
        }
    }

    pub(super) fn public_key(&self) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(self.key.verifying_key().to_bytes())
    }

    pub(super) fn id(&self) -> String {
        super::handshake::device_id_for_public_key(&self.key.verifying_key().to_bytes())
    }

    /// Adds a signed `device` block to `params` (v3 payload).
    pub(super) fn sign(&self, params: &mut Value, nonce: &str, signed_at: i64) {
        params["device"] = json!({ "id": self.id(), "publicKey": self.public_key(),
                                   "signature": "x", "signedAt": signed_at, "nonce": nonce });
        let s = |ptr: &str| {
            params
                .pointer(ptr)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let scopes: Vec<String> = params["scopes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let role = params["role"].as_str().unwrap_or("operator");
        let token = params
            .pointer("/auth/token")
            .or_else(|| params.pointer("/auth/deviceToken"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        // Built by hand (not with the code under test), like probe.mjs does.
        let payload = format!(
            "v3|{}|{}|{}|{role}|{}|{signed_at}|{token}|{nonce}|{}|{}",
            self.id(),
            s("/client/id"),
            s("/client/mode"),
            scopes.join(","),
            s("/client/platform").trim().to_ascii_lowercase(),
            s("/client/deviceFamily").trim().to_ascii_lowercase(),
        );
        let signature = self.key.sign(payload.as_bytes()).to_bytes();
        params["device"]["signature"] =
            json!(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signature));
    }
}

/// Callers spawn these futures and share the handle across tasks.
#[allow(dead_code)]
fn public_api_is_send_and_sync(gw: MockGateway) {
    fn send<T: Send>(_: &T) {}
    fn send_sync_clone<T: Send + Sync + Clone>() {}
    send_sync_clone::<MockGateway>();
    send(&MockGateway::start(MockConfig::default()));
    send(&gw.wait_ready_connections(1, WAIT));
    send(&gw.wait_request("x", WAIT));
    send(&gw.close_all(1000, ""));
    send(&gw.restart_notice(None));
    send(&gw.slow_consumer_close());
    send(&gw.clone().stop());
}
