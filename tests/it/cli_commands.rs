//! The everyday commands, run as the real binary against a running broker:
//! `clawmux status`, `clawmux call`, `clawmux tail` (output and exit codes).

use std::path::Path;
use std::time::Duration;

use crate::http_api::*;
use crate::support::*;
use clawmux::hub::ClientKind;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, ChildStdout, Command};

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test]
async fn status_summarizes_a_running_broker() {
    let h = start().await;
    let state = until_ready(&h.socket()).await;
    let (_ws, _) = h.connected().await;
    let (code, out, err) = run_clawmux(&["status", "--socket", s(&h.socket())]).await;
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "upstream   ready ",
        "gateway 2026.9.6-mock (protocol 4)",
        "scopes     operator.admin",
        "clients    1 connected (1 over WebSocket, 0 reading the event stream)",
        &format!("events     newest #{}", state["newest_seq"]),
    ] {
        assert!(out.contains(want), "{want:?} in\n{out}");
    }
    let epoch = state["epoch"].as_str().unwrap();
    assert!(
        !out.contains(epoch),
        "no broker-life hash in everyday output:\n{out}"
    );
    // The socket from the environment, and the raw document.
    let out = tokio::time::timeout(
        PATIENCE,
        Command::new(BIN)
            .args(["status", "--json"])
            .env("CLAWMUX_SOCKET", h.socket())
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    assert_eq!(doc["epoch"], state["epoch"]);
    assert_eq!(doc["upstream"]["phase"], "ready");
}

#[tokio::test]
async fn status_exit_codes_for_a_broker_without_upstream_and_for_no_broker() {
    let (broker, dir) = broker_only(|_| {}).await;
    eventually_async("an upstream last_error", || async {
        let s = state(broker.socket_path()).await;
        if s["upstream"]["last_error"].is_object() {
            Ok(())
        } else {
            Err(s)
        }
    })
    .await;
    let (code, out, _) = run_clawmux(&["status", "--socket", s(broker.socket_path())]).await;
    assert_eq!(
        code, 1,
        "the broker runs but the gateway session does not: {out}"
    );
    assert!(
        out.contains("error      cannot open the gateway connection")
            && out.contains("(studio.upstream_error"),
        "what happened first, then the code: {out}"
    );

    let missing = dir.path().join("nobody-here.sock");
    // With this test's dir as HOME, its broker is one of the user's own: the
    // hint names that listening socket to use instead.
    let (code, out, err) =
        run_clawmux_in(dir.path(), &["status", "--socket", s(&missing)], PATIENCE).await;
    assert_eq!(code, 3, "{err}");
    assert!(out.is_empty());
    assert_eq!(err.lines().count(), 3, "three short lines: {err}");
    assert!(
        err.contains(s(&missing))
            && err.contains(&format!(
                "A clawmux socket of yours is listening at {}",
                s(broker.socket_path())
            )),
        "{err}"
    );
    // From another home the same broker is some other program's temporary
    // socket: the message names the socket it tried, and not that one.
    let (code, _, err) = run_clawmux(&["status", "--socket", s(&missing)]).await;
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(s(&missing)), "{err}");
    assert!(!err.contains(s(broker.socket_path())), "{err}");
}

