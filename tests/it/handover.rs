//! Handing the broker over to its next instance (docs/src/restarts.md):
//! by `SIGUSR2` (the real binary starts the binary at its own path) and
//! through a stand-in for systemd's file descriptor store that follows its
//! documented protocol (`FDSTORE=1`/`FDNAME=` on the notify socket, the next
//! start with `LISTEN_FDS`/`LISTEN_FDNAMES`/`LISTEN_PID`, `FDSTOREREMOVE=1`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::http_api::state;
use crate::support::*;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

/// A process by pid (a handed-over broker is not this test's child), killed
/// when the test ends.
struct Pid(u32);

impl Drop for Pid {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0 as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// The pid of the `n`th new instance an upgrade started (from 1), from
/// the broker's log.
fn started_pid(log: &Path, n: usize) -> u32 {
    log_text(log)
        .lines()
        .filter(|l| l.contains("upgrade: new instance started"))
        .nth(n - 1)
        .and_then(|l| l.split("pid=").nth(1))
        .and_then(|p| p.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .expect("the new instance's pid in the log")
}

/// Every process of a process group, killed when dropped (a test that
/// fails leaves none behind); dropped before its leader is reaped, so the
/// group's id is still that group's.
struct Group(Option<u32>);

impl Group {
    /// Kills nothing when dropped.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(pid) = self
            .0
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

fn alive(pid: u32) -> bool {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return false;
    };
    // A zombie still "exists": read its state.
    rustix::process::test_kill_process(p).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(true)
}

fn serve_command(program: &Path, dir: &Path, socket: &Path, gateway: &str) -> Command {
    let mut cmd = serve_unconfigured(program, dir, socket);
    cmd.args(["--gateway-url", gateway, "--token", "test-token"]);
    cmd
}

/// `clawmux serve` from `program` with no gateway settings of its own on
/// the command line (a config file or the environment gives them).
fn serve_unconfigured(program: &Path, dir: &Path, socket: &Path) -> Command {
    serve_stopping_within(program, dir, socket, "2")
}

/// As [`serve_unconfigured`], with `--shutdown-timeout` `secs`.
fn serve_stopping_within(program: &Path, dir: &Path, socket: &Path, secs: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.arg("serve")
        .arg("--socket")
        .arg(socket)
        // With the device identity (the default): its state dir also
        // keeps the replay log's file, which a handover continues.
        .args(["--shutdown-timeout", secs])
        .env("HOME", dir)
        .env("XDG_STATE_HOME", dir.join("state"))
        .env_remove("CLAWMUX_CONFIG")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_PID")
        .env_remove("LISTEN_FDNAMES")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// The broker's log, written to a file so the test can wait for a line.
fn log_to(cmd: &mut Command, dir: &Path) -> PathBuf {
    let path = match std::env::var_os("HANDOVER_LOG") {
        Some(p) => PathBuf::from(p),
        None => dir.join("broker.log"),
    };
    let file = std::fs::File::create(&path).unwrap();
    cmd.stderr(file);
    path
}

async fn wait_log(path: &Path, needle: &str) {
    wait_log_times(path, needle, 1).await;
}

/// Waits until `needle` is in the broker's log `n` times.
async fn wait_log_times(path: &Path, needle: &str, n: usize) {
    eventually(&format!("{needle:?} {n} times in the broker's log"), || {
        std::fs::read_to_string(path).is_ok_and(|l| l.matches(needle).count() >= n)
    })
    .await;
}

/// Upgrades by `SIGUSR2` once: the old instance (`pid`, the child
/// `first`) exits 0 and a new one serves (killed when the result drops).
async fn upgrade_once(first: &mut ChildGuard, pid: u32, socket: &Path, log: &Path) -> Pid {
    signal_pid(pid, rustix::process::Signal::USR2);
    assert!(
        exits_with(&mut first.0).await.success(),
        "{}",
        log_text(log)
    );
    Pid(broker_pid(socket).await)
}

/// `/v1/state` still lists the client with `conn_id`.
async fn assert_listed(socket: &Path, conn_id: &serde_json::Value, what: &str) {
    let listed = state(socket).await["clients"].clone();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["conn_id"] == *conn_id),
        "{what}: {listed}"
    );
}

fn log_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `clawmux serve` from `program` against the double at `gateway`, its log
/// in a file, once its gateway session is ready: (the child, the socket,
/// the log).
async fn serve_ready(program: &Path, dir: &Path, gateway: &str) -> (ChildGuard, PathBuf, PathBuf) {
    let socket = dir.join("c.sock");
    let mut cmd = serve_command(program, dir, &socket, gateway);
    let log = log_to(&mut cmd, dir);
    let child = ChildGuard(cmd.spawn().unwrap());
    eventually("socket exists", || socket.exists()).await;
    crate::http_api::until_ready(&socket).await;
    (child, socket, log)
}

async fn broker_pid(socket: &Path) -> u32 {
    state(socket).await["broker"]["pid"].as_u64().unwrap() as u32
}

/// One `GET /healthz`: `Some(status)`, or `None` when the connection was
/// refused or dropped.
async fn healthz(socket: &Path) -> Option<u16> {
    let mut s = UnixStream::connect(socket).await.ok()?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE * 4, s.read_to_end(&mut out))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&out);
    text.split_whitespace().nth(1)?.parse().ok()
}

/// Probes `/healthz` in a loop until stopped: (probes, failures).
fn probe_continuously(
    socket: PathBuf,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<(usize, usize)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let s = Arc::clone(&stop);
    let task = tokio::spawn(async move {
        let (probes, failures) = (AtomicUsize::new(0), AtomicUsize::new(0));
        // Bounded: at most 5,000 probes.
        for _ in 0..5_000 {
            if s.load(Ordering::Relaxed) {
                break;
            }
            probes.fetch_add(1, Ordering::Relaxed);
            if healthz(&socket).await != Some(200) {
                failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        (probes.into_inner(), failures.into_inner())
    });
    (stop, task)
}

async fn exits_with(child: &mut std::process::Child) -> std::process::ExitStatus {
    eventually_async("the old instance exits", || {
        let r = child.try_wait().unwrap();
        async move { r.ok_or("still running") }
    })
    .await
}

/// The event log, read from cursor `first` on, holds the numbered events
/// `0..count` (and whatever else), each once, in order, with no gap told
/// between them: history equals what was seen live.
async fn assert_history_numbered(socket: &Path, first: u64, count: i64, log: &Path) {
    let mut history = crate::http_api::open_events(
        socket,
        &format!(
            "/v1/events?events=test.n,clawmux.gap&after_seq={}",
            first - 1
        ),
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("history: {e:?}\n{}", log_text(log)));
    for expected in 0..count {
        let (_, name, data) = history.next_event().await;
        assert_eq!(name, "test.n", "{data}");
        assert_eq!(data["payload"]["n"], expected);
    }
}

/// The client's next event: its `seq` follows `last_seq` (then updated),
/// and it announces no reconnect and no gap; `Some(n)` for a numbered
/// `test.n`, `None` for any other event. Panics, saying `what`, when the
/// connection ends or nothing comes.
async fn next_numbered(
    client: &mut WsClient,
    last_seq: &mut u64,
    what: &str,
    log: &Path,
) -> Option<i64> {
    let event = loop {
        match client.recv_within(PATIENCE * 2).await {
            Some(Got::Json(v)) if v["type"] == "event" => break v,
            Some(Got::Json(_)) => continue,
            other => panic!("{what}: {other:?}; last seq {last_seq}\n{}", log_text(log)),
        }
    };
    let seq = event["seq"].as_u64().expect("events carry seq");
    assert!(
        *last_seq == 0 || seq == *last_seq + 1,
        "{what}: seq went from {last_seq} to {seq}: {event}"
    );
    *last_seq = seq;
    assert_ne!(event["event"], "clawmux.upstream", "{what}: {event}");
    assert_ne!(event["event"], "clawmux.gap", "{what}: {event}");
    (event["event"] == "test.n").then(|| event["payload"]["n"].as_i64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_moves_connected_clients_to_the_new_binary_and_no_connection_is_refused() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let mut pid = broker_pid(&socket).await;
    assert_eq!(pid, first.0.id());
    let mut client = WsClient::open(&socket, "/ws").await;
    let hello = client.handshake().await;
    let conn_id = hello["server"]["connId"].clone();
    let sub = client
        .request(
            "sessions.messages.subscribe",
            serde_json::json!({"key": "agent:main:main"}),
        )
        .await;
    assert_eq!(sub["ok"], true, "{sub}");
    // A client that never sends anything after its connect moves too.
    let mut idle = WsClient::open(&socket, "/ws").await;
    idle.handshake().await;
    // Event streams move too, each with its filter: they go on, on the
    // same HTTP response, read by a real HTTP client (which would fail on
    // a chunk cut in two).
    let mut streams = Vec::new();
    for path in ["/v1/events", "/v1/events?events=test.n"] {
        let sse = crate::http_api::open_events(&socket, path, &[])
            .await
            .unwrap_or_else(|e| panic!("{path}: {e:?}"));
        streams.push((path, sse, -1i64, 0u64));
    }
    let mut first_event = (0, 0u64, serde_json::Value::Null);
    let mut last_seq = 0u64;
    let mut last_n = -1i64;
    let mut n = 0i64;
    let mut keep = Vec::new();
    for round in 1..=3 {
        // A paced, numbered burst runs across the handover.
        let burst = tokio::spawn({
            let gw = gw.clone();
            async move {
                let mut sent = Vec::new();
                for i in 0..60 {
                    gw.broadcast("test.n", serde_json::json!({"n": n + i}));
                    sent.push(n + i);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                sent
            }
        });
        let (stop, probes) = probe_continuously(socket.clone());
        signal_pid(pid, rustix::process::Signal::USR2);
        let next = eventually_async("a new instance serves", || {
            let socket = socket.clone();
            async move {
                match healthz(&socket).await {
                    Some(200) => {
                        let p = broker_pid(&socket).await;
                        if p != pid {
                            Ok(p)
                        } else {
                            Err(format!("pid {p} still serves"))
                        }
                    }
                    other => Err(format!("healthz {other:?}")),
                }
            }
        })
        .await;
        keep.push(Pid(next));
        if round == 1 {
            assert!(
                exits_with(&mut first.0).await.success(),
                "{}",
                log_text(&log)
            );
        } else {
            eventually("the old instance exits", || !alive(pid)).await;
        }
        pid = next;
        stop.store(true, Ordering::Relaxed);
        let (probed, failures) = probes.await.unwrap();
        assert!(probed > 0);
        assert_eq!(
            failures, 0,
            "{failures} of {probed} probes failed during handover {round}"
        );
        let sent = burst.await.unwrap();
        n += sent.len() as i64;
        // The client stayed connected, on the same gateway session: every
        // event of the burst came once, in order, with contiguous seq, and
        // no gap or reconnect was announced.
        let what = format!("round {round}");
        while last_n < n - 1 {
            if let Some(got) = next_numbered(&mut client, &mut last_seq, &what, &log).await {
                assert_eq!(got, last_n + 1, "{what}: event {got} after {last_n}");
                last_n = got;
            }
        }
        let res = client.request("health", serde_json::json!({})).await;
        assert_eq!(res["ok"], true, "round {round}: {res}");
        // The idle client got the burst too.
        loop {
            let event = idle.event_within("test.n", PATIENCE * 4).await;
            if event["payload"]["n"] == n - 1 {
                break;
            }
        }
        // So did each event stream: every event once, in order, no gap
        // said, no close.
        for (path, sse, seen_n, last_id) in &mut streams {
            while *seen_n < n - 1 {
                match sse.next_item_within(PATIENCE * 2).await {
                    crate::http_api::Item::Event { id, name, data, .. } => {
                        assert!(
                            id > *last_id,
                            "round {round}, {path}: id {id} after {last_id}"
                        );
                        *last_id = id;
                        assert_ne!(name, "clawmux.gap", "round {round}, {path}: {data}");
                        if name == "test.n" {
                            if first_event.0 == 0 && *path == "/v1/events" {
                                first_event = (1, id, data.clone());
                            }
                            let got = data["payload"]["n"].as_i64().unwrap();
                            assert_eq!(
                                got,
                                *seen_n + 1,
                                "round {round}, {path}: {got} after {seen_n}"
                            );
                            *seen_n = got;
                        }
                    }
                    crate::http_api::Item::Comment(_) => {}
                    crate::http_api::Item::Other(other) if other.starts_with("retry:") => {}
                    crate::http_api::Item::Other(other) => {
                        panic!("round {round}, {path}: {other}\n{}", log_text(&log))
                    }
                }
            }
        }
        // Its subscription stayed at the gateway (never sent again).
        gw.emit_session_message(
            "agent:main:main",
            serde_json::json!({"sessionKey": "agent:main:main", "text": format!("after {round}")}),
        );
        let message = client.event("session.message").await;
        assert_eq!(message["payload"]["text"], format!("after {round}"));
        // What was read out of order above was seen: the next round's seq
        // follows the last of it.
        for seen in std::iter::once(message).chain(client.events.drain(..)) {
            if let Some(seq) = seen["seq"].as_u64() {
                last_seq = last_seq.max(seq);
            }
        }
        let state = state(&socket).await;
        let listed = state["clients"].as_array().unwrap();
        assert!(
            listed.iter().any(|c| c["conn_id"] == conn_id),
            "round {round}: the client keeps its connId: {state}"
        );
    }
    // History shows what the streams saw live: every event once, no gap
    // (the log went on across the handovers, its cursors too).
    let (_, first, _) = &first_event;
    assert_history_numbered(&socket, *first, n, &log).await;
    // The gateway double saw one connection throughout, and one subscribe.
    assert_eq!(gw.total_connections(), 1, "{}", log_text(&log));
    let subscribes = gw
        .requests()
        .iter()
        .filter(|(_, r)| r["method"] == "sessions.messages.subscribe")
        .count();
    assert_eq!(subscribes, 1, "the subscription was never sent again");
    assert!(last_n >= 0, "events arrived");
    // The last instance owns the socket file now: a stop removes it.
    signal_pid(pid, rustix::process::Signal::TERM);
    eventually("the last instance exits", || !alive(pid)).await;
    eventually("the socket file is removed at the final stop", || {
        !socket.exists()
    })
    .await;
    let log = log_text(&log);
    assert!(log.contains("took the clients over"), "{log}");
    // The event streams moved (not closed and reopened: the reader above
    // would have failed on the end of its response).
    assert_eq!(log.matches("streams=2").count(), 3, "{log}");
}

/// A process's nice value (`/proc/<pid>/stat`, field 19), a zombie's too.
fn nice_of(pid: u32) -> i64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After the command's closing parenthesis: the state is field 3.
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    fields[19 - 3].parse().unwrap()
}

/// The old instance lets go of the moved clients and exits at the lowest
/// priority, so the new one has the CPU to catch its clients up; the new
/// one serves at the priority it was started with. The old one is this
/// test's child and is not reaped until the end: its priority can still be
/// read once it has exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_instance_exits_at_the_lowest_priority_and_the_new_one_serves_at_its_own() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    assert_eq!(nice_of(pid), 0, "the first instance starts at nice 0");
    signal_pid(pid, rustix::process::Signal::USR2);
    eventually("the old instance has exited", || !alive(pid)).await;
    assert_eq!(nice_of(pid), 19, "{}", log_text(&log));
    let next = Pid(broker_pid(&socket).await);
    assert_ne!(next.0, pid);
    assert_eq!(nice_of(next.0), 0, "the new instance serves at nice 0");
    assert_eq!(
        client.request("health", serde_json::json!({})).await["ok"],
        true
    );
    assert!(exits_with(&mut first.0).await.success());
}

fn signal_pid(pid: u32, sig: rustix::process::Signal) {
    let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(p, sig).unwrap();
}

/// The broker started from a copy of the binary in `dir`, so a test can
/// put another program at that path (an upgrade to a broken binary).
fn copied_binary(dir: &Path) -> PathBuf {
    let path = dir.join("bin").join("clawmux");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    install_executable(Path::new(BIN), &path);
    path
}

/// Puts `script` at `path` (a new file renamed over it, as a package upgrade does).
fn replace_with_script(path: &Path, script: &str) {
    let tmp = path.with_extension("new");
    install_script(&tmp, script);
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_binary_that_fails_leaves_the_old_one_serving_and_a_good_one_then_takes_over() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let program = copied_binary(dir.path());
    let (mut old, socket, log) = serve_ready(&program, dir.path(), &gw.url()).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    let mut events = crate::http_api::open_events(&socket, "/v1/events?events=test.n", &[])
        .await
        .unwrap();

    // 1. A binary that exits at start: nothing changes for anyone.
    replace_with_script(&program, "#!/bin/sh\necho 'cannot start' >&2\nexit 1\n");
    signal(&old.0, rustix::process::Signal::USR2);
    wait_log(&log, "upgrade failed, still serving").await;
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "the client stayed connected: {res}");
    assert_eq!(broker_pid(&socket).await, old.0.id());

    // 2. A binary that says valid, lets the old one stop, then dies: the old
    //    one serves again on the same socket, and takes its clients and its
    //    gateway session back.
    replace_with_script(&program, &dying_after_the_release(None));
    signal(&old.0, rustix::process::Signal::USR2);
    // (The second failure: the first is step 1's.)
    wait_log_times(&log, "upgrade failed, still serving", 2).await;
    gw.broadcast("test.n", serde_json::json!({"n": 1}));
    let event = client.event("test.n").await;
    assert_eq!(event["payload"]["n"], 1);
    // The event stream was taken back too, on its same response.
    let (_, name, data) = events.next_event().await;
    assert_eq!(
        (name.as_str(), &data["payload"]["n"]),
        ("test.n", &serde_json::json!(1))
    );
    assert!(
        !client
            .events
            .iter()
            .any(|e| e["event"] == "clawmux.upstream"),
        "the gateway session went on: {:?}",
        client.events
    );
    assert_eq!(gw.total_connections(), 1, "{}", log_text(&log));
    assert!(
        old.0.try_wait().unwrap().is_none(),
        "the old instance still runs"
    );
    assert_eq!(broker_pid(&socket).await, old.0.id());
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "the client is served again: {res}");
    let mut again = WsClient::open(&socket, "/ws").await;
    let challenge = again.recv_within(PATIENCE).await;
    let sent = again.try_send_json(&connect_frame("connect-1")).await;
    let hello = again.recv_within(PATIENCE).await;
    assert!(
        sent.is_ok() && matches!(&hello, Some(Got::Json(v)) if v["ok"] == true),
        "a new client after the failed upgrade: {challenge:?} {sent:?} {hello:?}\n{}",
        log_text(&log)
    );

    // 3. The real binary again: the upgrade happens.
    std::fs::remove_file(&program).unwrap();
    install_executable(Path::new(BIN), &program);
    signal(&old.0, rustix::process::Signal::USR2);
    assert!(exits_with(&mut old.0).await.success(), "{}", log_text(&log));
    let new = broker_pid(&socket).await;
    let _new = Pid(new);
    assert_ne!(new, old.0.id());
    gw.broadcast("test.n", serde_json::json!({"n": 2}));
    let (_, name, data) = events.next_event().await;
    assert_eq!(
        (name.as_str(), &data["payload"]["n"]),
        ("test.n", &serde_json::json!(2)),
        "{}",
        log_text(&log)
    );
}

