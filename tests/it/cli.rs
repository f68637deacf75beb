//! The real binary: `serve` against `mock-gateway`, `--help`, SIGTERM.

use std::process::{Command, Stdio};

use crate::support::*;

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

/// Output of a finished command: (exit code, stdout, stderr).
fn run(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.stdin(Stdio::null()).output().expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Lines of a child's stderr, read on a thread so waiting is bounded.
fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().expect("stderr piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Reads lines until one contains `needle` (within `patience`); returns all read.
fn lines_until(
    rx: &std::sync::mpsc::Receiver<String>,
    needle: &str,
    patience: std::time::Duration,
) -> Vec<String> {
    let deadline = std::time::Instant::now() + patience;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains(needle);
                seen.push(line);
                if done {
                    return seen;
                }
            }
            Err(_) => panic!("no line with {needle:?} within {patience:?}: {seen:#?}"),
        }
    }
}

/// `doctor` leaves no device key behind, prints no log lines into its report,
/// lists only its own flags, and has `--json`.
#[test]
fn doctor_changes_nothing_and_prints_only_its_report() {
    let home = TestHome::new();
    let args = [
        "doctor",
        "--token",
        "t",
        "--gateway-url",
        "ws://127.0.0.1:9",
    ];
    let (code, out, err) = run(home.clawmux().args(args));
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.is_empty(), "no log lines: {err}");
    assert!(!out.contains(" INFO ") && !out.contains(" WARN "), "{out}");
    assert!(out.contains("device key   none yet in"), "{out}");
    assert!(
        !home.state_home().join("clawmux/device.json").exists(),
        "doctor created no device key"
    );
    let (code, out, _) = run(home.clawmux().args(args).arg("--json"));
    assert_eq!(code, 1);
    let doc: serde_json::Value = serde_json::from_str(&out).expect(&out);
    assert_eq!(doc["ok"], false);
    assert_eq!(doc["gateway"]["code"], "studio.upstream_error", "{doc}");
    assert_eq!(doc["settings"]["device_key"]["exists"], false, "{doc}");
    assert_eq!(doc["settings"]["token"]["source"], "flag --token", "{doc}");
    let (_, help, _) = run(home.clawmux().args(["doctor", "--help"]));
    assert!(
        help.contains("--json") && help.contains("--gateway-url"),
        "{help}"
    );
    for serve_only in ["--connect-wait", "--request-timeout", "--demo"] {
        assert!(
            !help.contains(serve_only),
            "doctor --help lists {serve_only}: {help}"
        );
    }
    let (_, help, _) = run(home.clawmux().args(["serve", "--help"]));
    assert!(
        help.contains("--connect-wait") && help.contains("--request-timeout"),
        "{help}"
    );
}

#[test]
fn completions_and_man_pages() {
    let home = TestHome::new();
    for (shell, marker) in [
        ("bash", "_clawmux()"),
        ("zsh", "#compdef clawmux"),
        ("fish", "complete -c clawmux"),
    ] {
        let (code, out, err) = run(home.clawmux().args(["completions", shell]));
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains(marker) && out.contains("tail"),
            "{shell}: {out}"
        );
    }
    let (code, _, err) = run(home.clawmux().args(["completions", "tcsh"]));
    assert_eq!(code, 2, "{err}");
    let (code, out, _) = run(home.clawmux().arg("man"));
    assert_eq!(code, 0);
    assert!(
        out.starts_with(".ie") || out.contains(".TH clawmux 1"),
        "{out}"
    );
    assert!(
        out.contains("socket\\-path") || out.contains("socket-path"),
        "{out}"
    );
    let dir = home.path().join("man");
    let (code, _, err) = run(home.clawmux().arg("man").arg("--dir").arg(&dir));
    assert_eq!(code, 0, "{err}");
    for page in ["clawmux.1", "clawmux-tail.1", "clawmux-serve.1"] {
        assert!(dir.join(page).exists(), "{page}");
    }
}

/// `clawmux socket-path` prints the socket `serve` uses: from
/// `$XDG_RUNTIME_DIR`, else the temp dir, else `CLAWMUX_SOCKET` / config.toml.
#[test]
fn socket_path_is_the_one_serve_uses() {
    let home = TestHome::new();
    let uid = rustix::process::getuid().as_raw();
    let (_, out, _) = run(home.clawmux().arg("socket-path"));
    assert_eq!(
        out.trim(),
        home.path().join("run/clawmux.sock").to_str().unwrap()
    );
    let (_, out, _) = run(home
        .clawmux()
        .arg("socket-path")
        .env_remove("XDG_RUNTIME_DIR")
        .env("TMPDIR", home.path()));
    assert_eq!(
        out.trim(),
        home.path()
            .join(format!("clawmux-{uid}/clawmux.sock"))
            .to_str()
            .unwrap()
    );
    let (_, out, _) = run(home
        .clawmux()
        .arg("socket-path")
        .env("CLAWMUX_SOCKET", "/x/y.sock"));
    assert_eq!(out.trim(), "/x/y.sock");
    std::fs::create_dir_all(home.path().join(".config/clawmux")).unwrap();
    std::fs::write(
        home.path().join(".config/clawmux/config.toml"),
        "socket = \"/from/config.sock\"\n",
    )
    .unwrap();
    let (_, out, _) = run(home.clawmux().arg("socket-path"));
    assert_eq!(out.trim(), "/from/config.sock");
    // The client commands look there too.
    let (code, _, err) = run(home.clawmux().arg("status"));
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("/from/config.sock"), "{err}");
}

