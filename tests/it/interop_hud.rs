//! Continuity of the HUD feed against a REAL OpenClaw Gateway :
//! one real model run that calls `exec` (exiting 3) and then `read`, through
//! the mock provider `clawmux_mock::provider` on loopback, watched on
//! `/v1/hud` live. `/v1/hud?history=1` must equal the live feed field by
//! field but `id` and `replay` (tool arguments and results included), and a
//! reader that drops right after the run's `turn_start` and resumes with the
//! bare `id:` it got (`?after_seq=`, while the run goes on, and
//! `Last-Event-ID`, after it ended) must get the rest of the run, its
//! `turn_end` included.
//!
//! Run by `.ci/interop` (`--ignored`); skips with a note when the peers
//! script is absent.

use std::time::{Duration, Instant};

use crate::differential::Conn;
use crate::http_api::*;
use crate::interop_diff::{connect_params, use_provider};
use crate::real_gateway::*;
use serde_json::{json, Value};

/// Patience for one answer from the real gateway on a loaded 2-core box.
const ANSWER: Duration = Duration::from_secs(30);
/// Patience for the next HUD record of a run (the first turn warms the
/// agent runtime up: ~10 s here).
const RUN: Duration = Duration::from_secs(90);

/// The exec call: writes the file the read call reads, prints, exits 3 (a
/// failed command: `ok:false`, one rule live and in history).
const EXEC_COMMAND: &str =
    "printf 'Remember to water the plants.\\n' > notes.txt; echo wrote notes.txt; exit 3";

/// One record of a `/v1/hud` stream.
#[derive(Debug)]
enum Hud {
    /// A HUD event and its `id:` line, if any.
    Event(Option<String>, Value),
    /// A named broker record (`clawmux.gap`, `clawmux.close`).
    Broker(String),
}

