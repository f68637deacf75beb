//! `GET /ws/dedicated`: a gateway connection of its own for one local client.
//!
//! Some clients cannot share the broker's session: a device-signed Control
//! UI, a client that must appear under its own device in the gateway's
//! pairing list, a `role: "node"` connection. For each of them the broker
//! opens a separate upstream connection, the way Claw3D's studio proxy does
//! (`server/gateway-proxy.js` in iamlukethedev/Claw3D, commit eeb6f31):
//!
//! - the gateway's frames (its `connect.challenge` first) reach the client
//!   verbatim, so a device signature covers the gateway's own nonce. Unlike
//!   Claw3D, the upstream connection is not opened with the client's
//!   WebSocket (before: opening and closing the route without a `connect`
//!   made 41.6 gateway connections per second): it is opened when the
//!   client's `connect` arrives, or — for a client that waits for the
//!   gateway's challenge before it connects, as device-signed OpenClaw
//!   clients do for up to 750 ms — once the client has stayed open and
//!   silent for [`CHALLENGE_WAIT`]. A client that leaves sooner costs the
//!   gateway nothing. Every open takes a token from the per-peer and total
//!   rates of `[limits] upstream_open_*` ([`crate::rate::OpenLimiter`],
//!   keyed by the peer's uid); over either, the `connect` is answered
//!   `studio.too_many_requests` with `retryAfterMs` and nothing is opened;
//! - the client's first frame must be a `req` `connect` with a string id
//!   (`1008 connect required` / `connect id required`, `1003 invalid json`),
//!   held until the upstream socket is open, then forwarded;
//! - the host token is put into `params.auth.token` only when the client sent
//!   no token, password, device token or complete device block (Claw3D's
//!   `forwardConnectFrame`: `hasNonEmptyToken || hasNonEmptyPassword ||
//!   hasNonEmptyDeviceToken || hasCompleteDeviceAuth`); with neither,
//!   `studio.gateway_token_missing`;
//! - a failure before the gateway answered the `connect` is a `studio.*`
//!   error on the connect id, built by the same functions as the shared
//!   session's (`crate::upstream::{open_failed, closed_before_answer,
//!   handshake_timed_out}`), then close `1011 connect failed` after the
//!   same linger as on `/ws`;
//! - after that, frames pass verbatim both ways (no id or `seq` rewriting)
//!   and a close on either side is mirrored to the other with its code and
//!   reason. Where there is no close frame to mirror, Claw3D's own choices:
//!   `1012 upstream closed` to the client, `1001 going away` to the gateway;
//! - the gateway connection of a browser client (its upgrade request carried
//!   an `Origin`, or its `connect` names a browser UI) is opened with the
//!   `Origin` of `[upstream] dedicated_origin`, by default derived from the
//!   gateway URL as Claw3D derives it (see the `origin` module for who gets
//!   one and why not everyone).
//!
//! At a handover (design §11) a connection whose `connect` the gateway
//! answered moves whole to the next instance ([`take_over`]): both directions
//! stop reading at a message boundary once what they read is relayed, and
//! the client's socket and its own gateway socket travel with the bytes
//! read from each and not parsed. One that cannot (its `connect` is
//! unanswered, its gateway is `wss://`) is closed `1001` as at a stop.
//!
//! Differences from Claw3D, on purpose: no `Origin` header upstream for a
//! client that is no browser (with one, the gateway would stop pairing its
//! device silently on loopback), no `openclaw-control-ui` →
//! `webchat-ui` rename (the client asked for its own identity), frames are
//! not re-serialized, and the limits are the broker's: `max_dedicated`
//! connections, `preconnect_max_bytes` before the gateway admits the client,
//! `max_frame_bytes` after, `connect_timeout` for the client's `connect`, and
//! `[upstream] handshake_timeout` for opening the gateway connection and for
//! the gateway's answer.

mod close;
mod connect_auth;
mod handover;
mod origin;
mod relay;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};

