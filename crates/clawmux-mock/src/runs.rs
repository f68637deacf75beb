//! Scripted agent runs: the `agent`/`chat` event stream a real gateway emits
//! for `chat.send`, `agent` and the `--demo` mode (gateway-protocol.md §9),
//! plus the transcripts `chat.history` serves.
//!
//! Lock order: `Inner::chats` before `Inner::conns`. Every run step checks
//! that the run is still active and broadcasts while holding `chats`, so an
//! abort can never be overtaken by a late delta.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::state::{lock, now_ms, res_frame, until_shutdown, Inner};

/// Who started a run and what it answers when done.
#[derive(Clone, Debug)]
pub(crate) enum RunKind {
    /// `chat.send`: output only as events.
    Chat,
    /// `agent`: a second `res` with the same request id when the run ends.
    Agent { conn: u64, request_id: Value },
    /// A run nobody asked for (demo mode, `MockGateway::simulate_run`).
    Scripted,
}

/// One run, registered before its ack is sent so duplicates see it.
#[derive(Clone, Debug)]
pub(crate) struct RunRecord {
    pub run_id: String,
    pub session_key: String,
    pub owner_conn: Option<u64>,
    pub owner_device: Option<String>,
    pub active: bool,
    pub kind: RunKind,
}

/// Process-global chat state (sessions and the idempotency dedupe are global
/// on the real gateway too, §4.2).
#[derive(Debug, Default)]
pub(crate) struct ChatState {
    /// Transcript per session key, oldest first.
    pub history: HashMap<String, Vec<Value>>,
    /// Last activity per session key (ms), for `sessions.list`.
    pub updated_at: HashMap<String, i64>,
    /// Runs keyed by `"chat:<idempotencyKey>"` / `"agent:<idempotencyKey>"`.
    pub runs: HashMap<String, RunRecord>,
}

impl ChatState {
    /// Appends a transcript message, returning it.
    fn append(&mut self, session_key: &str, message: Value) -> Value {
        self.history
            .entry(session_key.to_string())
            .or_default()
            .push(message.clone());
        self.updated_at.insert(session_key.to_string(), now_ms());
        message
    }
}

/// What to play.
#[derive(Clone, Debug)]
pub(crate) struct RunScript {
    pub run_id: String,
    pub session_key: String,
    pub reply: String,
    /// Connection that receives the `stream:"tool"` events (started the run
    /// and advertised `caps:["tool-events"]`).
    pub tool_recipient: Option<u64>,
    /// Pause between events.
    pub step_delay: Duration,
}

/// The canonical form of a session key, as the gateway uses it in events,
/// transcripts and subscriptions: `main` → `agent:main:main`, any other
/// key without an `agent:` prefix → `agent:main:<key>`.
pub(crate) fn canonical_session_key(key: &str) -> String {
    if key.starts_with("agent:") {
        key.to_string()
    } else {
        format!("agent:main:{key}")
    }
}

/// An assistant transcript message in the shape of chat events (§9).
pub(crate) fn text_message(role: &str, text: &str) -> Value {
    json!({ "role": role, "content": [{ "type": "text", "text": text }], "timestamp": now_ms() })
}

/// The `session.message` payload for a transcript message.
pub(crate) fn session_message_payload(session_key: &str, message: &Value) -> Value {
    json!({ "sessionKey": session_key, "agentId": "main", "message": message })
}

/// Records a user message (plain-string content, as the gateway stores it)
/// and tells `session.message` subscribers. `session_key` is canonical.
pub(crate) fn record_user_message(inner: &Inner, session_key: &str, text: &str) {
    let mut chats = lock(&inner.chats);
    let user = json!({ "role": "user", "content": text, "timestamp": now_ms() });
    let message = chats.append(session_key, user);
    emit_session_message(
        inner,
        session_key,
        &session_message_payload(session_key, &message),
    );
}

/// Sends `session.message` to `sessions.subscribe` subscribers and to the
/// `sessions.messages.subscribe` subscribers of `key` (`server.impl.ts`).
pub(crate) fn emit_session_message(inner: &Inner, key: &str, payload: &Value) {
    let key = canonical_session_key(key);
    inner.broadcast_filtered("session.message", payload, None, false, |c| {
        c.sessions_subscribed || c.message_keys.contains(&key)
    });
}

