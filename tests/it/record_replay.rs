//! Record and replay: `clawmux record` (the real binary) following a broker
//! in front of the gateway double, and the double serving a recording
//! (`clawmux_mock::replay`, `clawmux mock-gateway --replay`, `clawmux serve
//! --demo --replay`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::http_api::until_ready;
use crate::support::*;
use clawmux_mock::recording::{Played, Recording};
use clawmux_mock::replay::{Pace, Replay};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Patience for a spawned binary under a loaded machine.
const SLOW: Duration = Duration::from_secs(20);

/// The fixture recorded from the real gateway (tools/record-fixture.sh).
const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/real-gateway-run.jsonl"
);

/// `clawmux record` against `socket`, writing `out`; returns once it says
/// it is recording (its tap is attached and the header written).
async fn start_recorder(home: &TestHome, socket: &Path, out: &Path, extra: &[&str]) -> Child {
    let mut cmd = Command::from(home.clawmux());
    cmd.arg("record")
        .arg("--socket")
        .arg(socket)
        .arg("--out")
        .arg(out)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("clawmux record runs");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(SLOW, lines.next_line())
        .await
        .expect("the recorder starts in time")
        .unwrap()
        .unwrap_or_default();
    assert!(line.contains("clawmux record: recording"), "{line}");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    child
}

/// Waits (bounded; a file has no event to await) until `path` holds `needle`.
async fn file_contains(path: &Path, needle: &str) -> String {
    file_where(path, needle, |text| text.contains(needle)).await
}

/// Waits (bounded) until the text of `path` satisfies `done`.
async fn file_where(path: &Path, what: &str, done: impl Fn(&str) -> bool) -> String {
    let what = format!("{what} in the recording");
    eventually_within(&what, SLOW, || {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let found = done(&text);
        async move {
            if found {
                Ok(text)
            } else {
                Err(format!("\n{text}"))
            }
        }
    })
    .await
}

fn sigterm_child(child: &Child) {
    let pid = rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
}

fn sigint(child: &Child) {
    let pid = rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
}

async fn exit_code(child: &mut Child) -> i32 {
    tokio::time::timeout(SLOW, child.wait())
        .await
        .expect("the process exits in time")
        .unwrap()
        .code()
        .expect("an exit code, not a signal")
}

/// Events a client compares: not `tick` (the double ticks on its own clock).
fn compared(events: &[Value]) -> Vec<(String, Value)> {
    events
        .iter()
        .filter(|e| e["type"] == "event" && e["event"] != "tick")
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_owned(),
                e["payload"].clone(),
            )
        })
        .collect()
}

/// A replaying double on a unix socket in `dir`, without auth (a test client
/// connects with no token).
async fn replay_double(
    dir: &Path,
    recording: Recording,
    pace: Pace,
    looped: bool,
) -> (MockGateway, PathBuf) {
    let path = dir.join("replay.sock");
    let gw = MockGateway::start_unix(
        &path,
        MockConfig {
            replay: Some(Replay::new(recording, pace, looped)),
            ..MockConfig::default()
        },
    )
    .await
    .expect("the replay double starts");
    (gw, path)
}

/// A WebSocket client straight to a double on a unix socket, past hello-ok.
async fn direct_client(path: &Path) -> (WsClient, Value) {
    let mut c = WsClient::open(path, "/").await;
    let hello = c.handshake().await;
    (c, hello)
}

/// Reads `n` events (besides ticks) from `c`.
async fn read_events(c: &mut WsClient, n: usize) -> Vec<Value> {
    let mut out = Vec::new();
    while out.len() < n {
        let e = c.event_any().await;
        if e["event"] != "tick" {
            out.push(e);
        }
    }
    out
}

