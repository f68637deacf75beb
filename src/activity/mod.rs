//! The activity projection: what agents are doing, built by a *client* from
//! the raw gateway events the broker publishes (the broker keeps no UI
//! model). `clawmux top` draws it, `clawmux tail --tree` prints it as
//! indented lines and `clawmux tail --hud` as JSON lines ([`render`]).
//!
//! Per session, newest run first: a run → its thinking, its tool calls
//! (name, arguments, duration, ok/error, result size) and its assistant
//! output → its end (ok, error, aborted). The event shapes are the real
//! gateway's (openclaw 2026.9.6, `server-chat.ts` and the embedded runner;
//! gateway-protocol.md §9):
//!
//! - `agent` `stream:"lifecycle"`, `data.phase` `start` | `end` | `error`
//!   (`data.error`, `data.aborted`, `data.stopReason`);
//! - `agent` `stream:"thinking"` / `"assistant"`, `data.text` cumulative and
//!   `data.delta` incremental;
//! - `agent` `stream:"tool"` (to the run's tool-events recipients) and
//!   `session.tool` (same payload, to session subscribers): `data.phase`
//!   `start` (`name`, `toolCallId`, `args`, `parentToolCallId`) | `update` |
//!   `result` (`isError`, `result`, `meta`);
//! - `chat` `state` `delta` | `final` | `aborted` | `error` (`errorMessage`).
//!
//! A run may start before the client was watching, and may end by its
//! lifecycle event, its terminal chat event, or both, in either order: the
//! first end ends it, a later one only adds what it knows.

pub mod hud;
pub mod render;

use std::collections::HashMap;

use serde_json::{json, Value};

/// Runs kept. Past this the oldest *ended* run is forgotten (a running one
/// is kept until a gap or an upstream reconnect: [`Activity::forget_unfinished`]).
pub const MAX_RUNS: usize = 200;
/// Thinking segments and tool calls kept per run; later ones are counted in
/// [`Run::dropped_items`] and shown as a number, not kept.
pub const MAX_ITEMS_PER_RUN: usize = 256;
/// Characters of assistant output or thinking kept per node (the end of the
/// text: the newest part is what a watcher wants to see).
pub const MAX_TEXT_CHARS: usize = 16 * 1024;
/// Bytes (as JSON) of a tool call's arguments or result kept; past it the
/// longest strings inside are cut ([`bound`]).
pub const MAX_VALUE_BYTES: usize = 16 * 1024;

/// One raw event as a client received it.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// The gateway event name (`agent`, `chat`, `session.tool`, …).
    pub name: &'a str,
    /// Its payload.
    pub payload: &'a Value,
    /// When the client received it (ms) if it was live; `None` for an event
    /// replayed from the broker's log (its arrival says nothing of when it
    /// happened). Used only for events that carry no time of their own.
    pub received_ms: Option<u64>,
}

/// How a run ended, or that it has not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    Ok,
    Aborted,
    Error(String),
}

impl RunStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Ok => "ok",
            RunStatus::Aborted => "aborted",
            RunStatus::Error(_) => "error",
        }
    }
}

/// A stretch of thinking: from its first `thinking` event to the next event
/// of another kind in the same run.
#[derive(Debug, Clone, PartialEq)]
pub struct Thinking {
    /// `<runId>:think:<n>`, n from 1 (stable, for views).
    pub id: String,
    /// A UUID derived from `id` ([`thinking_correlation_id`]; the HUD
    /// `correlationId`).
    pub correlation_id: String,
    pub text: String,
    /// The gateway's time of its first event.
    pub started_ms: Option<u64>,
    /// The time of the event that ended it, when known.
    pub ended_ms: Option<u64>,
    pub done: bool,
}

