//! Line renderings of the projection's [`Change`]s: the indented lines of
//! `clawmux tail --tree` (the HUD JSON of `tail --hud` is [`super::hud`]);
//! and the short texts `clawmux top` shows (durations, sizes, argument
//! summaries, previews).

use serde_json::Value;

use super::{Bound, Change, Node, RunStatus, ToolCall};
use crate::sanitize::{self, Shown};

/// Characters of a text preview on one line.
pub const PREVIEW_CHARS: usize = 60;
/// Characters of an argument summary.
pub const ARGS_CHARS: usize = 48;
/// Fewest characters of a run id [`unique_ids`] shows (a UUID's first
/// group), unless the id is shorter.
pub const MIN_ID_CHARS: usize = 8;
/// What ends a `tail --tree` line made from the broker's history (events
/// logged before tail connected). Not "replay": that is record/replay's word.
pub const HISTORY_MARK: &str = " (history)";

/// One HUD event per change (the protocol's wire format: [`super::hud`]).
pub use super::hud::hud_event as hud_line;

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

    /// The lines for one change (`time` formats a ms timestamp; a line
    /// whose time is not known gets blanks as wide as a time; `history`:
    /// made from the broker's log, marked [`HISTORY_MARK`]). Run ids are
    /// shown whole: a line once printed cannot be made longer when a later
    /// run shares its prefix.
    pub fn lines(
        &mut self,
        change: &Change,
        history: bool,
        time: impl Fn(u64) -> String,
    ) -> Vec<String> {
        let (run_id, ts, depth, text) = match change {
            Change::TurnStart {
                run_id,
                session_key,
                ts,
            } => {
                self.sessions.insert(run_id.clone(), session_key.clone());
                (run_id, *ts, 1, format!("run {} started", shown_id(run_id)))
            }
            Change::ThinkStart { .. } | Change::Received { .. } => return Vec::new(),
            Change::Truncated {
                run_id,
                node: Node::Turn { .. },
                bound,
                ..
            } => (
                run_id,
                None,
                1,
                format!(
                    "run {} no longer followed (the {} kept: it was idle longest)",
                    shown_id(run_id),
                    match bound {
                        Bound::Bytes => "bytes",
                        _ => "runs",
                    }
                ),
            ),
            Change::Truncated { .. } => return Vec::new(),
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
                format!("thinking {}{}", took(*duration_ms), preview(text)),
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
                call.ended_ms.or(call.started_ms),
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
                    lines.extend(me.line(run_id, *ts, depth, text, history, &time));
                };
                if !output.is_empty() {
                    line(2, format!("assistant {}", preview(output)), self);
                }
                let end = match status {
                    RunStatus::Error(message) => format!("error: {}", preview_head(message)),
                    other => other.as_str().to_owned(),
                };
                let took = duration_ms.map(|d| format!(" in {}", duration(d)));
                line(
                    1,
                    format!("run {} {end}{}", shown_id(run_id), took.unwrap_or_default()),
                    self,
                );
                return lines;
            }
        };
        self.line(run_id, ts, depth, text, history, &time)
    }

    fn line(
        &mut self,
        run_id: &str,
        ts: Option<u64>,
        depth: usize,
        text: String,
        history: bool,
        time: &impl Fn(u64) -> String,
    ) -> Vec<String> {
        let time = |ts: Option<u64>| {
            ts.map(time)
                .unwrap_or_else(|| " ".repeat(time(0).chars().count()))
        };
        let mut out = Vec::new();
        let session = self.sessions.get(run_id).cloned().unwrap_or_default();
        if self.last_session.as_deref() != Some(session.as_str()) {
            out.push(format!("{} {}", time(ts), Shown(&session)));
            self.last_session = Some(session);
        }
        let mark = if history { HISTORY_MARK } else { "" };
        if depth > 1 && self.last_run.as_deref() != Some(run_id) {
            out.push(format!("{}   run {}{mark}", time(ts), shown_id(run_id)));
        }
        self.last_run = Some(run_id.to_owned());
        out.push(format!("{} {}{text}{mark}", time(ts), "  ".repeat(depth)));
        out
    }
}

