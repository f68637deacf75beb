//! What reaches a terminal: gateway data and local clients' strings carrying
//! OSC 0 (window title), OSC 52 (clipboard write), C1 controls and bidi
//! overrides are printed by `clawmux tail`, `tail --tree`, `status` and
//! `call` only as visible, escaped text (point 1).

use crate::http_api::until_ready;
use crate::support::*;
use clawmux::hub::ClientKind;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

/// Sets the window title, then writes "hi" to the clipboard.
const OSC: &str = "\x1b]0;pwned\x07\x1b]52;c;aGk=\x07";
/// How [`OSC`] must be shown.
const OSC_SHOWN: &str = "\\e]0;pwned\\x07\\e]52;c;aGk=\\x07";

/// The first character a terminal would act on or hide, if any.
fn hidden_char(s: &str) -> Option<char> {
    s.chars().find(|&c| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
                | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
    })
}

fn assert_visible(what: &str, out: &str) {
    if let Some(c) = hidden_char(out) {
        panic!("{what} printed {c:?} raw:\n{out:?}");
    }
}

/// A running `clawmux tail` (stdout only; stderr is checked at the end).
struct Tail {
    child: Child,
    out: Lines<BufReader<ChildStdout>>,
    _home: tempfile::TempDir,
}

impl Tail {
    fn spawn(socket: &std::path::Path, extra: &[&str]) -> Tail {
        let socket = socket.to_str().expect("a UTF-8 path");
        let args = [&["tail", "--socket", socket][..], extra].concat();
        let (mut child, home) = spawn_clawmux(&args, &[("NO_COLOR", "1")]);
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        Tail {
            child,
            out,
            _home: home,
        }
    }

    /// Lines up to the first one containing `needle` (bounded by PATIENCE).
    async fn until(&mut self, needle: &str) -> String {
        let mut seen = String::new();
        loop {
            let line = tokio::time::timeout(PATIENCE, self.out.next_line())
                .await
                .unwrap_or_else(|_| panic!("{needle:?} in time; got:\n{seen}"))
                .expect("stdout readable")
                .expect("tail still running");
            seen.push_str(&line);
            seen.push('\n');
            if line.contains(needle) {
                return seen;
            }
        }
    }

