//! Shared test support: the gateway double (from the library, so tests,
//! `clawmux mock-gateway` and `--demo` share one faithful implementation),
//! a broker started on a temporary socket, and a WebSocket client over that
//! socket. Every wait is bounded.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

pub use clawmux::{RunningBroker, Settings};
pub use clawmux_mock::{Faults, MockConfig, MockGateway};

/// Patience for anything a test waits on.
pub const PATIENCE: Duration = Duration::from_secs(5);

/// A broker on a temp socket in front of a gateway double.
pub struct Harness {
    pub gw: MockGateway,
    pub broker: RunningBroker,
    pub dir: tempfile::TempDir,
}

impl Harness {
    pub fn socket(&self) -> PathBuf {
        self.broker.socket_path().to_owned()
    }

    pub async fn client(&self) -> WsClient {
        WsClient::open(&self.socket(), "/ws").await
    }

    /// A client that has completed the handshake, and its hello-ok payload.
    pub async fn connected(&self) -> (WsClient, Value) {
        let mut c = self.client().await;
        let hello = c.handshake().await;
        (c, hello)
    }

    /// Like [`connected`](Self::connected), asking for these scopes only.
    pub async fn connected_as(&self, scopes: &[&str]) -> (WsClient, Value) {
        let mut c = self.client().await;
        let mut frame = connect_frame("connect-1");
        frame["params"]["scopes"] = json!(scopes);
        c.send_json(&frame).await;
        let res = c.response("connect-1").await;
        assert_eq!(res["ok"], true, "connect failed: {res}");
        (c, res["payload"].clone())
    }
}

pub fn mock_config() -> MockConfig {
    MockConfig {
        token: Some("test-token".into()),
        ..MockConfig::default()
    }
}

/// Settings tuned for tests: a temp socket, fast retries, short waits.
pub fn test_settings(dir: &Path, gateway_url: &str, token: Option<&str>) -> Settings {
    let mut s = Settings::new(dir.join("clawmux.sock"));
    s.gateway_url = gateway_url.into();
    s.token = token.map(clawmux::config::Secret::new);
    s.upstream.backoff_initial = Duration::from_millis(20);
    s.upstream.backoff_max = Duration::from_millis(200);
    s.upstream.handshake_timeout = Duration::from_secs(2);
    s.limits.connect_wait = Duration::from_secs(3);
    // Never the real home: the device key and tokens live in the test's dir.
    s.upstream.device_identity = Some(dir.join("state"));
    s
}

pub async fn start_with(cfg: MockConfig, tweak: impl FnOnce(&mut Settings)) -> Harness {
    start_faulty(cfg, Faults::default(), tweak).await
}

/// Like [`start_with`], with the double's faults set before the broker connects.
pub async fn start_faulty(
    cfg: MockConfig,
    faults: Faults,
    tweak: impl FnOnce(&mut Settings),
) -> Harness {
    let gw = MockGateway::start(cfg)
        .await
        .expect("gateway double starts");
    gw.set_faults(faults);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    tweak(&mut settings);
    let broker = RunningBroker::start(settings).await.expect("broker starts");
    Harness { gw, broker, dir }
}

pub async fn start() -> Harness {
    start_with(mock_config(), |_| {}).await
}

/// Starts a broker without a gateway double (for settings errors).
pub async fn broker_only(tweak: impl FnOnce(&mut Settings)) -> (RunningBroker, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut settings = test_settings(dir.path(), "ws://127.0.0.1:9", Some("test-token"));
    tweak(&mut settings);
    let broker = RunningBroker::start(settings).await.expect("broker starts");
    (broker, dir)
}