use super::preconnect::{Limited, PreconnectBudget};
use super::ws_errors::{self, ReadFailure};
use crate::boundary::Releasing;
use crate::context::Ctx;
pub use crate::dedicated_registry::{Dedicated, Outcomes};
use crate::dedicated_registry::{Listing, Slot};
use crate::policy::{MethodFilter, SocketPolicy};
use crate::protocol::frames::encode_res_error;
use crate::protocol::{ConnectRequest, ErrorShape, StudioCode, UpstreamFrame};
use crate::rate::Exceeded;
use crate::upstream::{
    closed_before_answer, handshake_timed_out, open_failed, open_socket, GatewaySocket,
};
use close::{send_close, text_message};
pub use connect_auth::client_auth;
use connect_auth::inject_token;
use handover::Pauses;
pub use handover::{take_over, DedicatedParcel};

/// How long a client may stay open without sending its `connect` before the
/// gateway connection is opened anyway, so a client that waits for the
/// gateway's `connect.challenge` (to sign its nonce) gets it. OpenClaw's
/// client waits 750 ms for it: this leaves the gateway most of that to answer.
pub const CHALLENGE_WAIT: Duration = Duration::from_millis(100);

/// After a failed connect answer, how long the client may take to close
/// first before the broker closes `1011 connect failed` (as on `/ws`).
const CONNECT_FAILED_LINGER: Duration = Duration::from_secs(1);

/// How long the side that did not start a close may take to answer it
/// before its socket is dropped.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// The client's byte stream: the upgraded HTTP connection, or, taken over
/// from the previous instance at a handover, its socket.
pub trait ClientIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> ClientIo for T {}

/// A dedicated client's WebSocket.
pub type DedicatedWs = tokio_tungstenite::WebSocketStream<Limited<Box<dyn ClientIo>>>;
type Ws = DedicatedWs;

/// Who the client is, as the accept loop saw it.
#[derive(Debug, Clone, Copy)]
pub struct Client {
    /// Its uid (from the kernel), which keys its share of the upstream-open
    /// rate.
    pub uid: Option<u32>,
    /// Its upgrade request carried an `Origin` (see the `origin` module).
    pub browser: bool,
    /// The descriptor of its socket, for a handover.
    pub fd: Option<std::os::fd::RawFd>,
}

/// Whether `/ws/dedicated` is served on a socket with this policy: only
/// where it limits neither scopes nor methods. The route relays frames
/// unchecked (and may add the host token), so on a restricted socket it
/// would hand out what the policy withholds.
pub fn served_on(socket: &SocketPolicy) -> bool {
    socket.scopes.is_none() && socket.methods == MethodFilter::default()
}

/// Runs one dedicated client to completion (or until it moves to the next
/// instance at a handover: [`take_over`] serves it there).
pub async fn run(ws: Ws, budget: PreconnectBudget, client: Client, ctx: Arc<Ctx>) {
    let fd = client.fd;
    let local_pause = ws.get_ref().pause();
    let (mut local_tx, local_rx) = ws.split();
    let Some(slot) = ctx.dedicated.try_open() else {
        ctx.dedicated
            .outcomes
            .refused
            .fetch_add(1, Ordering::Relaxed);
        let max = ctx.dedicated.max;
        tracing::warn!(limit = max, "too many dedicated connections; refusing one");
        let reason = format!("too many dedicated connections ({max}); raise limits.max_dedicated");
        send_close(&mut local_tx, 1013, &reason).await;
        return;
    };
    let dedicated_id = slot.id;
    tracing::info!(dedicated_id, "dedicated client opened");
    let mut conn = Conn::new(local_tx, local_rx, &ctx, slot, budget, client);
    let cancel = ctx.cancel.clone();
    let upstream = tokio::select! {
        up = conn.handshake() => up,
        _ = cancel.cancelled() => {
            send_close(&mut conn.local_tx, 1001, "going away").await;
            None
        }
    };
    if let Some((up, connect_id)) = upstream {
        let pauses = Pauses {
            client: local_pause,
            gateway: up.get_ref().pause().filter(|_| fd.is_some()),
        };
        conn.serve(up, &connect_id, false, pauses, fd).await;
    } else {
        tracing::info!(dedicated_id, "dedicated client disconnected");
    }
}