/// A `SIGTERM` that reaches the old instance while it hands over (here:
/// while the new binary is held at its start, until the test lets it go)
/// is not lost when the handover succeeds: the new instance gets it, and
/// stops as a stop does (its clients are closed `1001`), so no broker is
/// left serving that was asked to stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_asked_during_an_upgrade_that_succeeds_stops_the_new_instance() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let program = copied_binary(dir.path());
    let (mut old, socket, log) = serve_ready(&program, dir.path(), &gw.url()).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    let go = dir.path().join("go");
    // The real binary, once `go` exists (at most 10 s: no orphan is left).
    replace_with_script(
        &program,
        &format!(
            "#!/bin/sh\n\
             i=0; while [ ! -e '{go}' ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done\n\
             exec '{bin}' \"$@\"\n",
            go = go.display(),
            bin = BIN,
        ),
    );
    signal(&old.0, rustix::process::Signal::USR2);
    wait_log(&log, "upgrade: new instance started").await;
    signal(&old.0, rustix::process::Signal::TERM);
    std::fs::write(&go, "").unwrap();
    assert!(exits_with(&mut old.0).await.success(), "{}", log_text(&log));
    let code = close_code(&mut client, &log).await;
    assert_eq!(code, 1001, "the new instance stopped\n{}", log_text(&log));
    wait_log(&log, "passed on to the new instance").await;
    eventually("no broker serves the socket", || {
        serve_processes(&socket).is_empty()
    })
    .await;
}

/// A broker with a WebSocket client whose upgrades hold (the test hook) at
/// `point` until `go` exists: `hold-before-ready`, the new instance with
/// everything taken over; `hold-before-exit`, the old one once the new one
/// serves, before it lets go and exits.
struct Held {
    _gw: MockGateway,
    _dir: tempfile::TempDir,
    go: PathBuf,
    old: ChildGuard,
    socket: PathBuf,
    log: PathBuf,
    client: WsClient,
}

impl Held {
    async fn start(point: &str) -> Held {
        Held::start_holding(&[point]).await
    }

    /// Each instance holds at each of `points` until `go` exists.
    async fn start_holding(points: &[&str]) -> Held {
        let gw = MockGateway::start(mock_config()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        let hold = points
            .iter()
            .map(|point| format!("{point}:{}", go.display()))
            .collect::<Vec<_>>()
            .join(",");
        let (old, socket, log, client) = serve_hooked(dir.path(), &gw, &hold).await;
        Held {
            _gw: gw,
            _dir: dir,
            go,
            old,
            socket,
            log,
            client,
        }
    }

    /// Upgraded once: the new instance serves, the old one holds before
    /// it exits.
    async fn before_exit() -> Held {
        Held::upgraded(Held::start("hold-before-exit").await).await
    }

    /// Upgraded once, the old instance holding before it exits and the new
    /// one (its pid returned) holding inside its stop, when it stops.
    async fn held_in_stop() -> (Held, u32) {
        let h =
            Held::upgraded(Held::start_holding(&["hold-before-exit", "hold-in-stop"]).await).await;
        let new = broker_pid(&h.socket).await;
        assert_ne!(new, h.old.0.id(), "the new instance serves");
        (h, new)
    }

    async fn upgraded(h: Held) -> Held {
        signal(&h.old.0, rustix::process::Signal::USR2);
        wait_log(&h.log, "upgrade: the new instance serves; exiting").await;
        h
    }

    /// The code of the client's close frame (the broker's log if the
    /// connection ends without one).
    async fn closed_with(&mut self) -> u16 {
        close_code(&mut self.client, &self.log).await
    }
}

/// The close code `client` gets, after any events; a connection that ends
/// without a close frame (a forced stop) fails with the broker's `log`.
async fn close_code(client: &mut WsClient, log: &Path) -> u16 {
    loop {
        match client.recv().await {
            Got::Json(_) => continue,
            Got::Close(code, _) => return code,
            Got::Eof => panic!(
                "the connection ended without a close frame\n{}",
                log_text(log)
            ),
        }
    }
}

/// After an upgrade the old instance lets go of what it moved at the
/// lowest priority before it exits, which on a busy machine can take most
/// of a second (the test hook holds it there). A `SIGTERM` sent to its pid
/// meanwhile is the new instance's: passed on as the word `stop`, so the
/// new instance stops politely (its clients closed `1001`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_asked_of_the_old_instance_while_it_exits_stops_the_new_one() {
    let mut h = Held::before_exit().await;
    let new = broker_pid(&h.socket).await;
    assert_ne!(new, h.old.0.id(), "the new instance serves");
    signal(&h.old.0, rustix::process::Signal::TERM);
    let (code, _) = h.client.expect_close().await;
    assert_eq!(code, 1001, "the new instance stopped\n{}", log_text(&h.log));
    wait_log(&h.log, "a stop was asked as this process exits: passed on").await;
    std::fs::write(&h.go, "").unwrap();
    assert!(
        exits_with(&mut h.old.0).await.success(),
        "{}",
        log_text(&h.log)
    );
    eventually("no broker serves the socket", || {
        serve_processes(&h.socket).is_empty()
    })
    .await;
}

/// A broker in `dir` against `gw`, the test hook set to `hook`, with one
/// client connected: (the broker, its socket, its log, the client).
async fn serve_hooked(
    dir: &Path,
    gw: &MockGateway,
    hook: &str,
) -> (ChildGuard, PathBuf, PathBuf, WsClient) {
    let (broker, socket, log, _) =
        serve_configured(dir, gw, "", &[("CLAWMUX_TEST_UPGRADE_FAULT", hook)]).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    (broker, socket, log, client)
}

/// A broker in `dir` against `gw`, the test hook set to `hold`, with one
/// client connected, upgraded once: (the first instance, the socket, the
/// log, the client, the second instance's pid).
async fn upgraded_holding(
    dir: &Path,
    gw: &MockGateway,
    hold: &str,
) -> (ChildGuard, PathBuf, PathBuf, WsClient, u32) {
    let (first, socket, log, client) = serve_hooked(dir, gw, hold).await;
    signal(&first.0, rustix::process::Signal::USR2);
    wait_log(&log, "upgrade: the new instance serves; exiting").await;
    let second = broker_pid(&socket).await;
    (first, socket, log, client, second)
}

/// Two upgrades in a row, the first instance still letting go (held) when
/// the second hands over to a third: a stop sent to the first one's pid
/// is passed on as the word `stop` to the second, which is no longer
/// serving and relays it to the third, whether the word comes while the
/// second hands over (`during`, the third held before it says `ready`) or
/// after, as the second exits. The third stops politely (its client closed
/// `1001`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_asked_of_the_first_instance_reaches_the_third_when_the_second_upgrades_before_the_first_exits(
) {
    for during in [true, false] {
        let gw = MockGateway::start(mock_config()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let exit = dir.path().join("exit");
        let ready = dir.path().join("ready");
        let hold = format!(
            "hold-before-exit:{},hold-before-ready:{}",
            exit.display(),
            ready.display()
        );
        // The first upgrade passes `ready` at once.
        std::fs::write(&ready, "").unwrap();
        let (mut first, socket, log, mut client, second) =
            upgraded_holding(dir.path(), &gw, &hold).await;
        let _second = Pid(second);
        if during {
            std::fs::remove_file(&ready).unwrap();
        }
        signal_pid(second, rustix::process::Signal::USR2);
        if during {
            wait_log_times(&log, "took the clients over", 2).await;
        } else {
            wait_log_times(&log, "upgrade: the new instance serves; exiting", 2).await;
        }
        let _third = Pid(started_pid(&log, 2));
        signal(&first.0, rustix::process::Signal::TERM);
        wait_log(&log, "a stop was asked as this process exits: passed on").await;
        if during {
            std::fs::write(&ready, "").unwrap();
        }
        let code = close_code(&mut client, &log).await;
        assert_eq!(code, 1001, "the third instance stopped\n{}", log_text(&log));
        // The second one logs its pass-on once it has written it.
        wait_log_times(&log, "passed on to the new instance", 2).await;
        let text = log_text(&log);
        assert_eq!(
            text.matches("passed on to the new instance").count(),
            2,
            "each of the first two passed the stop on once\n{text}"
        );
        // The second relays the word during its handover, or as it exits.
        let (relayed, times) = if during {
            ("a stop was asked during the handover: passed on", 1)
        } else {
            ("a stop was asked as this process exits: passed on", 2)
        };
        assert_eq!(text.matches(relayed).count(), times, "{text}");
        std::fs::write(&exit, "").unwrap();
        assert!(
            exits_with(&mut first.0).await.success(),
            "{}",
            log_text(&log)
        );
        eventually("no broker serves the socket", || {
            serve_processes(&socket).is_empty()
        })
        .await;
    }
}

/// As above, the second instance done letting go before the stop reaches
/// the first (each instance holds before it lets go until a file named
/// with its own pid exists): the second stays, relaying, until the first
/// has exited, so the stop still reaches the third.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_instance_that_has_let_go_relays_for_its_predecessor_until_that_one_exits() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let exit = |pid: u32| dir.path().join(format!("exit-{pid}"));
    let hold = format!("hold-before-exit:{}", dir.path().join("exit-%p").display());
    let (mut first, socket, log, mut client, second) =
        upgraded_holding(dir.path(), &gw, &hold).await;
    let _second = Pid(second);
    signal_pid(second, rustix::process::Signal::USR2);
    wait_log_times(&log, "upgrade: the new instance serves; exiting", 2).await;
    let _third = Pid(started_pid(&log, 2));
    std::fs::write(exit(second), "").unwrap();
    wait_log(
        &log,
        "relaying for the previous instance until it exits too",
    )
    .await;
    signal(&first.0, rustix::process::Signal::TERM);
    let code = close_code(&mut client, &log).await;
    assert_eq!(code, 1001, "the third instance stopped\n{}", log_text(&log));
    std::fs::write(exit(first.0.id()), "").unwrap();
    assert!(
        exits_with(&mut first.0).await.success(),
        "{}",
        log_text(&log)
    );
    eventually("the second instance ends with the first", || !alive(second)).await;
    eventually("no broker serves the socket", || {
        serve_processes(&socket).is_empty()
    })
    .await;
}

/// As above, a reload (`SIGHUP`) and an upgrade (`SIGUSR2`) sent to the
/// old instance's pid while it lets go are passed on: the new instance
/// re-reads its settings, then hands over to a third, and every client
/// stays connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_and_an_upgrade_asked_of_the_old_instance_while_it_exits_reach_the_new_one() {
    let mut h = Held::before_exit().await;
    let second = broker_pid(&h.socket).await;
    assert!(
        !log_text(&h.log).contains("settings reloaded"),
        "{}",
        log_text(&h.log)
    );
    signal(&h.old.0, rustix::process::Signal::HUP);
    wait_log(&h.log, "settings reloaded").await;
    signal(&h.old.0, rustix::process::Signal::USR2);
    // The second instance hands over to a third, then holds as the first.
    wait_log_times(&h.log, "upgrade: the new instance serves; exiting", 2).await;
    let third = Pid(broker_pid(&h.socket).await);
    assert!(
        third.0 != second && third.0 != h.old.0.id(),
        "a third instance serves\n{}",
        log_text(&h.log)
    );
    std::fs::write(&h.go, "").unwrap();
    assert!(
        exits_with(&mut h.old.0).await.success(),
        "{}",
        log_text(&h.log)
    );
    eventually("the second instance exited", || !alive(second)).await;
    let res = h.client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "the client stays connected: {res}");
}

/// A stop signalled to the whole group during an upgrade (systemd's
/// `KillMode=control-group`, a terminal's Ctrl-C) reaches the old and the
/// new instance both: the new one stops once, politely (exit 0, its clients
/// closed `1001`); the old one's word that a stop was asked of it too is
/// not a second signal, which would force the new one's stop (exit 3).
/// The new instance is held (a test hook) with everything taken over and
/// the old one waiting for its `ready` while both get the signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_signalled_to_both_instances_during_an_upgrade_is_one_polite_stop() {
    let mut h = Held::start("hold-before-ready").await;
    signal(&h.old.0, rustix::process::Signal::USR2);
    wait_log(&h.log, "took the clients over").await;
    let new = started_pid(&h.log, 1);
    let _new = Pid(new);
    // The group's stop: both get it.
    signal(&h.old.0, rustix::process::Signal::TERM);
    signal_pid(new, rustix::process::Signal::TERM);
    std::fs::write(&h.go, "").unwrap();
    assert!(
        exits_with(&mut h.old.0).await.success(),
        "{}",
        log_text(&h.log)
    );
    let code = h.closed_with().await;
    assert_eq!(code, 1001, "a polite stop\n{}", log_text(&h.log));
    eventually("the new instance ends", || !alive(new)).await;
    let text = log_text(&h.log);
    assert!(text.contains("upgrade: the new instance serves"), "{text}");
    // During the handover, or (its signal handled a moment later, on a
    // busy machine) as the old instance exits: passed on either way.
    assert!(
        text.contains("a stop was asked during the handover: passed on")
            || text.contains("a stop was asked as this process exits: passed on"),
        "{text}"
    );
    assert!(!text.contains("a second SIGTERM"), "{text}");
    assert!(text.contains("clawmux stopped"), "{text}");
}

/// The same group stop, its two signals in the other order: the old
/// instance's first, passed on as the word `stop`, which the new instance
/// acts on; its own `SIGTERM` comes while it stops (the test hook holds it
/// there). That is the same stop, not a second one, which would force the
/// stop (exit 3, the clients cut off without a close frame).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_stop_whose_signal_reaches_the_new_instance_after_the_word_is_one_polite_stop() {
    let (mut h, new) = Held::held_in_stop().await;
    let _new = Pid(new);
    signal(&h.old.0, rustix::process::Signal::TERM);
    wait_log(&h.log, "a stop passed on by the previous instance").await;
    signal_pid(new, rustix::process::Signal::TERM);
    eventually("the new instance heard its own SIGTERM", || {
        let text = log_text(&h.log);
        text.contains("from the previous instance: one stop") || text.contains("a second SIGTERM")
    })
    .await;
    std::fs::write(&h.go, "").unwrap();
    let code = h.closed_with().await;
    assert_eq!(code, 1001, "a polite stop\n{}", log_text(&h.log));
    assert!(
        exits_with(&mut h.old.0).await.success(),
        "{}",
        log_text(&h.log)
    );
    eventually("the new instance ends", || !alive(new)).await;
    let text = log_text(&h.log);
    assert!(!text.contains("a second SIGTERM"), "{text}");
    assert!(text.contains("clawmux stopped"), "{text}");
}