/// A token file that is missing or empty stops `serve` with exit 1 (README
/// "Exit codes"), from the flag or the environment.
#[test]
fn serve_with_a_missing_or_empty_token_file_exits_1() {
    let home = TestHome::new();
    let missing = home.path().join("no-such-token");
    let empty = home.path().join("empty-token");
    std::fs::write(&empty, "  \n").unwrap();
    for (flag, env) in [
        (Some(&missing), None),
        (Some(&empty), None),
        (None, Some(&empty)),
    ] {
        let mut cmd = home.clawmux();
        cmd.arg("serve");
        if let Some(p) = flag {
            cmd.arg("--token-file").arg(p);
        }
        if let Some(p) = env {
            cmd.env("CLAWMUX_GATEWAY_TOKEN_FILE", p);
        }
        let (code, _, err) = run(&mut cmd);
        assert_eq!(code, 1, "{flag:?} {env:?}: {err}");
        let file = flag.or(env).unwrap();
        assert!(err.contains(file.to_str().unwrap()), "{err}");
        assert!(
            !home.path().join("run/clawmux.sock").exists(),
            "it never served"
        );
    }
}

/// `mock-gateway` says which token it expects, and a busy port is named.
#[test]
fn mock_gateway_shows_its_token_and_names_a_busy_port() {
    let home = TestHome::new();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let (code, _, err) = run(home.clawmux().args(["mock-gateway", "--port", &port]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("--port"),
        "{err}"
    );
    assert_eq!(err.matches("in use").count(), 1, "said once: {err}");
    let mut gw = ChildGuard(
        home.clawmux()
            .args(["mock-gateway", "--port", "0", "--token", "demo-tok"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = lines_until(
        &stderr_lines(&mut gw.0),
        "listening on",
        std::time::Duration::from_secs(20),
    );
    let said = lines.last().unwrap();
    assert!(
        said.contains("expects token \"demo-tok\"") && said.contains("--token demo-tok"),
        "{said}"
    );
}

/// A socket path in a directory nobody can write is reported once, by the
/// socket's name (not the lock file's).
#[test]
fn an_unusable_socket_path_is_reported_once_by_its_name() {
    let home = TestHome::new();
    let (code, _, err) =
        run(home
            .clawmux()
            .args(["serve", "--socket", "/proc/x.sock", "--token", "t"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot set up the socket /proc/x.sock"),
        "{err}"
    );
    assert!(!err.contains(".x.sock.lock"), "{err}");
    assert_eq!(err.matches("os error").count(), 1, "the cause once: {err}");
}

/// `serve --demo` says what to run next and shows each run in its terminal.
#[test]
fn demo_says_what_to_run_next_and_shows_activity() {
    let home = TestHome::new();
    let socket = home.path().join("demo.sock");
    let mut broker = ChildGuard(
        home.clawmux()
            .args(["serve", "--demo", "--socket"])
            .arg(&socket)
            .env("CLAWMUX_LOG", "warn")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let rx = stderr_lines(&mut broker.0);
    let banner = lines_until(
        &rx,
        "Ctrl-C stops the demo",
        std::time::Duration::from_secs(20),
    )
    .join("\n");
    let sock = socket.to_str().unwrap();
    for next in [
        format!("status --socket {sock}"),
        format!("tail --socket {sock}"),
        format!("curl -s --unix-socket {sock} http://localhost/healthz"),
    ] {
        assert!(banner.contains(&next), "{next} in {banner}");
    }
    // A demo run every 3 s; its answer is shown here.
    let activity = lines_until(
        &rx,
        "clawmux demo: run ",
        std::time::Duration::from_secs(30),
    );
    assert!(
        activity
            .last()
            .unwrap()
            .contains("answered \"Hello from the mock gateway"),
        "{activity:#?}"
    );
    sigterm(&broker.0);
}

/// `call --scopes` takes only scope names the gateway knows: another one
/// is a usage error (exit 2) listing the valid names, before any broker
/// is asked.
#[tokio::test]
async fn call_refuses_an_unknown_scope_and_lists_the_valid_ones() {
    let (code, out, err) = run_clawmux(&["call", "health", "--scopes", "read,banana"]).await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("\"banana\" is not a scope")
            && err.contains("read, write, admin, approvals, pairing"),
        "{err}"
    );
}

/// `clawmux --help` lists the everyday commands first and the test double
/// last; the long `--log` default is said once, there, not on every
/// command's help.
#[test]
fn help_lists_everyday_commands_first_and_says_the_log_default_once() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let commands: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert_eq!(
        commands[..6],
        ["status", "tail", "call", "top", "serve", "doctor"],
        "{text}"
    );
    assert_eq!(commands.last(), Some(&"mock-gateway"), "{text}");
    assert_eq!(text.matches("off for doctor").count(), 1, "{text}");
    for sub in ["status", "serve", "tail", "doctor"] {
        let out = Command::new(BIN).args([sub, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("--log"), "{sub}: {help}");
        assert!(
            !help.contains("off for doctor"),
            "{sub} repeats the log default: {help}"
        );
    }
}
