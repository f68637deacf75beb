//! Entry points for the fuzz targets in `fuzz/` (`cargo +nightly fuzz`;
//! `.ci/fuzz.sh`) into parsers that are private to their module. Not an
//! API: hidden from the docs, and nothing in the broker calls it. Each is
//! a thin wrapper, so what is fuzzed is the code the routes run.

use http::HeaderValue;

use crate::hub::replay::{ReplayWindow, ResumePoint};

pub use crate::hub::replay::store::{
    parse as replay_log, Loaded as ReplayLogLoaded, MAX_LIVES as REPLAY_LOG_MAX_LIVES,
};

/// `/v1/events`: its query string and `Last-Event-ID` header, parsed as
/// the route parses them; the error is the 400's message.
pub fn events_query(
    query: Option<&str>,
    last_event_id: Option<&HeaderValue>,
) -> Result<ResumePoint, String> {
    crate::local::sse::parse_query(query, last_event_id, str::to_owned).map(|wanted| wanted.from)
}

/// `/v1/hud` and `/ws/hud`: the query parsed; `Ok(history)`, or the 400's message.
pub fn hud_query(query: Option<&str>) -> Result<bool, String> {
    crate::local::hud::parse_query(query).map(|(_, history)| history)
}

/// The `/v1/events` query a HUD stream opens with for a client's resume
/// point, and the cursor it stays quiet until (see `local::hud`).
pub fn hud_events_query(
    window: &ReplayWindow,
    resume: Option<&str>,
    epoch: Option<&str>,
) -> (String, Option<u64>) {
    crate::local::hud::events_query(window, resume, epoch)
}