/// Splits a reply into up to three streaming chunks on word boundaries.
fn chunks(reply: &str) -> Vec<String> {
    let words: Vec<&str> = reply.split_inclusive(' ').collect();
    let per_chunk = words.len().div_ceil(3).max(1);
    words.chunks(per_chunk).map(|c| c.concat()).collect()
}

fn agent_event(run: &RunScript, seq: u64, stream: &str, data: Value) -> Value {
    json!({
        "runId": run.run_id, "seq": seq, "stream": stream, "ts": now_ms(),
        "sessionKey": run.session_key, "agentId": "main", "data": data,
    })
}

/// What a scripted run thinks, in streamed pieces.
const THINKING: [&str; 2] = [
    "The user wants a reply; ",
    "let me check the workspace first.",
];

/// One scripted tool call: name, arguments, result text.
struct ScriptedTool {
    name: &'static str,
    args: &'static str,
    meta: &'static str,
    output: &'static str,
}

/// The tool calls every scripted run makes (in parallel).
const TOOL_CALLS: [ScriptedTool; 2] = [
    ScriptedTool {
        name: "exec",
        args: r#"{"command":"ls"}"#,
        meta: "ls",
        output: "README.md\nsrc\n",
    },
    ScriptedTool {
        name: "read",
        args: r#"{"path":"README.md"}"#,
        meta: "README.md",
        output: "# Workspace\n",
    },
];

/// A tool event's `data` in the real gateway's shape (openclaw 2026.9.6,
/// embedded runner: `start` carries `args`, `result` carries `meta`,
/// `isError` and the tool's `result`).
fn tool_data(phase: &str, tool: &ScriptedTool, call_id: &str) -> Value {
    let mut data = json!({ "phase": phase, "name": tool.name, "toolCallId": call_id });
    if phase == "start" {
        data["args"] = serde_json::from_str(tool.args).unwrap_or(Value::Null);
    } else {
        data["meta"] = json!(tool.meta);
        data["isError"] = json!(false);
        data["result"] = json!({ "content": [{ "type": "text", "text": tool.output }] });
    }
    data
}

/// Delivers a tool-stream event as the gateway does (`server-chat.ts`): as
/// `agent` to the run's tool-events recipient, and as `session.tool` (same
/// payload) to the other `sessions.subscribe` subscribers.
fn emit_tool_event(inner: &Inner, payload: &Value, recipient: Option<u64>) {
    if let Some(conn) = recipient {
        inner.broadcast_filtered("agent", payload, None, false, |c| c.index == conn);
    }
    inner.broadcast_filtered("session.tool", payload, None, true, |c| {
        c.sessions_subscribed && Some(c.index) != recipient
    });
}

/// Plays one step if the run is still active; returns false once aborted.
fn step(inner: &Inner, run_key: &str, play: impl FnOnce(&Inner, &mut ChatState)) -> bool {
    let mut chats = lock(&inner.chats);
    if !chats.runs.get(run_key).is_some_and(|r| r.active) {
        return false;
    }
    play(inner, &mut chats);
    true
}

/// Registers a run under its dedupe key, atomically with the duplicate
/// check. Returns the existing record if the key was already used.
pub(crate) fn try_register(inner: &Inner, run_key: &str, record: RunRecord) -> Option<RunRecord> {
    let mut chats = lock(&inner.chats);
    if let Some(existing) = chats.runs.get(run_key) {
        return Some(existing.clone());
    }
    chats.runs.insert(run_key.to_string(), record);
    None
}

/// Spawns the event stream of a registered run. Call it after queuing the
/// ack, so the requester sees the ack before the first event.
pub(crate) fn spawn_play(inner: &Arc<Inner>, run_key: String, script: RunScript) {
    let inner = inner.clone();
    tokio::spawn(async move { play_run(inner, run_key, script).await });
}