/// A `SIGTERM` and a `SIGINT` sent to the old instance's pid while it hands
/// over are two stops: both go on as the word `stop` once the new instance
/// serves, and the second forces its stop (held inside its polite one by
/// the test hook: a file named with its pid that never comes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stops_sent_to_the_old_instance_during_the_handover_force_the_new_instances_stop() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let hold = format!(
        "hold-before-ready:{},hold-in-stop:{}",
        go.display(),
        dir.path().join("never-%p").display()
    );
    let (mut old, _socket, log, mut client) = serve_hooked(dir.path(), &gw, &hold).await;
    signal(&old.0, rustix::process::Signal::USR2);
    wait_log(&log, "took the clients over").await;
    let new = started_pid(&log, 1);
    let _new = Pid(new);
    signal(&old.0, rustix::process::Signal::TERM);
    signal(&old.0, rustix::process::Signal::INT);
    std::fs::write(&go, "").unwrap();
    wait_log(
        &log,
        "a second stop passed on by the previous instance during shutdown: exiting now",
    )
    .await;
    assert!(exits_with(&mut old.0).await.success(), "{}", log_text(&log));
    eventually("the new instance ends", || !alive(new)).await;
    assert!(
        matches!(client.recv().await, Got::Eof),
        "a forced stop closes nothing\n{}",
        log_text(&log)
    );
}

/// Two stops sent to the old instance's pid while it exits are two stops:
/// both go on as the word `stop`, and the second forces the new instance's
/// stop (held inside its polite one by the test hook), as a second
/// `SIGTERM` to a broker that did not upgrade does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stop_sent_to_the_old_instance_while_it_exits_forces_the_new_instances_stop() {
    let (mut h, new) = Held::held_in_stop().await;
    let _new = Pid(new);
    signal(&h.old.0, rustix::process::Signal::TERM);
    wait_log(&h.log, "stop requested").await;
    signal(&h.old.0, rustix::process::Signal::TERM);
    wait_log(
        &h.log,
        "a second stop passed on by the previous instance during shutdown: exiting now",
    )
    .await;
    eventually("the new instance ends", || !alive(new)).await;
    // The old instance still holds the moved sockets until it lets go.
    std::fs::write(&h.go, "").unwrap();
    assert!(
        exits_with(&mut h.old.0).await.success(),
        "{}",
        log_text(&h.log)
    );
    assert!(
        matches!(h.client.recv().await, Got::Eof),
        "a forced stop closes nothing\n{}",
        log_text(&h.log)
    );
}

/// A broker run from a copy of the binary (replaceable, as an upgrade
/// replaces it) that reads its gateway from `config.toml`: gateway A at
/// first; gateway B wants its own token. With one client connected.
struct TwoGateways {
    gw_a: MockGateway,
    gw_b: MockGateway,
    _dir: tempfile::TempDir,
    program: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    old: ChildGuard,
    client: WsClient,
}

impl TwoGateways {
    async fn start() -> TwoGateways {
        Self::start_with(false).await
    }

    /// `hold`: an upgrade's new instance waits before its `ready` (the
    /// test hook) until `go` exists in the harness's directory.
    async fn start_with(hold: bool) -> TwoGateways {
        let gw_a = MockGateway::start(mock_config()).await.unwrap();
        let gw_b = MockGateway::start(MockConfig {
            token: Some("token-b".into()),
            ..mock_config()
        })
        .await
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let program = copied_binary(dir.path());
        let config = dir.path().join("config.toml");
        Self::write_config(&config, &gw_a.url(), "test-token");
        let socket = dir.path().join("c.sock");
        let mut cmd = serve_unconfigured(&program, dir.path(), &socket);
        cmd.arg("--config").arg(&config);
        if hold {
            let go = dir.path().join("go");
            cmd.env(
                "CLAWMUX_TEST_UPGRADE_FAULT",
                format!("hold-before-ready:{}", go.display()),
            );
        }
        let log = log_to(&mut cmd, dir.path());
        let old = ChildGuard(cmd.spawn().unwrap());
        eventually("socket exists", || socket.exists()).await;
        crate::http_api::until_ready(&socket).await;
        let mut client = WsClient::open(&socket, "/ws").await;
        client.handshake().await;
        TwoGateways {
            gw_a,
            gw_b,
            _dir: dir,
            program,
            config,
            socket,
            log,
            old,
            client,
        }
    }

    fn write_config(config: &Path, url: &str, token: &str) {
        std::fs::write(
            config,
            format!("[gateway]\nurl = \"{url}\"\ntoken = \"{token}\"\n"),
        )
        .unwrap();
        std::fs::set_permissions(config, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
    }

    /// Points the settings at gateway B and sends `SIGHUP`.
    fn reload_to_b(&self) {
        Self::write_config(&self.config, &self.gw_b.url(), "token-b");
        signal(&self.old.0, rustix::process::Signal::HUP);
    }

    /// Upgraded (started holding), with `reload` done while the new
    /// instance is held with everything taken over; the new instance.
    async fn upgraded_with_a_reload(&mut self, reload: impl FnOnce(&TwoGateways)) -> Pid {
        signal(&self.old.0, rustix::process::Signal::USR2);
        wait_log(&self.log, "took the clients over").await;
        reload(self);
        wait_log(&self.log, "settings reloaded").await;
        std::fs::write(self._dir.path().join("go"), "").unwrap();
        assert!(
            exits_with(&mut self.old.0).await.success(),
            "{}",
            log_text(&self.log)
        );
        Pid(broker_pid(&self.socket).await)
    }

    /// After an upgrade failed: the instance serving again is the old one,
    /// on gateway B.
    async fn assert_serving_again_on_b(&mut self) {
        wait_log(&self.log, "upgrade failed, still serving").await;
        assert_eq!(broker_pid(&self.socket).await, self.old.0.id());
        self.assert_on_b().await;
    }

    /// The serving broker is on gateway B, ready, and its client is served;
    /// gateway A has no connection left.
    async fn assert_on_b(&mut self) {
        assert!(
            self.gw_b.wait_ready_connections(1, PATIENCE).await,
            "{}",
            log_text(&self.log)
        );
        assert!(
            self.gw_a.wait_no_connections(PATIENCE).await,
            "{}",
            log_text(&self.log)
        );
        assert_eq!(
            state(&self.socket).await["upstream"]["url"],
            self.gw_b.url()
        );
        eventually_async("the broker's session is ready", || async {
            let phase = state(&self.socket).await["upstream"]["phase"].clone();
            if phase == "ready" {
                Ok(())
            } else {
                Err(phase)
            }
        })
        .await;
        assert_eq!(
            self.client.request("health", serde_json::json!({})).await["ok"],
            true
        );
    }
}

/// A new binary that says valid, takes the release, and dies once `go`
/// exists (at once without one).
fn dying_after_the_release(go: Option<&Path>) -> String {
    let wait = go.map_or(String::new(), |go| {
        format!(
            "i=0; while [ ! -e '{}' ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done\n",
            go.display()
        )
    });
    format!(
        "#!/bin/bash\n\
         for kv in ${{CLAWMUX_HANDOVER_FDS//,/ }}; do case $kv in clawmux-control=*) fd=${{kv#*=}};; esac; done\n\
         echo valid >&$fd\n\
         read -r line <&$fd\n\
         {wait}exit 1\n"
    )
}

/// A reload by `SIGHUP` pointed the broker at another gateway; an upgrade
/// then failed after the old instance had stopped: serving again, it goes
/// on with the reloaded settings (`/v1/state` and its next reconnect name
/// the new gateway), not the ones it was started with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upgrade_serves_again_with_the_settings_a_reload_brought() {
    let mut h = TwoGateways::start().await;
    // The reload: the session moves to gateway B, the client stays.
    h.reload_to_b();
    loop {
        let e = h.client.event("clawmux.upstream").await;
        if e["payload"]["phase"] == "ready" {
            break;
        }
    }
    assert_eq!(h.gw_b.total_connections(), 1, "{}", log_text(&h.log));
    replace_with_script(&h.program, &dying_after_the_release(None));
    signal(&h.old.0, rustix::process::Signal::USR2);
    h.assert_serving_again_on_b().await;
    // The same connection to B went on; when B restarts, the broker
    // reconnects to B, never to A.
    assert_eq!(h.gw_b.total_connections(), 1, "{}", log_text(&h.log));
    h.gw_b.close_all(1012, "service restart").await;
    assert!(
        h.gw_b.wait_ready_connections(1, PATIENCE).await,
        "{}",
        log_text(&h.log)
    );
    assert_eq!(h.gw_b.total_connections(), 2, "{}", log_text(&h.log));
    assert_eq!(h.gw_a.total_connections(), 1, "{}", log_text(&h.log));
    let last = h.gw_b.connects().last().cloned().unwrap();
    assert_eq!(last["auth"]["token"], "token-b");
}

/// The same, with the reload arriving during the upgrade: after the old
/// instance released (it waits for the new one's `ready`), a `SIGHUP`
/// points it at gateway B; the new instance then dies. The old instance
/// serving again follows the reload: its session moves to B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_during_an_upgrade_that_fails_is_kept_by_the_instance_serving_again() {
    let mut h = TwoGateways::start().await;
    let go = h._dir.path().join("go");
    replace_with_script(&h.program, &dying_after_the_release(Some(&go)));
    signal(&h.old.0, rustix::process::Signal::USR2);
    wait_log(&h.log, "handover: clients ready to move").await;
    h.reload_to_b();
    wait_log(&h.log, "settings reloaded").await;
    std::fs::write(&go, "").unwrap();
    h.assert_serving_again_on_b().await;
}

/// A reload during an upgrade that succeeds: the new instance read the
/// settings at its start, before the edit and the `SIGHUP` (it is held with
/// everything taken over); the old one passes the reload on, and the new
/// one's session moves to gateway B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_during_an_upgrade_that_succeeds_reaches_the_new_instance() {
    let mut h = TwoGateways::start_with(true).await;
    let _new = h.upgraded_with_a_reload(TwoGateways::reload_to_b).await;
    h.assert_on_b().await;
}

/// A reload asked of the old instance during an upgrade that succeeds,
/// whatever it changed, is passed on: the new instance, which read the
/// settings at its start, reads them again (the log says `settings
/// reloaded` twice, once for each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_reload_during_an_upgrade_that_succeeds_is_passed_on_to_the_new_instance() {
    let mut h = TwoGateways::start_with(true).await;
    let _new = h
        .upgraded_with_a_reload(|h| signal(&h.old.0, rustix::process::Signal::HUP))
        .await;
    wait_log_times(&h.log, "settings reloaded", 2).await;
    let text = log_text(&h.log);
    assert!(
        text.contains("a reload was asked of this instance: passed on"),
        "{text}"
    );
}

/// `clawmux serve` from the binary under test against the double `gw`,
/// with `config.toml` in `dir` holding `config` and the environment `env`
/// added, once its gateway session is ready: (the child, its socket, its
/// log, the config file).
async fn serve_configured(
    dir: &Path,
    gw: &MockGateway,
    config: &str,
    env: &[(&str, &str)],
) -> (ChildGuard, PathBuf, PathBuf, PathBuf) {
    let socket = dir.join("c.sock");
    let config_path = dir.join("config.toml");
    std::fs::write(&config_path, config).unwrap();
    let mut cmd = serve_command(Path::new(BIN), dir, &socket, &gw.url());
    cmd.arg("--config").arg(&config_path);
    cmd.envs(env.iter().copied());
    let log = log_to(&mut cmd, dir);
    let child = ChildGuard(cmd.spawn().unwrap());
    eventually("socket exists", || socket.exists()).await;
    crate::http_api::until_ready(&socket).await;
    (child, socket, log, config_path)
}

/// A broker whose upgrades' new instance exits at `fault`
/// (`CLAWMUX_TEST_UPGRADE_FAULT`, inherited: only a new instance reads
/// it), with a WebSocket client and an event stream, and a paced burst of
/// 120 numbered events (one every 5 ms) running.
struct FaultyUpgrade {
    gw: MockGateway,
    _dir: tempfile::TempDir,
    socket: PathBuf,
    log: PathBuf,
    old: ChildGuard,
    pid: u32,
    client: WsClient,
    events: crate::http_api::Sse,
    burst: tokio::task::JoinHandle<()>,
}

