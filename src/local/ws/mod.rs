//! One local WebSocket client: connect enforcement, the synthesized
//! `hello-ok`, request forwarding, and the writing of its queue, all on the
//! client's one task.

#[doc(hidden)]
pub mod frames;
mod handover;
mod writer;

use handover::hand_over;
pub use handover::{take_over, Carried, HANDOVER_PAUSE_TIMEOUT};
use writer::{Writer, WriterEnd};

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use std::task::{ready, Context, Poll};

use futures_util::StreamExt;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;

use super::preconnect::{Limited, Pause, PreconnectBudget};
use super::ws_errors::{self, ReadFailure};
use crate::boundary::ReleaseReadBuffer;
use crate::context::Ctx;
use crate::dispatch::{Member, Registration};
use crate::hub::Client;
use crate::policy::{Access, Grant, SocketPolicy};
use crate::protocol::frames::{
    encode_res_error, encode_res_ok, encode_res_ok_with, ClientFrameError,
};
use crate::protocol::{now_ms, ClientFrame, ConnectRequest, ErrorShape, EventHead, StudioCode};
use crate::rate::TokenBucket;
use crate::upstream::UpstreamHello;

/// A local WebSocket, its reads limited until `connect` ([`super::preconnect`]).
pub type Ws = WebSocketStream<Limited<TokioIo<Upgraded>>>;

/// After a failed connect answer, how long the client may take to close
/// first (its close is echoed, as the gateway does) before the broker
/// closes `1011 connect failed`.
const CONNECT_FAILED_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a closing client may take to acknowledge our close frame.
const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// At a close, a client whose socket takes nothing for this long is not
/// waited for: it is not reading.
const CLOSE_STALL: std::time::Duration = std::time::Duration::from_millis(200);

/// The most batches ([`crate::hub::client::MAX_BATCH_BYTES`], 256 KiB or
/// one larger frame) the writer takes in one turn before the client's
/// socket is read again. A writer that drained the whole backlog before
/// reading kept a fast reader's own requests (a `chat.abort`) waiting
/// behind every event queued meanwhile ; after its turn the
/// writer yields (its task is woken at once) so a request waits for at
/// most one batch.
const WRITER_TURN_BATCHES: u32 = 1;

/// What the reader got from the socket.
enum Incoming {
    Text(Utf8Bytes),
    TooLarge,
    /// The peer broke the protocol: close with this code and reason
    /// (RFC 6455 §7.4.1: 1007 for invalid UTF-8, 1002 for a protocol error).
    Invalid(u16, &'static str),
    Closed,
}

/// What the client's socket did next.
enum Step {
    Read(Incoming),
    /// The writer ended (see [`Writer::ended`]).
    WriterEnded,
}

/// One client's socket, read and written by the client's own task. A
/// request read is forwarded, and an answer queued is written, by the task
/// that polled them: there is no second task to wake. (tokio-tungstenite
/// wakes the task that last wrote a socket whenever it turns readable, so
/// a second, writing task would make every request wake two tasks, and
/// the runtime its other worker for the second.)
struct Conn<T = TokioIo<Upgraded>> {
    /// Read through tungstenite; written by [`Writer`] beside it. Boxed:
    /// the client's task moves its connection between futures (serving,
    /// a handover, the last steps), and each would hold it whole.
    ws: Box<WebSocketStream<Limited<T>>>,
    writer: Writer,
    client: Arc<Client>,
    /// Gives a large request's read buffer back once it is handled.
    release: ReleaseReadBuffer,
    /// Stops the reader under the parser at a message boundary (handover).
    pause: Pause,
}

impl<T> Conn<T>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    fn new(ws: WebSocketStream<Limited<T>>, client: Arc<Client>, pause: Pause) -> Self {
        Conn {
            ws: Box::new(ws),
            writer: Writer::new(),
            client,
            release: ReleaseReadBuffer::default(),
            pause,
        }
    }

