//! The front ends people use, wired to the broker: discovery that never takes
//! the broker's own socket for the gateway, a configured self-URL refused,
//! `clawmux setup claw3d` and its undo, and Node's `ws` (what Claw3D's proxy
//! uses) reaching the broker with the URL form setup writes.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clawmux::settings::{resolve, Overrides, Source};
use clawmux_mock::MockGateway;
use serde_json::{json, Value};

use crate::home::Home;
use crate::support::*;

/// The broker's socket in such a home, and the overrides that name it.
impl Home {
    fn socket(&self) -> PathBuf {
        self.path().join("run/clawmux.sock")
    }
    fn over(&self) -> Overrides {
        Overrides {
            socket: Some(self.socket()),
            ..Overrides::default()
        }
    }
}

/// Every way a client writes the broker's socket as a URL.
fn self_url_forms(socket: &Path) -> Vec<String> {
    let s = socket.display().to_string();
    let dir = socket.parent().unwrap().display().to_string();
    let encoded = s.replace('/', "%2F");
    vec![
        format!("ws+unix://{s}:/ws"),
        format!("ws+unix://localhost{s}:/ws"),
        format!("ws+unix://localhost{s}:/api/gateway/ws"),
        format!("ws+unix://{s}"),
        format!("ws+unix://localhost{s}"),
        format!("ws+unix://{s}/:/ws"),
        format!("ws+unix://{dir}//./clawmux.sock:/ws"),
        format!("http+unix://{encoded}/ws"),
        format!("unix:{s}"),
    ]
}

#[test]
fn discovery_passes_over_claw3d_settings_naming_this_broker_in_every_url_form() {
    let home = Home::new();
    home.write(
        ".openclaw/openclaw.json",
        r#"{ gateway: { port: 1111, auth: { token: "oc-token" } } }"#,
    );
    for url in self_url_forms(&home.socket()) {
        home.write(
            ".openclaw/claw3d/settings.json",
            &json!({"gateway": {"url": url, "token": "placeholder"}}).to_string(),
        );
        let r = resolve(&home.over(), &home.env(&[])).unwrap();
        assert_eq!(r.settings.gateway_url, "ws://localhost:1111", "{url}");
        // The file's token was meant for the broker, not for the gateway.
        assert_eq!(
            r.settings.token.as_ref().map(|t| t.expose()),
            Some("oc-token"),
            "{url}"
        );
        assert_eq!(r.discovery.len(), 1, "{url}");
        assert!(
            r.discovery[0].starts_with("Claw3D's settings.json points at this broker")
                && r.discovery[0].contains("using openclaw.json"),
            "{url}: {}",
            r.discovery[0]
        );
        assert_eq!(r.settings.discovery, r.discovery);
    }
    // Without OpenClaw's config: the default, said so.
    std::fs::remove_file(home.path().join(".openclaw/openclaw.json")).unwrap();
    let r = resolve(&home.over(), &home.env(&[])).unwrap();
    assert_eq!(
        (r.settings.gateway_url.as_str(), &r.url_source),
        ("ws://localhost:18789", &Source::Default)
    );
    assert!(r.settings.token.is_none());
    assert!(
        r.discovery[0].ends_with("; using the default ws://localhost:18789"),
        "{}",
        r.discovery[0]
    );
}

#[test]
fn discovery_knows_every_socket_the_broker_serves_and_symlinks_to_them() {
    let home = Home::new();
    let extra = home.path().join("run/ro.sock");
    let config = home.write(
        "config.toml",
        &format!(
            "[[sockets]]\nname = \"ro\"\npath = \"{}\"\nscopes = [\"operator.read\"]\n",
            extra.display()
        ),
    );
    // A real socket behind a symlink, as a front end in a container might name it.
    std::fs::create_dir_all(extra.parent().unwrap()).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(&extra).unwrap();
    let link = home.path().join("link.sock");
    std::os::unix::fs::symlink(&extra, &link).unwrap();
    let over = Overrides {
        config: Some(config),
        ..home.over()
    };
    for url in [
        format!("ws+unix://localhost{}:/ws", extra.display()),
        format!("ws+unix://localhost{}:/ws", link.display()),
    ] {
        home.write(
            ".openclaw/claw3d/settings.json",
            &json!({"gateway": {"url": url}}).to_string(),
        );
        let r = resolve(&over, &home.env(&[])).unwrap();
        assert_eq!(r.settings.gateway_url, "ws://localhost:18789", "{url}");
        assert!(
            r.discovery[0].contains(&extra.display().to_string()),
            "{url}: {:?}",
            r.discovery
        );
    }
    // Another broker's socket is somebody else's: used (and fails as any
    // non-ws URL does, when the connector starts).
    home.write(
        ".openclaw/claw3d/settings.json",
        r#"{"gateway":{"url":"ws+unix://localhost/run/other.sock:/ws"}}"#,
    );
    let r = resolve(&over, &home.env(&[])).unwrap();
    assert_eq!(
        r.settings.gateway_url,
        "ws+unix://localhost/run/other.sock:/ws"
    );
    assert!(r.discovery.is_empty());
}

