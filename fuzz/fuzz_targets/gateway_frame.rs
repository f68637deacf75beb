//! The gateway frame decoder (`protocol::UpstreamFrame::parse`) and the
//! encoders that splice its raw slices into the frames clients receive.
//!
//! Property: any text either is ignored (`None`) or decodes to an event or
//! a response whose re-encoding (`EventHead` with a per-client `seq`; a
//! response re-addressed to the client's own id) decodes again to the same
//! name, id, `seq`, and the very same payload, error and `stateVersion`
//! bytes (passed verbatim: a lone surrogate escape, which `serde_json`
//! will not decode into a `Value` but JavaScript clients accept, included).
#![no_main]

use clawmux::protocol::frames::encode_res;
use clawmux::protocol::{EventHead, EventSeq, UpstreamFrame};
use libfuzzer_sys::fuzz_target;
use serde_json::value::RawValue;

fn raw(v: Option<&RawValue>) -> Option<&str> {
    v.map(RawValue::get)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match UpstreamFrame::parse(text) {
        None => {}
        Some(UpstreamFrame::Event {
            name,
            payload,
            seq: _,
            state_version,
        }) => {
            let head = EventHead::encode(&name, payload, state_version);
            assert_eq!(head.name(), name, "the name reads back");
            let bytes = head.with_seq(u64::MAX);
            let text = std::str::from_utf8(&bytes).expect("the event is UTF-8");
            let Some(UpstreamFrame::Event {
                name: name2,
                payload: payload2,
                seq,
                state_version: state_version2,
            }) = UpstreamFrame::parse(text)
            else {
                panic!("the re-encoded event does not decode: {text}")
            };
            assert_eq!(name2, name);
            assert_eq!(raw(payload2), raw(payload), "the payload passes verbatim");
            assert_eq!(raw(state_version2), raw(state_version));
            assert_eq!(seq, EventSeq::Valid(u64::MAX));
            let bare = head.without_seq();
            let bare = std::str::from_utf8(&bare).expect("the event is UTF-8");
            assert!(matches!(
                UpstreamFrame::parse(bare),
                Some(UpstreamFrame::Event {
                    seq: EventSeq::Absent,
                    ..
                })
            ));
        }
        Some(UpstreamFrame::Res {
            id,
            ok,
            payload,
            error,
        }) => {
            // Re-addressed to the client's own id, which may need escapes.
            let local_id = format!("{id}\u{2028}\"local\"");
            let bytes = encode_res(&local_id, ok, payload, error);
            let text = std::str::from_utf8(&bytes).expect("the response is UTF-8");
            let Some(UpstreamFrame::Res {
                id: id2,
                ok: ok2,
                payload: payload2,
                error: error2,
            }) = UpstreamFrame::parse(text)
            else {
                panic!("the re-addressed response does not decode: {text}")
            };
            assert_eq!(id2, local_id);
            assert_eq!(ok2, ok);
            assert_eq!(raw(payload2), raw(payload), "the payload passes verbatim");
            assert_eq!(raw(error2), raw(error));
        }
    }
});
