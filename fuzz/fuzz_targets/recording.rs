//! A recording's line parser (`clawmux_mock::recording::Recording::parse`,
//! what `clawmux mock-gateway --replay` and the tests load).
//!
//! Property: any text is a recording or an error that says why, never a
//! panic; a recording's exchanges can be looked up.
#![no_main]

use clawmux_mock::recording::Recording;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Recording::parse(text) {
        Ok(recording) => {
            let _ = recording.gateway_version();
            let _ = recording.matching("chat.send", &serde_json::Value::Null);
        }
        Err(e) => assert!(!e.0.is_empty()),
    }
});
