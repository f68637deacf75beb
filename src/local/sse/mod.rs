//! `GET /v1/events`: gateway events as Server-Sent Events, resumable by cursor.
//!
//! An SSE stream is a hub [`Client`] of kind [`ClientKind::Sse`]: it gets the
//! same byte-counted queue, drops and slow-consumer close as a WebSocket
//! client; only its writer differs. Instead of a task writing to a socket,
//! the response body *is* the writer: hyper polls it for the next chunk, and
//! it formats what the queue holds as `id:`/`event:`/`data:` records, with
//! the durable broker cursor `event_seq` as `id:` (a plain integer that no
//! broker life repeats), so the id a browser `EventSource` resends as
//! `Last-Event-ID` resumes, across broker restarts too, or is answered 410.
//! Events after the requested cursor come from the replay log first; the
//! hub admits the client in the same lock, so backlog and live events meet
//! with no hole and no overlap. Where the cursors a stream receives skip (an
//! upstream gap or reconnect, or events this stream's queue dropped) it also
//! gets a `clawmux.gap` record, so even a filtered stream learns of the
//! hole; a broker restart is a logged `clawmux.gap` record with an `id:`.
//! At a handover the stream moves, on the same response ([`moving`]).
//!
//! Server-Sent Events are formatted by hand: the format is three kinds of
//! line, and hyper (without a framework) has no helper for it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::respond::{error_response, shape_response, Body};
use super::ConnectionKill;

mod handover;

use crate::context::Ctx;
use crate::hub::replay::{EventId, ResumePoint, GAP_EVENT};
use crate::hub::{Client, ClientKind, Outgoing, SubscribeError};
use crate::protocol::{ErrorShape, EventHead, StudioCode};
pub(crate) use handover::{
    body_of, end_with, moved_access, take_over, take_over_socket, unwritten_of, watch, write_on,
    BodySource, Movable,
};

/// Response header naming the broker life serving the stream (information:
/// cursors are valid across lives).
pub const EPOCH_HEADER: &str = "clawmux-epoch";
/// Response header with the cursor the stream starts after (the requested
/// one, or the newest at the moment a stream "from now" was admitted), so a
/// client can resume exactly even before it has seen an event.
pub const AFTER_SEQ_HEADER: &str = "clawmux-after-seq";
/// Response header with the newest cursor when the stream was admitted:
/// records up to it come from the replay log, later ones are live.
pub const NEWEST_SEQ_HEADER: &str = "clawmux-newest-seq";

/// How long a stream killed as a slow consumer (or at shutdown) may take to
/// end on its own before its connection is cut.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Backlog is sent in chunks of about this size, so a long replay reaches
/// the client steadily instead of as one huge write.
const CHUNK_BYTES: usize = 64 * 1024;

/// The query string of `/v1/events`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    /// Resume after this cursor, exclusive (an old-style
    /// `<epoch>:<cursor>` id is read as its cursor).
    after_seq: Option<String>,
    /// Accepted for older clients, information only: cursors are durable.
    epoch: Option<String>,
    /// Comma-separated event names to keep; all when absent.
    events: Option<String>,
    /// `1`: also the request tap ([`crate::tap`]) and a first
    /// `clawmux.hello` record (for `clawmux record`).
    tap: Option<String>,
    /// `all`: every targeted event the broker receives (tool streams,
    /// `session.*`, `sessions.changed`: an observer's opt-in, see
    /// [`crate::sharing::Reader::observer`]); `own` (default): none, as for
    /// any client that started no run and holds no subscription.
    tool_events: Option<String>,
    /// Comma-separated session keys (`main` and short keys as the gateway
    /// reads them): only events about these sessions.
    session: Option<String>,
    /// Comma-separated agent ids: only events about these agents' sessions
    /// (`agent:<id>:…`).
    agent: Option<String>,
}

/// What a stream asked for, parsed (the hub checks the resume point).
#[derive(Debug)]
pub(crate) struct StreamRequest {
    pub(crate) from: ResumePoint,
    filter: Option<HashSet<String>>,
    sessions: crate::hub::about::SessionFilter,
    tap: bool,
    /// The stream observes every targeted event (`tool_events=all`).
    observe_tools: bool,
}

