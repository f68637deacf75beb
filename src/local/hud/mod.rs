//! `GET /v1/hud` and `/ws/hud`: the HUD protocol's activity feed
//! ([`crate::activity::hud`]) live from the socket, so a webchat HUD panel
//! consumes clawmux directly.
//!
//! - `GET /v1/hud`: Server-Sent Events, one HUD event per `data:` record.
//!   A record made from a logged gateway event carries that event's `id:`
//!   (the `/v1/events` cursor), so a browser `EventSource` resumes with
//!   `Last-Event-ID` (or `?after_seq=`) where it left off. `?history=1`
//!   sends what the broker's replay log holds first, each event flagged
//!   `replay: true`. `event: clawmux.gap` / `clawmux.close` records say
//!   what `/v1/events` says (an `EventSource` delivers only unnamed records
//!   to `onmessage`, so a HUD panel sees HUD events only).
//! - `GET /ws/hud`: a WebSocket with one HUD event per text frame (same
//!   query).
//!
//! Built on `/v1/events` itself ([`super::sse::open`], as an observer of
//! every tool stream): one stream per HUD client, its events run through
//! the one activity projection ([`crate::activity`], the same as `clawmux
//! top` and `tail --tree/--hud`). The stream always starts at the oldest
//! event the log holds, so runs that began earlier have their start and
//! times; what the client did not ask for (history, or what it saw before
//! resuming) is applied silently. `received` events for requests (a
//! message sent, an abort, a reset) come from the request tap
//! ([`crate::tap`]): only requests, as they happen (they are not in the
//! log, so history has none).
//!
//! Who may: the same as `tool_events=all` on `/v1/events` ([`may_observe`]).

use std::sync::Arc;

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::Value;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use super::respond::{error_response, full, Body};
use tokio_util::sync::CancellationToken;

mod handover;
mod ws;

use crate::activity::hud::hud_event;
use crate::activity::{Activity, Observed};
use crate::context::Ctx;
use crate::hub::replay::{EventId, ReplayWindow};
use crate::hub::{Client, ClientKind, Outgoing};
use crate::policy::Grant;
use crate::protocol::StudioCode;
pub(crate) use handover::take_over;

/// The query of `/v1/hud` and `/ws/hud`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HudQuery {
    /// `1`: the replay log's events first, flagged `replay: true`.
    history: Option<String>,
    /// Resume after this event id, as on `/v1/events`.
    after_seq: Option<String>,
    /// The broker life `after_seq` is from, as on `/v1/events`.
    epoch: Option<String>,
}

/// Whether a caller may watch every run's tool calls: the rule of
/// `/v1/events?tool_events=all` (the events it carries need
/// `operator.read`, as `agent` events do). One function, so a socket-level
/// observer switch can replace it.
pub fn may_observe(grant: &Grant) -> bool {
    crate::policy::events::guard("agent").allows(grant)
}

