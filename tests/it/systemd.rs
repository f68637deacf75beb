//! The real binary under systemd's protocols: socket activation (fd passing
//! as systemd does it, and with `systemd-socket-activate` when installed),
//! `READY=1`/`STATUS=`/`WATCHDOG=1`/`STOPPING=1` on a test `NOTIFY_SOCKET`,
//! shutdown with a client that never reads, exit codes, and the token from
//! `LoadCredential=`. The unit files themselves: `tests/it/install_service.rs`.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::support::*;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

/// A fresh directory under one temp dir for this test binary, to be a
/// spawned broker's HOME (its device key and tokens land there).
fn private_home() -> std::path::PathBuf {
    static BASE: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let base = BASE.get_or_init(|| tempfile::tempdir().expect("temp base"));
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let home = base.path().join(format!("home-{n}"));
    std::fs::create_dir_all(&home).expect("temp home");
    home
}

/// The binary with none of the test runner's own systemd variables (the
/// runner itself might run under systemd).
fn clawmux_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    // Never the real home: a private HOME and XDG dirs per command.
    let home = private_home();
    cmd.env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("XDG_STATE_HOME", home.join("state"))
        .env_remove("CLAWMUX_CONFIG");
    for var in [
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "CREDENTIALS_DIRECTORY",
        "CLAWMUX_SOCKET",
        "CLAWMUX_GATEWAY_TOKEN",
        "CLAWMUX_GATEWAY_TOKEN_FILE",
        "CLAWMUX_GATEWAY_URL",
    ] {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

/// `clawmux serve` with `fd` passed as fd 3, the way systemd passes a
/// socket: `LISTEN_FDS=1`, `LISTEN_FDNAMES`, and `LISTEN_PID` set to the
/// binary's own pid (by a shell that then `exec`s it, keeping its pid).
fn activated_command(fd: RawFd, args: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut cmd = clawmux_command("/bin/sh");
    cmd.arg("-c")
        .arg(r#"LISTEN_PID=$$ exec "$0" "$@""#)
        .arg(BIN)
        .arg("serve")
        .args(args)
        .env("LISTEN_FDS", "1")
        .env("LISTEN_FDNAMES", "clawmux.socket")
        .envs(envs.iter().copied());
    // SAFETY: the closure runs in the forked child before exec and only calls
    // dup2/fcntl, which are async-signal-safe; it allocates nothing and
    // touches no lock. dup2 clears close-on-exec on fd 3; if the socket is
    // fd 3 already, clearing the flag is all that is needed.
    unsafe {
        cmd.pre_exec(move || {
            let rc = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// A `NOTIFY_SOCKET` the test reads, as systemd would.
struct NotifySocket {
    sock: tokio::net::UnixDatagram,
    path: PathBuf,
    /// Every line received so far, in order.
    lines: Vec<String>,
}

impl NotifySocket {
    fn bind(dir: &Path) -> NotifySocket {
        let path = dir.join("notify");
        let sock = tokio::net::UnixDatagram::bind(&path).expect("bind notify socket");
        NotifySocket {
            sock,
            path,
            lines: Vec::new(),
        }
    }

    fn env(&self) -> (&'static str, &str) {
        (
            "NOTIFY_SOCKET",
            self.path.to_str().expect("utf-8 temp path"),
        )
    }

    /// Reads datagrams until one holds a line matching `want`; returns that line.
    async fn wait_for(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        loop {
            let mut buf = vec![0u8; 4096];
            let n = tokio::time::timeout(PATIENCE, self.sock.recv(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("no {what} within the patience; got {:?}", self.lines))
                .expect("recv");
            let text = String::from_utf8(buf[..n].to_vec()).expect("utf-8 notification");
            let mut found = None;
            for line in text.lines() {
                self.lines.push(line.to_owned());
                if found.is_none() && want(line) {
                    found = Some(line.to_owned());
                }
            }
            if let Some(line) = found {
                return line;
            }
        }
    }
}

fn private_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    dir
}

/// `clawmux serve --socket SOCKET` reporting to `notify`.
fn serve_command(socket: &Path, notify: &NotifySocket) -> Command {
    let mut cmd = clawmux_command(BIN);
    cmd.arg("serve")
        .arg("--socket")
        .arg(socket)
        .env(notify.env().0, notify.env().1);
    cmd
}

/// Spawns the broker and waits for its `READY=1`.
async fn spawn_ready(cmd: &mut Command, notify: &mut NotifySocket) -> ChildGuard {
    let broker = ChildGuard(cmd.spawn().unwrap());
    notify.wait_for("READY=1", |l| l == "READY=1").await;
    broker
}

#[tokio::test]
async fn socket_activation_serves_on_the_passed_socket_and_never_unlinks_it() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let socket = dir.path().join("activated.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let mut notify = NotifySocket::bind(dir.path());
    let unused = dir.path().join("unused.sock");
    let url = gw.url();
    let mut broker = ChildGuard(
        activated_command(
            listener.as_raw_fd(),
            &["--gateway-url", &url, "--shutdown-timeout", "3"],
            &[
                notify.env(),
                ("CLAWMUX_GATEWAY_TOKEN", "test-token"),
                // Ignored: the socket systemd passes wins over the configured path.
                ("CLAWMUX_SOCKET", unused.to_str().unwrap()),
            ],
        )
        .spawn()
        .unwrap(),
    );
    notify.wait_for("READY=1", |l| l == "READY=1").await;
    let mut c = WsClient::open(&socket, "/ws").await;
    c.handshake().await;
    assert_eq!(c.request("health", json!({})).await["ok"], true);
    sigterm(&broker.0);
    let shutdown = c.event("shutdown").await;
    assert_eq!(shutdown["payload"]["reason"], "clawmux stopping");
    assert_eq!(c.expect_close().await.0, 1001);
    assert!(wait_exit(&mut broker.0).await.success());
    assert!(socket.exists(), "the socket systemd owns is left in place");
    assert!(!unused.exists(), "no socket of its own was created");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "no lock or temp files: {leftovers:?}");
    // systemd's listener still queues connections for the next start.
    std::os::unix::net::UnixStream::connect(&socket).expect("the listener is still open");
}

/// Policy sockets come from systemd too, matched by name
/// (`FileDescriptorName=` = the `[[sockets]]` entry's `name`): the broker
/// serves each with its policy and unlinks neither.
#[tokio::test]
async fn socket_activation_passes_policy_sockets_by_name() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let main = dir.path().join("main.sock");
    let ro = dir.path().join("ro.sock");
    let main_l = std::os::unix::net::UnixListener::bind(&main).unwrap();
    let ro_l = std::os::unix::net::UnixListener::bind(&ro).unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[[sockets]]\nname = \"dashboard\"\npath = \"{}\"\nscopes = [\"operator.read\"]\n",
            dir.path().join("configured-but-passed.sock").display()
        ),
    )
    .unwrap();
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = clawmux_command("/bin/sh");
    let (a, b) = (main_l.as_raw_fd(), ro_l.as_raw_fd());
    cmd.arg("-c")
        .arg(r#"LISTEN_PID=$$ exec "$0" "$@""#)
        .arg(BIN)
        .args(["serve", "--gateway-url", &gw.url(), "--config"])
        .arg(&config)
        .env("LISTEN_FDS", "2")
        .env("LISTEN_FDNAMES", "clawmux.socket:dashboard")
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token")
        .env(notify.env().0, notify.env().1);
    // SAFETY: as in `activated_command`: only dup2/fcntl between fork and
    // exec. The two sockets are moved out of the way first (to 100, 101) so
    // neither is overwritten while the other is being placed at 3 or 4.
    unsafe {
        cmd.pre_exec(move || {
            for (from, to) in [(a, 100), (b, 101), (100, 3), (101, 4)] {
                if libc::dup2(from, to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut broker = ChildGuard(cmd.spawn().unwrap());
    notify.wait_for("READY=1", |l| l == "READY=1").await;
    let mut c = WsClient::open(&ro, "/ws").await;
    let hello = c.handshake().await;
    assert_eq!(hello["auth"]["scopes"], json!(["operator.read"]), "{hello}");
    let mut m = WsClient::open(&main, "/ws").await;
    let hello = m.handshake().await;
    assert!(hello["auth"]["scopes"]
        .as_array()
        .unwrap()
        .contains(&json!("operator.admin")));
    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());
    assert!(main.exists() && ro.exists(), "sockets systemd owns stay");
    assert!(!dir.path().join("configured-but-passed.sock").exists());
}

#[tokio::test]
#[ignore = "needs systemd-socket-activate: bash .ci/systemd-tools.sh, then cargo test --test it -- --ignored systemd:: (.ci/run does)"]
async fn systemd_socket_activate_starts_the_broker_on_first_connection() {
    let tool = which("systemd-socket-activate")
        .expect("systemd-socket-activate is installed (bash .ci/systemd-tools.sh)");
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let socket = dir.path().join("sa.sock");
    let mut cmd = clawmux_command(tool.to_str().unwrap());
    cmd.arg("-l")
        .arg(&socket)
        .arg("--fdname=clawmux.socket")
        // The tool passes the child only a few variables, plus these.
        .arg("--setenv=CLAWMUX_GATEWAY_TOKEN=test-token")
        .args([BIN, "serve", "--gateway-url", &gw.url()]);
    let mut broker = ChildGuard(cmd.spawn().unwrap());
    // Listening, not only bound: the file exists from `bind`, and a
    // connect before `listen` is refused.
    eventually("systemd-socket-activate listens", || listening(&socket)).await;
    // The first connection makes the tool exec clawmux with the socket.
    let mut c = WsClient::open(&socket, "/ws").await;
    assert_eq!(c.handshake().await["type"], "hello-ok");
    sigterm(&broker.0); // the tool exec'd clawmux in its own process
    assert_eq!(c.expect_close().await.0, 1001);
    assert!(wait_exit(&mut broker.0).await.success());
    assert!(socket.exists(), "clawmux did not unlink the tool's socket");
}

/// Whether a unix socket is bound at `path` and listening (the kernel's
/// table, `/proc/net/unix`: its `Flags` field has `__SO_ACCEPTCON`), seen
/// without connecting to it.
fn listening(path: &Path) -> bool {
    const ACCEPTING: u32 = 0x0001_0000;
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    let path = path.to_string_lossy();
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() >= 8
            && fields[7] == path
            && u32::from_str_radix(fields[3], 16).is_ok_and(|flags| flags & ACCEPTING != 0)
    })
}

fn which(program: &str) -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .ok_or(())
}

#[tokio::test]
async fn notify_protocol_ready_status_watchdog_stopping() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let socket = dir.path().join("c.sock");
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = serve_command(&socket, &notify);
    cmd.args(["--gateway-url", &gw.url()])
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token")
        .env("WATCHDOG_USEC", "200000");
    let mut broker = spawn_ready(&mut cmd, &mut notify).await;
    assert_eq!(notify.lines[0], "READY=1", "READY=1 comes first");
    assert!(
        notify.lines.iter().any(|l| l.starts_with("STATUS=")),
        "a status goes with READY=1: {:?}",
        notify.lines
    );
    // Listening when READY=1 is sent: a connect succeeds at once.
    std::os::unix::net::UnixStream::connect(&socket).expect("listening at READY=1");
    notify
        .wait_for("ready status", |l| {
            l.starts_with("STATUS=upstream ready") && l.ends_with("0 clients")
        })
        .await;
    let (mut c, _) = {
        let mut c = WsClient::open(&socket, "/ws").await;
        let hello = c.handshake().await;
        (c, hello)
    };
    notify
        .wait_for("client count", |l| l.ends_with("; 1 client"))
        .await;
    for n in 0..2 {
        notify
            .wait_for(&format!("watchdog ping {n}"), |l| l == "WATCHDOG=1")
            .await;
    }
    sigterm(&broker.0);
    notify.wait_for("STOPPING=1", |l| l == "STOPPING=1").await;
    assert_eq!(c.expect_close().await.0, 1001);
    assert!(wait_exit(&mut broker.0).await.success());
    assert!(!socket.exists(), "its own socket is removed");
}

#[tokio::test]
async fn ready_does_not_wait_for_the_gateway() {
    // A "gateway" that accepts TCP but never speaks: the upstream handshake hangs.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("ws://{}", silent.local_addr().unwrap());
    let dir = private_dir();
    let socket = dir.path().join("c.sock");
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = serve_command(&socket, &notify);
    cmd.args(["--gateway-url", &url])
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token");
    let mut broker = spawn_ready(&mut cmd, &mut notify).await;
    let status = notify
        .lines
        .iter()
        .find(|l| l.starts_with("STATUS="))
        .cloned()
        .expect("a status with READY=1");
    assert!(!status.contains("ready"), "{status}");
    let (code, body) = http_get(&socket, "/healthz").await;
    assert_eq!(code, 200);
    assert_ne!(body["upstream"], "ready", "{body}");
    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());
}

/// The broker's send buffer per client in the flood tests (set, so that
/// what fills first is this figure, not the machine's default).
const FLOOD_SEND_BUFFER: usize = 16 * 1024;

/// A config file in `dir` setting [`FLOOD_SEND_BUFFER`].
fn flood_config(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("flood.toml");
    std::fs::write(
        &path,
        format!("[limits]\nsend_buffer_bytes = {FLOOD_SEND_BUFFER}\n"),
    )
    .unwrap();
    path
}

/// Events of 64 KiB, 2 MiB more than the broker's socket to a client holds
/// (its send buffer is set: [`flood_config`]; the kernel doubles it) and
/// far less than the 8 MiB a client may have queued: a client that does
/// not read has its writer blocked, and is not yet closed as a slow
/// consumer. Returns the reader's highest seq so far.
async fn flood(gw: &MockGateway, reader: &mut WsClient) -> u64 {
    let blob = "x".repeat(64 * 1024);
    let count = (2 * FLOOD_SEND_BUFFER + (2 << 20)).div_ceil(64 * 1024);
    for n in 0..count {
        gw.broadcast("test.big", json!({"n": n, "blob": blob}));
    }
    let mut last = 0;
    for n in 0..count {
        let e = reader.event("test.big").await;
        assert_eq!(e["payload"]["n"], n);
        last = e["seq"].as_u64().expect("events carry seq");
    }
    let others = reader.events.drain(..).filter_map(|e| e["seq"].as_u64());
    others.fold(last, u64::max)
}

/// A stop never waits for a client that is not reading: with a deadline
/// of a minute, the broker leaves the stuck client as soon as its socket
/// takes nothing more, and exits cleanly (the reading client gets its
/// `shutdown` event and its close).
#[tokio::test]
async fn sigterm_with_a_client_that_never_reads_does_not_wait_for_it() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let socket = dir.path().join("c.sock");
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = serve_command(&socket, &notify);
    cmd.args(["--gateway-url", &gw.url(), "--shutdown-timeout", "60"])
        .arg("--config")
        .arg(flood_config(dir.path()))
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token")
        .stderr(Stdio::piped());
    let mut broker = spawn_ready(&mut cmd, &mut notify).await;
    let (mut reader, _) = {
        let mut c = WsClient::open(&socket, "/ws").await;
        let hello = c.handshake().await;
        (c, hello)
    };
    let mut stuck = WsClient::open(&socket, "/ws").await;
    stuck.handshake().await;
    // From here on `stuck` never reads again.
    let last_seq = flood(&gw, &mut reader).await;
    sigterm(&broker.0);
    let shutdown = reader.event("shutdown").await;
    assert_eq!(shutdown["payload"], json!({"reason": "clawmux stopping"}));
    let before = reader.events.iter().filter_map(|e| e["seq"].as_u64());
    assert_eq!(
        shutdown["seq"].as_u64(),
        Some(before.fold(last_seq, u64::max) + 1),
        "the shutdown event takes the client's next seq"
    );
    assert_eq!(reader.expect_close().await, (1001, "going away".into()));
    // Within the test's patience, far inside the minute's deadline: the
    // stop did not wait for the stuck client.
    let status = wait_exit(&mut broker.0).await;
    assert!(status.success(), "a clean stop: {status:?}");
    let mut log = String::new();
    std::io::Read::read_to_string(&mut broker.0.stderr.take().unwrap(), &mut log).unwrap();
    assert!(!log.contains("shutdown deadline reached"), "{log}");
    assert!(
        log.contains("not waiting for a client that is not reading"),
        "{log}"
    );
    assert!(gw.wait_no_connections(PATIENCE).await, "upstream closed");
    drop(stuck);
}

#[tokio::test]
async fn a_second_signal_during_shutdown_forces_exit_3() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let socket = dir.path().join("c.sock");
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = serve_command(&socket, &notify);
    cmd.args(["--gateway-url", &gw.url(), "--shutdown-timeout", "60"])
        .arg("--config")
        .arg(flood_config(dir.path()))
        .env("CLAWMUX_GATEWAY_TOKEN", "test-token");
    let mut broker = spawn_ready(&mut cmd, &mut notify).await;
    let mut reader = WsClient::open(&socket, "/ws").await;
    reader.handshake().await;
    let mut stuck = WsClient::open(&socket, "/ws").await;
    stuck.handshake().await;
    flood(&gw, &mut reader).await;
    // A client that reads, a byte at a time, holds the stop for its close
    // linger (2 s): its socket keeps taking bytes.
    let trickle = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut byte = [0u8; 1];
        while stuck.raw().read(&mut byte).await.is_ok_and(|n| n > 0) {
            // The reader's slowness being simulated, not a wait.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    sigterm(&broker.0);
    notify.wait_for("STOPPING=1", |l| l == "STOPPING=1").await;
    signal(&broker.0, rustix::process::Signal::INT);
    let status = wait_exit(&mut broker.0).await;
    assert_eq!(status.code(), Some(3), "forced stop: {status:?}");
    trickle.abort();
}

#[tokio::test]
async fn a_socket_in_use_is_a_start_up_failure_exit_1() {
    let (running, dir) = broker_only(|_| {}).await;
    let out = clawmux_command(BIN)
        .arg("serve")
        .arg("--socket")
        .arg(running.socket_path())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("another clawmux is already serving"),
        "{stderr}"
    );
    drop(dir);
}