    /// The next frame from the client, writing what its queue holds meanwhile.
    async fn next(&mut self) -> Step {
        // The message read last (if any) has been handled.
        self.ws.get_mut().message_handled();
        std::future::poll_fn(|cx| {
            if self
                .writer
                .poll_drive(cx, &mut self.ws, &self.client)
                .is_ready()
            {
                return Poll::Ready(Step::WriterEnded);
            }
            let polled = poll_incoming(&mut self.ws, cx);
            let payload = match &polled {
                Poll::Ready(Incoming::Text(t)) => Some(Bytes::from(t.clone())),
                _ => None,
            };
            self.release.after_poll(payload.as_ref());
            polled.map(Step::Read)
        })
        .await
    }

    /// Writes what is queued (a close frame last) until the writer ends.
    async fn finish_writing(&mut self) {
        std::future::poll_fn(|cx| self.writer.poll_drive(cx, &mut self.ws, &self.client)).await;
    }

    /// [`Conn::finish_writing`] for as long as the socket keeps taking
    /// bytes: a client that takes none for [`CLOSE_STALL`] is left there
    /// (a stop never waits for a client that is not reading), and one that
    /// reads gets at most [`CLOSE_LINGER`].
    async fn finish_while_read(&mut self) {
        let deadline = tokio::time::Instant::now() + CLOSE_LINGER;
        loop {
            let before = self.ws.get_ref().written();
            let until = deadline.min(tokio::time::Instant::now() + CLOSE_STALL);
            if tokio::time::timeout_at(until, self.finish_writing())
                .await
                .is_ok()
                || tokio::time::Instant::now() >= deadline
            {
                return;
            }
            if self.ws.get_ref().written() == before {
                tracing::info!(
                    client_id = self.client.id,
                    "not waiting for a client that is not reading to take its close"
                );
                return;
            }
        }
    }
}

fn poll_incoming<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut WebSocketStream<S>,
    cx: &mut Context<'_>,
) -> Poll<Incoming> {
    loop {
        let incoming = match ready!(stream.poll_next_unpin(cx)) {
            Some(Ok(Message::Text(t))) => Incoming::Text(t),
            Some(Ok(Message::Binary(b))) => match Utf8Bytes::try_from(b) {
                Ok(t) => Incoming::Text(t),
                // Not text: treated like unparseable JSON.
                Err(_) => Incoming::Text(Utf8Bytes::from_static("\u{0}")),
            },
            Some(Ok(Message::Close(_))) | None => Incoming::Closed,
            Some(Ok(_)) => continue,
            Some(Err(e)) => match ws_errors::classify(&e, "local client") {
                ReadFailure::Ended => Incoming::Closed,
                ReadFailure::TooLarge => Incoming::TooLarge,
                ReadFailure::Invalid(code, reason) => Incoming::Invalid(code, reason),
            },
        };
        return Poll::Ready(incoming);
    }
}

/// What a client sees when the upstream session restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restarts {
    /// Stay connected: a `seq` gap and `clawmux.upstream` events (the
    /// broker's better-on-purpose default on `/ws`).
    Continuity,
    /// Be closed as a direct connection would be (the gateway's own close,
    /// else `1012 service restart`): for clients whose restart flow waits for
    /// the socket to drop (Claw3D). The default on `/api/gateway/ws`.
    Mirror,
}

impl Restarts {
    /// From the path and `?restarts=continuity|mirror`.
    pub fn for_request(uri: &http::Uri) -> Result<Restarts, String> {
        let default = if uri.path() == "/api/gateway/ws" {
            Restarts::Mirror
        } else {
            Restarts::Continuity
        };
        let Some(query) = uri.query() else {
            return Ok(default);
        };
        let mut chosen = default;
        for (k, v) in serde_urlencoded::from_str::<Vec<(String, String)>>(query)
            .map_err(|e| format!("bad query: {e}"))?
        {
            if k == "restarts" {
                chosen = match v.as_str() {
                    "continuity" => Restarts::Continuity,
                    "mirror" => Restarts::Mirror,
                    other => {
                        return Err(format!(
                            "restarts={other}: expected restarts=continuity or restarts=mirror"
                        ))
                    }
                };
            }
        }
        Ok(chosen)
    }
}

/// Where a local client's connection comes from.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// The peer's process id from the kernel, for `/v1/state`.
    pub pid: Option<u32>,
    /// The connection's socket, for a handover.
    pub fd: Option<super::ConnFd>,
}

