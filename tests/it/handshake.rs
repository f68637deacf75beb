//! Local connect enforcement and the synthesized hello-ok (design §2).

use std::time::Duration;

use crate::support::*;
use serde_json::json;

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
    c.close().await;
    // The broker answers with its close frame; a broker that did not would
    // end the connection bare after its 2 s linger on silent peers (EOF).
    match c.recv().await {
        Got::Close(..) => {}
        other => panic!("expected the broker's close reply, got {other:?}"),
    }
    eventually("client gone from the hub", || {
        h.broker.ctx().hub.client_count() == 0
    })
    .await;
}

/// A raw WebSocket over the broker's socket, for frames a WebSocket library
/// will not send (oversized announcements, invalid UTF-8).
mod raw {
    use std::path::Path;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    pub struct RawWs {
        pub stream: UnixStream,
        buf: Vec<u8>,
    }

    impl RawWs {
        /// Opens `/ws` and reads the `101` answer.
        pub async fn open(socket: &Path) -> RawWs {
            let mut stream = UnixStream::connect(socket).await.expect("socket accepts");
            stream
                .write_all(
                    b"GET /ws HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
                      Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
                )
                .await
                .unwrap();
            let mut ws = RawWs {
                stream,
                buf: Vec::new(),
            };
            loop {
                if let Some(end) = ws.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    assert!(
                        ws.buf.starts_with(b"HTTP/1.1 101"),
                        "{:?}",
                        String::from_utf8_lossy(&ws.buf)
                    );
                    ws.buf.drain(..end + 4);
                    return ws;
                }
                ws.fill().await;
            }
        }

        async fn fill(&mut self) {
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the broker closed the socket without a close frame");
            self.buf.extend_from_slice(&chunk[..n]);
        }

        /// Writes a masked text frame header announcing `len` payload bytes.
        pub async fn header(&mut self, len: u64) {
            let mut h = vec![0x81u8, 0x80 | 127];
            h.extend_from_slice(&len.to_be_bytes());
            h.extend_from_slice(&[0, 0, 0, 0]); // mask key 0: payload as is
            self.stream.write_all(&h).await.unwrap();
        }

        /// Writes one whole masked text frame (mask key 0).
        pub async fn frame(&mut self, payload: &[u8]) {
            self.header(payload.len() as u64).await;
            self.stream.write_all(payload).await.unwrap();
        }

        /// Reads server frames until a close frame; returns its code and reason.
        pub async fn close_frame(&mut self) -> (u16, String) {
            loop {
                while self.buf.len() < 2 {
                    self.fill().await;
                }
                let (op, len7) = (self.buf[0] & 0x0f, (self.buf[1] & 0x7f) as usize);
                let (len, at) = match len7 {
                    126 => {
                        while self.buf.len() < 4 {
                            self.fill().await;
                        }
                        (u16::from_be_bytes([self.buf[2], self.buf[3]]) as usize, 4)
                    }
                    127 => {
                        while self.buf.len() < 10 {
                            self.fill().await;
                        }
                        (
                            u64::from_be_bytes(self.buf[2..10].try_into().unwrap()) as usize,
                            10,
                        )
                    }
                    n => (n, 2),
                };
                while self.buf.len() < at + len {
                    self.fill().await;
                }
                let payload: Vec<u8> = self.buf[at..at + len].to_vec();
                self.buf.drain(..at + len);
                if op == 0x8 {
                    let code = u16::from_be_bytes([payload[0], payload[1]]);
                    return (code, String::from_utf8_lossy(&payload[2..]).into_owned());
                }
            }
        }
    }
}

/// Before `connect` the broker reads at most `preconnect_max_bytes` (plus
/// frame headers) and closes `1009` at once; it no longer buffers a first
/// frame up to `max_frame_bytes` while waiting for the rest.
#[tokio::test]
async fn an_oversized_first_frame_is_refused_before_it_is_buffered() {
    let h = start_with(mock_config(), |s| {
        s.limits.connect_timeout = Duration::from_secs(30);
    })
    .await;
    let mut ws = raw::RawWs::open(&h.socket()).await;
    ws.header(20 << 20).await;
    use tokio::io::AsyncWriteExt;
    ws.stream.write_all(&vec![b' '; 100 * 1024]).await.unwrap();
    let (code, reason) = tokio::time::timeout(PATIENCE, ws.close_frame())
        .await
        .expect("closed at once, not at the connect timeout");
    assert_eq!((code, reason.as_str()), (1009, "frame too large"));
}