/// One tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub call_id: String,
    pub name: String,
    /// The arguments as the gateway sent them (bounded: [`MAX_VALUE_BYTES`]).
    pub args: Value,
    /// The call this one runs inside (`parentToolCallId`), if any.
    pub parent_call_id: Option<String>,
    pub started_ms: Option<u64>,
    pub ended_ms: Option<u64>,
    /// `isError` of the result (`None` while running, or when the run ended
    /// before the result: [`ToolCall::interrupted`]).
    pub is_error: Option<bool>,
    /// The result as the gateway sent it (bounded: [`MAX_VALUE_BYTES`]).
    pub result: Value,
    /// `meta` of the result, if sent.
    pub meta: Option<String>,
    /// Bytes of the result as JSON, before bounding.
    pub result_bytes: Option<usize>,
    /// Bytes of the result's text (its `content` text parts), before bounding.
    pub text_bytes: Option<usize>,
    /// Strings of `args` or `result` were cut to fit [`MAX_VALUE_BYTES`].
    pub cut: bool,
    /// The run ended before this call's result arrived.
    pub interrupted: bool,
}

impl ToolCall {
    /// Whether the call succeeded (`None` while running or interrupted),
    /// by one rule for every view, live and history: the result is not an
    /// error, and an `exec` exited 0 (when its result says how it exited).
    pub fn ok(&self) -> Option<bool> {
        let failed_exit = self.name == "exec"
            && self.result["details"]["exitCode"]
                .as_i64()
                .is_some_and(|code| code != 0);
        self.is_error.map(|error| !error && !failed_exit)
    }

    pub fn ended(&self) -> bool {
        self.is_error.is_some() || self.interrupted
    }

    /// From start to end (or to `now` while running), when both are known.
    pub fn duration_ms(&self, now: Option<u64>) -> Option<u64> {
        let end = if self.ended() { self.ended_ms } else { now };
        Some(end?.saturating_sub(self.started_ms?))
    }
}

/// A child of a run, in the order it began.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Thinking(Thinking),
    Tool(ToolCall),
}

/// One agent run.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub id: String,
    pub session_key: String,
    /// When it started, by the gateway (`startedAt`, or the lifecycle
    /// start's `ts`); `None` when the start was not seen and no later event
    /// said it.
    pub started_ms: Option<u64>,
    /// When it ended, by the gateway (`endedAt`, `ts`, `message.timestamp`)
    /// or by its live arrival; `None` while running or when not known.
    pub ended_ms: Option<u64>,
    pub status: RunStatus,
    pub items: Vec<Item>,
    /// Items past [`MAX_ITEMS_PER_RUN`], not kept.
    pub dropped_items: usize,
    /// The assistant's output so far (the final message once it ended).
    pub output: String,
    /// The newest time known of it (ms; 0 when none), for ordering.
    pub last_ms: u64,
    /// Thinking segments begun, for their ids.
    thinks: usize,
}

impl Run {
    /// Whether the run is still going.
    pub fn running(&self) -> bool {
        self.status == RunStatus::Running
    }

    /// From start to end (or to `now` while running), when both are known.
    pub fn duration_ms(&self, now: Option<u64>) -> Option<u64> {
        let end = if self.running() { now } else { self.ended_ms };
        Some(end?.saturating_sub(self.started_ms?))
    }

    fn open_thinking(&mut self) -> Option<&mut Thinking> {
        match self.items.last_mut() {
            Some(Item::Thinking(t)) if !t.done => Some(t),
            _ => None,
        }
    }

    fn tool_mut(&mut self, call_id: &str) -> Option<&mut ToolCall> {
        self.items.iter_mut().find_map(|i| match i {
            Item::Tool(t) if t.call_id == call_id => Some(t),
            _ => None,
        })
    }

    fn push_item(&mut self, item: Item) -> bool {
        if self.items.len() >= MAX_ITEMS_PER_RUN {
            self.dropped_items += 1;
            return false;
        }
        self.items.push(item);
        true
    }

    fn saw(&mut self, at: Option<u64>) {
        if let Some(at) = at {
            self.last_ms = self.last_ms.max(at);
        }
    }
}

