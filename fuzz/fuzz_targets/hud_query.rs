//! The query and cursor handling of `/v1/hud` (and `/ws/hud`): its query
//! string, and the `/v1/events` query a HUD stream opens with for the
//! client's resume point (`after_seq` or `Last-Event-ID`) and `epoch`.
//!
//! Input lines: the query; the resume point; the epoch; the replay
//! window as `<epoch> <oldest_seq> <newest_seq>`.
//! Property: the query built for `/v1/events` is always a valid URI query
//! that `/v1/events` parses (at worst refusing the client's own bad id,
//! never the query itself); a resume it takes as held (the stream then
//! starts at the log's start) lies in the window.
#![no_main]

use std::sync::Arc;

use clawmux::fuzz_api;
use clawmux::hub::replay::ReplayWindow;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.split('\n');
    let query = lines.next().unwrap_or_default();
    let resume = lines.next().filter(|l| !l.is_empty());
    let epoch = lines.next().filter(|l| !l.is_empty());
    let mut window = lines.next().unwrap_or_default().split(' ');
    // The broker's own life: a non-empty visible ASCII name (16 hex digits).
    let life = window
        .next()
        .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or("c8acfedd6e9eb1b4");
    let oldest = window
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(1);
    let newest = window
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    // The log's own invariant: the oldest held is at most one past the newest.
    let window = ReplayWindow {
        epoch: Arc::from(life),
        oldest_seq: oldest.min(newest.saturating_add(1)),
        newest_seq: newest,
    };

    let _ = fuzz_api::hud_query(Some(query));

    let (events_query, resumed) = fuzz_api::hud_events_query(&window, resume, epoch);
    let uri = format!("/v1/events?{events_query}");
    assert!(uri.parse::<http::Uri>().is_ok(), "{uri:?}");
    if let Err(message) = fuzz_api::events_query(Some(&events_query), None) {
        assert!(
            message.starts_with("bad after_seq"),
            "{message} for {events_query:?}"
        );
        assert!(
            resume.is_some(),
            "a HUD without a resume point starts at the log's start"
        );
    }
    if let Some(cursor) = resumed {
        assert!(resume.is_some());
        // `resumed` is the cursor the client resumes after (records up to
        // it are applied, not sent), held or not. Only a resume the log
        // holds makes the stream start at the log's start: then it lies in
        // the window. One it does not hold goes to `/v1/events` as given
        // (which answers 410 and why).
        let start = window.oldest_seq.saturating_sub(1).to_string();
        let from_start = events_query
            .split('&')
            .any(|kv| kv == format!("after_seq={start}"));
        if from_start && resume.map(str::trim) != Some(start.as_str()) {
            assert!(
                cursor >= window.oldest_seq.saturating_sub(1) && cursor <= window.newest_seq,
                "{cursor} taken as held, outside {window:?}"
            );
        }
    }
});