/// Answers `GET /v1/hud` (SSE) and `GET /ws/hud` (WebSocket).
pub async fn open(req: Request<Incoming>, ctx: &Arc<Ctx>) -> Response<Body> {
    let websocket = req.uri().path() == "/ws/hud";
    let access = super::respond::http_access(&req, ctx);
    if !may_observe(&access.grant) {
        return error_response(
            StatusCode::FORBIDDEN,
            StudioCode::Forbidden.as_str(),
            "the HUD feed shows every run's tool calls: it needs operator.read, which this caller does not hold (its socket's policy or X-Clawmux-Scopes)".into(),
        );
    }
    let (query, history) = match parse_query(req.uri().query()) {
        Ok(parsed) => parsed,
        Err(message) => return error_response(StatusCode::BAD_REQUEST, "INVALID_REQUEST", message),
    };
    if websocket {
        return upgrade(req, ctx, query, history);
    }
    let socket = super::movable_socket(&req);
    let kill = req
        .extensions()
        .get::<super::ConnectionKill>()
        .map(|k| k.0.clone());
    let peer_pid = req.extensions().get::<super::PeerPid>().and_then(|p| p.0);
    let query_text = req.uri().query().unwrap_or("").to_owned();
    let source = match HudSource::open(req, ctx, query, history) {
        Ok(source) => source,
        Err(resp) => return *resp,
    };
    let feed = source.feed.clone();
    // It moves at a handover when it has a socket of its own and the log
    // goes on in the next instance (its feed continues from it there).
    let moves = socket.is_some() && ctx.hub.replay_file().is_some();
    let done = CancellationToken::new();
    let body = handover::HudBody::new(
        ctx,
        source,
        &access,
        peer_pid,
        query_text,
        moves,
        done.clone(),
    );
    let first = Bytes::from_static(b": clawmux HUD events\n\nretry: 1000\n\n");
    let (chunks, on_stop) = super::sse::body_of(first, body);
    let (resp, drained) =
        super::respond::event_stream_response_watched(chunks, ctx.hub.queue_budget());
    if let Some(feed) = feed {
        // What hyper holds of this stream is its feed's client's, for the
        // budget (the feed is what the budget closes).
        feed.hold_outside(Arc::new(drained.clone()));
    }
    if let (Some(socket), Some(kill), true) = (socket, kill, moves) {
        ctx.tracker.spawn(super::sse::watch(
            Arc::clone(ctx),
            None,
            done,
            kill,
            Some(super::sse::Movable::new(
                socket,
                on_stop,
                drained,
                ctx.hub.queue_budget(),
            )),
        ));
    }
    resp
}

/// The query of `/v1/hud` and `/ws/hud`, and whether it asks for history;
/// the error is the 400's message.
pub(crate) fn parse_query(query: Option<&str>) -> Result<(HudQuery, bool), String> {
    let query: HudQuery = serde_urlencoded::from_str(query.unwrap_or("")).map_err(|e| {
        format!("bad query: {e}; expected history=1, after_seq=<event id>, epoch=<id>")
    })?;
    let history = match query.history.as_deref() {
        None | Some("0") | Some("false") => false,
        Some("1") | Some("true") => true,
        Some(other) => {
            return Err(format!(
                "bad history={other}: expected history=1 or history=0"
            ))
        }
    };
    Ok((query, history))
}

/// One record for a HUD client.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// A HUD event, with the id of the gateway event it came from (none
    /// for tool streams and requests: not in the log).
    Hud { id: Option<String>, event: Value },
    /// A `/v1/events` record passed on (`clawmux.gap`, `clawmux.close`).
    Broker { name: String, data: String },
}

pub(super) fn sse_chunk(records: &[Record]) -> Bytes {
    let mut out = String::new();
    for record in records {
        match record {
            Record::Hud { id, event } => {
                if let Some(id) = id {
                    out.push_str("id: ");
                    out.push_str(&id.replace(['\n', '\r'], ""));
                    out.push('\n');
                }
                out.push_str("data: ");
                out.push_str(&event.to_string());
                out.push_str("\n\n");
            }
            Record::Broker { name, data } => {
                out.push_str("event: ");
                out.push_str(name);
                out.push_str("\ndata: ");
                out.push_str(&data.replace(['\n', '\r'], " "));
                out.push_str("\n\n");
            }
        }
    }
    Bytes::from(out)
}

/// Stops copying requests to a HUD stream when it ends.
struct TapListener {
    ctx: Arc<Ctx>,
    client: Arc<Client>,
}

impl Drop for TapListener {
    fn drop(&mut self) {
        self.ctx.router.tap.detach(self.client.id);
        self.ctx.hub.remove(self.client.id);
    }
}

type Events = std::pin::Pin<
    Box<
        dyn futures_util::Stream<
                Item = Result<
                    eventsource_stream::Event,
                    eventsource_stream::EventStreamError<std::convert::Infallible>,
                >,
            > + Send,
    >,
>;

