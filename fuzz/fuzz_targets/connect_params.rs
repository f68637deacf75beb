//! The local `connect` check: `ConnectRequest::parse_first` (the first
//! frame) then `ConnectRequest::validate` (the params the broker relies on).
//!
//! Property: every first frame maps to one of the documented close codes
//! or to a connect with a non-empty id; validated params have protocol
//! bounds of at least 1 and an `auth` that is an object.
#![no_main]

use clawmux::protocol::ConnectRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ConnectRequest::parse_first(text) {
        Err(e) => assert!(matches!(e.close_code(), 1003 | 1008), "{e}"),
        Ok(connect) => {
            assert!(!connect.id.is_empty());
            match connect.validate() {
                Ok(p) => {
                    assert!(p.min_protocol >= 1 && p.max_protocol >= 1);
                    assert!(p.auth.as_ref().is_none_or(|a| a.is_object()));
                }
                Err(message) => assert!(message.starts_with("invalid"), "{message}"),
            }
        }
    }
});
