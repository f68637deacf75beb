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

/// Inodes of the TCP sockets in LISTEN state on this machine.
fn tcp_listen_inodes() -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st == 0A is LISTEN; column 9 is the inode.
            if cols.len() > 9 && cols[3] == "0A" {
                out.insert(cols[9].to_owned());
            }
        }
    }
    out
}

/// `serve --demo` runs its gateway double on a unix socket: the process
/// listens on no TCP port at all (the broker never listens on TCP).
#[tokio::test]
async fn demo_listens_on_no_tcp_port() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("demo.sock");
    let broker = ChildGuard(
        Command::new(BIN)
            .args(["serve", "--demo", "--socket"])
            .arg(&socket)
            .env("HOME", dir.path())
            .env("TMPDIR", dir.path())
            .env("XDG_STATE_HOME", dir.path().join("state"))
            .env("XDG_CONFIG_HOME", dir.path().join("config"))
            .env_remove("XDG_RUNTIME_DIR")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    let mut c = WsClient::open(&socket, "/ws").await;
    assert_eq!(c.handshake().await["type"], "hello-ok");
    assert_eq!(c.request("health", serde_json::json!({})).await["ok"], true);
    let listening = tcp_listen_inodes();
    let fds = std::fs::read_dir(format!("/proc/{}/fd", broker.0.id())).unwrap();
    for fd in fds.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        if let Some(inode) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
        {
            assert!(
                !listening.contains(inode),
                "the demo listens on a TCP socket (fd {:?})",
                fd.file_name()
            );
        }
    }
    let demo_dirs = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("clawmux-demo-"))
            .count()
    };
    assert_eq!(demo_dirs(), 1, "the double's socket lives in a private dir");
    drop(c);
    let mut broker = broker;
    sigterm(&broker.0);
    wait_exit(&mut broker.0).await;
    assert_eq!(demo_dirs(), 0, "removed at exit");
}