impl Conn {
    fn new(
        local_tx: SplitSink<Ws, Message>,
        local_rx: SplitStream<Ws>,
        ctx: &Arc<Ctx>,
        slot: Slot,
        budget: PreconnectBudget,
        client: Client,
    ) -> Conn {
        Conn {
            local_tx,
            local_rx: Releasing::new(local_rx),
            ctx: Arc::clone(ctx),
            slot,
            budget,
            peer_uid: client.uid,
            browser: client.browser,
        }
    }
}

/// What a read from one side gave.
enum Read {
    /// A text or binary frame, to relay as it is.
    Frame(Message),
    /// A control frame (ping, pong): nothing to relay.
    Skip,
    /// The side sent a close frame (`None`: one without a code).
    Closed(Option<CloseFrame>),
    /// The connection ended without a close frame.
    Ended,
    /// A frame over the limit (the local `max_frame_bytes` or pre-connect
    /// budget, or `[upstream] max_frame_bytes`).
    TooLarge,
    /// The peer broke the WebSocket protocol: close with this code.
    Invalid(u16, &'static str),
}

fn classify(msg: Option<Result<Message, WsError>>, side: &str) -> Read {
    match msg {
        Some(Ok(Message::Close(frame))) => Read::Closed(frame),
        Some(Ok(m @ (Message::Text(_) | Message::Binary(_)))) => Read::Frame(m),
        // Pings and pongs belong to one hop: tungstenite answers a ping on
        // each side itself.
        Some(Ok(_)) => Read::Skip,
        None => Read::Ended,
        Some(Err(e)) => match ws_errors::classify(&e, side) {
            ReadFailure::Ended => Read::Ended,
            ReadFailure::TooLarge => Read::TooLarge,
            ReadFailure::Invalid(code, reason) => Read::Invalid(code, reason),
        },
    }
}

/// How the relay ended, and so how both sides are closed.
enum End {
    /// The client closed, left, or broke a limit (its close, if any).
    Client(Read),
    /// The gateway closed or went away.
    Gateway(Read),
    /// A `studio.*` error before the gateway answered the `connect`; it was
    /// sent to the client.
    Unanswered,
    /// Writing to the client failed (it is gone).
    ClientGone,
    /// A write to the client made no progress for `limits.slow_grace`: it
    /// does not read. (Not reading the gateway meanwhile would leave the
    /// gateway's own slow-consumer close unseen.)
    ClientSlow,
    /// Writing to the gateway failed, or made no progress for
    /// `[upstream] write_timeout` (it does not read).
    GatewayGone,
    /// The broker is stopping.
    Shutdown,
    /// Both readers stopped at a message boundary for a handover.
    HandedOver,
}

impl End {
    /// How `/metrics` counts it (`clawmux_dedicated_ends_total{reason}`).
    fn label(&self) -> &'static str {
        match self {
            End::Client(_) => "client_closed",
            End::Gateway(_) => "gateway_closed",
            End::Unanswered => "unanswered",
            End::ClientGone => "client_gone",
            End::ClientSlow => "client_slow",
            End::GatewayGone => "gateway_gone",
            End::Shutdown => "shutdown",
            End::HandedOver => "handed_over",
        }
    }
}

/// Where the gateway connection is during the handshake.
enum Upstream {
    /// Not opened yet: waiting for the client's `connect` (or [`CHALLENGE_WAIT`]).
    NotYet,
    Opening,
    Open(GatewaySocket),
    Failed(ErrorShape),
    /// Not opened: over the upstream-open rate.
    Limited(ErrorShape),
}

/// One dedicated client's connection.
struct Conn {
    local_tx: SplitSink<Ws, Message>,
    local_rx: Releasing<SplitStream<Ws>>,
    ctx: Arc<Ctx>,
    slot: Slot,
    budget: PreconnectBudget,
    peer_uid: Option<u32>,
    /// The upgrade request carried an `Origin`: a browser, or a proxy for one.
    browser: bool,
}

