//! Watching agents: the observers' opt-in to tool-stream events
//! (`/v1/events?tool_events=all`), who `/v1/state` says each client is, and
//! `clawmux tail --tree/--hud` and `clawmux top` against the gateway double.

use crate::http_api::{open_events, state, Item};
use crate::support::*;
use serde_json::{json, Value};

/// The tool-stream events on an SSE stream until the run's lifecycle end;
/// each is logged (an `id:`, the frame's `seq` the same cursor), so a
/// reader resumes after it .
async fn tool_events_until_end(sse: &mut crate::http_api::Sse) -> Vec<Value> {
    let mut tools = Vec::new();
    loop {
        match sse.next_item().await {
            Item::Event { id, data, .. } => {
                if data["payload"]["stream"] == "tool" {
                    assert_eq!(data["seq"], id, "{data}");
                    tools.push(data);
                } else if data["payload"]["stream"] == "lifecycle"
                    && data["payload"]["data"]["phase"] == "end"
                {
                    return tools;
                }
            }
            Item::Other(record) => {
                assert!(
                    !record.contains("\"tool\""),
                    "a tool event without an id: {record}"
                );
            }
            Item::Comment(_) => {}
        }
    }
}

#[tokio::test]
async fn an_observer_stream_sees_the_tool_calls_of_runs_started_through_the_broker() {
    let h = start().await;
    let socket = h.socket();
    let mut observer = open_events(&socket, "/v1/events?tool_events=all", &[])
        .await
        .expect("observer stream");
    let mut plain = open_events(&socket, "/v1/events?tool_events=own", &[])
        .await
        .expect("plain stream");
    // The starter did not ask for tool events: nobody but the observer gets them.
    let mut starter = h.client().await;
    starter.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["caps"] = json!([]);
    starter.send_json(&frame).await;
    assert_eq!(starter.response("c1").await["ok"], true);
    let st = state(&socket).await;
    let observers: Vec<bool> = st["clients"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["kind"] == "sse")
        .map(|c| c["tool_observer"].as_bool().unwrap())
        .collect();
    assert_eq!(observers.iter().filter(|o| **o).count(), 1, "{st}");
    let key = uuid::Uuid::new_v4().to_string();
    starter
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "hi", "idempotencyKey": key}),
        )
        .await;
    let tools = tool_events_until_end(&mut observer).await;
    let phases: Vec<(String, String)> = tools
        .iter()
        .map(|f| {
            assert_eq!(f["event"], "agent");
            assert_eq!(f["payload"]["runId"], key.as_str());
            let d = &f["payload"]["data"];
            (
                d["name"].as_str().unwrap().to_owned(),
                d["phase"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        phases,
        [
            ("exec", "start"),
            ("read", "start"),
            ("read", "result"),
            ("exec", "result")
        ]
        .map(|(n, p)| (n.to_owned(), p.to_owned())),
        "both tool calls, in the order they happened"
    );
    assert!(
        tool_events_until_end(&mut plain).await.is_empty(),
        "an ordinary stream gets none"
    );
    while let Some(e) = starter.events.pop() {
        assert_ne!(
            e["payload"]["stream"], "tool",
            "the starter did not ask for them"
        );
    }
    loop {
        let e = starter.event("agent").await;
        assert_ne!(
            e["payload"]["stream"], "tool",
            "the starter did not ask for them"
        );
        if e["payload"]["data"]["phase"] == "end" {
            break;
        }
    }
}

#[tokio::test]
async fn a_bad_tool_events_value_is_refused_with_what_to_send() {
    let h = start().await;
    let err = match open_events(&h.socket(), "/v1/events?tool_events=yes", &[]).await {
        Err(e) => e,
        Ok(_) => panic!("tool_events=yes opened a stream"),
    };
    assert_eq!(err.0, 400);
    let message = err.1["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("tool_events=own or tool_events=all"),
        "{}",
        err.1
    );
}

#[tokio::test]
async fn state_lists_each_clients_declared_identity_peer_pid_and_connection_time() {
    let h = start().await;
    let before = clawmux::protocol::now_ms();
    let mut c = h.client().await;
    c.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["client"] = json!({"id": "cli", "version": "9.8.7", "platform": "linux", "mode": "cli", "displayName": "watcher"});
    c.send_json(&frame).await;
    assert_eq!(c.response("c1").await["ok"], true);
    let _sse = open_events(&h.socket(), "/v1/events", &[])
        .await
        .expect("stream");
    let st = state(&h.socket()).await;
    let clients = st["clients"].as_array().expect("clients");
    let ws = clients
        .iter()
        .find(|c| c["kind"] == "ws")
        .expect("ws client");
    assert_eq!(
        ws["declared"],
        json!({"client_id": "cli", "mode": "cli", "version": "9.8.7", "display_name": "watcher"})
    );
    // This test process is the peer on both connections.
    assert_eq!(ws["peer_pid"], std::process::id());
    let at = ws["connected_at_ms"].as_u64().expect("connected_at_ms");
    assert!(at >= before && at <= clawmux::protocol::now_ms(), "{ws}");
    let sse = clients
        .iter()
        .find(|c| c["kind"] == "sse")
        .expect("sse client");
    assert_eq!(sse["peer_pid"], std::process::id());
    assert_eq!(sse["declared"]["client_id"], Value::Null);
    assert_eq!(sse["tool_observer"], false);
}

/// A tmux server of the test's own (its socket in a temp dir), running one
/// pane of 80×24; killed when dropped.
struct Tmux {
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmux {
    /// The tests using it are ignored where build.rs found no tmux.
    fn start(home: &TestHome, command: &str) -> Tmux {
        assert!(
            std::process::Command::new("tmux").arg("-V").output().is_ok(),
            "tmux is not installed, yet build.rs found it (`touch build.rs` after removing or installing a tool)"
        );
        let dir = tempfile::tempdir().expect("tmux dir");
        let tmux = Tmux {
            socket: dir.path().join("tmux.sock"),
            _dir: dir,
        };
        let mut cmd = std::process::Command::new("tmux");
        home.apply(&mut cmd);
        let status = cmd
            .arg("-S")
            .arg(&tmux.socket)
            .args([
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-x",
                "80",
                "-y",
                "24",
                command,
            ])
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env_remove("TMUX")
            .env_remove("NO_COLOR")
            .status()
            .expect("tmux runs");
        assert!(status.success(), "tmux new-session");
        tmux
    }

    fn run(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p"])
    }

    /// Waits (bounded) until the pane shows every one of `texts`.
    async fn wait_for(&self, texts: &[&str]) -> String {
        let what = format!("the pane to show {texts:?}");
        eventually_within(&what, TERMINAL_PATIENCE, || {
            let screen = self.screen();
            let shown = texts.iter().all(|t| screen.contains(t));
            async move {
                if shown {
                    Ok(screen)
                } else {
                    Err(format!("it shows:\n{screen}"))
                }
            }
        })
        .await
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        self.run(&["kill-server"]);
    }
}

/// How long a terminal test waits for the screen (a debug build drawing
/// under a CPU hog on 2 cores is slow to start).
const TERMINAL_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// The pane's shell line: `clawmux top` (its pid written to `pidfile`),
/// then how it exited and whether the terminal is back to cooked mode
/// (`stty` shows `icanon` and `echo`, not `-icanon`/`-echo`), and whether
/// the alternate screen was left.
fn top_then_report(socket: &std::path::Path, pidfile: &std::path::Path) -> String {
    format!(
        "sh -c 'echo $$ > {pid}; exec {bin} top --socket {sock}'; echo top-exited=$?; stty -a | grep -o -- ' -*icanon\\| -*echo ' | tr -d '\\n'; echo; sleep 600",
        pid = pidfile.display(),
        bin = env!("CARGO_BIN_EXE_clawmux"),
        sock = socket.display(),
    )
}

async fn assert_terminal_restored(tmux: &Tmux) {
    // The stty line comes after the exit line: wait for both.
    let screen = tmux.wait_for(&["top-exited=0", "canon"]).await;
    assert!(
        screen.contains(" icanon echo"),
        "cooked mode again:\n{screen}"
    );
    assert!(
        !screen.contains("-icanon") && !screen.contains("-echo"),
        "{screen}"
    );
    assert!(
        !screen.contains("clawmux top  upstream"),
        "the dashboard is gone:\n{screen}"
    );
    assert_eq!(
        tmux.run(&["display", "-p", "#{alternate_on}"]).trim(),
        "0",
        "left the alternate screen"
    );
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "tmux"),
    ignore = "needs tmux to run `clawmux top` in a terminal (apt-get install tmux; CI runs this)"
)]
async fn top_in_a_real_terminal_shows_a_run_with_thinking_and_two_tool_calls_then_q_restores_it() {
    let h = start().await;
    let home = TestHome::new();
    let pidfile = home.path().join("top.pid");
    let tmux = Tmux::start(&home, &top_then_report(&h.socket(), &pidfile));
    tmux.wait_for(&["clawmux top", "upstream ready", "Clients", "(observer)"])
        .await;
    let (mut c, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    c.request(
        "chat.send",
        json!({"sessionKey": "main", "message": "hi", "idempotencyKey": key}),
    )
    .await;
    let screen = tmux
        .wait_for(&[
            &format!("run {}", &key[..8]),
            "thinking",
            "tool exec command=\"ls\" ok",
            "tool read path=\"README.md\" ok",
            "assistant \"Echo: hi\"",
            "end ok after",
            "cli/cli",
        ])
        .await;
    assert!(screen.lines().count() <= 24, "{screen}");
    tmux.run(&["send-keys", "q"]);
    assert_terminal_restored(&tmux).await;
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "tmux"),
    ignore = "needs tmux to run `clawmux top` in a terminal (apt-get install tmux; CI runs this)"
)]
async fn top_gives_the_terminal_back_on_sigterm() {
    let h = start().await;
    let home = TestHome::new();
    let pidfile = home.path().join("top.pid");
    let tmux = Tmux::start(&home, &top_then_report(&h.socket(), &pidfile));
    tmux.wait_for(&["clawmux top", "upstream ready"]).await;
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid");
    let pid = rustix::process::Pid::from_raw(pid).expect("a live pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    assert_terminal_restored(&tmux).await;
}

#[tokio::test]
async fn top_without_a_terminal_or_a_broker_says_what_to_do() {
    let home = TestHome::new();
    let out = home
        .clawmux()
        .args(["top", "--socket"])
        .arg(home.path().join("nothing.sock"))
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(3), "unreachable");
    let h = start().await;
    let mut cmd = home.clawmux();
    cmd.args(["top", "--socket"]).arg(h.socket());
    // Off the runtime thread: the broker under test runs on it.
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("joined")
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs a terminal") && err.contains("tail --tree"),
        "{err}"
    );
    // Said once: the command is named by the prefix only.
    assert!(err.starts_with("clawmux top: needs a terminal"), "{err}");
    assert_eq!(err.matches("clawmux top").count(), 1, "{err}");
}

