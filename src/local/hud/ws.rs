//! `GET /ws/hud`: the HUD feed as WebSocket text frames, and its move at a
//! handover (design §11). It moves as a `/ws` client does: its reader
//! stops at a message boundary (the client only sends control frames),
//! what it wrote is flushed, and its socket travels with the bytes read
//! and not parsed; its feed moves as a `/v1/hud` stream's does
//! ([`super::moving`]): the projection travels, the feed reopens right
//! after the newest cursor it applied.

use std::os::fd::{OwnedFd, RawFd};
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use base64::Engine as _;
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::{HudSource, Record};
use crate::boundary::Pause;
use crate::context::{Ctx, HudEntry, StreamEntry, StreamParcel};
use crate::local::dedicated::ClientIo;
use crate::local::preconnect::{Limited, PreconnectBudget};
use crate::local::ws::HANDOVER_PAUSE_TIMEOUT;

/// A `/ws/hud` client's WebSocket (hyper's upgraded connection, or a moved
/// socket).
pub(super) type HudWs = WebSocketStream<Limited<Box<dyn ClientIo>>>;

/// Who a `/ws/hud` client is, for the next instance.
pub(super) struct Who {
    pub(super) scopes: Vec<String>,
    pub(super) socket: String,
    pub(super) peer_pid: Option<u32>,
    pub(super) query: String,
    /// Its socket's descriptor (owned by the WebSocket): it moves when set
    /// and the event log goes on in the next instance.
    pub(super) fd: Option<RawFd>,
}

/// The WebSocket over `io` (whose first bytes are `unread`), and the
/// handle that pauses its reader at a message boundary.
pub(super) async fn websocket(io: Box<dyn ClientIo>, unread: Vec<u8>, ctx: &Ctx) -> (HudWs, Pause) {
    let max_frame = ctx.settings.limits.max_frame_bytes;
    let config = WebSocketConfig::default()
        .max_message_size(Some(max_frame))
        .max_frame_size(Some(max_frame));
    let budget = PreconnectBudget::new(0);
    budget.lift();
    let io = Limited::with_unread(io, budget, unread);
    let pause = io.pause();
    (
        WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await,
        pause,
    )
}

/// Serves a `/ws/hud` client: `first` (HUD events to send before the
/// feed's, a moved client's), then one HUD event per text frame, pings
/// when idle, until it leaves, the broker stops, or it moves.
pub(super) async fn serve(
    mut ws: HudWs,
    pause: Pause,
    mut source: HudSource,
    who: Who,
    first: Vec<String>,
    ctx: Arc<Ctx>,
) {
    let moves = who.fd.is_some() && ctx.hub.replay_file().is_some();
    let serving = moves.then(|| ctx.handoff.serving());
    let keepalive = ctx.settings.limits.sse_keepalive;
    let handoff = ctx.handoff.requested.clone();
    for event in first {
        if ws.send(Message::text(event)).await.is_err() {
            return;
        }
    }
    let mut last_write = Instant::now();
    loop {
        let idle = last_write + keepalive;
        tokio::select! {
            records = source.next_records() => {
                let Some(records) = records else { break };
                for record in records {
                    // One HUD event per text frame; the broker's own
                    // records are for SSE readers only.
                    if let Record::Hud { event, .. } = record {
                        if ws.send(Message::text(event.to_string())).await.is_err() {
                            return;
                        }
                        last_write = Instant::now();
                    }
                }
            }
            msg = ws.next() => match msg {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
            _ = tokio::time::sleep_until(idle.into()) => {
                if ws.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
                last_write = Instant::now();
            }
            _ = handoff.cancelled(), if moves => {
                match stop(&mut ws, &pause).await {
                    Some(unread) => {
                        if let Some(fd) = who.fd.and_then(dup) {
                            source.feed_left.cancel();
                            ctx.handoff.leave_stream(Box::new(WsHudMoved { source, who, unread, fd }));
                            drop(serving);
                            // Dropping `ws` closes this instance's
                            // descriptor only: the copy moves.
                            return;
                        }
                        close(&mut ws, 1012, "service restart").await;
                    }
                    None => {
                        tracing::info!("handover: a /ws/hud client not at a boundary in time; closing it");
                        close(&mut ws, 1012, "service restart").await;
                    }
                }
                break;
            }
            _ = ctx.cancel.cancelled() => {
                // Told to come back (it was not moved).
                let (code, reason) = if handoff.is_cancelled() {
                    (1012, "service restart")
                } else {
                    (1001, "going away")
                };
                close(&mut ws, code, reason).await;
                break;
            }
        }
    }
    drop(serving);
    let _ = ws.close(None).await;
}

async fn close(ws: &mut HudWs, code: u16, reason: &str) {
    let frame = CloseFrame {
        code: code.into(),
        reason: reason.into(),
    };
    let _ =
        tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, ws.send(Message::Close(Some(frame)))).await;
}