/// What one event changed, for the line-oriented renderings
/// ([`hud::hud_event`], [`render::TreePrinter`]). Times are the gateway's
/// (or a live event's arrival); `None` where neither is known.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    TurnStart {
        run_id: String,
        session_key: String,
        ts: Option<u64>,
    },
    ThinkStart {
        run_id: String,
        think_id: String,
        correlation_id: String,
        ts: Option<u64>,
    },
    ThinkEnd {
        run_id: String,
        think_id: String,
        correlation_id: String,
        ts: Option<u64>,
        duration_ms: Option<u64>,
        text: String,
    },
    ToolStart {
        run_id: String,
        call: ToolCall,
    },
    ToolEnd {
        run_id: String,
        call: ToolCall,
    },
    TurnEnd {
        run_id: String,
        session_key: String,
        ts: Option<u64>,
        duration_ms: Option<u64>,
        status: RunStatus,
        output: String,
    },
    /// Something the broker saw happen at once (HUD `received`): a message
    /// sent, an abort, a session reset, the upstream back after an outage.
    Received {
        subtype: &'static str,
        label: String,
        payload: Value,
        ts: Option<u64>,
    },
}

/// The projection: every run seen, by session.
#[derive(Debug, Clone, Default)]
pub struct Activity {
    runs: HashMap<String, Run>,
    /// Runs set aside by [`Activity::forget_unfinished`]: not shown, but a
    /// later event of one brings it back as it was (no second `turn_start`).
    set_aside: HashMap<String, Run>,
    /// Events applied, for rates.
    pub events_seen: u64,
    /// The reader gets no tool streams (not an observer): tool calls are
    /// taken from `item` events instead ([`Activity::without_tool_streams`]).
    items_only: bool,
}

/// An event's own time: `ts`, else its message's `timestamp`, else its
/// live arrival.
fn event_time(p: &Value, received_ms: Option<u64>) -> Option<u64> {
    positive(&p["ts"])
        .or_else(|| positive(&p["message"]["timestamp"]))
        .or(received_ms)
}

fn positive(v: &Value) -> Option<u64> {
    v.as_u64().filter(|t| *t > 0)
}

impl Activity {
    /// The projection for a reader that receives tool streams (an
    /// observer: `/v1/events?tool_events=all`, `/v1/hud`): tool calls come
    /// from the tool stream (arguments, results); `item` events, which
    /// say less and may come first, are not used.
    pub fn new() -> Self {
        Self::default()
    }

    /// The projection for a reader that receives no tool streams: tool
    /// calls come from `item` events (name, times, status; no arguments or
    /// results). Live and history alike: which events a reader gets, not
    /// when, decides.
    pub fn without_tool_streams() -> Self {
        Activity {
            items_only: true,
            ..Self::default()
        }
    }

    /// One run by id.
    pub fn run(&self, run_id: &str) -> Option<&Run> {
        self.runs.get(run_id)
    }

    /// Sessions, most recently active first, each with its runs newest first.
    pub fn sessions(&self) -> Vec<(String, Vec<&Run>)> {
        let mut by_key: HashMap<&str, Vec<&Run>> = HashMap::new();
        for run in self.runs.values() {
            by_key.entry(&run.session_key).or_default().push(run);
        }
        let order = |r: &Run| r.started_ms.unwrap_or(r.last_ms);
        let mut sessions: Vec<(String, Vec<&Run>)> = by_key
            .into_iter()
            .map(|(key, mut runs)| {
                runs.sort_by(|a, b| (order(b), &b.id).cmp(&(order(a), &a.id)));
                (key.to_owned(), runs)
            })
            .collect();
        let last = |runs: &[&Run]| runs.iter().map(|r| r.last_ms).max().unwrap_or(0);
        sessions.sort_by(|a, b| last(&b.1).cmp(&last(&a.1)).then(a.0.cmp(&b.0)));
        sessions
    }

    /// Runs still going.
    pub fn running(&self) -> usize {
        self.runs.values().filter(|r| r.running()).count()
    }

