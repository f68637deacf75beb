//! Continuity : one durable history of everything a client could
//! have seen live, each event with its audience, read back through the
//! same filter live delivery uses; `/v1/events` carries targeted events
//! with `id:` cursors and filters by session and agent.

use crate::http_api::*;
use crate::support::*;
use clawmux::policy::{MethodFilter, SocketPolicy};
use serde_json::json;

/// A further socket with no observer powers (`observe = false`).
fn plain_socket(path: &std::path::Path) -> SocketPolicy {
    SocketPolicy {
        name: "plain".into(),
        path: path.to_owned(),
        mode: 0o600,
        uids: Vec::new(),
        gids: Vec::new(),
        scopes: None,
        methods: MethodFilter::default(),
        observe: false,
    }
}

/// (id, name) of every record up to and including the event with cursor
/// `last`; gaps (with or without an id) as `clawmux.gap`.
async fn names_through(sse: &mut Sse, last: u64) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    loop {
        match sse.next_item().await {
            Item::Event { id, name, .. } => {
                out.push((id, name));
                if id >= last {
                    return out;
                }
            }
            Item::Other(o) if o.contains("event: clawmux.gap") => {
                out.push((0, "clawmux.gap".into()))
            }
            _ => {}
        }
    }
}

/// Opens `path` on `socket` (with `headers`), or panics with the answer.
async fn stream(socket: &std::path::Path, path: &str, headers: &[(&str, &str)]) -> Sse {
    open_events(socket, path, headers)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e:?}"))
}

/// Subscribes a WebSocket client to `sessions.subscribe` and waits until
/// the gateway holds the subscription.
async fn subscriber(h: &Harness) -> WsClient {
    let (mut sub, _) = h.connected().await;
    let res = sub.request("sessions.subscribe", json!({})).await;
    assert_eq!(res["ok"], true, "{res}");
    let gw = &h.gw;
    eventually("the gateway holds sessions.subscribe", || {
        gw.subscriptions().iter().any(|(sessions, _)| *sessions)
    })
    .await;
    sub
}

/// The gateway's targeted events (`session.message`, a per-subscriber
/// `sessions.changed`) are logged with ids: an observer gets them live and
/// in history alike, with the same ids; a plain reader, a reader on a
/// socket without observer powers and an observer without `operator.read`
/// get none of them, live or in history, and no false gap for the cursors
/// they do not see.
#[tokio::test]
async fn targeted_events_are_in_history_with_ids_for_exactly_those_who_saw_them_live() {
    let dir = tempfile::tempdir().unwrap();
    let extra = dir.path().join("plain.sock");
    let h = start_with(mock_config(), |s| s.sockets = vec![plain_socket(&extra)]).await;
    let socket = h.socket();
    let mut sub = subscriber(&h).await;
    let start = state(&socket).await["newest_seq"].as_u64().unwrap();
    let mut live_observer = stream(&socket, "/v1/events?tool_events=all", &[]).await;
    let mut live_plain = stream(&socket, "/v1/events", &[]).await;
    let key = "agent:main:main";
    h.gw.emit_session_message(
        key,
        json!({"sessionKey": key, "message": {"role": "user", "content": "hi"}}),
    );
    h.gw.emit_sessions_changed(json!({"sessionKey": key, "reason": "patch"}));
    h.gw.broadcast("tick", json!({"ts": 1, "marker": "end"}));
    sub.event("session.message").await;
    sub.event("sessions.changed").await;
    let (end, _, _) = loop {
        let e = live_plain.next_event().await;
        if e.2["payload"]["marker"] == "end" {
            break e;
        }
    };
    let live = names_through(&mut live_observer, end).await;
    let targeted: Vec<&(u64, String)> = live
        .iter()
        .filter(|(_, n)| n == "session.message" || n == "sessions.changed")
        .collect();
    assert_eq!(targeted.len(), 2, "the observer gets them live: {live:?}");
    assert!(targeted.iter().all(|(id, _)| *id > start), "{live:?}");

    // History equals live for the observer, id for id.
    let after = format!("/v1/events?tool_events=all&after_seq={start}");
    let history = names_through(&mut stream(&socket, &after, &[]).await, end).await;
    assert_eq!(history, live);
    // And Last-Event-ID resumes the same way, from the first one's id.
    let first = targeted[0].0;
    let resumed = names_through(
        &mut stream(
            &socket,
            "/v1/events?tool_events=all",
            &[("last-event-id", &first.to_string())],
        )
        .await,
        end,
    )
    .await;
    let expected: Vec<(u64, String)> = live.iter().filter(|r| r.0 > first).cloned().collect();
    assert_eq!(resumed, expected);

    // Nobody else gains anything, live or from history, and sees no gap.
    let plain_history = format!("/v1/events?after_seq={start}");
    let limited = [("x-clawmux-scopes", "operator.approvals")];
    for (what, records) in [
        (
            "plain reader, history",
            names_through(&mut stream(&socket, &plain_history, &[]).await, end).await,
        ),
        (
            "socket without observe, history",
            names_through(&mut stream(&extra, &plain_history, &[]).await, end).await,
        ),
        (
            "observer without operator.read, history",
            names_through(&mut stream(&socket, &after, &limited).await, end).await,
        ),
    ] {
        assert!(
            records
                .iter()
                .all(|(_, n)| !n.starts_with("session") && n != "clawmux.gap"),
            "{what}: {records:?}"
        );
        assert_eq!(
            records.last().map(|r| r.0),
            Some(end),
            "{what}: {records:?}"
        );
    }
    let (status, _) = open_events(&extra, &after, &[]).await.err().expect("403");
    assert_eq!(status, 403);
}

