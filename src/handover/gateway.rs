//! The gateway connections a handover moves, the main session's and each
//! narrower session's: each stops where it is and leaves a parcel, with
//! its requests in flight for the moving clients ([`leave`]), and the next
//! instance's connector takes its socket over ([`take_over`]). Their
//! parcels are packed here rather than beside the sessions' own code:
//! packing one reaches the router and the dispatcher, which sit above the
//! sessions.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use base64::Engine as _;

use crate::context::Ctx;
use crate::parcels::{Entry, NarrowerEntry, Parcel, Subscription, UpstreamEntry};
use crate::policy::Grant;

/// How long a handover waits for a gateway session to stop (inside a
/// message too large to carry, its own bound is 1 s; the rest is margin).
pub const UPSTREAM_HANDOVER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A gateway connection stopped for the next instance, with its socket.
#[derive(Debug)]
enum GatewayParcel {
    Main(UpstreamEntry, OwnedFd),
    Narrower(NarrowerEntry, OwnedFd),
}

impl Parcel for GatewayParcel {
    fn pack(self: Box<Self>) -> Entry {
        match *self {
            GatewayParcel::Main(entry, fd) => Entry::Upstream(Box::new(entry), fd),
            GatewayParcel::Narrower(entry, fd) => Entry::Narrower(Box::new(entry), fd),
        }
    }
}

/// Once the clients have left their parcels: each gateway session that
/// can move stops and leaves its parcel. Its requests in flight for the
/// clients that `moves` move with it; every other one is answered here.
/// One that cannot move (`wss://`) ends now, each of its requests in
/// flight answered into its client's queue before this returns.
pub async fn leave(ctx: &Ctx, moves: &impl Fn(u64) -> bool) {
    // Every session stops at once: the pause lasts until the last one has.
    let (narrower, main) = tokio::join!(
        ctx.sessions.narrower.hand_over(UPSTREAM_HANDOVER_WAIT),
        ctx.upstream().hand_over(UPSTREAM_HANDOVER_WAIT)
    );
    // The narrower sessions move the same way, each on its own.
    for (grant, handed) in narrower {
        use base64::Engine as _;
        let pending = ctx
            .router
            .take_for_handover(handed.generation, moves, &handed.unsent);
        let entry = NarrowerEntry {
            scopes: grant.scopes().to_vec(),
            url: crate::config::redact_url(ctx.upstream().target_url().trim()),
            kind: handed.socket.kind,
            hello: handed.hello,
            unread: base64::engine::general_purpose::STANDARD.encode(&handed.socket.unread),
            unwritten: base64::engine::general_purpose::STANDARD.encode(&handed.socket.unwritten),
            next_request_id: ctx.router.next_id(),
            pending,
        };
        tracing::info!(
            scopes = %entry.scopes.join(","),
            requests = entry.pending.len(),
            "handover: a narrower gateway session moves with the clients"
        );
        ctx.handover
            .leave(Box::new(GatewayParcel::Narrower(entry, handed.socket.fd)));
    }
    let Some(handed) = main else {
        return;
    };
    let pending = ctx
        .router
        .take_for_handover(handed.generation, moves, &handed.unsent);
    let continued = ctx.sessions.main_owner.continued();
    let mut hello = handed.hello;
    // The snapshot as events have updated it since the `hello-ok`.
    if let Some(payload) = hello.payload.as_object_mut() {
        payload.insert("snapshot".into(), ctx.hub.snapshot());
    }
    use base64::Engine as _;
    let entry = UpstreamEntry {
        // The gateway it is connected to now (a reload may have moved it
        // since the start).
        url: crate::config::redact_url(ctx.upstream().target_url().trim()),
        kind: handed.socket.kind,
        hello,
        unread: base64::engine::general_purpose::STANDARD.encode(&handed.socket.unread),
        unwritten: base64::engine::general_purpose::STANDARD.encode(&handed.socket.unwritten),
        last_seq: continued.last_seq,
        confirmed: continued.confirmed.iter().map(Subscription::of).collect(),
        next_request_id: ctx.router.next_id(),
        pending,
    };
    tracing::info!(
        requests = entry.pending.len(),
        "handover: the gateway session moves with the clients"
    );
    ctx.handover
        .leave(Box::new(GatewayParcel::Main(entry, handed.socket.fd)));
}

