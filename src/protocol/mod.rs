//! The gateway's wire protocol, without any I/O.
//!
//! Everything here turns bytes into typed frames and back. Payloads stay as
//! [`RawValue`](serde_json::value::RawValue) slices so that the broker never
//! re-encodes what it only forwards; the one thing it rewrites per local client
//! is the event `seq`, which [`frames::EventHead`] appends at the end.

pub mod errors;
pub mod frames;

pub use errors::{ErrorShape, StudioCode};
pub use frames::{
    ClientFrame, ConnectRequest, EventHead, EventSeq, FirstFrameError, UpstreamFrame, PROTOCOL_MAX,
    PROTOCOL_MIN,
};

/// Milliseconds since the Unix epoch, as the gateway stamps `ts` fields.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `X-Clawmux-Scopes`: an HTTP caller's own (narrower) scopes, separated
/// by commas or spaces (the broker's routes read it; `clawmux call
/// --scopes` sends it).
pub const SCOPES_HEADER: &str = "x-clawmux-scopes";