/// `clawmux tail <args>` against the harness, its stdout lines on a channel.
fn spawn_tail(
    home: &TestHome,
    socket: &std::path::Path,
    args: &[&str],
) -> (ChildGuard, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use std::io::BufRead;
    let mut child = home
        .clawmux()
        .arg("tail")
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("tail starts");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (ChildGuard(child), rx)
}

/// Lines until one contains `last` (bounded).
async fn lines_until(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    last: &str,
) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        let line = tokio::time::timeout(TERMINAL_PATIENCE, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no line with {last:?} in time; got {lines:#?}"))
            .unwrap_or_else(|| panic!("tail ended before {last:?}; got {lines:#?}"));
        let done = line.contains(last);
        lines.push(line);
        if done {
            return lines;
        }
    }
}

async fn run_to_end(h: &Harness) -> String {
    let (mut c, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    c.request(
        "chat.send",
        json!({"sessionKey": "main", "message": "hi", "idempotencyKey": key}),
    )
    .await;
    loop {
        let e = c.event("agent").await;
        if e["payload"]["runId"] == key.as_str() && e["payload"]["data"]["phase"] == "end" {
            return key;
        }
    }
}

#[tokio::test]
async fn tail_hud_prints_turns_thinking_and_tools_and_marks_replayed_ones() {
    let h = start().await;
    let home = TestHome::new();
    // A run that is over before tail starts: it comes from the replay log.
    let old = run_to_end(&h).await;
    let epoch = state(&h.socket()).await["epoch"]
        .as_str()
        .unwrap()
        .to_owned();
    let (_tail, mut rx) = spawn_tail(
        &home,
        &h.socket(),
        &["--hud", "--after", &format!("{epoch}:0")],
    );
    let replayed: Vec<Value> = lines_until(&mut rx, "turn_end")
        .await
        .iter()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(replayed[0]["type"], "hud");
    assert_eq!(replayed[0]["event"], "turn_start");
    assert_eq!(replayed[0]["correlationId"], old.as_str());
    assert!(
        replayed.iter().all(|l| l["replay"] == true),
        "{replayed:#?}"
    );
    assert!(replayed.iter().any(|l| l["event"] == "think_end"));
    // Live: both tool calls with ids, parents and durations.
    let live = run_to_end(&h).await;
    let lines: Vec<Value> = lines_until(&mut rx, "turn_end")
        .await
        .iter()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let types: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        [
            "turn_start",
            "think_start",
            "think_end",
            "tool_start",
            "tool_start",
            "tool_end",
            "tool_end",
            "turn_end"
        ]
    );
    for l in &lines {
        assert!(l.get("replay").is_none(), "live: {l}");
        assert!(
            l["ts"].is_u64() && l["correlationId"].is_string() && l["type"] == "hud",
            "{l}"
        );
        assert!(
            uuid::Uuid::parse_str(l["id"].as_str().unwrap()).is_ok(),
            "{l}"
        );
    }
    let read_end = &lines[5];
    assert_eq!(
        (read_end["tool"].clone(), read_end["parentId"].clone()),
        (json!("read"), json!(live))
    );
    assert!(
        read_end["durationMs"].is_u64() && read_end["result"]["ok"] == true,
        "{read_end}"
    );
    assert_eq!(
        read_end["correlationId"], lines[4]["correlationId"],
        "start and end of one call"
    );
    assert!(read_end["correlationId"]
        .as_str()
        .unwrap()
        .starts_with("call_"));
    assert_eq!(lines[7]["status"], "ok");
}