#[tokio::test]
async fn a_recorded_session_replays_the_same_events_and_answers() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let home = TestHome::new();
    let file = home.path().join("session.jsonl");
    let mut recorder = start_recorder(&home, &h.socket(), &file, &["--requests"]).await;

    let (mut a, _) = h.connected().await;
    let health = a.request("health", json!(null)).await;
    assert_eq!(health["ok"], true, "{health}");
    h.gw.simulate_run("agent:main:main", "recorded reply");
    // What `a` sees, up to the run's final chat message.
    let mut seen: Vec<Value> = a
        .events
        .drain(..)
        .filter(|e| e["type"] == "event")
        .collect();
    loop {
        let v = a.recv_json().await;
        if v["type"] == "event" {
            seen.push(v.clone());
            if v["event"] == "chat" && v["payload"]["state"] == "final" {
                break;
            }
        }
    }
    let history = a
        .request("chat.history", json!({"sessionKey": "main"}))
        .await;
    assert_eq!(history["ok"], true, "{history}");
    // Both answers (health, chat.history) are in, so is everything before them.
    let text = file_where(&file, "the chat.history answer", |t| {
        t.contains("\"method\":\"chat.history\"") && t.matches("\"type\":\"res\"").count() == 2
    })
    .await;
    assert!(text.contains("\"state\":\"final\""), "{text}");

    sigint(&recorder);
    assert_eq!(exit_code(&mut recorder).await, 0);
    let text = std::fs::read_to_string(&file).unwrap();
    let rec = Recording::parse(&text).expect("the recording parses");
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.gateway_version(), Some("2026.9.6-mock"));
    assert_eq!(rec.header["broker_version"], env!("CARGO_PKG_VERSION"));
    assert!(rec.header["started_at"].as_str().unwrap().ends_with('Z'));
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["end"], "interrupted");

    // Replay it to a client of its own: same events, fresh seq, same answers.
    let dir = tempfile::tempdir().unwrap();
    let (_gw, path) = replay_double(dir.path(), rec, Pace::Speed(4.0), false).await;
    let (mut b, hello) = direct_client(&path).await;
    assert_eq!(hello["server"]["version"], "2026.9.6-mock");
    let want = compared(&seen);
    let got = read_events(&mut b, want.len()).await;
    assert_eq!(compared(&got), want);
    let seqs: Vec<u64> = got.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "fresh, contiguous seq"
    );
    let replayed = b.request("health", json!(null)).await;
    assert_eq!(replayed["payload"], health["payload"]);
    let replayed = b
        .request("chat.history", json!({"sessionKey": "main"}))
        .await;
    assert_eq!(replayed["payload"], history["payload"]);
    let miss = b
        .request("chat.history", json!({"sessionKey": "other"}))
        .await;
    assert_eq!(miss["ok"], false);
    assert_eq!(miss["error"]["code"], "INVALID_REQUEST");
    let message = miss["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no recorded answer for chat.history") && message.contains("other"),
        "{message}"
    );
}

#[tokio::test]
async fn the_token_never_appears_in_a_recording_made_with_it() {
    const TOKEN: &str = "tok-3e1f0c9a77d54b8f";
    let h = start_with(
        MockConfig {
            token: Some(TOKEN.into()),
            ..MockConfig::default()
        },
        |s| s.token = Some(clawmux::config::Secret::new(TOKEN)),
    )
    .await;
    until_ready(&h.socket()).await;
    let home = TestHome::new();
    let file = home.path().join("secret.jsonl");
    let mut recorder = start_recorder(&home, &h.socket(), &file, &["--requests"]).await;
    let (mut a, _) = h.connected().await;
    let params = json!({"token": TOKEN, "auth": {"password": TOKEN, "deviceToken": TOKEN},
                        "apiKey": TOKEN, "signature": TOKEN, "nonce": TOKEN, "probe": "marker-1"});
    a.request("health", params).await;
    file_contains(&file, "marker-1").await;
    sigint(&recorder);
    assert_eq!(exit_code(&mut recorder).await, 0);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        !text.contains(TOKEN),
        "the token leaked into the recording:\n{text}"
    );
    assert!(
        !text.contains("dt_"),
        "a device token leaked into the recording:\n{text}"
    );
    assert!(text.contains("[redacted]"), "{text}");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o077, 0, "the recording is private");
}

#[tokio::test]
async fn sigint_mid_stream_leaves_a_valid_file() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let home = TestHome::new();
    let file = home.path().join("busy.jsonl");
    let mut recorder = start_recorder(&home, &h.socket(), &file, &[]).await;
    let gw = h.gw.clone();
    let pump = tokio::spawn(async move {
        for n in 0u64.. {
            gw.broadcast("cron", json!({"n": n, "pad": "x".repeat(200)}));
            tokio::task::yield_now().await;
            if n % 50 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    });
    file_contains(&file, "\"n\":200").await;
    sigint(&recorder);
    assert_eq!(exit_code(&mut recorder).await, 0);
    pump.abort();
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.ends_with('\n'));
    let rec = Recording::parse(&text).expect("valid after Ctrl-C");
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert!(rec.timeline.len() > 200);
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["end"], "interrupted");
}