/// The `/v1/events` stream's chunks (up to one batch, 256 KiB, each) handed
/// to the SSE parser one record at a time, as slices of the chunk. The
/// parser copies what it is given into its own buffer and, per line it
/// reads, copies the rest of that buffer again: given a whole chunk it
/// copied it quadratically, and kept a copy of up to a batch outside the
/// queue budget. Given one record it copies only that record; the chunk
/// itself (and with it its count in `queue_total_bytes`, [`super::stream_body`])
/// stays alive until its last record is handed over.
fn records<S, E>(chunks: S) -> impl futures_util::Stream<Item = Result<Bytes, E>> + Send
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: Send,
{
    futures_util::stream::unfold(
        (chunks, std::collections::VecDeque::new()),
        |(mut chunks, mut pending)| async move {
            if pending.is_empty() {
                match chunks.next().await? {
                    Ok(chunk) => pending = split_records(chunk),
                    Err(e) => return Some((Err(e), (chunks, pending))),
                }
            }
            let record = pending.pop_front().unwrap_or_default();
            Some((Ok(record), (chunks, pending)))
        },
    )
}

/// A chunk's records, each up to its blank line, as slices of the chunk; a
/// partial last one as it is (the parser keeps it until the next chunk
/// completes it). Searched once per chunk with `str::find` (`memchr`): a
/// byte-by-byte search cost more than the parse in a debug build. The
/// stream is UTF-8 text; a chunk that were not is handed over whole, for
/// the parser to judge.
fn split_records(chunk: Bytes) -> std::collections::VecDeque<Bytes> {
    let mut ends = Vec::new();
    if let Ok(text) = std::str::from_utf8(&chunk) {
        let mut from = 0;
        while let Some(at) = text[from..].find("\n\n") {
            from += at + 2;
            ends.push(from);
        }
    }
    if ends.last() != Some(&chunk.len()) {
        ends.push(chunk.len());
    }
    let mut records = std::collections::VecDeque::with_capacity(ends.len());
    let mut start = 0;
    for end in ends {
        if end > start {
            records.push_back(chunk.slice(start..end));
            start = end;
        }
    }
    records
}

/// One HUD client's feed: its `/v1/events` stream through the projection.
struct HudSource {
    events: Events,
    activity: Activity,
    /// Records up to this cursor are applied but not sent (what the client
    /// did not ask for, or already saw).
    quiet_until: Option<u64>,
    /// The newest cursor when the stream was admitted: records up to it
    /// are replayed.
    newest: Option<u64>,
    tap: Option<TapListener>,
    done: bool,
    /// The newest logged cursor it applied (or where its feed started):
    /// a moved stream's feed goes on after it.
    applied: u64,
    /// Cancelled when it moved: its feed's watch ends (the feed is
    /// reopened in the next instance).
    feed_left: CancellationToken,
    /// The feed's hub client: the queue the budget judges this stream by.
    feed: Option<Arc<Client>>,
    /// What the projection keeps, counted in the queue budget.
    kept: Arc<Kept>,
}

/// A HUD stream's projection in the queue budget: counted while the
/// stream lives, as its feed client's (held outside its queue, so the
/// budget's shedder knows it goes when the feed is closed). The
/// projection bounds itself ([`Activity::max_bytes`]); this makes the
/// budget see it.
#[derive(Debug)]
struct Kept {
    bytes: std::sync::atomic::AtomicUsize,
    budget: Arc<crate::hub::QueueBudget>,
}

impl Kept {
    fn set(&self, bytes: usize) {
        use crate::hub::client::BudgetCount;
        let was = self.bytes.swap(bytes, std::sync::atomic::Ordering::Relaxed);
        if bytes > was {
            self.budget.count_add(bytes - was);
        } else {
            self.budget.count_sub(was - bytes);
        }
    }
}

impl crate::hub::HeldOutside for Kept {
    fn held(&self) -> usize {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.set(0);
    }
}