/// Runs one local client to completion. `budget` is lifted once it is admitted.
///
/// Not an `async fn`: the future it returns lives as long as the client,
/// and an `async fn` keeps room for every argument for its whole life,
/// even once moved (the socket's 520 bytes, twice). The connection is
/// boxed here, before the future is made, and the rare steps (a handover,
/// the last steps) are boxed where they start, so an idle client's task
/// holds what serving it takes and little more.
pub fn run(
    ws: Ws,
    budget: PreconnectBudget,
    restarts: Restarts,
    socket: Arc<SocketPolicy>,
    peer: Peer,
    ctx: Arc<Ctx>,
) -> impl std::future::Future<Output = ()> {
    let pause = ws.get_ref().pause();
    let registration = ctx.dispatcher.register(ctx.hub.new_client());
    let client = Arc::clone(registration.client());
    client.count_written(budget.written());
    let mut conn = Conn::new(ws, Arc::clone(&client), pause);
    async move {
        let peer_pid = peer.pid;
        let client_id = client.id;
        tracing::debug!(client_id, "local client opened");

        let admitted = match ctx.handshakes.take(&socket.name).ok_or(()) {
            Err(()) => {
                tracing::warn!(
                    client_id,
                    socket = %socket.name,
                    limit = ctx.handshakes.share(&socket.name),
                    "too many clients in their handshake on this socket; refusing one"
                );
                client.close(1013, "too many connecting clients; try again later");
                false
            }
            Ok(_permit) => {
                // The gateway's own challenge fields (e.g. `capabilities`) as of
                // the last session, with this client's own nonce and time.
                let mut payload = ctx
                    .upstream()
                    .status()
                    .hello
                    .map(|h| h.challenge_extra.clone())
                    .unwrap_or_default();
                payload.insert("nonce".into(), json!(uuid::Uuid::new_v4().to_string()));
                payload.insert("ts".into(), json!(now_ms()));
                let challenge = EventHead::from_value("connect.challenge", &Value::Object(payload));
                client.push_frame(challenge.without_seq());
                tokio::select! {
                    // Boxed, so what the handshake needs while it runs is
                    // freed once it is done (an idle client keeps only what
                    // serving it takes).
                    admitted = Box::pin(handshake(&mut conn, &socket, peer_pid, &ctx)) => admitted,
                    _ = ctx.cancel.cancelled() => {
                        client.close(1001, "going away");
                        false
                    }
                }
            }
        };
        if admitted {
            budget.lift();
            conn.ws
                .get_mut()
                .charge_messages_to(Arc::clone(client.budget()));
            tracing::info!(client_id, conn_id = %client.conn_id, "local client connected");
            // Counted until the client has left for the next instance (or is
            // being closed): a handover waits for every one.
            let serving = ctx.handover.serving();
            let served = serve_requests(&mut conn, &registration, &ctx, restarts).await;
            if served == Served::HandOver {
                match peer.fd {
                    Some(fd) => {
                        match Box::pin(hand_over(conn, registration, fd.0, restarts, &ctx)).await {
                            Ok(()) => return,
                            Err((conn, registration)) => {
                                client.close(1012, "service restart");
                                drop(serving);
                                return Box::pin(finish(conn, registration)).await;
                            }
                        }
                    }
                    _ => client.close(1012, "service restart"),
                }
            }
            drop(serving);
        }
        Box::pin(finish(conn, registration)).await
    }
}

/// A client's last steps: answer a peer's close, release what it held,
/// deliver what is queued (bounded), then the socket is closed.
async fn finish<T>(mut conn: Conn<T>, registration: Registration)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let client = Arc::clone(&conn.client);
    let client_id = client.id;
    // Answer a peer's close (tungstenite only writes the reply on the next
    // write or flush) so the client sees a clean close; a no-op when the
    // broker already queued its own close.
    client.close(1000, "");
    // Everything the client held goes with its registration, at once.
    drop(registration);
    // Let the writer deliver what is queued (the close frame included), but
    // never wait on a client that does not read.
    if conn.writer.ended.is_none() {
        conn.finish_while_read().await;
    }
    if conn.writer.ended == Some(WriterEnd::Killed) {
        conn.writer.send_slow_consumer_close(&mut conn.ws).await;
    }
    tracing::info!(client_id, "local client disconnected");
}