impl FaultyUpgrade {
    async fn start(fault: &str) -> FaultyUpgrade {
        let gw = MockGateway::start(mock_config()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (old, socket, log, _) = serve_configured(
            dir.path(),
            &gw,
            "",
            &[("CLAWMUX_TEST_UPGRADE_FAULT", fault)],
        )
        .await;
        let pid = old.0.id();
        let mut client = WsClient::open(&socket, "/ws").await;
        client.handshake().await;
        let events = crate::http_api::open_events(&socket, "/v1/events?events=test.n", &[])
            .await
            .unwrap();
        let burst = tokio::spawn({
            let gw = gw.clone();
            async move {
                for n in 0..120 {
                    gw.broadcast("test.n", serde_json::json!({ "n": n }));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        FaultyUpgrade {
            gw,
            _dir: dir,
            socket,
            log,
            old,
            pid,
            client,
            events,
            burst,
        }
    }
}

/// The new instance takes everything over and then dies before it says
/// `ready` (the test hook holds it 300 ms first, during a paced burst):
/// it read and wrote nothing moved (its gate stayed closed), so the old
/// instance serves every client, stream and the gateway connection again,
/// exactly: each event once, in order, with contiguous seq, no gap told;
/// no probe refused (the new instance accepted nothing); one gateway
/// connection; the event log goes on with no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_that_dies_before_the_commit_touched_nothing_and_the_old_one_serves_on_exactly(
) {
    let f = FaultyUpgrade::start("before-ready").await;
    let (gw, socket, log, pid) = (f.gw.clone(), f.socket.clone(), f.log.clone(), f.pid);
    let (mut old, mut client, mut events) = (f.old, f.client, f.events);
    let burst = f.burst;
    let (stop, probes) = probe_continuously(socket.clone());
    signal_pid(pid, rustix::process::Signal::USR2);
    wait_log(&log, "upgrade failed, still serving").await;
    burst.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let (probed, failures) = probes.await.unwrap();
    assert!(probed > 0);
    assert_eq!(
        failures,
        0,
        "{failures} of {probed} probes failed\n{}",
        log_text(&log)
    );
    let text = log_text(&log);
    assert!(text.contains("=before-ready: exiting"), "{text}");
    let mut last_seq = 0;
    let mut want = 0;
    while want < 120 {
        let what = format!("after n {want}");
        if let Some(got) = next_numbered(&mut client, &mut last_seq, &what, &log).await {
            assert_eq!(got, want, "{}", log_text(&log));
            want += 1;
        }
    }
    let mut first_id = None;
    for want in 0..120 {
        let (id, name, data) = events.next_event().await;
        first_id.get_or_insert(id);
        assert_eq!(name, "test.n", "{data}");
        assert_eq!(data["payload"]["n"], want, "{data}\n{}", log_text(&log));
    }
    // Nothing more (a repeat) is on its way.
    gw.broadcast("test.n", serde_json::json!({ "n": 120 }));
    assert_eq!(client.event("test.n").await["payload"]["n"], 120);
    assert_eq!(events.next_event().await.2["payload"]["n"], 120);
    assert_eq!(gw.total_connections(), 1, "{}", log_text(&log));
    assert_eq!(broker_pid(&socket).await, pid);
    // History equals live: every event once, no gap, across the attempt.
    assert_history_numbered(&socket, first_id.unwrap(), 121, &log).await;
    signal(&old.0, rustix::process::Signal::TERM);
    assert!(exits_with(&mut old.0).await.success());
}

/// The new instance dies after the commit (the hook lets it serve 300 ms
/// first, during a paced burst): its clients lose their connection, never
/// a repeat (the old instance touches none of them again) and reconnect to
/// the old instance, which serves on; an event stream resuming by cursor
/// gets each event at most once, and a `clawmux.gap` where some are lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_that_dies_after_the_commit_costs_a_reconnect_never_a_repeat() {
    let f = FaultyUpgrade::start("after-commit").await;
    let (gw, socket, log, pid) = (f.gw.clone(), f.socket.clone(), f.log.clone(), f.pid);
    let (mut old, mut client, mut events) = (f.old, f.client, f.events);
    let burst = f.burst;
    signal_pid(pid, rustix::process::Signal::USR2);
    wait_log(&log, "after the commit: its clients reconnect").await;
    burst.await.unwrap();
    wait_log(&log, "=after-commit: exiting").await;
    // The WebSocket client: every event once, in order, then the end.
    let (mut last_seq, mut last_n) = (0, -1);
    let end = loop {
        match client.recv_within(PATIENCE * 2).await {
            Some(Got::Json(v)) if v["type"] == "event" => {
                let seq = v["seq"].as_u64().expect("events carry seq");
                assert!(
                    last_seq == 0 || seq == last_seq + 1,
                    "seq {last_seq} then {seq}: {v}"
                );
                last_seq = seq;
                if v["event"] == "test.n" {
                    let n = v["payload"]["n"].as_i64().unwrap();
                    assert_eq!(n, last_n + 1, "{v}\n{}", log_text(&log));
                    last_n = n;
                }
            }
            Some(Got::Json(_)) => {}
            other => break other,
        }
    };
    assert!(
        matches!(end, Some(Got::Eof | Got::Close(..)) | None),
        "{end:?}"
    );
    // The old instance serves on, for a client reconnecting.
    let mut again = WsClient::open(&socket, "/ws").await;
    again.handshake().await;
    assert_eq!(broker_pid(&socket).await, pid);
    // The event stream: each event at most once, in order, until its
    // response ends; resumed by cursor, the rest, a gap told where events
    // were lost.
    let (mut last_id, mut seen) = (0, Vec::new());
    while let Some(item) = events.next_item_or_end(PATIENCE * 2).await {
        if let crate::http_api::Item::Event { id, name, data, .. } = item {
            assert!(id > last_id, "id {id} after {last_id}");
            last_id = id;
            if name == "test.n" {
                seen.push(data["payload"]["n"].as_i64().unwrap());
            }
        }
    }
    let mut resumed = crate::http_api::open_events(
        &socket,
        &format!("/v1/events?events=test.n,clawmux.gap&after_seq={last_id}"),
        &[],
    )
    .await
    .unwrap();
    crate::http_api::until_ready(&socket).await;
    gw.broadcast("test.n", serde_json::json!({ "n": 1000 }));
    let mut gap_told = false;
    loop {
        let (id, name, data) = resumed.next_event().await;
        assert!(id > last_id, "id {id} after {last_id}");
        last_id = id;
        if name == "clawmux.gap" {
            gap_told = true;
            continue;
        }
        let n = data["payload"]["n"].as_i64().unwrap();
        let previous = seen.last().copied().unwrap_or(-1);
        assert!(
            n > previous,
            "{n} after {previous}: a repeat\n{}",
            log_text(&log)
        );
        assert!(
            n == previous + 1 || gap_told,
            "{n} after {previous} with no gap told"
        );
        seen.push(n);
        if n == 1000 {
            break;
        }
    }
    assert!(gap_told, "the restart is told: {seen:?}");
    signal(&old.0, rustix::process::Signal::TERM);
    assert!(exits_with(&mut old.0).await.success());
}

/// A stand-in for systemd's notify socket that keeps what `FDSTORE=1`
/// stores, by `FDNAME=`, and forgets what `FDSTOREREMOVE=1` removes.
struct Store {
    sock: std::os::unix::net::UnixDatagram,
    path: PathBuf,
    fds: Vec<(String, OwnedFd)>,
    lines: Vec<String>,
}

impl Store {
    fn bind(dir: &Path) -> Store {
        let path = dir.join("notify");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        Store {
            sock,
            path,
            fds: Vec::new(),
            lines: Vec::new(),
        }
    }

    /// Waits for `child` to exit, taking what it stores meanwhile, as
    /// systemd does (a notify socket nobody reads holds 10 messages, and a
    /// store sends one per descriptor).
    async fn drain_until_exit(
        &mut self,
        child: &mut std::process::Child,
    ) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + PATIENCE * 4;
        loop {
            tokio::task::block_in_place(|| self.drain());
            if let Some(status) = child.try_wait().unwrap() {
                self.drain();
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the broker exits in time"
            );
        }
    }

    /// Takes every message waiting (bounded by a quiet 50 ms).
    fn drain(&mut self) {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        use std::mem::MaybeUninit;
        loop {
            let mut buf = [0u8; 4096];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                &self.sock,
                &mut [std::io::IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            );
            let Ok(got) = got else { return };
            let mut fds = Vec::new();
            for msg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = msg {
                    fds.extend(rights);
                }
            }
            let text = String::from_utf8_lossy(&buf[..got.bytes]).into_owned();
            let lines: Vec<&str> = text.lines().collect();
            let name = lines
                .iter()
                .find_map(|l| l.strip_prefix("FDNAME="))
                .unwrap_or("stored");
            if lines.contains(&"FDSTORE=1") {
                for fd in fds {
                    self.fds.push((name.to_owned(), fd));
                }
            }
            if lines.contains(&"FDSTOREREMOVE=1") {
                self.fds.retain(|(n, _)| n != name);
            }
            self.lines.extend(lines.iter().map(|l| l.to_string()));
        }
    }
}

/// The next start as systemd does it: the stored descriptors from fd 3 on,
/// `LISTEN_FDS`, `LISTEN_FDNAMES`, and `LISTEN_PID` = the binary's own pid
/// (a shell that then `exec`s it keeps its pid).
fn start_with_stored(
    cmd: Command,
    fds: Vec<(String, OwnedFd)>,
    notify: &Path,
    log: Option<&Path>,
) -> std::process::Child {
    let names: Vec<String> = fds.iter().map(|(n, _)| n.clone()).collect();
    let raw: Vec<i32> = fds.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
    let program = cmd.get_program().to_owned();
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let mut sh = Command::new("/bin/sh");
    sh.arg("-c")
        .arg(r#"LISTEN_PID=$$ exec "$0" "$@""#)
        .arg(program)
        .args(args);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => sh.env(k, v),
            None => sh.env_remove(k),
        };
    }
    sh.env("LISTEN_FDS", raw.len().to_string())
        .env("LISTEN_FDNAMES", names.join(":"))
        .env("NOTIFY_SOCKET", notify)
        .env("FDSTORE", "64")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(match log {
            Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
            None => Stdio::null(),
        });
    // SAFETY: the closure runs in the forked child before exec and calls only
    // dup/dup2/fcntl (async-signal-safe), allocating nothing. Each fd is first
    // moved above the target range (so a later dup2 cannot overwrite one not
    // yet placed), then placed at 3, 4, … without close-on-exec.
    unsafe {
        sh.pre_exec(move || {
            let mut high = [0i32; 16];
            for (i, fd) in raw.iter().enumerate() {
                high[i] = libc::fcntl(*fd, libc::F_DUPFD, 100);
                if high[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, fd) in high.iter().take(raw.len()).enumerate() {
                if libc::dup2(*fd, 3 + i as i32) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = sh.spawn().unwrap();
    drop(fds);
    child
}

/// `serve` under a stand-in for systemd with a file descriptor store
/// (`store`), whose job on the service is `job` (`restart`, `stop`); once
/// it serves. Its stderr is the caller's to set.
async fn serve_under_systemd(
    mut serve: Command,
    store: &Store,
    dir: &Path,
    socket: &Path,
    job: &str,
) -> ChildGuard {
    let child = ChildGuard(
        serve
            .env("NOTIFY_SOCKET", &store.path)
            .env("FDSTORE", "64")
            .env("PATH", fake_systemctl(dir, job))
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    crate::http_api::until_ready(socket).await;
    child
}

/// [`serve_under_systemd`] with a restart for the job, its log dropped.
async fn serve_to_be_restarted(
    mut serve: Command,
    store: &Store,
    dir: &Path,
    socket: &Path,
) -> ChildGuard {
    serve.stderr(Stdio::null());
    serve_under_systemd(serve, store, dir, socket, "restart").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemds_store_keeps_the_socket_across_a_restart_and_the_next_start_removes_the_state() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let mut store = Store::bind(dir.path());
    let serve = serve_command(Path::new(BIN), dir.path(), &socket, &gw.url());
    let mut first = serve_to_be_restarted(serve, &store, dir.path(), &socket).await;
    // A client connected across the restart.
    let mut client = WsClient::open(&socket, "/ws").await;
    let hello = client.handshake().await;
    let conn_id = hello["server"]["connId"].clone();
    // And a dedicated one, with its own gateway connection.
    let mut dedicated = WsClient::open(&socket, "/ws/dedicated").await;
    assert_eq!(dedicated.recv_json().await["event"], "connect.challenge");
    dedicated.send_json(&connect_frame("c1")).await;
    assert_eq!(dedicated.response("c1").await["ok"], true);
    // And an event stream.
    let mut events = crate::http_api::open_events(&socket, "/v1/events?events=test.n", &[])
        .await
        .unwrap();
    sigterm(&first.0);
    assert!(store.drain_until_exit(&mut first.0).await.success());
    let mut names: Vec<&str> = store.fds.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let clients = names
        .iter()
        .filter(|n| n.starts_with("clawmux-client-"))
        .count();
    assert_eq!(
        clients, 1,
        "the connected client's socket is stored: {names:?}"
    );
    names.retain(|n| !n.starts_with("clawmux-client-"));
    assert_eq!(
        names,
        [
            "clawmux-clients",
            "clawmux-dedicated-0",
            "clawmux-dedicated-0-gateway",
            "clawmux-listen",
            "clawmux-listen-lock",
            "clawmux-state",
            "clawmux-stream-0",
            "clawmux-upstream"
        ],
        "{:?}",
        store.lines
    );
    // Between the two lives the socket stays bound: a client that connects
    // now waits in its queue and is answered by the next start.
    assert!(socket.exists(), "the socket file stays for the next start");
    let waiting = tokio::spawn({
        let socket = socket.clone();
        async move { healthz(&socket).await }
    });
    let fds = std::mem::take(&mut store.fds);
    let next = start_with_stored(
        serve_command(Path::new(BIN), dir.path(), &socket, &gw.url()),
        fds,
        &store.path,
        None,
    );
    let mut next = ChildGuard(next);
    assert_eq!(
        waiting.await.unwrap(),
        Some(200),
        "the waiting client is served"
    );
    assert_eq!(broker_pid(&socket).await, next.0.id());
    // The client stayed connected, on the same gateway session (stored
    // too), and is served under its own connId.
    gw.broadcast("test.n", serde_json::json!({"n": 1}));
    let event = client.event("test.n").await;
    assert_eq!(event["payload"]["n"], 1);
    // The event stream was taken back too, on its same response.
    let (_, name, data) = events.next_event().await;
    assert_eq!(
        (name.as_str(), &data["payload"]["n"]),
        ("test.n", &serde_json::json!(1))
    );
    assert!(
        !client
            .events
            .iter()
            .any(|e| e["event"] == "clawmux.upstream"),
        "the gateway session went on: {:?}",
        client.events
    );
    assert_eq!(
        gw.total_connections(),
        2,
        "the shared session and the dedicated one"
    );
    dedicated
        .send_json(&serde_json::json!({"type":"req","id":"d2","method":"health"}))
        .await;
    assert_eq!(dedicated.response("d2").await["ok"], true);
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    let listed = state(&socket).await["clients"].clone();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["conn_id"] == conn_id),
        "{listed}"
    );
    // Read once: the next start removed what it took from the store.
    store.drain();
    for name in [
        "clawmux-state",
        "clawmux-clients",
        "clawmux-listen",
        "clawmux-listen-lock",
        "clawmux-upstream",
        "clawmux-dedicated-0",
        "clawmux-dedicated-0-gateway",
    ] {
        assert!(
            store.lines.iter().any(|l| l == &format!("FDNAME={name}"))
                && store.lines.iter().any(|l| l == "FDSTOREREMOVE=1"),
            "{name} removed: {:?}",
            store.lines
        );
    }
    sigterm(&next.0);
    assert!(store.drain_until_exit(&mut next.0).await.success());
}

/// The frames queued for a client that is not reading travel beside the
/// clients document, in a memfd of their own: through systemd's store too,
/// where it is stored under its own name, and the next start gives each of
/// them to the client once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_not_reading_across_systemds_store_gets_its_queued_frames_once_in_order() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "[limits]\nsend_buffer_bytes = 8192\n").unwrap();
    let command = || {
        let mut cmd = serve_command(Path::new(BIN), dir.path(), &socket, &gw.url());
        cmd.arg("--config").arg(&config);
        cmd
    };
    let mut store = Store::bind(dir.path());
    let mut first = serve_to_be_restarted(command(), &store, dir.path(), &socket).await;
    let mut stuck = WsClient::open(&socket, "/ws").await;
    let stuck_id = stuck.handshake().await["server"]["connId"].clone();
    let mut reader = WsClient::open(&socket, "/ws").await;
    reader.handshake().await;
    // More than the stuck client's socket holds: the rest waits in its queue.
    const EVENTS: u64 = 40;
    flood_past(
        &gw,
        &mut reader,
        EVENTS,
        &socket,
        &stuck_id,
        "frames wait in its queue",
        |q| q > 0,
    )
    .await;
    sigterm(&first.0);
    assert!(store.drain_until_exit(&mut first.0).await.success());
    assert!(
        store.fds.iter().any(|(n, _)| n == "clawmux-frames"),
        "the queued frames are stored: {:?}",
        store.lines
    );
    let fds = std::mem::take(&mut store.fds);
    let mut next = ChildGuard(start_with_stored(command(), fds, &store.path, None));
    crate::http_api::until_ready(&socket).await;
    assert_eq!(broker_pid(&socket).await, next.0.id());
    let mut seq = None;
    for n in 0..EVENTS {
        let event = stuck.event("test.n").await;
        assert_eq!(event["payload"]["n"], n, "once each, in order");
        let this = event["seq"].as_u64().unwrap();
        if let Some(last) = seq {
            assert_eq!(this, last + 1, "contiguous seq");
        }
        seq = Some(this);
    }
    gw.broadcast("test.n", serde_json::json!({"n": EVENTS}));
    let after = stuck.event("test.n").await;
    assert_eq!(after["payload"]["n"], EVENTS);
    assert_eq!(after["seq"].as_u64(), seq.map(|s| s + 1));
    sigterm(&next.0);
    // It stores its clients for its own next start: the store is read.
    assert!(store.drain_until_exit(&mut next.0).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_state_this_version_cannot_read_starts_fresh() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let store = Store::bind(dir.path());
    // A state from a future format, with a descriptor that is not a listener.
    let state = rustix::fs::memfd_create("state", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    std::fs::File::from(state.try_clone().unwrap())
        .write_all_at(br#"{"format":99,"listeners":[],"clients":[]}"#, 0)
        .unwrap();
    let stray = rustix::fs::memfd_create("stray", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let log = dir.path().join("broker.log");
    let child = start_with_stored(
        serve_command(Path::new(BIN), dir.path(), &socket, &gw.url()),
        vec![
            ("clawmux-state".into(), state),
            ("clawmux-listen".into(), stray),
        ],
        &store.path,
        Some(&log),
    );
    let _child = ChildGuard(child);
    eventually("socket exists", || socket.exists()).await;
    assert_eq!(healthz(&socket).await, Some(200));
    wait_log(&log, "starting fresh").await;
    wait_log(&log, "format 99").await;
}

use std::os::unix::fs::FileExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_in_flight_at_a_handover_is_answered_once_by_the_next_instance() {
    let mut cfg = mock_config();
    // A run long enough to be in flight when the broker hands over.
    cfg.run_step_delay = Duration::from_millis(300);
    let gw = MockGateway::start(cfg).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    let key = uuid::Uuid::new_v4().to_string();
    client
        .send_json(
            &serde_json::json!({"type": "req", "id": "run1", "method": "agent",
            "params": {"message": "go", "idempotencyKey": key}}),
        )
        .await;
    let accepted = client.response("run1").await;
    assert_eq!(accepted["payload"]["status"], "accepted", "{accepted}");
    signal_pid(pid, rustix::process::Signal::USR2);
    assert!(
        exits_with(&mut first.0).await.success(),
        "{}",
        log_text(&log)
    );
    let next = broker_pid(&socket).await;
    let _next = Pid(next);
    // The gateway session moved with the client: the run's final answer
    // arrives on it, at the new instance, which delivers it once.
    let last = loop {
        match client.recv_within(PATIENCE * 2).await {
            Some(Got::Json(v)) if v["type"] == "res" && v["id"] == "run1" => break v,
            Some(Got::Json(v)) => client.events.push(v),
            other => panic!("no final answer ({other:?}); log:\n{}", log_text(&log)),
        }
    };
    assert_eq!(last["ok"], true, "{last}\n{}", log_text(&log));
    assert_eq!(last["payload"]["status"], "ok", "{last}");
    // Nothing more for run1: a later request's answer comes after anything
    // queued before it.
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    let resent = client
        .events
        .iter()
        .filter(|v| v["type"] == "res" && v["id"] == "run1")
        .count();
    assert_eq!(resent, 0, "run1 answered more than once");
    assert_eq!(
        gw.total_connections(),
        1,
        "the gateway saw one connection\n{}",
        log_text(&log)
    );
}

/// Nothing in a handover waits for a client: one that is half way through
/// sending a request and has stopped reading (its socket full in the
/// middle of a batch, the broker's send buffer set small) moves at once
/// with the half it sent and the batch as far as its socket took it. It
/// stays connected, its request is answered once it sends the rest, and it
/// receives every event once, in order, with contiguous `seq`; the other
/// client moves too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_half_way_through_a_message_and_not_reading_moves_with_its_half_written_bytes() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log, _) =
        serve_configured(dir.path(), &gw, "[limits]\nsend_buffer_bytes = 8192\n", &[]).await;
    let pid = broker_pid(&socket).await;
    let mut stuck = WsClient::open(&socket, "/ws").await;
    let stuck_id = stuck.handshake().await["server"]["connId"].clone();
    let mut mover = WsClient::open(&socket, "/ws").await;
    let conn_id = mover.handshake().await["server"]["connId"].clone();
    // A request (`id` "half"), of which 10 bytes of the payload are sent now.
    let frame = half_request_frame();
    let (sent, rest) = frame.split_at(6 + 10);
    stuck.raw().write_all(sent).await.unwrap();
    // More events than the stuck client's socket holds: its writer takes a
    // batch and the socket takes only part of it.
    const EVENTS: u64 = 40;
    let took_a_batch = |q| q < EVENTS * 16 * 1024;
    flood_past(
        &gw,
        &mut mover,
        EVENTS,
        &socket,
        &stuck_id,
        "its writer took a batch",
        took_a_batch,
    )
    .await;
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    assert!(
        !log_text(&log).contains("could not move"),
        "{}",
        log_text(&log)
    );
    assert_listed(&socket, &stuck_id, "the client that was not reading moved").await;
    assert_listed(&socket, &conn_id, "the other client moved").await;
    // It reads again and sends the rest of its request.
    stuck.raw().write_all(rest).await.unwrap();
    let mut seq = None;
    for n in 0..EVENTS {
        let event = stuck.event("test.n").await;
        assert_eq!(event["payload"]["n"], n, "{}", log_text(&log));
        let this = event["seq"].as_u64().unwrap();
        if let Some(last) = seq {
            assert_eq!(this, last + 1, "contiguous seq");
        }
        seq = Some(this);
    }
    let res = stuck.response("half").await;
    assert_eq!(res["ok"], true, "the half-sent request, answered: {res}");
    gw.broadcast("test.n", serde_json::json!({"n": EVENTS}));
    let next = stuck.event("test.n").await;
    assert_eq!(next["payload"]["n"], EVENTS);
    assert_eq!(next["seq"].as_u64(), seq.map(|s| s + 1));
    let res = mover.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
}

/// Sends `events` numbered events of 16 KiB, each read by `reader`: more
/// than a client that is not reading (`stuck`, its send buffer set small)
/// can take; then waits until that client's queued bytes pass `queued`.
async fn flood_past(
    gw: &MockGateway,
    reader: &mut WsClient,
    events: u64,
    socket: &Path,
    stuck: &serde_json::Value,
    what: &str,
    queued: impl Fn(u64) -> bool,
) {
    let pad = "x".repeat(16 * 1024);
    for n in 0..events {
        gw.broadcast("test.n", serde_json::json!({"n": n, "pad": pad}));
        assert_eq!(reader.event("test.n").await["payload"]["n"], n);
    }
    let what = format!("the client that is not reading: {what}");
    crate::support::eventually_async(&what, || async {
        let clients = state(socket).await["clients"].clone();
        let bytes = clients
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["conn_id"] == *stuck)
            .map(|c| c["queue_bytes"].as_u64().unwrap());
        match bytes {
            Some(q) if queued(q) => Ok(()),
            other => Err(format!("{other:?} bytes queued")),
        }
    })
    .await;
}

/// A masked text frame holding the whole request `health` (`id` "half"):
/// a client sends part of it before a handover and the rest after.
fn half_request_frame() -> Vec<u8> {
    let request = br#"{"type":"req","id":"half","method":"health","params":{}}"#;
    let mask = [1u8, 2, 3, 4];
    let mut frame = vec![0x81, 0x80 | request.len() as u8];
    frame.extend(mask);
    frame.extend(request.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame
}

/// The `test.n` numbers of the whole records in a raw `/v1/events`
/// response (head, then a chunked body), and whether a chunk was cut.
fn numbers_in_raw_stream(raw: &[u8]) -> Vec<u64> {
    let Some(head_end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Vec::new();
    };
    let mut rest = &raw[head_end + 4..];
    let mut body = Vec::new();
    // Chunks: a hex size line, the bytes, CRLF (RFC 9112 §7.1).
    while let Some(line_end) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&rest[..line_end]).unwrap();
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size line");
        if size == 0 || rest.len() < line_end + 2 + size + 2 {
            break;
        }
        body.extend_from_slice(&rest[line_end + 2..line_end + 2 + size]);
        assert_eq!(&rest[line_end + 2 + size..line_end + 4 + size], b"\r\n");
        rest = &rest[line_end + 4 + size..];
    }
    let text = String::from_utf8(body).expect("UTF-8 records");
    let mut numbers = Vec::new();
    let mut records: Vec<&str> = text.split("\n\n").collect();
    records.pop(); // the part after the last blank line (not whole yet)
    for record in records {
        if !record.lines().any(|l| l == "event: test.n") {
            continue;
        }
        let data = record
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .expect("a data line");
        let data: serde_json::Value = serde_json::from_str(data).unwrap();
        numbers.push(data["payload"]["n"].as_u64().unwrap());
    }
    numbers
}

/// An event stream whose reader has stopped reading (`clawmux tail | less`
/// paused), its socket full in the middle of a chunk (the broker's send
/// buffer set small), does not hold up a handover: it moves at once with
/// the bytes its socket had not taken, stays open, and once its reader
/// reads again it has every event once, in order, with whole chunks; a
/// stream that reads moves too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_whose_reader_stopped_reading_moves_with_its_unwritten_bytes() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log, _) =
        serve_configured(dir.path(), &gw, "[limits]\nsend_buffer_bytes = 8192\n", &[]).await;
    let pid = broker_pid(&socket).await;
    let mut stuck_stream = UnixStream::connect(&socket).await.unwrap();
    stuck_stream
        .write_all(b"GET /v1/events?events=test.n HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut reading = crate::http_api::open_events(&socket, "/v1/events?events=test.n", &[])
        .await
        .unwrap();
    crate::support::eventually_async("both streams admitted", || async {
        let streams = state(&socket).await["clients"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["kind"] == "sse")
            .count();
        if streams == 2 {
            Ok(())
        } else {
            Err(streams)
        }
    })
    .await;
    const EVENTS: u64 = 64;
    let big = "x".repeat(16 * 1024);
    for n in 0..EVENTS {
        gw.broadcast("test.n", serde_json::json!({"n": n, "pad": big}));
        let (_, _, data) = reading.next_event().await;
        assert_eq!(data["payload"]["n"], n);
    }
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    assert!(
        !log_text(&log).contains("not at a chunk boundary in time"),
        "{}",
        log_text(&log)
    );
    gw.broadcast("test.n", serde_json::json!({"n": EVENTS}));
    let (_, _, data) = reading.next_event().await;
    assert_eq!(data["payload"]["n"], EVENTS, "{}", log_text(&log));
    // The stopped reader reads again: everything, once, in order.
    let mut raw = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let numbers = tokio::time::timeout(PATIENCE * 2, async {
        loop {
            let n = stuck_stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the stream ended: {}", log_text(&log));
            raw.extend_from_slice(&chunk[..n]);
            let numbers = numbers_in_raw_stream(&raw);
            if numbers.last() == Some(&EVENTS) {
                return numbers;
            }
        }
    })
    .await
    .expect("the moved stream goes on");
    assert_eq!(numbers, (0..=EVENTS).collect::<Vec<_>>());
}

/// A gateway stalled inside a message does not hold up a handover, nor
/// cost a reconnect: its connection moves with the part of the message
/// read so far, and the next instance parses the message whole once the
/// gateway sends the rest (one gateway connection throughout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stalled_inside_a_message_moves_with_the_part_read_so_far() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    let conn_id = client.handshake().await["server"]["connId"].clone();
    // An event whose first fragment arrives before the handover (the
    // upgrade takes far longer than the broker's read of it) and whose last
    // one after it.
    gw.send_fragment_start("{\"type\":\"event\",\"event\":\"test.half\"");
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    wait_log(&log, "upstream session handed over").await;
    gw.send_fragment_end(",\"payload\":{\"whole\":true}}");
    let event = client.event("test.half").await;
    assert_eq!(event["payload"]["whole"], true, "{event}");
    assert_eq!(gw.total_connections(), 1, "the same gateway connection");
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    assert_listed(&socket, &conn_id, "the client moved").await;
}

/// A gateway that stops reading while a client has sent far more than the
/// sockets between them hold: the broker has requests written in part,
/// held by its writer and queued. At a handover each of them is either
/// moved written (the next instance gets its answer once the gateway reads
/// again) or answered "not sent" at once; none waits for its timeout.
/// (The writer stopped inside a batch, which this cannot bring about on
/// purpose, is `a_writer_dropped_mid_batch_leaves_each_request_written_or_withdrawn`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_not_yet_written_to_a_gateway_that_stopped_reading_are_each_answered_across_a_handover(
) {
    const REQUESTS: usize = 200;
    let gw = MockGateway::start(clawmux_mock::MockConfig {
        recv_buffer_bytes: Some(4096),
        ..mock_config()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // A lost request would be answered `request_timeout` after 8 s.
    let config = "[limits]\nrequest_timeout_ms = 8000\n[upstream]\nwrite_timeout_ms = 60000\n";
    let (mut first, socket, log, _config) = serve_configured(dir.path(), &gw, config, &[]).await;
    let pid = broker_pid(&socket).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    send_to_a_gateway_not_reading(&gw, &mut client, "r", REQUESTS).await;
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    wait_log(&log, "upstream session handed over").await;
    gw.set_faults(clawmux_mock::Faults::default());
    let (answered, failed) = answers(&mut client, "r", REQUESTS, Duration::from_secs(20)).await;
    for (id, res) in &failed {
        let message = res["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("the request was not sent to the gateway"),
            "{id}: answered neither by the gateway nor as not sent: {res}"
        );
    }
    eprintln!(
        "{REQUESTS} requests: {answered} answered by the gateway, {} not sent",
        failed.len()
    );
    assert!(answered > 0, "some were written before the handover");
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "the client goes on: {res}");
}

/// A gateway connection that cannot move (`wss://`) ends with the old
/// instance, which answers each of its requests in flight (the gateway
/// stopped reading: some written, some still queued) into its client's
/// queue, with whether it was sent; the answers move with the client, once
/// each, with a zero shutdown timeout too, and with the session taking
/// 300 ms to answer them (the test hook): a handover that did not wait
/// for its answers would pack their clients without them. The new
/// instance opens its own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_a_gateway_connection_that_cannot_move_are_answered_across_a_zero_timeout_handover(
) {
    const REQUESTS: usize = 40;
    let leaf = crate::tls::leaf(&["openclaw-gateway"], None, false);
    let gw = MockGateway::start(clawmux_mock::MockConfig {
        recv_buffer_bytes: Some(4096),
        ..crate::tls::tls_config(&leaf)
    })
    .await
    .unwrap();
    assert!(gw.url().starts_with("wss://"), "{}", gw.url());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let mut cmd = serve_stopping_within(Path::new(BIN), dir.path(), &socket, "0");
    cmd.args(["--gateway-url", &gw.url(), "--token", "test-token"])
        .args(["--tls-fingerprint", &leaf.fingerprint])
        .env("CLAWMUX_TEST_UPGRADE_FAULT", "pause-before-answers:300");
    let log = log_to(&mut cmd, dir.path());
    let mut first = ChildGuard(cmd.spawn().unwrap());
    eventually("socket exists", || socket.exists()).await;
    crate::http_api::until_ready(&socket).await;
    let pid = broker_pid(&socket).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    send_to_a_gateway_not_reading(&gw, &mut client, "q", REQUESTS).await;
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    assert!(
        !log_text(&log).contains("upstream session handed over"),
        "a wss:// connection cannot move\n{}",
        log_text(&log)
    );
    gw.set_faults(clawmux_mock::Faults::default());
    let (_, failed) = answers(&mut client, "q", REQUESTS, PATIENCE).await;
    for (id, res) in &failed {
        assert!(
            res["error"]["details"]["sent"].is_boolean(),
            "{id}: answered with whether it was sent: {res}"
        );
    }
    assert!(
        !failed.is_empty(),
        "the session ended with requests in flight"
    );
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(
        res["ok"],
        true,
        "the client goes on: {res}\n{}",
        log_text(&log)
    );
    assert_eq!(gw.total_connections(), 2, "{}", log_text(&log));
    let answers = client
        .events
        .iter()
        .filter(|v| v["type"] == "res" && v["id"].as_str().is_some_and(|id| id.starts_with('q')))
        .count();
    assert_eq!(answers, 0, "each answered once");
}

/// Stops `gw` reading, then sends `n` `health` requests of 60 KiB each
/// (ids `{prefix}0`, `{prefix}1`, …): far more than the sockets hold, so
/// some are written and some wait in the broker. Each is under the size
/// that goes beside tungstenite: through it, so its write buffer fills and
/// the writer waits inside its batch.
async fn send_to_a_gateway_not_reading(
    gw: &MockGateway,
    client: &mut WsClient,
    prefix: &str,
    n: usize,
) {
    gw.set_faults(clawmux_mock::Faults {
        stop_reading: true,
        ..clawmux_mock::Faults::default()
    });
    let pad = "x".repeat(60 * 1024);
    for i in 0..n {
        client
            .send_json(&serde_json::json!({"type": "req", "id": format!("{prefix}{i}"), "method": "health", "params": {"pad": pad}}))
            .await;
    }
}

/// The answers to requests `{prefix}0` … `{prefix}{n-1}`, each awaited
/// within `within`: how many succeeded, and the others with their ids.
async fn answers(
    client: &mut WsClient,
    prefix: &str,
    n: usize,
    within: Duration,
) -> (usize, Vec<(String, serde_json::Value)>) {
    let (mut ok, mut failed) = (0, Vec::new());
    for i in 0..n {
        let id = format!("{prefix}{i}");
        let res = client.response_within(&id, within).await;
        if res["ok"] == true {
            ok += 1;
        } else {
            failed.push((id, res));
        }
    }
    (ok, failed)
}

/// A run started through `/v1/rpc` (`clawmux call chat.send`) runs on
/// after its answer, owned by a requester that is gone: it stays owned
/// across a handover, so another client still cannot stop it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_through_rpc_stays_owned_across_a_handover() {
    let gw = MockGateway::start(clawmux_mock::MockConfig {
        run_step_delay: Duration::from_secs(30),
        ..mock_config()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let body = serde_json::json!({"method": "chat.send", "params": {"sessionKey": "main",
        "message": "long", "idempotencyKey": "rpc-run-1"}});
    let (status, answer) = crate::http_api::rpc(&socket, &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let mut other = WsClient::open(&socket, "/ws").await;
    let challenge = other.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge");
    let mut connect = connect_frame("c1");
    connect["params"]["scopes"] = serde_json::json!(["operator.read", "operator.write"]);
    other.send_json(&connect).await;
    assert_eq!(other.response("c1").await["ok"], true);
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    let answer = other
        .request("chat.abort", serde_json::json!({"sessionKey": "main"}))
        .await;
    assert_eq!(
        answer["error"]["code"],
        "studio.forbidden",
        "the run is still owned: {answer}\n{}",
        log_text(&log)
    );
}

/// A client with a narrower grant moves too: its grant goes with it, and
/// the next instance opens its narrower gateway session again for its next
/// request (which gets the answer tailored to that grant).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_a_narrower_session_moves_with_it_and_keeps_its_grant() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut reader = WsClient::open(&socket, "/ws").await;
    let challenge = reader.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge");
    let mut connect = connect_frame("connect-1");
    connect["params"]["scopes"] = serde_json::json!(["operator.read"]);
    reader.send_json(&connect).await;
    let hello = reader.response("connect-1").await;
    assert_eq!(hello["ok"], true, "{hello}");
    let conn_id = hello["payload"]["server"]["connId"].clone();
    let before = reader.request("status", serde_json::json!({})).await;
    assert_eq!(before["ok"], true, "{before}");
    assert!(
        before["payload"]["sessions"].get("paths").is_none(),
        "redacted for a reader: {before}"
    );
    assert_eq!(
        gw.total_connections(),
        2,
        "the main session and the narrower one"
    );
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    // The narrower session's connection moved too. The moved client holds
    // it, as it did, before any request of its own here (it stays open
    // while the client does).
    let sessions = state(&socket).await["upstream"]["narrower_sessions"]["sessions"].clone();
    assert_eq!(sessions.as_array().map(Vec::len), Some(1), "{sessions}");
    assert_eq!(sessions[0]["holders"], 1, "{sessions}");
    let after = reader.request("status", serde_json::json!({})).await;
    assert_eq!(after["ok"], true, "{after}\n{}", log_text(&log));
    // No new connection for it.
    assert_eq!(gw.total_connections(), 2, "{}", log_text(&log));
    wait_log(&log, "taking a narrower upstream session over").await;
    assert!(
        after["payload"]["sessions"].get("paths").is_none(),
        "still redacted for a reader: {after}"
    );
    // Still a reader: a write is refused by the broker.
    let write = reader
        .request(
            "chat.send",
            serde_json::json!({"sessionKey": "agent:main:main", "message": "hi", "idempotencyKey": "k1"}),
        )
        .await;
    assert_eq!(write["ok"], false, "{write}");
    assert_listed(&socket, &conn_id, "the client moved").await;
}

/// `--shutdown-timeout 0` bounds how long a stop waits for peers, not how
/// long a handover's clients take to stop (none of them waits for one):
/// every client, a narrower session's and an event stream move all the
/// same, with their gateway connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_with_a_zero_shutdown_timeout_still_moves_every_client() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let mut cmd = serve_stopping_within(Path::new(BIN), dir.path(), &socket, "0");
    cmd.args(["--gateway-url", &gw.url(), "--token", "test-token"]);
    let log = log_to(&mut cmd, dir.path());
    let mut first = ChildGuard(cmd.spawn().unwrap());
    eventually("socket exists", || socket.exists()).await;
    crate::http_api::until_ready(&socket).await;
    let pid = broker_pid(&socket).await;
    let mut clients = Vec::new();
    // Enough that they cannot all stop within the timer's millisecond.
    for _ in 0..200 {
        let mut c = WsClient::open(&socket, "/ws").await;
        let hello = c.handshake().await;
        clients.push((hello["server"]["connId"].clone(), c));
    }
    let mut reader = WsClient::open(&socket, "/ws").await;
    reader.recv_json().await;
    let mut connect = connect_frame("connect-1");
    connect["params"]["scopes"] = serde_json::json!(["operator.read"]);
    reader.send_json(&connect).await;
    let hello = reader.response("connect-1").await;
    assert_eq!(hello["ok"], true, "{hello}");
    let reader_id = hello["payload"]["server"]["connId"].clone();
    assert_eq!(
        reader.request("status", serde_json::json!({})).await["ok"],
        true
    );
    let mut events = crate::http_api::open_events(&socket, "/v1/events?events=test.n", &[])
        .await
        .unwrap();
    assert_eq!(
        gw.total_connections(),
        2,
        "the main session and the narrower one"
    );
    // A burst the event log is still writing when the stop begins.
    let before = state(&socket).await["newest_seq"].as_u64().unwrap();
    let pad = "x".repeat(256);
    for i in 0..200 {
        gw.broadcast("test.log", serde_json::json!({ "i": i, "pad": pad }));
    }
    crate::http_api::wait_newest_seq(&socket, before + 200).await;

    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    // The log was closed for the next instance, with every event of the
    // burst and no gap.
    let mut history = crate::http_api::open_events(
        &socket,
        &format!("/v1/events?events=test.log,clawmux.gap&after_seq={before}"),
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("history: {e:?}\n{}", log_text(&log)));
    for i in 0..200 {
        let (_, name, data) = history.next_event().await;
        assert_eq!(
            (name.as_str(), &data["payload"]["i"]),
            ("test.log", &serde_json::json!(i))
        );
    }
    assert!(
        !log_text(&log).contains("did not close"),
        "{}",
        log_text(&log)
    );
    let listed = state(&socket).await["clients"].clone();
    let listed: std::collections::HashSet<_> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["conn_id"].clone())
        .collect();
    for (conn_id, c) in &mut clients {
        assert!(
            listed.contains(conn_id),
            "a client moved\n{}",
            log_text(&log)
        );
        let res = c.request("health", serde_json::json!({})).await;
        assert_eq!(res["ok"], true, "{res}\n{}", log_text(&log));
    }
    assert_listed(&socket, &reader_id, "the narrower session's client moved").await;
    let res = reader.request("status", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}\n{}", log_text(&log));
    gw.broadcast("test.n", serde_json::json!({"n": 1}));
    let (_, name, data) = events.next_event().await;
    assert_eq!(
        (name.as_str(), &data["payload"]["n"]),
        ("test.n", &serde_json::json!(1)),
        "{}",
        log_text(&log)
    );
    for (_, c) in &mut clients {
        assert_eq!(c.event("test.n").await["payload"]["n"], 1);
    }
    assert_eq!(gw.total_connections(), 2, "{}", log_text(&log));
}

/// A `/ws/dedicated` connection moves whole: the client's socket and its
/// own gateway connection, each stopped at a message boundary; frames then
/// pass verbatim both ways through the new instance, and the gateway never
/// sees a new connection for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedicated_connection_moves_with_its_own_gateway_connection() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut c = WsClient::open(&socket, "/ws/dedicated").await;
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
    c.send_json(&connect_frame("c1")).await;
    let res = c.response("c1").await;
    assert_eq!(res["ok"], true, "{res}");
    let sub = c
        .request(
            "sessions.messages.subscribe",
            serde_json::json!({"key": "agent:main:main"}),
        )
        .await;
    assert_eq!(sub["ok"], true, "{sub}");
    assert_eq!(gw.total_connections(), 2, "the shared session and this one");
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    // Verbatim both ways, through the new instance.
    c.send_json(&serde_json::json!({"type":"req","id":"same-id","method":"health"}))
        .await;
    let health = c.response("same-id").await;
    assert_eq!(health["ok"], true, "{health}\n{}", log_text(&log));
    // Its own gateway connection kept its subscription: no new connection.
    gw.emit_session_message(
        "agent:main:main",
        serde_json::json!({"sessionKey": "agent:main:main", "text": "after"}),
    );
    let message = c.event("session.message").await;
    assert_eq!(message["payload"]["text"], "after");
    assert_eq!(gw.total_connections(), 2, "{}", log_text(&log));
    wait_log(&log, "dedicated client taken over").await;
}