#[tokio::test]
async fn tail_tree_prints_the_same_projection_as_indented_lines() {
    let h = start().await;
    let home = TestHome::new();
    let (_tail, mut rx) = spawn_tail(&home, &h.socket(), &["--tree"]);
    // tail is following once the broker counts its stream.
    let socket = h.socket();
    eventually_within(
        "the broker counts tail's stream",
        TERMINAL_PATIENCE,
        || async {
            let s = state(&socket).await;
            if s["clients"].as_array().is_some_and(|c| !c.is_empty()) {
                Ok(())
            } else {
                Err(s)
            }
        },
    )
    .await;
    let key = run_to_end(&h).await;
    let lines = lines_until(&mut rx, &format!("run {} ok", key)).await;
    let text: Vec<&str> = lines.iter().map(|l| l.split_once(' ').unwrap().1).collect();
    assert_eq!(text[0], "agent:main:main");
    assert_eq!(text[1], format!("  run {} started", key));
    assert!(text[2].starts_with("    thinking "), "{text:#?}");
    assert_eq!(text[3], "    tool exec command=\"ls\"");
    assert_eq!(text[4], "    tool read path=\"README.md\"");
    assert!(
        text[5].starts_with("    tool read ok ") && text[6].starts_with("    tool exec ok "),
        "{text:#?}"
    );
    assert_eq!(text[7], "    assistant \"Echo: hi\"");
    assert!(
        text[8].starts_with(&format!("  run {} ok in ", key)),
        "{text:#?}"
    );
}

