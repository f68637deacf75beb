//! What `top` shows at a glance: the rate of live events, a footer notice
//! that fits and goes away, a client column as wide as its names, and what
//! the run count means at the bound.

use ratatui::backend::TestBackend;
use ratatui::Terminal;
use serde_json::{json, Value};

use super::*;

const NOW: u64 = 1_700_000_010_000;

fn screen(app: &App, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| draw(f, app)).unwrap();
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

fn app(clients: Vec<Value>) -> App {
    let mut app = App::new(false, NOW);
    app.state = json!({"upstream": {"phase": "ready", "server_version": "2026.9.6"},
        "broker": {"uptime_ms": 1000}, "clients": clients});
    app.link = "live".into();
    app
}

fn tick(n: u64) -> Value {
    json!({"type": "event", "event": "tick", "seq": n, "payload": {"ts": n}})
}

#[test]
fn the_rate_counts_live_events_not_the_replayed_backlog() {
    let mut app = app(vec![]);
    for n in 0..500 {
        app.on_event("tick", &tick(n), None);
    }
    app.next_second();
    for n in 500..503 {
        app.on_event("tick", &tick(n), Some(NOW));
    }
    app.next_second();
    assert_eq!(app.rates.iter().copied().collect::<Vec<_>>(), [0, 3]);
}

#[test]
fn missed_events_are_told_briefly_beside_the_keys_then_cleared() {
    let mut app = app(vec![]);
    app.on_gap("cannot resume after seq 1795690297978256: the broker's log no longer holds that broker life: events since were missed; continuing after seq 1795690311510000".into());
    let shown = screen(&app, 120, 20);
    let footer = shown.lines().last().unwrap();
    assert!(footer.ends_with(MISSED_NOTICE), "{footer}");
    assert!(!shown.contains("1795690297978256"), "{shown}");
    for _ in 0..NOTICE_SECONDS {
        assert!(app.notice.is_some());
        app.next_second();
    }
    assert!(app.notice.is_none(), "the notice goes away");
    let footer = screen(&app, 120, 20).lines().last().unwrap().to_owned();
    assert!(!footer.contains("missed"), "{footer}");
}

#[test]
fn the_client_column_is_as_wide_as_its_names_not_the_terminal() {
    let client = |id: u64, name: &str| {
        json!({"id": id, "kind": "ws", "queue_bytes": 0, "drops": 0, "inflight": 0,
            "connected_at_ms": NOW - 5_000, "peer_pid": 4242,
            "declared": {"client_id": name, "mode": "cli"}, "tool_observer": false})
    };
    let app = app(vec![client(1, "cli"), client(2, &"x".repeat(100))]);
    let shown = screen(&app, 200, 20);
    let header = shown.lines().find(|l| l.contains("client/mode")).unwrap();
    let pid_at = header.find("pid").unwrap();
    assert!(
        pid_at <= 4 + 4 + CLIENT_COLUMN_CHARS + 3,
        "pid at column {pid_at}: {header}"
    );
    assert!(shown.contains('…'), "a longer name is cut: {shown}");
}

#[test]
fn at_the_bound_the_run_count_says_only_the_newest_are_kept() {
    let mut app = app(vec![]);
    for i in 0..crate::activity::MAX_RUNS as u64 + 5 {
        let run = format!("run-{i}");
        for (state, seq) in [("start", 2 * i), ("end", 2 * i + 1)] {
            let frame = json!({"type": "event", "event": "agent", "seq": seq, "payload": {
                "runId": run, "sessionKey": "agent:main:main", "stream": "lifecycle",
                "ts": NOW as i64, "data": {"phase": state}}});
            app.on_event("agent", &frame, Some(NOW));
        }
    }
    let shown = screen(&app, 120, 30);
    assert!(
        shown.contains(&format!(
            "{} runs (of the newest {} kept), 0 running",
            crate::activity::MAX_RUNS,
            crate::activity::MAX_RUNS
        )),
        "{shown}"
    );
}
