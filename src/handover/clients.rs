//! The connected WebSocket clients a handover moves (design §11): each
//! client's socket travels as a descriptor; what it is (its id, `connId`,
//! grant, declared identity, next `seq`, subscriptions) and the bytes read
//! from it and not parsed travel in this document (a sealed memfd, like
//! [`super::State`]); the frames queued for it and not yet written travel
//! beside it as raw bytes, in a sealed memfd of their own
//! ([`Clients::frames_memfd`]), so that neither instance escapes or parses
//! them inside the pause.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::state::{Unreadable, FORMAT};
use crate::context::Ctx;
use crate::hub::ClientIdentity;
use crate::parcels::{ClientEntry, DedicatedEntry, Entry, Parcel, StreamEntry};
pub use crate::parcels::{NarrowerEntry, UpstreamEntry};
use crate::policy::{Access, Grant, SocketPolicy};

/// The descriptor name of the clients document (systemd's store).
pub const CLIENTS_FD_NAME: &str = "clawmux-clients";

/// The largest clients document read back: the queues it carries are
/// bounded by `queue_total_bytes` (at most 1 GiB, see the limits page),
/// and the rest is a few hundred bytes per client.
pub const MAX_CLIENTS_BYTES: u64 = 2 << 30;

/// The descriptor name of a client's socket.
pub fn client_fd_name(id: u64) -> String {
    format!("clawmux-client-{id}")
}

/// The descriptor name of the gateway connection's socket (systemd's store).
pub const UPSTREAM_FD_NAME: &str = "clawmux-upstream";

/// Every client moved, in the order of their descriptors, and the gateway
/// session they are on when it moves too.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Clients {
    pub format: u32,
    pub clients: Vec<ClientEntry>,
    /// The main gateway session, when its connection moves (its socket
    /// travels as [`UPSTREAM_FD_NAME`], or right after this document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<UpstreamEntry>,
    /// The runs the moved clients started and that have not ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<RunEntry>,
    /// The `/ws/dedicated` connections moved (each with two sockets,
    /// [`dedicated_fd_names`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dedicated: Vec<DedicatedEntry>,
    /// The event streams (`/v1/events`) moved (each socket as
    /// [`stream_fd_name`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub streams: Vec<StreamEntry>,
    /// The narrower gateway sessions, when their connections move (each
    /// socket as [`narrower_fd_name`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub narrower: Vec<NarrowerEntry>,
    /// The newest cursor the old instance's event log handed out: the next
    /// instance goes on right after it only when its log file ends there
    /// ([`crate::hub::replay::ReplayLog::open`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_newest: Option<u64>,
}

/// The descriptor name of the frames memfd (systemd's store), which
/// travels right after the clients document when any client has queued
/// frames ([`Clients::has_frames`]).
pub const FRAMES_FD_NAME: &str = "clawmux-frames";

/// The descriptor name of the `i`th narrower session's socket (systemd's store).
pub fn narrower_fd_name(i: usize) -> String {
    format!("clawmux-narrower-{i}")
}

/// The descriptor name of the `i`th event stream's socket (systemd's store).
pub fn stream_fd_name(i: usize) -> String {
    format!("clawmux-stream-{i}")
}

/// The descriptor names of the `i`th dedicated connection's two sockets
/// (systemd's store): the client's, the gateway's.
pub fn dedicated_fd_names(i: usize) -> (String, String) {
    (
        format!("clawmux-dedicated-{i}"),
        format!("clawmux-dedicated-{i}-gateway"),
    )
}

/// A run a moved client started ([`crate::sharing::runs`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunEntry {
    pub run_id: String,
    pub client_id: u64,
    pub session_key: Option<String>,
    pub tool_events: bool,
}

/// The parcels packed, for the next instance: the document, each client's
/// socket by id, and the gateway connections' sockets.
#[derive(Debug, Default)]
pub struct Packed {
    pub doc: Clients,
    pub clients: Vec<(u64, OwnedFd)>,
    pub upstream: Option<OwnedFd>,
    /// Each dedicated connection's sockets (the client's, the gateway's),
    /// in the order of `doc.dedicated`.
    pub dedicated: Vec<(OwnedFd, OwnedFd)>,
    /// Each event stream's socket, in the order of `doc.streams`.
    pub streams: Vec<OwnedFd>,
    /// Each narrower session's socket, in the order of `doc.narrower`.
    pub narrower: Vec<OwnedFd>,
    /// What the old instance held for the clients packed, dropped with
    /// this (once the new instance serves, or before this one serves them
    /// again), never inside the pause.
    pub leftovers: Vec<crate::parcels::Leftover>,
}

