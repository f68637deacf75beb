//! The projection over recorded event sequences in the real gateway's
//! shapes (openclaw 2026.9.6; see the module docs).

use serde_json::{json, Value};

use super::render::{hud_line, TreePrinter};
use super::*;

const S: &str = "agent:main:main";

fn agent(run: &str, ts: u64, stream: &str, data: Value) -> Value {
    json!({"event": "agent", "payload": {"runId": run, "seq": 1, "stream": stream, "ts": ts,
        "sessionKey": S, "agentId": "main", "data": data}})
}

fn chat(run: &str, state: &str, extra: Value) -> Value {
    let mut p = json!({"runId": run, "sessionKey": S, "agentId": "main", "seq": 9, "state": state});
    p.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    json!({"event": "chat", "payload": p})
}

fn tool(run: &str, ts: u64, phase: &str, name: &str, id: &str, extra: Value) -> Value {
    let mut data = json!({"phase": phase, "name": name, "toolCallId": id});
    data.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    agent(run, ts, "tool", data)
}

fn message(text: &str) -> Value {
    json!({"role": "assistant", "content": [{"type": "text", "text": text}], "timestamp": 0})
}

/// Applies the events (received at `ts` 5000 when they carry none).
fn feed(a: &mut Activity, events: &[Value]) -> Vec<Change> {
    events
        .iter()
        .flat_map(|e| {
            a.apply(Observed {
                name: e["event"].as_str().unwrap(),
                payload: &e["payload"],
                received_ms: Some(5000),
            })
        })
        .collect()
}

fn kinds(changes: &[Change]) -> Vec<String> {
    changes
        .iter()
        .map(|c| hud_line(c, false)["event"].as_str().unwrap().to_owned())
        .collect()
}

/// A run as the double (and a real gateway) plays it: thinking, two tool
/// calls in parallel (the second ends first), streamed text, chat final,
/// lifecycle end.
fn parallel_run(run: &str) -> Vec<Value> {
    vec![
        agent(
            run,
            1000,
            "lifecycle",
            json!({"phase": "start", "startedAt": 1000}),
        ),
        agent(
            run,
            1100,
            "thinking",
            json!({"text": "Let me ", "delta": "Let me "}),
        ),
        agent(
            run,
            1200,
            "thinking",
            json!({"text": "Let me look.", "delta": "look."}),
        ),
        tool(
            run,
            1300,
            "start",
            "exec",
            "c1",
            json!({"args": {"command": "ls"}}),
        ),
        tool(
            run,
            1400,
            "start",
            "read",
            "c2",
            json!({"args": {"path": "README.md"}}),
        ),
        tool(
            run,
            1500,
            "update",
            "exec",
            "c1",
            json!({"partialResult": {"content": []}}),
        ),
        tool(
            run,
            1600,
            "result",
            "read",
            "c2",
            json!({"isError": false, "meta": "README.md", "result": {"content": [{"type": "text", "text": "# W\n"}]}}),
        ),
        tool(
            run,
            1900,
            "result",
            "exec",
            "c1",
            json!({"isError": true, "meta": "ls", "result": {"content": [{"type": "text", "text": "denied"}]}}),
        ),
        agent(
            run,
            2000,
            "assistant",
            json!({"text": "Done", "delta": "Done"}),
        ),
        chat(
            run,
            "delta",
            json!({"deltaText": "Done", "message": message("Done")}),
        ),
        agent(
            run,
            2100,
            "assistant",
            json!({"text": "Done: two files.", "delta": ": two files."}),
        ),
        chat(
            run,
            "final",
            json!({"message": message("Done: two files.")}),
        ),
        agent(
            run,
            2300,
            "lifecycle",
            json!({"phase": "end", "endedAt": 2300}),
        ),
    ]
}