/// A client's `connect`, checked and ready to forward.
struct TakenConnect {
    id: String,
    /// The frame to forward (with the host token when it had no auth).
    text: String,
    /// It names a browser UI ([`origin::names_browser_ui`]).
    browser_ui: bool,
}

impl Conn {
    /// Takes a token for one gateway connection from the open rates, or
    /// the `studio.too_many_requests` answer for the client's `connect`.
    fn may_open(&self) -> Result<(), ErrorShape> {
        let limits = &self.ctx.settings.limits;
        // A peer whose uid the kernel did not give shares one bucket.
        let peer = self.peer_uid.unwrap_or(u32::MAX);
        let limited = match self
            .ctx
            .dedicated
            .opens(limits)
            .try_acquire(&peer, std::time::Instant::now())
        {
            Ok(()) => return Ok(()),
            Err(limited) => limited,
        };
        self.ctx
            .dedicated
            .outcomes
            .rate_limited
            .fetch_add(1, Ordering::Relaxed);
        let (setting, rate) = match limited.exceeded {
            Exceeded::Peer => ("upstream_open_rate", limits.upstream_open_rate),
            Exceeded::Total => ("upstream_open_rate_total", limits.upstream_open_rate_total),
        };
        let whose = match limited.exceeded {
            Exceeded::Peer => "this user's",
            Exceeded::Total => "all local clients'",
        };
        tracing::warn!(
            dedicated_id = self.slot.id,
            peer_uid = peer,
            limit = setting,
            "dedicated connection refused: over the upstream-open rate"
        );
        Err(ErrorShape::studio(
            StudioCode::TooManyRequests,
            format!(
                "too many gateway connections opened for local clients: over {whose} rate of {rate}/s ([limits] {setting}); retry later"
            ),
        )
        .with_retry_after_ms(Some(limited.retry_after_ms()))
        .with_details(serde_json::json!({"limit": setting, "rate_per_second": rate})))
    }

