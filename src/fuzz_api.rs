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

/// A moved HUD stream's projection, as the next instance reads it from the
/// clients document (`local::hud::handover`), then driven on: each run it
/// holds gets a tool call, thinking, its end, and a gap. `None` when it
/// does not read; the projection written back when it does.
pub fn hud_projection(activity: serde_json::Value) -> Option<serde_json::Value> {
    use crate::activity::{Activity, Observed};
    use serde_json::json;
    let mut projection: Activity = serde_json::from_value(activity).ok()?;
    let written = serde_json::to_value(&projection).ok()?;
    let runs: Vec<String> = written["runs"]
        .as_object()
        .map(|runs| runs.keys().cloned().collect())
        .unwrap_or_default();
    for run in runs {
        for (stream, data) in [
            (
                "tool",
                json!({"phase": "start", "toolCallId": "c", "name": "exec", "args": {}}),
            ),
            ("thinking", json!({"text": "t"})),
            (
                "tool",
                json!({"phase": "result", "toolCallId": "c", "result": {}, "isError": false}),
            ),
            ("lifecycle", json!({"phase": "end"})),
        ] {
            let payload = json!({"runId": run, "sessionKey": "agent:main:main", "stream": stream, "data": data});
            projection.apply(Observed {
                name: "agent",
                payload: &payload,
                received_ms: Some(1),
            });
        }
    }
    projection.forget_unfinished();
    Some(written)
}

/// The WebSocket frame writer of `/ws` clients (`local::ws::frames`): a
/// batch of frames laid out for vectored writes, taken by the socket in
/// any pieces, cut after the frame in progress and closed.
pub use crate::local::ws::frames::{Framed as WsFramed, Frames as WsFrames, Payload as WsPayload};
