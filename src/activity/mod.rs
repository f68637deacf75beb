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

pub mod render;

use std::collections::HashMap;

use serde_json::Value;

/// Runs kept. Past this the oldest *ended* run is forgotten (a running one
/// is kept however old), so a dashboard left open for days stays small.
pub const MAX_RUNS: usize = 200;
/// Thinking segments and tool calls kept per run; later ones are counted in
/// [`Run::dropped_items`] and shown as a number, not kept.
pub const MAX_ITEMS_PER_RUN: usize = 256;
/// Characters of assistant output or thinking kept per node (the end of the
/// text: the newest part is what a watcher wants to see).
pub const MAX_TEXT_CHARS: usize = 16 * 1024;

/// One raw event as a client received it.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// The gateway event name (`agent`, `chat`, `session.tool`, …).
    pub name: &'a str,
    /// Its payload.
    pub payload: &'a Value,
    /// When the client received it (ms), for events that carry no `ts`.
    pub received_ms: u64,
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
    /// `<runId>:think:<n>`, n from 1.
    pub id: String,
    pub text: String,
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
}

/// One tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub call_id: String,
    pub name: String,
    pub args: Value,
    /// The call this one runs inside (`parentToolCallId`), if any.
    pub parent_call_id: Option<String>,
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
    /// `isError` of the result (`None` while running, or when the run ended
    /// before the result: [`ToolCall::interrupted`]).
    pub is_error: Option<bool>,
    /// The result as the gateway sent it.
    pub result: Value,
    /// Bytes of the result as JSON.
    pub result_bytes: Option<usize>,
    /// The run ended before this call's result arrived.
    pub interrupted: bool,
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
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
    pub status: RunStatus,
    pub items: Vec<Item>,
    /// Items past [`MAX_ITEMS_PER_RUN`], not kept.
    pub dropped_items: usize,
    /// The assistant's output so far (the final message once it ended).
    pub output: String,
    /// Last activity (ms), for ordering.
    pub last_ms: u64,
    /// Thinking segments begun, for their ids.
    thinks: usize,
}

impl Run {
    /// Whether the run is still going.
    pub fn running(&self) -> bool {
        self.status == RunStatus::Running
    }

    fn open_thinking(&mut self) -> Option<&mut Thinking> {
        match self.items.last_mut() {
            Some(Item::Thinking(t)) if t.ended_ms.is_none() => Some(t),
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
}

/// What one event changed, for the line-oriented renderings
/// ([`render::hud_line`], [`render::tree_line`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    TurnStart {
        run_id: String,
        session_key: String,
        ts: u64,
    },
    ThinkStart {
        run_id: String,
        think_id: String,
        ts: u64,
    },
    ThinkEnd {
        run_id: String,
        think_id: String,
        ts: u64,
        duration_ms: u64,
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
        ts: u64,
        duration_ms: u64,
        status: RunStatus,
        output: String,
    },
}

/// The projection: every run seen, by session.
#[derive(Debug, Clone, Default)]
pub struct Activity {
    runs: HashMap<String, Run>,
    /// Events applied, for rates.
    pub events_seen: u64,
}

