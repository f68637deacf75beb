//! Runs and their bookkeeping: a run's status, its thinking and items, how
//! it begins (first event seen) and ends (first end wins), and which runs
//! the projection keeps ([`MAX_RUNS`], set aside after a gap).

use serde_json::{json, Value};

use super::{Activity, Change, ToolCall, MAX_ITEMS_PER_RUN, MAX_RUNS, MAX_TEXT_CHARS};

/// How a run ended, or that it has not.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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

/// A child of a run, in the order it began.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Item {
    Thinking(Thinking),
    Tool(ToolCall),
}

/// One agent run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
    pub(super) thinks: usize,
    /// The projection's event count when an event last was about it: the
    /// run idle longest has the smallest.
    #[serde(default)]
    pub(super) touched: u64,
    /// What it keeps, in bytes, as last measured.
    #[serde(skip)]
    pub(super) size: super::bounds::SizeCache,
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

    pub(super) fn open_thinking(&mut self) -> Option<&mut Thinking> {
        match self.items.last_mut() {
            Some(Item::Thinking(t)) if !t.done => Some(t),
            _ => None,
        }
    }

    pub(super) fn tool_mut(&mut self, call_id: &str) -> Option<&mut ToolCall> {
        self.items.iter_mut().find_map(|i| match i {
            Item::Tool(t) if t.call_id == call_id => Some(t),
            _ => None,
        })
    }

    pub(super) fn push_item(&mut self, item: Item) -> bool {
        if self.items.len() >= MAX_ITEMS_PER_RUN {
            self.dropped_items += 1;
            return false;
        }
        self.items.push(item);
        true
    }

    /// Drops what no later change of a feed needs ([`Activity::for_feed`]),
    /// after each event of the run: its output and thinking text; the
    /// arguments and result of a tool call that has ended (its `ToolEnd`
    /// was produced with them); and once the run has ended, its items (a
    /// later event of an ended run starts nothing and ends nothing).
    pub(super) fn shed_detail(&mut self) {
        self.output = String::new();
        if !self.running() {
            self.items = Vec::new();
            return;
        }
        for item in &mut self.items {
            match item {
                Item::Thinking(t) => t.text = String::new(),
                Item::Tool(call) if call.ended() => {
                    call.args = Value::Null;
                    call.result = Value::Null;
                    call.meta = None;
                    call.size.clear();
                }
                Item::Tool(_) => {}
            }
        }
    }

    pub(super) fn saw(&mut self, at: Option<u64>) {
        if let Some(at) = at {
            self.last_ms = self.last_ms.max(at);
        }
    }
}

impl Activity {
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

    /// The run `run_id`, created (with a `TurnStart`) if this is the first
    /// event seen of it. `started` is its start, when this event says it.
    pub(super) fn run_entry(
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
                touched: 0,
                size: Default::default(),
            }
        });
        run.saw(at);
        run
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
pub(super) fn close_thinking(run: &mut Run, at: Option<u64>, changes: &mut Vec<Change>) {
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
pub(super) fn end_run(
    run: &mut Run,
    at: Option<u64>,
    status: RunStatus,
    changes: &mut Vec<Change>,
) {
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
        dropped_items: run.dropped_items,
    });
}

/// Keeps the last [`MAX_TEXT_CHARS`] characters of `text`.
pub(super) fn keep_tail(text: &mut String) {
    let n = text.chars().count();
    if n > MAX_TEXT_CHARS {
        *text = text.chars().skip(n - MAX_TEXT_CHARS).collect();
    }
}
