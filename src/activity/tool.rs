//! Tool calls: the model of one call, the one rule of whether it succeeded
//! ([`ToolCall::ok`]), how the tool stream and `item` events build it, and
//! how its arguments and result are bounded ([`bound`]).

use serde_json::{json, Value};

use super::events::Event;
use super::run::close_thinking;
use super::{positive, render, Activity, Change, Item, MAX_VALUE_BYTES};

/// One tool call.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// What its arguments and result keep, in bytes, as last measured.
    #[serde(skip)]
    pub size: super::bounds::SizeCache,
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

impl Activity {
    /// The tool stream (`agent` `stream:"tool"`, `session.tool`): a call
    /// begins at its first event and ends at its `result`.
    pub(super) fn apply_tool(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        let Event { run_id, p, at } = *ev;
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
                size: Default::default(),
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
            call.size.clear();
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
            call.size.clear();
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
    pub(super) fn apply_tool_item(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        let Event { run_id, p, at } = *ev;
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
            let ev = Event {
                run_id,
                p: &tool,
                at: started,
            };
            self.apply_tool(&ev, changes);
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
