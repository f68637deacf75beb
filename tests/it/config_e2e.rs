//! Settings end to end: a broken file, client-supplied auth, SIGHUP reload,
//! and `clawmux doctor` — each through the real broker.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::support::*;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

/// The binary in a private home.
fn clawmux(home: &Path) -> Command {
    isolated_command(BIN, home)
}

/// Runs a command off the async runtime (the gateway double lives on it).
trait OutputAsync {
    async fn output_async(&mut self) -> std::process::Output;
}

impl OutputAsync for Command {
    async fn output_async(&mut self) -> std::process::Output {
        let mut cmd = std::mem::replace(self, Command::new("true"));
        tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap()
    }
}

fn sighup(child: &std::process::Child) {
    signal(child, rustix::process::Signal::HUP);
}

async fn refused(socket: &Path) -> serde_json::Value {
    let mut c = WsClient::open(socket, "/ws").await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(c.expect_close().await, (1011, "connect failed".into()));
    res["error"].clone()
}

/// A broken file clawmux only borrows (OpenClaw's, needed for the URL and
/// token) is served to clients as the reason; the broker keeps running. (A
/// broken config.toml of its own stops `serve` at start with exit 2:
/// `serve_messages::a_config_typo_stops_serve_at_start_with_exit_2`.)
#[tokio::test]
async fn a_broken_settings_file_is_reported_to_clients_and_the_broker_keeps_serving() {
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join(".openclaw/openclaw.json");
    std::fs::create_dir_all(cfg.parent().unwrap()).unwrap();
    std::fs::write(&cfg, "{\n  gateway: {\n    port: ,\n  },\n}\n").unwrap();
    let socket = home.path().join("c.sock");
    let _broker = ChildGuard(
        clawmux(home.path())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    let e = refused(&socket).await;
    assert_eq!(e["code"], "studio.settings_load_failed", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("openclaw.json"),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("line 3"), "{e}");
    assert_eq!(e["retryable"], false);
    let (status, body) = http_get(&socket, "/healthz").await;
    assert_eq!((status, body["upstream"].as_str()), (200, Some("rejected")));
}

#[tokio::test]
async fn the_first_clients_own_auth_opens_the_shared_session() {
    let h = start_with(mock_config(), |s| {
        s.token = None;
        s.upstream.device_identity = None;
    })
    .await;
    // Without any credential: token missing.
    let e = refused(&h.socket()).await;
    assert_eq!(e["code"], "studio.gateway_token_missing");
    // A wrong client token is refused and not kept.
    let mut bad = h.client().await;
    bad.recv_json().await;
    let mut frame = connect_frame("c-bad");
    frame["params"]["auth"] = json!({"token": "wrong"});
    bad.send_json(&frame).await;
    let res = bad.response("c-bad").await;
    assert_eq!(res["error"]["code"], "studio.upstream_rejected", "{res}");
    // The right one opens the session ...
    let mut first = h.client().await;
    first.recv_json().await;
    let mut frame = connect_frame("c-good");
    frame["params"]["auth"] = json!({"token": "test-token"});
    first.send_json(&frame).await;
    assert_eq!(first.response("c-good").await["ok"], true);
    // ... and later clients share it without auth.
    let (mut later, _) = h.connected().await;
    assert_eq!(later.request("health", json!({})).await["ok"], true);
    assert_eq!(h.gw.open_connections(), 1);
    let last = h.gw.connects().last().cloned().unwrap();
    assert_eq!(last["auth"]["token"], "test-token");
}

#[tokio::test]
async fn sighup_reloads_settings_without_disconnecting_clients() {
    let gw_a = MockGateway::start(mock_config()).await.unwrap();
    let gw_b = MockGateway::start(MockConfig {
        token: Some("token-b".into()),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join("clawmux.toml");
    let write = |url: &str, token: &str| {
        std::fs::write(&cfg, format!("[gateway]\nurl = \"{url}\"\ntoken = \"{token}\"\n[upstream]\ndevice_identity = false\n")).unwrap();
        std::fs::set_permissions(&cfg, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
    };
    write(&gw_a.url(), "test-token");
    let socket = home.path().join("c.sock");
    let log = home.path().join("broker.log");
    let broker = ChildGuard(
        clawmux(home.path())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--config")
            .arg(&cfg)
            .env("CLAWMUX_LOG", "trace")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    let mut c = WsClient::open(&socket, "/ws").await;
    c.handshake().await;
    // A broken file: the old settings keep running.
    std::fs::write(&cfg, "[gateway\n").unwrap();
    sighup(&broker.0);
    eventually("reload failure logged", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("settings reload failed")
    })
    .await;
    assert_eq!(c.request("health", json!({})).await["ok"], true);
    // A new gateway and token: the session moves, the client stays.
    write(&gw_b.url(), "token-b");
    sighup(&broker.0);
    let ready = loop {
        let e = c.event("clawmux.upstream").await;
        if e["payload"]["phase"] == "ready" {
            break e;
        }
    };
    assert!(ready["seq"].as_u64().is_some());
    assert_eq!(c.request("health", json!({})).await["ok"], true);
    assert_eq!(gw_b.ready_connections(), 1);
    assert!(gw_a.wait_no_connections(PATIENCE).await);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains("token-b") && !text.contains("test-token"),
        "no token in the trace log"
    );
    let (_, state) = http_get(&socket, "/v1/state").await;
    assert!(!state.to_string().contains("token-b"));
}

#[tokio::test]
async fn doctor_shows_sources_and_probes_the_gateway() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let out = clawmux(home.path())
        .args(["doctor", "--no-device-identity", "--gateway-url", &gw.url()])
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token")
        .output_async()
        .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("flag --gateway-url"), "{text}");
    assert!(text.contains("environment CLAWMUX_GATEWAY_TOKEN"), "{text}");
    assert!(text.contains("sha256:"), "{text}");
    assert!(
        !text.contains("test-token"),
        "the token is only fingerprinted: {text}"
    );
    assert!(text.contains("ok: server"), "{text}");
    // A gateway that is not there: the studio code and the fix, exit 1.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = clawmux(home.path())
        .args([
            "doctor",
            "--no-device-identity",
            "--token",
            "t",
            "--gateway-url",
            &format!("ws://127.0.0.1:{port}"),
        ])
        .output_async()
        .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("studio.upstream_error") && text.contains("openclaw gateway"),
        "{text}"
    );
    // A wrong token: rejected, with the gateway's detail code.
    let out = clawmux(home.path())
        .args([
            "doctor",
            "--no-device-identity",
            "--token",
            "wrong",
            "--gateway-url",
            &gw.url(),
        ])
        .output_async()
        .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text.contains("studio.upstream_rejected") && text.contains("AUTH_TOKEN_MISMATCH"),
        "{text}"
    );
}