/// What moves of the core beside the parcels: the runs, and the event
/// log's newest cursor.
#[derive(Debug, Default)]
pub struct CoreParcels {
    pub runs: Vec<RunEntry>,
    /// The newest cursor its event log handed out.
    pub replay_newest: Option<u64>,
}

impl Clients {
    pub fn parse(bytes: &[u8]) -> Result<Clients, Unreadable> {
        super::state::check_format(bytes)?;
        serde_json::from_slice(bytes).map_err(|e| Unreadable::Invalid(e.to_string()))
    }

    pub fn to_memfd(&self) -> std::io::Result<OwnedFd> {
        super::state::memfd_with(&serde_json::to_vec(self).map_err(std::io::Error::other)?)
    }

    pub fn from_fd(fd: impl std::os::fd::AsFd) -> Result<Clients, Unreadable> {
        Clients::parse(&super::state::read_memfd(fd, MAX_CLIENTS_BYTES)?)
    }

    /// Whether a frames memfd travels beside this document: some client
    /// has queued frames ([`ClientEntry::queued_lengths`]).
    pub fn has_frames(&self) -> bool {
        self.clients.iter().any(|c| !c.queued_lengths.is_empty())
    }

    /// A sealed memfd with every client's queued frames, one client's after
    /// another in the document's order (`None` when no client has any).
    pub fn frames_memfd(&self) -> std::io::Result<Option<OwnedFd>> {
        if !self.has_frames() {
            return Ok(None);
        }
        let frames = || self.clients.iter().flat_map(|c| &c.frames);
        let mut bytes = Vec::with_capacity(frames().map(|f| f.len()).sum());
        frames().for_each(|f| bytes.extend_from_slice(f));
        super::state::memfd_with(&bytes).map(Some)
    }

    /// Gives each client its queued frames back from the frames memfd
    /// (`fd`: passed exactly when the document has frames), as
    /// [`Clients::attach_frames`].
    pub fn read_frames(&mut self, fd: Option<impl std::os::fd::AsFd>) -> Result<(), Unreadable> {
        let bytes = match (self.has_frames(), fd) {
            (false, None) => Vec::new(),
            (false, Some(_)) => {
                return Err(Unreadable::Invalid(
                    "a frames memfd the document does not name".into(),
                ))
            }
            (true, None) => {
                return Err(Unreadable::Invalid(
                    "the frames memfd was not passed".into(),
                ))
            }
            (true, Some(fd)) => super::state::read_memfd(fd, MAX_CLIENTS_BYTES)?,
        };
        self.attach_frames(&bytes)
    }

    /// Gives each client its queued frames back from `bytes` (the frames
    /// memfd's): every length must be there and the lengths must cover
    /// them exactly. Each client's frames share one buffer of their own, so
    /// what one slow client holds is only its own queue.
    pub fn attach_frames(&mut self, bytes: &[u8]) -> Result<(), Unreadable> {
        let mut at = 0usize;
        for client in &mut self.clients {
            let len = client
                .queued_lengths
                .iter()
                .try_fold(0usize, |sum, l| sum.checked_add(*l));
            let end = len
                .and_then(|len| at.checked_add(len))
                .filter(|end| *end <= bytes.len());
            let Some(end) = end else {
                return Err(Unreadable::Invalid(format!(
                    "client {}: its queued frames run past the frames memfd",
                    client.id
                )));
            };
            let mut own = Bytes::copy_from_slice(&bytes[at..end]);
            client.frames = client
                .queued_lengths
                .iter()
                .map(|l| own.split_to(*l))
                .collect();
            at = end;
        }
        if at != bytes.len() {
            return Err(Unreadable::Invalid(format!(
                "the frames memfd holds {} bytes no client's queue names",
                bytes.len() - at
            )));
        }
        Ok(())
    }
}