impl HudSource {
    /// Opens the underlying `/v1/events` stream (as an observer, from the
    /// log's start) on `req`, rewritten; an error answer is passed on.
    fn open(
        req: Request<Incoming>,
        ctx: &Arc<Ctx>,
        query: HudQuery,
        history: bool,
    ) -> Result<HudSource, Box<Response<Body>>> {
        let last_event_id = req
            .headers()
            .get("last-event-id")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_owned);
        let resume = last_event_id.or(query.after_seq.clone());
        let feed_left = CancellationToken::new();
        let (events_query, resumed) = events_query(
            &ctx.hub.replay_window(),
            resume.as_deref(),
            query.epoch.as_deref(),
        );
        let resp = super::sse::open_from(
            super::sse::Opening {
                query: Some(events_query),
                last_event_id: None,
                access: super::respond::http_access(&req, ctx),
                peer_pid: req.extensions().get::<super::PeerPid>().and_then(|p| p.0),
                kill: req
                    .extensions()
                    .get::<super::ConnectionKill>()
                    .map(|k| k.0.clone()),
                socket: None,
                reader_left: Some(feed_left.clone()),
            },
            ctx,
        );
        if resp.status() != StatusCode::OK {
            return Err(Box::new(resp));
        }
        let newest = header(&resp, super::sse::NEWEST_SEQ_HEADER);
        let quiet_until = match (resumed, history) {
            (Some(cursor), _) => Some(cursor),
            (None, true) => None,
            (None, false) => newest,
        };
        Ok(HudSource::on(
            resp,
            ctx,
            Activity::for_feed(),
            quiet_until,
            newest,
            feed_left,
        ))
    }

    /// A feed on the `/v1/events` stream `resp` (answered 200), through
    /// `activity`, with the request tap.
    fn on(
        resp: Response<Body>,
        ctx: &Arc<Ctx>,
        activity: Activity,
        quiet_until: Option<u64>,
        newest: Option<u64>,
        feed_left: CancellationToken,
    ) -> HudSource {
        let applied = header(&resp, super::sse::AFTER_SEQ_HEADER).unwrap_or(0);
        let feed = resp
            .extensions()
            .get::<super::sse::StreamClient>()
            .map(|c| Arc::clone(&c.0));
        let kept = Arc::new(Kept {
            bytes: Default::default(),
            budget: Arc::clone(ctx.hub.queue_budget()),
        });
        kept.set(activity.bytes());
        if let Some(feed) = &feed {
            feed.hold_outside(Arc::clone(&kept) as Arc<dyn crate::hub::HeldOutside>);
        }
        let events: Events = Box::pin(records(resp.into_body().into_data_stream()).eventsource());
        // Requests: copied from the tap into a queue of this stream's own
        // (not a hub client: it receives no events).
        let client = ctx.hub.new_client_of_kind(ClientKind::Sse);
        // Counted in the budget: the shedder and the stall sweep see it.
        ctx.hub.watch(&client);
        ctx.router.tap.attach(Arc::clone(&client));
        HudSource {
            events,
            activity,
            quiet_until,
            newest,
            tap: Some(TapListener {
                ctx: Arc::clone(ctx),
                client,
            }),
            done: false,
            applied,
            feed_left,
            feed,
            kept,
        }
    }

    /// The next records (possibly none: an event that changed nothing);
    /// `None` once the stream ended.
    async fn next_records(&mut self) -> Option<Vec<Record>> {
        if self.done {
            return None;
        }
        let tap = self.tap.as_ref().map(|t| Arc::clone(&t.client));
        let batch = async {
            match &tap {
                Some(client) => client.next_batch().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            next = self.events.next() => {
                let Some(Ok(event)) = next else {
                    self.done = true;
                    return None;
                };
                Some(self.on_event(event))
            }
            batch = batch => Some(self.on_requests(batch)),
        }
    }

    fn on_event(&mut self, event: eventsource_stream::Event) -> Vec<Record> {
        // (An `EventSource` keeps the last id for records without one.)
        if let Ok(id) = event.id.parse::<u64>() {
            self.applied = self.applied.max(id);
        }
        match event.event.as_str() {
            "clawmux.close" => {
                self.done = true;
                return vec![Record::Broker {
                    name: event.event,
                    data: event.data,
                }];
            }
            "clawmux.gap" => {
                self.activity.forget_unfinished();
                // A gap the client already saw, or from before it asked to
                // start (a fresh live feed starts with what happens from
                // now on): applied, not sent. `next` is the first cursor
                // after it (a logged gap's own).
                let next = serde_json::from_str::<Value>(&event.data)
                    .ok()
                    .and_then(|d| d["next"].as_u64());
                let at = next.or_else(|| event.id.parse::<u64>().ok());
                if matches!((at, self.quiet_until), (Some(a), Some(q)) if a <= q) {
                    return Vec::new();
                }
                return vec![Record::Broker {
                    name: event.event,
                    data: event.data,
                }];
            }
            _ => {}
        }
        let frame: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        let seq = frame["seq"].as_u64().filter(|_| !event.id.is_empty());
        let replay = matches!((seq, self.newest), (Some(s), Some(n)) if s <= n);
        let changes = self.activity.apply(Observed {
            name: &event.event,
            payload: &frame["payload"],
            received_ms: (!replay).then(crate::protocol::now_ms),
        });
        self.kept.set(self.activity.bytes());
        let quiet = matches!((seq, self.quiet_until), (Some(s), Some(q)) if s <= q);
        if quiet {
            return Vec::new();
        }
        let id = seq.map(|_| event.id.clone());
        changes
            .iter()
            .enumerate()
            .map(|(n, change)| Record::Hud {
                // The id goes on the last record of the event: a client
                // that resumes from it has seen all of them.
                id: id.clone().filter(|_| n + 1 == changes.len()),
                event: hud_event(change, replay),
            })
            .collect()
    }

    fn on_requests(&mut self, batch: Vec<Outgoing>) -> Vec<Record> {
        let mut out = Vec::new();
        for item in batch {
            match item {
                Outgoing::Frame(bytes) => {
                    // Only requests matter; answers (some large) are not
                    // parsed. The tap writes `dir` first (serde_json's
                    // sorted keys).
                    if !bytes.starts_with(br#"{"dir":"out""#) {
                        continue;
                    }
                    let Ok(record) = serde_json::from_slice::<Value>(&bytes) else {
                        continue;
                    };
                    let frame = &record["frame"];
                    if record["dir"] != "out" || frame["type"] != "req" {
                        continue;
                    }
                    let Some(method) = frame["method"].as_str() else {
                        continue;
                    };
                    let changes = self.activity.apply_request(
                        method,
                        &frame["params"],
                        crate::protocol::now_ms(),
                    );
                    out.extend(changes.iter().map(|c| Record::Hud {
                        id: None,
                        event: hud_event(c, false),
                    }));
                }
                // The tap's queue was closed (this stream fell far behind):
                // no more requests.
                Outgoing::Close(..) => self.tap = None,
                Outgoing::Event(..) => {}
            }
        }
        out
    }
}

