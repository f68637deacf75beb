//! The replay log's line parser (`hub::replay::store::parse`): what a
//! broker reads back from the file a previous life wrote.
//!
//! Input: the first byte's low bit says whether the bytes start mid-file
//! (over the read cap), the rest is the file.
//! Property: whatever the file holds (torn lines, corruption, another
//! log's lines), what is loaded is consistent: cursors strictly increase,
//! all above the floor and at most the newest; at most `MAX_LIVES` lives;
//! every event re-encodes to a frame that decodes as an event; each line is counted once.
#![no_main]

use clawmux::fuzz_api;
use clawmux::fuzz_api::REPLAY_LOG_MAX_LIVES as MAX_LIVES;
use clawmux::protocol::UpstreamFrame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, bytes)) = data.split_first() else {
        return;
    };
    let loaded = fuzz_api::replay_log(bytes, flags & 1 == 1);
    let mut last = loaded.floor;
    for (event, _ts) in &loaded.events {
        assert!(event.cursor() > last, "cursors increase, above the floor");
        last = event.cursor();
        let frame = event.head.with_seq(1);
        let frame = std::str::from_utf8(&frame).expect("a loaded event is UTF-8");
        assert!(
            matches!(
                UpstreamFrame::parse(frame),
                Some(UpstreamFrame::Event { .. })
            ),
            "a loaded event decodes as one: {frame}"
        );
    }
    assert!(last <= loaded.newest);
    assert!(loaded.lives.len() <= MAX_LIVES);
    let lines = bytes.split(|&b| b == b'\n').count();
    assert!(loaded.bad_lines + loaded.events.len() <= lines);
    assert!(loaded.skipped_bytes <= bytes.len() as u64 + 1);
});