/// Packs what the client tasks left, once the sessions have ended (every
/// answer to their requests is queued by then, but those of the requests
/// that move with the gateway session), with the `core`'s parcels: the
/// document and the descriptors.
pub fn pack(parcels: Vec<Box<dyn Parcel>>, core: CoreParcels) -> Packed {
    let mut doc = Clients {
        format: FORMAT,
        clients: Vec::new(),
        upstream: None,
        runs: core.runs,
        dedicated: Vec::new(),
        streams: Vec::new(),
        narrower: Vec::new(),
        replay_newest: core.replay_newest,
    };
    let mut packed = Packed::default();
    for parcel in parcels {
        match parcel.pack() {
            Entry::Client(entry, fd, leftover) => {
                packed.leftovers.push(leftover);
                packed.clients.push((entry.id, fd));
                doc.clients.push(entry);
            }
            Entry::Dedicated(entry, client, gateway) => {
                packed.dedicated.push((client, gateway));
                doc.dedicated.push(entry);
            }
            Entry::Stream(entry, fd) => {
                packed.streams.push(fd);
                doc.streams.push(entry);
            }
            Entry::Upstream(entry, fd) => {
                doc.upstream = Some(*entry);
                packed.upstream = Some(fd);
            }
            Entry::Narrower(entry, fd) => {
                doc.narrower.push(*entry);
                packed.narrower.push(fd);
            }
        }
    }
    packed.doc = doc;
    packed
}

/// What moves of the core once the clients have left their parcels: the
/// gateway connections leave theirs ([`super::gateway::leave`]: each
/// when it can move, with its requests in flight for the moving clients),
/// and the runs that move are listed.
pub async fn pack_core(ctx: &Ctx) -> CoreParcels {
    let moving = ctx.handover.client_ids();
    // A run moves with its owner; one whose owner is no client at all
    // (started through `/v1/rpc`, whose requester is gone once answered)
    // moves too, still owned: nobody else may stop it there either.
    // Only the runs of clients closed rather than moved are let go.
    let connected: std::collections::HashSet<u64> =
        ctx.hub.clients().iter().map(|c| c.id).collect();
    let moves = |id: u64| moving.contains(&id) || !connected.contains(&id);
    let runs = ctx
        .sharing
        .runs
        .entries(moves)
        .into_iter()
        .map(|(run_id, owner)| RunEntry {
            run_id,
            client_id: owner.client_id,
            session_key: owner.session_key,
            tool_events: owner.tool_events,
        })
        .collect();
    super::gateway::leave(ctx, &moves).await;
    CoreParcels {
        runs,
        replay_newest: None,
    }
}