/// Holon's per-agent stream: `session=` and `agent=` keep the events about
/// those sessions (short keys read as the gateway reads them), in history
/// and live, with their ids; broker records are kept.
#[tokio::test]
async fn session_and_agent_filters_keep_only_those_sessions() {
    let h = start().await;
    let socket = h.socket();
    let start = until_ready(&socket).await["newest_seq"].as_u64().unwrap();
    let chat = |run: &str, key: &str| {
        json!({"runId": run, "sessionKey": key, "state": "final",
               "message": {"content": [{"type": "text", "text": run}]}})
    };
    h.gw.broadcast("chat", chat("r-main", "agent:main:main"));
    h.gw.broadcast("chat", chat("r-side", "agent:main:side"));
    h.gw.broadcast("chat", chat("r-ops", "agent:ops:main"));
    h.gw.broadcast("tick", json!({"ts": 1}));
    for (run, key) in [
        ("z-main", "agent:main:main"),
        ("z-side", "agent:main:side"),
        ("z-ops", "agent:ops:main"),
    ] {
        h.gw.broadcast("chat", chat(run, key));
    }
    let end = wait_newest_seq(&socket, start + 7).await["newest_seq"]
        .as_u64()
        .unwrap();
    for (query, want) in [
        ("session=main", vec!["r-main", "z-main"]),
        (
            "session=side,agent:ops:main",
            vec!["r-side", "r-ops", "z-side", "z-ops"],
        ),
        ("agent=ops", vec!["r-ops", "z-ops"]),
        ("agent=main&session=side", vec!["r-side", "z-side"]),
    ] {
        let path = format!("/v1/events?after_seq={start}&{query}");
        let mut sse = stream(&socket, &path, &[]).await;
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let (id, _, data) = sse.next_event().await;
            assert!(id > start && id <= end, "{query}: {id}");
            got.push(data["payload"]["runId"].as_str().unwrap_or("").to_owned());
        }
        assert_eq!(got, want, "{query}");
    }
    // Live too.
    let mut live = stream(&socket, "/v1/events?agent=ops", &[]).await;
    h.gw.broadcast("chat", chat("r-main-2", "agent:main:main"));
    h.gw.broadcast("chat", chat("r-ops-2", "agent:ops:x"));
    let e = live.next_event().await;
    assert_eq!(e.2["payload"]["runId"], "r-ops-2", "{e:?}");
    assert!(e.0 > end);
}