/// `ok 120 ms, 30 B` / `error 1.2 s, 12 B` / `interrupted after 3.0 s` /
/// `running 2.0 s` (a duration whose times are not known is left out).
pub fn tool_outcome(call: &ToolCall) -> String {
    tool_outcome_at(call, None)
}

/// [`tool_outcome`], a running call's duration counted to `now`.
pub fn tool_outcome_at(call: &ToolCall, now: Option<u64>) -> String {
    let took = call.duration_ms(now).map(duration);
    if call.interrupted {
        return match took {
            Some(took) => format!("interrupted after {took}"),
            None => "interrupted".to_owned(),
        };
    }
    let state = match call.ok() {
        None => "running",
        Some(false) => "error",
        Some(true) => "ok",
    };
    let mut out = state.to_owned();
    if let Some(took) = &took {
        out.push(' ');
        out.push_str(took);
    }
    if call.is_error.is_some() {
        if let Some(size) = call.result_bytes {
            out.push_str(if took.is_some() { ", " } else { " " });
            out.push_str(&bytes(size));
        }
    }
    out
}

/// ` 850 ms ` before a preview, or a single space when not known.
fn took(duration_ms: Option<u64>) -> String {
    match duration_ms {
        Some(d) => format!("{} ", duration(d)),
        None => String::new(),
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

/// A run id whole (escaped: [`sanitize::text`]).
pub fn shown_id(id: &str) -> String {
    sanitize::text(id).into_owned()
}

/// How a view that shows `ids` together writes each (escaped): its shortest
/// prefix of at least [`MIN_ID_CHARS`] characters that no other id starts
/// with, else the whole id. Two different ids are never shown alike: a
/// shown prefix that is not a whole id belongs to one id only.
pub fn unique_ids<'a>(
    ids: impl IntoIterator<Item = &'a str>,
) -> std::collections::HashMap<&'a str, String> {
    let mut ids: Vec<&str> = ids.into_iter().collect();
    ids.sort_unstable();
    ids.dedup();
    // In sorted order, the ids sharing the longest prefix with an id are
    // its neighbours.
    let common = |a: &str, b: &str| a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    let mut shown = std::collections::HashMap::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        let before = i.checked_sub(1).map_or(0, |j| common(ids[j], id));
        let after = ids.get(i + 1).map_or(0, |next| common(next, id));
        let chars = (before.max(after) + 1).max(MIN_ID_CHARS);
        let prefix: String = id.chars().take(chars).collect();
        shown.insert(*id, sanitize::text(&prefix).into_owned());
    }
    shown
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

/// A quoted one-line preview of the start of a text (an error message:
/// its beginning says what went wrong), cut at the end with `…` (escaped).
pub fn preview_head(text: &str) -> String {
    sanitize::preview(text, PREVIEW_CHARS, sanitize::Keep::Start)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_never_show_two_runs_alike() {
        // The README's `run-<time>` ids share far more than 8 characters.
        let ids = [
            "run-1795431469879",
            "run-1795431470344",
            "run-1795431470399",
            "5e8cdc96-aaaa-4bbb-8ccc-000000000001",
            "735fab92-aaaa-4bbb-8ccc-000000000002",
            "r1",
        ];
        let shown = unique_ids(ids);
        assert_eq!(shown["run-1795431469879"], "run-179543146");
        assert_eq!(shown["run-1795431470344"], "run-179543147034");
        assert_eq!(shown["run-1795431470399"], "run-179543147039");
        assert_eq!(shown["5e8cdc96-aaaa-4bbb-8ccc-000000000001"], "5e8cdc96");
        assert_eq!(shown["r1"], "r1");
        let mut texts: Vec<&String> = shown.values().collect();
        texts.sort();
        texts.dedup();
        assert_eq!(texts.len(), ids.len(), "{shown:?}");
        // One id the prefix of another: the shorter one whole, the longer
        // one past it.
        let shown = unique_ids(["run-123456789", "run-1234567890"]);
        assert_eq!(shown["run-123456789"], "run-123456789");
        assert_eq!(shown["run-1234567890"], "run-1234567890");
        // Escaped like every gateway string.
        assert_eq!(
            unique_ids(["run\u{1b}[2Jx"])["run\u{1b}[2Jx"],
            shown_id("run\u{1b}[2Jx")
        );
    }
}
