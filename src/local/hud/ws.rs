//! `GET /ws/hud`: the HUD feed as WebSocket text frames, and its move at a
//! handover (design §11). It moves as a `/ws` client does, where it is,
//! waiting for nobody: its reader stops (the client only sends control
//! frames; one half read moves as its bytes so far), and its socket
//! travels with those bytes and the ones written and not taken yet (every
//! frame is taken whole beside the socket: [`Limited::spool_writes`]);
//! its feed moves as a `/v1/hud` stream's does
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
use crate::context::Ctx;
use crate::local::dedicated::ClientIo;
use crate::local::preconnect::{Limited, PreconnectBudget};
use crate::local::ws::HANDOVER_PAUSE_TIMEOUT;
use crate::parcels::{Entry, HudEntry, Parcel, StreamEntry};

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

/// HUD events are taken from the feed only while less than this is
/// written and not yet taken by the client's socket.
const HELD_BYTES: usize = 256 * 1024;

/// The WebSocket over `io` (whose first bytes are `unread`; `unwritten`
/// goes to the socket first), and the handle that stops its reader.
pub(super) async fn websocket(
    io: Box<dyn ClientIo>,
    unread: Vec<u8>,
    unwritten: Vec<u8>,
    ctx: &Ctx,
) -> (HudWs, Pause) {
    let max_frame = ctx.settings.limits.max_frame_bytes;
    let config = WebSocketConfig::default()
        .max_message_size(Some(max_frame))
        .max_frame_size(Some(max_frame));
    let budget = PreconnectBudget::new(0);
    budget.lift();
    let mut io =
        Limited::with_carried(io, budget, unread, unwritten).fragments_in_pieces(max_frame);
    io.spool_writes();
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
    let serving = moves.then(|| ctx.handover.serving());
    let keepalive = ctx.settings.limits.sse_keepalive;
    let handover = ctx.handover.requested.clone();
    for event in first {
        if ws.send(Message::text(event)).await.is_err() {
            return;
        }
    }
    let mut last_write = Instant::now();
    loop {
        let idle = last_write + keepalive;
        // Bounded beside the socket: a client that does not read leaves
        // the events in the feed (judged there as any slow reader).
        let room = ws.get_ref().held_len() < HELD_BYTES;
        tokio::select! {
            records = source.next_records(), if room => {
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
            msg = next_and_drain(&mut ws) => match msg {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
            _ = tokio::time::sleep_until(idle.into()) => {
                if ws.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
                last_write = Instant::now();
            }
            _ = handover.cancelled(), if moves => {
                match stop(&mut ws, &pause).await {
                    Some((unread, unwritten)) => {
                        if let Some(fd) = who.fd.and_then(dup) {
                            source.feed_left.cancel();
                            ctx.handover.leave(Box::new(WsHudParcel { source, who, unread, unwritten, fd }));
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
                let (code, reason) = if handover.is_cancelled() {
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
    flush_held(&mut ws).await;
}

async fn close(ws: &mut HudWs, code: u16, reason: &str) {
    let frame = CloseFrame {
        code: code.into(),
        reason: reason.into(),
    };
    let _ = ws.send(Message::Close(Some(frame))).await;
    flush_held(ws).await;
}

/// At a close: writes what is held for the socket for as long as it takes
/// bytes (a client that takes none for 200 ms is not waited for), at most
/// 2 s.
async fn flush_held(ws: &mut HudWs) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while ws.get_ref().has_held() {
        let before = ws.get_ref().held_len();
        let until =
            deadline.min(tokio::time::Instant::now() + std::time::Duration::from_millis(200));
        let drained = tokio::time::timeout_at(
            until,
            std::future::poll_fn(|cx| ws.get_mut().poll_write_held(cx)),
        )
        .await;
        match drained {
            Ok(_) => return,
            Err(_) if tokio::time::Instant::now() >= deadline => return,
            Err(_) if ws.get_ref().held_len() == before => return,
            Err(_) => {}
        }
    }
}

/// The client's next message, writing what is held for its socket
/// meanwhile; `Some(Err)` when that write fails.
async fn next_and_drain(
    ws: &mut HudWs,
) -> Option<Result<Message, tokio_tungstenite::tungstenite::Error>> {
    std::future::poll_fn(|cx| {
        if ws.get_ref().has_held() {
            if let Poll::Ready(Err(e)) = ws.get_mut().poll_write_held(cx) {
                return Poll::Ready(Some(Err(e.into())));
            }
        }
        ws.poll_next_unpin(cx)
    })
    .await
}

/// Stops the client where it is, for the next instance: what its parser
/// holds whole is handled (a ping is answered: held), nothing more is
/// read, and it gives the bytes read and not parsed (a message half read
/// from its first byte) and the bytes written and not taken. `None`: it
/// left, or was inside a message too large to carry and did not finish it
/// within [`HANDOVER_PAUSE_TIMEOUT`].
async fn stop(ws: &mut HudWs, pause: &Pause) -> Option<(Vec<u8>, Vec<u8>)> {
    pause.stop();
    let parsed = loop {
        match crate::boundary::poll_now(|cx| ws.poll_next_unpin(cx)) {
            Poll::Pending => break true,
            Poll::Ready(Some(Ok(Message::Close(_)))) | Poll::Ready(None) => break false,
            Poll::Ready(Some(Err(_))) => break false,
            Poll::Ready(Some(Ok(_))) => {}
        }
    };
    if !parsed {
        return None;
    }
    let unread = match ws.get_mut().take_carried() {
        Some(unread) => unread,
        None => {
            // Inside a large message: read to its end, bounded.
            pause.resume_reads();
            pause.request();
            let stopped = tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, async {
                loop {
                    match pause.next_before_boundary(&mut *ws).await {
                        None => return true,
                        Some(Some(Ok(Message::Close(_)))) | Some(None) | Some(Some(Err(_))) => {
                            return false
                        }
                        Some(Some(Ok(_))) => {}
                    }
                }
            })
            .await;
            if stopped != Ok(true) {
                return None;
            }
            ws.get_mut().take_unread()
        }
    };
    Some((unread, ws.get_mut().take_held()))
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
struct WsHudParcel {
    source: HudSource,
    who: Who,
    unread: Vec<u8>,
    unwritten: Vec<u8>,
    fd: OwnedFd,
}

impl std::fmt::Debug for WsHudParcel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WsHudParcel").finish_non_exhaustive()
    }
}

impl Parcel for WsHudParcel {
    /// As a `/v1/hud` stream's ([`hud_entry`]); its unsent
    /// HUD events are one JSON text per line.
    fn pack(self: Box<Self>) -> Entry {
        let WsHudParcel {
            mut source,
            who,
            unread,
            unwritten,
            fd,
        } = *self;
        let mut entry = hud_entry(&mut source, who, Some(&unread), |records| {
            let mut lines = String::new();
            for record in records {
                if let Record::Hud { event, .. } = record {
                    lines.push_str(&event.to_string());
                    lines.push('\n');
                }
            }
            lines.into_bytes()
        });
        entry.unwritten = base64::engine::general_purpose::STANDARD.encode(&unwritten);
        Entry::Stream(entry, fd)
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
