//! What a projection keeps: at most [`MAX_RUNS`] runs and
//! [`Activity::max_bytes`] bytes (runs' ids, texts, tool calls' arguments
//! and results, estimated as allocated), and what it drops past them,
//! saying so ([`Change::Truncated`]: the HUD's `*_end` events marked
//! `truncated`).
//!
//! Past either bound the run idle longest (no event about it for the
//! longest) goes first: a run set aside after a gap, then an ended run
//! (nothing more will happen to it), then a running one, whose open
//! thinking, tool calls and turn are ended as truncated so a consumer's
//! view does not show them running forever. The run the current event is
//! about is never dropped for it; when it alone is over the byte bound its
//! texts, then its oldest tool calls' arguments and results, are dropped
//! (the calls stay, marked cut).

use serde_json::Value;

use super::{Activity, Change, Item, Run, ToolCall, MAX_RUNS};

/// Which bound made the projection drop something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// [`MAX_RUNS`]: the run was idle longest.
    Runs,
    /// [`Activity::max_bytes`]: the run was idle longest.
    Bytes,
    /// [`super::MAX_ITEMS_PER_RUN`]: later thinking and tool calls of the
    /// run were counted, not kept.
    Items,
}

impl Bound {
    /// The HUD's `truncatedBy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Runs => "runs",
            Bound::Bytes => "bytes",
            Bound::Items => "items",
        }
    }
}

/// What of a run still going the projection stopped following.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// The run itself (after its open thinking and tool calls).
    Turn {
        /// Thinking and tool calls past [`super::MAX_ITEMS_PER_RUN`], not kept.
        dropped_items: usize,
    },
    /// Its open thinking.
    Thinking {
        think_id: String,
        correlation_id: String,
    },
    /// One of its open tool calls.
    Tool(ToolCall),
}

/// A size kept beside what it measures: not part of the value (two
/// projections of the same events are equal whatever they have measured).
#[derive(Debug, Clone, Copy, Default)]
pub struct SizeCache(Option<usize>);

impl PartialEq for SizeCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl SizeCache {
    fn get_or(&mut self, measure: impl FnOnce() -> usize) -> usize {
        *self.0.get_or_insert_with(measure)
    }

    /// What it measured changed.
    pub fn clear(&mut self) {
        self.0 = None;
    }
}

/// What serde_json allocates for `v` besides the `Value` itself
/// (estimated: a map entry's node share, a string's capacity).
fn heap_bytes(v: &Value) -> usize {
    const VALUE: usize = std::mem::size_of::<Value>();
    const MAP_ENTRY: usize = 48;
    match v {
        Value::String(s) => s.capacity(),
        Value::Array(items) => {
            items.capacity() * VALUE + items.iter().map(heap_bytes).sum::<usize>()
        }
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| k.capacity() + MAP_ENTRY + VALUE + heap_bytes(v))
            .sum(),
        _ => 0,
    }
}

impl ToolCall {
    /// Bytes this call keeps besides its slot in the run.
    fn kept_bytes(&mut self) -> usize {
        let strings = self.call_id.capacity()
            + self.name.capacity()
            + self.parent_call_id.as_ref().map_or(0, String::capacity)
            + self.meta.as_ref().map_or(0, String::capacity);
        let (args, result) = (&self.args, &self.result);
        strings + self.size.get_or(|| heap_bytes(args) + heap_bytes(result))
    }

    /// Drops its arguments and result (marked cut); whether it had any.
    fn drop_values(&mut self) -> bool {
        if self.args.is_null() && self.result.is_null() {
            return false;
        }
        self.args = Value::Null;
        self.result = Value::Null;
        self.cut = true;
        self.size.clear();
        true
    }
}

impl Run {
    /// Bytes this run keeps (with its entry in the projection's map).
    fn kept_bytes(&mut self) -> usize {
        const RUN: usize = std::mem::size_of::<Run>() + 64;
        if let Some(bytes) = self.size.0 {
            return bytes;
        }
        let mut bytes = RUN
            + 2 * self.id.capacity()
            + self.session_key.capacity()
            + self.output.capacity()
            + self.items.capacity() * std::mem::size_of::<Item>();
        for item in &mut self.items {
            bytes += match item {
                Item::Thinking(t) => {
                    t.id.capacity() + t.correlation_id.capacity() + t.text.capacity()
                }
                Item::Tool(call) => call.kept_bytes(),
            };
        }
        self.size.0 = Some(bytes);
        bytes
    }

    /// Drops the next thing it can do without (its output and thinking
    /// text first, then its oldest tool call's arguments and result);
    /// whether there was one.
    fn drop_detail(&mut self) -> bool {
        self.size.clear();
        if self.output.capacity() > 0 {
            self.output = String::new();
            return true;
        }
        for item in &mut self.items {
            if let Item::Thinking(t) = item {
                if t.text.capacity() > 0 {
                    t.text = String::new();
                    return true;
                }
            }
        }
        self.items.iter_mut().any(|item| match item {
            Item::Tool(call) => call.drop_values(),
            Item::Thinking(_) => false,
        })
    }
}