/// A stream's query string and `Last-Event-ID` header, parsed (the fuzz
/// targets reach it without a request).
/// `canonical` spells a session key the way the gateway does.
pub(crate) fn parse_query(
    query: Option<&str>,
    last_event_id: Option<&HeaderValue>,
    canonical: impl Fn(&str) -> String,
) -> Result<StreamRequest, String> {
    let query: EventsQuery = serde_urlencoded::from_str(query.unwrap_or("")).map_err(|e| {
        format!(
            "bad query: {e}; expected after_seq=<cursor>, events=<name,name>, session=<key,key>, agent=<id,id>, tool_events=own|all"
        )
    })?;
    let after_seq = query
        .after_seq
        .map(|text| text.parse::<EventId>())
        .transpose()
        .map_err(|e| format!("bad after_seq: {e}"))?;
    // An empty Last-Event-ID is what an EventSource holds after an empty
    // `id:` line: no cursor.
    let last_event_id = last_event_id
        .map(|v| v.to_str().unwrap_or("\u{fffd}").trim())
        .filter(|text| !text.is_empty())
        .map(|text| text.parse::<EventId>())
        .transpose()
        .map_err(|e| format!("bad Last-Event-ID: {e}"))?;
    let tap = match query.tap.as_deref() {
        None | Some("0") | Some("false") => false,
        Some("1") | Some("true") => true,
        Some(other) => return Err(format!("bad tap={other}: expected tap=1 or tap=0")),
    };
    let list = |text: Option<String>| {
        text.map(|list| {
            list.split(',')
                .map(str::trim)
                .filter(|name| !name.is_empty())
                .map(str::to_owned)
                .collect::<HashSet<_>>()
        })
        .filter(|set| !set.is_empty())
    };
    let filter = list(query.events);
    let sessions = crate::hub::about::SessionFilter {
        sessions: list(query.session).map(|keys| keys.iter().map(|k| canonical(k)).collect()),
        agents: list(query.agent),
    };
    let observe_tools = match query.tool_events.as_deref() {
        None | Some("own") => false,
        Some("all") => true,
        Some(other) => {
            return Err(format!(
                "bad tool_events={other}: expected tool_events=own or tool_events=all"
            ))
        }
    };
    Ok(StreamRequest {
        observe_tools,
        from: ResumePoint::new(
            last_event_id,
            after_seq,
            query.epoch.filter(|e| !e.is_empty()),
        ),
        filter,
        sessions,
        tap,
    })
}

/// Answers `/v1/events`: 200 with a stream, 400 for a bad query, 403 for
/// `tap=1` without `operator.admin`, 410 for a cursor the log cannot serve
/// (older than the oldest kept, or never handed out), 503 at the client limit.
///
/// The stream moves at a handover with its connection ([`moving`]).
pub fn open(req: &Request<Incoming>, ctx: &Arc<Ctx>) -> Response<Body> {
    open_from(
        Opening {
            query: req.uri().query().map(str::to_owned),
            last_event_id: req.headers().get("last-event-id").cloned(),
            access: super::respond::http_access(req, ctx),
            peer_pid: req.extensions().get::<super::PeerPid>().and_then(|p| p.0),
            kill: req
                .extensions()
                .get::<ConnectionKill>()
                .map(|k| k.0.clone()),
            socket: super::movable_socket(req),
            reader_left: None,
        },
        ctx,
    )
}

/// What opens a stream: the request's parts ([`open`]), or those a HUD
/// stream opens its feed with (here, or in the instance it moved to).
pub(crate) struct Opening {
    pub(crate) query: Option<String>,
    pub(crate) last_event_id: Option<HeaderValue>,
    pub(crate) access: crate::policy::Access,
    pub(crate) peer_pid: Option<u32>,
    /// Cuts the connection (a stream that does not drain once closed).
    pub(crate) kill: Option<CancellationToken>,
    /// The connection's socket, when the stream moves at a handover.
    pub(crate) socket: Option<super::ConnSocket>,
    /// Cancelled when the stream's reader is done with it without
    /// dropping it (a HUD stream that moved: its feed is reopened in the
    /// next instance), so its watch ends.
    pub(crate) reader_left: Option<CancellationToken>,
}

