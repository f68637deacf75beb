//! [`Activity::apply`]: each event goes to the handler of its kind, chosen
//! once by a table ([`HANDLERS`]) from the event's name and, for `agent`,
//! its stream; a handler reads only the fields its kind carries.

use serde_json::Value;

use super::run::{close_thinking, end_run, keep_tail};
use super::{
    event_time, message_text, positive, thinking_correlation_id, Activity, Change, Item, Observed,
    RunStatus, Thinking,
};

/// One event about a run, as its handler gets it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Event<'a> {
    /// The run it is about (`runId`, not empty).
    pub run_id: &'a str,
    /// Its payload.
    pub p: &'a Value,
    /// Its time ([`event_time`]).
    pub at: Option<u64>,
}

/// What handles one kind of event: it adds what the event changed.
type Handler = fn(&mut Activity, &Event<'_>, &mut Vec<Change>);

/// The handler of each kind of event: by event name and `agent` stream
/// (`None`: any stream), the first entry that matches. `session.tool` is
/// the tool stream sent to session subscribers (same payload). An event
/// of a name not here changes nothing.
const HANDLERS: &[(&str, Option<&str>, Handler)] = &[
    ("agent", Some("lifecycle"), Activity::on_lifecycle),
    ("agent", Some("thinking"), Activity::on_thinking),
    ("agent", Some("assistant"), Activity::on_assistant),
    ("agent", Some("tool"), Activity::apply_tool),
    ("agent", Some("item"), Activity::on_item),
    ("agent", None, Activity::on_other_stream),
    ("session.tool", None, Activity::apply_tool),
    ("chat", None, Activity::on_chat),
];

/// The handler of an event named `name` with payload `p`, if any.
fn handler(name: &str, p: &Value) -> Option<Handler> {
    let stream = p["stream"].as_str().unwrap_or("");
    HANDLERS
        .iter()
        .find(|(n, s, _)| *n == name && s.is_none_or(|s| s == stream))
        .map(|(_, _, handler)| *handler)
}

impl Activity {
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
        if let Some(handler) = handler(ev.name, p) {
            handler(self, &Event { run_id, p, at }, &mut changes);
        }
        let seen = self.events_seen;
        if let Some(run) = self.runs.get_mut(run_id) {
            if self.feed_only {
                run.shed_detail();
            }
            run.touched = seen;
            run.size.clear();
        }
        self.keep_within_bounds(Some(run_id), &mut changes);
        changes
    }

    /// `agent` `stream:"lifecycle"`: `phase` `start` | `end` | `error`.
    fn on_lifecycle(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        let Event { run_id, p, at } = *ev;
        let data = &p["data"];
        let phase = data["phase"].as_str().unwrap_or("");
        let started = positive(&data["startedAt"]);
        let start_at = if phase == "start" {
            started.or(at)
        } else {
            started
        };
        let run = self.run_entry(run_id, p, start_at, at, changes);
        if run.started_ms.is_none() {
            run.started_ms = start_at;
        }
        let end_at = positive(&data["endedAt"]).or(at);
        match phase {
            "end" if data["aborted"] == true => end_run(run, end_at, RunStatus::Aborted, changes),
            "end" => end_run(run, end_at, RunStatus::Ok, changes),
            "error" => {
                let message = data["error"].as_str().unwrap_or("error").to_owned();
                end_run(run, end_at, RunStatus::Error(message), changes)
            }
            _ => {}
        }
    }

    /// `agent` `stream:"thinking"`: begins a thinking stretch unless one is
    /// open, and sets or extends its text.
    fn on_thinking(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        let Event { run_id, p, at } = *ev;
        let data = &p["data"];
        let run = self.run_entry(run_id, p, None, at, changes);
        if !run.running() {
            return;
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

    /// `agent` `stream:"assistant"`: ends open thinking; sets or extends
    /// the run's output.
    fn on_assistant(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        let Event { run_id, p, at } = *ev;
        let data = &p["data"];
        let run = self.run_entry(run_id, p, None, at, changes);
        if !run.running() {
            return;
        }
        close_thinking(run, at, changes);
        match (data["text"].as_str(), data["delta"].as_str()) {
            (Some(text), _) => run.output = text.to_owned(),
            (None, Some(delta)) => run.output.push_str(delta),
            (None, None) => {}
        }
        keep_tail(&mut run.output);
    }

    /// `agent` `stream:"item"`: a tool call's item, for a reader without
    /// tool streams (the tool stream says more: arguments, result). The
    /// same rule live and in history. Other items are as other streams.
    fn on_item(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        if ev.p["data"]["kind"] == "tool" && self.items_only {
            self.apply_tool_item(ev, changes)
        } else {
            self.on_other_stream(ev, changes)
        }
    }

    /// Other streams (`run_status`, `usage`, `item`, …) say nothing the
    /// tree shows: they do not make a run appear.
    fn on_other_stream(&mut self, ev: &Event<'_>, _: &mut Vec<Change>) {
        if let Some(run) = self.runs.get_mut(ev.run_id) {
            run.saw(ev.at);
        }
    }

    /// `chat`: `state` `delta` | `final` | `aborted` | `error`; the final
    /// message is the run's output.
    fn on_chat(&mut self, ev: &Event<'_>, changes: &mut Vec<Change>) {
        let Event { run_id, p, at } = *ev;
        let state = p["state"].as_str().unwrap_or("");
        if !matches!(state, "delta" | "final" | "aborted" | "error") {
            // `status` (preparing, queued, …): not yet the run proper.
            if let Some(run) = self.runs.get_mut(run_id) {
                run.saw(at);
            }
            return;
        }
        let run = self.run_entry(run_id, p, None, at, changes);
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
                end_run(run, at, RunStatus::Aborted, changes)
            }
            "final" => end_run(run, at, RunStatus::Ok, changes),
            "aborted" => end_run(run, at, RunStatus::Aborted, changes),
            "error" => {
                let message = p["errorMessage"].as_str().unwrap_or("error").to_owned();
                end_run(run, at, RunStatus::Error(message), changes)
            }
            _ => {}
        }
    }
}