/// Stops the client's reader at a message boundary (what it sent before
/// is handled: a ping is answered) and flushes what was written, within
/// [`HANDOVER_PAUSE_TIMEOUT`]; the bytes read and not parsed. `None`: not
/// in time, or it left.
async fn stop(ws: &mut HudWs, pause: &Pause) -> Option<Vec<u8>> {
    pause.request();
    let stopped = tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, async {
        loop {
            let next = std::future::poll_fn(|cx| match ws.poll_next_unpin(cx) {
                Poll::Ready(msg) => Poll::Ready(Some(msg)),
                Poll::Pending if pause.at_boundary() => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            })
            .await;
            match next {
                None => break,
                Some(Some(Ok(Message::Close(_)))) | Some(None) | Some(Some(Err(_))) => {
                    return false
                }
                Some(Some(Ok(_))) => {}
            }
        }
        ws.flush().await.is_ok()
    })
    .await;
    (stopped == Ok(true)).then(|| ws.get_mut().take_unread())
}

/// A close-on-exec copy of the client's socket.
fn dup(fd: RawFd) -> Option<OwnedFd> {
    // SAFETY: `fd` is the descriptor of the socket under the WebSocket the
    // caller holds (it is dropped only after this), so borrowing it for
    // the duplication cannot outlive or alias a closed descriptor.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 3).ok()
}

/// A `/ws/hud` client left for the next instance.
struct WsHudMoved {
    source: HudSource,
    who: Who,
    unread: Vec<u8>,
    fd: OwnedFd,
}

impl std::fmt::Debug for WsHudMoved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WsHudMoved").finish_non_exhaustive()
    }
}

impl StreamParcel for WsHudMoved {
    /// As a `/v1/hud` stream's ([`hud_entry`]); its unsent
    /// HUD events are one JSON text per line.
    fn pack(self: Box<Self>) -> (StreamEntry, OwnedFd) {
        let WsHudMoved {
            mut source,
            who,
            unread,
            fd,
        } = *self;
        let entry = hud_entry(&mut source, who, Some(&unread), |records| {
            let mut lines = String::new();
            for record in records {
                if let Record::Hud { event, .. } = record {
                    lines.push_str(&event.to_string());
                    lines.push('\n');
                }
            }
            lines.into_bytes()
        });
        (entry, fd)
    }
}

/// A HUD stream's part of the clients document: the requests its tap
/// queued are applied now (their records travel in `unsent`, as `encode`
/// writes them), then its projection goes as it is. `unread`: a `/ws/hud`
/// client's bytes read and not parsed (`None` for `/v1/hud`).
pub(super) fn hud_entry(
    source: &mut HudSource,
    who: Who,
    unread: Option<&[u8]>,
    encode: impl Fn(&[Record]) -> Vec<u8>,
) -> StreamEntry {
    let mut records: Vec<Record> = Vec::new();
    if let Some(tap) = &source.tap {
        let (items, _) = tap.client.take_all();
        records = source.on_requests(items);
    }
    let unsent = if records.is_empty() {
        Vec::new()
    } else {
        encode(&records)
    };
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    StreamEntry {
        id: source.tap.as_ref().map_or(0, |t| t.client.id),
        conn_id: String::new(),
        connected_at_ms: 0,
        peer_pid: who.peer_pid,
        scopes: who.scopes,
        socket: who.socket,
        query: who.query,
        next_seq: 0,
        last_cursor: source.applied,
        last_seq: 0,
        gap_pending: false,
        unsent: b64(&unsent),
        unwritten: String::new(),
        finished: false,
        from_log: false,
        hud: Some(HudEntry {
            quiet_until: source.quiet_until,
            newest: source.newest,
            activity: serde_json::to_value(&source.activity).unwrap_or_default(),
            websocket: unread.is_some(),
            unread: unread.map(b64).unwrap_or_default(),
        }),
    }
}