/// `CLAWMUX_TEST_LOG=debug cargo test …` shows the broker's log for a failing test.
pub fn init_test_log() {
    if let Ok(filter) = std::env::var("CLAWMUX_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}

/// What a client read from the socket.
#[derive(Debug)]
pub enum Got {
    Json(Value),
    Close(u16, String),
    Eof,
}

/// A WebSocket client over the broker's unix socket.
pub struct WsClient {
    ws: WebSocketStream<UnixStream>,
    /// Events read while waiting for something else, in order.
    pub events: Vec<Value>,
    next_id: u64,
}

/// The scopes the test clients ask for: every operator scope, as the
/// openclaw CLI and Claw3D do (a narrower client is built by the test).
pub const FULL_SCOPES: [&str; 5] = [
    "operator.admin",
    "operator.read",
    "operator.write",
    "operator.approvals",
    "operator.pairing",
];

pub fn connect_frame(id: &str) -> Value {
    json!({"type":"req","id":id,"method":"connect","params":{
        "minProtocol":3,"maxProtocol":4,
        "client":{"id":"cli","version":"test","platform":"linux","mode":"cli"},
        "role":"operator","scopes":FULL_SCOPES,"caps":["tool-events"]}})
}

impl WsClient {
    pub async fn open(socket: &Path, path: &str) -> WsClient {
        Self::open_with_headers(socket, path, &[]).await
    }

    /// [`WsClient::open`] with these headers on the upgrade request (an
    /// `Origin`, as a browser sends).
    pub async fn open_with_headers(
        socket: &Path,
        path: &str,
        headers: &[(&str, &str)],
    ) -> WsClient {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
        let stream = tokio::time::timeout(PATIENCE, UnixStream::connect(socket))
            .await
            .expect("connect in time")
            .expect("socket accepts");
        let mut request = format!("ws://localhost{path}")
            .into_client_request()
            .expect("a request");
        for (name, value) in headers {
            request.headers_mut().insert(
                http::HeaderName::from_bytes(name.as_bytes()).expect("a header name"),
                http::HeaderValue::from_str(value).expect("a header value"),
            );
        }
        let (ws, _) = tokio::time::timeout(
            PATIENCE,
            // Accept frames up to what hello-ok advertises (maxPayload,
            // 25 MiB), as a real gateway client does; tungstenite's default
            // frame cap is 16 MiB.
            tokio_tungstenite::client_async_with_config(
                request,
                stream,
                Some(
                    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
                        .max_frame_size(Some(64 << 20))
                        .max_message_size(Some(64 << 20)),
                ),
            ),
        )
        .await
        .expect("upgrade in time")
        .expect("upgrade succeeds");
        WsClient {
            ws,
            events: Vec::new(),
            next_id: 0,
        }
    }

    /// The WebSocket itself, for frames the helpers do not send.
    pub fn ws_mut(&mut self) -> &mut WebSocketStream<UnixStream> {
        &mut self.ws
    }

    /// Starts a clean close from the client side.
    pub async fn close(&mut self) {
        self.ws.close(None).await.expect("close");
    }

    /// The socket under the WebSocket, to write bytes no client library
    /// would (half a frame).
    pub fn raw(&mut self) -> &mut UnixStream {
        self.ws.get_mut()
    }

    pub async fn send_text(&mut self, text: &str) {
        self.ws.send(Message::text(text)).await.expect("send");
    }

    /// [`WsClient::send_json`] that reports a failure instead of panicking.
    pub async fn try_send_json(
        &mut self,
        v: &Value,
    ) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        self.ws.send(Message::text(v.to_string())).await
    }

    pub async fn send_json(&mut self, v: &Value) {
        self.send_text(&v.to_string()).await;
    }

    pub async fn recv(&mut self) -> Got {
        self.recv_within(PATIENCE)
            .await
            .expect("a frame within the patience window")
    }

    /// Like [`recv`](Self::recv) with a chosen patience; `None` when
    /// nothing arrived in time (for waits longer than [`PATIENCE`], such as
    /// a real gateway's 30 s ticks).
    /// The next text message as it came, unparsed (for frames too large
    /// to parse quickly in a debug build); `None` if none came in `wait`
    /// or the connection ended.
    pub async fn recv_text_within(&mut self, wait: Duration) -> Option<String> {
        loop {
            let msg = tokio::time::timeout(wait, self.ws.next()).await.ok()?;
            match msg {
                Some(Ok(Message::Text(t))) => return Some(t.as_str().to_owned()),
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return None,
                Some(Ok(_)) => continue,
            }
        }
    }

    pub async fn recv_within(&mut self, wait: Duration) -> Option<Got> {
        loop {
            let msg = tokio::time::timeout(wait, self.ws.next()).await.ok()?;
            return Some(match msg {
                Some(Ok(Message::Text(t))) => {
                    Got::Json(serde_json::from_str(t.as_str()).expect("broker sends JSON"))
                }
                Some(Ok(Message::Close(f))) => match f {
                    Some(f) => Got::Close(u16::from(f.code), f.reason.as_str().to_owned()),
                    None => Got::Close(1005, String::new()),
                },
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => Got::Eof,
            });
        }
    }

    /// Waits up to `wait` for an event named `name` (kept-aside events first).
    pub async fn event_within(&mut self, name: &str, wait: Duration) -> Value {
        if let Some(i) = self.events.iter().position(|e| e["event"] == name) {
            return self.events.remove(i);
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv_within(left).await {
                Some(Got::Json(v)) if v["type"] == "event" && v["event"] == name => return v,
                Some(Got::Json(v)) => self.events.push(v),
                other => panic!("no {name} event within {wait:?}: {other:?}"),
            }
        }
    }

    pub async fn recv_json(&mut self) -> Value {
        match self.recv().await {
            Got::Json(v) => v,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// Reads until the close frame, skipping other frames; returns (code, reason).
    pub async fn expect_close(&mut self) -> (u16, String) {
        loop {
            match self.recv().await {
                Got::Json(v) => self.events.push(v),
                Got::Close(c, r) => return (c, r),
                Got::Eof => panic!("connection ended without a close frame"),
            }
        }
    }

    /// Reads the challenge, sends `connect`, returns the hello-ok payload.
    pub async fn handshake(&mut self) -> Value {
        let challenge = self.recv_json().await;
        assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
        self.send_json(&connect_frame("connect-1")).await;
        let res = self.response("connect-1").await;
        assert_eq!(res["ok"], true, "connect failed: {res}");
        res["payload"].clone()
    }

    /// Reads until the `res` with `id`, keeping other frames aside (and
    /// looking among those first).
    pub async fn response(&mut self, id: &str) -> Value {
        self.response_within(id, PATIENCE).await
    }

    /// [`response`](Self::response) with a chosen patience for each frame
    /// (an answer a real gateway takes longer for: a file of megabytes).
    pub async fn response_within(&mut self, id: &str, wait: Duration) -> Value {
        if let Some(i) = self
            .events
            .iter()
            .position(|v| v["type"] == "res" && v["id"] == id)
        {
            return self.events.remove(i);
        }
        loop {
            let v = match self.recv_within(wait).await {
                Some(Got::Json(v)) => v,
                other => panic!("expected the answer {id} within {wait:?}, got {other:?}"),
            };
            if v["type"] == "res" && v["id"] == id {
                return v;
            }
            self.events.push(v);
        }
    }

    /// Sends a request with a fresh id and returns its response frame.
    pub async fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = format!("r{}", self.next_id);
        self.send_json(&json!({"type":"req","id":id,"method":method,"params":params}))
            .await;
        self.response(&id).await
    }

    /// The next event of any name (kept-aside events first).
    pub async fn event_any(&mut self) -> Value {
        if let Some(i) = self.events.iter().position(|e| e["type"] == "event") {
            return self.events.remove(i);
        }
        loop {
            let v = self.recv_json().await;
            if v["type"] == "event" {
                return v;
            }
            self.events.push(v);
        }
    }

    /// Waits for an event named `name` (looking at kept-aside events first).
    pub async fn event(&mut self, name: &str) -> Value {
        if let Some(i) = self.events.iter().position(|e| e["event"] == name) {
            return self.events.remove(i);
        }
        loop {
            let v = self.recv_json().await;
            if v["type"] == "event" && v["event"] == name {
                return v;
            }
            self.events.push(v);
        }
    }
}

/// How often [`eventually`] and [`eventually_async`] look again.
pub const POLL_EVERY: Duration = Duration::from_millis(5);

/// Puts an executable copy of `src` at `dest` (replacing it), made by
/// `install(1)` in a child process, never by this one: a file this
/// multithreaded test process wrote itself cannot be executed while a
/// child that another test forked meanwhile still holds the descriptor it
/// was written through (`ETXTBSY`, "Text file busy").
pub fn install_executable(src: &Path, dest: &Path) {
    let status = std::process::Command::new("install")
        .args(["-m", "755"])
        .arg(src)
        .arg(dest)
        .status()
        .expect("install(1) runs");
    assert!(
        status.success(),
        "install {} {}",
        src.display(),
        dest.display()
    );
}

/// Puts an executable script at `dest` (see [`install_executable`]).
pub fn install_script(dest: &Path, script: &str) {
    let text = dest.with_extension("text");
    std::fs::write(&text, script).unwrap();
    install_executable(&text, dest);
}

/// Polls a condition until true or the patience runs out (for state that has
/// no event to await, like a connection count the double updates).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    eventually_async(what, || {
        let done = cond();
        async move {
            if done {
                Ok(())
            } else {
                Err("not yet")
            }
        }
    })
    .await
}

