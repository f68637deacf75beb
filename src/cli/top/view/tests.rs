//! Snapshots of the dashboard with ratatui's `TestBackend`.

use ratatui::backend::TestBackend;
use ratatui::style::Color;
use ratatui::Terminal;
use serde_json::{json, Value};

use super::*;

const NOW: u64 = 1_700_000_010_000;
const T0: u64 = 1_700_000_000_000;

fn state(clients: usize) -> Value {
    let clients: Vec<Value> = (1..=clients as u64)
        .map(|id| {
            json!({"id": id, "kind": "ws", "conn_id": "x", "queue_bytes": 1536, "drops": 0,
                "inflight": 1, "connected_at_ms": T0 - 65_000, "peer_pid": 4242,
                "declared": {"client_id": "cli", "mode": "cli", "version": "1", "display_name": null},
                "tool_observer": false})
        })
        .chain(std::iter::once(json!({"id": 99, "kind": "sse", "queue_bytes": 0, "drops": 2,
            "inflight": 0, "connected_at_ms": NOW - 5_000, "peer_pid": 77, "declared": null,
            "tool_observer": true})))
        .collect();
    json!({"upstream": {"phase": "ready", "server_version": "2026.9.6"},
        "broker": {"uptime_ms": 3_723_000}, "clients": clients})
}

fn ev(name: &str, payload: Value) -> (String, Value) {
    (
        name.to_owned(),
        json!({"type": "event", "event": name, "payload": payload}),
    )
}

fn agent(run: &str, ts: i64, stream: &str, data: Value) -> (String, Value) {
    ev(
        "agent",
        json!({"runId": run, "stream": stream, "ts": (T0 as i64 + ts) as u64,
        "sessionKey": "agent:main:main", "data": data}),
    )
}

/// A run with thinking and two tool calls, still streaming its answer.
fn running_run() -> Vec<(String, Value)> {
    vec![
        agent("7d7b1f2c-aaaa", 0, "lifecycle", json!({"phase": "start"})),
        agent(
            "7d7b1f2c-aaaa",
            100,
            "thinking",
            json!({"delta": "The user wants a reply; "}),
        ),
        agent(
            "7d7b1f2c-aaaa",
            200,
            "thinking",
            json!({"delta": "let me check the workspace."}),
        ),
        agent(
            "7d7b1f2c-aaaa",
            300,
            "tool",
            json!({"phase": "start", "name": "exec", "toolCallId": "c1", "args": {"command": "ls"}}),
        ),
        agent(
            "7d7b1f2c-aaaa",
            400,
            "tool",
            json!({"phase": "start", "name": "read", "toolCallId": "c2", "args": {"path": "README.md"}}),
        ),
        agent(
            "7d7b1f2c-aaaa",
            600,
            "tool",
            json!({"phase": "result", "name": "read",
            "toolCallId": "c2", "isError": false, "result": {"content": [{"type": "text", "text": "# W"}]}}),
        ),
        agent(
            "7d7b1f2c-aaaa",
            900,
            "tool",
            json!({"phase": "result", "name": "exec",
            "toolCallId": "c1", "isError": true, "result": "permission denied"}),
        ),
        agent(
            "7d7b1f2c-aaaa",
            1000,
            "assistant",
            json!({"text": "Echo: hi", "delta": "Echo: hi"}),
        ),
    ]
}

fn older_run() -> Vec<(String, Value)> {
    vec![
        agent(
            "0ld0ld00-bbbb",
            -5000,
            "lifecycle",
            json!({"phase": "start"}),
        ),
        ev(
            "chat",
            json!({"runId": "0ld0ld00-bbbb", "sessionKey": "agent:main:main", "state": "final",
            "message": {"role": "assistant", "content": [{"type": "text", "text": "Earlier answer"}]}}),
        ),
    ]
}

fn app_with(events: &[(String, Value)], color: bool) -> App {
    let mut app = App::new(color, NOW - 8_000);
    app.state = state(2);
    app.link = "live".into();
    for (name, frame) in events {
        // Live: each arrives when the gateway stamped it (or at the stale
        // frame clock when it carries no time).
        let arrived = frame["payload"]["ts"].as_u64().unwrap_or(app.now_ms);
        app.on_event(name, frame, Some(arrived));
    }
    for n in [3, 0, 12, 7] {
        for _ in 0..n {
            app.this_second += 1;
        }
        app.next_second();
    }
    app.now_ms = NOW;
    app
}

