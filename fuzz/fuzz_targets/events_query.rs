//! The query and cursor parsers of `/v1/events`: the query string
//! (`after_seq`, `epoch`, `events`, `tap`, `tool_events`), the
//! `Last-Event-ID` header, and the event id both carry (`hub::replay::EventId`).
//!
//! Input: the query on the first line, the header's bytes after it.
//! Property: a bad query is a 400 with its message, never a panic; an
//! event id reads back as itself once written (`id:` lines are accepted
//! back by the same route); a resume point's cursor is the id's.
#![no_main]

use clawmux::fuzz_api;
use clawmux::hub::replay::EventId;
use http::HeaderValue;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (query, header) = match data.iter().position(|&b| b == b'\n') {
        Some(at) => (&data[..at], Some(&data[at + 1..])),
        None => (data, None),
    };
    let Ok(query) = std::str::from_utf8(query) else {
        return;
    };
    let header = header.and_then(|h| HeaderValue::from_bytes(h).ok());
    if let Ok(from) = fuzz_api::events_query(Some(query), header.as_ref()) {
        assert!(from.lives.len() <= 2, "an id's life and epoch=, at most");
    }
    for text in [Some(query), header.as_ref().and_then(|h| h.to_str().ok())]
        .into_iter()
        .flatten()
    {
        if let Ok(id) = text.parse::<EventId>() {
            let written = id.to_string();
            assert_eq!(written.parse::<EventId>().as_ref(), Ok(&id), "{written:?}");
            // What the route reads from `after_seq=<id>` is that id's cursor.
            let q = format!("after_seq={}", urlencode(&written));
            let from = fuzz_api::events_query(Some(&q), None).expect("a written id is accepted");
            assert_eq!(from.cursor, Some(id.cursor));
        }
    }
});

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
