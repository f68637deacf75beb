//! Bounds on the accept path and on settings: the connection cap, the
//! header read timeout, a low open-file limit, running out of descriptors,
//! and absurd durations.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

/// Opens a WebSocket on the socket; `Err` carries what the client saw.
/// Never waits longer than [`PATIENCE`]: a connection left unanswered is a
/// failure of the test, not a hang.
async fn try_ws(socket: &Path) -> Result<WsStream, String> {
    let attempt = async {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        tokio_tungstenite::client_async("ws://localhost/ws", stream)
            .await
            .map(|(ws, _)| ws)
            .map_err(|e| match e {
                tokio_tungstenite::tungstenite::Error::Http(resp) => {
                    format!("http {}", resp.status().as_u16())
                }
                other => format!("ws: {other}"),
            })
    };
    tokio::time::timeout(PATIENCE, attempt)
        .await
        .unwrap_or_else(|_| {
            panic!("no answer within {PATIENCE:?}: the connection was left hanging")
        })
}

type WsStream = tokio_tungstenite::WebSocketStream<UnixStream>;

/// Sends a request head and reads the whole answer (the broker closes).
async fn raw_exchange(socket: &Path, request: &[u8]) -> String {
    let mut s = UnixStream::connect(socket).await.expect("socket accepts");
    s.write_all(request).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut out))
        .await
        .expect("closed in time")
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

/// A client slowed down between its connect and its write (as on a loaded
/// machine): it reads the broker's whole answer first, to the end, and only
/// then writes its request. `Ok(answer)` if that write still succeeds (the
/// broker lingered, reading); `Err` with what the write saw if the broker
/// had closed the connection with the request unread.
async fn late_writer(socket: &Path) -> Result<String, String> {
    let mut s = UnixStream::connect(socket).await.expect("socket accepts");
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut answer))
        .await
        .expect("answered in time")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .map_err(|e| format!("{e} after reading {answer:?}"))?;
    Ok(answer)
}

/// `clawmux serve` under `bash`, after `setup` (e.g. `ulimit -n 64`), with
/// its log on a pipe.
fn serve_under_shell(home: &Path, setup: &str, socket: &Path, gateway: &str) -> Child {
    isolated_command("bash", home)
        .arg("-c")
        .arg(format!("{setup}\nexec \"$0\" \"$@\""))
        .arg(BIN)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(["--gateway-url", gateway, "--token", "test-token"])
        .arg("--no-device-identity")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash runs")
}

/// Stops the child and returns its log.
/// Stops the broker the way a supervisor does (SIGTERM: the log writer
/// drains before exit; a SIGKILL could cut off lines still queued for it on
/// a loaded machine), killing it only if it has not exited within the
/// patience, and returns what it logged.
fn stop_and_read_log(child: &mut Child) -> String {
    sigterm(child);
    let deadline = std::time::Instant::now() + PATIENCE;
    while child.try_wait().ok().flatten().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = child.wait();
    let mut log = String::new();
    child
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut log)
        .expect("log");
    log
}

#[tokio::test(start_paused = true)]
async fn a_client_trickling_its_request_head_is_cut_off() {
    let h = start_with(mock_config(), |s| {
        s.limits.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let mut s = UnixStream::connect(h.socket()).await.unwrap();
    s.write_all(b"GET /heal").await.unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut buf))
        .await
        .expect("the broker closes a trickling client")
        .expect("read");
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "closed by the timeout, not at once"
    );
    // A prompt client on the same broker is served.
    let (status, body) = http_get(&h.socket(), "/healthz").await;
    assert_eq!((status, body["ok"].as_bool()), (200, Some(true)));
}

#[tokio::test]
async fn connections_over_the_cap_get_503_and_the_others_keep_working() {
    let h = start_with(mock_config(), |s| s.limits.max_connections = Some(3)).await;
    let (mut a, _) = h.connected().await;
    let (_b, _) = h.connected().await;
    let mut c = h.client().await; // a WebSocket before `connect` counts too
    let answer = raw_exchange(
        &h.socket(),
        b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("studio.too_many_clients"), "{answer}");
    assert!(
        answer.contains("max_connections"),
        "says what to raise: {answer}"
    );
    let late = late_writer(&h.socket()).await.expect("the broker lingers");
    assert!(late.starts_with("HTTP/1.1 503 "), "{late}");
    let res = a.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "an admitted client keeps working: {res}");
    c.handshake().await;
    // A closed connection frees its slot.
    a.close().await;
    drop(a);
    let socket = h.socket();
    eventually_async("a freed slot", || try_ws(&socket)).await;
}

/// `ulimit -n 64`: the broker keeps its reserve of descriptors, so clients
/// beyond what the limit holds get a clean `503`, the rest are served, the
/// log says so once (not once per refusal), and a freed slot is used again.
#[tokio::test]
async fn a_low_open_file_limit_refuses_cleanly_and_keeps_serving() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let socket = home.path().join("run/c.sock");
    let mut guard = ChildGuard(serve_under_shell(
        home.path(),
        "ulimit -n 64",
        &socket,
        &gw.url(),
    ));
    eventually("socket exists", || socket.exists()).await;
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..45 {
        match try_ws(&socket).await {
            Ok(ws) => admitted.push(ws),
            Err(e) => refused.push(e),
        }
    }
    assert!(
        admitted.len() >= 20,
        "most clients are served: {} admitted, refused: {refused:?}",
        admitted.len()
    );
    assert!(!refused.is_empty(), "all 45 admitted under ulimit -n 64");
    // A 503 as a rule; a client slowed down past the broker's linger may
    // see its connection closed instead, which is still an answer.
    assert!(
        refused.iter().any(|e| e == "http 503"),
        "refused with a 503: {refused:?}"
    );
    // The broker still serves: a freed slot admits a new client, whose
    // handshake works.
    admitted.pop();
    let _again = eventually_async("a freed slot", || try_ws(&socket)).await;
    let log = stop_and_read_log(&mut guard.0);
    assert!(log.contains("open-file limit"), "warned at start: {log}");
    let lines = log.matches("too many open connections").count();
    assert!(
        (1..=2).contains(&lines),
        "{lines} lines for {} refusals: {log}",
        refused.len()
    );
}

