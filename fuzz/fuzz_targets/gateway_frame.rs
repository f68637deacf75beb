//! The gateway frame decoder (`protocol::UpstreamFrame::parse`) and the
//! encoders that splice its raw slices into the frames clients receive.
//!
//! Property: any text either is ignored (`None`) or decodes to an event or
//! a response whose re-encoding (`EventHead` with a per-client `seq`; a
//! response re-addressed to the client's own id) is valid JSON carrying the
//! same name, id, payload, error and `stateVersion`.
#![no_main]

use clawmux::protocol::frames::encode_res;
use clawmux::protocol::{EventHead, UpstreamFrame};
use libfuzzer_sys::fuzz_target;
use serde_json::value::RawValue;
use serde_json::Value;

fn value(raw: Option<&RawValue>) -> Value {
    raw.map(|r| serde_json::from_str(r.get()).expect("a raw slice is JSON"))
        .unwrap_or(Value::Null)
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
            let frame: Value =
                serde_json::from_slice(&head.with_seq(u64::MAX)).expect("the event is JSON");
            assert_eq!(frame["type"], "event");
            assert_eq!(frame["event"].as_str(), Some(&*name));
            assert_eq!(frame["seq"].as_u64(), Some(u64::MAX));
            assert_eq!(frame["payload"], value(payload));
            assert_eq!(frame["stateVersion"], value(state_version));
            let bare: Value =
                serde_json::from_slice(&head.without_seq()).expect("the event is JSON");
            assert!(bare.get("seq").is_none());
        }
        Some(UpstreamFrame::Res {
            id,
            ok,
            payload,
            error,
        }) => {
            let local_id = format!("{id}\u{2028}\"local\"");
            let frame: Value = serde_json::from_slice(&encode_res(&local_id, ok, payload, error))
                .expect("the response is JSON");
            assert_eq!(frame["id"].as_str(), Some(&*local_id));
            assert_eq!(frame["ok"].as_bool(), Some(ok));
            assert_eq!(frame["payload"], value(payload));
            assert_eq!(frame["error"], value(error));
        }
    }
});