/// Connect enforcement (design §2). Returns true once the client is admitted.
async fn handshake(
    conn: &mut Conn,
    socket: &Arc<SocketPolicy>,
    peer_pid: Option<u32>,
    ctx: &Arc<Ctx>,
) -> bool {
    let limits = &ctx.settings.limits;
    let client = &Arc::clone(&conn.client);
    let first = match tokio::time::timeout(limits.connect_timeout, conn.next()).await {
        Err(_) => {
            client.close(1008, "connect timeout");
            return false;
        }
        Ok(Step::WriterEnded) => return false,
        Ok(Step::Read(Incoming::Closed)) => return false,
        Ok(Step::Read(Incoming::TooLarge)) => {
            client.close(1009, "frame too large");
            return false;
        }
        Ok(Step::Read(Incoming::Invalid(code, reason))) => {
            client.close(code, reason);
            return false;
        }
        Ok(Step::Read(Incoming::Text(t))) => t,
    };
    if first.len() > limits.preconnect_max_bytes {
        client.close(1009, "frame too large");
        return false;
    }
    let req = match ConnectRequest::parse_first(first.as_str()) {
        Ok(req) => req,
        Err(e) => {
            client.close(e.close_code(), &e.to_string());
            return false;
        }
    };
    let params = match req.validate() {
        Ok(p) => p,
        Err(message) => {
            client.push_frame(encode_res_error(
                &req.id,
                &ErrorShape::invalid_request(message.clone()),
            ));
            client.close(1008, truncate_reason(&message));
            return false;
        }
    };
    let _ = client
        .identity
        .set(declared_identity(&req.params, peer_pid));
    let deadline = crate::router::deadline_after(limits.connect_wait);
    let hello = match ctx
        .upstream()
        .wait_ready_with_auth(deadline, params.auth.as_ref())
        .await
    {
        Ok(h) => h,
        Err(error) => {
            tracing::info!(client_id = client.id, code = %error.code, "local connect failed");
            client.push_frame(encode_res_error(&req.id, &error));
            // Claw3D's client closes first after a failed connect answer
            // (4008 "connect failed: CODE MESSAGE") and shows that close to the
            // user: give it the moment it needs, then close ourselves.
            match tokio::time::timeout(CONNECT_FAILED_LINGER, conn.next()).await {
                Ok(Step::Read(Incoming::Closed)) => return false,
                // The answer could not be written: the client will not see a close either.
                Ok(Step::WriterEnded) => return false,
                _ => {}
            }
            client.close(1011, "connect failed");
            return false;
        }
    };
    if !(params.min_protocol..=params.max_protocol).contains(&hello.protocol) {
        let error = ErrorShape::invalid_request("protocol mismatch").with_details(json!({
            "code": "PROTOCOL_MISMATCH",
            "expectedProtocol": hello.protocol,
            "clientMinProtocol": params.min_protocol,
            "clientMaxProtocol": params.max_protocol,
        }));
        client.push_frame(encode_res_error(&req.id, &error));
        client.close(1002, "protocol mismatch");
        return false;
    }
    client
        .tool_events
        .store(params.tool_events, std::sync::atomic::Ordering::Relaxed);
    // What the client asked for, within what the broker's session holds and
    // what its socket allows (as a locally paired device gets its requested
    // scopes within its pairing: nothing asked, nothing granted).
    let grant = Grant::new(&params.scopes).within(&socket.ceiling(&Grant::new(&hello.scopes)));
    client.set_access(Access {
        grant,
        socket: Arc::clone(socket),
    });
    let max_frame = ctx.settings.limits.max_frame_bytes as u64;
    let admitted = ctx.hub.admit(client, |snapshot| {
        encode_hello(
            &req.id,
            &hello,
            snapshot,
            &client.conn_id,
            max_frame,
            &client.grant().in_order_of(&params.scopes),
        )
    });
    if let Err(e) = admitted {
        let error = ErrorShape::studio(
            StudioCode::TooManyClients,
            format!("{e}; close another client or raise max_clients"),
        );
        client.push_frame(encode_res_error(&req.id, &error));
        client.close(1013, "too many clients");
        return false;
    }
    true
}

