//! Frame parsing and encoding (gateway-protocol.md §1).
//!
//! Parsing borrows from the input and keeps payloads as raw JSON; encoding
//! splices those raw slices into new frames. Nothing in here touches a socket.

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::ErrorShape;

/// Lowest protocol version the broker speaks upstream (gateway-protocol.md §2.2).
pub const PROTOCOL_MIN: u64 = 3;
/// Highest protocol version the broker speaks upstream.
pub const PROTOCOL_MAX: u64 = 4;

/// Why a local client's first frame was refused; each maps to one close code
/// (the Claw3D proxy's table, gateway-protocol.md §7.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FirstFrameError {
    #[error("invalid json")]
    InvalidJson,
    /// Valid JSON nested deeper than the parser's limit (128 levels).
    #[error("too deeply nested")]
    TooDeep,
    #[error("connect required")]
    ConnectRequired,
    #[error("connect id required")]
    ConnectIdRequired,
}

impl FirstFrameError {
    /// The WebSocket close code for this refusal.
    pub fn close_code(&self) -> u16 {
        match self {
            FirstFrameError::InvalidJson | FirstFrameError::TooDeep => 1003,
            FirstFrameError::ConnectRequired | FirstFrameError::ConnectIdRequired => 1008,
        }
    }
}

/// A local client's `connect` request, checked only for what the broker needs.
///
/// The broker answers `connect` itself, so it is deliberately more lenient
/// than the gateway's closed `ConnectParams` schema: anything the gateway
/// accepts is accepted here too.
#[derive(Debug, Clone)]
pub struct ConnectRequest {
    pub id: String,
    pub params: Value,
}

/// What the broker reads from `connect` params.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectParams {
    pub min_protocol: u64,
    pub max_protocol: u64,
    /// The client asked for `agent` tool-stream events (`caps:["tool-events"]`).
    pub tool_events: bool,
    /// The client's `client.id`, for logs and `/v1/state`.
    pub client_name: Option<String>,
    /// The client's own `auth` object, if any (never logged).
    pub auth: Option<Value>,
    /// The scopes the client asked for (default-deny: none if absent).
    pub scopes: Vec<String>,
}

impl ConnectRequest {
    /// Parses a local client's first frame (design §2, local side).
    pub fn parse_first(text: &str) -> Result<ConnectRequest, FirstFrameError> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            if is_too_deep(&e) {
                FirstFrameError::TooDeep
            } else {
                FirstFrameError::InvalidJson
            }
        })?;
        let Value::Object(mut obj) = value else {
            return Err(FirstFrameError::InvalidJson);
        };
        let is_connect = obj.get("type").and_then(Value::as_str) == Some("req")
            && obj.get("method").and_then(Value::as_str) == Some("connect");
        if !is_connect {
            return Err(FirstFrameError::ConnectRequired);
        }
        let id = match obj.get("id").and_then(Value::as_str) {
            Some(id) if !id.is_empty() => id.to_owned(),
            _ => return Err(FirstFrameError::ConnectIdRequired),
        };
        let params = obj.remove("params").unwrap_or(Value::Null);
        Ok(ConnectRequest { id, params })
    }

    /// Checks the params the broker relies on; the error text follows the
    /// gateway's "invalid connect params: …" wording.
    pub fn validate(&self) -> Result<ConnectParams, String> {
        let Value::Object(p) = &self.params else {
            return Err("invalid connect params: params must be an object".into());
        };
        let proto = |key: &str| -> Result<u64, String> {
            match p.get(key).and_then(Value::as_u64) {
                Some(v) if v >= 1 => Ok(v),
                _ => Err(format!(
                    "invalid connect params: {key} must be an integer >= 1"
                )),
            }
        };
        let min_protocol = proto("minProtocol")?;
        let max_protocol = proto("maxProtocol")?;
        match p.get("role") {
            None | Some(Value::Null) => {}
            Some(Value::String(r)) if r == "operator" => {}
            Some(Value::String(r)) if r == "node" => {
                return Err("invalid role: node: a node needs its own gateway session; connect it to /ws/dedicated instead".into())
            }
            Some(_) => return Err("invalid role".into()),
        }
        let tool_events = p
            .get("caps")
            .and_then(Value::as_array)
            .is_some_and(|caps| caps.iter().any(|c| c.as_str() == Some("tool-events")));
        let client_name = p
            .get("client")
            .and_then(|c| c.get("id"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let auth = p.get("auth").filter(|a| a.is_object()).cloned();
        let scopes = string_array(p.get("scopes")).unwrap_or_default();
        Ok(ConnectParams {
            scopes,
            min_protocol,
            max_protocol,
            tool_events,
            client_name,
            auth,
        })
    }
}

/// The strings of a JSON array (e.g. `scopes`); `None` when it is not an array.
pub fn string_array(value: Option<&Value>) -> Option<Vec<String>> {
    let items = value?.as_array()?;
    Some(
        items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
    )
}

/// A request frame as the gateway's closed `req` schema defines it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictReq<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow)]
    method: Cow<'a, str>,
    #[serde(borrow, default)]
    params: Option<&'a RawValue>,
    /// The gateway's schema also allows these two (2026.9.6
    /// `RequestFrameSchema`). `traceparent` is a tracing hint: accepted and
    /// not forwarded. `expectedProfileId` is a guard the one shared upstream
    /// session cannot carry: refused with a clear error rather than dropped.
    #[serde(rename = "traceparent", borrow, default)]
    _traceparent: Option<&'a RawValue>,
    #[serde(rename = "expectedProfileId", borrow, default)]
    expected_profile_id: Option<&'a RawValue>,
}

