//! A handover's state and clients documents (`clawmux::handover`): what a
//! new instance reads from the memfds the old one (or systemd's store)
//! passed. A document from another version, or damaged, must be refused,
//! never half taken.
//!
//! Property: parsing never panics; a document that parses names each
//! descriptor once, its main listener (if any) under the main name, and
//! comes back unchanged after being written and parsed again. A moved HUD
//! stream's projection that reads is driven on without a panic, and reads
//! back the same once written. The bytes after a NUL (which no JSON holds)
//! stand for the frames memfd beside a clients document: they are taken
//! only when its clients' queued lengths cover them exactly, each client's
//! frames then of those lengths and, end to end, those bytes.
#![no_main]

use clawmux::handover::clients::Clients;
use clawmux::handover::state::{State, MAIN_LISTENER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = State::parse(data) {
        let mut names: Vec<&str> = state.listeners.iter().map(|l| l.fd_name.as_str()).collect();
        names.sort_unstable();
        assert!(names.windows(2).all(|w| w[0] != w[1]), "a name twice: {names:?}");
        for l in &state.listeners {
            assert_eq!(l.policy.is_none(), l.fd_name == MAIN_LISTENER, "{l:?}");
        }
        let again = State::parse(&serde_json::to_vec(&state).unwrap()).expect("round trip");
        assert_eq!(again, state);
    }
    if let Some(nul) = data.iter().position(|b| *b == 0) {
        if let Ok(mut clients) = Clients::parse(&data[..nul]) {
            let frames = &data[nul + 1..];
            if clients.attach_frames(frames).is_ok() {
                let mut joined = Vec::new();
                for c in &clients.clients {
                    let lengths: Vec<usize> = c.frames.iter().map(|f| f.len()).collect();
                    assert_eq!(lengths, c.queued_lengths);
                    c.frames.iter().for_each(|f| joined.extend_from_slice(f));
                }
                assert_eq!(joined, frames);
            }
        }
    }
    if let Ok(clients) = Clients::parse(data) {
        let again = Clients::parse(&serde_json::to_vec(&clients).unwrap()).expect("round trip");
        assert_eq!(again, clients);
        for hud in clients.streams.iter().filter_map(|s| s.hud.as_ref()) {
            if let Some(written) = clawmux::fuzz_api::hud_projection(hud.activity.clone()) {
                let again = clawmux::fuzz_api::hud_projection(written.clone()).expect("reads back");
                assert_eq!(again, written);
            }
        }
    }
});