/// A reader that goes away early (`clawmux call … | head -c 1`) ends
/// `call` quietly (exit 0), not with a panic on the broken pipe.
#[tokio::test]
async fn call_into_a_closed_pipe_exits_quietly() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = tokio::time::timeout(
        PATIENCE,
        Command::new(BIN)
            .args(["call", "--socket", s(&h.socket()), "health"])
            .env_remove("CLAWMUX_SOCKET")
            .stdout(writer)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the command finishes in time")
    .expect("the binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[tokio::test]
async fn call_prints_results_and_exits_by_outcome() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let sock = h.socket();
    let sock = s(&sock);
    let (code, out, err) = run_clawmux(&["call", "--socket", sock, "health"]).await;
    assert_eq!(code, 0, "{err}");
    let payload: Value = serde_json::from_str(&out).expect("the payload, as JSON");
    assert!(payload.is_object(), "{out}");

    let (code, out, _) = run_clawmux(&[
        "call",
        "--socket",
        sock,
        "--json",
        "chat.history",
        r#"{"sessionKey":"agent:main:main"}"#,
    ])
    .await;
    assert_eq!(code, 0);
    let frame: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (&frame["type"], &frame["ok"]),
        (&json!("res"), &json!(true))
    );
    assert_eq!(frame["payload"]["sessionKey"], "agent:main:main");

    let (code, out, err) = run_clawmux(&["call", "--socket", sock, "no.such.method", "{}"]).await;
    assert_eq!(code, 1, "an error answer: {out}{err}");
    assert!(
        err.contains("INVALID_REQUEST") && err.contains("no.such.method"),
        "{err}"
    );

    let (code, _, err) = run_clawmux(&["call", "--socket", sock, "health", "{not json"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("PARAMS_JSON is not valid JSON"), "{err}");

    let (code, _, err) = run_clawmux(&["call", "--socket", sock, "connect"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("connect is handled by the broker"), "{err}");

    let (code, _, _) = run_clawmux(&["call", "--socket", sock]).await;
    assert_eq!(code, 2, "METHOD is required");

    let gone = h.dir.path().join("gone.sock");
    let (code, _, err) = run_clawmux(&["call", "--socket", s(&gone), "health"]).await;
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(s(&gone)), "{err}");
}

/// A running `clawmux tail` with its output lines.
struct Tail {
    child: Child,
    out: Lines<BufReader<ChildStdout>>,
    err: Lines<BufReader<ChildStderr>>,
    _home: tempfile::TempDir,
}

impl Tail {
    fn spawn(args: &[&str]) -> Tail {
        Tail::spawn_with_env(args, &[])
    }

    fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Tail {
        let args = [&["tail"][..], args].concat();
        let (mut child, home) = spawn_clawmux(&args, env);
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        let err = BufReader::new(child.stderr.take().unwrap()).lines();
        Tail {
            child,
            out,
            err,
            _home: home,
        }
    }

    async fn line(&mut self) -> String {
        tokio::time::timeout(PATIENCE, self.out.next_line())
            .await
            .expect("a line in time")
            .expect("stdout readable")
            .expect("tail is still running")
    }

    /// Reads lines until one contains `needle`; returns all read.
    async fn lines_until(&mut self, needle: &str) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let line = self.line().await;
            let done = line.contains(needle);
            seen.push(line);
            if done {
                return seen;
            }
        }
    }

    async fn err_line_containing(&mut self, needle: &str) -> String {
        loop {
            let line = tokio::time::timeout(PATIENCE, self.err.next_line())
                .await
                .unwrap_or_else(|_| panic!("stderr line with {needle:?} in time"))
                .unwrap()
                .expect("tail is still running");
            if line.contains(needle) {
                return line;
            }
        }
    }
}

async fn wait_for_stream(h: &Harness) {
    eventually("tail is streaming", || {
        h.broker
            .ctx()
            .hub
            .clients()
            .iter()
            .any(|c| c.kind == ClientKind::Sse)
    })
    .await;
}

/// The cursor (second column, `#N`) of a human tail line.
fn cursor_of(line: &str) -> u64 {
    let column = line.split_whitespace().nth(1).unwrap();
    column
        .strip_prefix('#')
        .expect("the cursor is labelled #N")
        .parse()
        .expect(line)
}