/// Polls an async probe (an HTTP request, a file read) until it gives
/// `Ok(value)`, within [`PATIENCE`]: for state that has no event to await.
/// `Err(seen)` means "not yet"; the last one seen is in the failure message.
pub async fn eventually_async<T, S, F, Fut>(what: &str, probe: F) -> T
where
    S: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, S>>,
{
    eventually_within(what, PATIENCE, probe).await
}

/// [`eventually_async`] with a chosen patience (for a child process that
/// first has to start).
pub async fn eventually_within<T, S, F, Fut>(what: &str, patience: Duration, mut probe: F) -> T
where
    S: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, S>>,
{
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(seen) => assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for: {what} (last seen: {seen})"
            ),
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// A plain HTTP GET over the unix socket: (status, body as JSON).
pub async fn http_get(socket: &Path, path: &str) -> (u16, Value) {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;
    let stream = UnixStream::connect(socket).await.expect("socket accepts");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("http handshake");
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", "localhost")
        .body(Empty::<bytes::Bytes>::new())
        .expect("request");
    let resp = tokio::time::timeout(PATIENCE, sender.send_request(req))
        .await
        .expect("answer in time")
        .expect("http response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Kills a child process when dropped, so a failing test leaves nothing running.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends `sig` to a child process.
pub fn signal(child: &std::process::Child, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("pid");
    rustix::process::kill_process(pid, sig).expect("signal");
}

pub fn sigterm(child: &std::process::Child) {
    signal(child, rustix::process::Signal::TERM);
}

/// Waits (bounded) for a child process to exit.
pub async fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "process did not exit in time"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `program` (the clawmux binary, or a shell that execs it) with a private
/// HOME and XDG dirs under `home`, and nothing inherited from the test
/// runner that could point it at a real gateway, config, socket or systemd.
pub fn isolated_command(program: &str, home: &Path) -> std::process::Command {
    for dir in ["config", "state", "run"] {
        let dir = home.join(dir);
        std::fs::create_dir_all(&dir).expect("temp XDG dir");
        let private = std::os::unix::fs::PermissionsExt::from_mode(0o700);
        std::fs::set_permissions(&dir, private).expect("temp XDG dir mode");
    }
    let mut cmd = std::process::Command::new(program);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("XDG_STATE_HOME", home.join("state"))
        .env("XDG_RUNTIME_DIR", home.join("run"))
        .stdin(std::process::Stdio::null());
    cmd
}

/// Runs the clawmux binary to completion in a private home (a fresh temp
/// dir: never the caller's HOME, socket or settings), without colour:
/// (exit code, stdout, stderr). Bounded by [`PATIENCE`].
pub async fn run_clawmux(args: &[&str]) -> (i32, String, String) {
    let home = tempfile::tempdir().expect("temp home");
    run_clawmux_in(home.path(), args, PATIENCE).await
}

/// [`run_clawmux`] in the private home `home` (files the command reads
/// live there), killed if it has not ended `within`.
pub async fn run_clawmux_in(home: &Path, args: &[&str], within: Duration) -> (i32, String, String) {
    let mut cmd =
        tokio::process::Command::from(isolated_command(env!("CARGO_BIN_EXE_clawmux"), home));
    cmd.args(args).env("NO_COLOR", "1").kill_on_drop(true);
    let out = tokio::time::timeout(within, cmd.output())
        .await
        .expect("the command finishes in time")
        .expect("the binary runs");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Starts the clawmux binary in a private home (a fresh temp dir, returned
/// to be kept as long as the child runs) with `env` added and its output
/// piped; killed when dropped.
pub fn spawn_clawmux(
    args: &[&str],
    env: &[(&str, &str)],
) -> (tokio::process::Child, tempfile::TempDir) {
    let home = tempfile::tempdir().expect("temp home");
    let child =
        tokio::process::Command::from(isolated_command(env!("CARGO_BIN_EXE_clawmux"), home.path()))
            .args(args)
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("clawmux starts");
    (child, home)
}

/// Waits until a broker answers `/readyz` 200 on `socket`, at most
/// `within`; on failure shows its `log`.
pub async fn wait_readyz(socket: &Path, within: Duration, log: &Path) {
    let deadline = tokio::time::Instant::now() + within;
    while !(socket.exists() && http_get(socket, "/readyz").await.0 == 200) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the broker never got ready on {}: {}",
            socket.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A private home for a spawned binary: `HOME` and every XDG directory point
/// inside a temp dir, and the caller's `CLAWMUX_*`/`OPENCLAW_*`/`RUST_LOG`
/// settings are removed, so a test never reads or writes the real user's
/// files (state dir, config, socket) nor picks up their settings.
pub struct TestHome {
    pub dir: tempfile::TempDir,
}

impl TestHome {
    pub fn new() -> TestHome {
        let dir = tempfile::tempdir().expect("temp home");
        for sub in [".config", ".local/state", ".cache", "run"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("xdg dir");
        }
        std::fs::set_permissions(
            dir.path().join("run"),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .expect("runtime dir mode");
        TestHome { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `XDG_STATE_HOME`: the broker's device key lands in `<this>/clawmux`.
    pub fn state_home(&self) -> PathBuf {
        self.path().join(".local/state")
    }

    /// Points `cmd` at this home (see the type's docs).
    pub fn apply<'a>(&self, cmd: &'a mut std::process::Command) -> &'a mut std::process::Command {
        for (key, _) in std::env::vars_os() {
            let name = key.to_string_lossy();
            if name.starts_with("CLAWMUX_") || name.starts_with("OPENCLAW_") || name == "RUST_LOG" {
                cmd.env_remove(&key);
            }
        }
        let home = self.path();
        cmd.env("HOME", home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_STATE_HOME", self.state_home())
            .env("XDG_CACHE_HOME", home.join(".cache"))
            .env("XDG_RUNTIME_DIR", home.join("run"))
    }

    /// `clawmux` (the binary under test) with this home.
    pub fn clawmux(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_clawmux"));
        self.apply(&mut cmd);
        cmd
    }
}