async fn play_run(inner: Arc<Inner>, run_key: String, run: RunScript) {
    let delay = run.step_delay;
    let mut seq = 0u64;
    let mut next_seq = || {
        seq += 1;
        seq
    };
    let pause = || tokio::time::sleep(delay);

    let start = agent_event(
        &run,
        next_seq(),
        "lifecycle",
        json!({ "phase": "start", "startedAt": now_ms() }),
    );
    if !step(&inner, &run_key, |i, _| {
        i.broadcast("agent", &start, None, false)
    }) {
        return;
    }
    // Thinking streams like assistant text: cumulative `text` and an
    // incremental `delta` (openclaw 2026.9.6 emitReasoningStream), broadcast.
    let mut thought = String::new();
    for chunk in THINKING {
        pause().await;
        thought.push_str(chunk);
        let thinking = agent_event(
            &run,
            next_seq(),
            "thinking",
            json!({ "text": thought, "delta": chunk }),
        );
        if !step(&inner, &run_key, |i, _| {
            i.broadcast("agent", &thinking, None, false)
        }) {
            return;
        }
    }
    // Two tool calls in parallel: both start, the second ends first.
    let call_ids: Vec<String> = TOOL_CALLS
        .iter()
        .map(|_| format!("call_{}", uuid::Uuid::new_v4().simple()))
        .collect();
    for (phase, index) in [("start", 0), ("start", 1), ("result", 1), ("result", 0)] {
        pause().await;
        let data = tool_data(phase, &TOOL_CALLS[index], &call_ids[index]);
        let tool = agent_event(&run, next_seq(), "tool", data);
        if !step(&inner, &run_key, |i, _| {
            emit_tool_event(i, &tool, run.tool_recipient)
        }) {
            return;
        }
    }
    let mut text = String::new();
    for chunk in chunks(&run.reply) {
        pause().await;
        text.push_str(&chunk);
        let seq = next_seq();
        let assistant = agent_event(
            &run,
            seq,
            "assistant",
            json!({ "text": text, "delta": chunk }),
        );
        let delta = json!({
            "runId": run.run_id, "sessionKey": run.session_key, "agentId": "main", "seq": seq, "state": "delta",
            "deltaText": chunk, "message": text_message("assistant", &text),
        });
        let sent = step(&inner, &run_key, |i, _| {
            i.broadcast("agent", &assistant, None, false);
            i.broadcast("chat", &delta, None, true);
        });
        if !sent {
            return;
        }
    }
    pause().await;
    let final_seq = next_seq();
    let end = agent_event(
        &run,
        next_seq(),
        "lifecycle",
        json!({ "phase": "end", "endedAt": now_ms() }),
    );
    let mut kind = None;
    let finished = step(&inner, &run_key, |i, chats| {
        let message = chats.append(&run.session_key, text_message("assistant", &text));
        let final_event = json!({
            "runId": run.run_id, "sessionKey": run.session_key, "agentId": "main", "seq": final_seq,
            "state": "final", "message": message,
        });
        i.broadcast("chat", &final_event, None, false);
        emit_session_message(
            i,
            &run.session_key,
            &session_message_payload(&run.session_key, &message),
        );
        i.broadcast("agent", &end, None, false);
        if let Some(r) = chats.runs.get_mut(&run_key) {
            r.active = false;
            kind = Some(r.kind.clone());
        }
    });
    if finished {
        if let Some(RunKind::Agent { conn, request_id }) = kind {
            let summary = format!("completed: {text}");
            let payload = json!({ "runId": run.run_id, "status": "ok", "summary": summary,
                "result": { "payloads": [{ "text": text }] } });
            send_final_agent_response(&inner, conn, &request_id, payload);
        }
    }
}

/// The second `res` of an `agent` request (suppressed while `silent`).
fn send_final_agent_response(inner: &Inner, conn: u64, request_id: &Value, payload: Value) {
    if inner.faults().silent {
        return;
    }
    inner.send_frame(conn, res_frame(request_id, Ok(&payload)));
}

