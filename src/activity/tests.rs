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
                received_ms: 5000,
            })
        })
        .collect()
}

fn kinds(changes: &[Change]) -> Vec<String> {
    changes
        .iter()
        .map(|c| hud_line(c, false)["type"].as_str().unwrap().to_owned())
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
        ("Let me look.", 1100, Some(1300))
    );
    assert_eq!(
        (exec.name.as_str(), exec.started_ms, exec.ended_ms),
        ("exec", 1300, Some(1900))
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
        (500, &RunStatus::Ok, "partial")
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
    assert_eq!((text.as_str(), *duration_ms), ("first thought", 100));
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
fn old_ended_runs_are_forgotten_past_the_bound_running_ones_are_kept() {
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
    assert!(a.run("live").is_some(), "a running run is never forgotten");
    assert!(a.run("r0").is_none() && a.run(&format!("r{}", MAX_RUNS + 9)).is_some());
}

#[test]
fn hud_lines_carry_ids_parents_times_and_replay() {
    let mut a = Activity::new();
    let changes = feed(&mut a, &parallel_run("r1"));
    let lines: Vec<Value> = changes.iter().map(|c| hud_line(c, true)).collect();
    assert_eq!(
        lines[0],
        json!({"type": "turn_start", "id": "r1", "correlationId": "r1",
        "parentId": null, "ts": 1000, "sessionKey": S, "replay": true})
    );
    assert_eq!(lines[2]["id"], "r1:think:1");
    assert_eq!(
        (lines[2]["parentId"].clone(), lines[2]["durationMs"].clone()),
        (json!("r1"), json!(200))
    );
    let read_end = &lines[5];
    assert_eq!(read_end["type"], "tool_end");
    assert_eq!(
        (read_end["id"].clone(), read_end["correlationId"].clone()),
        (json!("c2"), json!("c2"))
    );
    assert_eq!(
        (read_end["parentId"].clone(), read_end["durationMs"].clone()),
        (json!("r1"), json!(200))
    );
    assert_eq!(read_end["tool"], "read");
    assert_eq!(read_end["isError"], false);
    assert_eq!(read_end["result"]["content"][0]["text"], "# W\n");
    assert_eq!(lines[7]["status"], "ok");
    assert_eq!(lines[7]["durationMs"], 4000);
    assert!(
        hud_line(&changes[0], false).get("replay").is_none(),
        "only replayed events say so"
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
            " 1000   run 7d7b1f2c started",
            " 1300     thinking 200 ms \"Let me look.\"",
            " 1300     tool exec command=\"ls\"",
            " 1400     tool read path=\"README.md\"",
            " 1600     tool read ok 200 ms, 44 B",
            " 1900     tool exec error 600 ms, 45 B",
            " 5000     assistant \"Done: two files.\"",
            " 5000   run 7d7b1f2c ok in 4.0 s",
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
            "1000   run aaaaaaaa started (replay)",
            "1100   run bbbbbbbb started (replay)",
            "1200   run aaaaaaaa (replay)",
            "1200     tool exec (replay)",
        ]
    );
}