/// A serde error about the closed `req` schema, in the gateway's own words
/// (its Ajv messages) for the two common cases.
fn gateway_wording(err: &serde_json::Error) -> String {
    let text = err.to_string();
    let field = |prefix: &str| {
        text.strip_prefix(prefix)
            .and_then(|rest| rest.split('`').next())
            .map(str::to_owned)
    };
    if let Some(name) = field("missing field `") {
        format!("must have required property '{name}'")
    } else if let Some(name) = field("unknown field `") {
        format!("at root: unexpected property '{name}'")
    } else {
        text
    }
}

/// Just enough of a frame to echo its id in an error.
#[derive(Deserialize)]
struct IdOnly<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
}

/// A request from a local client after its handshake.
#[derive(Debug)]
pub struct ClientFrame<'a> {
    pub id: Cow<'a, str>,
    pub method: Cow<'a, str>,
    pub params: Option<&'a RawValue>,
}

/// Why a post-handshake client frame was refused.
#[derive(Debug, PartialEq)]
pub enum ClientFrameError {
    /// Not JSON at all: the gateway logs and ignores these.
    InvalidJson,
    /// JSON, but not a valid `req` frame: answered with `INVALID_REQUEST`
    /// under the frame's id (or `"invalid"`), socket stays open.
    InvalidFrame { id: String, message: String },
}

impl<'a> ClientFrame<'a> {
    pub fn parse(text: &'a str) -> Result<ClientFrame<'a>, ClientFrameError> {
        match serde_json::from_str::<StrictReq<'a>>(text) {
            Ok(req) if req.expected_profile_id.is_some() && !req.id.is_empty() => {
                Err(ClientFrameError::InvalidFrame {
                    id: req.id.into_owned(),
                    message: "invalid request frame: expectedProfileId is not supported through clawmux (its clients share one gateway session); send the request without it".into(),
                })
            }
            Ok(req) if req.kind == "req" && !req.id.is_empty() && !req.method.is_empty() => {
                Ok(ClientFrame {
                    id: req.id,
                    method: req.method,
                    params: req.params,
                })
            }
            Ok(req) => Err(ClientFrameError::InvalidFrame {
                id: if req.id.is_empty() {
                    "invalid".into()
                } else {
                    req.id.into_owned()
                },
                message:
                    "invalid request frame: type must be \"req\" with a non-empty id and method"
                        .into(),
            }),
            Err(err) => {
                if let Err(e) = serde_json::from_str::<&RawValue>(text) {
                    if is_too_deep(&e) {
                        return Err(ClientFrameError::InvalidFrame {
                            id: "invalid".into(),
                            message: format!("invalid request frame: too deeply nested (more than {MAX_JSON_DEPTH} levels)"),
                        });
                    }
                    return Err(ClientFrameError::InvalidJson);
                }
                let id = serde_json::from_str::<IdOnly>(text)
                    .ok()
                    .and_then(|f| f.id)
                    .filter(|id| !id.is_empty())
                    .map(Cow::into_owned)
                    .unwrap_or_else(|| "invalid".into());
                Err(ClientFrameError::InvalidFrame {
                    id,
                    message: format!("invalid request frame: {}", gateway_wording(&err)),
                })
            }
        }
    }
}