#[test]
fn an_openclaw_remote_url_naming_this_broker_falls_back_to_the_local_gateway() {
    let home = Home::new();
    let url = format!("ws+unix://localhost{}:/ws", home.socket().display());
    home.write(
        ".openclaw/openclaw.json",
        &json!({"gateway": {"mode": "remote", "port": 2222,
            "remote": {"url": url, "token": "remote-token"},
            "auth": {"token": "local-token"}}})
        .to_string(),
    );
    let r = resolve(&home.over(), &home.env(&[])).unwrap();
    assert_eq!(r.settings.gateway_url, "ws://localhost:2222");
    assert_eq!(
        r.settings.token.as_ref().map(|t| t.expose()),
        Some("local-token")
    );
    assert!(
        r.discovery[0].starts_with("OpenClaw's openclaw.json points at this broker"),
        "{:?}",
        r.discovery
    );
}

#[test]
fn a_configured_url_naming_this_broker_is_refused_with_the_socket_named() {
    let home = Home::new();
    let url = format!("ws+unix://localhost{}:/ws", home.socket().display());
    let config = home.write("config.toml", &format!("[gateway]\nurl = \"{url}\"\n"));
    for (over, env, source) in [
        (
            Overrides {
                gateway_url: Some(url.clone()),
                ..home.over()
            },
            home.env(&[]),
            "flag --gateway-url",
        ),
        (
            home.over(),
            home.env(&[("CLAWMUX_GATEWAY_URL", &url)]),
            "environment CLAWMUX_GATEWAY_URL",
        ),
        (
            Overrides {
                config: Some(config.clone()),
                ..home.over()
            },
            home.env(&[]),
            "config.toml",
        ),
    ] {
        let e = resolve(&over, &env).unwrap_err();
        assert_eq!(e.code, "studio.gateway_url_invalid", "{source}");
        assert!(
            e.message.contains(source)
                && e.message.contains(&format!(
                    "points at this broker's own socket {}",
                    home.socket().display()
                )),
            "{source}: {}",
            e.message
        );
    }
}