#[test]
fn a_passed_fd_that_is_not_a_unix_listener_is_a_start_up_failure_exit_1() {
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = activated_command(tcp.as_raw_fd(), &[], &[])
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is not a unix socket"), "{stderr}");
    assert!(stderr.contains("Accept=no"), "says what to fix: {stderr}");
}

#[tokio::test]
async fn the_token_comes_from_the_load_credential_directory() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = private_dir();
    let creds = dir.path().join("credentials");
    std::fs::create_dir(&creds).unwrap();
    std::fs::write(creds.join("gateway-token"), "test-token\n").unwrap();
    let socket = dir.path().join("c.sock");
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = serve_command(&socket, &notify);
    cmd.args(["--gateway-url", &gw.url()])
        .env("CREDENTIALS_DIRECTORY", &creds);
    let mut broker = spawn_ready(&mut cmd, &mut notify).await;
    let mut c = WsClient::open(&socket, "/ws").await;
    assert_eq!(c.handshake().await["type"], "hello-ok");
    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());

    // An unusable credential: the broker still starts, and every client is
    // told what to fix (studio.settings_load_failed naming the file only).
    std::fs::write(creds.join("gateway-token"), "  \n").unwrap();
    drop(notify);
    let _ = std::fs::remove_file(dir.path().join("notify"));
    let mut notify = NotifySocket::bind(dir.path());
    let mut cmd = serve_command(&socket, &notify);
    cmd.env("CREDENTIALS_DIRECTORY", &creds);
    let mut broker = spawn_ready(&mut cmd, &mut notify).await;
    let mut c = WsClient::open(&socket, "/ws").await;
    c.recv_json().await;
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["error"]["code"], "studio.settings_load_failed", "{res}");
    assert!(
        res["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gateway-token is empty"),
        "{res}"
    );
    sigterm(&broker.0);
    assert!(wait_exit(&mut broker.0).await.success());
}