#[test]
fn parallel_tool_calls_each_get_their_own_duration_and_outcome() {
    let mut a = Activity::new();
    let changes = feed(&mut a, &parallel_run("r1"));
    assert_eq!(
        kinds(&changes),
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
    let run = a.run("r1").unwrap();
    // The chat final (no ts: received at 5000) ended it before the lifecycle end.
    assert_eq!(run.status, RunStatus::Ok);
    assert_eq!(run.output, "Done: two files.");
    let [Item::Thinking(t), Item::Tool(exec), Item::Tool(read)] = &run.items[..] else {
        panic!("{:?}", run.items)
    };
    assert_eq!(
        (t.text.as_str(), t.started_ms, t.ended_ms),
        ("Let me look.", Some(1100), Some(1300))
    );
    assert_eq!(
        (exec.name.as_str(), exec.started_ms, exec.ended_ms),
        ("exec", Some(1300), Some(1900))
    );
    assert_eq!(exec.is_error, Some(true));
    assert_eq!(exec.args, json!({"command": "ls"}));
    assert_eq!((read.ended_ms, read.is_error), (Some(1600), Some(false)));
    assert_eq!(read.result_bytes, Some(read.result.to_string().len()));
    assert_eq!(a.running(), 0);
}

#[test]
fn a_run_without_a_final_chat_event_ends_with_its_lifecycle() {
    let mut a = Activity::new();
    let changes = feed(
        &mut a,
        &[
            agent("r2", 1000, "lifecycle", json!({"phase": "start"})),
            agent(
                "r2",
                1200,
                "assistant",
                json!({"text": "partial", "delta": "partial"}),
            ),
            agent(
                "r2",
                1500,
                "lifecycle",
                json!({"phase": "end", "stopReason": "stop"}),
            ),
        ],
    );
    assert_eq!(kinds(&changes), ["turn_start", "turn_end"]);
    let Change::TurnEnd {
        duration_ms,
        status,
        output,
        ..
    } = &changes[1]
    else {
        panic!()
    };
    assert_eq!(
        (*duration_ms, status, output.as_str()),
        (Some(500), &RunStatus::Ok, "partial")
    );
    // A late terminal chat event does not end it twice.
    assert!(feed(
        &mut a,
        &[chat("r2", "final", json!({"message": message("partial")}))]
    )
    .is_empty());
}

#[test]
fn an_aborted_run_interrupts_its_open_tool_call_and_ends_once() {
    let mut a = Activity::new();
    let changes = feed(
        &mut a,
        &[
            agent("r3", 1000, "lifecycle", json!({"phase": "start"})),
            tool(
                "r3",
                1100,
                "start",
                "exec",
                "c1",
                json!({"args": {"command": "sleep 60"}}),
            ),
            chat("r3", "aborted", json!({"stopReason": "user"})),
            agent(
                "r3",
                5100,
                "lifecycle",
                json!({"phase": "end", "aborted": true}),
            ),
        ],
    );
    assert_eq!(
        kinds(&changes),
        ["turn_start", "tool_start", "tool_end", "turn_end"]
    );
    let run = a.run("r3").unwrap();
    assert_eq!(run.status, RunStatus::Aborted);
    let Item::Tool(call) = &run.items[0] else {
        panic!()
    };
    assert!(call.interrupted && call.ended_ms == Some(5000));
    let hud = hud_line(&changes[2], false);
    assert_eq!(
        (hud["interrupted"].clone(), hud["durationMs"].clone()),
        (json!(true), json!(3900))
    );
    // A tool event after the end adds nothing.
    assert!(feed(
        &mut a,
        &[tool("r3", 6000, "start", "exec", "c9", json!({}))]
    )
    .is_empty());
}

#[test]
fn an_errored_run_carries_the_gateways_message() {
    let mut a = Activity::new();
    let changes = feed(
        &mut a,
        &[
            agent("r4", 1000, "lifecycle", json!({"phase": "start"})),
            agent("r4", 1100, "thinking", json!({"delta": "hmm"})),
            agent(
                "r4",
                1300,
                "lifecycle",
                json!({"phase": "error", "error": "No API key found for provider anthropic"}),
            ),
            chat(
                "r4",
                "error",
                json!({"errorMessage": "No API key found for provider anthropic", "errorKind": "unknown"}),
            ),
        ],
    );
    assert_eq!(
        kinds(&changes),
        ["turn_start", "think_start", "think_end", "turn_end"]
    );
    let run = a.run("r4").unwrap();
    assert_eq!(
        run.status,
        RunStatus::Error("No API key found for provider anthropic".into())
    );
    let hud = hud_line(changes.last().unwrap(), false);
    assert_eq!(hud["status"], "error");
    assert_eq!(hud["error"], "No API key found for provider anthropic");
    // A chat error after a clean lifecycle end still says it failed.
    let mut b = Activity::new();
    feed(
        &mut b,
        &[
            agent("r5", 1000, "lifecycle", json!({"phase": "end"})),
            chat("r5", "error", json!({"errorMessage": "boom"})),
        ],
    );
    assert_eq!(b.run("r5").unwrap().status, RunStatus::Error("boom".into()));
}

#[test]
fn thinking_streams_split_into_segments_around_tool_calls() {
    let mut a = Activity::new();
    let changes = feed(
        &mut a,
        &[
            agent("r6", 1000, "thinking", json!({"delta": "first "})),
            agent("r6", 1050, "thinking", json!({"delta": "thought"})),
            agent("r6", 1060, "thinking", json!({"progressTokens": 12})),
            tool(
                "r6",
                1100,
                "start",
                "web_search",
                "c1",
                json!({"args": {"query": "rust"}}),
            ),
            agent(
                "r6",
                1200,
                "thinking",
                json!({"text": "second", "delta": "second"}),
            ),
            agent("r6", 1400, "lifecycle", json!({"phase": "end"})),
        ],
    );
    assert_eq!(
        kinds(&changes),
        [
            "turn_start",
            "think_start",
            "think_end",
            "tool_start",
            "think_start",
            "think_end",
            "tool_end",
            "turn_end"
        ]
    );
    let ids: Vec<&str> = a
        .run("r6")
        .unwrap()
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Thinking(t) => Some(t.id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, ["r6:think:1", "r6:think:2"]);
    let Change::ThinkEnd {
        text, duration_ms, ..
    } = &changes[2]
    else {
        panic!()
    };
    assert_eq!((text.as_str(), *duration_ms), ("first thought", Some(100)));
}

#[test]
fn session_tool_and_agent_tool_events_of_one_call_count_once() {
    let mut a = Activity::new();
    let start = tool("r7", 1000, "start", "exec", "c1", json!({"args": {}}));
    let mut session_tool = start.clone();
    session_tool["event"] = json!("session.tool");
    let changes = feed(&mut a, &[start, session_tool]);
    assert_eq!(kinds(&changes), ["turn_start", "tool_start"]);
    assert_eq!(a.run("r7").unwrap().items.len(), 1);
}

#[test]
fn events_without_a_run_change_nothing_and_sessions_sort_newest_first() {
    let mut a = Activity::new();
    assert!(feed(&mut a, &[json!({"event": "tick", "payload": {"ts": 1}})]).is_empty());
    let mut other = agent("old", 10, "lifecycle", json!({"phase": "start"}));
    other["payload"]["sessionKey"] = json!("agent:main:other");
    feed(
        &mut a,
        &[
            other,
            agent("new1", 20, "lifecycle", json!({"phase": "start"})),
            agent("new2", 30, "lifecycle", json!({"phase": "start"})),
        ],
    );
    let sessions = a.sessions();
    assert_eq!(sessions[0].0, S);
    let runs: Vec<&str> = sessions[0].1.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(runs, ["new2", "new1"], "newest run first");
    assert_eq!(sessions[1].0, "agent:main:other");
}

#[test]
fn old_ended_runs_are_forgotten_past_the_bound_before_a_running_one() {
    let mut a = Activity::new();
    feed(
        &mut a,
        &[agent("live", 0, "lifecycle", json!({"phase": "start"}))],
    );
    for i in 0..MAX_RUNS as u64 + 10 {
        let run = format!("r{i}");
        feed(
            &mut a,
            &[
                agent(&run, 10 + i, "lifecycle", json!({"phase": "start"})),
                agent(&run, 10 + i, "lifecycle", json!({"phase": "end"})),
            ],
        );
    }
    assert_eq!(a.runs.len(), MAX_RUNS);
    assert!(a.run("live").is_some(), "ended runs go first");
    assert!(a.run("r0").is_none() && a.run(&format!("r{}", MAX_RUNS + 9)).is_some());
}

fn is_uuid(v: &Value) -> bool {
    v.as_str().is_some_and(|s| uuid::Uuid::parse_str(s).is_ok())
}

#[test]
fn hud_events_follow_the_protocol_ids_pairing_parents_times_and_replay() {
    let mut a = Activity::new();
    let changes = feed(&mut a, &parallel_run("r1"));
    let lines: Vec<Value> = changes.iter().map(|c| hud_line(c, true)).collect();
    for l in &lines {
        assert_eq!(l["type"], "hud", "{l}");
        assert!(is_uuid(&l["id"]), "every id a fresh UUID: {l}");
        assert_eq!(l["replay"], true);
    }
    let ids: std::collections::HashSet<&str> =
        lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), lines.len(), "no id twice");
    let start = &lines[0];
    assert_eq!(
        (
            start["event"].clone(),
            start["correlationId"].clone(),
            start["ts"].clone()
        ),
        (json!("turn_start"), json!("r1"), json!(1000))
    );
    assert!(start.get("parentId").is_none());
    // Thinking: a UUID made at think_start, the same at think_end.
    let (think_start, think_end) = (&lines[1], &lines[2]);
    assert!(is_uuid(&think_start["correlationId"]));
    assert_eq!(think_start["correlationId"], think_end["correlationId"]);
    assert_ne!(think_start["correlationId"], think_start["id"]);
    assert_eq!(
        (
            think_end["parentId"].clone(),
            think_end["durationMs"].clone()
        ),
        (json!("r1"), json!(200))
    );
    assert!(think_start.get("durationMs").is_none(), "only ends");
    // Tools: the provider's call id, the turn as parent.
    let read_start = &lines[4];
    assert_eq!(
        (
            read_start["event"].clone(),
            read_start["correlationId"].clone()
        ),
        (json!("tool_start"), json!("c2"))
    );
    assert_eq!(read_start["args"], json!({"path": "README.md"}));
    let read_end = &lines[5];
    assert_eq!(read_end["event"], "tool_end");
    assert_eq!(read_end["correlationId"], "c2");
    assert_eq!(
        (read_end["parentId"].clone(), read_end["durationMs"].clone()),
        (json!("r1"), json!(200))
    );
    assert_eq!(read_end["tool"], "read");
    assert_eq!(
        read_end["result"],
        json!({"ok": true, "file": {"path": "README.md", "viewerPath": "README.md"},
            "text": "# W\n", "bytes": 4, "truncated": false}),
        "no area: the call gave no offset/limit"
    );
    let exec_end = &lines[6];
    assert_eq!(exec_end["result"]["ok"], false);
    assert_eq!(exec_end["result"]["stdout"], "denied");
    assert_eq!(exec_end["result"]["error"], "denied");
    assert!(
        exec_end["result"].get("exitCode").is_none(),
        "not sent: left out"
    );
    assert_eq!(lines[7]["event"], "turn_end");
    assert_eq!(lines[7]["status"], "ok");
    assert_eq!(lines[7]["durationMs"], 4000);
    assert!(
        hud_line(&changes[0], false).get("replay").is_none(),
        "only replayed events say so"
    );
}