/// One record of a `/v1/hud` stream.
#[derive(Debug)]
enum Hud {
    /// A HUD event and its `id:` line, if any.
    Event(Option<String>, serde_json::Value),
    /// A named broker record (`clawmux.gap`, `clawmux.close`).
    Broker(String),
}

async fn next_hud(sse: &mut Sse) -> Hud {
    loop {
        let record = match sse.next_item().await {
            Item::Other(record) => record,
            Item::Event { name, .. } => return Hud::Broker(name),
            Item::Comment(_) => continue,
        };
        if record.lines().any(|l| l.starts_with("retry:")) {
            continue;
        }
        if let Some(name) = record.lines().find_map(|l| l.strip_prefix("event: ")) {
            return Hud::Broker(name.to_owned());
        }
        let id = record
            .lines()
            .find_map(|l| l.strip_prefix("id: "))
            .map(str::to_owned);
        let data = record
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap();
        return Hud::Event(id, serde_json::from_str(data).unwrap());
    }
}

/// HUD records until the `turn_end` of `run` (broker records included).
async fn hud_until_turn_end(sse: &mut Sse, run: &str) -> Vec<Hud> {
    let mut out = Vec::new();
    loop {
        let record = next_hud(sse).await;
        let end = matches!(&record, Hud::Event(_, e)
            if e["event"] == "turn_end" && e["correlationId"] == run);
        out.push(record);
        if end {
            return out;
        }
    }
}

/// The HUD events of `run` (its turn, thinking and tools), without the
/// fields a replay may differ in (`id`, `replay`).
fn of_run(records: &[Hud], run: &str) -> Vec<serde_json::Value> {
    records
        .iter()
        .filter_map(|r| match r {
            Hud::Event(_, e) if e["correlationId"] == run || e["parentId"] == run => {
                let mut e = e.clone();
                let map = e.as_object_mut().unwrap();
                map.remove("id");
                map.remove("replay");
                Some(e)
            }
            _ => None,
        })
        .collect()
}

/// Starts a run through a WebSocket client (which asked for tool events)
/// and returns its id; the run plays on in the gateway double.
async fn start_run(h: &Harness) -> (WsClient, String) {
    let (mut c, _) = h.connected().await;
    let key = uuid::Uuid::new_v4().to_string();
    let res = c
        .request(
            "chat.send",
            json!({"sessionKey": "main", "message": "hi", "idempotencyKey": key}),
        )
        .await;
    assert_eq!(res["ok"], true, "{res}");
    (c, key)
}