    /// Stops tail; its stderr.
    async fn stop(mut self) -> String {
        let _ = self.child.start_kill();
        let out = self.child.wait_with_output().await.expect("tail ends");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

#[tokio::test]
async fn injected_escapes_reach_tail_tree_status_and_call_only_escaped() {
    let h = start().await;
    let socket = h.socket();
    until_ready(&socket).await;
    let mut plain = Tail::spawn(&socket, &[]);
    let mut tree = Tail::spawn(&socket, &["--tree"]);
    eventually("both tails are streaming", || {
        h.broker
            .ctx()
            .hub
            .clients()
            .iter()
            .filter(|c| c.kind == ClientKind::Sse)
            .count()
            == 2
    })
    .await;

    // A local client with a hostile self-description starts a run on a
    // hostile session key (the mock echoes it in every event of the run).
    let mut starter = h.client().await;
    starter.recv_json().await;
    let mut frame = connect_frame("c1");
    frame["params"]["client"]["displayName"] = json!(format!("evil\u{202e}txt.exe{OSC}"));
    frame["params"]["client"]["version"] = json!(format!("1\u{9b}31m{OSC}"));
    starter.send_json(&frame).await;
    assert_eq!(starter.response("c1").await["ok"], true);
    let key = format!("main{OSC}");
    let answer = starter
        .request(
            "chat.send",
            json!({"sessionKey": key, "message": "hi", "idempotencyKey": uuid::Uuid::new_v4().to_string()}),
        )
        .await;
    assert_eq!(answer["ok"], true, "{answer}");
    loop {
        let e = starter.event("chat").await;
        if e["payload"]["state"] == "final" {
            break;
        }
    }

    // The gateway itself sends hostile run ids, tool names and arguments,
    // error messages and event names.
    let run = format!("r{OSC}");
    let session = format!("agent:main:x\u{202e}{OSC}");
    let ts = clawmux::protocol::now_ms();
    let agent = |stream: &str, data: Value| json!({"runId": run, "sessionKey": session, "stream": stream, "ts": ts, "data": data});
    h.gw.broadcast("agent", agent("lifecycle", json!({"phase": "start"})));
    h.gw.broadcast(
        "agent",
        agent(
            "tool",
            json!({"phase": "start", "name": format!("exec{OSC}"), "toolCallId": "call_1",
                "args": {format!("k\u{202e}"): format!("ls{OSC}"), "n": format!("\u{9b}2J")}}),
        ),
    );
    h.gw.broadcast(
        "agent",
        agent(
            "tool",
            json!({"phase": "result", "name": format!("exec{OSC}"), "toolCallId": "call_1",
                "isError": true, "result": {"content": [{"type": "text", "text": OSC}]}}),
        ),
    );
    h.gw.broadcast(
        "agent",
        agent(
            "assistant",
            json!({"text": format!("out{OSC}"), "delta": format!("out{OSC}")}),
        ),
    );
    h.gw.broadcast(
        "chat",
        json!({"runId": run, "sessionKey": session, "state": "error",
            "errorMessage": format!("boom\u{202e}{OSC}"), "ts": ts}),
    );
    h.gw.broadcast(
        "agent",
        agent(
            "lifecycle",
            json!({"phase": "error", "error": format!("boom{OSC}")}),
        ),
    );
    h.gw.broadcast(&format!("cron{OSC}"), json!({"job": OSC}));
    h.gw.broadcast("cron", json!({"job": "done-marker"}));

    let out = plain.until("done-marker").await;
    assert_visible("tail", &out);
    assert!(out.contains(OSC_SHOWN), "escaped, not dropped:\n{out}");
    assert!(out.contains("cron\\e]0;pwned"), "event name:\n{out}");
    assert!(out.contains("run=r\\e]0;pwn"), "run id prefix:\n{out}");
    assert!(out.contains("\\u{202e}"), "bidi override:\n{out}");
    let err = plain.stop().await;
    assert_visible("tail's stderr", &err);

    let out = tree.until("boom").await;
    assert_visible("tail --tree", &out);
    assert!(out.contains("tool exec\\e]0;pwned"), "tool name:\n{out}");
    assert!(out.contains("k\\u{202e}="), "argument name:\n{out}");
    assert!(out.contains(&format!("main{OSC_SHOWN}")), "session:\n{out}");
    let err = tree.stop().await;
    assert_visible("tail --tree's stderr", &err);

    let (code, out, err) = run_clawmux(&["status", "--socket", socket.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_visible("status", &format!("{out}{err}"));

    // A gateway error whose code, message and details carry escapes.
    h.gw.set_faults(clawmux_mock::Faults {
        fail_methods: vec![(
            "health".into(),
            json!({"code": format!("E{OSC}"), "message": format!("bad\u{202e}{OSC}"),
                "details": {"why": "\u{9b}31m\u{2066}"}}),
        )],
        ..Default::default()
    });
    let (code, out, err) =
        run_clawmux(&["call", "--socket", socket.to_str().unwrap(), "health"]).await;
    assert_eq!(code, 1, "an error answer: {out}{err}");
    assert_visible("call", &format!("{out}{err}"));
    assert!(err.contains(&format!("E{OSC_SHOWN}")), "{err}");
    assert!(err.contains("bad\\u{202e}"), "{err}");
    // `--json` stays exact JSON (serde escapes the C0 controls).
    let (_, out, _) = run_clawmux(&[
        "call",
        "--socket",
        socket.to_str().unwrap(),
        "--json",
        "health",
    ])
    .await;
    let frame: Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(frame["error"]["code"], format!("E{OSC}"));
    // An unknown method's name is echoed by the gateway.
    let (_, out, err) = run_clawmux(&[
        "call",
        "--socket",
        socket.to_str().unwrap(),
        &format!("no.such{OSC}"),
    ])
    .await;
    assert_visible("call of an unknown method", &format!("{out}{err}"));
}

/// C1 controls (U+009B is a CSI on many terminals), DEL and bidi controls:
/// JSON allows them raw in strings, and serde writes them raw.
const RAW_IN_JSON: &str = "\u{9b}31m\u{7f}\u{202e}\u{2066}\u{200e}\u{200f}\u{61c}";

/// The JSON in `line`, checked to show nothing raw.
fn exact_json(what: &str, line: &str) -> Value {
    assert_visible(what, line);
    for escape in [
        "\\u009b", "\\u007f", "\\u202e", "\\u2066", "\\u200e", "\\u200f", "\\u061c",
    ] {
        assert!(line.contains(escape), "{what}: {escape} in {line}");
    }
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{what}: JSON: {e}\n{line}"))
}

/// Every JSON the CLI prints (`tail --json`, `tail --hud`, `status --json`,
/// `call`, `call --json`) writes those characters as `\uXXXX`: still exact
/// JSON with the gateway's value, nothing a terminal acts on .
#[tokio::test]
async fn json_outputs_escape_c1_del_and_bidi_characters() {
    let cfg = clawmux_mock::MockConfig {
        server_version: format!("2026.9.6{RAW_IN_JSON}"),
        ..mock_config()
    };
    let h = start_with(cfg, |_| {}).await;
    let socket = h.socket();
    until_ready(&socket).await;
    let mut json = Tail::spawn(&socket, &["--json"]);
    let mut hud = Tail::spawn(&socket, &["--hud"]);
    eventually("both tails are streaming", || {
        h.broker
            .ctx()
            .hub
            .clients()
            .iter()
            .filter(|c| c.kind == ClientKind::Sse)
            .count()
            == 2
    })
    .await;
    let hostile = format!("x{RAW_IN_JSON}");
    h.gw.broadcast("cron", json!({"job": hostile, "marker": "json-marker"}));
    h.gw.broadcast(
        "agent",
        json!({"runId": "hud-marker", "sessionKey": hostile, "stream": "lifecycle",
            "ts": clawmux::protocol::now_ms(), "data": {"phase": "start"}}),
    );

    let out = json.until("json-marker").await;
    let line = out.lines().last().unwrap();
    let frame = exact_json("tail --json", line);
    assert_eq!(frame["payload"]["job"], hostile.as_str(), "the same value");
    json.stop().await;

    let out = hud.until("hud-marker").await;
    let line = out.lines().last().unwrap();
    let change = exact_json("tail --hud", line);
    assert_eq!(change["sessionKey"], hostile.as_str(), "{change}");
    hud.stop().await;

    let socket = socket.to_str().unwrap();
    let (code, out, err) = run_clawmux(&["status", "--socket", socket, "--json"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let state = exact_json("status --json", &out);
    assert_eq!(
        state["upstream"]["server_version"],
        format!("2026.9.6{RAW_IN_JSON}")
    );
    // The mock's `status` answer carries its version as `runtimeVersion`.
    let (code, out, err) = run_clawmux(&["call", "--socket", socket, "status"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let payload = exact_json("call", &out);
    assert_eq!(payload["runtimeVersion"], format!("2026.9.6{RAW_IN_JSON}"));
    let (code, out, err) = run_clawmux(&["call", "--socket", socket, "--json", "status"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let frame = exact_json("call --json", out.trim());
    assert_eq!(
        frame["payload"]["runtimeVersion"],
        format!("2026.9.6{RAW_IN_JSON}")
    );
}

/// A recording whose header, event and recorded request carry ESC, BEL, CR,
/// DEL, C1 and bidi characters (JSON-escaped in the file, raw once parsed).
fn hostile_recording(dir: &std::path::Path) -> std::path::PathBuf {
    let bad = "x\u{1b}]0;t\u{7}\r\u{7f}\u{9b}31m\u{202e}";
    let lines = [
        json!({"format": "clawmux-recording", "version": 1, "gateway_version": bad,
            "started_ms": 1000, "hello": {"type": "hello-ok"}}),
        json!({"ms": 1000, "dir": "out", "frame": {"type": "req", "id": "1", "method": bad, "params": {"k": bad}}}),
        json!({"ms": 1001, "dir": "in", "frame": {"type": "res", "id": "1", "ok": true, "payload": {}}}),
        json!({"ms": 1002, "dir": "in", "frame": {"type": "event", "event": bad, "payload": {"t": bad}}}),
    ];
    let path = dir.join("hostile.jsonl");
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// Reads `child`'s stderr until a line containing `needle`; all of it so far.
async fn stderr_until(child: &mut Child, needle: &str) -> String {
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    while !seen.contains(needle) {
        match tokio::time::timeout(PATIENCE, lines.next_line()).await {
            Ok(Ok(Some(line))) => {
                seen.push_str(&line);
                seen.push('\n');
            }
            _ => panic!("no {needle:?} on stderr:\n{seen:?}"),
        }
    }
    seen
}

/// `mock-gateway --replay` and `serve --demo --replay` say what the
/// recording holds (its gateway version, a method it answers) only
/// escaped; so does the error for a header they cannot read.
#[tokio::test]
async fn text_from_a_recording_file_reaches_the_terminal_escaped() {
    let files = tempfile::tempdir().unwrap();
    let file = hostile_recording(files.path());
    let file = file.to_str().unwrap();
    let (mut gw, _home) = spawn_clawmux(
        &["mock-gateway", "--port", "0", "--instant", "--replay", file],
        &[("NO_COLOR", "1")],
    );
    let said = stderr_until(&mut gw, "listening").await;
    assert_visible("mock-gateway --replay", &said);
    assert!(
        said.contains("(gateway x\\e]0;t\\x07\\r\\x7f\\u{9b}31m\\u{202e})"),
        "{said}"
    );
    let _ = gw.start_kill();

    let socket = files.path().join("demo.sock");
    let (mut demo, _home) = spawn_clawmux(
        &[
            "serve",
            "--demo",
            "--instant",
            "--replay",
            file,
            "--socket",
            socket.to_str().unwrap(),
        ],
        &[("NO_COLOR", "1")],
    );
    let said = stderr_until(&mut demo, "Ctrl-C stops the demo").await;
    assert_visible("serve --demo --replay", &said);
    assert!(said.contains("answered as recorded"), "{said}");
    let _ = demo.start_kill();

    // A header this clawmux cannot read, quoting the file's own value.
    let broken = files.path().join("broken.jsonl");
    let version = "\u{1b}]52;c;aGk=\u{7}\u{202e}";
    let header = json!({"format": "clawmux-recording", "version": version});
    std::fs::write(&broken, format!("{header}\n")).unwrap();
    let (code, out, err) =
        run_clawmux(&["mock-gateway", "--replay", broken.to_str().unwrap()]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert_visible("mock-gateway --replay (refused)", &err);
    assert!(err.contains("format version"), "{err}");
}