/// `serve` with its own socket as the gateway stops at start (exit 2) with
/// the sentence, and serves nothing.
#[tokio::test]
async fn serve_refuses_its_own_socket_as_the_gateway_at_start() {
    let home = tempfile::tempdir().unwrap();
    let socket = home.path().join("run/clawmux.sock");
    let url = format!("ws+unix://localhost{}:/ws", socket.display());
    let (code, _, stderr) = run_clawmux_in(
        home.path(),
        &["serve", "--gateway-url", &url, "--token", "t"],
        PATIENCE,
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("points at this broker's own socket")
            && stderr.contains("clawmux cannot be its own gateway"),
        "{stderr}"
    );
    assert!(!socket.exists());
}

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// `setup claw3d` writes Claw3D's settings (0600) with a backup beside it,
/// keeps the gateway it named in clawmux's own settings (the broker then
/// finds the real gateway with that file in place), and `--undo` puts
/// every byte back.
#[tokio::test]
async fn setup_claw3d_writes_backs_up_keeps_the_gateway_and_undoes() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let settings = home.path().join(".openclaw/claw3d/settings.json");
    std::fs::create_dir_all(settings.parent().unwrap()).unwrap();
    let original = json!({"gateway": {"url": gw.url(), "token": "test-token",
        "adapterType": "openclaw"}, "focused": {"x": 1}})
    .to_string();
    std::fs::write(&settings, &original).unwrap();
    std::fs::set_permissions(&settings, std::fs::Permissions::from_mode(0o644)).unwrap();
    let socket = home.path().join("run/clawmux.sock");

    // The preview changes nothing; without a terminal or --yes, neither does setup.
    let (code, out, _) =
        run_clawmux_in(home.path(), &["setup", "claw3d", "--dry-run"], PATIENCE).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("gateway.url") && out.contains("dry run"),
        "{out}"
    );
    assert!(
        !out.contains("test-token"),
        "the token is shown as a fingerprint: {out}"
    );
    let (code, _, err) = run_clawmux_in(home.path(), &["setup", "claw3d"], PATIENCE).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--yes"), "{err}");
    assert_eq!(std::fs::read_to_string(&settings).unwrap(), original);

    let (code, out, err) =
        run_clawmux_in(home.path(), &["setup", "claw3d", "--yes"], PATIENCE).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("test-token"), "{out}");
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&settings).unwrap()).unwrap();
    let claw3d_url = format!("ws+unix://localhost{}:/api/gateway/ws", socket.display());
    assert_eq!(written["gateway"]["url"], json!(claw3d_url));
    assert_eq!(written["gateway"]["adapterType"], "openclaw");
    assert_eq!(written["focused"], json!({"x": 1}));
    assert_eq!(mode_of(&settings), 0o600);
    let backup = home
        .path()
        .join(".openclaw/claw3d/settings.json.clawmux-backup");
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), original);
    assert_eq!(mode_of(&backup), 0o600);
    let config_dir = home.path().join("config/clawmux");
    let config = std::fs::read_to_string(config_dir.join("config.toml")).unwrap();
    assert!(
        config.contains(&format!("url = \"{}\"", gw.url())),
        "{config}"
    );
    assert!(!config.contains("test-token"), "{config}");
    let token_file = config_dir.join("gateway-token");
    assert_eq!(
        std::fs::read_to_string(&token_file).unwrap().trim(),
        "test-token"
    );
    assert_eq!(mode_of(&token_file), 0o600);
    let record = std::fs::read_to_string(config_dir.join("claw3d-setup.json")).unwrap();
    assert!(!record.contains("test-token"), "{record}");
    // A second setup says it is done already, and changes nothing.
    let before = std::fs::read(&settings).unwrap();
    let (code, out, _) = run_clawmux_in(home.path(), &["setup", "claw3d", "--yes"], PATIENCE).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("already points at this broker") && out.contains("--undo"),
        "{out}"
    );
    assert_eq!(std::fs::read(&settings).unwrap(), before);

    // With the file pointing at the broker, a zero-config broker finds the gateway.
    let log = home.path().join("serve.log");
    let _broker = ChildGuard(
        isolated_command(env!("CARGO_BIN_EXE_clawmux"), home.path())
            .args(["serve", "--no-device-identity"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_readyz(&socket, PATIENCE, &log).await;
    let (code, out, _) = run_clawmux_in(home.path(), &["doctor"], PATIENCE).await;
    assert!(
        out.contains(&format!(
            "Claw3D   {}: points at this broker ({})",
            settings.display(),
            socket.display()
        )),
        "{out}"
    );
    assert_eq!(code, 0, "{out}");

    let (code, out, err) =
        run_clawmux_in(home.path(), &["setup", "claw3d", "--undo"], PATIENCE).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(std::fs::read_to_string(&settings).unwrap(), original);
    for gone in [
        backup,
        token_file,
        config_dir.join("config.toml"),
        config_dir.join("claw3d-setup.json"),
    ] {
        assert!(!gone.exists(), "{} is left", gone.display());
    }
    let (code, _, err) =
        run_clawmux_in(home.path(), &["setup", "claw3d", "--undo"], PATIENCE).await;
    assert_eq!(code, 1);
    assert!(err.contains("nothing to undo"), "{err}");
}

/// Undo keeps what the user wrote in config.toml around setup's keys.
#[tokio::test]
async fn undo_leaves_the_rest_of_config_toml_alone() {
    let home = tempfile::tempdir().unwrap();
    let settings = home.path().join(".openclaw/claw3d/settings.json");
    std::fs::create_dir_all(settings.parent().unwrap()).unwrap();
    std::fs::write(
        &settings,
        r#"{"gateway":{"url":"wss://gw.example","token":"t0k"}}"#,
    )
    .unwrap();
    let config = home.path().join("config/clawmux/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    let mine = "# my limits\n[limits]\nmax_clients = 7\n";
    std::fs::write(&config, mine).unwrap();
    let (code, out, err) = run_clawmux_in(home.path(), &["setup", "claw3d", "-y"], PATIENCE).await;
    assert_eq!(code, 0, "{out}{err}");
    let during = std::fs::read_to_string(&config).unwrap();
    assert!(
        during.starts_with(mine) && during.contains("url = \"wss://gw.example\""),
        "{during}"
    );
    let (code, _, err) =
        run_clawmux_in(home.path(), &["setup", "claw3d", "--undo"], PATIENCE).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), mine);
}

/// Claw3D's proxy needs a token of its own: when its file has none and the
/// broker holds the credential, setup gives it a placeholder; a saved
/// profile for the same gateway follows the URL. Only what came from
/// Claw3D's file is recorded (here the URL; the token is config.toml's).
#[tokio::test]
async fn setup_gives_claw3d_a_placeholder_token_and_moves_its_profile() {
    let home = tempfile::tempdir().unwrap();
    let settings = home.path().join(".openclaw/claw3d/settings.json");
    std::fs::create_dir_all(settings.parent().unwrap()).unwrap();
    let original = json!({"gateway": {"url": "wss://gw.example", "token": "",
        "profiles": {"openclaw": {"url": "wss://gw.example", "token": ""},
                     "hermes": {"url": "ws://localhost:9999", "token": ""}}}})
    .to_string();
    std::fs::write(&settings, &original).unwrap();
    let config = home.path().join("config/clawmux/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(&config, "[gateway]\ntoken = \"cfg-token\"\n").unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (code, out, err) = run_clawmux_in(home.path(), &["setup", "claw3d", "-y"], PATIENCE).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("placeholder"), "{out}");
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&settings).unwrap()).unwrap();
    let url = written["gateway"]["url"].as_str().unwrap().to_owned();
    assert!(url.starts_with("ws+unix://localhost/"), "{written}");
    assert_eq!(
        written["gateway"]["token"],
        json!(clawmux::frontends::setup::PLACEHOLDER_TOKEN)
    );
    assert_eq!(
        written["gateway"]["profiles"]["openclaw"]["url"],
        json!(url)
    );
    assert_eq!(
        written["gateway"]["profiles"]["hermes"]["url"],
        "ws://localhost:9999"
    );
    let during = std::fs::read_to_string(&config).unwrap();
    assert!(
        during.contains("url = \"wss://gw.example\"") && !during.contains("token_file"),
        "{during}"
    );
    assert!(!home.path().join("config/clawmux/gateway-token").exists());
    let (code, _, err) =
        run_clawmux_in(home.path(), &["setup", "claw3d", "--undo"], PATIENCE).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read_to_string(&settings).unwrap(), original);
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "[gateway]\ntoken = \"cfg-token\"\n"
    );
}