#[tokio::test]
async fn max_bytes_stops_the_recording_at_the_limit() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let home = TestHome::new();
    let file = home.path().join("small.jsonl");
    let mut recorder = start_recorder(&home, &h.socket(), &file, &["--max-bytes", "16384"]).await;
    let gw = h.gw.clone();
    let pump = tokio::spawn(async move {
        for n in 0u64.. {
            gw.broadcast("cron", json!({"n": n, "pad": "y".repeat(300)}));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    assert_eq!(exit_code(&mut recorder).await, 0);
    pump.abort();
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.len() <= 16384, "{} bytes", text.len());
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["end"], "max-bytes");
    Recording::parse(&text).expect("valid");

    let (code, err) = {
        let out = tokio::time::timeout(
            SLOW,
            Command::from(home.clawmux())
                .args(["record", "--max-bytes", "1024"])
                .arg("--socket")
                .arg(h.socket())
                .output(),
        )
        .await
        .unwrap()
        .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--max-bytes 1024 is too small"), "{err}");
}

/// Runs the binary to completion in `home`: (exit code, stderr).
async fn run_in(home: &TestHome, args: &[&str]) -> (Option<i32>, String) {
    let (code, _, err) = run_clawmux_in(home.dir.path(), args, SLOW).await;
    (Some(code), err)
}

#[tokio::test]
async fn bad_requests_to_record_and_replay_are_refused_clearly() {
    // No gateway session: nothing to record yet.
    let (broker, _dir) = broker_only(|_| {}).await;
    let socket = broker.socket_path().to_owned();
    let home = TestHome::new();
    let sock = socket.to_str().unwrap();
    let (code, err) = run_in(&home, &["record", "--socket", sock]).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("no gateway session now"), "{err}");
    let (status, body) = http_get(&socket, "/v1/events?tap=yes").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("tap=1"), "{body}");
    // The tap shows every client's traffic: admin only.
    let (status, _, _) = crate::http_api::request(
        &socket,
        "GET",
        "/v1/events?tap=1",
        &[("x-clawmux-scopes", "operator.read")],
        b"",
    )
    .await;
    assert_eq!(status, 403);

    let file = home.path().join("r.jsonl");
    std::fs::write(&file, synthetic(&[0], None)).unwrap();
    let f = file.to_str().unwrap();
    let (code, err) = run_in(&home, &["serve", "--replay", f, "--socket", sock]).await;
    assert_eq!(code, Some(2), "a usage error: {err}");
    assert!(err.contains("--replay needs --demo"), "{err}");
    let (code, err) = run_in(&home, &["mock-gateway", "--replay", f, "--speed", "0"]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--speed takes a number from 0.001 to 1000"),
        "{err}"
    );
    let (code, err) = run_in(&home, &["mock-gateway", "--speed", "2"]).await;
    assert_eq!(code, Some(2), "--speed without --replay: {err}");
    let missing = home.path().join("missing.jsonl");
    let (code, err) = run_in(
        &home,
        &[
            "mock-gateway",
            "--port",
            "0",
            "--replay",
            missing.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot read the recording"), "{err}");
}

/// A recording with these events at these offsets (ms), a gap before the
/// event at `gap_before`, and one recorded exchange.
fn synthetic(offsets: &[u64], gap_before: Option<usize>) -> String {
    let mut lines = vec![
        json!({"format":"clawmux-recording","version":1,"gateway_version":"2026.9.6",
        "broker_version":"0.1.0","started_at":"2026-11-23T10:00:00.000Z","started_ms":1_000_000u64,
        "hello":{"type":"hello-ok","protocol":4,"server":{"version":"2026.9.6","connId":"x"},
                 "features":{"methods":["health","chat.history"],"events":["chat"]},
                 "snapshot":{"presence":[],"health":{},"stateVersion":{"presence":1,"health":1},
                             "sessionDefaults":{"defaultAgentId":"main","mainKey":"main","mainSessionKey":"agent:main:main"}},
                 "policy":{"maxPayload":26214400,"maxBufferedBytes":52428800,"tickIntervalMs":30000},
                 "auth":{"role":"operator","scopes":["operator.admin"]}}}),
    ];
    for (i, at) in offsets.iter().enumerate() {
        let ms = 1_000_100 + at;
        if gap_before == Some(i) {
            lines.push(json!({"ms": ms, "dir": "in", "gap": {"after": i, "next": i + 2}}));
        }
        lines.push(json!({"ms": ms, "dir": "in", "cursor": i + 1,
            "frame": {"type":"event","event":"chat","payload":{"n": i}}}));
    }
    lines.push(json!({"ms": 1_000_050, "dir": "out", "frame": {"type":"req","id":"cm-1","method":"health"}}));
    lines.push(json!({"ms": 1_000_060, "dir": "in", "frame": {"type":"res","id":"cm-1","ok":true,"payload":{"ok":true,"recorded":true}}}));
    lines.iter().map(|l| format!("{l}\n")).collect()
}

#[tokio::test(start_paused = true)]
async fn speed_paces_the_replay_and_gaps_stay_visible() {
    // Recorded: 4,000 s apart in all; replayed at 4000x on tokio's paused
    // clock, the span is the pace's alone, whatever this machine's speed.
    let offsets = [0, 1_000_000, 2_000_000, 4_000_000];
    let rec = Recording::parse(&synthetic(&offsets, Some(2))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_gw, path) = replay_double(dir.path(), rec.clone(), Pace::Speed(4000.0), false).await;
    let (mut c, _) = direct_client(&path).await;
    let first = c.event("chat").await;
    let t0 = tokio::time::Instant::now();
    let rest = read_events(&mut c, 3).await;
    let span = t0.elapsed();
    // At 4000x: 1 s (ignoring the speed: 4,000 s; `--instant`: none).
    assert!(
        span >= Duration::from_millis(999) && span < Duration::from_millis(1100),
        "{span:?}"
    );
    let seqs: Vec<u64> = std::iter::once(&first)
        .chain(&rest)
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [1, 2, 4, 5], "the recorded gap is a skipped seq");
    assert_eq!(rest[2]["payload"]["n"], 3);

    let (_gw2, path2) = {
        let d = dir.path().join("instant");
        std::fs::create_dir(&d).unwrap();
        replay_double(&d, rec, Pace::Instant, false).await
    };
    let (mut c, _) = direct_client(&path2).await;
    // `--instant` does not wait (at 1x this would take 4,000 s).
    let all = read_events(&mut c, 4).await;
    assert_eq!(all[3]["payload"]["n"], 3);
}

