//! The local request frame (`protocol::ClientFrame::parse`), what every
//! frame a client sends after its handshake goes through.
//!
//! Property: a frame is accepted, refused as not JSON, or refused with an
//! id to answer under (never empty); an accepted one re-encodes upstream
//! (`encode_req` with the broker's id) to a frame that decodes again with
//! the same method and the very same params bytes.
#![no_main]

use clawmux::protocol::frames::{encode_req, ClientFrameError};
use clawmux::protocol::ClientFrame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ClientFrame::parse(text) {
        Ok(frame) => {
            assert!(!frame.id.is_empty() && !frame.method.is_empty());
            let upstream = encode_req("cm-1", &frame.method, frame.params);
            let again = ClientFrame::parse(&upstream).expect("the request decodes again");
            assert_eq!(again.id, "cm-1");
            assert_eq!(again.method, frame.method);
            assert_eq!(
                again.params.map(|p| p.get()),
                frame.params.map(|p| p.get()),
                "the params pass verbatim"
            );
        }
        Err(ClientFrameError::InvalidJson) => {}
        Err(ClientFrameError::InvalidFrame { id, message }) => {
            assert!(!id.is_empty(), "an error is answered under some id");
            assert!(message.starts_with("invalid request frame"), "{message}");
        }
    }
});
