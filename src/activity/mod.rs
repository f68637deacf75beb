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
//!
//! The parts: `events.rs` chooses the handler of each event by a table;
//! `run.rs` is a run and its bookkeeping (begin, end, which runs are
//! kept); `tool.rs` a tool call (its ok rule, its bounded arguments and
//! result); `bounds.rs` what a projection keeps in all (runs, bytes) and
//! what it says when it drops something; `received.rs` the HUD's
//! `received` changes; [`hud`] and [`render`] the views.

mod bounds;
mod events;
pub mod hud;
mod received;
pub mod render;
mod run;
mod tool;

use std::collections::HashMap;

use serde_json::Value;

pub use bounds::{Bound, Node};
pub use run::{runs_in_flight, thinking_correlation_id, Item, Run, RunStatus, Thinking};
pub use tool::{bound, bound_to, content_text, ToolCall};

/// Runs kept, running or ended. Past this the run idle longest goes: an
/// ended one if there is one (forgotten), else a running one, which the
/// projection ends as truncated ([`Change::Truncated`], [`Bound::Runs`]).
pub const MAX_RUNS: usize = 200;
/// Thinking segments and tool calls kept per run; later ones are counted in
/// [`Run::dropped_items`] and shown as a number (on the HUD's `turn_end`:
/// `truncatedBy: "items"`), not kept.
pub const MAX_ITEMS_PER_RUN: usize = 256;
/// Bytes a projection keeps in all (estimated as allocated: ids, texts,
/// tool calls' arguments and results). Past it runs go as past
/// [`MAX_RUNS`] ([`Bound::Bytes`]); the run the current event is about
/// loses its texts and its oldest calls' arguments and results instead.
/// A run keeps at most [`MAX_ITEMS_PER_RUN`] × 2 × [`MAX_VALUE_BYTES`]
/// plus its text (~8 MiB), so one run always fits.
pub const MAX_BYTES: usize = 16 << 20;
/// [`MAX_BYTES`] of a feed ([`Activity::for_feed`]): what one HUD stream
/// keeps (it keeps only what a later change needs, mostly open tool calls'
/// arguments: 64 of them at their largest), and the broker's own
/// projection for `/v1/state`.
pub const MAX_FEED_BYTES: usize = 1 << 20;
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
        /// Thinking and tool calls past [`MAX_ITEMS_PER_RUN`], not kept.
        dropped_items: usize,
    },
    /// The projection stopped following something of a run still going,
    /// to stay within its bounds (the HUD's `*_end` event for it, marked
    /// `truncated`): the run idle longest went.
    Truncated {
        run_id: String,
        session_key: String,
        node: Node,
        bound: Bound,
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

/// The projection: every run seen, by session. Serializable: a HUD
/// stream moves with its projection at a handover.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
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
    /// Only the changes are wanted, never the tree ([`Activity::for_feed`]):
    /// what no later change needs is not kept.
    feed_only: bool,
    /// Bytes kept after the last event ([`Activity::bytes`]).
    #[serde(skip)]
    bytes: usize,
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

    /// The projection for a feed of changes (`/v1/hud`, `/ws/hud`: one
    /// per stream, so what it keeps is multiplied by the streams): it
    /// produces the same changes as [`Activity::new`] but keeps only what a
    /// later change needs ([`Run::shed_detail`]): no assistant output or
    /// thinking text (no HUD event carries them), a tool call's arguments
    /// and result only until its end is produced, and of an ended run only
    /// its id, session and status (later events of it change nothing). An
    /// ended run then costs ~200 bytes instead of up to 16 KiB of output
    /// plus its tool calls' arguments and results.
    pub fn for_feed() -> Self {
        Activity {
            feed_only: true,
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