    /// Sets aside the runs whose end was not seen: after a gap in the
    /// events or an upstream reconnect their end may have been missed, and
    /// they would show as running forever. A later event of one brings it
    /// back as it was, so a run seen across a gap (a broker restart) has
    /// one `turn_start` and one `turn_end`. At most [`MAX_RUNS`] are kept
    /// aside (the oldest go first).
    pub fn forget_unfinished(&mut self) {
        let unfinished: Vec<String> = self
            .runs
            .values()
            .filter(|r| r.running())
            .map(|r| r.id.clone())
            .collect();
        for id in unfinished {
            if let Some(run) = self.runs.remove(&id) {
                self.set_aside.insert(id, run);
            }
        }
        if self.set_aside.len() > MAX_RUNS {
            let mut by_age: Vec<(u64, String)> = self
                .set_aside
                .values()
                .map(|r| (r.last_ms, r.id.clone()))
                .collect();
            by_age.sort();
            let excess = self.set_aside.len() - MAX_RUNS;
            for (_, id) in by_age.into_iter().take(excess) {
                self.set_aside.remove(&id);
            }
        }
    }

    /// Applies one event; returns what it changed (nothing for events that
    /// are not about runs).
    pub fn apply(&mut self, ev: Observed<'_>) -> Vec<Change> {
        self.events_seen += 1;
        let p = ev.payload;
        let at = event_time(p, ev.received_ms);
        if ev.name == "clawmux.upstream" {
            return self.upstream(p, at);
        }
        let Some(run_id) = p["runId"].as_str().filter(|r| !r.is_empty()) else {
            return Vec::new();
        };
        let mut changes = Vec::new();
        match ev.name {
            "agent" | "session.tool" => {
                let data = &p["data"];
                let stream = match ev.name {
                    "session.tool" => "tool",
                    _ => p["stream"].as_str().unwrap_or(""),
                };
                match stream {
                    "lifecycle" => {
                        let phase = data["phase"].as_str().unwrap_or("");
                        let started = positive(&data["startedAt"]);
                        let start_at = if phase == "start" {
                            started.or(at)
                        } else {
                            started
                        };
                        let run = self.run_entry(run_id, p, start_at, at, &mut changes);
                        if run.started_ms.is_none() {
                            run.started_ms = start_at;
                        }
                        let end_at = positive(&data["endedAt"]).or(at);
                        match phase {
                            "end" if data["aborted"] == true => {
                                end_run(run, end_at, RunStatus::Aborted, &mut changes)
                            }
                            "end" => end_run(run, end_at, RunStatus::Ok, &mut changes),
                            "error" => {
                                let message = data["error"].as_str().unwrap_or("error").to_owned();
                                end_run(run, end_at, RunStatus::Error(message), &mut changes)
                            }
                            _ => {}
                        }
                    }
                    "thinking" => {
                        let run = self.run_entry(run_id, p, None, at, &mut changes);
                        if !run.running() {
                            return changes;
                        }
                        let text = data["text"].as_str().map(str::to_owned);
                        if run.open_thinking().is_none() {
                            run.thinks += 1;
                            let think_id = format!("{}:think:{}", run.id, run.thinks);
                            let correlation_id = thinking_correlation_id(&think_id);
                            let begun = run.push_item(Item::Thinking(Thinking {
                                id: think_id.clone(),
                                correlation_id: correlation_id.clone(),
                                text: String::new(),
                                started_ms: at,
                                ended_ms: None,
                                done: false,
                            }));
                            if begun {
                                changes.push(Change::ThinkStart {
                                    run_id: run.id.clone(),
                                    think_id,
                                    correlation_id,
                                    ts: at,
                                });
                            }
                        }
                        if let Some(t) = run.open_thinking() {
                            match (text, data["delta"].as_str()) {
                                (Some(text), _) => t.text = text,
                                (None, Some(delta)) => t.text.push_str(delta),
                                (None, None) => {}
                            }
                            keep_tail(&mut t.text);
                        }
                    }
                    "assistant" => {
                        let run = self.run_entry(run_id, p, None, at, &mut changes);
                        if !run.running() {
                            return changes;
                        }
                        close_thinking(run, at, &mut changes);
                        match (data["text"].as_str(), data["delta"].as_str()) {
                            (Some(text), _) => run.output = text.to_owned(),
                            (None, Some(delta)) => run.output.push_str(delta),
                            (None, None) => {}
                        }
                        keep_tail(&mut run.output);
                    }
                    "tool" => self.apply_tool(run_id, p, at, &mut changes),
                    // A tool call's item, for a reader without tool streams
                    // (the tool stream says more: arguments, result). The
                    // same rule live and in history.
                    "item" if data["kind"] == "tool" && self.items_only => {
                        self.apply_tool_item(run_id, p, at, &mut changes)
                    }
                    // Other streams (`run_status`, `usage`, `item`, …) say
                    // nothing the tree shows: they do not make a run appear.
                    _ => {
                        if let Some(run) = self.runs.get_mut(run_id) {
                            run.saw(at);
                        }
                    }
                }
            }
            "chat" => {
                let state = p["state"].as_str().unwrap_or("");
                if !matches!(state, "delta" | "final" | "aborted" | "error") {
                    // `status` (preparing, queued, …): not yet the run proper.
                    if let Some(run) = self.runs.get_mut(run_id) {
                        run.saw(at);
                    }
                    return changes;
                }
                let run = self.run_entry(run_id, p, None, at, &mut changes);
                let text = message_text(&p["message"]);
                if let Some(text) = &text {
                    if state == "final" || (state == "delta" && run.running()) {
                        run.output = text.clone();
                        keep_tail(&mut run.output);
                    }
                }
                match state {
                    // A run aborted while queued ends with a final that
                    // carries no message.
                    "final" if p["message"].is_null() && run.running() => {
                        end_run(run, at, RunStatus::Aborted, &mut changes)
                    }
                    "final" => end_run(run, at, RunStatus::Ok, &mut changes),
                    "aborted" => end_run(run, at, RunStatus::Aborted, &mut changes),
                    "error" => {
                        let message = p["errorMessage"].as_str().unwrap_or("error").to_owned();
                        end_run(run, at, RunStatus::Error(message), &mut changes)
                    }
                    _ => {}
                }
            }
            _ => {}
        }
        self.evict();
        changes
    }