/// Opens a stream from its parts (see [`open`] for the answers).
pub(crate) fn open_from(opening: Opening, ctx: &Arc<Ctx>) -> Response<Body> {
    let wanted = match parse_query(
        opening.query.as_deref(),
        opening.last_event_id.as_ref(),
        |k| ctx.sharing.canonical(k),
    ) {
        Ok(w) => w,
        Err(message) => return error_response(StatusCode::BAD_REQUEST, "INVALID_REQUEST", message),
    };
    let client = ctx.hub.new_client_of_kind(ClientKind::Sse);
    client.set_access(opening.access);
    if let Some(refusal) = client.access().and_then(|a| {
        crate::local::tap_stream::observer_refusal(a, wanted.tap, wanted.observe_tools)
    }) {
        return error_response(
            StatusCode::FORBIDDEN,
            StudioCode::Forbidden.as_str(),
            refusal,
        );
    }
    if wanted.tap && !client.grant().is_admin() {
        // The tap shows every client's requests and answers.
        return error_response(
            StatusCode::FORBIDDEN,
            StudioCode::Forbidden.as_str(),
            "tap=1 shows every client's requests and answers: it needs operator.admin, which this caller does not hold (its socket's policy or X-Clawmux-Scopes)".into(),
        );
    }
    let _ = client.identity.set(crate::hub::ClientIdentity {
        peer_pid: opening.peer_pid,
        ..Default::default()
    });
    // Before admission: history and live events are filtered alike.
    client
        .observer
        .store(wanted.observe_tools, std::sync::atomic::Ordering::Relaxed);
    // Names and sessions are filtered as events are queued (history, as
    // it is written).
    want_filters(&client, &wanted);
    let (backlog, window) = match ctx.hub.admit_at_cursor(&client, &wanted.from) {
        Ok(admitted) => admitted,
        Err(SubscribeError::ReplayUnavailable(gone)) => {
            let error = ErrorShape::studio(StudioCode::ReplayUnavailable, gone.to_string())
                .with_retryable(false)
                .with_details(json!({
                    "oldest_seq": gone.window.oldest_seq,
                    "newest_seq": gone.window.newest_seq,
                    "epoch": &*gone.window.epoch,
                }));
            return shape_response(StatusCode::GONE, &error);
        }
        Err(SubscribeError::TooManyClients(e)) => {
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                StudioCode::TooManyClients.as_str(),
                format!("{e}; close another client or raise max_clients"),
            );
        }
    };
    let epoch = window.epoch;
    let after = wanted.from.cursor.unwrap_or(window.newest_seq);
    let hello = wanted.tap.then(|| {
        ctx.router.tap.attach(Arc::clone(&client));
        crate::local::tap_stream::hello_record(ctx)
    });
    tracing::info!(client_id = client.id, cursor = ?wanted.from.cursor, backlog = backlog.events.len(), "event stream opened");
    let done = opening
        .reader_left
        .as_ref()
        .map_or_else(CancellationToken::new, CancellationToken::child_token);
    let peer_pid = opening.peer_pid;
    // Moves at a handover when it has a socket of its own to move.
    let socket = opening.socket;
    let stream = EventStream {
        client: Arc::clone(&client),
        last_cursor: after,
        last_seq: 0,
        gap_pending: false,
        hole: None,
        gap_after_backlog: backlog.gap_after,
        backlog: backlog.events.into_iter(),
        tapped: wanted.tap,
        keepalive: ctx.settings.limits.sse_keepalive,
        last_write: Instant::now(),
        cancel: ctx.cancel.clone(),
        handover: ctx.handover.requested.clone(),
        moves: socket.is_some(),
        query: opening.query.unwrap_or_default(),
        peer_pid,
        finished: false,
        registration: Registration {
            ctx: Arc::clone(ctx),
            client_id: client.id,
            done: done.clone(),
            tapped: wanted.tap,
            moved: false,
        },
    };
    let first = Bytes::from(format!(
        ": clawmux events, epoch {epoch}\n\nretry: 1000\n\n{}",
        hello.unwrap_or_default()
    ));
    let (chunks, on_stop) = handover::body_of(first, stream);
    let (mut resp, drained) =
        super::respond::event_stream_response_watched(chunks, ctx.hub.queue_budget());
    client.hold_outside(Arc::new(drained.clone()));
    // A HUD stream reading this one counts what it holds as this client's.
    resp.extensions_mut()
        .insert(StreamClient(Arc::clone(&client)));
    if let Some(kill) = opening.kill {
        ctx.tracker.spawn(handover::watch(
            Arc::clone(ctx),
            Some(Arc::clone(&client)),
            done,
            kill,
            socket.map(|socket| {
                handover::Movable::new(socket, on_stop, drained, ctx.hub.queue_budget())
            }),
        ));
    }
    let headers = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&epoch) {
        headers.insert(EPOCH_HEADER, v);
    }
    headers.insert(AFTER_SEQ_HEADER, HeaderValue::from(after));
    headers.insert(NEWEST_SEQ_HEADER, HeaderValue::from(window.newest_seq));
    resp
}