#[tokio::test]
async fn tail_shows_runs_readably_and_survives_a_broker_restart() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let mut tail = Tail::spawn(&["--socket", s(&h.socket())]);
    wait_for_stream(&h).await;
    h.gw.simulate_run("agent:main:main", "Hello from tail");
    let lines = tail.lines_until("final").await;
    let run_line = lines
        .iter()
        .find(|l| l.contains(" chat "))
        .expect("chat lines");
    assert!(run_line.contains("session=agent:main:main"), "{run_line}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" agent ") && l.contains("stream=lifecycle start")),
        "{lines:#?}"
    );
    let last = lines.last().unwrap();
    assert!(last.contains("final \"Hello from tail\""), "{last}");
    let before_restart = cursor_of(last);

    // Restart the broker on the same socket: cursors are durable, so tail
    // resumes its own cursor, and is told of the downtime (a gap).
    let Harness { gw, broker, dir } = h;
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    broker.shutdown(Duration::from_secs(2)).await;
    tail.err_line_containing("lost the stream").await;
    let broker = RunningBroker::start(settings).await.unwrap();
    let h = Harness { gw, broker, dir };
    until_ready(&h.socket()).await;
    let said = tail.err_line_containing("reconnected").await;
    let resumed_from: u64 = said
        .split("after seq ")
        .nth(1)
        .and_then(|n| n.trim().parse().ok())
        .expect(&said);
    assert!(
        resumed_from >= before_restart,
        "tail's own last cursor: {said}"
    );
    let gap = tail.err_line_containing("were not delivered").await;
    assert!(gap.contains("before seq"), "{gap}");
    wait_for_stream(&h).await;
    h.gw.broadcast("cron", json!({"job": "after-restart"}));
    let lines = tail.lines_until("after-restart").await;
    assert!(lines.last().unwrap().contains(" cron "), "{lines:#?}");
    let _ = tail.child.start_kill();
}

#[tokio::test]
async fn tail_resumes_exactly_after_its_stream_is_cut() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let mut tail = Tail::spawn(&["--socket", s(&h.socket()), "--events", "cron"]);
    wait_for_stream(&h).await;
    h.gw.broadcast("cron", json!({"n": 0}));
    let first = cursor_of(&tail.line().await);
    // The broker ends the stream (as it would for a slow consumer) while
    // events keep coming; tail reconnects after its last cursor.
    for c in h.broker.ctx().hub.clients() {
        c.close(1008, "slow consumer");
    }
    for n in 1..=5 {
        h.gw.broadcast("cron", json!({ "n": n }));
        h.gw.broadcast("talk.mode", json!({}));
    }
    let mut cursors = Vec::new();
    for _ in 1..=5 {
        let line = tail.line().await;
        assert!(line.contains(" cron "), "only the chosen events: {line}");
        cursors.push(cursor_of(&line));
    }
    tail.err_line_containing("ended the stream").await;
    let expected: Vec<u64> = (1..=5).map(|n| first + 2 * n - 1).collect();
    assert_eq!(
        cursors, expected,
        "each cron event once, in order, none lost"
    );
    let _ = tail.child.start_kill();
}

#[tokio::test]
async fn tail_json_replays_from_a_cursor() {
    let h = start().await;
    let base = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    for n in 0..4 {
        h.gw.broadcast("cron", json!({ "n": n }));
    }
    let s0 = wait_newest_seq(&h.socket(), base + 4).await;
    let newest = s0["newest_seq"].as_u64().unwrap();
    let after = (newest - 2).to_string();
    let mut tail = Tail::spawn(&["--socket", s(&h.socket()), "--json", "--after", &after]);
    for want in newest - 1..=newest {
        let frame: Value =
            serde_json::from_str(&tail.line().await).expect("one JSON frame per line");
        assert_eq!(frame["type"], "event");
        assert_eq!(frame["seq"], want, "seq is the broker cursor");
    }
    let _ = tail.child.start_kill();
}

#[tokio::test]
async fn tail_without_a_broker_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("none.sock");
    let (code, _, err) = run_clawmux(&["tail", "--socket", s(&sock)]).await;
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("cannot reach the broker") && err.contains(s(&sock)),
        "{err}"
    );
}