    /// `clawmux.upstream`: the gateway session is back after an outage.
    /// What happened meanwhile is unknown: runs not seen ending are forgotten.
    fn upstream(&mut self, p: &Value, at: Option<u64>) -> Vec<Change> {
        if p["phase"] != "ready" || p["reason"] != "reconnected" {
            return Vec::new();
        }
        self.forget_unfinished();
        let mut payload = json!({});
        if let Some(v) = p["serverVersion"].as_str() {
            payload["serverVersion"] = json!(v);
        }
        vec![Change::Received {
            subtype: "reconnect",
            label: "reconnected — the gateway session is back".into(),
            payload,
            ts: at,
        }]
    }

    /// A request the broker sent to the gateway (`method`, `params`), at
    /// `at`: the HUD's `received` events for a message sent (`chat.send`,
    /// with a preview), an abort (`chat.abort`, `/stop`) and a session
    /// reset (`sessions.reset`, `/new`, `/reset`). Other requests change
    /// nothing.
    pub fn apply_request(&mut self, method: &str, params: &Value, at: u64) -> Vec<Change> {
        let session = params["sessionKey"].as_str().or(params["key"].as_str());
        let with_session = |mut payload: Value| {
            if let Some(key) = session {
                payload["sessionKey"] = json!(key);
            }
            payload
        };
        let received = |subtype, label: &str, payload| {
            vec![Change::Received {
                subtype,
                label: label.to_owned(),
                payload,
                ts: Some(at),
            }]
        };
        match method {
            "chat.send" => {
                let text = match &params["message"] {
                    Value::String(s) => s.clone(),
                    other => message_text(other).unwrap_or_default(),
                };
                let command = text.trim().to_ascii_lowercase();
                if command == "/new" || command == "/reset" {
                    return received(
                        "new_session",
                        &format!("{command} received — resetting session"),
                        with_session(json!({})),
                    );
                }
                if command == "/stop" {
                    return received(
                        "stop",
                        "stop received — aborting turn",
                        with_session(json!({})),
                    );
                }
                let preview = render::cut(&render::one_line(&text), render::PREVIEW_CHARS);
                received(
                    "message",
                    "message received",
                    with_session(json!({"preview": preview})),
                )
            }
            "chat.abort" => {
                let mut payload = with_session(json!({}));
                if let Some(run) = params["runId"].as_str() {
                    payload["runId"] = json!(run);
                }
                received("stop", "stop received — aborting turn", payload)
            }
            "sessions.reset" => {
                let mut payload = with_session(json!({}));
                if let Some(reason) = params["reason"].as_str() {
                    payload["reason"] = json!(reason);
                }
                received(
                    "new_session",
                    "session reset received — resetting session",
                    payload,
                )
            }
            _ => Vec::new(),
        }
    }