async fn next_hud(sse: &mut Sse) -> Hud {
    loop {
        let record = match sse.next_item_within(RUN).await {
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
            .unwrap_or_else(|| panic!("a HUD record has data: {record}"));
        return Hud::Event(id, serde_json::from_str(data).expect("HUD data is JSON"));
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
/// fields a history event may differ in (`id`, `replay`).
fn of_run(records: &[Hud], run: &str) -> Vec<Value> {
    records
        .iter()
        .filter_map(|r| match r {
            Hud::Event(_, e) if e["correlationId"] == run || e["parentId"] == run => {
                let mut e = e.clone();
                let map = e.as_object_mut().expect("a HUD event is an object");
                map.remove("id");
                map.remove("replay");
                Some(e)
            }
            _ => None,
        })
        .collect()
}

/// The tool events among `events`.
fn tools(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["tool"].is_string())
        .cloned()
        .collect()
}

async fn stream(socket: &std::path::Path, path: &str, headers: &[(&str, &str)]) -> Sse {
    open_events(socket, path, headers)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e:?}"))
}

async fn req(c: &mut Conn, id: &str, method: &str, params: Value) -> Value {
    c.send(&json!({"type": "req", "id": id, "method": method, "params": params}))
        .await;
    c.response(id, ANSWER).await
}

#[tokio::test]
#[ignore = "needs a real OpenClaw gateway (~1 GB, installed from npm): run by .ci/interop"]
async fn hud_history_equals_live_and_resumes_with_the_bare_id() {
    if !peers_present("hud_history_equals_live_and_resumes_with_the_bare_id") {
        return;
    }
    let t_all = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let provider =
        clawmux_mock::provider::MockProvider::start(clawmux_mock::provider::ProviderConfig {
            tool_name: Some("exec".into()),
            tool_arguments: json!({"command": EXEC_COMMAND}),
            then_tools: vec![("read".into(), json!({"path": "notes.txt"}))],
            ..Default::default()
        })
        .await
        .expect("provider starts");
    let port = free_port();
    let mut gw = Gateway::start(port, dir.path().join("gateway.log"));
    gw.wait_ready(FIRST_START).await;
    use_provider(port, &provider).await;
    let broker = clawmux::RunningBroker::start(broker_settings(&dir.path().join("b"), port, TOKEN))
        .await
        .expect("broker starts");
    let sock = broker.socket_path().to_owned();
    wait_phase(&sock, "ready", ANSWER, &gw).await;
    eprintln!(
        "interop-hud: gateway and broker ready after {:.1} s",
        t_all.elapsed().as_secs_f64()
    );

    // Two live readers, then the run (started through the broker).
    let t_run = Instant::now();
    let mut live = stream(&sock, "/v1/hud", &[]).await;
    let mut dropping = stream(&sock, "/v1/hud", &[]).await;
    let mut c = Conn::unix(&sock, "/ws").await;
    c.until(ANSWER, "connect.challenge", |v| {
        v["event"] == "connect.challenge"
    })
    .await;
    let hello = req(&mut c, "connect-1", "connect", connect_params()).await;
    assert_eq!(hello["ok"], true, "{hello}");
    let run = format!("hud-interop-{}", uuid::Uuid::new_v4());
    let res = req(
        &mut c,
        "chat-1",
        "chat.send",
        json!({"sessionKey": "agent:main:hud-interop", "message": "please [[use-a-tool]]",
            "idempotencyKey": run}),
    )
    .await;
    assert_eq!(res["ok"], true, "chat.send: {res}");

    // The dropping reader goes away right after the run's turn_start, with
    // the last id: it got (what an EventSource sends as Last-Event-ID).
    let mut last_id = None;
    let start_had_id = loop {
        if let Hud::Event(id, e) = next_hud(&mut dropping).await {
            let had = id.is_some();
            if id.is_some() {
                last_id = id;
            }
            if e["event"] == "turn_start" && e["correlationId"] == run.as_str() {
                break had;
            }
        }
    };
    drop(dropping);
    let resume_id = last_id.expect("an id: by the run's turn_start");
    assert!(
        resume_id.bytes().all(|b| b.is_ascii_digit()),
        "a bare cursor: {resume_id}"
    );
    // Resumed at once, while the run goes on.
    let mut by_query = stream(&sock, &format!("/v1/hud?after_seq={resume_id}"), &[]).await;

    let live = hud_until_turn_end(&mut live, &run).await;
    c.until(RUN, "chat final", |v| {
        v["event"] == "chat"
            && v["payload"]["runId"] == run.as_str()
            && v["payload"]["state"] == "final"
    })
    .await;
    eprintln!(
        "interop-hud: the run (exec, read) took {:.1} s",
        t_run.elapsed().as_secs_f64()
    );
    let live_run = of_run(&live, &run);
    let live_tools = tools(&live_run);
    let exec_end = live_tools
        .iter()
        .find(|e| e["event"] == "tool_end" && e["tool"] == "exec");
    let read_end = live_tools
        .iter()
        .find(|e| e["event"] == "tool_end" && e["tool"] == "read");
    assert!(
        live_tools.iter().any(|e| e["event"] == "tool_start"
            && e["tool"] == "exec"
            && e["args"]["command"] == EXEC_COMMAND)
            && live_tools.iter().any(|e| e["event"] == "tool_start"
                && e["tool"] == "read"
                && e["args"]["path"] == "notes.txt"),
        "live tool_start with args: {live_tools:#?}"
    );
    let exec_end = exec_end.unwrap_or_else(|| panic!("an exec tool_end: {live_tools:#?}"));
    let read_end = read_end.unwrap_or_else(|| panic!("a read tool_end: {live_tools:#?}"));
    assert_eq!(exec_end["result"]["ok"], false, "exit 3: {exec_end}");
    assert_eq!(exec_end["result"]["exitCode"], 3, "{exec_end}");
    assert!(
        exec_end["result"]["stdout"]
            .as_str()
            .is_some_and(|s| s.contains("wrote notes.txt")),
        "{exec_end}"
    );
    assert_eq!(read_end["result"]["ok"], true, "{read_end}");
    assert!(
        read_end["result"]["text"]
            .as_str()
            .is_some_and(|s| s.contains("Remember to water the plants.")),
        "{read_end}"
    );

    // History: field by field what was live, every tool call's args and
    // result first, then the whole run.
    let mut history = stream(&sock, "/v1/hud?history=1", &[]).await;
    let replayed = hud_until_turn_end(&mut history, &run).await;
    let not_replay: Vec<&Hud> = replayed
        .iter()
        .filter(|r| matches!(r, Hud::Event(_, e) if e["replay"] != true))
        .collect();
    assert!(
        not_replay.is_empty(),
        "history marks replay: {not_replay:#?}"
    );
    let replayed_run = of_run(&replayed, &run);
    assert_eq!(
        tools(&replayed_run),
        live_tools,
        "tool calls in /v1/hud?history=1 vs live"
    );
    assert_eq!(replayed_run, live_run, "/v1/hud?history=1 vs live");

    // Resuming with the bare id: the rest of the run, turn_end included,
    // nothing sent twice, no broker records.
    let rest: Vec<Value> = live_run
        .iter()
        .skip_while(|e| e["event"] != "turn_start")
        .skip(1)
        .cloned()
        .collect();
    assert!(rest.last().is_some_and(|e| e["event"] == "turn_end"));
    let got = hud_until_turn_end(&mut by_query, &run).await;
    let by_header = {
        let mut s = stream(&sock, "/v1/hud", &[("last-event-id", resume_id.as_str())]).await;
        hud_until_turn_end(&mut s, &run).await
    };
    for (how, got) in [
        ("after_seq (during the run)", got),
        ("Last-Event-ID (after it)", by_header),
    ] {
        let broker_records: Vec<&String> = got
            .iter()
            .filter_map(|r| match r {
                Hud::Broker(name) => Some(name),
                Hud::Event(..) => None,
            })
            .collect();
        assert!(broker_records.is_empty(), "{how}: {broker_records:?}");
        assert_eq!(
            of_run(&got, &run),
            rest,
            "resumed by {how} from {resume_id}"
        );
    }
    eprintln!(
        "interop-hud: {} HUD events of the run ({} of tools) equal in history; resumed from id {resume_id} (turn_start {} its own id) by after_seq and Last-Event-ID; done in {:.1} s",
        live_run.len(),
        live_tools.len(),
        if start_had_id { "carried" } else { "did not carry" },
        t_all.elapsed().as_secs_f64()
    );
    drop(broker);
    drop(gw);
}