/// The hub client of an event stream, on its response (for a HUD stream
/// built on it).
#[derive(Debug, Clone)]
pub(crate) struct StreamClient(pub(crate) Arc<Client>);

/// Leaves the hub when the stream is dropped (the reader went away or the
/// stream ended), whichever way that happens.
struct Registration {
    ctx: Arc<Ctx>,
    client_id: u64,
    done: CancellationToken,
    tapped: bool,
    /// Left for the next instance (which serves it on).
    moved: bool,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.tapped {
            self.ctx.router.tap.detach(self.client_id);
        }
        self.ctx.hub.remove(self.client_id);
        self.done.cancel();
        if self.moved {
            tracing::debug!(
                client_id = self.client_id,
                "event stream left for the next instance"
            );
        } else {
            tracing::info!(client_id = self.client_id, "event stream closed");
        }
    }
}

/// What the body does next.
pub(crate) enum Step {
    /// Write this.
    Chunk(Bytes),
    /// End the response (after the last chunk).
    End,
    /// Stop for a handover, every chunk so far handed out: the stream
    /// moves ([`moving`]).
    Stop,
}

/// The writer of one SSE client, driven by hyper polling the body (or, in
/// an instance it moved to, by [`moving`]'s writer).
struct EventStream {
    client: Arc<Client>,
    /// The newest cursor this stream has received (written or filtered
    /// out), or where it started: where a gap it reports begins.
    last_cursor: u64,
    /// The last per-client `seq` of a live event: a later one more than one
    /// past it is a gap (an upstream gap or reconnect, or events this
    /// stream's queue dropped). Cursors cannot tell: they also skip the
    /// targeted events this reader may not see.
    last_seq: u64,
    /// A gap comes before the next event written.
    gap_pending: bool,
    /// Where that gap lies, from the events the hub passed over for this
    /// stream (`events=`): the newest cursor before it, the first after.
    hole: Option<(u64, Option<u64>)>,
    /// The history ends with a gap (before the first live event).
    gap_after_backlog: bool,
    /// History: events and whether a gap comes before each.
    backlog: std::vec::IntoIter<(EventHead, bool)>,
    /// Receives the request tap: its `Outgoing::Frame`s are tapped frames.
    tapped: bool,
    keepalive: Duration,
    last_write: Instant,
    cancel: CancellationToken,
    /// Cancelled when the clients are to be handed over.
    handover: CancellationToken,
    /// It stops for a handover (it has a socket of its own).
    moves: bool,
    /// Its query string, as it was opened (or moved) with.
    query: String,
    peer_pid: Option<u32>,
    finished: bool,
    registration: Registration,
}

impl EventStream {
    /// The next piece of the body.
    async fn next(&mut self) -> Step {
        if self.finished {
            return Step::End;
        }
        // Before the history too: what it has not written moves.
        if self.moves && self.handover.is_cancelled() {
            return Step::Stop;
        }
        let mut out = BytesMut::new();
        self.write_backlog(&mut out, CHUNK_BYTES);
        if !out.is_empty() {
            return Step::Chunk(self.sent(out));
        }
        loop {
            let idle_until = self.last_write + self.keepalive;
            let batch = tokio::select! {
                batch = self.client.next_batch() => batch,
                _ = tokio::time::sleep_until(idle_until.into()) => {
                    return Step::Chunk(self.sent(BytesMut::from(&b": keep-alive\n\n"[..])));
                }
                _ = self.cancel.cancelled() => {
                    // Not moved at a handover: told to come back.
                    let (code, reason) = if self.handover.is_cancelled() {
                        (1012, "service restart")
                    } else {
                        (1001, "going away")
                    };
                    write_close(&mut out, code, reason);
                    self.finished = true;
                    return Step::Chunk(self.sent(out));
                }
                _ = self.handover.cancelled(), if self.moves => return Step::Stop,
            };
            self.write_batch(&mut out, batch);
            if !out.is_empty() {
                return Step::Chunk(self.sent(out));
            }
        }
    }