    fn apply_tool(&mut self, run_id: &str, p: &Value, at: Option<u64>, changes: &mut Vec<Change>) {
        let data = &p["data"];
        let Some(call_id) = data["toolCallId"].as_str() else {
            return;
        };
        let phase = data["phase"].as_str().unwrap_or("");
        let name = data["name"].as_str().unwrap_or("tool").to_owned();
        let run = self.run_entry(run_id, p, None, at, changes);
        if run.tool_mut(call_id).is_none() {
            if !run.running() {
                return;
            }
            close_thinking(run, at, changes);
            let (args, cut) = bound(&data["args"]);
            let call = ToolCall {
                call_id: call_id.to_owned(),
                name,
                args,
                parent_call_id: data["parentToolCallId"].as_str().map(str::to_owned),
                started_ms: at,
                ended_ms: None,
                is_error: None,
                result: Value::Null,
                meta: None,
                result_bytes: None,
                text_bytes: None,
                cut,
                interrupted: false,
            };
            if !run.push_item(Item::Tool(call.clone())) {
                return;
            }
            changes.push(Change::ToolStart {
                run_id: run.id.clone(),
                call,
            });
        }
        let run_id = run.id.clone();
        let Some(call) = run.tool_mut(call_id) else {
            return;
        };
        if call.args.is_null() && !data["args"].is_null() {
            let (args, cut) = bound(&data["args"]);
            call.args = args;
            call.cut |= cut;
        }
        if phase == "result" && !call.ended() {
            call.ended_ms = at.map(|at| call.started_ms.map_or(at, |s| at.max(s)));
            call.is_error = Some(data["isError"] == true);
            let result = &data["result"];
            call.result_bytes = (!result.is_null()).then(|| result.to_string().len());
            call.text_bytes = content_text(result).map(|t| t.len());
            let (result, cut) = bound(result);
            call.result = result;
            call.cut |= cut;
            call.meta = data["meta"].as_str().map(str::to_owned);
            changes.push(Change::ToolEnd {
                run_id,
                call: call.clone(),
            });
        }
    }

    /// An `item` event of kind `tool` (`phase` `start`/`end`, `startedAt`,
    /// `endedAt`, `status`, `meta`): a tool call without its arguments or
    /// result, as the replay log holds it.
    fn apply_tool_item(
        &mut self,
        run_id: &str,
        p: &Value,
        at: Option<u64>,
        changes: &mut Vec<Change>,
    ) {
        let data = &p["data"];
        let mut tool = p.clone();
        tool["data"] = json!({
            "toolCallId": data["toolCallId"],
            "name": data["name"],
            "phase": match data["phase"].as_str() {
                Some("start") => "start",
                Some("end") => "item_end",
                _ => "update",
            },
        });
        let started = positive(&data["startedAt"]).or(at);
        let Some(call_id) = data["toolCallId"].as_str() else {
            return;
        };
        let known = self
            .runs
            .get(run_id)
            .or(self.set_aside.get(run_id))
            .is_some_and(|r| {
                r.items
                    .iter()
                    .any(|i| matches!(i, Item::Tool(t) if t.call_id == call_id))
            });
        if !known {
            self.apply_tool(run_id, &tool, started, changes);
        }
        if data["phase"] != "end" {
            return;
        }
        let Some(run) = self.runs.get_mut(run_id) else {
            return;
        };
        let run_id = run.id.clone();
        let Some(call) = run.tool_mut(call_id) else {
            return;
        };
        if call.ended() {
            return;
        }
        let ended = positive(&data["endedAt"]).or(at);
        call.ended_ms = ended.map(|at| call.started_ms.map_or(at, |s| at.max(s)));
        call.is_error = Some(data["status"] != "completed");
        call.meta = data["meta"].as_str().map(str::to_owned);
        changes.push(Change::ToolEnd {
            run_id,
            call: call.clone(),
        });
    }