/// A frame from the gateway. Unknown fields are tolerated everywhere.
#[derive(Debug, Deserialize)]
struct RawUpstream<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(default)]
    ok: Option<bool>,
    #[serde(borrow, default, deserialize_with = "present")]
    payload: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    error: Option<&'a RawValue>,
    #[serde(borrow, default)]
    event: Option<Cow<'a, str>>,
    #[serde(borrow, default, deserialize_with = "present")]
    seq: Option<&'a RawValue>,
    #[serde(rename = "stateVersion", borrow, default, deserialize_with = "present")]
    state_version: Option<&'a RawValue>,
}

/// A field that is present, `null` included: `Option<&RawValue>` alone
/// reads `null` as absent, and a `"payload":null` must pass through as
/// `null` (a client may read `payload` of `last-heartbeat` and crash on
/// `undefined`). Absent fields stay `None` through `#[serde(default)]`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// The `seq` of a gateway event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventSeq {
    /// No `seq` (targeted events carry none).
    Absent,
    Valid(u64),
    /// Present but not a non-negative integer (negative, a float, a
    /// string…): the event is still delivered; the anomaly is counted and logged.
    Invalid,
}

impl EventSeq {
    fn of(raw: Option<&RawValue>) -> EventSeq {
        match raw.map(RawValue::get) {
            None | Some("null") => EventSeq::Absent,
            Some(text) => text
                .parse::<u64>()
                .map_or(EventSeq::Invalid, EventSeq::Valid),
        }
    }
}

/// serde_json's nesting limit, which every parse here is subject to.
pub const MAX_JSON_DEPTH: usize = 128;

/// Whether a parse failed only because the JSON nests too deeply.
fn is_too_deep(e: &serde_json::Error) -> bool {
    e.to_string().starts_with("recursion limit exceeded")
}

/// A parsed gateway frame, borrowing from the text it came from.
#[derive(Debug)]
pub enum UpstreamFrame<'a> {
    Event {
        name: Cow<'a, str>,
        payload: Option<&'a RawValue>,
        seq: EventSeq,
        state_version: Option<&'a RawValue>,
    },
    Res {
        id: Cow<'a, str>,
        ok: bool,
        payload: Option<&'a RawValue>,
        error: Option<&'a RawValue>,
    },
}