    /// Writes history until `out` holds `limit` bytes or the history ends.
    fn write_backlog(&mut self, out: &mut BytesMut, limit: usize) {
        while out.len() < limit {
            let Some((head, gap)) = self.backlog.next() else {
                self.gap_pending |= std::mem::take(&mut self.gap_after_backlog);
                break;
            };
            self.gap_pending |= gap;
            self.write_event(out, &head, Filtered::NotYet);
        }
    }

    /// Writes what the queue gave, up to a close (which ends the stream).
    fn write_batch(&mut self, out: &mut BytesMut, batch: Vec<Outgoing>) {
        for item in batch {
            match item {
                Outgoing::Event(head, seq) => {
                    if seq > self.last_seq + 1 {
                        self.gap_pending = true;
                        // Given only some names, it did not get the events
                        // around the gap: the hub kept their cursors.
                        self.hole = self.hole.or_else(|| self.client.take_hole());
                    }
                    self.last_seq = seq;
                    self.write_event(out, &head, Filtered::ByTheHub)
                }
                Outgoing::Frame(frame) if self.tapped => {
                    crate::local::tap_stream::write_tapped(out, &frame)
                }
                // Responses and greetings are for WebSocket clients only.
                Outgoing::Frame(_) => {}
                Outgoing::Close(code, reason) => {
                    write_close(out, code, &reason);
                    self.finished = true;
                    break;
                }
            }
        }
    }

    fn sent(&mut self, out: BytesMut) -> Bytes {
        self.last_write = Instant::now();
        out.freeze()
    }

    /// Writes one event the stream may see (live, the hub decided; in
    /// history, the log, by the same rule), after the gap before it if
    /// any, unless this stream's filters leave it out.
    fn write_event(&mut self, out: &mut BytesMut, head: &EventHead, filtered: Filtered) {
        let cursor = head.cursor();
        let name = head.name();
        if cursor == 0 {
            // Not logged (a copy the broker made for WebSocket
            // subscribers): no cursor to resume from, so no `id:`.
            if self.keeps(&name, head, filtered) {
                write_unlogged(out, &name, &head.without_seq());
            }
            return;
        }
        if name == GAP_EVENT {
            // A logged gap (a broker restart): it says what it covers,
            // whatever the filter, with an id to resume after.
            self.gap_pending = false;
            self.last_cursor = self.last_cursor.max(cursor);
            write_logged_gap(out, cursor, head);
            return;
        }
        if std::mem::take(&mut self.gap_pending) {
            let (after, next) = match self.hole.take() {
                Some((before, after)) => (
                    self.last_cursor.max(before),
                    after.map_or(cursor, |a| a.min(cursor)),
                ),
                None => (self.last_cursor, cursor),
            };
            write_gap(out, after, next);
        }
        self.last_cursor = self.last_cursor.max(cursor);
        if self.keeps(&name, head, filtered) {
            write_record(out, cursor, &name, &head.with_seq(cursor));
        }
    }

    /// Whether this stream's filters (`events=`, `session=`, `agent=`, its
    /// client's: [`crate::hub::Client::want`]) keep it: the hub applied
    /// them to live events as it queued them; history is filtered here.
    fn keeps(&self, name: &str, head: &EventHead, filtered: Filtered) -> bool {
        filtered == Filtered::ByTheHub
            || self
                .client
                .is_given(name, &crate::hub::about::About::new(head.payload()))
    }
}

/// Whether an event a stream writes has been through its filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Filtered {
    /// Queued live: the hub kept it for this stream.
    ByTheHub,
    /// From history.
    NotYet,
}

/// Gives a stream's client the filters the stream asked for: applied
/// from now on as events are queued for it.
pub(crate) fn want_filters(client: &crate::hub::Client, wanted: &StreamRequest) {
    client.want(
        wanted
            .filter
            .as_ref()
            .map(|names| names.iter().map(|n| Box::from(n.as_str())).collect()),
        wanted.sessions.clone(),
    );
}

/// One SSE record, `id: <cursor>`. `data` is a JSON frame whose `seq` is
/// the cursor: a raw newline can only be insignificant whitespace in JSON,
/// so it becomes a space and the frame stays one `data:` line.
fn write_record(out: &mut BytesMut, cursor: u64, name: &str, data: &[u8]) {
    out.put_slice(b"id: ");
    out.put_slice(cursor.to_string().as_bytes());
    out.put_u8(b'\n');
    write_event_body(out, name, data);
}