/// Before: `/v1/hud?history=1` equals the live feed field by field
/// (except `id` and `replay: true`), tool arguments and results included;
/// and a reader that drops right after `turn_start` and resumes with the
/// bare `id:` it got (as `after_seq=` and as `Last-Event-ID`) gets the rest
/// of the run, ending with its `turn_end`.
#[tokio::test]
async fn hud_history_equals_live_and_the_bare_id_resumes_the_rest_of_the_run() {
    let mut cfg = mock_config();
    cfg.run_step_delay = std::time::Duration::from_millis(40);
    let h = start_with(cfg, |_| {}).await;
    until_ready(&h.socket()).await;
    let mut live = stream(&h.socket(), "/v1/hud", &[]).await;
    let mut dropping = stream(&h.socket(), "/v1/hud", &[]).await;
    let (_c, run) = start_run(&h).await;
    // The dropping reader goes away right after the turn's start.
    let turn_start_id = loop {
        if let Hud::Event(id, e) = next_hud(&mut dropping).await {
            if e["event"] == "turn_start" && e["correlationId"] == run.as_str() {
                break id.expect("turn_start carries the id of its event");
            }
        }
    };
    drop(dropping);
    assert!(
        turn_start_id.bytes().all(|b| b.is_ascii_digit()),
        "a bare cursor: {turn_start_id}"
    );
    let live = hud_until_turn_end(&mut live, &run).await;
    let live_run = of_run(&live, &run);
    let tools: Vec<&serde_json::Value> =
        live_run.iter().filter(|e| e["tool"].is_string()).collect();
    assert!(
        tools
            .iter()
            .any(|e| e["event"] == "tool_start" && e["args"]["command"] == "ls"),
        "{tools:#?}"
    );
    assert!(
        tools
            .iter()
            .any(|e| e["event"] == "tool_end" && e["result"]["stdout"] == "README.md\nsrc\n"),
        "{tools:#?}"
    );

    // History: field by field what was live.
    let mut history = stream(&h.socket(), "/v1/hud?history=1", &[]).await;
    let replayed = hud_until_turn_end(&mut history, &run).await;
    assert!(replayed
        .iter()
        .all(|r| !matches!(r, Hud::Event(_, e) if e["replay"] != true)));
    assert_eq!(of_run(&replayed, &run), live_run);

    // Resuming with the bare id: the rest of the run, no second turn_start.
    let rest: Vec<serde_json::Value> = live_run
        .iter()
        .skip_while(|e| e["event"] != "turn_start")
        .skip(1)
        .cloned()
        .collect();
    assert!(rest.last().is_some_and(|e| e["event"] == "turn_end"));
    let path = format!("/v1/hud?after_seq={turn_start_id}");
    let header = [("last-event-id", turn_start_id.as_str())];
    for (path, headers) in [(path.as_str(), &[][..]), ("/v1/hud", &header[..])] {
        let mut resumed = stream(&h.socket(), path, headers).await;
        let got = hud_until_turn_end(&mut resumed, &run).await;
        assert!(
            !got.iter().any(|r| matches!(r, Hud::Broker(_))),
            "{path}: {got:#?}"
        );
        assert_eq!(of_run(&got, &run), rest, "{path} {headers:?}");
    }
}

/// A fresh live `/v1/hud` starts with what happens from now on: no old
/// `clawmux.gap` (an upstream gap earlier in the log) comes first.
#[tokio::test]
async fn a_fresh_live_hud_feed_shows_no_old_gaps() {
    let h = start().await;
    let base = until_ready(&h.socket()).await["newest_seq"]
        .as_u64()
        .unwrap();
    h.gw.broadcast("tick", json!({"ts": 1}));
    h.gw.skip_seq();
    h.gw.broadcast("tick", json!({"ts": 2}));
    // Logged, the gap between them included.
    wait_newest_seq(&h.socket(), base + 3).await;
    let mut hud = stream(&h.socket(), "/v1/hud", &[]).await;
    let (_c, run) = start_run(&h).await;
    let got = hud_until_turn_end(&mut hud, &run).await;
    assert!(!got.iter().any(|r| matches!(r, Hud::Broker(_))), "{got:#?}");
    // History still tells of it.
    let mut history = stream(&h.socket(), "/v1/hud?history=1", &[]).await;
    let got = hud_until_turn_end(&mut history, &run).await;
    assert!(
        got.iter()
            .any(|r| matches!(r, Hud::Broker(n) if n == "clawmux.gap")),
        "{got:#?}"
    );
}