/// The follower's next report (bounded).
async fn next(
    rx: &mut tokio::sync::mpsc::Receiver<clawmux::cli::watch::Feed>,
) -> clawmux::cli::watch::Feed {
    tokio::time::timeout(TERMINAL_PATIENCE, rx.recv())
        .await
        .expect("a report in time")
        .expect("follower alive")
}

#[tokio::test]
async fn the_observer_follower_resumes_after_a_broker_restart_with_the_new_brokers_events() {
    use clawmux::cli::watch::{follow, Feed};
    let Harness { gw, broker, dir } = start().await;
    let socket = broker.socket_path().to_owned();
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let follower = tokio::spawn(follow(clawmux::cli::BrokerClient::new(socket.clone()), tx));
    let first = match next(&mut rx).await {
        Feed::Connected { epoch, .. } => epoch,
        other => panic!("{other:?}"),
    };
    assert!(
        broker.shutdown(std::time::Duration::from_secs(5)).await,
        "stopped"
    );
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    let broker = clawmux::RunningBroker::start(settings)
        .await
        .expect("restarts");
    // A run on the new broker reaches the follower, after it said what happened.
    let h = Harness { gw, broker, dir };
    let (mut reports, mut second) = (Vec::new(), None);
    while second.is_none() {
        match next(&mut rx).await {
            Feed::Connected { epoch, .. } if epoch != first => second = Some(epoch),
            other => reports.push(format!("{other:?}")),
        }
    }
    let key = run_to_end(&h).await;
    // Cursors are durable: the follower resumes its own cursor and is told
    // of the downtime (the restart's `clawmux.gap`) before the new events.
    let mut missed = false;
    loop {
        match next(&mut rx).await {
            Feed::Event {
                name,
                frame,
                replay,
                ..
            } => {
                if name == "agent"
                    && frame["payload"]["runId"] == key.as_str()
                    && frame["payload"]["stream"] == "tool"
                {
                    assert!(!replay);
                    break;
                }
            }
            Feed::Missed(_) => missed = true,
            other => reports.push(format!("{other:?}")),
        }
    }
    assert!(reports.iter().any(|r| r.contains("Lost")), "{reports:#?}");
    assert!(missed, "the restart gap was reported");
    follower.abort();
}

