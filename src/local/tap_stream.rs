//! The records `GET /v1/events?tap=1` adds to an event stream (for
//! `clawmux record`): first `event: clawmux.hello` with the gateway's
//! `hello-ok` as the broker holds it, then `event: clawmux.tap` records with
//! what the request tap ([`crate::tap`]) copies, in order with the events.
//! Neither has an `id:`: they are not in the replay log.

use bytes::{BufMut, BytesMut};
use serde_json::json;

use crate::context::Ctx;
use crate::policy::Access;

/// Why a stream asking for observer powers (`tap=1`, `tool_events=all`) is
/// refused on this caller's socket, if it is: they show other clients'
/// traffic, and only a socket with `observe` on grants them
/// ([`crate::policy::may_observe`]). `None`: allowed (the tap still needs
/// `operator.admin`).
pub fn observer_refusal(access: &Access, tap: bool, all_tool_events: bool) -> Option<String> {
    if !(tap || all_tool_events) || crate::policy::may_observe(access) {
        return None;
    }
    let what = if tap {
        "tap=1 shows every client's requests and answers"
    } else {
        "tool_events=all shows every client's tool-stream events"
    };
    Some(format!(
        "{what}: the socket {:?} does not allow observers (set observe = true in its [[sockets]] entry)",
        access.socket.name
    ))
}

/// `event: clawmux.hello` / `data: {"hello":<payload or null>,"server_version":…,"protocol":…}`:
/// the upstream `hello-ok` payload (held without the device token, and
/// redacted again here), `null` while there is no gateway session.
pub fn hello_record(ctx: &Ctx) -> String {
    let status = ctx.upstream().status();
    let hello = status.hello.as_deref();
    let mut payload = hello.map(|h| h.payload.clone());
    if let Some(p) = payload.as_mut() {
        crate::tap::redact(p);
    }
    let data = json!({
        "hello": payload,
        "server_version": hello.map(|h| h.server_version.as_str()),
        "protocol": hello.map(|h| h.protocol),
        "phase": status.phase.as_str(),
    });
    format!("event: clawmux.hello\ndata: {data}\n\n")
}

/// One tapped frame (`{"dir":…,"frame":…}`, one JSON line already).
pub fn write_tapped(out: &mut BytesMut, record: &[u8]) {
    out.put_slice(b"event: clawmux.tap\ndata: ");
    out.put_slice(record);
    out.put_slice(b"\n\n");
}