/// A `/ws/dedicated` connection caught in the middle both ways does not
/// hold up a handover, nor is it closed: its client is half way through
/// sending a request and has stopped reading (its socket full inside a
/// frame of the gateway's, the broker's send buffer set small), and its
/// gateway has begun a message and not ended it. It moves at once with the
/// bytes read of each message so far and the bytes its client's socket had
/// not taken; once both peers go on, every frame arrives whole, in order,
/// and the gateway never sees a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedicated_connection_in_the_middle_of_a_frame_both_ways_moves_at_once() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log, _) =
        serve_configured(dir.path(), &gw, "[limits]\nsend_buffer_bytes = 8192\n", &[]).await;
    let pid = broker_pid(&socket).await;
    let mut c = WsClient::open(&socket, "/ws/dedicated").await;
    let challenge = c.recv_json().await;
    assert_eq!(challenge["event"], "connect.challenge", "{challenge}");
    c.send_json(&connect_frame("c1")).await;
    assert_eq!(c.response("c1").await["ok"], true);
    let mut mover = WsClient::open(&socket, "/ws").await;
    mover.handshake().await;
    assert_eq!(
        gw.total_connections(),
        2,
        "the shared session and the dedicated one"
    );
    // A request (`id` "half"), of which 10 bytes of the payload are sent now.
    let frame = half_request_frame();
    let (sent, rest) = frame.split_at(6 + 10);
    c.raw().write_all(sent).await.unwrap();
    // Events of 16 KiB, each more than the dedicated client's socket
    // holds: the relay is left inside the first frame it writes.
    const EVENTS: u64 = 20;
    let pad = "x".repeat(16 * 1024);
    for n in 0..EVENTS {
        gw.broadcast("test.n", serde_json::json!({"n": n, "pad": pad}));
        assert_eq!(mover.event("test.n").await["payload"]["n"], n);
    }
    crate::support::eventually_async("the relay wrote part of a frame to the client", || {
        let queued = rustix::io::ioctl_fionread(&*c.raw());
        async move {
            match queued {
                Ok(n) if n > 0 => Ok(()),
                other => Err(format!("{other:?} bytes on the client's socket")),
            }
        }
    })
    .await;
    gw.send_fragment_start("{\"type\":\"event\",\"event\":\"test.half\"");
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    let text = log_text(&log);
    assert!(text.contains("dedicated client taken over"), "{text}");
    assert!(!text.contains("closing it"), "{text}");
    // Both peers go on: the gateway ends its message, the client sends the
    // rest of its request and reads again.
    gw.send_fragment_end(",\"payload\":{\"whole\":true}}");
    c.raw().write_all(rest).await.unwrap();
    for n in 0..EVENTS {
        let event = c.event("test.n").await;
        assert_eq!(event["payload"]["n"], n, "{}", log_text(&log));
        assert_eq!(
            event["payload"]["pad"].as_str().map(str::len),
            Some(pad.len())
        );
    }
    let half = c.event("test.half").await;
    assert_eq!(half["payload"]["whole"], true, "{half}");
    let res = c.response("half").await;
    assert_eq!(res["ok"], true, "the half-sent request, answered: {res}");
    let res = c.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(gw.total_connections(), 2, "{}", log_text(&log));
}