#[tokio::test]
async fn after_a_broker_restart_the_follower_replays_what_the_new_broker_logged() {
    use clawmux::cli::watch::{follow_with, Feed, Follow, Start};
    let h = start().await;
    // Events the "new" broker logged before the follower came back.
    let key = run_to_end(&h).await;
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let how = Follow {
        // A cursor of another broker life: the broker answers 410, with its
        // window under error.details.
        start: Start::After(clawmux::hub::replay::EventId {
            epoch: Some("an-earlier-life".into()),
            cursor: 3,
        }),
        events: Vec::new(),
        observer: true,
    };
    let follower = tokio::spawn(follow_with(
        clawmux::cli::BrokerClient::new(h.socket()),
        how,
        tx,
    ));
    let mut said = Vec::new();
    loop {
        match next(&mut rx).await {
            Feed::Event {
                name,
                frame,
                replay,
                ..
            } => {
                if name == "agent" && frame["payload"]["runId"] == key.as_str() {
                    assert!(replay, "from the log");
                    break;
                }
            }
            other => said.push(format!("{other:?}")),
        }
    }
    // (Cursors are durable integers now: an old life's cursor resumes in
    // the log that continues it, so there is no "restarted" to report.)
    drop(said);
    follower.abort();
}

#[tokio::test]
async fn tail_tree_n_prints_the_last_n_lines_of_what_is_held_then_follows() {
    let h = start().await;
    let home = TestHome::new();
    let first = run_to_end(&h).await;
    let second = run_to_end(&h).await;
    let (_tail, mut rx) = spawn_tail(&home, &h.socket(), &["--tree", "-n", "3"]);
    // The held lines come once tail has read through the newest held event.
    let held = lines_until(&mut rx, &format!("run {} ok", second)).await;
    assert_eq!(held.len(), 3, "{held:#?}");
    assert!(
        held.iter().all(|l| !l.contains(first.as_str())),
        "only the last 3: {held:#?}"
    );
    let live = run_to_end(&h).await;
    let lines = lines_until(&mut rx, &format!("run {} ok", live)).await;
    assert!(
        lines[0].contains(&format!("run {} started", live)),
        "then live: {lines:#?}"
    );
}

