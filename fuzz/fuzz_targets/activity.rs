//! The activity projection (`activity::Activity`) and its HUD and tree
//! renderings fed arbitrary event sequences, as `clawmux top`, `tail
//! --tree/--hud` and `/v1/hud` feed them.
//!
//! Input: lines in the recording's shape (`{"dir":"in","frame":<event>,
//! "ms":…}`; `"dir":"out"` for a request the broker sent, which the HUD
//! shows as `received`; a line without `ms` is replayed history) or a bare
//! event frame; a line `gap` is a gap in the events. Seeds: the recorded
//! real-gateway run.
//! Property: no panic; the state stays within the documented caps
//! (`MAX_RUNS` runs, its byte bound, `MAX_ITEMS_PER_RUN`, `MAX_TEXT_CHARS`,
//! `MAX_VALUE_BYTES`); every change renders as a HUD JSON object; every
//! tree line is free of control and bidi characters (it goes to a terminal).
#![no_main]

use clawmux::activity::hud::hud_event;
use clawmux::activity::render::TreePrinter;
use clawmux::activity::{
    Activity, Item, Observed, MAX_ITEMS_PER_RUN, MAX_RUNS, MAX_TEXT_CHARS, MAX_VALUE_BYTES,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn check_caps(activity: &Activity) {
    let mut runs = 0;
    for (_, session_runs) in activity.sessions() {
        for run in session_runs {
            runs += 1;
            assert!(run.items.len() <= MAX_ITEMS_PER_RUN);
            assert!(run.output.chars().count() <= MAX_TEXT_CHARS);
            for item in &run.items {
                match item {
                    Item::Thinking(t) => assert!(t.text.chars().count() <= MAX_TEXT_CHARS),
                    Item::Tool(call) => {
                        assert!(call.args.to_string().len() <= MAX_VALUE_BYTES);
                        assert!(call.result.to_string().len() <= MAX_VALUE_BYTES);
                    }
                }
            }
        }
    }
    assert!(runs <= MAX_RUNS, "{runs} runs kept");
    assert!(activity.bytes() <= activity.max_bytes());
}

fn forbidden(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut activity = Activity::new();
    let mut tree = TreePrinter::new();
    for line in text.lines() {
        if line == "gap" {
            activity.forget_unfinished();
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (frame, ms) = match v.get("frame") {
            Some(frame) => (frame, v["ms"].as_u64()),
            None => (&v, None),
        };
        let replay = ms.is_none();
        let changes = if v["dir"] == "out" {
            let method = frame["method"].as_str().unwrap_or_default();
            activity.apply_request(method, &frame["params"], ms.unwrap_or(0))
        } else {
            let Some(name) = frame["event"].as_str() else {
                continue;
            };
            activity.apply(Observed {
                name,
                payload: &frame["payload"],
                received_ms: ms,
            })
        };
        for change in &changes {
            let hud = hud_event(change, replay);
            assert_eq!(hud["type"], "hud");
            assert!(hud["event"].is_string(), "{hud}");
            for line in tree.lines(change, replay, |ms| ms.to_string()) {
                if let Some(c) = line.chars().find(|&c| forbidden(c)) {
                    panic!("tree line with {c:?}: {line:?}");
                }
            }
        }
        check_caps(&activity);
    }
});
