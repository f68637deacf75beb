//! The real binary's log: no filter directive reveals a secret (the
//! WebSocket library dumps whole frames at trace level, and frames carry
//! tokens), and a log nobody reads never holds up the broker.

use std::path::Path;
use std::process::Stdio;

use crate::support::*;
use base64::Engine as _;
use serde_json::{json, Value};

/// The host token the broker injects upstream (set through the
/// environment, so it is not on a command line the test could echo).
const HOST_TOKEN: &str = "tok-SECRET-7f3a9c";
/// A token a local client sends in its own `connect`.
const CLIENT_TOKEN: &str = "cli-SECRET-4be1d0";

/// Every way a secret's bytes could show up in a log: in clear, in hex
/// (tungstenite prints frame payloads as `0x…`), as a decimal byte list
/// (`Debug` of a byte vector), and in base64 at each of the three
/// alignments it could have inside a longer encoded text.
fn forms(secret: &str) -> Vec<String> {
    let bytes = secret.as_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let list = bytes
        .iter()
        .map(u8::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut forms = vec![secret.to_owned(), hex.clone(), hex.to_uppercase(), list];
    for engine in [
        base64::engine::general_purpose::STANDARD_NO_PAD,
        base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ] {
        for shift in 0..3 {
            let mut shifted = vec![0u8; shift];
            shifted.extend_from_slice(bytes);
            let encoded = engine.encode(&shifted);
            // Keep the characters that depend on the secret's bytes only.
            let start = if shift == 0 { 0 } else { 4 };
            forms.push(encoded[start..encoded.len() - 4].to_owned());
        }
    }
    forms
}

fn assert_no_secret(log: &str, name: &str, secret: &str) {
    for form in forms(secret) {
        assert!(
            !log.contains(&form),
            "the {name} appears in the log as {form:?}:\n{}",
            excerpt(log, &form)
        );
    }
}

/// The lines around the first `needle`, for a readable failure.
fn excerpt(log: &str, needle: &str) -> String {
    let at = log.find(needle).unwrap_or(0);
    let start = log[..at].rfind('\n').map_or(0, |i| i + 1);
    let end = log[at..].find('\n').map_or(log.len(), |i| at + i);
    log[start..end].chars().take(2000).collect()
}

/// Runs `clawmux serve` against the gateway double with `args`/`envs`; a
/// client sends its own token in its `connect` and another connects
/// plainly (so the upstream connect is sent), then the broker is stopped.
/// With `host_token` the broker has the gateway token; without, the
/// client's own token opens the upstream session (design §2). Returns
/// (stdout + stderr, the device token the broker stored).
async fn serve_and_collect_log(
    host_token: bool,
    args: &[&str],
    envs: &[(&str, &str)],
) -> (String, Option<String>) {
    let gw = MockGateway::start(MockConfig {
        token: Some(if host_token { HOST_TOKEN } else { CLIENT_TOKEN }.into()),
        ..MockConfig::default()
    })
    .await
    .expect("gateway double starts");
    let home = TestHome::new();
    let socket = home.path().join("c.sock");
    let out_path = home.path().join("stdout.log");
    let err_path = home.path().join("stderr.log");
    let mut cmd = home.clawmux();
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--gateway-url", &gw.url(), "--shutdown-timeout", "2"])
        .args(args)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    if host_token {
        cmd.env("CLAWMUX_GATEWAY_TOKEN", HOST_TOKEN);
    }
    let mut broker = ChildGuard(cmd.spawn().expect("clawmux starts"));
    eventually("the broker listens", || socket.exists()).await;

    let mut own = WsClient::open(&socket, "/ws").await;
    own.recv_json().await; // connect.challenge
    own.send_json(&connect_with_token("own-1")).await;
    let res = own.response("own-1").await;
    assert_eq!(res["ok"], true, "{res}");

    let mut plain = WsClient::open(&socket, "/ws").await;
    plain.handshake().await;
    assert_eq!(plain.request("health", json!({})).await["ok"], true);

    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());
    let log =
        std::fs::read_to_string(&out_path).unwrap() + &std::fs::read_to_string(&err_path).unwrap();
    (log, stored_device_token(&home.state_home()))
}

fn connect_with_token(id: &str) -> Value {
    let mut frame = connect_frame(id);
    frame["params"]["auth"] = json!({ "token": CLIENT_TOKEN });
    frame
}

/// The device token the gateway double minted and the broker kept.
fn stored_device_token(state_home: &Path) -> Option<String> {
    let text = std::fs::read_to_string(state_home.join("clawmux/device-tokens.json")).ok()?;
    let file: Value = serde_json::from_str(&text).ok()?;
    let gateways = file["gateways"].as_object()?;
    let token = gateways.values().next()?["token"].as_str()?;
    Some(token.to_owned())
}

async fn assert_log_keeps_secrets(host_token: bool, args: &[&str], envs: &[(&str, &str)]) {
    let (log, device_token) = serve_and_collect_log(host_token, args, envs).await;
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the filter took effect (debug or trace lines): {log}"
    );
    assert!(
        log.contains("clawmux stopped"),
        "the last line is flushed at exit: {log}"
    );
    assert_no_secret(&log, "host token", HOST_TOKEN);
    assert_no_secret(&log, "client's token", CLIENT_TOKEN);
    let device_token = device_token.expect("the gateway double minted a device token");
    assert_no_secret(&log, "device token", &device_token);
}

