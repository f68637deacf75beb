//! A `/v1/hud` stream at a handover (design §11): its body stops between
//! two chunks as a `/v1/events` stream's does ([`crate::local::sse`]), and
//! it moves with its projection. Its feed (its own `/v1/events` stream,
//! read in this process) does not move: the next instance opens it again
//! right after the newest cursor the projection applied, from the event
//! log, which a handover continues without a gap. So what the feed had
//! received and not yet applied is applied there, once, by the same
//! projection, and the HUD records come out as they would have here.
//! Requests the tap had queued for it are applied here and their records
//! travel as bytes. It moves only when the log is kept in a file (else the
//! next instance's log starts empty, and the stream is closed instead).

use crate::context::holding;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::StatusCode;
use tokio_util::sync::CancellationToken;

use super::{sse_chunk, Activity, HudSource};
use crate::context::Ctx;
use crate::local::sse::{BodySource, Opening, Step};
use crate::local::ws::HANDOVER_PAUSE_TIMEOUT;
use crate::parcels::{Entry, Parcel, StreamEntry};
use crate::policy::{Access, SocketPolicy};

/// A HUD stream's body: its feed, as SSE chunks, with keep-alives.
pub(super) struct HudBody {
    source: HudSource,
    keepalive: Duration,
    cancel: CancellationToken,
    handover: CancellationToken,
    /// It stops for a handover.
    moves: bool,
    /// Who it is for, for the next instance.
    scopes: Vec<String>,
    socket: String,
    peer_pid: Option<u32>,
    /// Its `/v1/hud` query.
    query: String,
    /// Cut by its feed's watch once the feed was closed and did not drain
    /// (a moved stream's own; hyper's connection otherwise).
    kill: Option<CancellationToken>,
    _done: DoneOnDrop,
}

/// Cancels its token when the body is dropped (its watch then ends).
struct DoneOnDrop(CancellationToken);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

impl HudBody {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        ctx: &Ctx,
        source: HudSource,
        access: &Access,
        peer_pid: Option<u32>,
        query: String,
        moves: bool,
        done: CancellationToken,
    ) -> HudBody {
        HudBody {
            source,
            keepalive: ctx.settings.limits.sse_keepalive,
            cancel: ctx.cancel.clone(),
            handover: ctx.handover.requested.clone(),
            moves,
            scopes: access.grant.scopes().to_vec(),
            socket: access.socket.name.clone(),
            peer_pid,
            query,
            kill: None,
            _done: DoneOnDrop(done),
        }
    }

    async fn next(&mut self) -> Step {
        if self.moves && self.handover.is_cancelled() {
            return Step::Stop;
        }
        let idle_until = tokio::time::Instant::now() + self.keepalive;
        loop {
            tokio::select! {
                next = tokio::time::timeout_at(idle_until, self.source.next_records()) => {
                    return match next {
                        Ok(None) => Step::End,
                        Ok(Some(records)) if records.is_empty() => continue,
                        Ok(Some(records)) => Step::Chunk(sse_chunk(&records)),
                        Err(_) => Step::Chunk(Bytes::from_static(b": keep-alive\n\n")),
                    };
                }
                _ = self.handover.cancelled(), if self.moves => return Step::Stop,
            }
        }
    }
}

impl BodySource for HudBody {
    fn next_step(&mut self) -> impl Future<Output = Step> + Send {
        HudBody::next(self)
    }

    fn give_up(&self) -> impl Future<Output = ()> + Send {
        let (kill, cancel, handover, moves) = (
            self.kill.clone(),
            self.cancel.clone(),
            self.handover.clone(),
            self.moves,
        );
        async move {
            let kill = async {
                match &kill {
                    Some(kill) => kill.cancelled().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = kill => {}
                _ = cancel.cancelled() => tokio::time::sleep(Duration::from_secs(2)).await,
                _ = handover.cancelled(), if moves => {
                    tokio::time::sleep(HANDOVER_PAUSE_TIMEOUT).await
                }
            }
        }
    }

    fn stopped(&mut self) {
        self.moves = false;
        self.source.feed_left.cancel();
    }

    fn into_parcel(self, fd: OwnedFd) -> Box<dyn Parcel> {
        Box::new(HudParcel { body: self, fd })
    }

    fn id(&self) -> u64 {
        self.source.tap.as_ref().map_or(0, |t| t.client.id)
    }

    fn moves(&self) -> bool {
        self.moves
    }
}

/// A HUD stream left for the next instance.
struct HudParcel {
    body: HudBody,
    fd: OwnedFd,
}

impl std::fmt::Debug for HudParcel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HudParcel").finish_non_exhaustive()
    }
}