/// Without a broker every command says so in three short lines: what
/// happened (the socket and how it was chosen), then what to do.
#[tokio::test]
async fn without_a_broker_every_command_says_so_in_three_short_lines() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("none.sock");
    for args in [
        &["status"][..],
        &["call", "health"],
        &["tail"],
        &["metrics"],
        &["record"],
    ] {
        let mut argv = args.to_vec();
        argv.extend(["--socket", s(&sock)]);
        let (code, _, err) = run_clawmux(&argv).await;
        assert_eq!(code, 3, "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 3, "{args:?}: {err}");
        assert!(
            lines[0].starts_with(&format!(
                "clawmux {}: cannot reach the broker at {}",
                args[0],
                s(&sock)
            )) && lines[0].ends_with("no socket there."),
            "{args:?}: {err}"
        );
        // Another test's broker may be listening: then line 2 names it.
        if lines[1].starts_with("Start it with `clawmux serve`") {
            assert!(lines[2].starts_with("or point --socket"), "{err}");
            let longest = lines[1..].iter().map(|l| l.chars().count()).max().unwrap();
            assert!(
                longest <= 80,
                "{args:?}: a hint line of {longest} characters: {err}"
            );
        } else {
            assert!(
                lines[1].starts_with("A clawmux socket of yours is listening at "),
                "{err}"
            );
        }
    }
}