/// The next start names another gateway (its settings changed): the
/// stored gateway connection is not taken over. The requests in flight on
/// it are answered once, failed with `sent: true` (they may have run), and
/// the clients, still connected, see a reconnect to the new gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_connection_the_next_start_does_not_take_fails_its_requests_once() {
    let mut cfg = mock_config();
    cfg.run_step_delay = Duration::from_millis(300);
    let old_gw = MockGateway::start(cfg).await.unwrap();
    let new_gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let mut store = Store::bind(dir.path());
    let mut first = ChildGuard(
        serve_command(Path::new(BIN), dir.path(), &socket, &old_gw.url())
            .env("NOTIFY_SOCKET", &store.path)
            .env("FDSTORE", "64")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    crate::http_api::until_ready(&socket).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    client
        .send_json(
            &serde_json::json!({"type": "req", "id": "run1", "method": "agent",
            "params": {"message": "go", "idempotencyKey": uuid::Uuid::new_v4().to_string()}}),
        )
        .await;
    let accepted = client.response("run1").await;
    assert_eq!(accepted["payload"]["status"], "accepted", "{accepted}");
    sigterm(&first.0);
    assert!(store.drain_until_exit(&mut first.0).await.success());
    let fds = std::mem::take(&mut store.fds);
    let log = dir.path().join("next.log");
    let mut next = ChildGuard(start_with_stored(
        serve_command(Path::new(BIN), dir.path(), &socket, &new_gw.url()),
        fds,
        &store.path,
        Some(&log),
    ));
    let last = client.response("run1").await;
    assert_eq!(last["ok"], false, "{last}");
    assert_eq!(last["error"]["details"]["sent"], true, "{last}");
    loop {
        let event = client.event_within("clawmux.upstream", PATIENCE * 4).await;
        if event["payload"]["reason"] == "reconnected" {
            break;
        }
    }
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(new_gw.total_connections(), 1);
    let answers = client
        .events
        .iter()
        .filter(|v| v["type"] == "res" && v["id"] == "run1")
        .count();
    assert_eq!(answers, 0, "run1 answered once");
    // (systemd reads its notify socket: so does the stand-in, before the
    // next stop stores again.)
    store.drain();
    sigterm(&next.0);
    let status = store.drain_until_exit(&mut next.0).await;
    assert!(status.success(), "{status}\n{}", log_text(&log));
}

/// The next HUD event of a `/ws/hud` client.
async fn next_ws_hud(ws: &mut WsClient, log: &Path) -> serde_json::Value {
    match ws.recv_within(PATIENCE).await {
        Some(Got::Json(v)) => v,
        other => panic!("/ws/hud: {other:?}\n{}", log_text(log)),
    }
}

/// The next HUD event of a `/v1/hud` stream (`clawmux.*` records fail).
async fn next_hud(sse: &mut crate::http_api::Sse, log: &Path) -> serde_json::Value {
    loop {
        let record = match sse.next_item().await {
            crate::http_api::Item::Other(record) => record,
            crate::http_api::Item::Comment(_) => continue,
            crate::http_api::Item::Event { name, data, .. } => {
                panic!("{name} on the HUD stream: {data}\n{}", log_text(log))
            }
        };
        if record.starts_with("retry:") {
            continue;
        }
        let data = record
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or_else(|| panic!("a data line: {record}"));
        return serde_json::from_str(data).expect("one HUD event per data line");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hud_stream_moves_with_its_projection_and_a_run_across_the_handover_is_one_turn() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    // A client connected before: its id is taken over with it, and the
    // HUD's feed, opened again in the next instance, must not take it.
    let mut client = WsClient::open(&socket, "/ws").await;
    let conn_id = client.handshake().await["server"]["connId"].clone();
    let mut hud = crate::http_api::open_events(&socket, "/v1/hud", &[])
        .await
        .unwrap();
    // And the same feed over WebSocket.
    let mut ws_hud = WsClient::open(&socket, "/ws/hud").await;
    let agent = |phase: &str| {
        serde_json::json!({"runId": "r-hud", "sessionKey": "agent:main:main",
            "stream": "lifecycle", "data": {"phase": phase}})
    };
    gw.broadcast("agent", agent("start"));
    let start = next_hud(&mut hud, &log).await;
    assert_eq!(
        (&start["event"], &start["correlationId"]),
        (
            &serde_json::json!("turn_start"),
            &serde_json::json!("r-hud")
        )
    );
    let ws_start = next_ws_hud(&mut ws_hud, &log).await;
    assert_eq!(ws_start["event"], "turn_start", "{ws_start}");
    let next = upgrade_once(&mut first, pid, &socket, &log).await;
    // Its end comes after the handover: the projection moved with the
    // stream, so it closes the same turn (no second `turn_start`, no gap).
    gw.broadcast("agent", agent("end"));
    let end = next_hud(&mut hud, &log).await;
    assert_eq!(
        (&end["event"], &end["correlationId"], &end["status"]),
        (
            &serde_json::json!("turn_end"),
            &serde_json::json!("r-hud"),
            &serde_json::json!("ok")
        ),
        "{end}"
    );
    assert_eq!(end.get("replay"), None, "live, as before: {end}");
    let ws_end = next_ws_hud(&mut ws_hud, &log).await;
    assert_eq!(
        (&ws_end["event"], &ws_end["correlationId"]),
        (&serde_json::json!("turn_end"), &serde_json::json!("r-hud")),
        "{ws_end}"
    );
    wait_log(&log, "streams=2").await;
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    assert_listed(&socket, &conn_id, "the earlier client keeps its place").await;
    drop(next);
}

/// A `/ws/hud` client that has stopped reading, its socket full in the
/// middle of a frame (the broker's send buffer set small), moves at once
/// with what its socket had not taken: it stays connected, and once it
/// reads again it has every HUD event once, in order, then the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ws_hud_client_that_stopped_reading_moves_with_its_unwritten_bytes() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log, _) =
        serve_configured(dir.path(), &gw, "[limits]\nsend_buffer_bytes = 4096\n", &[]).await;
    let pid = broker_pid(&socket).await;
    let mut ws_hud = WsClient::open(&socket, "/ws/hud").await;
    let start = |i: usize| {
        serde_json::json!({"runId": format!("r-{i:03}"), "sessionKey": "agent:main:main",
            "stream": "lifecycle", "data": {"phase": "start"}})
    };
    // The first one read: the feed is open. Then far more than the socket
    // holds, not read.
    gw.broadcast("agent", start(0));
    assert_eq!(
        next_ws_hud(&mut ws_hud, &log).await["correlationId"],
        "r-000"
    );
    const RUNS: usize = 150;
    for i in 1..RUNS {
        gw.broadcast("agent", start(i));
    }
    crate::support::eventually_async("the feed took every event", || async {
        let newest = state(&socket).await["newest_seq"].as_u64().unwrap_or(0);
        let runs = state(&socket).await["runs"].as_array().map_or(0, Vec::len);
        if runs >= RUNS {
            Ok(())
        } else {
            Err(format!("{runs} runs at cursor {newest}"))
        }
    })
    .await;
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    assert!(
        !log_text(&log).contains("/ws/hud client not at a boundary"),
        "{}",
        log_text(&log)
    );
    gw.broadcast(
        "agent",
        serde_json::json!({"runId": "r-000", "sessionKey": "agent:main:main",
            "stream": "lifecycle", "data": {"phase": "end"}}),
    );
    let mut starts = Vec::new();
    loop {
        let event = next_ws_hud(&mut ws_hud, &log).await;
        match event["event"].as_str() {
            Some("turn_start") => starts.push(event["correlationId"].as_str().unwrap().to_owned()),
            Some("turn_end") => {
                assert_eq!(event["correlationId"], "r-000", "{event}");
                break;
            }
            _ => {}
        }
    }
    let expected: Vec<String> = (1..RUNS).map(|i| format!("r-{i:03}")).collect();
    assert_eq!(starts, expected, "every turn once, in order");
}