/// Serves the moved clients in this instance: each from where the previous
/// one stopped. A client whose socket or `[[sockets]]` entry is missing is
/// not taken (its descriptor is closed: it reconnects and resumes by
/// cursor). Returns how many were taken.
pub fn take_over(ctx: &Arc<Ctx>, policies: &[Arc<SocketPolicy>], packed: Packed) -> usize {
    let Packed {
        doc: mut clients,
        clients: fds,
        upstream: upstream_fd,
        dedicated,
        streams,
        narrower,
        leftovers,
    } = packed;
    // The previous core's hold on them goes first (an instance serving its
    // clients again after a failed upgrade).
    drop(leftovers);
    // Every moved client keeps its id: no client made here (a moved HUD
    // stream's feed, below) may take one of theirs first, nor the id that
    // owns a moved run (a `/v1/rpc` run's requester, gone already).
    let listed: std::collections::HashSet<u64> = clients.clients.iter().map(|c| c.id).collect();
    let carried = clients.clients.iter().map(|c| c.id);
    let owners = clients.runs.iter().map(|r| r.client_id);
    if let Some(top) = carried
        .chain(clients.streams.iter().map(|s| s.id))
        .chain(owners)
        .max()
    {
        ctx.hub.reserve_ids_through(top);
    }
    // Admitted before the gateway connection is taken over (below), as
    // the clients are: no event reaches this instance before them.
    let mut taken = 0;
    for (entry, fd) in std::mem::take(&mut clients.streams)
        .into_iter()
        .zip(streams)
    {
        // It holds one of its socket's connection slots, as when accepted.
        let Some(slot) = ctx.slots.take(&entry.socket) else {
            tracing::warn!(client_id = entry.id, socket = %entry.socket, "handover: the socket's max_connections is reached; closing a moved event stream");
            continue;
        };
        let took = if entry.hud.is_some() {
            crate::local::hud::take_over(ctx, policies, entry, fd, slot)
        } else {
            crate::local::sse::take_over(ctx, policies, entry, fd, slot)
        };
        taken += usize::from(took);
    }
    for (entry, (client, gateway)) in clients.dedicated.iter().zip(dedicated) {
        let decode = |s: &str| base64::engine::general_purpose::STANDARD.decode(s);
        let decoded = [
            &entry.client_unread,
            &entry.client_unwritten,
            &entry.gateway_unread,
            &entry.gateway_unwritten,
        ]
        .map(|s| decode(s));
        let [Ok(client_unread), Ok(client_unwritten), Ok(gateway_unread), Ok(gateway_unwritten)] =
            decoded
        else {
            tracing::warn!("handover: a dedicated connection's carried bytes are not base64");
            continue;
        };
        let parcel = crate::local::dedicated::DedicatedParcel {
            client,
            client_unread,
            client_unwritten,
            gateway: crate::upstream::MovedSocket {
                fd: gateway,
                kind: entry.gateway_kind,
                unread: gateway_unread,
                unwritten: gateway_unwritten,
            },
            peer_uid: entry.peer_uid,
            browser: entry.browser,
        };
        // Counted on the main socket when it has a slot free: the document
        // does not say which socket a dedicated connection came through, so
        // one is never closed for a count it may not belong to (it held a
        // slot of its own socket in the previous instance).
        let slot = policies.first().and_then(|p| ctx.slots.take(&p.name));
        let serve = crate::local::dedicated::take_over(parcel, Arc::clone(ctx));
        ctx.spawn_moved(crate::context::holding(slot, serve));
    }
    let mut fds: HashMap<u64, OwnedFd> = fds.into_iter().collect();
    // A mirror client (`restarts=mirror`) stays only on the gateway
    // connection it was on: when that does not move, it is closed as a
    // direct gateway connection would be by the reconnect.
    let upstream_moves = clients.upstream.is_some() && upstream_fd.is_some();
    let mut moving = Vec::with_capacity(clients.clients.len());
    for entry in clients.clients {
        match fds.remove(&entry.id) {
            Some(fd) => moving.push((entry, fd)),
            None => tracing::warn!(
                client_id = entry.id,
                "handover: a client's socket was not passed"
            ),
        }
    }
    let mut registered = HashMap::new();
    let take = {
        let ctx = Arc::clone(ctx);
        let policies = policies.to_vec();
        Arc::new(move |(entry, fd)| take_over_client(&ctx, &policies, entry, fd, upstream_moves))
    };
    for (id, member) in in_two_halves(moving, take) {
        registered.insert(id, member);
    }
    taken += registered.len();
    if taken > 0 {
        ctx.sessions.main_owner.clients_taken_over();
    }
    for run in clients.runs {
        // A run whose owner is no client of the document was started
        // through `/v1/rpc`: it stays owned (by an id no client here has)
        // until it ends. A moved client's run is its client's again; one of
        // a client that could not be taken over is let go, as at its leaving.
        let member = registered.get(&run.client_id);
        if member.is_none() && listed.contains(&run.client_id) {
            continue;
        }
        let owner = crate::sharing::runs::RunOwner {
            client_id: run.client_id,
            session_key: run.session_key,
            tool_events: run.tool_events,
        };
        if ctx.sharing.runs.start(&run.run_id, owner) {
            if let Some(member) = member {
                member.book().runs.insert(run.run_id);
            }
        }
    }
    let narrower = std::mem::take(&mut clients.narrower)
        .into_iter()
        .zip(narrower);
    super::gateway::take_over(ctx, clients.upstream, upstream_fd, narrower, &registered);
    taken
}