/// A run that spans a broker restart is one turn: one `turn_start`, one
/// `turn_end`, in the history the new broker serves.
#[tokio::test]
async fn a_run_across_a_broker_restart_has_one_turn_start_and_one_turn_end() {
    let mut cfg = mock_config();
    cfg.run_step_delay = std::time::Duration::from_millis(150);
    let h = start_with(cfg, |_| {}).await;
    until_ready(&h.socket()).await;
    let mut events = stream(&h.socket(), "/v1/events", &[]).await;
    let run = h.gw.simulate_run("main", "a reply across the restart");
    loop {
        let (_, _, e) = events.next_event().await;
        if e["payload"]["runId"] == run.as_str() && e["payload"]["stream"] == "thinking" {
            break;
        }
    }
    drop(events);
    let Harness { gw, broker, dir } = h;
    assert!(broker.shutdown(std::time::Duration::from_secs(5)).await);
    let broker = RunningBroker::start(test_settings(dir.path(), &gw.url(), Some("test-token")))
        .await
        .unwrap();
    let h = Harness { gw, broker, dir };
    let mut hud = stream(&h.socket(), "/v1/hud?history=1", &[]).await;
    let got = hud_until_turn_end(&mut hud, &run).await;
    let turns: Vec<&str> = got
        .iter()
        .filter_map(|r| match r {
            Hud::Event(_, e) if e["correlationId"] == run.as_str() => e["event"].as_str(),
            _ => None,
        })
        .filter(|e| e.starts_with("turn_"))
        .collect();
    assert_eq!(turns, ["turn_start", "turn_end"], "{got:#?}");
}

/// `/v1/state` includes the runs in flight (open tool
/// calls and thinking) at its `newest_seq`, so state then `after_seq` is
/// complete: the stream after it ends exactly those calls and the run. A
/// socket without observer powers gets none.
#[tokio::test]
async fn state_lists_the_runs_in_flight_and_the_stream_after_it_completes_them() {
    let dir = tempfile::tempdir().unwrap();
    let extra = dir.path().join("plain.sock");
    let mut cfg = mock_config();
    cfg.run_step_delay = std::time::Duration::from_millis(60);
    let h = start_with(cfg, |s| s.sockets = vec![plain_socket(&extra)]).await;
    until_ready(&h.socket()).await;
    let mut observer = stream(&h.socket(), "/v1/events?tool_events=all", &[]).await;
    let (_c, run) = start_run(&h).await;
    loop {
        let (_, _, e) = observer.next_event().await;
        if e["payload"]["runId"] == run.as_str()
            && e["payload"]["data"]["phase"] == "start"
            && e["payload"]["stream"] == "tool"
        {
            break;
        }
    }
    let s = state(&h.socket()).await;
    let runs = s["runs"].as_array().expect("runs in /v1/state");
    let this = runs
        .iter()
        .find(|r| r["runId"] == run.as_str())
        .unwrap_or_else(|| panic!("the run in flight: {s}"));
    assert_eq!(this["sessionKey"], "agent:main:main");
    let open: Vec<String> = this["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            assert!(t["name"].is_string() && t["args"].is_object(), "{t}");
            t["toolCallId"].as_str().unwrap().to_owned()
        })
        .collect();
    assert!(!open.is_empty(), "{this}");
    // Streaming after its cursor ends each open call, then the run.
    let newest = s["newest_seq"].as_u64().unwrap();
    let path = format!("/v1/events?tool_events=all&after_seq={newest}");
    let mut after = stream(&h.socket(), &path, &[]).await;
    let mut ended = Vec::new();
    loop {
        let (_, _, e) = after.next_event().await;
        let p = &e["payload"];
        if p["runId"] != run.as_str() {
            continue;
        }
        if p["stream"] == "tool" && p["data"]["phase"] == "result" {
            ended.push(p["data"]["toolCallId"].as_str().unwrap().to_owned());
        }
        if p["stream"] == "lifecycle" && p["data"]["phase"] == "end" {
            break;
        }
    }
    for id in &open {
        assert!(
            ended.contains(id),
            "{id} ends after the snapshot: {ended:?}"
        );
    }
    let done = state(&h.socket()).await;
    assert!(
        !done["runs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["runId"] == run.as_str()),
        "{done}"
    );
    let (status, plain) = crate::support::http_get(&extra, "/v1/state").await;
    assert_eq!(status, 200);
    assert!(plain["runs"].is_null(), "{plain}");
}