fn render(app: &App, w: u16, h: u16) -> Terminal<TestBackend> {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| draw(f, app)).unwrap();
    t
}

fn screen(app: &App, w: u16, h: u16) -> String {
    let t = render(app, w, h);
    let buf = t.backend().buffer();
    buf.content
        .chunks(w as usize)
        .map(|row| {
            row.iter()
                .map(|c| c.symbol())
                .collect::<String>()
                .trim_end()
                .to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn dashboard_at_80x24_shows_header_clients_and_the_activity_tree() {
    let mut events = older_run();
    events.extend(running_run());
    let app = app_with(&events, false);
    let expected = r#"clawmux top  upstream ready  gateway 2026.9.6  up 1h02m  7 ev/s  1 running
events/s █ ▇▄
 Clients (3) ───────────────────────────────────────────────────────────────────
id   kind client/mode pid     since     queue     drops infl
1    ws   cli/cli     4242    1 m 15 s  1.5 KiB   0     1
2    ws   cli/cli     4242    1 m 15 s  1.5 KiB   0     1
99   sse  (observer)  77      5.0 s     0 B       2     0
 Activity · session: all ───────────────────────────────────────────────────────
agent:main:main  2 runs, 1 running
 ▾ run 7d7b1f2c running 10.0 s, 2 tools
     thinking 200 ms "The user wants a reply; let me check the workspace."
     tool exec command="ls" error 600 ms, 19 B
     tool read path="README.md" ok 200 ms, 42 B
     assistant (streaming) "Echo: hi"
 ▸ run 0ld0ld00 ok 7.0 s  "Earlier answer"








q quit  ↑↓ move  ⏎ expand  s session  p pause"#;
    assert_eq!(screen(&app, 80, 24), expected);
}

#[test]
fn keys_move_expand_filter_and_pause() {
    let mut app = app_with(&older_run(), false);
    // The newest run of a session is open at first; select it and fold it.
    let shown = screen(&app, 80, 24);
    assert!(shown.contains("end ok after 7.0 s"), "{shown}");
    assert_eq!(app.key(Key::Down), Action::Redraw);
    assert_eq!(app.key(Key::Toggle), Action::Redraw);
    assert!(!screen(&app, 80, 24).contains("end ok"));
    assert_eq!(app.key(Key::Expand), Action::Redraw);
    assert!(screen(&app, 80, 24).contains("end ok"));
    assert_eq!(app.key(Key::Collapse), Action::Redraw);
    // Pause: new runs wait until resumed, but are not lost.
    app.key(Key::Char('p'));
    for (name, frame) in running_run() {
        app.on_event(&name, &frame, Some(app.now_ms));
    }
    let paused = screen(&app, 80, 24);
    assert!(
        paused.contains("PAUSED") && !paused.contains("7d7b1f2c"),
        "{paused}"
    );
    app.key(Key::Char('p'));
    assert!(screen(&app, 80, 24).contains("run 7d7b1f2c running"));
    // Filter by session: all → the first session → back to all.
    let mut other = agent("ffff0000-cccc", 50, "lifecycle", json!({"phase": "start"}));
    other.1["payload"]["sessionKey"] = json!("agent:main:other");
    app.on_event(&other.0, &other.1, Some(app.now_ms));
    app.key(Key::Char('s'));
    let filtered = screen(&app, 80, 24);
    let first = app.session_filter.clone().expect("a session");
    assert!(
        filtered.contains(&format!("session: {first}")),
        "{filtered}"
    );
    assert_eq!(filtered.matches(" running\n").count(), 1 + 1, "{filtered}");
    app.key(Key::Char('s'));
    app.key(Key::Char('s'));
    assert_eq!(app.session_filter, None);
    assert_eq!(app.key(Key::Char('q')), Action::Quit);
    assert_eq!(app.key(Key::Char('x')), Action::None);
}

#[test]
fn no_color_means_no_colour_and_colour_marks_states() {
    let t = render(&app_with(&running_run(), false), 80, 24);
    assert!(
        t.backend()
            .buffer()
            .content
            .iter()
            .all(|c| c.fg == Color::Reset && c.bg == Color::Reset),
        "NO_COLOR: no cell is coloured"
    );
    let t = render(&app_with(&running_run(), true), 80, 24);
    let buf = t.backend().buffer();
    let fg_of = |text: &str| {
        let w = buf.area.width as usize;
        buf.content
            .chunks(w)
            .find_map(|row| {
                let line: String = row.iter().map(|c| c.symbol()).collect();
                line.find(text)
                    .map(|byte| row[line[..byte].chars().count()].fg)
            })
            .unwrap_or_else(|| panic!("{text} on screen"))
    };
    assert_eq!(fg_of("ready"), Color::Green);
    assert_eq!(fg_of("running 10.0 s"), Color::Yellow);
    assert_eq!(fg_of("error 600 ms"), Color::Red);
}

#[test]
fn an_empty_broker_and_a_small_terminal_still_draw() {
    let mut app = App::new(false, NOW);
    app.state = state(9);
    let shown = screen(&app, 80, 24);
    assert!(shown.contains("Clients (10)"), "{shown}");
    assert_eq!(shown.matches("cli/cli").count(), MAX_CLIENT_ROWS, "{shown}");
    assert!(shown.contains("no agent runs yet"), "{shown}");
    assert!(
        shown.contains("connecting"),
        "the link status shows until live"
    );
    // Tiny terminals do not panic.
    screen(&app, 20, 5);
    screen(&app, 1, 1);
}

#[test]
fn the_paused_header_fits_80_columns_leaving_out_what_does_not_fit() {
    let mut app = app_with(&running_run(), false);
    app.key(Key::Char('p'));
    let shown = screen(&app, 80, 24);
    let header = shown.lines().next().unwrap();
    assert!(
        header.starts_with("clawmux top PAUSED  upstream ready") && header.ends_with("1 running"),
        "{header}"
    );
    assert!(header.chars().count() <= 80, "{header}");
    // Wide enough: everything.
    let wide = screen(&app, 120, 24);
    assert!(
        wide.lines()
            .next()
            .unwrap()
            .contains("gateway 2026.9.6  up 1h02m  7 ev/s  1 running"),
        "{wide}"
    );
}

#[test]
fn events_are_timed_when_they_arrive_not_by_the_clock_of_the_last_frame() {
    let mut app = App::new(false, T0);
    // The frame clock is stale (T0); the final chat event (no ts) arrives 700 ms later.
    app.on_event(
        &agent("a1", 0, "lifecycle", json!({"phase": "start"})).0,
        &agent("a1", 0, "lifecycle", json!({"phase": "start"})).1,
        Some(T0),
    );
    let (name, frame) = ev(
        "chat",
        json!({"runId": "a1", "sessionKey": "agent:main:main", "state": "final",
            "message": {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}}),
    );
    app.on_event(&name, &frame, Some(T0 + 700));
    let run = app.activity.run("a1").unwrap();
    assert_eq!(run.duration_ms(None), Some(700));
    // Replayed (no arrival time): no made-up end time.
    let (name, frame) = ev(
        "chat",
        json!({"runId": "b2", "sessionKey": "agent:main:main", "state": "aborted"}),
    );
    app.on_event(&name, &frame, None);
    assert_eq!(app.activity.run("b2").unwrap().ended_ms, None);
    app.now_ms = T0 + 60_000;
    let shown = screen(&app, 80, 24);
    assert!(shown.contains("run b2 aborted"), "{shown}");
    assert!(!shown.contains("run b2 aborted 1"), "no duration: {shown}");
}

#[test]
fn a_gap_forgets_runs_whose_end_was_not_seen() {
    let mut app = app_with(&running_run(), false);
    assert_eq!(app.activity.running(), 1);
    app.on_gap("events were missed".into());
    assert_eq!(app.activity.running(), 0);
    assert_eq!(app.notice.as_deref(), Some(MISSED_NOTICE));
}

/// Gateway and client strings carrying OSC sequences, C1 controls and bidi
/// overrides are drawn escaped (ratatui drops ESC itself, not U+202E).
#[test]
fn injected_controls_and_bidi_overrides_are_drawn_escaped() {
    const OSC: &str = "\x1b]0;pwned\x07";
    let run = format!("r\u{202e}{OSC}");
    let session = format!("agent:main:\u{202e}{OSC}");
    let payload = |stream: &str, data: Value| {
        json!({"runId": run, "stream": stream, "ts": T0 + 10, "sessionKey": session,
            "data": data})
    };
    let events = vec![
        ev("agent", payload("lifecycle", json!({"phase": "start"}))),
        ev(
            "agent",
            payload("thinking", json!({"delta": format!("hmm\u{202e}{OSC}")})),
        ),
        ev(
            "agent",
            payload(
                "tool",
                json!({"phase": "start", "name": format!("ex\u{202e}ec"), "toolCallId": "c1",
                    "args": {"command": format!("ls\u{9b}2J{OSC}")}}),
            ),
        ),
        ev(
            "agent",
            payload("assistant", json!({"text": format!("out\u{202e}{OSC}")})),
        ),
    ];
    let mut app = app_with(&events, false);
    app.state["upstream"]["server_version"] = json!(format!("9\u{202e}{OSC}"));
    app.state["clients"][0]["declared"]["client_id"] = json!(format!("cli\u{202e}{OSC}"));
    app.state["clients"][0]["declared"]["mode"] = json!(format!("\u{2066}x"));
    let shown = screen(&app, 160, 30);
    let bad = shown.chars().find(|&c| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}' | '\u{feff}')
    });
    assert_eq!(bad, None, "{shown}");
    for want in [
        "gateway 9\\u{202e}\\e]0;pwned\\x07",
        "cli\\u{202e}\\e]0;pwned\\x07/\\u{2066}x",
        "agent:main:\\u{202e}\\e]0;pwned\\x07",
        "tool ex\\u{202e}ec",
        "run r\\u{202e}\\e]0;",
        "hmm\\u{202e}",
    ] {
        assert!(shown.contains(want), "{want:?} in\n{shown}");
    }
}

#[test]
fn a_pause_freezes_the_durations_too() {
    let mut app = app_with(&running_run(), false);
    assert!(screen(&app, 80, 24).contains("run 7d7b1f2c running 10.0 s"));
    app.key(Key::Char('p'));
    app.now_ms = NOW + 5_000;
    let paused = screen(&app, 80, 24);
    assert!(paused.contains("run 7d7b1f2c running 10.0 s"), "{paused}");
    app.key(Key::Char('p'));
    let resumed = screen(&app, 80, 24);
    assert!(resumed.contains("run 7d7b1f2c running 15.0 s"), "{resumed}");
}

#[test]
fn a_replayed_run_still_in_progress_shows_its_recorded_durations() {
    // From the broker's history (no arrival time): what was recorded, up to
    // its newest event, not the 69 s since.
    let mut app = App::new(false, T0 + 69_000);
    for (name, frame) in &running_run()[..4] {
        app.on_event(name, frame, None);
    }
    let shown = screen(&app, 80, 24);
    assert!(shown.contains("run 7d7b1f2c running 300 ms"), "{shown}");
    assert!(
        shown.contains("tool exec command=\"ls\" running 0 ms"),
        "{shown}"
    );
    // Played back from a recording made an hour ago (live, old times): the
    // recorded durations go on from the newest event, not the hour since.
    let hour = 3_600_000;
    let mut app = App::new(false, NOW);
    for (name, frame) in running_run().iter().take(4) {
        let mut frame = frame.clone();
        let ts = frame["payload"]["ts"].as_u64().unwrap() - hour;
        frame["payload"]["ts"] = json!(ts);
        app.on_event(name, &frame, Some(NOW - 2_000));
    }
    let shown = screen(&app, 80, 24);
    assert!(shown.contains("run 7d7b1f2c running 2.3 s"), "{shown}");
    assert!(
        shown.contains("tool exec command=\"ls\" running 2.0 s"),
        "{shown}"
    );
}

#[test]
fn run_ids_that_share_a_long_prefix_are_shown_apart() {
    let runs = ["run-1795431469879", "run-1795431470344"];
    let mut events = Vec::new();
    for (n, run) in runs.iter().enumerate() {
        events.push(agent(
            run,
            n as i64 * 100,
            "lifecycle",
            json!({"phase": "start"}),
        ));
    }
    let shown = screen(&app_with(&events, false), 80, 24);
    assert!(shown.contains("run run-179543146 running"), "{shown}");
    assert!(shown.contains("run run-179543147 running"), "{shown}");
}