#[tokio::test]
async fn tail_rejects_unknown_event_names_with_the_known_ones() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let (code, _, err) =
        run_clawmux(&["tail", "--socket", s(&h.socket()), "--events", "chat,chta"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unknown event name chta"), "{err}");
    assert!(
        err.contains("chat")
            && err.contains("clawmux.upstream")
            && err.contains("sessions.changed"),
        "lists the valid names: {err}"
    );
}

/// `-n N` prints the last N held events first, then follows; `--session`
/// and `--run` keep one session's or one run's events.
#[tokio::test]
async fn tail_n_session_and_run_pick_what_is_printed() {
    let h = start().await;
    let base = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    for n in 0..5 {
        h.gw.broadcast("cron", json!({ "n": n }));
    }
    let chat = |run: &str, session: &str, text: &str| {
        json!({"runId": run, "sessionKey": session, "state": "final",
               "message": {"content": [{"type": "text", "text": text}]}})
    };
    h.gw.broadcast("chat", chat("aaaa1111-x", "agent:main:main", "in main"));
    h.gw.broadcast("chat", chat("bbbb2222-y", "agent:main:side", "in side"));
    let newest = wait_newest_seq(&h.socket(), base + 7).await["newest_seq"]
        .as_u64()
        .unwrap();

    let mut tail = Tail::spawn(&["--socket", s(&h.socket()), "-n", "2", "--events", "cron"]);
    let first = tail.line().await;
    let second = tail.line().await;
    assert!(
        first.contains(r#"{"n":3}"#) && second.contains(r#"{"n":4}"#),
        "{first}\n{second}"
    );
    h.gw.broadcast("cron", json!({"n": "live"}));
    let live = tail.line().await;
    assert!(live.contains(r#"{"n":"live"}"#), "then follows: {live}");
    assert!(cursor_of(&live) > newest, "{live}");
    let _ = tail.child.start_kill();

    let mut tail = Tail::spawn(&["--socket", s(&h.socket()), "-n", "10", "--session", "main"]);
    let line = tail.line().await;
    assert!(line.contains("in main"), "{line}");
    h.gw.broadcast(
        "chat",
        chat("cccc3333-z", "agent:main:main", "later in main"),
    );
    let line = tail.line().await;
    assert!(
        line.contains("later in main"),
        "the side session is skipped: {line}"
    );
    let _ = tail.child.start_kill();

    let mut tail = Tail::spawn(&["--socket", s(&h.socket()), "-n", "10", "--run", "bbbb2222"]);
    let line = tail.line().await;
    assert!(line.contains("in side"), "{line}");
    let _ = tail.child.start_kill();
}

/// `clawmux tail … | head -n 5` ends when `head` has its lines, even when
/// tail wrote them all at once from what the broker held and nothing more
/// comes: it learns that its reader is gone without writing.
#[tokio::test]
async fn tail_into_a_pipe_its_reader_closed_ends_without_writing_again() {
    let h = start().await;
    let base = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    for n in 0..5 {
        h.gw.broadcast("cron", json!({ "n": n }));
    }
    wait_newest_seq(&h.socket(), base + 5).await;
    let (reader, writer) = std::io::pipe().unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut child = Command::from(isolated_command(BIN, home.path()))
        .args([
            "tail",
            "--socket",
            s(&h.socket()),
            "-n",
            "5",
            "--events",
            "cron",
        ])
        .env_remove("CLAWMUX_SOCKET")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary runs");
    // Every held line is read, then the reader goes, as `head -n 5` does:
    // tail has nothing left to write.
    let read = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(reader).lines();
        (0..5).map(|_| lines.next()).collect::<Vec<_>>()
    });
    let lines = tokio::time::timeout(PATIENCE, read)
        .await
        .expect("tail prints the held events")
        .unwrap();
    assert!(
        lines
            .iter()
            .all(|l| matches!(l, Some(Ok(l)) if l.contains("cron"))),
        "{lines:?}"
    );
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .expect("tail ends once nobody reads its output")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// `--since` keeps the held events of the last DURATION (by the event's own time).
#[tokio::test]
async fn tail_since_prints_only_recent_held_events() {
    let h = start().await;
    let base = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    let now = clawmux::protocol::now_ms();
    h.gw.broadcast("cron", json!({"ts": now - 3_600_000, "job": "an hour ago"}));
    h.gw.broadcast("cron", json!({"ts": now, "job": "just now"}));
    wait_newest_seq(&h.socket(), base + 2).await;
    let mut tail = Tail::spawn(&[
        "--socket",
        s(&h.socket()),
        "--since",
        "10m",
        "--events",
        "cron",
    ]);
    let line = tail.line().await;
    assert!(line.contains("just now"), "{line}");
    let _ = tail.child.start_kill();
    let (code, _, err) = run_clawmux(&["tail", "--since", "yesterday-ish"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--since takes a duration"), "{err}");
}

/// A cursor from the future is called that, not "no longer held".
#[tokio::test]
async fn tail_after_a_future_cursor_says_so() {
    let h = start().await;
    let state = until_ready(&h.socket()).await;
    let after = format!(
        "{}:{}",
        state["epoch"].as_str().unwrap(),
        state["newest_seq"].as_u64().unwrap() + 999_999
    );
    let mut tail = Tail::spawn(&["--socket", s(&h.socket()), "--after", &after]);
    let said = tail.err_line_containing("cannot resume").await;
    assert!(said.contains("newer than the newest event"), "{said}");
    assert!(!said.contains("no longer held"), "{said}");
    let _ = tail.child.start_kill();
}

/// Colour through anstream: off when piped, on with CLICOLOR_FORCE, and
/// NO_COLOR wins over both.
#[tokio::test]
async fn tail_and_status_colour_follows_no_color_and_the_terminal() {
    let h = start().await;
    let base = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    h.gw.broadcast("cron", json!({"n": 1}));
    wait_newest_seq(&h.socket(), base + 1).await;
    let sock = s(&h.socket()).to_owned();
    for (env, colour) in [
        (vec![], false),
        (vec![("CLICOLOR_FORCE", "1")], true),
        (vec![("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")], false),
    ] {
        let mut tail = Tail::spawn_with_env(&["--socket", &sock, "-n", "1"], &env);
        let line = tail.line().await;
        assert_eq!(line.contains("\x1b["), colour, "{env:?}: {line:?}");
        let _ = tail.child.start_kill();
        let out = Command::new(BIN)
            .args(["status", "--socket", &sock])
            .env_remove("NO_COLOR")
            .env_remove("CLICOLOR_FORCE")
            .envs(env.iter().copied())
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text.contains("\x1b["), colour, "status {env:?}: {text:?}");
        assert!(text.contains("ready"), "{text}");
    }
}

/// `clawmux metrics` prints `/metrics`; `--textfile DIR` writes
/// `DIR/clawmux.prom` for node_exporter, with `clawmux_up 0` (exit 3) when
/// the broker is down.
#[tokio::test]
async fn metrics_textfile_for_node_exporter() {
    let h = start().await;
    until_ready(&h.socket()).await;
    let (code, out, err) = run_clawmux(&["metrics", "--socket", s(&h.socket())]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("clawmux_upstream_phase{phase=\"ready\"} 1"),
        "{out}"
    );
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = run_clawmux(&[
        "metrics",
        "--socket",
        s(&h.socket()),
        "--textfile",
        s(dir.path()),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let file = dir.path().join("clawmux.prom");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("\nclawmux_up 1\n") && text.contains("process_cpu_seconds_total"),
        "{text}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left"
    );
    // A directory that does not exist yet is made (as node_exporter's
    // textfile directory often is not, before the first run).
    let fresh = dir.path().join("textfile/collector");
    let (code, _, err) = run_clawmux(&[
        "metrics",
        "--socket",
        s(&h.socket()),
        "--textfile",
        s(&fresh),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(fresh.join("clawmux.prom").is_file());
    let gone = dir.path().join("gone.sock");
    let (code, _, err) =
        run_clawmux(&["metrics", "--socket", s(&gone), "--textfile", s(dir.path())]).await;
    assert_eq!(code, 3, "{err}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.ends_with("\nclawmux_up 0\n") && !text.contains("process_"),
        "{text}"
    );
}

/// A wrong gateway token: `call` says what happened and what to do, then
/// the code, with no raw JSON; `status` shows the whole message, wrapped at
/// words, never cut mid-word.
#[tokio::test]
async fn a_wrong_token_reads_whole_in_call_and_status() {
    let h = start_with(mock_config(), |s| {
        s.token = Some(clawmux::config::Secret::new("wrong-token"))
    })
    .await;
    let sock = s(&h.socket()).to_owned();
    // Once the gateway has refused the token (before that, a call is
    // answered "not open yet": `/v1/rpc` does not wait for the session).
    eventually_async("the gateway refused the token", || {
        let socket = h.socket();
        async move {
            let state = crate::http_api::state(&socket).await;
            if state["upstream"]["phase"] == "rejected" {
                Ok(())
            } else {
                Err(format!("upstream {}", state["upstream"]["phase"]))
            }
        }
    })
    .await;
    let (code, _, err) = run_clawmux(&["call", "--socket", &sock, "health"]).await;
    assert_eq!(code, 1, "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].starts_with("clawmux call: check clawmux's gateway token")
            && lines[0].ends_with(
                "the broker needs the right shared token) (the request was not sent to the gateway)"
            ),
        "{err}"
    );
    assert!(
        lines[1].starts_with("(studio.upstream_rejected;")
            && lines[1].contains("code INVALID_REQUEST")
            && lines[1].ends_with("`--json` prints the whole answer)"),
        "{err}"
    );
    assert!(!err.contains('{'), "no raw JSON: {err}");

    let (code, out, err) = run_clawmux(&["status", "--socket", &sock]).await;
    assert_eq!(code, 1, "{out}{err}");
    let joined = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        joined.contains("error check clawmux's gateway token")
            && joined
                .contains("the broker needs the right shared token) (studio.upstream_rejected"),
        "{out}"
    );
    assert!(!out.contains('…'), "{out}");
    assert!(out.lines().all(|l| l.chars().count() <= 100), "{out}");
}