#[tokio::test]
async fn a_replay_reaches_several_clients_through_the_broker() {
    let rec = Recording::parse(&synthetic(&[0, 50, 100, 150, 200], Some(3))).unwrap();
    let gw = MockGateway::start(MockConfig {
        token: Some("test-token".into()),
        replay: Some(Replay::new(rec, Pace::Speed(1.0), true)),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    let broker = RunningBroker::start(settings).await.unwrap();
    let socket = broker.socket_path().to_owned();
    until_ready(&socket).await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut c = WsClient::open(&socket, "/ws").await;
        c.handshake().await;
        clients.push(c);
    }
    for c in &mut clients {
        // Find the start of a whole loop, then read it through.
        loop {
            let e = c.event("chat").await;
            if e["payload"]["n"] == 0 {
                c.events.insert(0, e);
                break;
            }
        }
        let cycle = read_events(c, 5).await;
        let ns: Vec<u64> = cycle
            .iter()
            .map(|e| e["payload"]["n"].as_u64().unwrap())
            .collect();
        assert_eq!(ns, [0, 1, 2, 3, 4]);
        let seqs: Vec<u64> = cycle.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs[1], seqs[0] + 1);
        assert_eq!(
            seqs[3],
            seqs[2] + 2,
            "the recorded gap reaches every client: {seqs:?}"
        );
    }
    let answer = clients[1].request("health", json!(null)).await;
    assert_eq!(answer["payload"]["recorded"], true, "{answer}");
    let miss = clients[2].request("status", json!(null)).await;
    assert_eq!(miss["error"]["code"], "INVALID_REQUEST", "{miss}");
    assert!(
        miss["error"]["message"]
            .as_str()
            .unwrap()
            .contains("status"),
        "{miss}"
    );
}