/// `tail --tree --run R` prints that run only (whole ids: two runs never
/// look alike), its history lines marked `(history)`.
#[tokio::test]
async fn tail_tree_run_prints_only_that_run_and_marks_history() {
    let h = start().await;
    let home = TestHome::new();
    let first = run_to_end(&h).await;
    let second = run_to_end(&h).await;
    let third = run_to_end(&h).await;
    let prefix = &second[..13];
    let (_tail, mut rx) = spawn_tail(&home, &h.socket(), &["--tree", "-n", "50", "--run", prefix]);
    let held = lines_until(&mut rx, &format!("run {second} ok")).await;
    assert!(
        held.iter()
            .all(|l| !l.contains(first.as_str()) && !l.contains(third.as_str())),
        "only the run asked for: {held:#?}"
    );
    assert!(
        held.iter()
            .any(|l| l.contains(&format!("run {second} started (history)"))),
        "{held:#?}"
    );
    assert!(
        held.iter().skip(1).all(|l| l.ends_with(" (history)")),
        "read from the broker's log: {held:#?}"
    );
    assert!(held.iter().all(|l| !l.contains("(replay)")), "{held:#?}");
}

/// The next HUD record of a `/v1/hud` stream: its `id:` (if any) and event.
async fn next_hud(sse: &mut crate::http_api::Sse) -> (Option<String>, Value) {
    loop {
        let record = match sse.next_item().await {
            Item::Other(record) => record,
            Item::Event { name, .. } => panic!("a named record on /v1/hud: {name}"),
            Item::Comment(_) => continue,
        };
        if record
            .lines()
            .any(|l| l.starts_with("event: ") || l.starts_with("retry:"))
        {
            continue;
        }
        let id = record
            .lines()
            .find_map(|l| l.strip_prefix("id: "))
            .map(str::to_owned);
        let data = record
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or_else(|| panic!("a data line: {record}"));
        return (
            id,
            serde_json::from_str(data).expect("one HUD event per data line"),
        );
    }
}

/// HUD records until the `turn_end` of `run`.
async fn hud_until_turn_end(
    sse: &mut crate::http_api::Sse,
    run: &str,
) -> Vec<(Option<String>, Value)> {
    let mut out = Vec::new();
    loop {
        let (id, event) = next_hud(sse).await;
        let end = event["event"] == "turn_end" && event["correlationId"] == run;
        out.push((id, event));
        if end {
            return out;
        }
    }
}

#[tokio::test]
async fn v1_hud_serves_history_flagged_replay_then_live_events_with_received_and_resumes() {
    let h = start().await;
    let old = run_to_end(&h).await;
    let mut hud = open_events(&h.socket(), "/v1/hud?history=1", &[])
        .await
        .expect("a HUD stream");
    let history = hud_until_turn_end(&mut hud, &old).await;
    assert_eq!(history[0].1["event"], "turn_start");
    assert_eq!(history[0].1["correlationId"], old.as_str());
    for (_, e) in &history {
        assert_eq!(
            (e["type"].clone(), e["replay"].clone()),
            (json!("hud"), json!(true)),
            "{e}"
        );
        assert!(
            uuid::Uuid::parse_str(e["id"].as_str().unwrap()).is_ok(),
            "{e}"
        );
    }
    // Live: a message sent, then the run with its two parallel tool calls.
    let (mut c, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    c.request(
        "chat.send",
        json!({"sessionKey": "main", "message": "hi there", "idempotencyKey": key}),
    )
    .await;
    let live = hud_until_turn_end(&mut hud, &key).await;
    let events: Vec<&Value> = live.iter().map(|(_, e)| e).collect();
    let received = events
        .iter()
        .find(|e| e["event"] == "received")
        .expect("a received event");
    assert_eq!(received["subtype"], "message");
    assert_eq!(received["payload"]["preview"], "hi there");
    assert!(events.iter().all(|e| e.get("replay").is_none()), "live");
    let kinds: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] != "received")
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "turn_start",
            "think_start",
            "think_end",
            "tool_start",
            "tool_start",
            "tool_end",
            "tool_end",
            "turn_end"
        ]
    );
    let tools: Vec<&&Value> = events.iter().filter(|e| e["tool"].is_string()).collect();
    for end in tools.iter().filter(|e| e["event"] == "tool_end") {
        let start = tools
            .iter()
            .find(|s| s["event"] == "tool_start" && s["correlationId"] == end["correlationId"])
            .expect("paired by correlationId");
        assert_eq!(start["tool"], end["tool"]);
        assert_eq!(end["parentId"], key.as_str());
        assert!(
            end["durationMs"].is_u64() && end["result"]["ok"] == true,
            "{end}"
        );
    }
    let exec_end = tools
        .iter()
        .find(|e| e["event"] == "tool_end" && e["tool"] == "exec")
        .unwrap();
    assert_eq!(exec_end["result"]["stdout"], "README.md\nsrc\n");
    // Resume after the last logged event seen: nothing again, then the next run.
    let last_id = live
        .iter()
        .rev()
        .find_map(|(id, _)| id.clone())
        .expect("a logged event's id");
    drop(hud);
    let mut resumed = open_events(&h.socket(), "/v1/hud", &[("last-event-id", &last_id)])
        .await
        .expect("resumed");
    let next_run = run_to_end(&h).await;
    let after = hud_until_turn_end(&mut resumed, &next_run).await;
    assert!(
        after
            .iter()
            .all(|(_, e)| e["correlationId"] != key.as_str() && e["correlationId"] != old.as_str()),
        "nothing seen before: {after:#?}"
    );
    let first = after
        .iter()
        .find(|(_, e)| e["event"] != "received")
        .unwrap();
    assert_eq!(first.1["event"], "turn_start");
    assert_eq!(first.1["correlationId"], next_run.as_str());
}