/// Takes over one moved `/ws` client ([`take_over`]): its hub client, its
/// grant, subscriptions and queue, and its task, which waits at the gate.
/// `None` if it cannot be (its descriptor is closed: it reconnects and
/// resumes by cursor).
fn take_over_client(
    ctx: &Arc<Ctx>,
    policies: &[Arc<SocketPolicy>],
    entry: ClientEntry,
    fd: OwnedFd,
    upstream_moves: bool,
) -> Option<(u64, Arc<crate::dispatch::Member>)> {
    let Some(policy) = policies.iter().find(|p| p.name == entry.socket) else {
        tracing::warn!(client_id = entry.id, socket = %entry.socket, "handover: the client's socket is no longer configured; closing it");
        return None;
    };
    let decode = |b: &str| base64::engine::general_purpose::STANDARD.decode(b);
    let (Ok(unread), Ok(unwritten)) = (decode(&entry.unread), decode(&entry.unwritten)) else {
        tracing::warn!(
            client_id = entry.id,
            "handover: a client's carried bytes are not base64; closing it"
        );
        return None;
    };
    // It holds one of its socket's connection slots, as when accepted.
    let Some(slot) = ctx.slots.take(&policy.name) else {
        tracing::warn!(client_id = entry.id, socket = %policy.name, "handover: the socket's max_connections is reached; closing a moved client");
        return None;
    };
    let stream = std::os::unix::net::UnixStream::from(fd);
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(stream))
    {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(
                client_id = entry.id,
                "handover: a client's socket is unusable ({e})"
            );
            return None;
        }
    };
    let client = ctx.hub.restored_client(
        entry.id,
        entry.conn_id,
        entry.connected_at_ms,
        crate::hub::ClientKind::Ws,
    );
    let _ = client.identity.set(ClientIdentity {
        client_id: entry.identity.client_id,
        mode: entry.identity.mode,
        version: entry.identity.version,
        display_name: entry.identity.display_name,
        peer_pid: entry.identity.peer_pid,
    });
    client
        .tool_events
        .store(entry.tool_events, std::sync::atomic::Ordering::Relaxed);
    let asked = Grant::new(&entry.scopes);
    client.set_access(Access {
        grant: asked.within(&policy.ceiling(&asked)),
        socket: Arc::clone(policy),
    });
    client.continue_seq(entry.next_seq);
    let registration = ctx.dispatcher.register(Arc::clone(&client));
    if ctx.hub.admit_restored(&client).is_err() {
        return None;
    }
    {
        let mut st = ctx.sharing.subscriptions.lock();
        let mut book = registration.member().book();
        for sub in entry.subscriptions {
            let key = sub.key();
            st.restore(key.clone(), client.id);
            book.subs.insert(key);
        }
    }
    for frame in entry.queued {
        client.push_frame(Bytes::from(frame));
    }
    for frame in entry.frames {
        client.push_frame(frame);
    }
    let member = Arc::clone(registration.member());
    let restarts = if entry.mirror {
        if !upstream_moves {
            client.close(1012, "service restart");
        }
        crate::local::ws::Restarts::Mirror
    } else {
        crate::local::ws::Restarts::Continuity
    };
    // It waits at the gate itself, once set up.
    let serve = crate::local::ws::take_over(
        stream,
        crate::local::ws::Carried { unread, unwritten },
        registration,
        restarts,
        Arc::clone(ctx),
    );
    // Boxed here, once: the serving future is about 4 KiB, and the
    // wrappers and the spawn then move a pointer instead of copying it
    // three times, for every client, inside the pause.
    ctx.tracker
        .spawn(crate::context::holding(slot, Box::pin(serve)));
    Some((client.id, member))
}

/// Below this many, [`in_two_halves`] does the work on the calling thread
/// alone (a task costs more than it saves).
const SPLIT_ABOVE: usize = 64;