/// Takes over the gateway connections the previous instance handed over
/// (the main one and the narrower ones, each with its socket), once the
/// clients they carry requests for are `registered`; then the main
/// session's connector goes on, on the moved connection or a new one.
pub fn take_over(
    ctx: &Arc<Ctx>,
    upstream: Option<UpstreamEntry>,
    upstream_fd: Option<OwnedFd>,
    narrower: impl Iterator<Item = (NarrowerEntry, OwnedFd)>,
    registered: &HashMap<u64, Arc<crate::dispatch::Member>>,
) {
    for (entry, fd) in narrower {
        take_over_narrower(ctx, entry, fd, registered);
    }
    let takeover = match (upstream, upstream_fd) {
        (Some(entry), Some(fd)) => take_over_upstream(ctx, entry, fd, registered),
        (Some(_), None) => {
            tracing::warn!("handover: the gateway connection's socket was not passed");
            None
        }
        _ => None,
    };
    match takeover {
        // Its connector waits at the gate (`Takeover::gate`).
        Some(takeover) => ctx.sessions.take_over(Some(takeover)),
        // The connector connects itself once told: only after the gate, so
        // nothing reaches the event log (or a client) before the commit.
        None => {
            let sessions = Arc::clone(&ctx.sessions);
            ctx.spawn_moved(async move { sessions.take_over(None) });
        }
    }
}

/// Goes on with a narrower session the previous instance handed over: its
/// connector takes the connection over, and its requests in flight wait
/// for their answers here again (those of a client that was not taken are
/// dropped, as for the main session).
fn take_over_narrower(
    ctx: &Arc<Ctx>,
    entry: NarrowerEntry,
    fd: OwnedFd,
    registered: &HashMap<u64, Arc<crate::dispatch::Member>>,
) {
    let moved = MovedConnection {
        fd,
        kind: entry.kind,
        unread: &entry.unread,
        unwritten: &entry.unwritten,
        hello: entry.hello,
        url: entry.url,
    };
    let Some(takeover) = moved.takeover(ctx, entry.next_request_id) else {
        return;
    };
    let grant = Grant::new(&entry.scopes);
    let generation = ctx.sessions.narrower.take_over(&grant, takeover);
    // The moved clients with this grant hold it, as they did there.
    for member in registered.values() {
        if member.client().grant() == &grant {
            ctx.sessions.narrower.hold(&grant, &member.narrower);
        }
    }
    take_over_pending(ctx, entry.pending, generation, registered);
}

/// Readies the gateway session handed over for this instance's connector:
/// its requests in flight wait for their answers here again (those of a
/// client that was not taken are dropped: the previous instance answered
/// nothing for them, and their client is gone), its ids go on, and the
/// main session's owner learns its `seq` and subscriptions.
fn take_over_upstream(
    ctx: &Arc<Ctx>,
    entry: UpstreamEntry,
    fd: OwnedFd,
    registered: &HashMap<u64, Arc<crate::dispatch::Member>>,
) -> Option<crate::upstream::Takeover> {
    let moved = MovedConnection {
        fd,
        kind: entry.kind,
        unread: &entry.unread,
        unwritten: &entry.unwritten,
        hello: entry.hello,
        url: entry.url,
    };
    let takeover = moved.takeover(ctx, entry.next_request_id)?;
    let generation = ctx.upstream().status().generation;
    take_over_pending(ctx, entry.pending, generation, registered);
    ctx.sessions
        .main_owner
        .will_continue(crate::sessions::main_session::Continued {
            last_seq: entry.last_seq,
            confirmed: entry.confirmed.into_iter().map(Subscription::key).collect(),
        });
    Some(takeover)
}

/// A gateway connection as the document describes it (main or narrower).
struct MovedConnection<'a> {
    fd: OwnedFd,
    kind: crate::upstream::SocketKind,
    unread: &'a str,
    unwritten: &'a str,
    hello: crate::upstream::UpstreamHello,
    url: String,
}

impl MovedConnection<'_> {
    /// What its connector takes over; its upstream ids go on after
    /// `next_request_id`. `None` when its unread bytes are not base64.
    fn takeover(self, ctx: &Ctx, next_request_id: u64) -> Option<crate::upstream::Takeover> {
        let decode = |s: &str| base64::engine::general_purpose::STANDARD.decode(s);
        let (Ok(unread), Ok(unwritten)) = (decode(self.unread), decode(self.unwritten)) else {
            tracing::warn!("handover: a gateway connection's carried bytes are not base64");
            return None;
        };
        ctx.router.continue_ids(next_request_id);
        Some(crate::upstream::Takeover {
            socket: crate::upstream::MovedSocket {
                fd: self.fd,
                kind: self.kind,
                unread,
                unwritten,
            },
            hello: self.hello,
            url: self.url,
            gate: ctx.handover.gate.clone(),
        })
    }
}

/// Requests in flight on a moved connection wait for their answers here,
/// on `generation`, for the clients that were taken.
fn take_over_pending(
    ctx: &Ctx,
    pending: Vec<crate::router::MovedRequest>,
    generation: u64,
    registered: &HashMap<u64, Arc<crate::dispatch::Member>>,
) {
    for request in pending {
        if let Some(member) = registered.get(&request.client_id) {
            ctx.router.take_over(&member.requester, request, generation);
        }
    }
}