/// Something else ate the descriptors (here: 40 inherited from the shell),
/// so `accept` itself fails with EMFILE: waiting clients still get an
/// answer (503 through the spare descriptor, read even by a client that
/// writes its request late: before, clients saw only broken pipes under load) instead of
/// hanging in the backlog, the log is not flooded, and the broker serves
/// again once descriptors are free.
#[tokio::test]
async fn running_out_of_descriptors_answers_waiting_clients_and_recovers() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let socket = home.path().join("run/c.sock");
    let setup = "ulimit -n 64\nfor i in $(seq 1 40); do exec {fd}</dev/null; done";
    let mut guard = ChildGuard(serve_under_shell(home.path(), setup, &socket, &gw.url()));
    eventually("socket exists", || socket.exists()).await;
    // The upstream session first: its socket opening while the clients
    // exhaust the descriptors could take the one the spare frees.
    eventually_async("upstream ready", || async {
        let (_, body) = http_get(&socket, "/healthz").await;
        if body["upstream"] == "ready" {
            Ok(())
        } else {
            Err(body)
        }
    })
    .await;
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..30 {
        match try_ws(&socket).await {
            Ok(ws) => admitted.push(ws),
            Err(e) => refused.push(e),
        }
    }
    assert!(!admitted.is_empty(), "nobody admitted: {refused:?}");
    assert!(
        refused.len() >= 5,
        "expected EMFILE refusals, {} admitted",
        admitted.len()
    );
    // Every refusal is a 503 the client read, never a broken pipe on its
    // write (the broker lingers, reading the request, before it closes).
    assert!(
        refused.iter().all(|e| e == "http 503"),
        "the spare descriptor answers 503: {refused:?}"
    );
    // Even a client that writes only after the answer has arrived.
    let answer = late_writer(&socket).await.expect("the broker lingers");
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    admitted.clear();
    let _again = eventually_async("recovered: a client admitted", || try_ws(&socket)).await;
    let log = stop_and_read_log(&mut guard.0);
    let lines = log.matches("accept failed").count();
    assert!(
        (1..=3).contains(&lines),
        "{lines} accept-failure lines for {} refusals: {log}",
        refused.len()
    );
}

/// Absurd durations on the command line: exit 2 with the flag named, never a
/// broker that panics on its first request (Instant overflow).
#[tokio::test]
async fn absurd_durations_on_the_command_line_are_usage_errors() {
    let home = tempfile::tempdir().unwrap();
    for (flag, value) in [
        ("--request-timeout", "18446744073709551615"),
        ("--connect-wait", "18446744073709551615"),
        ("--request-timeout", "0"),
        ("--shutdown-timeout", "1e300"),
    ] {
        let mut child = isolated_command(BIN, home.path())
            .arg("serve")
            .arg("--socket")
            .arg(home.path().join("run/c.sock"))
            .args(["--gateway-url", "ws://127.0.0.1:9", "--token", "t"])
            .args([flag, value])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = wait_exit(&mut child).await;
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag) && err.contains("one day"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The same for config.toml: `doctor` names the key and exits 1.
#[tokio::test]
async fn an_absurd_config_value_is_a_settings_error_naming_the_key() {
    let home = tempfile::tempdir().unwrap();
    let config = home.path().join("config.toml");
    std::fs::write(
        &config,
        "[limits]\nrequest_timeout_ms = 18446744073709551615\n",
    )
    .unwrap();
    let mut cmd = isolated_command(BIN, home.path());
    cmd.arg("doctor")
        .arg("--config")
        .arg(&config)
        .args(["--gateway-url", "ws://127.0.0.1:9"]);
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A broken config.toml: exit 2, as for every command (the report shows it too).
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("limits.request_timeout_ms"), "{text}");
    assert!(text.contains("studio.settings_load_failed"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// The header timeout is about request heads only: an `/v1/events` stream
/// open much longer than it keeps flowing.
#[tokio::test(start_paused = true)]
async fn an_event_stream_outlives_the_header_read_timeout() {
    let h = start_with(mock_config(), |s| {
        s.limits.header_read_timeout = Duration::from_millis(200);
        s.limits.sse_keepalive = Duration::from_millis(100);
    })
    .await;
    let mut s = UnixStream::connect(h.socket()).await.unwrap();
    s.write_all(b"GET /v1/events HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    // Keep-alive comments for three times the header timeout.
    while started.elapsed() < Duration::from_millis(600) {
        let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
            .await
            .expect("the stream keeps flowing")
            .unwrap();
        assert!(n > 0, "closed after {:?}: {seen}", started.elapsed());
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    assert!(seen.matches(": keep-alive").count() >= 3, "{seen}");
}