impl Activity {
    /// The most bytes this projection keeps: [`super::MAX_FEED_BYTES`] for
    /// a feed ([`Activity::for_feed`], of which the broker keeps one per
    /// HUD stream), else [`super::MAX_BYTES`].
    pub fn max_bytes(&self) -> usize {
        if self.feed_only {
            super::MAX_FEED_BYTES
        } else {
            super::MAX_BYTES
        }
    }

    /// Bytes the projection kept after the last event it applied
    /// (estimated as allocated).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Brings the projection back within its bounds after an event about
    /// `current` (never dropped for it), adding what it stopped following.
    pub(super) fn keep_within_bounds(&mut self, current: Option<&str>, changes: &mut Vec<Change>) {
        while self.runs.len() > MAX_RUNS {
            let Some(id) = self.idlest(current) else {
                break;
            };
            self.drop_run(&id, Bound::Runs, changes);
        }
        let mut bytes: usize = self
            .runs
            .values_mut()
            .chain(self.set_aside.values_mut())
            .map(Run::kept_bytes)
            .sum();
        while bytes > self.max_bytes() {
            let aside = self
                .set_aside
                .values()
                .min_by_key(|r| (r.touched, r.id.clone()))
                .map(|r| r.id.clone());
            if let Some(mut run) = aside.and_then(|id| self.set_aside.remove(&id)) {
                bytes -= run.kept_bytes();
                continue;
            }
            if let Some(id) = self.idlest(current) {
                bytes -= self.drop_run(&id, Bound::Bytes, changes);
                continue;
            }
            let Some(run) = current.and_then(|id| self.runs.get_mut(id)) else {
                break;
            };
            let before = run.kept_bytes();
            if !run.drop_detail() {
                break;
            }
            bytes = bytes - before + run.kept_bytes();
        }
        self.bytes = bytes;
    }

    /// The run idle longest that may go: an ended one if there is one, else
    /// a running one; never `current`.
    fn idlest(&self, current: Option<&str>) -> Option<String> {
        self.runs
            .values()
            .filter(|r| Some(r.id.as_str()) != current)
            .min_by_key(|r| (r.running(), r.touched, r.id.clone()))
            .map(|r| r.id.clone())
    }