/// A `systemctl` first on the returned `PATH` whose `list-jobs` says that
/// systemd's job on `clawmux.service` is `job` (as the real one prints it).
fn fake_systemctl(dir: &Path, job: &str) -> std::ffi::OsString {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    install_script(
        &bin.join("systemctl"),
        &format!(
            "#!/bin/sh\necho \"$*\" >> {}/systemctl.args\necho '7 clawmux.service {job} running'\n",
            dir.display()
        ),
    );
    let mut joined = bin.into_os_string();
    joined.push(":");
    joined.push(std::env::var_os("PATH").unwrap_or_default());
    joined
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemctl_stop_closes_the_clients_politely_and_stores_none_of_them() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let mut store = Store::bind(dir.path());
    let mut cmd = serve_command(Path::new(BIN), dir.path(), &socket, &gw.url());
    let log = log_to(&mut cmd, dir.path());
    // systemd's job on the service: a stop, not a restart.
    let mut first = serve_under_systemd(cmd, &store, dir.path(), &socket, "stop").await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    sigterm(&first.0);
    // Told, as at any polite stop: the gateway's `shutdown` event, then 1001.
    let shutdown = client.event("shutdown").await;
    assert_eq!(
        shutdown["payload"]["reason"], "clawmux stopping",
        "{shutdown}"
    );
    match client.recv_within(PATIENCE).await {
        Some(Got::Close(1001, _)) => {}
        other => panic!("{other:?}\n{}", log_text(&log)),
    }
    assert!(store.drain_until_exit(&mut first.0).await.success());
    assert!(
        !store
            .fds
            .iter()
            .any(|(n, _)| n.starts_with("clawmux-client-") || n == "clawmux-clients"),
        "nothing stored for a next start that will not take it: {:?}",
        store.lines
    );
    let asked = std::fs::read_to_string(dir.path().join("systemctl.args")).unwrap();
    assert_eq!(
        asked.trim(),
        "--user list-jobs --no-legend --plain clawmux.service"
    );
    wait_log(&log, "systemd stops the service (not a restart)").await;
}