/// A numeric header of a response.
fn header(resp: &Response<Body>, name: &str) -> Option<u64> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The `/v1/events` query for a HUD stream: an observer's, from the log's
/// start when the client's resume point (if any) is in the log (a bare
/// cursor, as the HUD's own `id:` lines give it, or one of this broker
/// life), so runs that began before it keep their start; else from the
/// client's own resume point, for `/v1/events` to answer (`410` and why).
/// Also the cursor the client resumes after: records up to it are
/// applied but not sent.
pub(crate) fn events_query(
    window: &ReplayWindow,
    resume: Option<&str>,
    epoch: Option<&str>,
) -> (String, Option<u64>) {
    let from_start = EventId {
        epoch: None,
        cursor: window.oldest_seq.saturating_sub(1),
    };
    let mut query = vec![("tool_events", "all".to_owned())];
    let mut resumed = None;
    match resume {
        None => query.push(("after_seq", from_start.to_string())),
        Some(text) => {
            let id = text.parse::<EventId>().ok();
            let life = id.as_ref().and_then(|id| id.epoch.as_deref()).or(epoch);
            let held = id.as_ref().is_some_and(|id| {
                life.is_none_or(|l| l == &*window.epoch)
                    && id.cursor >= from_start.cursor
                    && id.cursor <= window.newest_seq
            });
            resumed = id.map(|id| id.cursor);
            if held {
                query.push(("after_seq", from_start.to_string()));
            } else {
                query.push(("after_seq", text.to_owned()));
                if let Some(epoch) = epoch {
                    query.push(("epoch", epoch.to_owned()));
                }
            }
        }
    }
    (
        serde_urlencoded::to_string(&query).unwrap_or_default(),
        resumed,
    )
}