    /// Forgets run `id`; one still going is ended as truncated (its open
    /// thinking and tool calls, then its turn). What it kept, in bytes.
    fn drop_run(&mut self, id: &str, bound: Bound, changes: &mut Vec<Change>) -> usize {
        let Some(mut run) = self.runs.remove(id) else {
            return 0;
        };
        let bytes = run.kept_bytes();
        if !run.running() {
            return bytes;
        }
        let truncated = |node| Change::Truncated {
            run_id: run.id.clone(),
            session_key: run.session_key.clone(),
            node,
            bound,
        };
        for item in &run.items {
            match item {
                Item::Thinking(t) if !t.done => changes.push(truncated(Node::Thinking {
                    think_id: t.id.clone(),
                    correlation_id: t.correlation_id.clone(),
                })),
                Item::Tool(call) if !call.ended() => {
                    changes.push(truncated(Node::Tool(call.clone())))
                }
                _ => {}
            }
        }
        changes.push(truncated(Node::Turn {
            dropped_items: run.dropped_items,
        }));
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::super::{hud, Observed, MAX_BYTES, MAX_FEED_BYTES, MAX_ITEMS_PER_RUN};
    use super::*;
    use serde_json::json;

    fn tool_start(run: &str, call: &str, args: Value) -> Value {
        json!({"runId": run, "sessionKey": "agent:main:main", "stream": "tool",
               "data": {"phase": "start", "name": "exec", "toolCallId": call, "args": args}})
    }

    fn tool_result(run: &str, call: &str, result: Value) -> Value {
        json!({"runId": run, "sessionKey": "agent:main:main", "stream": "tool",
               "data": {"phase": "result", "name": "exec", "toolCallId": call, "isError": false, "result": result}})
    }

    fn apply(a: &mut Activity, payload: &Value) -> Vec<Value> {
        a.apply(Observed {
            name: "agent",
            payload,
            received_ms: None,
        })
        .iter()
        .map(|c| hud::hud_event(c, false))
        .collect()
    }

    /// What the projection holds, measured apart from its own estimate: as
    /// JSON (every id, text, argument and result it keeps).
    fn held(a: &Activity) -> usize {
        serde_json::to_vec(a).unwrap().len()
    }

    /// A thousand runs that never end, eight open tool calls of 2 KB each
    /// (a HUD stream's feed): at most 200 runs and 1 MiB are kept, and every
    /// run dropped is ended in the feed as truncated, its open calls first
    /// (before: every run was kept while it ran, 16 MB here and growing).
    #[test]
    fn runs_that_never_end_are_bounded_and_said_to_be_dropped() {
        let mut a = Activity::for_feed();
        let pad = "p".repeat(2048);
        let mut out = Vec::new();
        for call in 0..8 {
            for run in 0..1000 {
                let run = format!("run-{run}");
                out.extend(apply(
                    &mut a,
                    &tool_start(&run, &format!("{run}-{call}"), json!({"pad": pad})),
                ));
                assert!(a.runs.len() <= MAX_RUNS);
                assert!(a.bytes() <= MAX_FEED_BYTES);
            }
        }
        assert!(held(&a) <= MAX_FEED_BYTES, "{} bytes held", held(&a));
        let dropped = |event: &str| {
            out.iter()
                .filter(|e| e["event"] == event && e["truncated"] == true)
                .count()
        };
        assert!(
            dropped("turn_end") >= 1000 - MAX_RUNS,
            "{}",
            dropped("turn_end")
        );
        assert!(
            dropped("tool_end") >= dropped("turn_end"),
            "the open calls first"
        );
        let marker = out.iter().find(|e| e["event"] == "turn_end").unwrap();
        assert_eq!(marker["truncatedBy"], "runs", "{marker}");
        assert!(marker.get("status").is_none(), "it did not end: {marker}");
        // A dropped run seen again starts again (and is kept).
        let first = out.iter().position(|e| e["event"] == "turn_end").unwrap();
        let run = out[first]["correlationId"].as_str().unwrap().to_owned();
        let again = apply(&mut a, &tool_start(&run, "again", json!({})));
        assert_eq!(again[0]["event"], "turn_start", "{again:?}");
        assert!(a.run(&run).is_some());
    }

    /// One run whose tool calls carry huge arguments and results: what it
    /// keeps stays within the projection's bytes; in a feed the oldest open
    /// calls lose their arguments (marked cut), the run stays (before: 256
    /// open calls kept 4 MiB of arguments in each HUD stream).
    #[test]
    fn a_run_with_huge_tool_calls_stays_within_the_bytes() {
        let huge = "h".repeat(64 * 1024);
        for mut a in [Activity::for_feed(), Activity::new()] {
            for n in 0..MAX_ITEMS_PER_RUN + 10 {
                let call = format!("c{n}");
                apply(&mut a, &tool_start("big", &call, json!({"command": huge})));
                if n % 10 == 0 && n < MAX_ITEMS_PER_RUN {
                    let result = json!({"content": [{"type": "text", "text": huge}]});
                    apply(&mut a, &tool_result("big", &call, result));
                }
                assert!(
                    a.bytes() <= a.max_bytes(),
                    "{} of {}",
                    a.bytes(),
                    a.max_bytes()
                );
            }
            assert!(held(&a) <= a.max_bytes(), "{} bytes held", held(&a));
            let run = a.run("big").expect("the run the events are about stays");
            assert_eq!(run.dropped_items, 10);
            if a.max_bytes() == MAX_FEED_BYTES {
                let Some(Item::Tool(first)) = run.items.first() else {
                    panic!()
                };
                assert!(
                    first.args.is_null() && first.cut,
                    "the oldest call's arguments went"
                );
            }
        }
        const { assert!(MAX_BYTES > 2 * MAX_ITEMS_PER_RUN * super::super::MAX_VALUE_BYTES) };
    }

    /// A run with more thinking and tool calls than it keeps says so on
    /// its end.
    #[test]
    fn a_run_that_dropped_items_says_so_on_its_end() {
        let mut a = Activity::for_feed();
        for call in 0..MAX_ITEMS_PER_RUN + 3 {
            apply(&mut a, &tool_start("r", &format!("c{call}"), json!({})));
        }
        let end = json!({"runId": "r", "sessionKey": "agent:main:main", "stream": "lifecycle", "data": {"phase": "end"}});
        let out = apply(&mut a, &end);
        let turn_end = out.iter().find(|e| e["event"] == "turn_end").unwrap();
        assert_eq!(turn_end["status"], "ok");
        assert_eq!(
            (
                &turn_end["truncated"],
                &turn_end["truncatedBy"],
                &turn_end["droppedItems"]
            ),
            (&json!(true), &json!("items"), &json!(3)),
            "{turn_end}"
        );
    }

    #[test]
    fn a_values_estimate_counts_its_strings_and_entries() {
        let small = heap_bytes(&json!({"a": 1}));
        let big = heap_bytes(&json!({"a": "x".repeat(10_000)}));
        assert!(small > 0 && small < 200, "{small}");
        assert!((10_000..10_200).contains(&big), "{big}");
    }
}