impl Activity {
    pub fn new() -> Self {
        Self::default()
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
        let mut sessions: Vec<(String, Vec<&Run>)> = by_key
            .into_iter()
            .map(|(key, mut runs)| {
                runs.sort_by(|a, b| (b.started_ms, &b.id).cmp(&(a.started_ms, &a.id)));
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

    /// Applies one event; returns what it changed (nothing for events that
    /// are not about runs).
    pub fn apply(&mut self, ev: Observed<'_>) -> Vec<Change> {
        self.events_seen += 1;
        let p = ev.payload;
        let Some(run_id) = p["runId"].as_str().filter(|r| !r.is_empty()) else {
            return Vec::new();
        };
        let ts = p["ts"].as_u64().unwrap_or(ev.received_ms);
        let mut changes = Vec::new();
        match ev.name {
            "agent" | "session.tool" => {
                let stream = p["stream"].as_str().unwrap_or("");
                let data = &p["data"];
                let stream = if ev.name == "session.tool" {
                    "tool"
                } else {
                    stream
                };
                match stream {
                    "lifecycle" => {
                        let phase = data["phase"].as_str().unwrap_or("");
                        let run = self.run_entry(run_id, p, ts, &mut changes);
                        match phase {
                            "end" if data["aborted"] == true => {
                                end_run(run, ts, RunStatus::Aborted, &mut changes)
                            }
                            "end" => end_run(run, ts, RunStatus::Ok, &mut changes),
                            "error" => {
                                let message = data["error"].as_str().unwrap_or("error").to_owned();
                                end_run(run, ts, RunStatus::Error(message), &mut changes)
                            }
                            _ => {}
                        }
                    }
                    "thinking" => {
                        let run = self.run_entry(run_id, p, ts, &mut changes);
                        if !run.running() {
                            return changes;
                        }
                        let text = data["text"].as_str().map(str::to_owned);
                        if run.open_thinking().is_none() {
                            run.thinks += 1;
                            let think_id = format!("{}:think:{}", run.id, run.thinks);
                            let begun = run.push_item(Item::Thinking(Thinking {
                                id: think_id.clone(),
                                text: String::new(),
                                started_ms: ts,
                                ended_ms: None,
                            }));
                            if begun {
                                changes.push(Change::ThinkStart {
                                    run_id: run.id.clone(),
                                    think_id,
                                    ts,
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
                        let run = self.run_entry(run_id, p, ts, &mut changes);
                        if !run.running() {
                            return changes;
                        }
                        close_thinking(run, ts, &mut changes);
                        match (data["text"].as_str(), data["delta"].as_str()) {
                            (Some(text), _) => run.output = text.to_owned(),
                            (None, Some(delta)) => run.output.push_str(delta),
                            (None, None) => {}
                        }
                        keep_tail(&mut run.output);
                    }
                    "tool" => self.apply_tool(run_id, p, ts, &mut changes),
                    _ => {
                        self.run_entry(run_id, p, ts, &mut changes);
                    }
                }
            }
            "chat" => {
                let state = p["state"].as_str().unwrap_or("");
                let run = self.run_entry(run_id, p, ts, &mut changes);
                if let Some(text) = message_text(&p["message"]) {
                    if state == "final" || (state == "delta" && run.running()) {
                        run.output = text;
                        keep_tail(&mut run.output);
                    }
                }
                match state {
                    "final" => end_run(run, ts, RunStatus::Ok, &mut changes),
                    "aborted" => end_run(run, ts, RunStatus::Aborted, &mut changes),
                    "error" => {
                        let message = p["errorMessage"].as_str().unwrap_or("error").to_owned();
                        end_run(run, ts, RunStatus::Error(message), &mut changes)
                    }
                    _ => {}
                }
            }
            _ => {}
        }
        self.evict();
        changes
    }

    fn apply_tool(&mut self, run_id: &str, p: &Value, ts: u64, changes: &mut Vec<Change>) {
        let data = &p["data"];
        let Some(call_id) = data["toolCallId"].as_str() else {
            return;
        };
        let phase = data["phase"].as_str().unwrap_or("");
        let name = data["name"].as_str().unwrap_or("tool").to_owned();
        let run = self.run_entry(run_id, p, ts, changes);
        if run.tool_mut(call_id).is_none() {
            if !run.running() {
                return;
            }
            close_thinking(run, ts, changes);
            let call = ToolCall {
                call_id: call_id.to_owned(),
                name,
                args: data["args"].clone(),
                parent_call_id: data["parentToolCallId"].as_str().map(str::to_owned),
                started_ms: ts,
                ended_ms: None,
                is_error: None,
                result: Value::Null,
                result_bytes: None,
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
            call.args = data["args"].clone();
        }
        if phase == "result" && call.ended_ms.is_none() {
            call.ended_ms = Some(ts.max(call.started_ms));
            call.is_error = Some(data["isError"] == true);
            call.result = data["result"].clone();
            call.result_bytes = (!call.result.is_null()).then(|| call.result.to_string().len());
            changes.push(Change::ToolEnd {
                run_id,
                call: call.clone(),
            });
        }
    }

    /// The run `run_id`, created (with a `TurnStart`) if this is the first
    /// event seen of it.
    fn run_entry(
        &mut self,
        run_id: &str,
        p: &Value,
        ts: u64,
        changes: &mut Vec<Change>,
    ) -> &mut Run {
        let session_key = p["sessionKey"].as_str().unwrap_or("(no session)");
        let run = self.runs.entry(run_id.to_owned()).or_insert_with(|| {
            changes.push(Change::TurnStart {
                run_id: run_id.to_owned(),
                session_key: session_key.to_owned(),
                ts,
            });
            Run {
                id: run_id.to_owned(),
                session_key: session_key.to_owned(),
                started_ms: ts,
                ended_ms: None,
                status: RunStatus::Running,
                items: Vec::new(),
                dropped_items: 0,
                output: String::new(),
                last_ms: ts,
                thinks: 0,
            }
        });
        run.last_ms = run.last_ms.max(ts);
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

/// Ends open thinking of `run` at `ts`.
fn close_thinking(run: &mut Run, ts: u64, changes: &mut Vec<Change>) {
    let run_id = run.id.clone();
    if let Some(t) = run.open_thinking() {
        t.ended_ms = Some(ts.max(t.started_ms));
        changes.push(Change::ThinkEnd {
            run_id,
            think_id: t.id.clone(),
            ts,
            duration_ms: ts.saturating_sub(t.started_ms),
            text: t.text.clone(),
        });
    }
}

/// Ends `run` (the first end wins; a later one of another kind only fills
/// in an error message or an abort the first did not know).
fn end_run(run: &mut Run, ts: u64, status: RunStatus, changes: &mut Vec<Change>) {
    if !run.running() {
        if run.status == RunStatus::Ok && status != RunStatus::Ok {
            run.status = status;
        }
        return;
    }
    close_thinking(run, ts, changes);
    let run_id = run.id.clone();
    for item in &mut run.items {
        if let Item::Tool(call) = item {
            if call.ended_ms.is_none() {
                call.ended_ms = Some(ts.max(call.started_ms));
                call.interrupted = true;
                changes.push(Change::ToolEnd {
                    run_id: run_id.clone(),
                    call: call.clone(),
                });
            }
        }
    }
    run.ended_ms = Some(ts.max(run.started_ms));
    run.status = status.clone();
    changes.push(Change::TurnEnd {
        run_id,
        session_key: run.session_key.clone(),
        ts,
        duration_ms: ts.saturating_sub(run.started_ms),
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