#[tokio::test]
async fn a_cut_off_last_line_is_reported_and_a_broken_one_refused() {
    let home = TestHome::new();
    let text = synthetic(&[0, 10], None);
    let cut = home.path().join("cut.jsonl");
    std::fs::write(&cut, &text[..text.len() - 20]).unwrap();
    let mut gw = Command::from(home.clawmux());
    gw.args(["mock-gateway", "--port", "0", "--instant", "--replay"])
        .arg(&cut)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = gw.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut said = String::new();
    while !said.contains("listening") {
        let line = tokio::time::timeout(SLOW, lines.next_line())
            .await
            .expect("starts")
            .unwrap();
        let Some(line) = line else {
            panic!("exited early: {said}")
        };
        said.push_str(&line);
        said.push('\n');
    }
    assert!(
        said.contains("warning") && said.contains("incomplete"),
        "{said}"
    );
    sigint(&child);
    assert_eq!(exit_code(&mut child).await, 0);

    let broken = home.path().join("broken.jsonl");
    let mut lines: Vec<&str> = text.lines().collect();
    lines[1] = "{\"ms\":";
    std::fs::write(&broken, lines.join("\n") + "\n").unwrap();
    let out = tokio::time::timeout(
        SLOW,
        Command::from(home.clawmux())
            .args(["mock-gateway", "--port", "0", "--replay"])
            .arg(&broken)
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("line 2 is not JSON"), "{err}");
}

#[tokio::test]
async fn serve_demo_replays_the_real_gateway_fixture() {
    let rec = Recording::load(Path::new(FIXTURE)).expect("the fixture parses");
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    let home = TestHome::new();
    let socket = home.path().join("run/clawmux.sock");
    let mut serve = Command::from(home.clawmux());
    serve
        .args([
            "serve",
            "--demo",
            "--instant",
            "--replay",
            FIXTURE,
            "--socket",
        ])
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut serve = serve.spawn().unwrap();
    eventually_within("serve --demo --replay listening", SLOW, || {
        let up = socket.exists();
        async move {
            if up {
                Ok(())
            } else {
                Err("no socket yet")
            }
        }
    })
    .await;
    until_ready(&socket).await;
    let (mut c, hello) = {
        let mut c = WsClient::open(&socket, "/ws").await;
        let hello = c.handshake().await;
        (c, hello)
    };
    assert_eq!(hello["server"]["version"], rec.gateway_version().unwrap());
    // A recorded request through the broker gets its recorded answer.
    let exchange = rec
        .exchanges
        .iter()
        .find(|e| e.method == "chat.history")
        .expect("the fixture recorded chat.history");
    let answer = c.request("chat.history", exchange.params.clone()).await;
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["payload"], exchange.answers[0].1);
    // What the activity views need is in it: assistant text, a tool call.
    let events: Vec<&Played> = rec.timeline.iter().collect();
    let has = |pred: &dyn Fn(&str, &Value) -> bool| {
        events
            .iter()
            .any(|p| matches!(p, Played::Event { event, payload, .. } if pred(event, payload)))
    };
    assert!(
        has(&|e, p| e == "agent" && p["stream"] == "assistant"),
        "assistant text"
    );
    assert!(
        has(&|e, p| e == "chat" && p["state"] == "final"),
        "a final chat message"
    );
    assert!(
        has(&|e, p| (e == "agent" && p["stream"] == "tool") || e == "session.tool"),
        "a tool call"
    );
    // A clean stop removes the demo's private directory (a kill would leave it).
    sigterm_child(&serve);
    assert_eq!(exit_code(&mut serve).await, 0);
}

