//! The real binary: `serve` against `mock-gateway`, `--help`, SIGTERM.

mod support;

use std::process::{Command, Stdio};

use support::*;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

#[test]
fn help_explains_itself() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("serve") && text.contains("mock-gateway"),
        "{text}"
    );
    let out = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--socket",
        "--gateway-url",
        "--token-file",
        "--demo",
        "--no-device-identity",
        "--state-dir",
        "CLAWMUX_SOCKET",
    ] {
        assert!(text.contains(flag), "serve --help mentions {flag}: {text}");
    }
}

#[tokio::test]
async fn serve_binary_against_mock_gateway_binary() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut gw = ChildGuard(
        Command::new(BIN)
            .args([
                "mock-gateway",
                "--port",
                &port.to_string(),
                "--token",
                "bin-token",
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let mut broker = ChildGuard(
        Command::new(BIN)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(["--gateway-url", &format!("ws://127.0.0.1:{port}")])
            .env("CLAWMUX_GATEWAY_TOKEN", "bin-token")
            .env("XDG_STATE_HOME", dir.path().join("state"))
            .env("CLAWMUX_LOG", "trace")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    // The double may still be binding: the broker retries until connect_wait.
    let mut c = WsClient::open(&socket, "/ws").await;
    let hello = c.handshake().await;
    assert_eq!(hello["type"], "hello-ok");
    assert_eq!(c.request("health", serde_json::json!({})).await["ok"], true);
    sigterm(&broker.0);
    assert_eq!(
        c.expect_close().await.0,
        1001,
        "clients are told the broker is going away"
    );
    let status = wait_exit(&mut broker.0).await;
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
    assert!(!socket.exists(), "socket removed");
    let mut log = String::new();
    use std::io::Read;
    broker
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("upstream session ready"), "{log}");
    assert!(
        !log.contains("bin-token"),
        "the token never reaches the log, even at trace level"
    );
    // Device identity is on by default, in $XDG_STATE_HOME/clawmux, private.
    use std::os::unix::fs::MetadataExt;
    let state = dir.path().join("state/clawmux");
    assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o777, 0o700);
    for file in ["device.json", "device-tokens.json"] {
        let meta = std::fs::metadata(state.join(file)).expect("state file written");
        assert_eq!(meta.mode() & 0o777, 0o600, "{file}");
    }
    let tokens: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("device-tokens.json")).unwrap()).unwrap();
    let minted = tokens["gateways"][format!("ws://127.0.0.1:{port}")]["token"]
        .as_str()
        .expect("the minted device token is kept");
    assert!(
        !log.contains(minted),
        "the device token never reaches the log either"
    );
    sigterm(&gw.0);
    assert!(wait_exit(&mut gw.0).await.success());
}