/// The recorded real gateway run (openclaw 2026.9.6), as an observer
/// received it: each event, its broker cursor (none for the tool stream:
/// not in the log) and when it arrived.
fn fixture_events() -> Vec<(Value, Option<u64>, u64)> {
    include_str!("../../tests/fixtures/real-gateway-run.jsonl")
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r["dir"] == "in" && r["frame"]["type"] == "event")
        .map(|r| {
            (
                r["frame"].clone(),
                r["cursor"].as_u64(),
                r["ms"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The fixture run projected to HUD lines: live (every event, with the
/// time it arrived), or replayed from the broker's log (only the logged
/// events, no arrival times). Either way the same protocol events, in order.
fn fixture_hud_lines(replayed: bool) -> Vec<Value> {
    // Replayed: as a log without the tool stream holds it, read by a
    // reader that gets no tool streams.
    let mut a = if replayed {
        Activity::without_tool_streams()
    } else {
        Activity::new()
    };
    let changes: Vec<Change> = fixture_events()
        .iter()
        .filter(|(_, cursor, _)| !replayed || cursor.is_some())
        .flat_map(|(e, _, ms)| {
            a.apply(Observed {
                name: e["event"].as_str().unwrap(),
                payload: &e["payload"],
                received_ms: (!replayed).then_some(*ms),
            })
        })
        .collect();
    let lines: Vec<Value> = changes.iter().map(|c| hud_line(c, replayed)).collect();
    let kinds: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "turn_start",
            "think_start",
            "think_end",
            "tool_start",
            "tool_end",
            "think_start",
            "think_end",
            "turn_end"
        ]
    );
    lines
}

#[test]
fn the_real_gateways_run_projects_to_protocol_events_with_its_own_times() {
    // Live, as recorded.
    let lines = fixture_hud_lines(false);
    assert_eq!(lines[0]["correlationId"], "fixture-run-1");
    assert_eq!(
        lines[0]["ts"], 1795431469131_u64,
        "the lifecycle's startedAt"
    );
    assert_eq!(lines[0]["sessionKey"], "agent:main:main");
    assert_eq!(lines[3]["correlationId"], "call_1");
    assert_eq!(lines[3]["parentId"], "fixture-run-1");
    assert_eq!(lines[3]["args"], json!({"path": "notes.txt"}));
    let end = &lines[4];
    assert_eq!(
        end["result"],
        json!({"ok": true, "file": {"path": "notes.txt", "viewerPath": "notes.txt"},
            "text": "Remember to water the plants.\n", "bytes": 30, "truncated": false})
    );
    assert_eq!(end["durationMs"], 1795431470344_u64 - 1795431469879);
    assert_eq!(lines[5]["correlationId"], lines[6]["correlationId"]);
    assert_ne!(lines[1]["correlationId"], lines[5]["correlationId"]);
    let turn_end = &lines[7];
    assert_eq!(turn_end["ts"], 1795431472110_u64, "the lifecycle's endedAt");
    assert_eq!(turn_end["durationMs"], 1795431472110_u64 - 1795431469131);
    assert_eq!(turn_end["status"], "ok");
    assert!(lines
        .iter()
        .all(|l| l.get("replay").is_none() && is_uuid(&l["id"])));
}

#[test]
fn the_real_gateways_run_replayed_from_the_log_keeps_its_tool_call_from_the_item_stream() {
    // What the broker's log holds of it (the tool stream is not logged).
    let lines = fixture_hud_lines(true);
    let (start, end) = (&lines[3], &lines[4]);
    assert_eq!(start["correlationId"], "call_1");
    assert_eq!(start["ts"], 1795431469871_u64, "the item's startedAt");
    assert!(start.get("args").is_none(), "not in the log: left out");
    assert_eq!(end["durationMs"], 1795431470344_u64 - 1795431469871);
    assert_eq!(
        end["result"],
        json!({"ok": true}),
        "only what the item says"
    );
    assert_eq!(lines[7]["durationMs"], 1795431472110_u64 - 1795431469131);
    assert!(lines.iter().all(|l| l["replay"] == true));
}

#[test]
fn replayed_ends_take_the_gateways_times_never_the_replays() {
    // A 0.2 s run that ended before the view started: its final chat
    // event (no ts) says when by its message's timestamp.
    let replayed = |a: &mut Activity, e: &Value| {
        a.apply(Observed {
            name: e["event"].as_str().unwrap(),
            payload: &e["payload"],
            received_ms: None,
        })
    };
    let mut a = Activity::new();
    replayed(
        &mut a,
        &agent("r1", 1000, "lifecycle", json!({"phase": "start"})),
    );
    let mut done = message("ok");
    done["timestamp"] = json!(1200);
    let changes = replayed(&mut a, &chat("r1", "final", json!({"message": done})));
    let Change::TurnEnd {
        duration_ms, ts, ..
    } = &changes[0]
    else {
        panic!("{changes:?}")
    };
    assert_eq!((*duration_ms, *ts), (Some(200), Some(1200)));
    // An end with no time of its own, replayed: no duration is made up.
    let changes = replayed(&mut a, &chat("r2", "aborted", json!({})));
    let Change::TurnEnd {
        duration_ms, ts, ..
    } = &changes[1]
    else {
        panic!("{changes:?}")
    };
    assert_eq!((*duration_ms, *ts), (None, None));
    let mut printer = TreePrinter::new();
    let lines: Vec<String> = changes
        .iter()
        .flat_map(|c| printer.lines(c, true, |ts| format!("{ts:>5}")))
        .collect();
    assert_eq!(lines.last().unwrap(), "        run r2 aborted (history)");
    let hud = hud_line(&changes[1], true);
    assert!(
        hud.get("durationMs").is_none() && hud.get("ts").is_none(),
        "{hud}"
    );
}

#[test]
fn a_run_aborted_while_queued_ends_aborted_not_ok() {
    let mut a = Activity::new();
    let changes = feed(
        &mut a,
        &[chat("q1", "final", json!({"stopReason": "aborted"}))],
    );
    assert_eq!(a.run("q1").unwrap().status, RunStatus::Aborted);
    assert_eq!(
        hud_line(changes.last().unwrap(), false)["status"],
        "aborted"
    );
    // A final with its message after a clean lifecycle end stays ok.
    let mut b = Activity::new();
    feed(
        &mut b,
        &[
            agent("q2", 1000, "lifecycle", json!({"phase": "end"})),
            chat("q2", "final", json!({"message": message("hi")})),
        ],
    );
    assert_eq!(b.run("q2").unwrap().status, RunStatus::Ok);
}

#[test]
fn unfinished_runs_are_forgotten_on_an_upstream_reconnect_or_a_gap_only() {
    let mut a = Activity::new();
    feed(
        &mut a,
        &[
            agent("open", 1000, "lifecycle", json!({"phase": "start"})),
            agent("done", 1000, "lifecycle", json!({"phase": "start"})),
            agent("done", 1100, "lifecycle", json!({"phase": "end"})),
            json!({"event": "clawmux.upstream", "payload": {"phase": "backoff", "reason": "closed"}}),
        ],
    );
    assert!(a.run("open").is_some(), "an outage alone forgets nothing");
    let changes = feed(
        &mut a,
        &[
            json!({"event": "clawmux.upstream", "payload": {"phase": "ready", "reason": "reconnected", "serverVersion": "2026.9.6"}}),
        ],
    );
    assert!(a.run("open").is_none() && a.run("done").is_some());
    let hud = hud_line(&changes[0], false);
    assert_eq!(
        (
            hud["event"].clone(),
            hud["subtype"].clone(),
            hud["payload"].clone()
        ),
        (
            json!("received"),
            json!("reconnect"),
            json!({"serverVersion": "2026.9.6"})
        )
    );
    assert!(hud["label"].is_string() && hud.get("correlationId").is_none());
    feed(
        &mut a,
        &[agent("open2", 2000, "lifecycle", json!({"phase": "start"}))],
    );
    a.forget_unfinished();
    assert!(a.run("open2").is_none());
}

#[test]
fn tool_arguments_and_results_are_bounded() {
    let mut a = Activity::new();
    let big = "x".repeat(MAX_VALUE_BYTES * 4);
    feed(
        &mut a,
        &[
            tool(
                "b1",
                1000,
                "start",
                "write",
                "c1",
                json!({"args": {"path": "a.txt", "content": big}}),
            ),
            tool(
                "b1",
                1100,
                "result",
                "write",
                "c1",
                json!({"isError": false, "result": {"content": [{"type": "text", "text": big}]}}),
            ),
        ],
    );
    let Item::Tool(call) = &a.run("b1").unwrap().items[0] else {
        panic!()
    };
    assert!(
        call.args.to_string().len() <= MAX_VALUE_BYTES,
        "args bounded"
    );
    assert!(
        call.result.to_string().len() <= MAX_VALUE_BYTES,
        "result bounded"
    );
    assert_eq!(call.args["path"], "a.txt", "short fields kept");
    assert!(call.cut);
    assert!(
        call.result_bytes.unwrap() > MAX_VALUE_BYTES * 4,
        "the size as sent"
    );
    let result = super::hud::tool_result(call);
    assert!(
        result.get("bytes").is_none() && result.get("area").is_none(),
        "not from cut content: {result}"
    );
}

#[test]
fn requests_the_broker_sees_are_received_events() {
    let mut a = Activity::new();
    let hud = |changes: Vec<Change>| hud_line(&changes[0], false);
    let sent = hud(a.apply_request(
        "chat.send",
        &json!({"sessionKey": "main", "message": "hello world", "idempotencyKey": "k"}),
        7,
    ));
    assert_eq!(
        (
            sent["event"].clone(),
            sent["subtype"].clone(),
            sent["ts"].clone()
        ),
        (json!("received"), json!("message"), json!(7))
    );
    assert_eq!(
        sent["payload"],
        json!({"preview": "hello world", "sessionKey": "main"})
    );
    let long = "y".repeat(500);
    let sent = hud(a.apply_request("chat.send", &json!({"message": long}), 7));
    assert!(sent["payload"]["preview"].as_str().unwrap().chars().count() <= render::PREVIEW_CHARS);
    let stop = hud(a.apply_request(
        "chat.abort",
        &json!({"sessionKey": "main", "runId": "r1"}),
        8,
    ));
    assert_eq!(
        (stop["subtype"].clone(), stop["payload"]["runId"].clone()),
        (json!("stop"), json!("r1"))
    );
    let new = hud(a.apply_request(
        "sessions.reset",
        &json!({"key": "main", "reason": "new"}),
        9,
    ));
    assert_eq!(new["subtype"], "new_session");
    let slash = hud(a.apply_request(
        "chat.send",
        &json!({"sessionKey": "main", "message": "/new"}),
        9,
    ));
    assert_eq!(slash["subtype"], "new_session");
    assert!(a.apply_request("sessions.list", &json!({}), 9).is_empty());
}

#[test]
fn tool_results_take_the_protocols_per_tool_shapes() {
    let call = |name: &str, args: Value, result: Value, is_error: bool| ToolCall {
        call_id: "c".into(),
        name: name.into(),
        args,
        parent_call_id: None,
        started_ms: Some(1),
        ended_ms: Some(2),
        is_error: Some(is_error),
        result,
        meta: None,
        result_bytes: None,
        text_bytes: None,
        cut: false,
        interrupted: false,
        size: Default::default(),
    };
    let text = |t: &str| json!([{"type": "text", "text": t}]);
    use super::hud::tool_result;
    // exec as the real gateway sends it.
    let exec = tool_result(&call(
        "exec",
        json!({"command": "cat src/main.rs > /tmp/out.txt"}),
        json!({"content": text("fn main"), "details": {"status": "completed", "exitCode": 0,
            "exitSignal": null, "durationMs": 12, "aggregated": "fn main"}}),
        false,
    ));
    assert_eq!(
        exec,
        json!({"ok": true, "exitCode": 0, "stdout": "fn main", "truncated": false,
            "mentionedPaths": [{"path": "src/main.rs", "viewerPath": "src/main.rs"},
                {"path": "/tmp/out.txt", "viewerPath": "/tmp/out.txt"}]})
    );
    let read = tool_result(&call(
        "read",
        json!({"path": "/home/openclaw/.openclaw/workspace/SOUL.md", "offset": 10, "limit": 40}),
        json!({"content": text("# SOUL"), "details": {"kind": "text", "content": "# SOUL"}}),
        false,
    ));
    assert_eq!(
        read,
        json!({"ok": true, "file": {"path": "/home/openclaw/.openclaw/workspace/SOUL.md",
            "viewerPath": "workspace/SOUL.md", "area": {"startLine": 10, "endLine": 50}},
            "area": {"startLine": 10, "endLine": 50}, "text": "# SOUL", "bytes": 6, "truncated": false})
    );
    let write = tool_result(&call(
        "write",
        json!({"path": "a.md", "content": "one
two
"}),
        json!({"content": text("ok")}),
        false,
    ));
    assert_eq!(
        write,
        json!({"ok": true, "file": {"path": "a.md", "viewerPath": "a.md"},
            "area": {"startLine": 1, "endLine": 2}, "bytes": 8})
    );
    let edit = tool_result(&call("edit", json!({"path": "a.md"}), json!({}), false));
    assert_eq!(
        edit,
        json!({"ok": true, "file": {"path": "a.md", "viewerPath": "a.md"}})
    );
    // Seed 000: an edit's area is the replaced block in the resulting file.
    let edited = |details: Value| {
        tool_result(&call(
            "edit",
            json!({"path": "a.md", "oldText": "x", "newText": "one\ntwo\nthree"}),
            json!({"content": text("Successfully replaced text"), "details": details}),
            false,
        ))
    };
    let area = json!({"startLine": 22, "endLine": 24});
    assert_eq!(
        edited(json!({"firstChangedLine": 22, "diff": "..."})),
        json!({"ok": true, "file": {"path": "a.md", "viewerPath": "a.md", "area": area},
            "area": area})
    );
    assert_eq!(
        edited(json!({"diff": "   21 a\n-22 x\n+22 one\n+23 two\n+24 three"}))["area"],
        area,
        "from the diff when the first line is not said"
    );
    // One rule for exec: a non-zero exit is not ok, whatever isError says.
    let failed = call(
        "exec",
        json!({"command": "false"}),
        json!({"content": text("boom"), "details": {"exitCode": 3, "aggregated": "boom"}}),
        false,
    );
    assert_eq!(failed.ok(), Some(false));
    let failed = tool_result(&failed);
    assert_eq!(
        (&failed["ok"], &failed["exitCode"], &failed["error"]),
        (&json!(false), &json!(3), &json!("boom"))
    );
    let fetch = tool_result(&call(
        "web_fetch",
        json!({"url": "https://example.com"}),
        json!({"content": text("Example")}),
        false,
    ));
    assert_eq!(
        fetch,
        json!({"ok": true, "text": "Example", "url": "https://example.com", "truncated": false})
    );
    let browser = tool_result(&call(
        "browser",
        json!({"action": "open"}),
        json!({"content": text("Opened\npage"), "details": {"tab": 1}}),
        false,
    ));
    assert_eq!(
        browser,
        json!({"ok": true, "summary": "Opened page", "raw": {"tab": 1}})
    );
    let other = tool_result(&call(
        "cron",
        json!({}),
        json!({"content": text("x")}),
        true,
    ));
    assert_eq!(other, json!({"ok": false, "raw": {"content": text("x")}}));
}

#[test]
fn tree_error_lines_keep_the_start_of_the_message() {
    let mut a = Activity::new();
    let message = format!(
        "No API key found for provider anthropic; {}",
        "detail ".repeat(20)
    );
    let changes = feed(
        &mut a,
        &[
            agent("e1", 1000, "lifecycle", json!({"phase": "start"})),
            agent(
                "e1",
                1300,
                "lifecycle",
                json!({"phase": "error", "error": message}),
            ),
        ],
    );
    let mut printer = TreePrinter::new();
    let last = changes
        .iter()
        .flat_map(|c| printer.lines(c, false, |ts| format!("{ts}")))
        .last()
        .unwrap();
    assert!(
        last.contains("error: \"No API key found for provider anthropic; detail")
            && last.contains("…\" in 300 ms"),
        "{last}"
    );
}

#[test]
fn tree_lines_indent_runs_under_sessions() {
    let mut a = Activity::new();
    let changes = feed(&mut a, &parallel_run("7d7b1f2c-1111"));
    let mut printer = TreePrinter::new();
    let lines: Vec<String> = changes
        .iter()
        .flat_map(|c| printer.lines(c, false, |ts| format!("{ts:>5}")))
        .collect();
    assert_eq!(
        lines.join("\n"),
        [
            " 1000 agent:main:main",
            " 1000   run 7d7b1f2c-1111 started",
            " 1300     thinking 200 ms \"Let me look.\"",
            " 1300     tool exec command=\"ls\"",
            " 1400     tool read path=\"README.md\"",
            " 1600     tool read ok 200 ms, 44 B",
            " 1900     tool exec error 600 ms, 45 B",
            " 5000     assistant \"Done: two files.\"",
            " 5000   run 7d7b1f2c-1111 ok in 4.0 s",
        ]
        .join("\n")
    );
}

#[test]
fn tree_lines_of_interleaved_runs_say_which_run_they_belong_to() {
    let mut a = Activity::new();
    let mut changes = feed(
        &mut a,
        &[agent(
            "aaaaaaaa-1",
            1000,
            "lifecycle",
            json!({"phase": "start"}),
        )],
    );
    changes.extend(feed(
        &mut a,
        &[agent(
            "bbbbbbbb-2",
            1100,
            "lifecycle",
            json!({"phase": "start"}),
        )],
    ));
    changes.extend(feed(
        &mut a,
        &[tool(
            "aaaaaaaa-1",
            1200,
            "start",
            "exec",
            "c1",
            json!({"args": {}}),
        )],
    ));
    let mut printer = TreePrinter::new();
    let lines: Vec<String> = changes
        .iter()
        .flat_map(|c| printer.lines(c, true, |ts| format!("{ts}")))
        .collect();
    assert_eq!(
        lines,
        [
            "1000 agent:main:main",
            "1000   run aaaaaaaa-1 started (history)",
            "1100   run bbbbbbbb-2 started (history)",
            "1200   run aaaaaaaa-1 (history)",
            "1200     tool exec (history)",
        ]
    );
}

/// The projection a HUD stream keeps ([`Activity::for_feed`]) produces the
/// same HUD events as the full one for every kind of run (parallel tool
/// calls, thinking, an aborted run with an interrupted call, events after
/// the end, the real gateway's recorded run), while keeping of an ended
/// run neither its output nor its items (before: 150 `/v1/hud` streams
/// each kept every ended run's output, ~47 MiB over the queue budget).
#[test]
fn the_feed_projection_produces_the_same_changes_and_keeps_no_ended_detail() {
    let mut events = parallel_run("r1");
    events.extend([
        agent("r3", 1000, "lifecycle", json!({"phase": "start"})),
        tool(
            "r3",
            1100,
            "start",
            "read",
            "c1",
            json!({"args": {"path": "/a", "offset": 1, "limit": 2}}),
        ),
        tool(
            "r3",
            1200,
            "result",
            "read",
            "c1",
            json!({"result": {"content": [{"type": "text", "text": "x".repeat(4096)}]}}),
        ),
        tool(
            "r3",
            1300,
            "update",
            "read",
            "c1",
            json!({"args": {"path": "/b"}}),
        ),
        tool(
            "r3",
            1400,
            "start",
            "exec",
            "c2",
            json!({"args": {"command": "sleep"}}),
        ),
        chat("r3", "aborted", json!({"stopReason": "user"})),
        agent(
            "r3",
            5100,
            "lifecycle",
            json!({"phase": "end", "aborted": true}),
        ),
        tool(
            "r3",
            6000,
            "result",
            "exec",
            "c2",
            json!({"isError": false}),
        ),
        tool("r3", 6000, "start", "exec", "c9", json!({})),
        chat(
            "r1",
            "final",
            json!({"message": message(&"late ".repeat(1000))}),
        ),
        agent("r1", 7000, "assistant", json!({"text": "after the end"})),
    ]);
    events.extend(fixture_events().into_iter().map(|(frame, _, _)| frame));
    let strip = |changes: Vec<Change>| -> Vec<Value> {
        changes
            .iter()
            .map(|c| {
                let mut v = hud::hud_event(c, false);
                v.as_object_mut().unwrap().remove("id");
                v
            })
            .collect()
    };
    let mut full = Activity::new();
    let mut lean = Activity::for_feed();
    for e in &events {
        let seen = |a: &mut Activity| {
            a.apply(Observed {
                name: e["event"].as_str().unwrap(),
                payload: &e["payload"],
                received_ms: Some(5000),
            })
        };
        assert_eq!(strip(seen(&mut lean)), strip(seen(&mut full)), "{e}");
    }
    for (_, runs) in lean.sessions() {
        for run in runs {
            assert!(run.output.is_empty(), "{}", run.id);
            if !run.running() {
                assert!(run.items.is_empty(), "{}: {:?}", run.id, run.items);
            }
        }
    }
    assert!(!full.run("r1").unwrap().output.is_empty());
}
