//! Line renderings of the projection's [`Change`]s: the HUD activity JSON
//! lines of `clawmux tail --hud` and the indented lines of `clawmux tail
//! --tree`; and the short texts `clawmux top` shows (durations, sizes,
//! argument summaries, previews).

use serde_json::{json, Value};

use super::{Change, RunStatus, ToolCall};
use crate::sanitize::{self, Shown};

/// Characters of a text preview on one line.
pub const PREVIEW_CHARS: usize = 60;
/// Characters of an argument summary.
pub const ARGS_CHARS: usize = 48;

/// One HUD activity event (`turn_start`/`turn_end`, `think_start`/
/// `think_end`, `tool_start`/`tool_end`): `id`, `correlationId` (the run id
/// for turns and thinking, the tool call id for tools), `parentId` (the run
/// for thinking and tools, or the enclosing tool call), `ts`, `durationMs`
/// on ends, and `replay: true` for events read from the broker's replay
/// window.
pub fn hud_line(change: &Change, replay: bool) -> Value {
    let mut v = match change {
        Change::TurnStart {
            run_id,
            session_key,
            ts,
        } => json!({"type": "turn_start", "id": run_id, "correlationId": run_id,
            "parentId": null, "ts": ts, "sessionKey": session_key}),
        Change::TurnEnd {
            run_id,
            session_key,
            ts,
            duration_ms,
            status,
            output,
        } => {
            let mut v = json!({"type": "turn_end", "id": run_id, "correlationId": run_id,
                "parentId": null, "ts": ts, "durationMs": duration_ms, "sessionKey": session_key,
                "status": status.as_str(), "text": output});
            if let RunStatus::Error(message) = status {
                v["error"] = json!(message);
            }
            v
        }
        Change::ThinkStart {
            run_id,
            think_id,
            ts,
        } => json!({"type": "think_start", "id": think_id, "correlationId": run_id,
            "parentId": run_id, "ts": ts}),
        Change::ThinkEnd {
            run_id,
            think_id,
            ts,
            duration_ms,
            text,
        } => json!({"type": "think_end", "id": think_id, "correlationId": run_id,
            "parentId": run_id, "ts": ts, "durationMs": duration_ms, "text": text}),
        Change::ToolStart { run_id, call } => json!({"type": "tool_start", "id": call.call_id,
            "correlationId": call.call_id, "parentId": call.parent_call_id.as_deref().unwrap_or(run_id),
            "runId": run_id, "ts": call.started_ms, "tool": call.name, "args": call.args}),
        Change::ToolEnd { run_id, call } => {
            let mut v = json!({"type": "tool_end", "id": call.call_id,
                "correlationId": call.call_id, "parentId": call.parent_call_id.as_deref().unwrap_or(run_id),
                "runId": run_id, "ts": call.ended_ms, "durationMs": tool_duration(call),
                "tool": call.name, "args": call.args, "result": call.result,
                "isError": call.is_error.unwrap_or(false)});
            if call.interrupted {
                v["interrupted"] = json!(true);
            }
            v
        }
    };
    if replay {
        v["replay"] = json!(true);
    }
    v
}

fn tool_duration(call: &ToolCall) -> u64 {
    call.ended_ms.unwrap_or(call.started_ms) - call.started_ms
}

/// `clawmux tail --tree`: prints each change as an indented line, with a
/// session line whenever the session changes.
#[derive(Debug, Default)]
pub struct TreePrinter {
    last_session: Option<String>,
    /// The run the last line was about: a line about another run's items
    /// is preceded by that run's line, so interleaved runs stay readable.
    last_run: Option<String>,
    /// Sessions of the runs seen, for the session line of later changes.
    sessions: std::collections::HashMap<String, String>,
}

impl TreePrinter {
    pub fn new() -> Self {
        Self::default()
    }