    /// The run `run_id`, created (with a `TurnStart`) if this is the first
    /// event seen of it. `started` is its start, when this event says it.
    fn run_entry(
        &mut self,
        run_id: &str,
        p: &Value,
        started: Option<u64>,
        at: Option<u64>,
        changes: &mut Vec<Change>,
    ) -> &mut Run {
        let session_key = p["sessionKey"].as_str().unwrap_or("(no session)");
        if let Some(run) = self.set_aside.remove(run_id) {
            self.runs.insert(run_id.to_owned(), run);
        }
        let run = self.runs.entry(run_id.to_owned()).or_insert_with(|| {
            changes.push(Change::TurnStart {
                run_id: run_id.to_owned(),
                session_key: session_key.to_owned(),
                // First seen after its start: when it was seen.
                ts: started.or(at),
            });
            Run {
                id: run_id.to_owned(),
                session_key: session_key.to_owned(),
                started_ms: started,
                ended_ms: None,
                status: RunStatus::Running,
                items: Vec::new(),
                dropped_items: 0,
                output: String::new(),
                last_ms: 0,
                thinks: 0,
            }
        });
        run.saw(at);
        run
    }

    /// Forgets the oldest ended runs past [`MAX_RUNS`].
    fn evict(&mut self) {
        if self.runs.len() <= MAX_RUNS {
            return;
        }
        let mut ended: Vec<(u64, String)> = self
            .runs
            .values()
            .filter(|r| !r.running())
            .map(|r| (r.last_ms, r.id.clone()))
            .collect();
        ended.sort();
        let excess = self.runs.len() - MAX_RUNS;
        for (_, id) in ended.into_iter().take(excess) {
            self.runs.remove(&id);
        }
    }
}

/// The HUD `correlationId` of a thinking stretch: a UUID derived from its
/// id (`<runId>:think:<n>`), so every projection of the same events (live,
/// history, another reader) names it alike.
pub fn thinking_correlation_id(think_id: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(think_id.as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes)
        .into_uuid()
        .to_string()
}

/// The runs still going, for `/v1/state` (so a client can initialize its
/// view from it and stream after its `newest_seq`): each with its open
/// thinking and its open tool calls (arguments bounded as in the
/// projection), newest first.
pub fn runs_in_flight(activity: &Activity) -> Value {
    let mut runs: Vec<&Run> = activity.runs.values().filter(|r| r.running()).collect();
    runs.sort_by(|a, b| {
        let at = |r: &Run| r.started_ms.unwrap_or(r.last_ms);
        (at(b), &b.id).cmp(&(at(a), &a.id))
    });
    let runs: Vec<Value> = runs
        .into_iter()
        .map(|run| {
            let thinking = match run.items.last() {
                Some(Item::Thinking(t)) if !t.done => json!({
                    "id": t.id,
                    "correlationId": t.correlation_id,
                    "startedMs": t.started_ms,
                }),
                _ => Value::Null,
            };
            let tools: Vec<Value> = run
                .items
                .iter()
                .filter_map(|i| match i {
                    Item::Tool(t) if !t.ended() => Some(json!({
                        "toolCallId": t.call_id,
                        "name": t.name,
                        "args": t.args,
                        "parentToolCallId": t.parent_call_id,
                        "startedMs": t.started_ms,
                    })),
                    _ => None,
                })
                .collect();
            json!({
                "runId": run.id,
                "sessionKey": run.session_key,
                "startedMs": run.started_ms,
                "lastMs": run.last_ms,
                "thinking": thinking,
                "tools": tools,
            })
        })
        .collect();
    Value::Array(runs)
}

