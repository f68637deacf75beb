//! The local request frame (`protocol::ClientFrame::parse`), what every
//! frame a client sends after its handshake goes through.
//!
//! Property: a frame is accepted, refused as not JSON, or refused with an
//! id to answer under (never empty); an accepted one re-encodes upstream
//! (`encode_req` with the broker's id) to valid JSON with the same method
//! and params.
#![no_main]

use clawmux::protocol::frames::{encode_req, ClientFrameError};
use clawmux::protocol::ClientFrame;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ClientFrame::parse(text) {
        Ok(frame) => {
            assert!(!frame.id.is_empty() && !frame.method.is_empty());
            let upstream: Value =
                serde_json::from_str(&encode_req("cm-1", &frame.method, frame.params))
                    .expect("the request is JSON");
            assert_eq!(upstream["type"], "req");
            assert_eq!(upstream["id"], "cm-1");
            assert_eq!(upstream["method"].as_str(), Some(&*frame.method));
            let params = frame
                .params
                .map(|p| serde_json::from_str::<Value>(p.get()).expect("raw params are JSON"));
            assert_eq!(upstream.get("params"), params.as_ref());
        }
        Err(ClientFrameError::InvalidJson) => {}
        Err(ClientFrameError::InvalidFrame { id, message }) => {
            assert!(!id.is_empty(), "an error is answered under some id");
            assert!(message.starts_with("invalid request frame"), "{message}");
        }
    }
});