impl<'a> UpstreamFrame<'a> {
    /// Parses a gateway frame; `None` for anything that is not a well-formed
    /// `event` or `res` (the caller logs and ignores it, as gateway clients do).
    pub fn parse(text: &'a str) -> Option<UpstreamFrame<'a>> {
        let raw: RawUpstream<'a> = serde_json::from_str(text).ok()?;
        match raw.kind.as_ref() {
            "event" => Some(UpstreamFrame::Event {
                name: raw.event.filter(|e| !e.is_empty())?,
                payload: raw.payload,
                seq: EventSeq::of(raw.seq),
                state_version: raw.state_version,
            }),
            "res" => Some(UpstreamFrame::Res {
                id: raw.id?,
                ok: raw.ok?,
                payload: raw.payload,
                error: raw.error,
            }),
            _ => None,
        }
    }
}

/// An event frame encoded once, up to its `seq` value, shared by every
/// client queue: [`EventHead::prefix`] is every byte before the value
/// (`…,"seq":`) and [`EVENT_SUFFIX`] every byte after it, so a client's
/// frame is the prefix, its own `seq` digits and the suffix
/// ([`EventHead::with_seq`] joins them; the WebSocket writer does not).
#[derive(Debug, Clone)]
pub struct EventHead {
    /// The frame up to and including `,"seq":`.
    bytes: Bytes,
    /// The broker-wide event cursor (`event_seq`) the replay log gave this
    /// event; 0 until it is logged. HTTP streams use it as the SSE `id:`.
    cursor: u64,
}

/// How every encoded event starts; the event name follows as a JSON string.
const EVENT_PREFIX: &[u8] = br#"{"type":"event","event":"#;

/// Where the per-client `seq` goes: after everything else in the frame.
const SEQ_KEY: &[u8] = br#","seq":"#;

/// Every byte of an event frame after its `seq` value.
pub const EVENT_SUFFIX: &[u8] = b"}";

impl EventHead {
    pub fn encode(
        name: &str,
        payload: Option<&RawValue>,
        state_version: Option<&RawValue>,
    ) -> Self {
        let mut buf = Vec::with_capacity(
            48 + name.len()
                + payload.map_or(0, |p| p.get().len())
                + state_version.map_or(0, |s| s.get().len()),
        );
        buf.extend_from_slice(EVENT_PREFIX);
        write_json_str(&mut buf, name);
        if let Some(p) = payload {
            buf.extend_from_slice(br#","payload":"#);
            buf.extend_from_slice(p.get().as_bytes());
        }
        if let Some(sv) = state_version {
            buf.extend_from_slice(br#","stateVersion":"#);
            buf.extend_from_slice(sv.get().as_bytes());
        }
        buf.extend_from_slice(SEQ_KEY);
        EventHead {
            bytes: buf.into(),
            cursor: 0,
        }
    }

    /// Encodes an event whose payload is a [`Value`] the broker built itself.
    pub fn from_value(name: &str, payload: &Value) -> Self {
        let raw = serde_json::value::to_raw_value(payload).ok();
        Self::encode(name, raw.as_deref(), None)
    }

    /// The whole frame with this client's `seq`.
    pub fn with_seq(&self, seq: u64) -> Bytes {
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(seq).as_bytes();
        let mut buf = BytesMut::with_capacity(self.bytes.len() + digits.len() + EVENT_SUFFIX.len());
        buf.put_slice(&self.bytes);
        buf.put_slice(digits);
        buf.put_slice(EVENT_SUFFIX);
        buf.freeze()
    }

    /// Every byte of the frame before its `seq` value (valid UTF-8: it is
    /// built from strings and raw JSON only).
    pub fn prefix(&self) -> &[u8] {
        &self.bytes
    }

    /// The whole frame without a `seq` (only `connect.challenge` is sent so).
    pub fn without_seq(&self) -> Bytes {
        let body = &self.bytes[..self.bytes.len() - SEQ_KEY.len()];
        let mut buf = BytesMut::with_capacity(body.len() + 1);
        buf.put_slice(body);
        buf.put_u8(b'}');
        buf.freeze()
    }

    /// The same event, tagged with its broker-wide cursor (`event_seq`).
    pub fn with_cursor(mut self, cursor: u64) -> Self {
        self.cursor = cursor;
        self
    }

    /// The broker-wide cursor (`event_seq`); 0 if the event was never logged.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// The event name, read back from the encoded bytes (borrowed unless
    /// the name needed JSON escapes), so it need not be stored twice.
    pub fn name(&self) -> Cow<'_, str> {
        let rest = self.bytes.get(EVENT_PREFIX.len()..).unwrap_or_default();
        let mut de = serde_json::Deserializer::from_slice(rest);
        // Deserializing one value without `end()` ignores what follows it.
        match <&str as Deserialize>::deserialize(&mut de) {
            Ok(name) => Cow::Borrowed(name),
            Err(_) => {
                let mut de = serde_json::Deserializer::from_slice(rest);
                Cow::Owned(String::deserialize(&mut de).unwrap_or_default())
            }
        }
    }

    /// The event's payload, as encoded (borrowed: nothing is copied or
    /// parsed but the name before it); `None` for an event without one.
    pub fn payload(&self) -> Option<&RawValue> {
        let rest = self.bytes.get(EVENT_PREFIX.len()..)?;
        let mut names = serde_json::Deserializer::from_slice(rest).into_iter::<Cow<'_, str>>();
        names.next()?.ok()?;
        let rest = rest
            .get(names.byte_offset()..)?
            .strip_prefix(br#","payload":"#)?;
        let mut payloads = serde_json::Deserializer::from_slice(rest).into_iter::<&RawValue>();
        payloads.next()?.ok()
    }

    /// Encoded size in bytes (used for queue accounting).
    pub fn len(&self) -> usize {
        self.bytes.len() - SEQ_KEY.len() + 16
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

fn write_json_str(buf: &mut Vec<u8>, s: &str) {
    // Writing a &str to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *buf, s);
}

/// The longest header of a client's WebSocket frame (RFC 6455 §5.2): two
/// bytes, a 64-bit length, a masking key.
pub const FRAME_HEADER_ROOM: usize = 2 + 8 + 4;

/// `{"type":"req","id":…,"method":…,"params":…}` with the params spliced in raw.
///
/// Its buffer has room for a masked frame header beyond the text
/// ([`FRAME_HEADER_ROOM`]), so a large request can be framed in place,
/// without a second buffer of its size.
pub fn encode_req(id: &str, method: &str, params: Option<&RawValue>) -> String {
    const PARAMS_KEY: &[u8] = br#","params":"#;
    let params = params.map(|p| p.get().as_bytes());
    let rest = params.map_or(0, |p| PARAMS_KEY.len() + p.len()) + 1 + FRAME_HEADER_ROOM;
    // One allocation for the whole request when `id` and `method` need no
    // escaping, as they seldom do.
    let mut buf = Vec::with_capacity(38 + id.len() + method.len() + rest);
    buf.extend_from_slice(br#"{"type":"req","id":"#);
    write_json_str(&mut buf, id);
    buf.extend_from_slice(br#","method":"#);
    write_json_str(&mut buf, method);
    // Nothing when they did not: else exactly the rest and the room, so a
    // large request's buffer is never grown by doubling and always has it.
    buf.reserve_exact(rest);
    if let Some(p) = params {
        buf.extend_from_slice(PARAMS_KEY);
        buf.extend_from_slice(p);
    }
    buf.push(b'}');
    // Built only from valid UTF-8 pieces.
    String::from_utf8(buf).unwrap_or_default()
}

/// A `res` frame with raw payload/error spliced in (used to re-address upstream answers).
pub fn encode_res(
    id: &str,
    ok: bool,
    payload: Option<&RawValue>,
    error: Option<&RawValue>,
) -> Bytes {
    let mut buf = Vec::with_capacity(
        40 + id.len() + payload.map_or(0, |p| p.get().len()) + error.map_or(0, |e| e.get().len()),
    );
    buf.extend_from_slice(br#"{"type":"res","id":"#);
    write_json_str(&mut buf, id);
    buf.extend_from_slice(if ok {
        br#","ok":true"#
    } else {
        br#","ok":false"#
    });
    if let Some(p) = payload {
        buf.extend_from_slice(br#","payload":"#);
        buf.extend_from_slice(p.get().as_bytes());
    }
    if let Some(e) = error {
        buf.extend_from_slice(br#","error":"#);
        buf.extend_from_slice(e.get().as_bytes());
    }
    buf.push(b'}');
    buf.into()
}

/// A successful `res` frame with a payload the broker built.
pub fn encode_res_ok(id: &str, payload: &Value) -> Bytes {
    let raw = serde_json::value::to_raw_value(payload).ok();
    encode_res(id, true, raw.as_deref(), None)
}

/// A successful `res` frame whose payload is the object `head` with one
/// more member, `key`, whose value is already encoded (`member`): it is
/// copied in as it is, not parsed or encoded again. `head` must be an
/// object without `key`.
pub fn encode_res_ok_with(id: &str, head: &Value, key: &str, member: &RawValue) -> Bytes {
    let mut payload = serde_json::to_vec(head).unwrap_or_else(|_| b"{}".to_vec());
    if payload.last() != Some(&b'}') {
        payload = b"{}".to_vec();
    }
    payload.pop();
    if payload.len() > 1 {
        payload.push(b',');
    }
    write_json_str(&mut payload, key);
    payload.push(b':');
    let mut buf = Vec::with_capacity(40 + id.len() + payload.len() + member.get().len() + 1);
    buf.extend_from_slice(br#"{"type":"res","id":"#);
    write_json_str(&mut buf, id);
    buf.extend_from_slice(br#","ok":true,"payload":"#);
    buf.extend_from_slice(&payload);
    buf.extend_from_slice(member.get().as_bytes());
    buf.extend_from_slice(b"}}");
    buf.into()
}

/// A failed `res` frame.
pub fn encode_res_error(id: &str, error: &ErrorShape) -> Bytes {
    let raw = serde_json::value::to_raw_value(error).ok();
    encode_res(id, false, None, raw.as_deref())
}

/// Reads `payload.status` of a response without parsing the rest
/// (`agent` answers `status:"accepted"` before its final answer).
pub fn payload_status(payload: Option<&RawValue>) -> Option<String> {
    #[derive(Deserialize)]
    struct StatusOnly {
        #[serde(default)]
        status: Option<String>,
    }
    let p = payload?;
    serde_json::from_str::<StatusOnly>(p.get()).ok()?.status
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_event_head_gives_its_payload_as_encoded() {
        let payload =
            serde_json::value::to_raw_value(&json!({"sessionKey": "a", "n": [1]})).unwrap();
        let sv = serde_json::value::to_raw_value(&json!({"health": 2})).unwrap();
        for (name, sv) in [("chat", None), ("we\"ird", Some(&*sv))] {
            let head = EventHead::encode(name, Some(&payload), sv);
            assert_eq!(head.payload().map(RawValue::get), Some(payload.get()));
        }
        assert!(EventHead::encode("tick", None, Some(&sv))
            .payload()
            .is_none());
    }

    #[test]
    fn a_res_with_an_encoded_member_is_the_object_with_that_member() {
        let member = serde_json::value::to_raw_value(&json!({"big": [1, 2]})).unwrap();
        for (head, want) in [
            (json!({}), json!({"snapshot": {"big": [1, 2]}})),
            (
                json!({"type": "hello-ok", "n": 1}),
                json!({"type": "hello-ok", "n": 1, "snapshot": {"big": [1, 2]}}),
            ),
        ] {
            let frame = encode_res_ok_with("a\"1", &head, "snapshot", &member);
            let got: Value = serde_json::from_slice(&frame).unwrap();
            assert_eq!(
                got,
                json!({"type": "res", "id": "a\"1", "ok": true, "payload": want})
            );
        }
    }

    #[test]
    fn first_frame_classification() {
        assert_eq!(
            ConnectRequest::parse_first("{nope").unwrap_err(),
            FirstFrameError::InvalidJson
        );
        assert_eq!(
            ConnectRequest::parse_first("[1,2]").unwrap_err(),
            FirstFrameError::InvalidJson
        );
        assert_eq!(
            ConnectRequest::parse_first(r#"{"type":"req","id":"1","method":"health"}"#)
                .unwrap_err(),
            FirstFrameError::ConnectRequired
        );
        assert_eq!(
            ConnectRequest::parse_first(r#"{"type":"req","id":"","method":"connect"}"#)
                .unwrap_err(),
            FirstFrameError::ConnectIdRequired
        );
        assert_eq!(
            ConnectRequest::parse_first(r#"{"type":"req","id":7,"method":"connect"}"#).unwrap_err(),
            FirstFrameError::ConnectIdRequired
        );
        let c = ConnectRequest::parse_first(
            r#"{"type":"req","id":"c1","method":"connect","params":{"minProtocol":3,"maxProtocol":4,"caps":["tool-events"]}}"#,
        )
        .unwrap();
        assert_eq!(c.id, "c1");
        let p = c.validate().unwrap();
        assert_eq!(
            (p.min_protocol, p.max_protocol, p.tool_events),
            (3, 4, true)
        );
    }

    #[test]
    fn connect_params_need_protocol_range_and_operator_role() {
        let parse = |s: &str| ConnectRequest::parse_first(s).unwrap().validate();
        assert!(parse(r#"{"type":"req","id":"c","method":"connect"}"#).is_err());
        assert!(
            parse(r#"{"type":"req","id":"c","method":"connect","params":{"minProtocol":3}}"#)
                .unwrap_err()
                .contains("maxProtocol")
        );
        assert_eq!(
            parse(r#"{"type":"req","id":"c","method":"connect","params":{"minProtocol":3,"maxProtocol":4,"role":"admin"}}"#)
                .unwrap_err(),
            "invalid role"
        );
    }

    #[test]
    fn client_frames_follow_the_closed_schema() {
        let f =
            ClientFrame::parse(r#"{"type":"req","id":"a","method":"health","params":{"x":[1]}}"#)
                .unwrap();
        assert_eq!((f.id.as_ref(), f.method.as_ref()), ("a", "health"));
        assert_eq!(f.params.unwrap().get(), r#"{"x":[1]}"#);
        assert_eq!(
            ClientFrame::parse("{oops").unwrap_err(),
            ClientFrameError::InvalidJson
        );
        match ClientFrame::parse(r#"{"type":"req","id":"z","method":"health","extra":1}"#)
            .unwrap_err()
        {
            ClientFrameError::InvalidFrame { id, message } => {
                assert_eq!(id, "z");
                assert!(message.starts_with("invalid request frame: "), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // The gateway's words for the common schema errors.
        for (frame, want) in [
            (
                r#"{"type":"req","id":"m"}"#,
                "invalid request frame: must have required property 'method'",
            ),
            (
                r#"{"type":"req","id":"m","method":"health","extra":1}"#,
                "invalid request frame: at root: unexpected property 'extra'",
            ),
        ] {
            match ClientFrame::parse(frame).unwrap_err() {
                ClientFrameError::InvalidFrame { message, .. } => assert_eq!(message, want),
                other => panic!("{other:?}"),
            }
        }
        // `traceparent` is in the gateway's schema: accepted (not forwarded).
        let f = ClientFrame::parse(
            r#"{"type":"req","id":"t","method":"health","traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#,
        )
        .unwrap();
        assert_eq!(f.method, "health");
        // `expectedProfileId` is refused, never silently dropped.
        match ClientFrame::parse(
            r#"{"type":"req","id":"p","method":"health","expectedProfileId":"u1"}"#,
        )
        .unwrap_err()
        {
            ClientFrameError::InvalidFrame { id, message } => {
                assert_eq!(id, "p");
                assert!(
                    message.contains("expectedProfileId is not supported"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        match ClientFrame::parse(r#"{"type":"event","event":"x"}"#).unwrap_err() {
            ClientFrameError::InvalidFrame { id, .. } => assert_eq!(id, "invalid"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn event_head_splices_seq_once_encoded() {
        let text = r#"{"type":"event","event":"chat","payload":{"a":"é\"x"},"seq":9,"stateVersion":{"presence":1,"health":2},"extra":true}"#;
        let UpstreamFrame::Event {
            name,
            payload,
            seq,
            state_version,
        } = UpstreamFrame::parse(text).unwrap()
        else {
            panic!()
        };
        assert_eq!(seq, EventSeq::Valid(9));
        let head = EventHead::encode(&name, payload, state_version);
        let framed = head.with_seq(42);
        let v: Value = serde_json::from_slice(&framed).unwrap();
        assert_eq!(v["seq"], 42);
        assert_eq!(v["payload"]["a"], "é\"x");
        assert_eq!(v["stateVersion"]["health"], 2);
        assert!(v.get("extra").is_none());
        let bare: Value = serde_json::from_slice(&head.without_seq()).unwrap();
        assert!(bare.get("seq").is_none());
        assert_eq!(head.name(), "chat");
        assert_eq!(head.cursor(), 0);
        assert_eq!(head.with_cursor(7).cursor(), 7);
    }

    #[test]
    fn event_names_read_back_even_with_escapes() {
        let head = EventHead::from_value("odd \"name\"\n", &serde_json::json!({}));
        assert_eq!(head.name(), "odd \"name\"\n");
        let plain = EventHead::encode("session.message", None, None);
        assert!(matches!(plain.name(), Cow::Borrowed("session.message")));
    }

    #[test]
    fn responses_are_readdressed_verbatim() {
        let text =
            r#"{"type":"res","id":"up-1","ok":true,"payload":{"runId":"r","status":"accepted"}}"#;
        let UpstreamFrame::Res {
            id,
            ok,
            payload,
            error,
        } = UpstreamFrame::parse(text).unwrap()
        else {
            panic!()
        };
        assert_eq!(id, "up-1");
        assert_eq!(payload_status(payload).as_deref(), Some("accepted"));
        let out = encode_res("local \"1\"", ok, payload, error);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["id"], "local \"1\"");
        assert_eq!(v["payload"]["runId"], "r");
        let req: Value = serde_json::from_str(&encode_req("u1", "chat.send", None)).unwrap();
        assert_eq!(
            req,
            serde_json::json!({"type":"req","id":"u1","method":"chat.send"})
        );
    }

    #[test]
    fn garbage_upstream_frames_are_ignored() {
        assert!(UpstreamFrame::parse("nope").is_none());
        assert!(UpstreamFrame::parse(r#"{"type":"event"}"#).is_none());
        assert!(UpstreamFrame::parse(r#"{"type":"res","id":"x"}"#).is_none());
        assert!(UpstreamFrame::parse(r#"{"type":"hello"}"#).is_none());
    }

    #[test]
    fn anomalous_seqs_are_kept_apart_from_absent_ones() {
        let seq_of = |frame: &str| match UpstreamFrame::parse(frame) {
            Some(UpstreamFrame::Event { seq, .. }) => seq,
            other => panic!("{other:?}"),
        };
        assert_eq!(seq_of(r#"{"type":"event","event":"x"}"#), EventSeq::Absent);
        assert_eq!(
            seq_of(r#"{"type":"event","event":"x","seq":7}"#),
            EventSeq::Valid(7)
        );
        for bad in ["-1", "1.5", "\"3\"", "true"] {
            let frame = format!(r#"{{"type":"event","event":"x","seq":{bad}}}"#);
            assert_eq!(seq_of(&frame), EventSeq::Invalid, "{bad}");
        }
    }

    #[test]
    fn deep_nesting_is_named() {
        let deep = format!(
            r#"{{"type":"req","id":"c","method":"connect","params":{{"x":{}1{}}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(
            ConnectRequest::parse_first(&deep).unwrap_err(),
            FirstFrameError::TooDeep
        );
        assert_eq!(FirstFrameError::TooDeep.to_string(), "too deeply nested");
        let after = format!(
            r#"{{"type":"req","id":"r","method":"x","params":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        // After connect, params pass through as raw JSON, however deep (as
        // the gateway's own parser takes them).
        assert!(ClientFrame::parse(&after).is_ok());
    }

    #[test]
    fn a_null_payload_passes_through_as_null() {
        let text = r#"{"type":"res","id":"cm-1","ok":true,"payload":null}"#;
        let Some(UpstreamFrame::Res {
            id,
            ok,
            payload,
            error,
        }) = UpstreamFrame::parse(text)
        else {
            panic!("a res frame")
        };
        let out = encode_res("mine", ok, payload, error);
        assert_eq!(
            &out[..],
            br#"{"type":"res","id":"mine","ok":true,"payload":null}"#,
            "{id}"
        );
        let absent = r#"{"type":"res","id":"cm-2","ok":true}"#;
        let Some(UpstreamFrame::Res { payload, .. }) = UpstreamFrame::parse(absent) else {
            panic!()
        };
        assert!(payload.is_none());
        let event = r#"{"type":"event","event":"x","payload":null,"seq":null}"#;
        match UpstreamFrame::parse(event) {
            Some(UpstreamFrame::Event { payload, seq, .. }) => {
                assert_eq!(payload.map(RawValue::get), Some("null"));
                assert_eq!(seq, EventSeq::Absent);
            }
            other => panic!("{other:?}"),
        }
    }
}