/// What a `connect` says about its client (`client.id`, `mode`, `version`,
/// `displayName`), for `/v1/state`; strings only, anything else is left out.
fn declared_identity(params: &Value, peer_pid: Option<u32>) -> crate::hub::ClientIdentity {
    let field = |key: &str| {
        params
            .get("client")
            .and_then(|c| c.get(key))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    crate::hub::ClientIdentity {
        client_id: field("id"),
        mode: field("mode"),
        version: field("version"),
        display_name: field("displayName"),
        peer_pid,
    }
}

/// The `hello-ok` a local client gets, as its `res` frame: the gateway's
/// own, with this client's `connId`, the current snapshot, a `maxPayload`
/// no larger than either side accepts, and the broker's effective auth
/// (never its device token). The snapshot is copied in as encoded once for
/// every client. No hello is larger than the `maxPayload` it announces:
/// when the whole snapshot would make it so, it carries the snapshot with
/// `presence` and `health` emptied and their versions 0, and the client
/// has them with the next `presence` and `health` events (or asks
/// `system-presence` and `health`).
fn encode_hello(
    id: &str,
    up: &UpstreamHello,
    snapshot: Option<&crate::hub::EncodedSnapshot>,
    conn_id: &str,
    max_frame: u64,
    scopes: &[String],
) -> Bytes {
    let max_payload = up.max_payload.map_or(max_frame, |m| m.min(max_frame));
    let head = hello_head(up, conn_id, max_payload, scopes);
    let Some(snapshot) = snapshot else {
        // None kept (yet): the gateway's own, as it sent it.
        let mut hello = head;
        if let Some(own) = up.payload.get("snapshot") {
            hello["snapshot"] = own.clone();
        }
        return encode_res_ok(id, &hello);
    };
    // The small one first: the whole one's size follows from it, so a
    // whole snapshot too large is never encoded only to be thrown away.
    let (whole, cut) = (
        snapshot.whole.get().len(),
        snapshot.without_presence_and_health.get().len(),
    );
    let cut_frame =
        encode_res_ok_with(id, &head, "snapshot", &snapshot.without_presence_and_health);
    let whole_bytes = cut_frame.len() - cut + whole;
    if whole_bytes as u64 <= max_payload {
        return encode_res_ok_with(id, &head, "snapshot", &snapshot.whole);
    }
    tracing::warn!(
        hello_bytes = whole_bytes,
        max_payload,
        sent_bytes = cut_frame.len(),
        "the gateway's snapshot makes hello-ok larger than maxPayload; the client gets it without presence and health (the next events of each bring them)"
    );
    cut_frame
}

/// Every member of a local client's `hello-ok` but the snapshot (see
/// [`encode_hello`]).
fn hello_head(up: &UpstreamHello, conn_id: &str, max_payload: u64, scopes: &[String]) -> Value {
    // Member by member: the gateway's own snapshot (which can be large) is
    // not copied, the hub's current one takes its place.
    let mut hello = match &up.payload {
        Value::Object(members) => Value::Object(
            members
                .iter()
                .filter(|(key, _)| key.as_str() != "snapshot")
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect(),
        ),
        _ => json!({}),
    };
    hello["type"] = json!("hello-ok");
    hello["protocol"] = json!(up.protocol);
    let mut server = hello
        .get("server")
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    server["connId"] = json!(conn_id);
    server["version"] = json!(up.server_version);
    hello["server"] = server;
    let mut policy = hello
        .get("policy")
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    policy["maxPayload"] = json!(max_payload);
    hello["policy"] = policy;
    // The gateway's own auth fields (`method`, `recoveryScope`, …) pass
    // through; the device token was taken out when the hello was read, and
    // what belongs to the broker's device is not the client's.
    let mut auth = hello
        .get("auth")
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    if let Some(a) = auth.as_object_mut() {
        for own in ["deviceToken", "deviceTokens", "issuedAtMs", "deviceId"] {
            a.remove(own);
        }
    }
    auth["role"] = json!("operator");
    auth["scopes"] = json!(scopes);
    hello["auth"] = auth;
    hello
}

/// Why [`serve_requests`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// The client left, was closed, or the broker stops.
    Ended,
    /// The broker hands its clients over to its next instance.
    HandOver,
}