    /// Opens the gateway connection while waiting for the client's
    /// `connect`, relays the gateway's frames meanwhile, and forwards the
    /// `connect` (with the host token when the client brought no auth).
    /// Returns the gateway socket and the connect id, or `None` when the
    /// connection ended here (its close already sent).
    async fn handshake(&mut self) -> Option<(GatewaySocket, String)> {
        let ctx = Arc::clone(&self.ctx);
        let limits = &ctx.settings.limits;
        let target = ctx.upstream().target();
        let opts = ctx.settings.upstream.clone();
        let url = target.url.trim().to_owned();
        let open = |origin: Option<String>| {
            let (target, opts, url) = (target.clone(), opts.clone(), url.clone());
            async move {
                let opening = open_socket(&target, &opts, origin.as_deref());
                tokio::time::timeout(opts.handshake_timeout, opening)
                    .await
                    .unwrap_or_else(|_| Err(handshake_timed_out(&url, opts.handshake_timeout)))
            }
        };
        let mut opening = std::pin::pin!(futures_util::future::OptionFuture::from(None));
        let mut upstream = Upstream::NotYet;
        let started = tokio::time::Instant::now();
        let connect_deadline = started + limits.connect_timeout;
        let challenge_wait = started + CHALLENGE_WAIT;
        // The client's connect: its id, and the text to forward.
        let mut connect: Option<TakenConnect> = None;
        loop {
            if let Some(TakenConnect { id, browser_ui, .. }) = &connect {
                if matches!(upstream, Upstream::NotYet) {
                    upstream = self.start_open(&mut opening, &open, *browser_ui);
                }
                match &mut upstream {
                    Upstream::NotYet | Upstream::Opening => {}
                    Upstream::Failed(error) => {
                        let (id, error) = (id.clone(), error.clone());
                        self.connect_failed(&id, &error).await;
                        return None;
                    }
                    Upstream::Limited(error) => {
                        let (id, error) = (id.clone(), error.clone());
                        self.answer_and_close(&id, &error).await;
                        return None;
                    }
                    Upstream::Open(_) => break,
                }
            }
            let opening_now = matches!(upstream, Upstream::Opening);
            let not_yet = matches!(upstream, Upstream::NotYet);
            tokio::select! {
                opened = &mut opening, if opening_now => {
                    upstream = match opened {
                        Some(Ok(ws)) => Upstream::Open(ws),
                        Some(Err(e)) => {
                            tracing::info!(dedicated_id = self.slot.id, code = %e.code, "dedicated upstream failed: {}", e.message);
                            Upstream::Failed(e)
                        }
                        None => Upstream::NotYet,
                    };
                }
                _ = tokio::time::sleep_until(challenge_wait), if not_yet && connect.is_none() => {
                    // The client may be waiting for the gateway's challenge.
                    upstream = self.start_open(&mut opening, &open, false);
                }
                read = next_from_gateway(&mut upstream) => {
                    match read {
                        Read::Frame(m) => {
                            if self.local_tx.send(m).await.is_err() {
                                self.ended_early(Early::Abandoned);
                                return None;
                            }
                        }
                        Read::Skip => {}
                        Read::Closed(frame) => {
                            let (code, reason) = frame.map(|f| (u16::from(f.code), f.reason.to_string())).unwrap_or((1005, String::new()));
                            upstream = Upstream::Failed(closed_before_answer(code, &reason));
                        }
                        Read::Ended | Read::Invalid(..) => {
                            upstream = Upstream::Failed(closed_before_answer(1006, "the connection ended"));
                        }
                        Read::TooLarge => {
                            upstream = Upstream::Failed(ErrorShape::studio(StudioCode::UpstreamError, "the gateway sent a frame over [upstream] max_frame_bytes"));
                        }
                    }
                }
                read = self.local_rx.next(), if connect.is_none() => {
                    match classify(read, "dedicated client") {
                        Read::Frame(m) => match self.take_connect(m, &target.token) {
                            Ok(c) => connect = Some(c),
                            Err(Refusal::Close(code, reason)) => {
                                self.ended_early(Early::Invalid);
                                send_close(&mut self.local_tx, code, &reason).await;
                                close_quietly(upstream).await;
                                return None;
                            }
                            Err(Refusal::Answer(id, error)) => {
                                self.connect_failed(&id, &error).await;
                                close_quietly(upstream).await;
                                return None;
                            }
                        },
                        Read::Closed(_) | Read::Ended => {
                            // Nothing was forwarded: the gateway (if it was
                            // reached at all) sees an ordinary close of a
                            // connection that never connected.
                            self.ended_early(Early::Abandoned);
                            let _ = self.local_tx.flush().await;
                            close_quietly(upstream).await;
                            return None;
                        }
                        Read::TooLarge => {
                            self.ended_early(Early::Invalid);
                            send_close(&mut self.local_tx, 1009, "frame too large").await;
                            close_quietly(upstream).await;
                            return None;
                        }
                        Read::Skip => {}
                        Read::Invalid(code, reason) => {
                            self.ended_early(Early::Invalid);
                            send_close(&mut self.local_tx, code, reason).await;
                            close_quietly(upstream).await;
                            return None;
                        }
                    }
                }
                _ = tokio::time::sleep_until(connect_deadline), if connect.is_none() => {
                    self.ended_early(Early::TimedOut);
                    send_close(&mut self.local_tx, 1008, "connect timeout").await;
                    close_quietly(upstream).await;
                    return None;
                }
            }
        }
        let (Some(TakenConnect { id, text, .. }), Upstream::Open(mut ws)) = (connect, upstream)
        else {
            return None;
        };
        if let Err(e) = ws.send(Message::text(text)).await {
            let error = open_failed(&url, e);
            self.connect_failed(&id, &error).await;
            return None;
        }
        self.slot.update(|l| l.phase = "connecting");
        Some((ws, id))
    }