/// Answers the `/ws/hud` upgrade; the feed runs once hyper hands over the
/// connection.
fn upgrade(
    mut req: Request<Incoming>,
    ctx: &Arc<Ctx>,
    query: HudQuery,
    history: bool,
) -> Response<Body> {
    let key = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned();
    let is_upgrade = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let Some(key) = key.filter(|_| is_upgrade) else {
        return error_response(
            StatusCode::UPGRADE_REQUIRED,
            "upgrade_required",
            "/ws/hud sends HUD events over WebSocket; connect with a WebSocket client (or GET /v1/hud for Server-Sent Events)".into(),
        );
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let access = super::respond::http_access(&req, ctx);
    let who = ws::Who {
        scopes: access.grant.scopes().to_vec(),
        socket: access.socket.name.clone(),
        peer_pid: req.extensions().get::<super::PeerPid>().and_then(|p| p.0),
        query: req.uri().query().unwrap_or("").to_owned(),
        fd: req.extensions().get::<super::ConnFd>().map(|fd| fd.0),
    };
    let source = match HudSource::open(req, ctx, query, history) {
        Ok(source) => source,
        Err(resp) => return *resp,
    };
    let ctx = Arc::clone(ctx);
    ctx.tracker.clone().spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let (ws, pause) = ws::websocket(
            Box::new(TokioIo::new(upgraded)),
            Vec::new(),
            Vec::new(),
            &ctx,
        )
        .await;
        ws::serve(ws, pause, source, who, Vec::new(), ctx).await;
    });
    let mut resp = Response::new(full(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = resp.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(v) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
        headers.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Records are handed one by one (a partial one as it is, completed by
    /// the next chunk), and a chunk lives until its last record is taken:
    /// its count in the queue budget with it.
    #[tokio::test]
    async fn chunks_are_parsed_one_record_at_a_time_and_live_until_taken() {
        struct Owner(Vec<u8>, Arc<std::sync::atomic::AtomicBool>);
        impl AsRef<[u8]> for Owner {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let first = Bytes::from_owner(Owner(
            b"id: 1\nevent: a\ndata: {}\n\nid: 2\nevent: b\ndata: {}\n\nid: 3\nev".to_vec(),
            Arc::clone(&dropped),
        ));
        let second = Bytes::from_static(b"ent: c\ndata: {}\n\n");
        let chunks =
            futures_util::stream::iter([Ok::<_, std::convert::Infallible>(first), Ok(second)]);
        let mut split = Box::pin(records(chunks));
        let mut taken = Vec::new();
        while let Some(Ok(record)) = split.next().await {
            let whole_chunk_taken = taken.len() >= 3;
            assert_eq!(
                dropped.load(std::sync::atomic::Ordering::SeqCst),
                whole_chunk_taken,
                "after {} records",
                taken.len()
            );
            taken.push(String::from_utf8(record.to_vec()).unwrap());
        }
        assert_eq!(
            taken,
            [
                "id: 1\nevent: a\ndata: {}\n\n",
                "id: 2\nevent: b\ndata: {}\n\n",
                "id: 3\nev",
                "ent: c\ndata: {}\n\n"
            ]
        );
        // Through the parser: three events, the split one whole.
        let chunks = futures_util::stream::iter(
            taken
                .concat()
                .into_bytes()
                .chunks(7)
                .map(|c| Ok::<_, std::convert::Infallible>(Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>(),
        );
        let names: Vec<String> = records(chunks)
            .eventsource()
            .map(|e| e.unwrap().event)
            .collect()
            .await;
        assert_eq!(names, ["a", "b", "c"]);
    }

    #[test]
    fn sse_records_carry_the_id_only_when_the_event_is_logged() {
        let records = [
            Record::Hud {
                id: Some("e1:7".into()),
                event: json!({"type": "hud", "event": "turn_start"}),
            },
            Record::Hud {
                id: None,
                event: json!({"type": "hud"}),
            },
            Record::Broker {
                name: "clawmux.gap".into(),
                data: "{\"after\":1,\n\"next\":3}".into(),
            },
        ];
        assert_eq!(
            &sse_chunk(&records)[..],
            &b"id: e1:7\ndata: {\"event\":\"turn_start\",\"type\":\"hud\"}\n\ndata: {\"type\":\"hud\"}\n\nevent: clawmux.gap\ndata: {\"after\":1, \"next\":3}\n\n"[..]
        );
    }
}