/// The `event:` and `data:` lines of a record, and its end.
fn write_event_body(out: &mut BytesMut, name: &str, data: &[u8]) {
    out.put_slice(b"event: ");
    // Event names come from the gateway; keep the record intact whatever they hold.
    out.put_slice(name.replace(['\n', '\r'], " ").as_bytes());
    out.put_slice(b"\ndata: ");
    if data.contains(&b'\n') || data.contains(&b'\r') {
        out.extend(
            data.iter()
                .map(|&b| if b == b'\n' || b == b'\r' { b' ' } else { b }),
        );
    } else {
        out.put_slice(data);
    }
    out.put_slice(b"\n\n");
}

/// A record for an event outside the log: no `id:` (an `EventSource` keeps
/// the last real one) and no `seq` in its frame.
fn write_unlogged(out: &mut BytesMut, name: &str, data: &[u8]) {
    write_event_body(out, name, data);
}

/// Says that events after cursor `after` and before `next` were not
/// delivered (an upstream gap or reconnect, or this stream's queue dropped
/// them). It has no `id:`, so a resuming `EventSource` keeps the id of the
/// last real event, and a replay from there shows the same gap again.
fn write_gap(out: &mut BytesMut, after: u64, next: u64) {
    let data = json!({"after": after, "next": next}).to_string();
    out.put_slice(b"event: clawmux.gap\ndata: ");
    out.put_slice(data.as_bytes());
    out.put_slice(b"\n\n");
}

/// A gap the log holds (a broker restart): `id: <cursor>` and, as `data`,
/// its payload, shaped like [`write_gap`]'s (`after`, `next`) plus what
/// the broker knows of the downtime.
fn write_logged_gap(out: &mut BytesMut, cursor: u64, head: &EventHead) {
    #[derive(Deserialize)]
    struct Frame<'a> {
        #[serde(borrow)]
        payload: Option<&'a serde_json::value::RawValue>,
    }
    let frame = head.without_seq();
    let payload = serde_json::from_slice::<Frame>(&frame)
        .ok()
        .and_then(|f| f.payload)
        .map_or("{}", |p| p.get());
    out.put_slice(b"id: ");
    out.put_slice(cursor.to_string().as_bytes());
    out.put_u8(b'\n');
    write_event_body(out, GAP_EVENT, payload.as_bytes());
}

/// [`write_close`] into a plain buffer.
fn write_close_to(out: &mut Vec<u8>, code: u16, reason: &str) {
    let mut record = BytesMut::new();
    write_close(&mut record, code, reason);
    out.extend_from_slice(&record);
}

/// The last record of a stream the broker ends (slow consumer, shutdown).
fn write_close(out: &mut BytesMut, code: u16, reason: &str) {
    let data = json!({"code": code, "reason": reason}).to_string();
    out.put_slice(b"event: clawmux.close\ndata: ");
    out.put_slice(data.as_bytes());
    out.put_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_stay_on_one_data_line() {
        let mut out = BytesMut::new();
        write_record(&mut out, 7, "chat", b"{\"a\":\n 1}");
        assert_eq!(&out[..], b"id: 7\nevent: chat\ndata: {\"a\":  1}\n\n");
        let mut out = BytesMut::new();
        let gap = EventHead::from_value(GAP_EVENT, &json!({"after": 4, "next": 9})).with_cursor(9);
        write_logged_gap(&mut out, 9, &gap);
        assert_eq!(
            &out[..],
            b"id: 9\nevent: clawmux.gap\ndata: {\"after\":4,\"next\":9}\n\n"
        );
        let mut out = BytesMut::new();
        write_unlogged(&mut out, "agent", b"{\"a\":\n1}");
        assert_eq!(&out[..], b"event: agent\ndata: {\"a\": 1}\n\n");
        let mut out = BytesMut::new();
        write_gap(&mut out, 4, 6);
        assert_eq!(
            &out[..],
            b"event: clawmux.gap\ndata: {\"after\":4,\"next\":6}\n\n"
        );
        let mut out = BytesMut::new();
        write_close(&mut out, 1008, "slow consumer");
        assert_eq!(
            &out[..],
            b"event: clawmux.close\ndata: {\"code\":1008,\"reason\":\"slow consumer\"}\n\n"
        );
    }
}