#[tokio::test]
async fn events_only_some_clients_get_are_recorded_without_a_cursor() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let home = TestHome::new();
    let file = home.path().join("tools.jsonl");
    let mut recorder = start_recorder(&home, &h.socket(), &file, &["--requests"]).await;
    // `a` asked for tool events and starts the run: the tool stream is its alone.
    let (mut a, _) = h.connected().await;
    let sent = a
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "use a tool", "idempotencyKey": "run-tool-1"}),
        )
        .await;
    assert_eq!(sent["ok"], true, "{sent}");
    loop {
        let e = a.event("chat").await;
        if e["payload"]["state"] == "final" {
            break;
        }
    }
    file_where(&file, "the run's final message", |t| {
        t.contains("\"state\":\"final\"")
    })
    .await;
    sigint(&recorder);
    assert_eq!(exit_code(&mut recorder).await, 0);
    let text = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tool: Vec<&Value> = lines
        .iter()
        .filter(|l| l["frame"]["payload"]["stream"] == "tool")
        .collect();
    // The double's scripted run calls two tools in parallel: a start and a
    // result for each.
    assert_eq!(tool.len(), 4, "tool starts and results: {text}");
    assert!(tool
        .iter()
        .all(|l| l.get("cursor").is_none() && l["frame"].get("seq").is_none()));
    let broadcast = lines
        .iter()
        .find(|l| l["frame"]["payload"]["stream"] == "assistant")
        .expect("assistant text");
    assert!(broadcast["cursor"].as_u64().is_some(), "{broadcast}");
    assert!(lines
        .iter()
        .any(|l| l["dir"] == "out" && l["frame"]["method"] == "chat.send"));
    let rec = Recording::parse(&text).unwrap();
    assert_eq!(
        rec.matching(
            "chat.send",
            &json!({"sessionKey": "main", "message": "use a tool", "idempotencyKey": "run-tool-1"})
        )
        .len(),
        1
    );
}

/// Reads `serve`'s stderr until a line containing `needle`; returns all so far.
async fn stderr_until(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
    seen: &mut String,
    needle: &str,
) {
    let deadline = tokio::time::Instant::now() + SLOW;
    while !seen.contains(needle) {
        match tokio::time::timeout_at(deadline, lines.next_line()).await {
            Ok(Ok(Some(line))) => {
                seen.push_str(&line);
                seen.push('\n');
            }
            _ => panic!("no {needle:?} in serve's output:\n{seen}"),
        }
    }
}

/// `serve --demo --replay` speaks about the recording: what it plays, a
/// `call` it can answer, no INFO log lines, and when it has ended. Without
/// recorded answers it says so, and how to record them.
#[tokio::test]
async fn serve_demo_replay_says_what_it_plays_and_when_it_ends() {
    let home = TestHome::new();
    // The fixture without its requests and answers.
    let no_answers = home.path().join("events-only.jsonl");
    let text: String = std::fs::read_to_string(FIXTURE)
        .unwrap()
        .lines()
        .filter(|l| !l.contains(r#""dir":"out""#) && !l.contains(r#""type":"res""#))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&no_answers, text).unwrap();
    for (file, answers) in [(FIXTURE, true), (no_answers.to_str().unwrap(), false)] {
        let socket = home.path().join("run/clawmux.sock");
        let mut serve = Command::from(home.clawmux());
        serve
            .args(["serve", "--demo", "--instant", "--replay", file, "--socket"])
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut serve = serve.spawn().unwrap();
        let mut lines = BufReader::new(serve.stderr.take().unwrap()).lines();
        let mut seen = String::new();
        stderr_until(&mut lines, &mut seen, "the recording has ended").await;
        assert!(
            seen.contains("a gateway double that plays the recording ("),
            "{seen}"
        );
        assert!(!seen.contains("scripted agent"), "{seen}");
        assert!(
            !seen.contains(" INFO "),
            "no log lines at the default level: {seen}"
        );
        assert!(!seen.contains("sse client"), "{seen}");
        let (code, _, err) =
            run_clawmux(&["call", "--socket", socket.to_str().unwrap(), "health"]).await;
        if answers {
            assert!(seen.contains("# answered as recorded"), "{seen}");
            assert!(
                !seen.contains(" call health"),
                "health was not recorded: {seen}"
            );
            assert!(err.contains("recorded methods: "), "{err}");
        } else {
            assert!(
                seen.contains(
                    "the recording has no answers; `clawmux record --requests` records them"
                ),
                "{seen}"
            );
            assert_eq!(code, 1, "{err}");
            assert!(
                err.contains(
                    "the recording has no answers: `clawmux record --requests` records them"
                ),
                "{err}"
            );
        }
        sigterm_child(&serve);
        assert_eq!(exit_code(&mut serve).await, 0);
    }
}