/// Serves requests after the handshake until the client leaves, the broker
/// stops or hands over, or the writer ends (slow consumer, write error).
async fn serve_requests<T>(
    conn: &mut Conn<T>,
    registration: &Registration,
    ctx: &Arc<Ctx>,
    restarts: Restarts,
) -> Served
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let limits = &ctx.settings.limits;
    let member: &Arc<Member> = registration.member();
    let mut upstream = ctx.upstream().subscribe();
    let admitted_on = upstream.borrow_and_update().generation;
    let mirror = restarts == Restarts::Mirror;
    let client = member.client();
    let mut bucket = TokenBucket::new(limits.request_rate, limits.request_burst);
    loop {
        let incoming = tokio::select! {
            step = conn.next() => match step {
                Step::Read(i) => i,
                Step::WriterEnded => return Served::Ended,
            },
            _ = ctx.cancel.cancelled() => {
                client.close(1001, "going away");
                return Served::Ended;
            }
            _ = ctx.handover.requested.cancelled() => return Served::HandOver,
            changed = upstream.changed(), if mirror => {
                let (ended, close) = {
                    let s = upstream.borrow_and_update();
                    let ended = changed.is_err()
                        || s.generation != admitted_on
                        || !matches!(s.phase, crate::upstream::Phase::Ready | crate::upstream::Phase::Stopped);
                    (ended && s.phase != crate::upstream::Phase::Stopped, s.last_close.clone())
                };
                if ended {
                    let (code, reason) = close.unwrap_or((1012, "service restart".into()));
                    client.close(code, truncate_reason(&reason));
                    return Served::Ended;
                }
                continue;
            }
        };
        let text = match incoming {
            Incoming::Text(t) => t,
            Incoming::TooLarge => {
                client.close(1009, "frame too large");
                return Served::Ended;
            }
            Incoming::Invalid(code, reason) => {
                client.close(code, reason);
                return Served::Ended;
            }
            Incoming::Closed => return Served::Ended,
        };
        if let Err(wait) = bucket.take(Instant::now()) {
            refuse_over_rate(client, text.as_str(), wait, limits.request_rate);
            continue;
        }
        handle_frame(&text, member, ctx);
    }
}

/// One frame from an admitted client: forwarded, or answered here.
fn handle_frame(text: &Utf8Bytes, member: &Arc<Member>, ctx: &Arc<Ctx>) {
    let client = member.client();
    {
        match ClientFrame::parse(text.as_str()) {
            Ok(frame) if frame.method == "connect" => {
                client.push_frame(encode_res_error(
                    &frame.id,
                    &ErrorShape::invalid_request("connect is only valid as the first request"),
                ));
            }
            Ok(frame) => {
                if let Err(error) =
                    ctx.dispatcher
                        .dispatch(member, &frame.id, &frame.method, frame.params)
                {
                    client.push_frame(encode_res_error(&frame.id, &error));
                }
            }
            Err(ClientFrameError::InvalidJson) => {
                // The gateway logs and ignores these; so do we (nothing to answer to).
                tracing::debug!(client_id = client.id, "ignoring a frame that is not JSON");
            }
            Err(ClientFrameError::InvalidFrame { id, message }) => {
                client.push_frame(encode_res_error(&id, &ErrorShape::invalid_request(message)));
            }
        }
    }
}

/// Answers a frame over the client's rate with `studio.too_many_requests`.
fn refuse_over_rate(client: &Client, text: &str, wait: std::time::Duration, rate: u32) {
    let id = match ClientFrame::parse(text) {
        Ok(frame) => frame.id.into_owned(),
        Err(ClientFrameError::InvalidFrame { id, .. }) => id,
        Err(ClientFrameError::InvalidJson) => return,
    };
    let error = ErrorShape::studio(
        StudioCode::TooManyRequests,
        format!("more than {rate} frames per second from this client; slow down"),
    )
    .with_retry_after_ms(Some(wait.as_millis() as u64 + 1))
    .with_sent(false);
    client.push_frame(encode_res_error(&id, &error));
}