/// Ends open thinking of `run` at `at`.
fn close_thinking(run: &mut Run, at: Option<u64>, changes: &mut Vec<Change>) {
    let run_id = run.id.clone();
    if let Some(t) = run.open_thinking() {
        t.done = true;
        t.ended_ms = at.map(|at| t.started_ms.map_or(at, |s| at.max(s)));
        changes.push(Change::ThinkEnd {
            run_id,
            think_id: t.id.clone(),
            correlation_id: t.correlation_id.clone(),
            ts: t.ended_ms,
            duration_ms: t.ended_ms.zip(t.started_ms).map(|(e, s)| e - s),
            text: t.text.clone(),
        });
    }
}

/// Ends `run` (the first end wins; a later one of another kind only fills
/// in an error message or an abort the first did not know, and a time the
/// first did not have).
fn end_run(run: &mut Run, at: Option<u64>, status: RunStatus, changes: &mut Vec<Change>) {
    if !run.running() {
        if run.status == RunStatus::Ok && status != RunStatus::Ok {
            run.status = status;
        }
        if run.ended_ms.is_none() {
            run.ended_ms = at;
        }
        return;
    }
    close_thinking(run, at, changes);
    let run_id = run.id.clone();
    for item in &mut run.items {
        if let Item::Tool(call) = item {
            if !call.ended() {
                call.ended_ms = at.map(|at| call.started_ms.map_or(at, |s| at.max(s)));
                call.interrupted = true;
                changes.push(Change::ToolEnd {
                    run_id: run_id.clone(),
                    call: call.clone(),
                });
            }
        }
    }
    run.ended_ms = at.map(|at| run.started_ms.map_or(at, |s| at.max(s)));
    run.status = status.clone();
    changes.push(Change::TurnEnd {
        run_id,
        session_key: run.session_key.clone(),
        ts: run.ended_ms,
        duration_ms: run.duration_ms(None),
        status,
        output: run.output.clone(),
    });
}

/// Keeps the last [`MAX_TEXT_CHARS`] characters of `text`.
fn keep_tail(text: &mut String) {
    let n = text.chars().count();
    if n > MAX_TEXT_CHARS {
        *text = text.chars().skip(n - MAX_TEXT_CHARS).collect();
    }
}

/// `value` within [`MAX_VALUE_BYTES`] as JSON: its longest strings cut
/// (keeping their start, with `…`) until it fits; whether anything was cut.
/// A value that still does not fit (very many small parts) is replaced by
/// `null`.
pub fn bound(value: &Value) -> (Value, bool) {
    bound_to(value, MAX_VALUE_BYTES)
}

/// [`bound`] with another limit (`max_bytes` of JSON).
pub fn bound_to(value: &Value, max_bytes: usize) -> (Value, bool) {
    if value.is_null() || value.to_string().len() <= max_bytes {
        return (value.clone(), false);
    }
    let mut limit = max_bytes / 2;
    while limit >= 16 {
        let mut v = value.clone();
        cut_strings(&mut v, limit);
        if v.to_string().len() <= max_bytes {
            return (v, true);
        }
        limit /= 2;
    }
    (Value::Null, true)
}

fn cut_strings(v: &mut Value, max_chars: usize) {
    match v {
        Value::String(s) if s.chars().count() > max_chars => {
            *s = render::cut(s, max_chars);
        }
        Value::Array(items) => items.iter_mut().for_each(|i| cut_strings(i, max_chars)),
        Value::Object(map) => map.values_mut().for_each(|i| cut_strings(i, max_chars)),
        _ => {}
    }
}

/// The text parts of a tool result (`{content:[{type:"text",text}]}`).
pub fn content_text(result: &Value) -> Option<String> {
    let parts = result["content"].as_array()?;
    let texts: Vec<&str> = parts
        .iter()
        .filter(|p| p["type"] == "text" || p["type"].is_null())
        .filter_map(|p| p["text"].as_str())
        .collect();
    (!texts.is_empty()).then(|| texts.concat())
}

/// The text of a chat message (`content` as a string or as text parts).
pub fn message_text(message: &Value) -> Option<String> {
    match &message["content"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            (!text.is_empty()).then_some(text)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests;