impl Parcel for HudParcel {
    fn pack(self: Box<Self>) -> Entry {
        let HudParcel { mut body, fd } = *self;
        let who = super::ws::Who {
            scopes: std::mem::take(&mut body.scopes),
            socket: std::mem::take(&mut body.socket),
            peer_pid: body.peer_pid,
            query: std::mem::take(&mut body.query),
            fd: None,
        };
        let entry = super::ws::hud_entry(&mut body.source, who, None, |records| {
            sse_chunk(records).to_vec()
        });
        Entry::Stream(entry, fd)
    }
}

/// Serves a HUD stream moved from the previous instance: its feed opens
/// again right after the newest cursor it applied (admitted now, before
/// the gateway connection is taken over), through its projection, written
/// on by its own task. False when it cannot be: its socket is closed (or,
/// when the log cannot serve its feed, ended with a `clawmux.close`), and
/// the reader resumes by `Last-Event-ID`.
pub(crate) fn take_over(
    ctx: &Arc<Ctx>,
    policies: &[Arc<SocketPolicy>],
    mut entry: StreamEntry,
    fd: OwnedFd,
    slot: crate::slots::Slot,
) -> bool {
    let Some(access) = crate::local::sse::moved_access(policies, &entry) else {
        return false;
    };
    let Some(hud) = entry.hud.take() else {
        return false;
    };
    let (Ok(unsent), Ok(activity), Some(unwritten)) = (
        base64::engine::general_purpose::STANDARD.decode(&entry.unsent),
        serde_json::from_value::<Activity>(hud.activity),
        crate::local::sse::unwritten_of(&entry),
    ) else {
        tracing::warn!("handover: a HUD stream's state does not read here; closing it");
        return false;
    };
    if !super::may_observe(&access.grant) {
        return false;
    }
    let Some(socket) = crate::local::sse::take_over_socket(fd) else {
        return false;
    };
    let unread = base64::engine::general_purpose::STANDARD
        .decode(&hud.unread)
        .unwrap_or_default();
    let kill = CancellationToken::new();
    let feed_left = CancellationToken::new();
    let resp = crate::local::sse::open_from(
        Opening {
            query: Some(format!("tool_events=all&after_seq={}", entry.last_cursor)),
            last_event_id: None,
            access: access.clone(),
            peer_pid: entry.peer_pid,
            kill: Some(kill.clone()),
            socket: None,
            reader_left: Some(feed_left.clone()),
        },
        ctx,
    );
    if resp.status() != StatusCode::OK {
        tracing::warn!(status = %resp.status(), "handover: the HUD stream's feed cannot go on here; closing it");
        if !hud.websocket {
            ctx.spawn_moved(holding(
                slot,
                crate::local::sse::end_with(socket, unwritten, Vec::new(), true),
            ));
        }
        return false;
    }
    let source = HudSource::on(resp, ctx, activity, hud.quiet_until, hud.newest, feed_left);
    if hud.websocket {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&socket);
        let who = super::ws::Who {
            scopes: entry.scopes,
            socket: entry.socket,
            peer_pid: entry.peer_pid,
            query: entry.query,
            fd: Some(fd),
        };
        let first = String::from_utf8_lossy(&unsent)
            .lines()
            .map(str::to_owned)
            .collect();
        let ctx = Arc::clone(ctx);
        ctx.clone().spawn_moved(async move {
            let _slot = slot;
            let (ws, pause) = super::ws::websocket(Box::new(socket), unread, unwritten, &ctx).await;
            super::ws::serve(ws, pause, source, who, first, ctx).await;
        });
        tracing::debug!("/ws/hud client taken over");
        return true;
    }
    let moves = ctx.hub.replay_file().is_some();
    let mut body = HudBody::new(
        ctx,
        source,
        &access,
        entry.peer_pid,
        entry.query,
        moves,
        CancellationToken::new(),
    );
    body.kill = Some(kill);
    tracing::debug!("HUD stream taken over");
    ctx.spawn_moved(holding(
        slot,
        crate::local::sse::write_on(
            Arc::clone(ctx),
            socket,
            body,
            unwritten,
            Bytes::from(unsent),
        ),
    ));
    true
}