/// `clawmux status` says which file discovery passed over and what it used.
#[tokio::test]
async fn status_says_when_claw3d_points_at_this_broker() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let socket = home.path().join("run/clawmux.sock");
    let port = gw.url().rsplit(':').next().unwrap().to_owned();
    let write = |rel: &str, text: String| {
        let p = home.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    };
    write(
        ".openclaw/claw3d/settings.json",
        json!({"gateway": {"url": format!("ws+unix://localhost{}:/ws", socket.display()), "token": "x"}})
            .to_string(),
    );
    write(
        ".openclaw/openclaw.json",
        format!("{{ gateway: {{ port: {port}, auth: {{ token: \"test-token\" }} }} }}"),
    );
    let log = home.path().join("serve.log");
    let _broker = ChildGuard(
        isolated_command(env!("CARGO_BIN_EXE_clawmux"), home.path())
            .args(["serve", "--no-device-identity"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_readyz(&socket, PATIENCE, &log).await;
    let (_, state) = http_get(&socket, "/v1/state").await;
    let note = state["upstream"]["discovery"][0]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        note.starts_with("Claw3D's settings.json points at this broker")
            && note.contains("using openclaw.json"),
        "{state}"
    );
    let (code, out, _) = run_clawmux_in(home.path(), &["status"], PATIENCE).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("discovery  {note}")), "{out}");
    let (_, out, _) = run_clawmux_in(home.path(), &["doctor"], PATIENCE).await;
    assert!(out.contains(&format!("  discovery    {note}")), "{out}");
    assert!(out.contains("OpenClaw /"), "{out}");
    assert!(
        out.contains("openclaw.json: points at the gateway (ws://localhost:"),
        "{out}"
    );
    assert_eq!(gw.connects()[0]["auth"]["token"], "test-token");
}