/// `f` over `items` in their order, in two halves, each a task of the
/// runtime's (on a multi-thread runtime; on the calling thread otherwise):
/// taking the clients over is the largest part of the pause every client
/// sees at a handover, and the new instance has nothing else to run
/// meanwhile. On the runtime's workers, the tasks each half spawns wait in
/// that worker's own queue until the half is done, instead of waking a
/// parked worker for every client.
fn in_two_halves<T, R>(mut items: Vec<T>, f: Arc<dyn Fn(T) -> Option<R> + Send + Sync>) -> Vec<R>
where
    T: Send + 'static,
    R: Send + 'static,
{
    let runtime = tokio::runtime::Handle::try_current()
        .ok()
        .filter(|r| r.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    let Some(runtime) = runtime.filter(|_| items.len() > SPLIT_ABOVE) else {
        return items.into_iter().filter_map(|item| f(item)).collect();
    };
    let second = items.split_off(items.len() / 2);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for (half, part) in [items, second].into_iter().enumerate() {
        let f = Arc::clone(&f);
        let done_tx = done_tx.clone();
        runtime.spawn(async move {
            let done: Vec<R> = part.into_iter().filter_map(|item| f(item)).collect();
            let _ = done_tx.send((half, done));
        });
    }
    drop(done_tx);
    let mut halves: [Option<Vec<R>>; 2] = [None, None];
    // The calling thread waits; on a worker, it hands its queue over first.
    tokio::task::block_in_place(|| {
        for (half, done) in done_rx.iter() {
            halves[half] = Some(done);
        }
    });
    let [Some(mut first), Some(second)] = halves else {
        panic!("a half of the take-over panicked");
    };
    first.extend(second);
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The halves keep the items' order, drop what `f` refuses, and the
    /// second half runs on another thread that can still reach the runtime
    /// (taking a client over registers its socket and spawns its task).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_halves_keep_the_order_and_the_runtime() {
        let caller = std::thread::current().id();
        let items: Vec<u32> = (0..1000).collect();
        let done = in_two_halves(
            items,
            Arc::new(|i| {
                assert!(tokio::runtime::Handle::try_current().is_ok());
                (i % 7 != 0).then(|| (i, std::thread::current().id()))
            }),
        );
        let expected: Vec<u32> = (0..1000).filter(|i| i % 7 != 0).collect();
        assert_eq!(done.iter().map(|(i, _)| *i).collect::<Vec<_>>(), expected);
        assert!(
            done.iter().all(|(_, t)| *t != caller),
            "both halves on the runtime's workers"
        );
        // Few items: all on the calling thread.
        let few = in_two_halves(
            (0..SPLIT_ABOVE as u32).collect(),
            Arc::new(|i| Some(std::thread::current().id()).filter(|_| i < u32::MAX)),
        );
        assert!(few.iter().all(|t| *t == caller));
    }

    /// On a current-thread runtime nothing else could run the halves:
    /// the calling thread does it all.
    #[tokio::test(flavor = "current_thread")]
    async fn on_one_thread_the_caller_takes_every_client_over() {
        let caller = std::thread::current().id();
        let done = in_two_halves(
            (0..1000u32).collect(),
            Arc::new(|i| Some((i, std::thread::current().id()))),
        );
        assert_eq!(done.len(), 1000);
        assert!(done
            .iter()
            .enumerate()
            .all(|(n, (i, t))| *i == n as u32 && *t == caller));
    }

    /// A document with the gateway connection's part (the fuzz seed) is
    /// read whole and written back unchanged; one from before that part
    /// existed still reads, with none.
    #[test]
    fn a_document_with_the_gateway_connection_round_trips() {
        let seed = include_str!("../../fuzz/seeds/handover_state/clients-upstream.json");
        let doc = Clients::parse(seed.as_bytes()).unwrap();
        let upstream = doc
            .upstream
            .as_ref()
            .expect("the gateway connection's part");
        assert_eq!(upstream.kind, crate::upstream::SocketKind::Tcp);
        assert_eq!(upstream.last_seq, Some(41));
        assert_eq!(upstream.pending[0].upstream_id, "cm-16");
        assert!(upstream.pending[0].accepted);
        assert_eq!(doc.runs[0].run_id, "r-1");
        let again = Clients::parse(&serde_json::to_vec(&doc).unwrap()).unwrap();
        assert_eq!(again, doc);
        let streams = include_str!("../../fuzz/seeds/handover_state/clients-streams.json");
        let streams = Clients::parse(streams.as_bytes()).unwrap();
        assert_eq!(streams.streams[0].query, "events=test.n");
        assert_eq!(streams.streams[0].last_cursor, 40);
        assert_eq!(
            Clients::parse(&serde_json::to_vec(&streams).unwrap()).unwrap(),
            streams
        );
        // A moved /ws/hud client's projection reads, and goes on.
        let hud = include_str!("../../fuzz/seeds/handover_state/clients-hud.json");
        let hud = Clients::parse(hud.as_bytes()).unwrap();
        let entry = hud.streams[0].hud.as_ref().unwrap();
        assert!(entry.websocket);
        let written = crate::fuzz_api::hud_projection(entry.activity.clone()).expect("reads");
        assert_eq!(
            written["runs"]["r-hud"]["items"][0]["Tool"]["call_id"],
            "c1"
        );
        let older = include_str!("../../fuzz/seeds/handover_state/clients.json");
        let older = Clients::parse(older.as_bytes()).unwrap();
        assert!(older.upstream.is_none() && older.runs.is_empty() && older.streams.is_empty());
    }

    /// Two clients with queued frames (and one without): their bytes
    /// travel in the frames memfd, not the document, and each client gets
    /// its own back, in order.
    fn with_frames() -> Clients {
        let seed = include_str!("../../fuzz/seeds/handover_state/clients.json");
        let mut doc = Clients::parse(seed.as_bytes()).unwrap();
        let one = doc.clients[0].clone();
        let frames: [&[&str]; 3] = [&["{\"a\":1}", "{\"b\":\"two\"}"], &[], &["{\"c\":3}"]];
        doc.clients = frames
            .iter()
            .enumerate()
            .map(|(i, frames)| ClientEntry {
                id: 10 + i as u64,
                queued: Vec::new(),
                queued_lengths: frames.iter().map(|f| f.len()).collect(),
                frames: frames.iter().map(|f| Bytes::from(f.to_string())).collect(),
                ..one.clone()
            })
            .collect();
        doc
    }

    #[test]
    fn queued_frames_travel_beside_the_document_and_come_back_in_order() {
        let doc = with_frames();
        let text = String::from_utf8(serde_json::to_vec(&doc).unwrap()).unwrap();
        assert!(!text.contains("two"), "no frame in the document: {text}");
        assert!(!text.contains("\"queued\""), "{text}");
        let frames = doc.frames_memfd().unwrap().expect("a frames memfd");
        assert_eq!(
            super::super::state::read_memfd(&frames, 1 << 20).unwrap(),
            b"{\"a\":1}{\"b\":\"two\"}{\"c\":3}"
        );
        let mut read = Clients::from_fd(doc.to_memfd().unwrap()).unwrap();
        assert!(read.clients.iter().all(|c| c.frames.is_empty()));
        read.read_frames(Some(&frames)).unwrap();
        assert_eq!(read, doc);
        // No client with a queue: no memfd, and none is expected.
        let mut empty = Clients::parse(b"{\"format\":1,\"clients\":[]}").unwrap();
        assert!(empty.frames_memfd().unwrap().is_none());
        empty.read_frames(None::<OwnedFd>).unwrap();
    }

    /// The fuzz seed of a document with its frames (the bytes after the
    /// NUL) reads, and its one client gets its one frame.
    #[test]
    fn the_frames_seed_reads() {
        let seed = include_bytes!("../../fuzz/seeds/handover_state/clients-frames.bin");
        let nul = seed.iter().position(|b| *b == 0).unwrap();
        let mut doc = Clients::parse(&seed[..nul]).unwrap();
        assert!(doc.has_frames());
        doc.attach_frames(&seed[nul + 1..]).unwrap();
        assert_eq!(
            doc.clients[0].frames,
            [Bytes::from_static(b"{\"type\":\"event\"}")]
        );
    }

    #[test]
    fn frames_that_do_not_match_the_document_are_refused() {
        let doc = with_frames();
        let frames = doc.frames_memfd().unwrap().unwrap();
        let refused = |mut doc: Clients, fd: Option<&OwnedFd>| {
            doc.clients.iter_mut().for_each(|c| c.frames.clear());
            match doc.read_frames(fd) {
                Err(Unreadable::Invalid(why)) => why,
                other => panic!("not refused: {other:?}"),
            }
        };
        assert!(refused(doc.clone(), None).contains("not passed"));
        let mut none = doc.clone();
        none.clients
            .iter_mut()
            .for_each(|c| c.queued_lengths.clear());
        assert!(refused(none, Some(&frames)).contains("does not name"));
        let mut past = doc.clone();
        past.clients[2].queued_lengths[0] += 1;
        assert!(refused(past, Some(&frames)).contains("run past"));
        let mut short = doc.clone();
        short.clients[2].queued_lengths[0] -= 1;
        assert!(refused(short, Some(&frames)).contains("no client's queue"));
        let mut huge = doc;
        huge.clients[0].queued_lengths[0] = usize::MAX;
        assert!(refused(huge, Some(&frames)).contains("run past"));
    }
}