#[tokio::test]
async fn ws_hud_sends_one_hud_event_per_text_frame() {
    let h = start().await;
    let old = run_to_end(&h).await;
    let mut ws = WsClient::open(&h.socket(), "/ws/hud?history=1").await;
    let mut kinds = Vec::new();
    loop {
        let e = ws.recv_json().await;
        assert_eq!(
            (e["type"].clone(), e["replay"].clone()),
            (json!("hud"), json!(true)),
            "{e}"
        );
        kinds.push(e["event"].as_str().unwrap().to_owned());
        if e["event"] == "turn_end" && e["correlationId"] == old.as_str() {
            break;
        }
    }
    assert_eq!(kinds[0], "turn_start");
    assert!(kinds.contains(&"think_end".to_owned()));
}

#[tokio::test]
async fn the_hud_feed_needs_what_tool_events_need() {
    let h = start().await;
    let refused = open_events(
        &h.socket(),
        "/v1/hud",
        &[("x-clawmux-scopes", "operator.approvals")],
    )
    .await;
    let Err((status, body)) = refused else {
        panic!("a HUD stream without operator.read")
    };
    assert_eq!(status, 403, "{body}");
    let bad = open_events(&h.socket(), "/v1/hud?history=maybe", &[]).await;
    assert!(matches!(bad, Err((400, _))));
    assert!(open_events(
        &h.socket(),
        "/v1/hud",
        &[("x-clawmux-scopes", "operator.read")]
    )
    .await
    .is_ok());
}

/// `tail --run R` (the flat view) shows that run's tool calls, as `--tree`
/// does: on a socket that allows observers it follows every tool-stream
/// event and keeps that run's.
#[tokio::test]
async fn tail_run_shows_that_runs_tool_calls() {
    let h = start().await;
    let home = TestHome::new();
    let key = uuid::Uuid::new_v4().to_string();
    let (_tail, mut rx) = spawn_tail(&home, &h.socket(), &["--run", &key]);
    let socket = h.socket();
    eventually_within("tail observes tool events", TERMINAL_PATIENCE, || async {
        let s = state(&socket).await;
        let observing = s["clients"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["tool_observer"] == true));
        if observing {
            Ok(())
        } else {
            Err(s)
        }
    })
    .await;
    let (mut c, _) = h.connected().await;
    c.request(
        "chat.send",
        json!({"sessionKey": "main", "message": "hi", "idempotencyKey": key}),
    )
    .await;
    let lines = lines_until(&mut rx, "stream=lifecycle end").await;
    assert!(
        lines.iter().all(|l| l.contains(&format!("run={key}"))),
        "only that run: {lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("stream=tool exec")),
        "its tool calls: {lines:#?}"
    );
}