/// Close reasons are limited to 123 bytes by the WebSocket spec; cut on a
/// character boundary.
fn truncate_reason(reason: &str) -> &str {
    let mut end = reason.len().min(120);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// The read buffer of a local WebSocket. tungstenite zero-fills it and
/// keeps it for the connection's life, so it is resident for every
/// connected client, idle or not (its default, 128 KiB, made 128 MiB for
/// 1,000 clients). Requests are small: 2 KiB holds one whole in a read, and
/// keeps an idle client at ~7 KiB in all. A larger frame still arrives
/// whole (the buffer grows to the frame's length, up to `max_frame_bytes`),
/// in reads of this size: a 1 MiB request takes 512 reads (~1 ms).
/// Measured by `cargo bench --bench clawmux` (BENCHMARKS.md).
pub(super) const LOCAL_READ_BUFFER_BYTES: usize = 2 * 1024;

/// Bytes tungstenite buffers before writing to the socket (the library's
/// default is 128 KiB). It writes only pongs and close frames here (the
/// writer frames events and responses itself, from the shared bytes), so
/// its buffer never holds a copy of what the queues count; kept small in
/// case that changes (a client that did not read once held this much of
/// serialized copies outside the queue budget).
pub(super) const LOCAL_WRITE_BUFFER_BYTES: usize = 16 * 1024;

/// The WebSocket settings of a local client's connection.
pub(super) fn config(ctx: &Ctx) -> tokio_tungstenite::tungstenite::protocol::WebSocketConfig {
    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .read_buffer_size(LOCAL_READ_BUFFER_BYTES)
        .write_buffer_size(LOCAL_WRITE_BUFFER_BYTES)
        .max_message_size(Some(ctx.settings.limits.max_frame_bytes))
        .max_frame_size(Some(ctx.settings.limits.max_frame_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::client::MAX_BATCH_BYTES;
    use crate::hub::QueueLimits;
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::protocol::Role;

    /// A client that reads as fast as the broker writes (a socket that
    /// never fills) and has a large backlog gets its own request read
    /// after at most one batch, not after the whole backlog (before: a
    /// `chat.abort` waited behind every event queued meanwhile).
    #[tokio::test]
    async fn a_request_waits_for_one_batch_not_the_whole_backlog() {
        // Room for everything: the writer is never held up by the socket.
        let (ours, theirs) = tokio::io::duplex(64 << 20);
        let budget = PreconnectBudget::new(0);
        budget.lift();
        let ws =
            WebSocketStream::from_raw_socket(Limited::new(ours, budget), Role::Server, None).await;
        let mut peer = WebSocketStream::from_raw_socket(theirs, Role::Client, None).await;
        let client = Arc::new(Client::new(
            1,
            QueueLimits {
                soft_bytes: 1 << 30,
                hard_bytes: 1 << 30,
                grace: std::time::Duration::from_secs(3600),
            },
        ));
        let frame = Bytes::from(format!(r#"{{"pad":"{}"}}"#, "x".repeat(1000)));
        let backlog = 8_000 * frame.len();
        for _ in 0..8_000 {
            assert!(client.push_frame(frame.clone()));
        }
        peer.send(Message::text(
            r#"{"type":"req","id":"a","method":"chat.abort"}"#,
        ))
        .await
        .unwrap();
        let mut conn = Conn::new(ws, Arc::clone(&client), Pause::default());
        let step = tokio::time::timeout(std::time::Duration::from_secs(5), conn.next())
            .await
            .expect("the request is read");
        assert!(matches!(step, Step::Read(Incoming::Text(t)) if t.as_str().contains("chat.abort")));
        let written = backlog - client.queued_bytes().min(backlog);
        assert!(
            written <= 2 * MAX_BATCH_BYTES,
            "{written} bytes of the {backlog}-byte backlog were written before the request was read"
        );
    }
}