/// A Node program: connects with `ws` to `URL` (with `Origin` computed as
/// Claw3D's proxy computes it from the URL, gateway-proxy.js 124-133),
/// answers the challenge with `CONNECT`, sends a `health` request, and
/// prints both answers with the URL's hostname (what `isUpstreamAllowed`
/// and `isLocalGatewayUrl` check).
const NODE_CLIENT: &str = r#"
const { WebSocket } = require("ws");
const url = process.env.URL;
const u = new URL(url);
const hostname = ["127.0.0.1", "::1", "0.0.0.0"].includes(u.hostname) ? "localhost" : u.hostname;
const origin = `${u.protocol === "wss:" ? "https:" : "http:"}//${u.port ? hostname + ":" + u.port : hostname}`;
const ws = new WebSocket(url, { origin, handshakeTimeout: 5000 });
const timer = setTimeout(() => { console.error("no answer"); process.exit(3); }, Number(process.env.PATIENCE_MS));
let hello = null;
ws.on("message", (raw) => {
  const m = JSON.parse(String(raw));
  if (m.type === "event" && m.event === "connect.challenge") ws.send(process.env.CONNECT);
  if (m.type === "res" && !hello) {
    hello = m;
    if (!m.ok) { console.log(JSON.stringify(m)); process.exit(4); }
    ws.send(JSON.stringify({ type: "req", id: "h1", method: "health", params: {} }));
  } else if (m.type === "res" && m.id === "h1") {
    console.log(JSON.stringify({ hostname: u.hostname, origin, hello: hello.payload.type, health: m.ok }));
    clearTimeout(timer);
    ws.close();
  }
});
ws.on("error", (e) => { console.error(String(e)); process.exit(2); });
"#;

/// `NODE_PATH` with the `ws` the real gateway's install brings (where it
/// is installed), after the caller's own.
fn node_path() -> std::ffi::OsString {
    let peers = std::env::var_os("PEERS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/clawmux-peers"))
        });
    let mut paths: Vec<PathBuf> = std::env::var_os("NODE_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    paths.extend(peers.map(|p| p.join("openclaw/node_modules")));
    std::env::join_paths(paths).unwrap_or_default()
}

/// Runs [`NODE_CLIENT`] against `url` and returns what it printed.
async fn node_client(url: &str, patience: Duration) -> Value {
    let out = tokio::time::timeout(
        patience + Duration::from_secs(5),
        tokio::process::Command::new("node")
            .args(["-e", NODE_CLIENT])
            .env("NODE_PATH", node_path())
            .env("URL", url)
            .env("CONNECT", connect_frame("c1").to_string())
            .env("PATIENCE_MS", patience.as_millis().to_string())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("node finishes")
    .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{url}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

/// What [`NODE_CLIENT`] prints when all went well.
fn node_answer() -> Value {
    json!({"hostname": "localhost", "origin": "http://localhost", "hello": "hello-ok", "health": true})
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "node_ws"),
    ignore = "needs node with ws: run `source .ci/doc-tools.sh` first (CI does)"
)]
async fn node_ws_with_the_localhost_url_form_gets_hello_ok_on_both_routes() {
    let h = start().await;
    let socket = h.socket();
    for route in ["/ws", "/api/gateway/ws"] {
        let url = format!("ws+unix://localhost{}:{route}", socket.display());
        assert_eq!(node_client(&url, PATIENCE).await, node_answer(), "{url}");
    }
    // The URL setup writes is one of them.
    assert_eq!(
        clawmux::frontends::setup::claw3d_url(&socket).unwrap(),
        format!("ws+unix://localhost{}:/api/gateway/ws", socket.display())
    );
}

/// The same through the broker to a real OpenClaw gateway: the URL form
/// setup writes for Claw3D, and the Origin Claw3D's proxy sends with it.
#[tokio::test]
#[ignore = "needs a real OpenClaw gateway (~1 GB, installed from npm): run by .ci/interop"]
async fn node_ws_reaches_a_real_gateway_through_the_url_setup_writes() {
    use crate::real_gateway::*;
    if !peers_present("front_ends::node_ws_reaches_a_real_gateway_through_the_url_setup_writes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut gw = Gateway::start(port, dir.path().join("gateway.log"));
    gw.wait_ready(FIRST_START).await;
    let mut settings = broker_settings(dir.path(), port, TOKEN);
    settings.upstream.device_identity = None;
    let broker = clawmux::RunningBroker::start(settings).await.unwrap();
    let socket = broker.socket_path().to_owned();
    wait_phase(&socket, "ready", Duration::from_secs(60), &gw).await;
    let url = clawmux::frontends::setup::claw3d_url(&socket).unwrap();
    assert_eq!(
        node_client(&url, Duration::from_secs(30)).await,
        node_answer(),
        "{url}"
    );
    broker.shutdown(Duration::from_secs(5)).await;
    gw.stop().await;
}