/// Invalid UTF-8 in a text frame closes `1007` (RFC 6455 §7.4.1), not
/// `1000` with an empty reason.
#[tokio::test]
async fn invalid_utf8_closes_1007() {
    let h = start().await;
    let mut ws = raw::RawWs::open(&h.socket()).await;
    ws.frame(b"{\"type\":\"req\",\"id\":\"\xff\xfe\"}").await;
    let (code, _) = tokio::time::timeout(PATIENCE, ws.close_frame())
        .await
        .expect("a close frame");
    assert_eq!(code, 1007);
}

/// A connect nested deeper than the parser allows is named as such.
#[tokio::test]
async fn a_too_deeply_nested_connect_says_so() {
    let h = start().await;
    let mut c = h.client().await;
    c.recv_json().await; // challenge
    let deep = format!(
        r#"{{"type":"req","id":"c","method":"connect","params":{{"minProtocol":3,"maxProtocol":4,"x":{}1{}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    c.send_text(&deep).await;
    assert_eq!(
        c.expect_close().await,
        (1003, "too deeply nested".to_owned())
    );
}

/// Clients still in their handshake are capped: one more is closed `1013`
/// at once, and a slot frees when one of them connects.
#[tokio::test]
async fn concurrent_handshakes_are_capped() {
    let h = start().await;
    let mut waiting = Vec::new();
    for _ in 0..clawmux::context::MAX_HANDSHAKES {
        let mut c = h.client().await;
        assert_eq!(c.recv_json().await["event"], "connect.challenge");
        waiting.push(c);
    }
    let mut over = h.client().await;
    let (code, reason) = over.expect_close().await;
    assert_eq!(code, 1013, "{reason}");
    // One of the waiting clients connects: its slot is free again.
    let mut first = waiting.swap_remove(0);
    first.send_json(&connect_frame("c1")).await;
    assert_eq!(first.response("c1").await["ok"], true);
    let mut next = h.client().await;
    assert_eq!(next.recv_json().await["event"], "connect.challenge");
}

/// A client's close is answered with the same code, as the gateway does
/// (Node `ws` and Python `websockets` otherwise report 1006).
#[tokio::test]
async fn a_clients_close_is_echoed() {
    let h = start().await;
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::protocol::CloseFrame;
    use tokio_tungstenite::tungstenite::Message;
    let (mut c, _) = h.connected().await;
    c.ws_mut()
        .send(Message::Close(Some(CloseFrame {
            code: 1000.into(),
            reason: "bye".into(),
        })))
        .await
        .unwrap();
    loop {
        match c.recv().await {
            Got::Json(_) => continue,
            Got::Close(code, _) => {
                assert_eq!(code, 1000);
                break;
            }
            Got::Eof => panic!("the broker dropped the connection without answering the close"),
        }
    }
}

/// A `null` payload passes through as `null`, not as an absent field.
#[tokio::test]
async fn a_null_payload_is_kept() {
    let h = start().await;
    let (mut c, _) = h.connected().await;
    c.send_json(&serde_json::json!({"type":"req","id":"hb","method":"last-heartbeat","params":{}}))
        .await;
    let res = c.response("hb").await;
    assert_eq!(res["ok"], true, "{res}");
    assert!(
        res.as_object().unwrap().contains_key("payload"),
        "payload:null must be present: {res}"
    );
    assert!(res["payload"].is_null());
}

/// What belongs to the gateway passes through the handshake: the extra
/// fields of its challenge, and `hello-ok.auth` fields such as `method`
/// (never the broker's device token).
#[tokio::test]
async fn gateway_handshake_fields_pass_through() {
    let cfg = MockConfig {
        challenge_extra: Some(json!({"capabilities": ["demo-cap"]})),
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let (_first, hello) = h.connected().await;
    assert_eq!(hello["auth"]["method"], "token", "{}", hello["auth"]);
    assert!(
        hello["auth"].get("deviceToken").is_none(),
        "{}",
        hello["auth"]
    );
    let mut c = h.client().await;
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge");
    assert_eq!(
        challenge["payload"]["capabilities"],
        json!(["demo-cap"]),
        "{challenge}"
    );
    assert!(challenge["payload"]["nonce"].is_string());
}