/// Aborts the active runs of (canonical) `session_key` (optionally only `run_id`) that
/// the requester may abort: its own runs (same connection or device) or any
/// run for an admin. Returns the aborted run ids.
pub(crate) fn abort_runs(
    inner: &Inner,
    session_key: &str,
    run_id: Option<&str>,
    requester: u64,
    requester_device: Option<&str>,
    is_admin: bool,
) -> Vec<String> {
    let mut chats = lock(&inner.chats);
    let mut aborted = Vec::new();
    for record in chats.runs.values_mut() {
        let owned = record.owner_conn == Some(requester)
            || (requester_device.is_some() && record.owner_device.as_deref() == requester_device);
        let matches = record.active
            && record.session_key == session_key
            && run_id.is_none_or(|id| record.run_id == id)
            && (owned || is_admin);
        if !matches {
            continue;
        }
        record.active = false;
        let chat = json!({ "runId": record.run_id, "sessionKey": session_key, "agentId": "main",
            "state": "aborted", "stopReason": "user" });
        inner.broadcast("chat", &chat, None, false);
        let end = json!({ "runId": record.run_id, "stream": "lifecycle", "ts": now_ms(),
            "sessionKey": session_key, "agentId": "main", "data": { "phase": "end", "aborted": true } });
        inner.broadcast("agent", &end, None, false);
        if let RunKind::Agent { conn, request_id } = &record.kind {
            let payload =
                json!({ "runId": record.run_id, "status": "aborted", "summary": "aborted" });
            send_final_agent_response(inner, *conn, request_id, payload);
        }
        aborted.push(record.run_id.clone());
    }
    aborted
}

/// Starts a scripted run nobody requested (demo mode, tests) on `session_key`.
pub(crate) fn simulate_run(
    inner: &Arc<Inner>,
    session_key: &str,
    reply: &str,
    step_delay: Duration,
) -> String {
    let session_key = &canonical_session_key(session_key);
    let run_id = uuid::Uuid::new_v4().to_string();
    let record = RunRecord {
        run_id: run_id.clone(),
        session_key: session_key.to_string(),
        owner_conn: None,
        owner_device: None,
        active: true,
        kind: RunKind::Scripted,
    };
    let script = RunScript {
        run_id: run_id.clone(),
        session_key: session_key.to_string(),
        reply: reply.to_string(),
        tool_recipient: None,
        step_delay,
    };
    let run_key = format!("scripted:{run_id}");
    try_register(inner, &run_key, record);
    spawn_play(inner, run_key, script);
    run_id
}

/// Demo runs stream at the real gateway's pace: chat deltas are throttled to
/// at most one per 150 ms (gateway-protocol.md §9).
const DEMO_STEP_DELAY: Duration = Duration::from_millis(150);

/// Demo mode: a scripted run on the main session every `demo_interval`, so
/// a newly attached client sees traffic without sending anything.
pub(crate) async fn demo_loop(inner: Arc<Inner>) {
    let mut shutdown = inner.shutdown.subscribe();
    let every = inner.cfg.demo_interval.max(Duration::from_millis(1));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            _ = until_shutdown(&mut shutdown) => return,
            _ = ticker.tick() => {}
        }
        let n = inner.demo_runs.fetch_add(1, Ordering::Relaxed) + 1;
        let reply = format!("Hello from the mock gateway (run {n})");
        let step = DEMO_STEP_DELAY.min(every / 10);
        simulate_run(&inner, "agent:main:main", &reply, step);
    }
}

/// Periodic `health` broadcast with a bumped `stateVersion.health`.
pub(crate) async fn health_loop(inner: Arc<Inner>, every: Duration) {
    let mut shutdown = inner.shutdown.subscribe();
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            _ = until_shutdown(&mut shutdown) => return,
            _ = ticker.tick() => {}
        }
        if inner.faults().silent {
            continue;
        }
        let summary = super::methods::health_summary(&inner);
        *lock(&inner.last_health) = Some(summary.clone());
        let sv = inner.bump_health();
        inner.broadcast("health", &summary, Some(sv), false);
    }
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_the_reply() {
        let reply = "Hello from the mock gateway (run 1)";
        let parts = chunks(reply);
        assert!(parts.len() <= 3 && !parts.is_empty());
        assert_eq!(parts.concat(), reply);
        assert_eq!(chunks("one").concat(), "one");
    }
}