/// The first event (`type: event`) a client receives, whatever its name.
async fn first_event(ws: &mut WsClient, log: &Path) -> serde_json::Value {
    loop {
        match ws.recv_within(PATIENCE * 2).await {
            Some(Got::Json(v)) if v["type"] == "event" => return v,
            Some(Got::Json(_)) => continue,
            other => panic!("{other:?}\n{}", log_text(log)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_sockets_than_one_message_holds_each_move_to_their_own_client() {
    // 191 clients, 8 dedicated connections (two sockets each) and 10 event
    // streams: 217 sockets, two control messages, the first ending inside
    // a dedicated connection's pair. Half of each kind differs from the
    // other half (a subscription, a filter), so a socket taken for another
    // one's would show.
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let key = "agent:main:main";
    let mut clients = Vec::new();
    for i in 0..191 {
        let mut c = WsClient::open(&socket, "/ws").await;
        c.handshake().await;
        if i % 2 == 0 {
            let sub = c
                .request(
                    "sessions.messages.subscribe",
                    serde_json::json!({"key": key}),
                )
                .await;
            assert_eq!(sub["ok"], true, "{sub}");
        }
        clients.push(c);
    }
    let mut dedicated = Vec::new();
    for i in 0..8 {
        let mut d = WsClient::open(&socket, "/ws/dedicated").await;
        assert_eq!(d.recv_json().await["event"], "connect.challenge");
        d.send_json(&connect_frame("c1")).await;
        assert_eq!(d.response("c1").await["ok"], true);
        if i % 2 == 0 {
            d.send_json(&serde_json::json!({"type": "req", "id": "s1",
                "method": "sessions.messages.subscribe", "params": {"key": key}}))
                .await;
            assert_eq!(d.response("s1").await["ok"], true);
        }
        dedicated.push(d);
    }
    let mut streams = Vec::new();
    for i in 0..10 {
        let path = if i % 2 == 0 {
            "/v1/events?events=test.n"
        } else {
            "/v1/events?events=test.m"
        };
        streams.push(
            crate::http_api::open_events(&socket, path, &[])
                .await
                .unwrap(),
        );
    }
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    wait_log(&log, "streams=10").await;
    // Subscribers first get the message, the others the broadcast after it.
    gw.emit_session_message(key, serde_json::json!({"sessionKey": key, "text": "after"}));
    gw.broadcast("test.m", serde_json::json!({}));
    gw.broadcast("test.n", serde_json::json!({}));
    for (i, c) in clients.iter_mut().enumerate() {
        let e = first_event(c, &log).await;
        let expected = if i % 2 == 0 {
            "session.message"
        } else {
            "test.m"
        };
        assert_eq!(e["event"], expected, "client {i}: {e}");
    }
    for (i, d) in dedicated.iter_mut().enumerate() {
        let e = first_event(d, &log).await;
        let expected = if i % 2 == 0 {
            "session.message"
        } else {
            "test.m"
        };
        assert_eq!(e["event"], expected, "dedicated {i}: {e}");
    }
    for (i, sse) in streams.iter_mut().enumerate() {
        let (_, name, _) = sse.next_event().await;
        let expected = if i % 2 == 0 { "test.n" } else { "test.m" };
        assert_eq!(name, expected, "stream {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_moved_in_the_middle_of_its_history_goes_on_from_the_log() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let before = state(&socket).await["newest_seq"].as_u64().unwrap();
    // 3 MiB of history: more than a moving stream writes into the clients
    // document (1 MiB), the rest it reads from the log in the next instance.
    let pad = "x".repeat(16 * 1024);
    for n in 0..200 {
        gw.broadcast("test.n", serde_json::json!({"n": n, "pad": pad}));
    }
    crate::http_api::wait_newest_seq(&socket, before + 200).await;
    let mut sse = crate::http_api::open_events(
        &socket,
        &format!("/v1/events?events=test.n&after_seq={before}"),
        &[],
    )
    .await
    .unwrap();
    let read = Arc::new(AtomicUsize::new(0));
    let reader = tokio::spawn({
        let read = Arc::clone(&read);
        async move {
            let mut got = Vec::new();
            while got.last() != Some(&200) {
                let (_, name, data) = sse.next_event().await;
                assert_eq!(name, "test.n", "{data}");
                got.push(data["payload"]["n"].as_i64().unwrap());
                read.fetch_add(1, Ordering::Relaxed);
                // A reader slower than the history is long.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            got
        }
    });
    eventually("the reader is into its history", || {
        read.load(Ordering::Relaxed) >= 5
    })
    .await;
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    assert!(
        read.load(Ordering::Relaxed) < 150,
        "the handover came in the middle of the history"
    );
    gw.broadcast("test.n", serde_json::json!({"n": 200}));
    let got = tokio::time::timeout(PATIENCE * 4, reader)
        .await
        .expect("the whole history and the live event")
        .unwrap();
    assert_eq!(got, (0..=200).collect::<Vec<i64>>(), "{}", log_text(&log));
    wait_log(&log, "history goes on from the log").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_stream_is_closed_at_a_handover_not_moved() {
    // Its body is not chunked (it ends with the connection): the next
    // instance could not go on with it in chunks.
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut s = UnixStream::connect(&socket).await.unwrap();
    s.write_all(b"GET /v1/events?events=test.n HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("retry: 1000") {
        let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got).to_lowercase();
    assert!(head.starts_with("http/1.0 200"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE * 2, s.read_to_end(&mut rest))
        .await
        .expect("the stream ends")
        .unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("event: clawmux.close\ndata: {\"code\":1012,\"reason\":\"service restart\"}"),
        "told to come back: {rest:?}"
    );
    assert!(!rest.contains("\r\n"), "no chunk framing: {rest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_socket_may_no_longer_observe_is_closed_not_moved() {
    // The next instance reads the settings afresh: an observer stream on a
    // socket whose `observe` was switched off meanwhile is told to come
    // back (and is then refused), never served on.
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("c.sock");
    let obs = dir.path().join("obs.sock");
    let config = dir.path().join("config.toml");
    let write_config = |observe: bool| {
        std::fs::write(
            &config,
            format!(
                "[[sockets]]\nname = \"obs\"\npath = \"{}\"\nscopes = [\"operator.read\"]\nobserve = {observe}\n",
                obs.display()
            ),
        )
        .unwrap()
    };
    write_config(true);
    let mut cmd = serve_command(Path::new(BIN), dir.path(), &socket, &gw.url());
    cmd.arg("--config").arg(&config);
    let log = log_to(&mut cmd, dir.path());
    let mut first = ChildGuard(cmd.spawn().unwrap());
    eventually("sockets exist", || socket.exists() && obs.exists()).await;
    crate::http_api::until_ready(&socket).await;
    let pid = broker_pid(&socket).await;
    let mut sse =
        crate::http_api::open_events(&obs, "/v1/events?tool_events=all&events=test.n", &[])
            .await
            .unwrap_or_else(|e| panic!("{e:?}\n{}", log_text(&log)));
    write_config(false);
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    loop {
        match sse.next_item().await {
            crate::http_api::Item::Other(record) if record.contains("clawmux.close") => {
                assert!(record.contains("1012"), "{record}");
                break;
            }
            crate::http_api::Item::Event { name, data, .. } => {
                panic!(
                    "{name} served after the handover: {data}\n{}",
                    log_text(&log)
                )
            }
            _ => {}
        }
    }
    wait_log(&log, "may no longer read what it asked for").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_client_moves_when_its_gateway_connection_does() {
    // Claw3D's path closes its clients as a direct gateway connection
    // would be closed. A handover moves the gateway connection, so a direct
    // connection would see nothing: the client moves, and stays.
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let pid = broker_pid(&socket).await;
    let mut mirror = WsClient::open(&socket, "/api/gateway/ws").await;
    let conn_id = mirror.handshake().await["server"]["connId"].clone();
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    gw.broadcast("test.n", serde_json::json!({"n": 1}));
    let event = mirror.event("test.n").await;
    assert_eq!(event["payload"]["n"], 1, "{}", log_text(&log));
    let res = mirror.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    assert_listed(&socket, &conn_id, "the mirror client moved").await;
    // Still a mirror client: a gateway restart closes it, as it would a
    // direct connection.
    gw.restart_notice(Some(100)).await;
    mirror.event("shutdown").await;
    assert_eq!(
        mirror.expect_close().await,
        (1012, "service restart".into())
    );
}

/// Moved connections hold their socket's connection slots in the next
/// instance, as accepted ones do: `max_connections` still bounds every
/// open connection after a handover (without, the moved ones were not
/// counted, and as many again could be accepted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moved_connections_still_count_against_max_connections() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, socket, log, _) =
        serve_configured(dir.path(), &gw, "[limits]\nmax_connections = 4\n", &[]).await;
    let pid = broker_pid(&socket).await;
    // Two WebSocket clients and an event stream move.
    let mut clients = Vec::new();
    for _ in 0..2 {
        let mut c = WsClient::open(&socket, "/ws").await;
        c.handshake().await;
        clients.push(c);
    }
    let mut sse = crate::http_api::open_events(&socket, "/v1/events?events=test.n", &[])
        .await
        .unwrap();
    let _next = upgrade_once(&mut first, pid, &socket, &log).await;
    // A fourth connection takes the last slot (once the probes above have
    // let theirs go: until then it is refused): a keep-alive connection
    // answered 200 holds it. A fifth is then refused.
    let _fourth = eventually_async("a fourth connection is served", || {
        let socket = socket.clone();
        async move {
            let mut s = UnixStream::connect(&socket)
                .await
                .map_err(|e| e.to_string())?;
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .map_err(|e| e.to_string())?;
            let mut head = [0u8; 12];
            tokio::time::timeout(PATIENCE, s.read_exact(&mut head))
                .await
                .map_err(|_| "no answer".to_owned())?
                .map_err(|e| e.to_string())?;
            match &head {
                b"HTTP/1.1 200" => Ok(s),
                other => Err(String::from_utf8_lossy(other).into_owned()),
            }
        }
    })
    .await;
    assert_eq!(healthz(&socket).await, Some(503), "{}", log_text(&log));
    // Every moved connection is still served.
    gw.broadcast("test.n", serde_json::json!({ "n": 1 }));
    for c in &mut clients {
        assert_eq!(c.event("test.n").await["payload"]["n"], 1);
    }
    assert_eq!(sse.next_event().await.2["payload"]["n"], 1);
    // A moved client that leaves gives its slot back.
    drop(clients.pop());
    eventually_async("a slot is free again", || {
        let socket = socket.clone();
        async move {
            match healthz(&socket).await {
                Some(200) => Ok(()),
                other => Err(format!("healthz {other:?}")),
            }
        }
    })
    .await;
}

/// A new instance whose start fails after the old one released (a
/// `[[sockets]]` entry it cannot bind) leaves the socket file and its lock
/// in place: the old instance serves on, and new connections reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_that_cannot_start_after_the_release_leaves_the_socket_file() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut old, socket, log, config) = serve_configured(dir.path(), &gw, "", &[]).await;
    let pid = old.0.id();
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    // A socket under a regular file cannot be bound.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    std::fs::write(
        &config,
        format!(
            "[[sockets]]\nname = \"x\"\npath = \"{}\"\n",
            file.join("x.sock").display()
        ),
    )
    .unwrap();
    signal_pid(pid, rustix::process::Signal::USR2);
    wait_log(&log, "upgrade failed, still serving").await;
    // It failed after the release (the state was valid), in its start.
    let text = log_text(&log);
    assert!(text.contains("before it said ready"), "{text}");
    assert!(socket.exists(), "the socket file is still there\n{text}");
    assert_eq!(broker_pid(&socket).await, pid, "{}", log_text(&log));
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    let mut again = WsClient::open(&socket, "/ws").await;
    again.handshake().await;
    signal(&old.0, rustix::process::Signal::TERM);
    assert!(exits_with(&mut old.0).await.success());
    assert!(!socket.exists(), "the old instance's final stop removes it");
}

/// A new instance that fails once it said `valid` (an error returned, so
/// every destructor runs, the socket guards' too) leaves the socket file
/// and its lock to the old instance, which serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_that_fails_after_valid_leaves_the_socket_file_to_the_old_one() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut old, socket, log, _) = serve_configured(
        dir.path(),
        &gw,
        "",
        &[("CLAWMUX_TEST_UPGRADE_FAULT", "after-valid")],
    )
    .await;
    let pid = old.0.id();
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    signal_pid(pid, rustix::process::Signal::USR2);
    wait_log(&log, "upgrade failed, still serving").await;
    // The new instance says why as it exits, which may come after the old
    // one saw its control socket close.
    wait_log(&log, "=after-valid").await;
    let text = log_text(&log);
    assert!(socket.exists(), "the socket file is still there\n{text}");
    assert_eq!(broker_pid(&socket).await, pid);
    let res = client.request("health", serde_json::json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    let mut again = WsClient::open(&socket, "/ws").await;
    again.handshake().await;
    signal(&old.0, rustix::process::Signal::TERM);
    assert!(exits_with(&mut old.0).await.success());
    assert!(!socket.exists(), "the old instance's final stop removes it");
}

/// One `GET /v1/state` (HTTP/1.0: the body ends with the connection), or
/// `None` when no broker answered.
async fn try_state(socket: &Path) -> Option<serde_json::Value> {
    let mut s = UnixStream::connect(socket).await.ok()?;
    s.write_all(b"GET /v1/state HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut out))
        .await
        .ok()?
        .ok()?;
    let at = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    serde_json::from_slice(&out[at + 4..]).ok()
}

/// The live serve processes of `socket` (every instance an upgrade
/// started: they are not this test's children).
fn serve_processes(socket: &Path) -> Vec<u32> {
    let needle = socket.as_os_str().as_encoded_bytes();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
                && alive(pid)
        })
        .collect()
}

/// A signal never kills a broker, whatever step of an upgrade it lands in:
/// `SIGUSR2` and `SIGHUP` sent to the new instance the moment `/v1/state`
/// names it (before, its handlers were installed only after the gate
/// opened, and the default action killed it with no process left to serve
/// the socket), and a storm of both to every serve process of the socket
/// (old, new, both) every few milliseconds. It ends with one serving broker
/// and every client still connected, answered and receiving events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signal_storms_at_every_step_of_an_upgrade_end_with_one_broker_and_every_client_connected()
{
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_first, socket, log) = serve_ready(Path::new(BIN), dir.path(), &gw.url()).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut c = WsClient::open(&socket, "/ws").await;
        c.handshake().await;
        clients.push(c);
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut pid = broker_pid(&socket).await;
    seen.insert(pid);
    let send = |pid: u32, sig| {
        if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(p, sig);
        }
    };
    let storm_stop = Arc::new(AtomicBool::new(false));
    for round in 0..16 {
        // Odd rounds add the storm: both signals to every serve process of
        // this socket every 5 ms (bounded: 400 volleys) until the round ends.
        let storm = (round % 2 == 1).then(|| {
            let (stop, socket) = (Arc::clone(&storm_stop), socket.clone());
            stop.store(false, Ordering::Relaxed);
            tokio::spawn(async move {
                for volley in 0..400 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let sig = if volley % 3 == 0 {
                        rustix::process::Signal::HUP
                    } else {
                        rustix::process::Signal::USR2
                    };
                    for p in serve_processes(&socket) {
                        if let Some(p) = rustix::process::Pid::from_raw(p as i32) {
                            let _ = rustix::process::kill_process(p, sig);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        });
        send(pid, rustix::process::Signal::USR2);
        // The moment the state names a new instance, signal it: the window
        // between its gate opening and its handlers running.
        let next = eventually_within("a new instance serves", PATIENCE * 4, || {
            let socket = socket.clone();
            async move {
                match try_state(&socket).await {
                    Some(s) => match s["broker"]["pid"].as_u64() {
                        Some(p) if p as u32 != pid => Ok(p as u32),
                        other => Err(format!("{other:?} still serves")),
                    },
                    None => Err("no answer".to_owned()),
                }
            }
        })
        .await;
        send(next, rustix::process::Signal::USR2);
        send(next, rustix::process::Signal::HUP);
        seen.insert(next);
        pid = next;
        storm_stop.store(true, Ordering::Relaxed);
        if let Some(storm) = storm {
            storm.await.unwrap();
        }
        for p in serve_processes(&socket) {
            seen.insert(p);
        }
    }
    // Every upgrade a pending signal started runs to its end: one broker
    // is left, and it is the one the state names.
    let last = eventually_within("one serve process is left", PATIENCE * 6, || {
        let socket = socket.clone();
        async move {
            let live = serve_processes(&socket);
            match (live.as_slice(), try_state(&socket).await) {
                ([one], Some(s)) if s["broker"]["pid"].as_u64() == Some(u64::from(*one)) => {
                    Ok(*one)
                }
                (live, _) => Err(format!("live: {live:?}")),
            }
        }
    })
    .await;
    let _guards: Vec<Pid> = seen.iter().chain([&last]).map(|&p| Pid(p)).collect();
    gw.broadcast("test.after", serde_json::json!({}));
    for (i, c) in clients.iter_mut().enumerate() {
        let got = c.event_within("test.after", PATIENCE * 2).await;
        assert_eq!(got["event"], "test.after", "client {i}\n{}", log_text(&log));
        let res = c.request("health", serde_json::json!({})).await;
        assert_eq!(res["ok"], true, "client {i}: {res}\n{}", log_text(&log));
    }
    let text = log_text(&log);
    assert!(!text.contains("upgrade failed"), "{text}");
}

/// `clawmux upgrade --socket S`: (exit code, what it printed).
async fn upgrade_command(socket: &Path, dir: &Path) -> (Option<i32>, String) {
    let out = tokio::process::Command::new(BIN)
        .args(["upgrade", "--timeout", "20", "--socket"])
        .arg(socket)
        .env("HOME", dir)
        .env_remove("CLAWMUX_CONFIG")
        .output();
    let out = tokio::time::timeout(PATIENCE * 6, out)
        .await
        .expect("clawmux upgrade ends")
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `clawmux upgrade` may ask as soon as the broker answers on its socket:
/// `/v1/state` says it can hand over from its first answer (here the
/// broker is held, by the test hook, between that and acting on its
/// signals), and the upgrade asked then is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_says_it_can_hand_over_from_its_first_answer() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let hold = format!("hold-before-serving:{}", go.display());
    let (mut first, socket, log, _) = serve_configured(
        dir.path(),
        &gw,
        "",
        &[("CLAWMUX_TEST_UPGRADE_FAULT", hold.as_str())],
    )
    .await;
    let st = state(&socket).await;
    assert_eq!(st["broker"]["upgrade"]["can_upgrade"], true, "{st}");
    std::fs::write(&go, "").unwrap();
    let (code, text) = upgrade_command(&socket, dir.path()).await;
    assert_eq!(code, Some(0), "{text}\n{}", log_text(&log));
    let _new = Pid(broker_pid(&socket).await);
    assert!(
        exits_with(&mut first.0).await.success(),
        "{}",
        log_text(&log)
    );
}

/// `clawmux upgrade` finds the broker behind the socket (not a process by
/// name), hands it over and says what happened in one line, with an exit
/// status a script can use: 0 and old pid → new pid with what moved; 1 and
/// the reason when the new binary fails (the old one serves on); 3 when no
/// broker answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_command_reports_the_outcome_and_exits_by_it() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let program = copied_binary(dir.path());
    let (mut first, socket, log) = serve_ready(&program, dir.path(), &gw.url()).await;
    let mut client = WsClient::open(&socket, "/ws").await;
    client.handshake().await;
    let old = first.0.id();

    // A new binary that cannot start: exit 1, the reason, the old one serves.
    replace_with_script(&program, "#!/bin/sh\necho 'cannot start' >&2\nexit 1\n");
    let (code, text) = upgrade_command(&socket, dir.path()).await;
    assert_eq!(code, Some(1), "{text}\n{}", log_text(&log));
    assert!(text.starts_with("upgrade failed: "), "{text}");
    assert!(text.contains(&format!("pid {old} still serves")), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");
    assert_eq!(
        client.request("health", serde_json::json!({})).await["ok"],
        true
    );

    // The real binary: exit 0, old pid → new pid, the client moved.
    std::fs::remove_file(&program).unwrap();
    install_executable(Path::new(BIN), &program);
    let (code, text) = upgrade_command(&socket, dir.path()).await;
    assert_eq!(code, Some(0), "{text}\n{}", log_text(&log));
    let new = broker_pid(&socket).await;
    let _new = Pid(new);
    assert_ne!(new, old);
    assert!(
        text.starts_with(&format!("upgraded: pid {old} ("))
            && text.contains(&format!("→ pid {new} (")),
        "{text}"
    );
    assert!(
        text.contains("1 client and 0 event streams moved"),
        "{text}"
    );
    assert!(
        exits_with(&mut first.0).await.success(),
        "{}",
        log_text(&log)
    );
    assert_eq!(
        client.request("health", serde_json::json!({})).await["ok"],
        true
    );

    // No broker: exit 3, naming the socket it tried.
    let nowhere = dir.path().join("nowhere.sock");
    let (code, text) = upgrade_command(&nowhere, dir.path()).await;
    assert_eq!(code, Some(3), "{text}");
    assert!(text.contains(&nowhere.display().to_string()), "{text}");
}

/// A broker started in a terminal, as a shell runs a foreground job: under
/// a real pty, the controlling terminal of a new session whose leader (and
/// process group) is the process the shell started. Upgraded `upgrades`
/// times, with one client connected.
struct InTerminal {
    /// The job: every instance, however many upgrades started (dropped
    /// before `first`, its leader, is reaped).
    _job: Group,
    _gw: MockGateway,
    _dir: tempfile::TempDir,
    socket: PathBuf,
    /// Where the test hook's held points (if any) wait for a file.
    go: PathBuf,
    first: ChildGuard,
    /// Every instance's pid, the first one's first.
    pids: Vec<u32>,
    _guards: Vec<Pid>,
    master: OwnedFd,
    screen: Arc<std::sync::Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
    client: WsClient,
}

impl InTerminal {
    async fn upgraded(upgrades: usize) -> InTerminal {
        InTerminal::upgraded_holding(upgrades, &[]).await
    }

    /// Upgraded `upgrades` times, each instance holding at each of
    /// `points` until `go` exists.
    async fn upgraded_holding(upgrades: usize, points: &[&str]) -> InTerminal {
        let mut t = InTerminal::started(points).await;
        for round in 1..=upgrades {
            let (code, text) = upgrade_command(&t.socket, t._dir.path()).await;
            assert_eq!(code, Some(0), "upgrade {round}: {text}\n{}", t.seen());
            let pid = broker_pid(&t.socket).await;
            t.pids.push(pid);
            t._guards.push(Pid(pid));
            assert!(
                t.first.0.try_wait().unwrap().is_none(),
                "after upgrade {round} the process the shell started is still there\n{}",
                t.seen()
            );
        }
        assert_eq!(
            t.client.request("health", serde_json::json!({})).await["ok"],
            true
        );
        t
    }

    /// Started, each instance holding at each of `points` until `go`
    /// exists.
    async fn started(points: &[&str]) -> InTerminal {
        use std::os::fd::FromRawFd;
        let gw = MockGateway::start(mock_config()).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("c.sock");
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty writes two new descriptors into the integers it is
        // given (the name, termios and size are not asked for); both are owned
        // below exactly once.
        let opened = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(opened, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: fresh descriptors from openpty, owned by nothing else.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let mut cmd = serve_command(Path::new(BIN), dir.path(), &socket, &gw.url());
        let go = dir.path().join("go");
        let hold = points
            .iter()
            .map(|point| format!("{point}:{}", go.display()))
            .collect::<Vec<_>>()
            .join(",");
        cmd.env("CLAWMUX_TEST_UPGRADE_FAULT", hold);
        cmd.stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave.try_clone().unwrap());
        // SAFETY: setsid and ioctl are async-signal-safe; the hook allocates
        // nothing. The child leads a new session whose controlling terminal is
        // the pty on its stdin, so the terminal's Ctrl-C reaches its group.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let first = ChildGuard(cmd.spawn().unwrap());
        // The terminal's other end stays open only in the brokers, so reading
        // it ends when the last of them has gone.
        drop(cmd);
        drop(slave);
        // What the brokers write to the terminal, read so they never block on it.
        let screen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let reader = {
            let mut master = std::fs::File::from(master.try_clone().unwrap());
            let screen = Arc::clone(&screen);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = std::io::Read::read(&mut master, &mut buf) {
                    screen.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            })
        };
        eventually("socket exists", || socket.exists()).await;
        crate::http_api::until_ready(&socket).await;
        let mut client = WsClient::open(&socket, "/ws").await;
        client.handshake().await;
        let pids = vec![first.0.id()];
        let _job = Group(Some(first.0.id()));
        InTerminal {
            _job,
            _gw: gw,
            _dir: dir,
            socket,
            go,
            first,
            pids,
            _guards: Vec::new(),
            master,
            screen,
            reader,
            client,
        }
    }

    /// What the brokers wrote to the terminal so far.
    fn seen(&self) -> String {
        String::from_utf8_lossy(&self.screen.lock().unwrap()).into_owned()
    }

    /// Ctrl-C, typed at the terminal.
    fn ctrl_c(&self) {
        std::io::Write::write_all(
            &mut std::fs::File::from(self.master.try_clone().unwrap()),
            b"\x03",
        )
        .unwrap();
    }

    /// `kill -TERM %1` in the shell: the job's whole process group.
    fn kill_the_job(&self) {
        let group = rustix::process::Pid::from_raw(self.first.0.id() as i32).unwrap();
        rustix::process::kill_process_group(group, rustix::process::Signal::TERM).unwrap();
    }

    /// The broker stopped politely: the client was closed `1001` (a forced
    /// stop closes nothing), the process the shell started exited 0 (3 when
    /// forced), every instance ended, and the terminal is let go.
    async fn stopped_politely(mut self) {
        let code = loop {
            match self.client.recv().await {
                Got::Json(_) => continue,
                Got::Close(code, _) => break code,
                Got::Eof => panic!(
                    "the connection ended without a close frame\n{}",
                    self.seen()
                ),
            }
        };
        assert_eq!(code, 1001, "{}", self.seen());
        let status = exits_with(&mut self.first.0).await;
        // The job's leader waits for the rest: none is left, and its pid
        // is reaped (it may be another group's now).
        self._job.disarm();
        assert!(status.success(), "{status:?}\n{}", self.seen());
        for p in &self.pids[1..] {
            eventually("every instance ends", || !alive(*p)).await;
        }
        let seen = self.seen();
        assert!(seen.contains("stop requested"), "{seen}");
        assert!(!seen.contains("during shutdown: exiting now"), "{seen}");
        drop(self.master);
        let _ = self.reader.join();
    }
}

/// A broker started in a terminal keeps it across upgrades: the process the
/// shell started stays (so the prompt does not come back while a broker
/// still writes to the terminal), `kill -HUP` on its pid reloads the
/// serving instance, and Ctrl-C stops the broker, however many upgrades it
/// had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_started_in_a_terminal_stops_on_ctrl_c_after_two_upgrades() {
    let t = InTerminal::upgraded(2).await;
    // `kill -HUP` on the pid the shell shows reloads the serving instance
    // (the process the shell started only passes it on).
    signal(&t.first.0, rustix::process::Signal::HUP);
    eventually("the reload passed on and done", || {
        let seen = t.seen();
        seen.contains("SIGHUP passed on to the new instance")
            && seen.matches("settings reloaded").count() == 1
    })
    .await;
    t.ctrl_c();
    t.stopped_politely().await;
}

/// A stop signalled to the process the shell started while it hands over
/// (`kill -INT <pid>`: it reaches that process only; the new one is held
/// with everything taken over) is passed on once the new instance serves:
/// it stops politely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_signalled_to_the_terminals_process_during_an_upgrade_reaches_the_new_instance() {
    let t = InTerminal::started(&["hold-before-ready"]).await;
    signal(&t.first.0, rustix::process::Signal::USR2);
    eventually("the new instance took the clients over", || {
        t.seen().contains("took the clients over")
    })
    .await;
    signal(&t.first.0, rustix::process::Signal::INT);
    std::fs::write(&t.go, "").unwrap();
    eventually("the stop passed on", || {
        t.seen()
            .contains("a stop was asked during the handover: passed on")
    })
    .await;
    t.stopped_politely().await;
}

/// After `kill <pid>` on the pid the shell shows, a Ctrl-C is a second
/// stop: it forces the stop (exit 3), as it does for a broker that did not
/// upgrade. The serving instance is held inside its polite stop (the test
/// hook), and the processes the terminal kept pass the Ctrl-C on as a
/// second word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ctrl_c_after_a_kill_of_the_pid_the_shell_shows_forces_the_stop_after_two_upgrades() {
    let mut t = InTerminal::upgraded_holding(2, &["hold-in-stop"]).await;
    signal(&t.first.0, rustix::process::Signal::TERM);
    eventually("the stop passed on", || t.seen().contains("stop requested")).await;
    t.ctrl_c();
    eventually("the stop forced", || {
        t.seen().contains("during shutdown: exiting now")
    })
    .await;
    let status = exits_with(&mut t.first.0).await;
    t._job.disarm();
    assert_eq!(status.code(), Some(3), "{}", t.seen());
    assert!(
        !t.seen().contains("shutdown did not finish"),
        "{}",
        t.seen()
    );
}

/// `kill %1` in the shell signals the job's whole process group: every
/// instance of an upgraded broker gets its own `SIGTERM`, and each process
/// that stands in for the next passes the stop on too. That is one stop,
/// polite (not a forced stop, exit 3), whichever process acts on it
/// first. Each order is made by signalling the
/// processes one at a time, the first one's stop awaited; then the group at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_started_in_a_terminal_stops_politely_on_kill_of_its_job_after_one_and_two_upgrades(
) {
    for upgrades in [1, 2] {
        for serving_first in [true, false] {
            let t = InTerminal::upgraded(upgrades).await;
            let mut order = t.pids.clone();
            if serving_first {
                order.reverse();
            }
            signal_pid(order[0], rustix::process::Signal::TERM);
            eventually("the first stop acted on", || {
                t.seen().contains("stop requested")
            })
            .await;
            for &pid in &order[1..] {
                // One that is gone already (a forced stop) fails below.
                let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            t.stopped_politely().await;
        }
        let t = InTerminal::upgraded(upgrades).await;
        t.kill_the_job();
        t.stopped_politely().await;
    }
}

/// `kill <pid>` with the pid the shell shows, after two upgrades: the stop
/// reaches only that process, which passes it on to the next, which passes
/// it on to the serving instance: a polite stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_started_in_a_terminal_stops_politely_on_kill_of_the_pid_the_shell_shows_after_two_upgrades(
) {
    let t = InTerminal::upgraded(2).await;
    signal(&t.first.0, rustix::process::Signal::TERM);
    t.stopped_politely().await;
}