/// The token file the README has you write (`~/.config/clawmux/gateway-token`)
/// is read by `doctor` with no flag; without it, doctor's advice names that
/// file and how to write it privately, not a plaintext key in config.toml.
#[tokio::test]
async fn doctor_reads_the_readme_token_file_and_names_it_when_missing() {
    use std::os::unix::fs::PermissionsExt;
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let doctor = || {
        let mut cmd = clawmux(home.path());
        cmd.args(["doctor", "--no-device-identity", "--gateway-url", &gw.url()])
            .env("NO_COLOR", "1");
        cmd
    };
    let out = doctor().output_async().await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("~/.config/clawmux/gateway-token") && text.contains("umask 077"),
        "the advice names the token file and a private way to write it: {text}"
    );
    assert!(
        !text.contains("set gateway.token"),
        "no plaintext token in config.toml proposed: {text}"
    );
    // The README's recipe, verbatim paths (XDG_CONFIG_HOME is <home>/config here).
    let file = home.path().join("config/clawmux/gateway-token");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, "test-token").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = doctor().output_async().await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("(from {})", file.display())),
        "the token's source is the file: {text}"
    );
    assert!(!text.contains("test-token"), "{text}");
}

/// A gateway's rejection message is not the user's text: control, C1 and
/// bidi characters in it reach the terminal only escaped, in the human
/// report and in `--json`, on stdout and on stderr.
#[tokio::test]
async fn doctor_shows_a_hostile_rejection_escaped() {
    let hostile = "no\x7f \u{9b}31m \u{202e}desrever\x1b]0;t\x07";
    let mut rejection = clawmux_mock::Rejection::token_mismatch();
    rejection.message = hostile.into();
    rejection.close_reason = hostile.into();
    rejection.details = Some(json!({"code": hostile}));
    let gw = MockGateway::start(mock_config()).await.unwrap();
    gw.set_faults(clawmux_mock::Faults {
        reject_connect: Some(rejection),
        ..Default::default()
    });
    let home = tempfile::tempdir().unwrap();
    for json in [false, true] {
        let mut cmd = clawmux(home.path());
        cmd.args(["doctor", "--no-device-identity", "--token", "t"])
            .args(["--gateway-url", &gw.url()])
            .env("NO_COLOR", "1");
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output_async().await;
        assert_eq!(out.status.code(), Some(1));
        for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            let text = String::from_utf8_lossy(bytes);
            let raw = text.chars().find(|&c| {
                (c.is_control() && c != '\n')
                    || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
            });
            assert_eq!(
                raw, None,
                "doctor (json: {json}) {name} printed {raw:?} raw: {text:?}"
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("desrever"),
            "the message is still shown: {text}"
        );
    }
}