    /// Starts opening the gateway connection if the open rates allow it:
    /// with the configured `Origin` for a browser client (`browser_ui`: its
    /// `connect`, already here, names a browser UI).
    fn start_open<F, Fut>(
        &self,
        opening: &mut std::pin::Pin<&mut futures_util::future::OptionFuture<Fut>>,
        open: &F,
        browser_ui: bool,
    ) -> Upstream
    where
        F: Fn(Option<String>) -> Fut,
        Fut: std::future::Future<Output = Result<GatewaySocket, ErrorShape>>,
    {
        if let Err(error) = self.may_open() {
            return Upstream::Limited(error);
        }
        self.ctx
            .dedicated
            .outcomes
            .upstream_opens
            .fetch_add(1, Ordering::Relaxed);
        let origin = if self.browser || browser_ui {
            let url = self.ctx.upstream().target_url();
            self.ctx.settings.upstream.dedicated_origin.for_url(&url)
        } else {
            None
        };
        self.slot.update(|l| l.origin.clone_from(&origin));
        opening.set(Some(open(origin)).into());
        Upstream::Opening
    }

    /// Counts a connection that ended before its `connect` was forwarded.
    fn ended_early(&self, how: Early) {
        let o = &self.ctx.dedicated.outcomes;
        match how {
            Early::Abandoned => &o.abandoned,
            Early::Invalid => &o.invalid,
            Early::TimedOut => &o.timed_out,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Checks the client's first frame and prepares the `connect` to
    /// forward: verbatim, or with the host token when it carries no auth.
    fn take_connect(
        &self,
        msg: Message,
        host_token: &Option<crate::config::Secret>,
    ) -> Result<TakenConnect, Refusal> {
        let limits = &self.ctx.settings.limits;
        let text = match msg {
            Message::Text(t) => t,
            Message::Binary(b) => {
                Utf8Bytes::try_from(b).map_err(|_| Refusal::Close(1003, "invalid json".into()))?
            }
            _ => return Err(Refusal::Close(1008, "connect required".into())),
        };
        if text.len() > limits.preconnect_max_bytes {
            return Err(Refusal::Close(1009, "frame too large".into()));
        }
        let req = ConnectRequest::parse_first(text.as_str())
            .map_err(|e| Refusal::Close(e.close_code(), e.to_string()))?;
        let client_auth = client_auth(&req.params);
        let browser_ui = origin::names_browser_ui(&req.params);
        let identity = |l: &mut Listing, auth| {
            let p = &req.params;
            l.client = p.get("client").cloned().unwrap_or(Value::Null);
            l.role = Some(
                p.get("role")
                    .and_then(Value::as_str)
                    .unwrap_or("operator")
                    .to_owned(),
            );
            l.device_id = p
                .pointer("/device/id")
                .and_then(Value::as_str)
                .map(str::to_owned);
            l.auth = auth;
        };
        if let Some(kind) = client_auth {
            self.slot.update(|l| identity(l, Some(kind)));
            return Ok(TakenConnect {
                id: req.id,
                text: text.as_str().to_owned(),
                browser_ui,
            });
        }
        self.slot.update(|l| identity(l, None));
        let Some(token) = host_token else {
            return Err(Refusal::Answer(
                req.id,
                Box::new(ErrorShape::studio(
                    StudioCode::GatewayTokenMissing,
                    "no gateway token on this host and the client sent no auth: write the gateway's token to ~/.config/clawmux/gateway-token (`(umask 077; printf '%s' 'TOKEN' > ~/.config/clawmux/gateway-token)`), or use --token-file or CLAWMUX_GATEWAY_TOKEN; or connect with your own auth or device identity",
                )),
            ));
        };
        let injected = inject_token(text.as_str(), token.expose())
            .ok_or_else(|| Refusal::Close(1003, "invalid json".into()))?;
        self.slot.update(|l| l.auth = Some("host-token"));
        Ok(TakenConnect {
            id: req.id,
            text: injected,
            browser_ui,
        })
    }

    /// Answers the connect with `error`, then closes `1011 connect failed`
    /// unless the client closes first (as on `/ws`).
    async fn connect_failed(&mut self, id: &str, error: &ErrorShape) {
        tracing::info!(dedicated_id = self.slot.id, code = %error.code, "dedicated connect failed");
        self.ctx
            .dedicated
            .outcomes
            .failed
            .fetch_add(1, Ordering::Relaxed);
        self.answer_and_close(id, error).await;
    }

    /// Answers the connect with `error` (already counted), then closes as
    /// [`Conn::connect_failed`] does.
    async fn answer_and_close(&mut self, id: &str, error: &ErrorShape) {
        let frame = encode_res_error(id, error);
        if self.local_tx.send(text_message(frame)).await.is_err() {
            return;
        }
        self.linger_then_close().await;
    }

    /// After a failed connect answer: the client may close first (Claw3D
    /// closes `4008 connect failed: …` and shows that close), else the broker
    /// closes `1011 connect failed` after [`CONNECT_FAILED_LINGER`].
    async fn linger_then_close(&mut self) {
        let closed_first = tokio::time::timeout(CONNECT_FAILED_LINGER, async {
            loop {
                match self.local_rx.next().await {
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                    Some(Ok(_)) => {}
                }
            }
        })
        .await
        .is_ok();
        if closed_first {
            // Writes the echo of the client's close.
            let _ = tokio::time::timeout(CLOSE_LINGER, self.local_tx.flush()).await;
        } else {
            send_close(&mut self.local_tx, 1011, "connect failed").await;
        }
    }
}

/// How a connection ended before its `connect` was forwarded.
#[derive(Debug, Clone, Copy)]
enum Early {
    /// The client left (or stopped reading) first.
    Abandoned,
    /// Its first frame was not a usable `connect`.
    Invalid,
    /// No `connect` within `limits.connect_timeout`.
    TimedOut,
}

/// Why the client's first frame was not forwarded.
enum Refusal {
    /// Close with this code and reason (no answer: no usable connect id).
    Close(u16, String),
    /// Answer the connect id with this error, then close `1011`.
    Answer(String, Box<ErrorShape>),
}

/// Reads the gateway during the handshake (pending while it is not open).
async fn next_from_gateway(upstream: &mut Upstream) -> Read {
    match upstream {
        Upstream::Open(ws) => classify(ws.next().await, "gateway"),
        _ => std::future::pending().await,
    }
}

/// Closes a gateway connection nobody connected on.
async fn close_quietly(upstream: Upstream) {
    if let Upstream::Open(mut ws) = upstream {
        let _ = tokio::time::timeout(CLOSE_LINGER, ws.close(None)).await;
    }
}

/// Sends the client its `studio.*` error for a connect the gateway did not
/// answer; the close follows in `finish`.
async fn unanswered(
    local_tx: &mut SplitSink<Ws, Message>,
    connect_id: &str,
    error: ErrorShape,
) -> End {
    tracing::info!(code = %error.code, "dedicated connect failed: {}", error.message);
    let _ = local_tx
        .send(text_message(encode_res_error(connect_id, &error)))
        .await;
    End::Unanswered
}

/// Whether `text` is the gateway's answer to the connect (`Some(ok)`); on
/// `ok`, the listing takes the gateway's connection id and granted scopes.
fn connect_answer(text: &str, connect_id: &str, slot: &Slot) -> Option<bool> {
    let Some(UpstreamFrame::Res {
        id, ok, payload, ..
    }) = UpstreamFrame::parse(text)
    else {
        return None;
    };
    if id != connect_id {
        return None;
    }
    let hello: Value = payload
        .and_then(|p| serde_json::from_str(p.get()).ok())
        .unwrap_or(Value::Null);
    slot.update(|l| {
        l.phase = if ok { "connected" } else { "rejected" };
        l.conn_id = hello
            .pointer("/server/connId")
            .and_then(Value::as_str)
            .map(str::to_owned);
        l.scopes = hello.pointer("/auth/scopes").cloned();
        if let Some(role) = hello.pointer("/auth/role").and_then(Value::as_str) {
            l.role = Some(role.to_owned());
        }
    });
    Some(ok)
}