    /// The lines for one change (`time` formats a ms timestamp).
    pub fn lines(
        &mut self,
        change: &Change,
        replay: bool,
        time: impl Fn(u64) -> String,
    ) -> Vec<String> {
        let (run_id, ts, depth, text) = match change {
            Change::TurnStart {
                run_id,
                session_key,
                ts,
            } => {
                self.sessions.insert(run_id.clone(), session_key.clone());
                (run_id, *ts, 1, format!("run {} started", short_id(run_id)))
            }
            Change::ThinkStart { .. } => return Vec::new(),
            Change::ThinkEnd {
                run_id,
                ts,
                duration_ms,
                text,
                ..
            } => (
                run_id,
                *ts,
                2,
                format!("thinking {} {}", duration(*duration_ms), preview(text)),
            ),
            Change::ToolStart { run_id, call } => (
                run_id,
                call.started_ms,
                2 + usize::from(call.parent_call_id.is_some()),
                format!("tool {} {}", Shown(&call.name), args_summary(&call.args))
                    .trim_end()
                    .to_owned(),
            ),
            Change::ToolEnd { run_id, call } => (
                run_id,
                call.ended_ms.unwrap_or(call.started_ms),
                2 + usize::from(call.parent_call_id.is_some()),
                format!("tool {} {}", Shown(&call.name), tool_outcome(call)),
            ),
            Change::TurnEnd {
                run_id,
                ts,
                duration_ms,
                status,
                output,
                ..
            } => {
                let mut lines = Vec::new();
                let mut line = |depth: usize, text: String, me: &mut Self| {
                    lines.extend(me.line(run_id, *ts, depth, text, replay, &time));
                };
                if !output.is_empty() {
                    line(2, format!("assistant {}", preview(output)), self);
                }
                let end = match status {
                    RunStatus::Error(message) => format!("error: {}", preview(message)),
                    other => other.as_str().to_owned(),
                };
                line(
                    1,
                    format!(
                        "run {} {end} in {}",
                        short_id(run_id),
                        duration(*duration_ms)
                    ),
                    self,
                );
                return lines;
            }
        };
        self.line(run_id, ts, depth, text, replay, &time)
    }

    fn line(
        &mut self,
        run_id: &str,
        ts: u64,
        depth: usize,
        text: String,
        replay: bool,
        time: &impl Fn(u64) -> String,
    ) -> Vec<String> {
        let mut out = Vec::new();
        let session = self.sessions.get(run_id).cloned().unwrap_or_default();
        if self.last_session.as_deref() != Some(session.as_str()) {
            out.push(format!("{} {}", time(ts), Shown(&session)));
            self.last_session = Some(session);
        }
        let mark = if replay { " (replay)" } else { "" };
        if depth > 1 && self.last_run.as_deref() != Some(run_id) {
            out.push(format!("{}   run {}{mark}", time(ts), short_id(run_id)));
        }
        self.last_run = Some(run_id.to_owned());
        out.push(format!("{} {}{text}{mark}", time(ts), "  ".repeat(depth)));
        out
    }
}

/// `ok 120 ms, 30 B` / `error 1.2 s, 12 B` / `interrupted after 3.0 s` /
/// `running 2.0 s`.
pub fn tool_outcome(call: &ToolCall) -> String {
    let took = duration(tool_duration(call));
    if call.interrupted {
        return format!("interrupted after {took}");
    }
    let size = call.result_bytes.map(bytes).unwrap_or_default();
    match call.is_error {
        None => format!("running {took}"),
        Some(true) => format!("error {took}, {size}")
            .trim_end_matches(", ")
            .to_owned(),
        Some(false) => format!("ok {took}, {size}")
            .trim_end_matches(", ")
            .to_owned(),
    }
}

/// `850 ms`, `1.2 s`, `3 m 05 s`.
pub fn duration(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=59_999 => format!("{:.1} s", ms as f64 / 1000.0),
        _ => format!("{} m {:02} s", ms / 60_000, (ms / 1000) % 60),
    }
}

/// `512 B`, `1.5 KiB`, `2.0 MiB`.
pub fn bytes(n: usize) -> String {
    match n {
        0..=1023 => format!("{n} B"),
        1024..=1_048_575 => format!("{:.1} KiB", n as f64 / 1024.0),
        _ => format!("{:.1} MiB", n as f64 / 1_048_576.0),
    }
}

/// The first 8 characters of a run id (escaped: [`sanitize::text`]).
pub fn short_id(id: &str) -> String {
    let short: String = id.chars().take(8).collect();
    sanitize::text(&short).into_owned()
}

/// Tool arguments in one short line: `command="ls"`, `path="a" limit=3`.
pub fn args_summary(args: &Value) -> String {
    let text = match args {
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{}={}", Shown(k), sanitize::quoted(s)),
                other => format!("{}={}", Shown(k), sanitize::text(&other.to_string())),
            })
            .collect::<Vec<_>>()
            .join(" "),
        Value::Null => String::new(),
        other => sanitize::text(&other.to_string()).into_owned(),
    };
    cut(&text, ARGS_CHARS)
}

/// A quoted one-line preview of the end of a text (escaped).
pub fn preview(text: &str) -> String {
    sanitize::preview(text, PREVIEW_CHARS, sanitize::Keep::End)
}

/// Line breaks and tabs as spaces, every other control and invisible
/// character escaped ([`sanitize::one_line`]).
pub fn one_line(text: &str) -> String {
    sanitize::one_line(text)
}

/// At most `max` characters, with `…` when cut.
pub fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let head: String = text.chars().take(max.saturating_sub(1)).collect();
        format!("{head}…")
    }
}