#[tokio::test]
async fn trace_everything_reveals_no_secret() {
    assert_log_keeps_secrets(true, &["--log", "trace"], &[]).await;
}

#[tokio::test]
async fn tracing_the_websocket_library_by_module_reveals_no_secret() {
    // More specific directives than any fixed `tungstenite=info` one.
    assert_log_keeps_secrets(
        true,
        &[
            "--log",
            "debug,tungstenite=trace,tungstenite::protocol=trace,tungstenite::protocol::frame=trace,tungstenite::handshake=trace,tokio_tungstenite=trace",
        ],
        &[],
    )
    .await;
}

#[tokio::test]
async fn trace_from_the_environment_reveals_no_secret() {
    assert_log_keeps_secrets(
        true,
        &[],
        &[
            ("CLAWMUX_LOG", "trace,tungstenite::protocol=trace"),
            ("RUST_LOG", "trace"),
        ],
    )
    .await;
}

#[tokio::test]
async fn a_client_credential_opening_the_session_is_not_logged() {
    assert_log_keeps_secrets(
        false,
        &[
            "--log",
            "trace,tokio_tungstenite=trace,tungstenite::protocol=trace",
        ],
        &[],
    )
    .await;
}

/// A broker whose stderr nobody reads (a stalled journald, a full pipe)
/// keeps serving: log lines are dropped, clients are not held up.
#[tokio::test]
async fn an_unread_log_never_blocks_the_broker() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = TestHome::new();
    let socket = home.path().join("c.sock");
    let mut cmd = home.clawmux();
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--gateway-url", &gw.url(), "--log", "trace"])
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // A pipe the test holds open and never reads: it fills at 64 KiB.
        .stderr(Stdio::piped());
    let _broker = ChildGuard(cmd.spawn().unwrap());
    eventually("the broker listens", || socket.exists()).await;
    let mut watcher = WsClient::open(&socket, "/ws").await;
    watcher.handshake().await;
    // Each client's arrival and departure logs a few lines: hundreds of
    // clients write far more than the pipe holds.
    for n in 0..CLIENTS {
        let mut c = WsClient::open(&socket, "/ws").await;
        c.handshake().await;
        if n % 50 == 0 {
            gw.broadcast("test.tick", json!({ "n": n }));
            assert_eq!(watcher.event("test.tick").await["payload"]["n"], n);
        }
        c.close().await;
    }
    gw.broadcast("test.done", json!({}));
    watcher.event("test.done").await;
}

/// Clients the unread-log test connects: enough lines to fill a pipe
/// several times over.
const CLIENTS: u64 = 400;

/// A gateway that is down costs a few log lines, not two per attempt: the
/// first failure, then a summary after 2, 4, 8… attempts.
#[tokio::test]
async fn an_outage_logs_state_changes_not_every_attempt() {
    let home = TestHome::new();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let conf = home.path().join(".config/clawmux");
    std::fs::create_dir_all(&conf).unwrap();
    std::fs::write(
        conf.join("config.toml"),
        "[upstream]\nbackoff_initial_ms = 5\nbackoff_max_ms = 10\n",
    )
    .unwrap();
    let socket = home.path().join("c.sock");
    let err_path = home.path().join("stderr.log");
    let mut cmd = home.clawmux();
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--gateway-url", &format!("ws://127.0.0.1:{port}")])
        .env("CLAWMUX_GATEWAY_TOKEN", "not-a-real-token")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap());
    let mut broker = ChildGuard(cmd.spawn().expect("clawmux starts"));
    let log = || std::fs::read_to_string(&err_path).unwrap_or_default();
    eventually("32 failed attempts", || {
        log().contains("still failing after 32 attempts")
    })
    .await;
    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());
    let log = log();
    let failures = log
        .lines()
        .filter(|l| l.contains("upstream connect"))
        .count();
    assert!(failures <= 7, "{failures} lines for 32 attempts:\n{log}");
    assert!(
        !log.contains("next upstream attempt scheduled"),
        "each attempt's schedule is not logged at info:\n{log}"
    );
}

/// A gateway's `server_version` (logged when the session is ready) carrying
/// SGR sequences that would hide (`ESC[8m`) or black out the rest of the
/// line reaches the log escaped: only the formatter's own styles are raw,
/// and with the log not on a terminal there are none .
#[tokio::test]
async fn a_gateways_colours_do_not_reach_the_log() {
    let gw = MockGateway::start(MockConfig {
        server_version: "2026.9.6\x1b[8m\x1b[30;40mhidden\x1b[0m".into(),
        ..mock_config()
    })
    .await
    .unwrap();
    let home = TestHome::new();
    let socket = home.path().join("c.sock");
    let err_path = home.path().join("stderr.log");
    let mut cmd = home.clawmux();
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--gateway-url", &gw.url()])
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap());
    let mut broker = ChildGuard(cmd.spawn().expect("clawmux starts"));
    let log = || std::fs::read_to_string(&err_path).unwrap_or_default();
    eventually("the session is ready", || {
        log().contains("upstream session ready")
    })
    .await;
    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());
    let log = log();
    assert!(!log.contains('\x1b'), "no raw escape:\n{log:?}");
    assert!(
        log.contains("server_version=2026.9.6\\e[8m\\e[30;40mhidden\\e[0m"),
        "shown escaped:\n{log}"
    );
}
