//! One local client's outgoing side: a bounded queue counted in bytes, its
//! own event `seq`, and the accounting that decides when it is too slow.
//!
//! Producers (the upstream reader, the router) only ever push and never wait;
//! whoever writes the client's socket (its own task) drains the queue in
//! batches.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::task::AtomicWaker;

use crate::protocol::EventHead;

#[cfg(test)]
mod model;
mod protocol;

use self::protocol::{Budget, Env, Queue};
pub use self::protocol::{Growth, Pushed, Stall, MAX_BATCH_BYTES, SLOW_CONSUMER_CLOSE};

/// What one queued entry costs a client's queue, besides the bytes it
/// points at: the [`Outgoing`] slot in the queue's ring buffer. A client
/// that does not read holds one per event, so with many such clients and
/// small events the slots outweigh the events (before: 980 stalled
/// clients × 50,000 events of 1 KiB was 1.2 GiB of slots and ring-buffer
/// slack against a 256 MiB budget that counted only the shared events).
pub const ENTRY_BYTES: usize = std::mem::size_of::<Outgoing>();

/// What a published event costs besides its encoded bytes: the shared
/// allocation holding it (`Arc` counts, the [`SharedEvent`], the `Bytes`
/// header) and the allocator's rounding, counted once like the bytes.
pub const EVENT_OVERHEAD_BYTES: usize = std::mem::size_of::<SharedEvent>() + 2 * 8 + 64;

/// Broker-wide accounting of queued memory, shared by every client of a hub.
///
/// What counts: each event once, however many queues hold it (queues share
/// its bytes), with its allocation's overhead, from the moment it is
/// published until the last client's writer has written it or dropped it;
/// each client-only frame (responses) while it waits in its queue; and
/// every queue's ring buffer as allocated ([`ENTRY_BYTES`] per slot,
/// including the slack of its last doubling). That is the memory the queues
/// really pin, so the budget is a real memory bound, not a multiple of the
/// number of clients or of the events each one holds.
#[derive(Debug)]
pub struct QueueBudget {
    /// Bytes counted now.
    used: AtomicUsize,
    /// Over this, the hub closes clients (`1008 slow consumer`), the one
    /// that has gone longest without reading first, until the count is back
    /// under it (`Hub::shed`).
    limit: AtomicUsize,
    /// The gateway's own per-connection buffer (`hello-ok.policy.maxBufferedBytes`),
    /// once known: a client's hard limit is never below it.
    upstream_hard: AtomicUsize,
    /// The progress clock every queue of the hub dates its waits by
    /// ([`Backlog::waiting_since`]): one step per reading.
    clock: AtomicU64,
}

impl QueueBudget {
    /// An unlimited budget (the hub's default until configured).
    pub fn new() -> Self {
        QueueBudget {
            used: AtomicUsize::new(0),
            limit: AtomicUsize::new(usize::MAX),
            upstream_hard: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
        }
    }

    /// Bytes counted now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    /// Whether the count is over the limit (one atomic load per publish).
    pub fn is_over(&self) -> bool {
        self.used() > self.limit()
    }

    /// Records the gateway's `maxBufferedBytes` (`None`: not advertised).
    pub fn set_upstream_hard(&self, bytes: Option<u64>) {
        let bytes = bytes.map_or(0, |b| usize::try_from(b).unwrap_or(usize::MAX));
        self.upstream_hard.store(bytes, Ordering::Relaxed);
    }
}

impl protocol::Budget for QueueBudget {
    fn add(&self, n: usize) {
        self.used.fetch_add(n, Ordering::Relaxed);
    }

    fn sub(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::Relaxed);
    }

    fn used(&self) -> usize {
        QueueBudget::used(self)
    }

    fn limit(&self) -> usize {
        QueueBudget::limit(self)
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// Counting in a [`QueueBudget`] by hand, for memory held outside the
/// queues whose holder gives it back itself (an incoming message).
pub trait BudgetCount {
    fn count_add(&self, n: usize);
    fn count_sub(&self, n: usize);
}

impl BudgetCount for QueueBudget {
    fn count_add(&self, n: usize) {
        protocol::Budget::add(self, n);
    }

    fn count_sub(&self, n: usize) {
        protocol::Budget::sub(self, n);
    }
}

impl QueueBudget {
    /// Counts `bytes` held outside every queue on a client's behalf (a
    /// chunk of an event stream that hyper has not written yet) for as long
    /// as the returned hold lives.
    pub fn hold(self: &Arc<Self>, bytes: usize) -> BudgetHold {
        self.add(bytes);
        BudgetHold {
            budget: Arc::clone(self),
            bytes,
        }
    }
}

/// Bytes counted in a [`QueueBudget`] until this is dropped.
#[derive(Debug)]
pub struct BudgetHold {
    budget: Arc<QueueBudget>,
    bytes: usize,
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        self.budget.sub(self.bytes);
    }
}

impl Default for QueueBudget {
    fn default() -> Self {
        Self::new()
    }
}

/// One published event, shared by every queue it was pushed to. It is
/// counted once in the [`QueueBudget`] and released when its last holder
/// (a queue or a writer's batch) drops it. Derefs to the [`EventHead`].
#[derive(Debug)]
pub struct SharedEvent {
    head: EventHead,
    budget: Arc<QueueBudget>,
}

impl SharedEvent {
    pub fn new(head: EventHead, budget: &Arc<QueueBudget>) -> Arc<Self> {
        budget.add(head.len() + EVENT_OVERHEAD_BYTES);
        Arc::new(SharedEvent {
            head,
            budget: Arc::clone(budget),
        })
    }
}

impl std::ops::Deref for SharedEvent {
    type Target = EventHead;
    fn deref(&self) -> &EventHead {
        &self.head
    }
}

impl Drop for SharedEvent {
    fn drop(&mut self) {
        self.budget.sub(self.head.len() + EVENT_OVERHEAD_BYTES);
    }
}

/// One item waiting to be written to a client.
#[derive(Debug)]
pub enum Outgoing {
    /// A shared event and the seq this client gets for it.
    Event(Arc<SharedEvent>, u64),
    /// A complete frame for this client only (responses, the challenge).
    Frame(Bytes),
    /// Close the WebSocket with this code and reason, after what precedes it.
    Close(u16, String),
}

impl Outgoing {
    /// What the item costs the client's own limits: its bytes and its slot.
    fn cost(&self) -> usize {
        match self {
            Outgoing::Event(head, _) => head.len() + ENTRY_BYTES,
            Outgoing::Frame(b) => b.len() + ENTRY_BYTES,
            Outgoing::Close(..) => 0,
        }
    }
}

/// Bytes held on a client's behalf outside its queue and counted in the
/// budget by their holder (the chunks of an event stream that hyper, or a
/// HUD stream's parser, has not let go of yet). Once the client is closed
/// they are on their way out (its connection ends, at the latest when it
/// is cut), so the budget's shedder does not close anyone else for them.
pub trait HeldOutside: Send + Sync + std::fmt::Debug {
    /// Bytes held now.
    fn held(&self) -> usize;
}

/// A client's backlog, as the broker-wide budget's shedder weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Bytes queued (each item with its slot).
    pub bytes: usize,
    /// The progress clock's reading when the client last had nothing
    /// waiting or last took something: the smaller, the longer it has
    /// gone without reading. Readings only grow, so of two clients the one
    /// with the smaller reading has waited longer, however busy the broker.
    pub waiting_since: u64,
    /// The stall sweep has seen it with a backlog and no progress for a
    /// whole sweep interval at least.
    pub stalled: bool,
}

/// How a client reaches the broker; its writer formats queued items for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientKind {
    /// A WebSocket session speaking the gateway protocol.
    Ws,
    /// A `/v1/events` Server-Sent Events stream (events only, `id:` is the
    /// broker cursor instead of the per-client `seq`).
    Sse,
    /// One `/v1/rpc` request: never admitted to the hub, only answered.
    Rpc,
}

impl ClientKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientKind::Ws => "ws",
            ClientKind::Sse => "sse",
            ClientKind::Rpc => "rpc",
        }
    }
}

/// Queue bounds for one client (from [`crate::config::Limits`]).
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    /// Over this many queued bytes, droppable events are dropped.
    pub soft_bytes: usize,
    /// A push that would take the queue past this closes the client (unless
    /// the queue is empty: one frame of any size reaches an idle client).
    pub hard_bytes: usize,
    /// A backlog with no progress (no batch taken by the writer) for this
    /// long closes the client. Zero: one stalled sweep closes it.
    pub grace: Duration,
}

/// Who a client says it is (its `connect`'s `client` block) and where it
/// came from, for `/v1/state` and `clawmux top`. Never used to decide anything.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClientIdentity {
    /// `client.id` as declared.
    pub client_id: Option<String>,
    /// `client.mode` as declared.
    pub mode: Option<String>,
    /// `client.version` as declared.
    pub version: Option<String>,
    /// `client.displayName` as declared.
    pub display_name: Option<String>,
    /// The peer's process id, from the kernel (`SO_PEERCRED`); `/v1/state`
    /// shows it beside what the client declared.
    #[serde(skip)]
    pub peer_pid: Option<u32>,
}

/// What a client given only some events wants (some names, some
/// sessions), and what it passed over.
#[derive(Debug)]
struct Wanted {
    /// `None`: every name.
    names: Option<Box<[Box<str>]>>,
    sessions: super::about::SessionFilter,
    passed: Mutex<Passed>,
}

impl Wanted {
    /// A gap in the log is given whatever the filters: it says what the
    /// reader did not get.
    fn includes(&self, name: &str, about: &super::about::About<'_>) -> bool {
        name == super::replay::GAP_EVENT
            || (self
                .names
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| **n == *name))
                && self.sessions.keeps(name, about))
    }
}

/// The cursors of the events a client was not given, as far as its gaps need them.
#[derive(Debug, Default)]
struct Passed {
    /// The newest one.
    newest: u64,
    /// A gap not yet told: the newest passed over before it, the first after.
    hole: Option<(u64, Option<u64>)>,
}

/// A lock that a panic elsewhere does not poison for good.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A connected local client, shared by the hub, the router and its own tasks.
#[derive(Debug)]
pub struct Client {
    pub id: u64,
    pub kind: ClientKind,
    /// The `server.connId` this client was given in its `hello-ok`.
    pub conn_id: String,
    /// When the client's connection was accepted (ms since the epoch).
    pub connected_at_ms: u64,
    /// Who it says it is; set once, when known (connect, stream open).
    pub identity: std::sync::OnceLock<ClientIdentity>,
    /// The client asked for tool-stream events at connect.
    pub tool_events: AtomicBool,
    /// The client observes every targeted event the broker receives
    /// (`/v1/events?tool_events=all`, `/v1/hud`; see
    /// [`crate::sharing::Reader::observer`]). Set before it is admitted.
    pub observer: AtomicBool,
    /// The only event names it is given (`/v1/events?events=`), checked as
    /// events are queued, so what it never wanted takes none of its queue;
    /// unset, every name. Set before it is admitted.
    wanted: std::sync::OnceLock<Wanted>,
    /// What the client may do (its scopes, its socket's policy), set once
    /// when it is admitted; unset, it may do nothing.
    access: std::sync::OnceLock<crate::policy::Access>,
    /// Requests forwarded upstream and not yet answered.
    pub inflight: AtomicUsize,
    /// Events dropped for this client (soft limit).
    pub dropped: AtomicU64,
    /// Cancelled when the client is closed as a slow consumer, so a writer
    /// blocked on a full socket gives up instead of waiting forever.
    pub killed: tokio_util::sync::CancellationToken,
    limits: QueueLimits,
    budget: Arc<QueueBudget>,
    queue: Mutex<Queue<Outgoing>>,
    /// The task writing the client's socket, woken when the queue stops
    /// being empty (and by frames and closes).
    wake: AtomicWaker,
    /// Bytes the socket under the writer accepted, when the session counts
    /// them ([`Client::count_written`]): progress within one large frame, so
    /// a reader slowly taking a 25 MiB frame is not judged stalled.
    written: std::sync::OnceLock<Arc<AtomicU64>>,
    /// What is held for it outside its queue ([`Client::hold_outside`]).
    outside: Mutex<Vec<Arc<dyn HeldOutside>>>,
}

impl Client {
    /// A client with a budget of its own (tools and tests); the hub's
    /// clients share the hub's ([`Client::with_budget`]).
    pub fn new(id: u64, limits: QueueLimits) -> Self {
        Self::with_budget(id, limits, Arc::new(QueueBudget::new()))
    }

    pub fn with_budget(id: u64, limits: QueueLimits, budget: Arc<QueueBudget>) -> Self {
        let conn_id = uuid::Uuid::new_v4().to_string();
        Self::with_connection(id, conn_id, crate::protocol::now_ms(), limits, budget)
    }

    /// A client whose connection already has its id and start time (one
    /// taken over from the previous instance): no new id is drawn.
    pub fn with_connection(
        id: u64,
        conn_id: String,
        connected_at_ms: u64,
        mut limits: QueueLimits,
        budget: Arc<QueueBudget>,
    ) -> Self {
        // Pushes compare with the soft limit first and the hard one only
        // past it, so the soft limit must not be above the hard one.
        limits.soft_bytes = limits.soft_bytes.min(limits.hard_bytes);
        Client {
            id,
            kind: ClientKind::Ws,
            conn_id,
            connected_at_ms,
            identity: std::sync::OnceLock::new(),
            tool_events: AtomicBool::new(false),
            observer: AtomicBool::new(false),
            wanted: std::sync::OnceLock::new(),
            access: std::sync::OnceLock::new(),
            inflight: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
            killed: tokio_util::sync::CancellationToken::new(),
            limits,
            budget,
            queue: Mutex::new(Queue::new()),
            wake: AtomicWaker::new(),
            written: std::sync::OnceLock::new(),
            outside: Mutex::new(Vec::new()),
        }
    }

    /// Gives the client only events with these names (once, before it is
    /// admitted; later calls are ignored). A gap in the log is given
    /// whatever the names: it says what the reader did not get.
    pub fn want_only<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        self.want(
            Some(names.into_iter().map(Box::from).collect()),
            super::about::SessionFilter::default(),
        );
    }

    /// Gives the client only events with these names (`None`: any) about
    /// these sessions (once, before it is admitted; later calls are
    /// ignored; nothing to filter by sets nothing). Both are applied as
    /// events are queued, so what the client never wanted takes none of
    /// its queue.
    pub fn want(&self, names: Option<Box<[Box<str>]>>, sessions: super::about::SessionFilter) {
        if names.is_none() && sessions.is_empty() {
            return;
        }
        let _ = self.wanted.set(Wanted {
            names,
            sessions,
            passed: Mutex::new(Passed::default()),
        });
    }

    /// Whether the client is given an event named `name`, about `about`,
    /// logged at `cursor` (0: not logged). One it is not given, it has
    /// passed over: where a gap lies is told by the events it could have
    /// seen around it ([`Client::take_hole`]).
    pub fn wants(&self, name: &str, cursor: u64, about: &super::about::About<'_>) -> bool {
        let Some(wanted) = self.wanted.get() else {
            return true;
        };
        if wanted.includes(name, about) {
            return true;
        }
        if cursor != 0 {
            let mut passed = lock(&wanted.passed);
            passed.newest = passed.newest.max(cursor);
            if let Some((_, next @ None)) = &mut passed.hole {
                *next = Some(cursor);
            }
        }
        false
    }

    /// Whether an event named `name`, about `about`, is for this client,
    /// whatever its cursor (history is filtered by this as it is written).
    pub fn is_given(&self, name: &str, about: &super::about::About<'_>) -> bool {
        self.wanted.get().is_none_or(|w| w.includes(name, about))
    }

    /// A gap in what the client is sent ([`Client::skip_seq`]): a client
    /// given only some names remembers the newest cursor it passed over
    /// before it, and the first after it, for the gap's record.
    fn mark_hole(&self) {
        if let Some(wanted) = self.wanted.get() {
            let mut passed = lock(&wanted.passed);
            if passed.hole.is_none() {
                passed.hole = Some((passed.newest, None));
            }
        }
    }

    /// The bounds of the first gap since the last call, as far as the
    /// events this client passed over tell: the newest cursor before it and
    /// the first after it (`None` if none came yet). `None` for a client
    /// given every name (its own events tell) or when no gap was marked.
    pub fn take_hole(&self) -> Option<(u64, Option<u64>)> {
        lock(&self.wanted.get()?.passed).hole.take()
    }

    /// Sets what the client may do (once; later calls are ignored).
    pub fn set_access(&self, access: crate::policy::Access) {
        let _ = self.access.set(access);
    }

    /// What the client may do, if it was admitted.
    pub fn access(&self) -> Option<&crate::policy::Access> {
        self.access.get()
    }

    /// The client's scopes (none before it is admitted).
    pub fn grant(&self) -> &crate::policy::Grant {
        static NONE: std::sync::OnceLock<crate::policy::Grant> = std::sync::OnceLock::new();
        self.access.get().map_or_else(
            || NONE.get_or_init(crate::policy::Grant::none),
            |a| &a.grant,
        )
    }

    /// Counts bytes the socket accepted as progress too (set once, by the
    /// session that owns the socket).
    /// This client as a reader of events, for [`crate::sharing::may_see`].
    pub fn reader(&self) -> crate::sharing::Reader<'_> {
        crate::sharing::Reader {
            id: self.id,
            grant: self.grant(),
            observer: self.observer.load(Ordering::Relaxed),
        }
    }

    pub fn count_written(&self, written: Arc<AtomicU64>) {
        let _ = self.written.set(written);
    }

    fn written(&self) -> u64 {
        self.written.get().map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// The same client, reached another way (set before it is shared).
    pub fn with_kind(mut self, kind: ClientKind) -> Self {
        self.kind = kind;
        self
    }

    /// The budget this client's queued bytes count against.
    pub fn budget(&self) -> &Arc<QueueBudget> {
        &self.budget
    }

    /// The hard limit in force: the configured one, raised to the gateway's
    /// `maxBufferedBytes` when that is larger (never stricter than a direct
    /// connection).
    fn hard_bytes(&self) -> usize {
        self.limits
            .hard_bytes
            .max(self.budget.upstream_hard.load(Ordering::Relaxed))
    }

    /// Queues an event with this client's next seq. Over the soft limit a
    /// droppable event is dropped (the seq is consumed so the client sees a
    /// gap); a push past the hard limit closes the client. Being slow is
    /// otherwise judged by progress, in [`Client::sweep_stall`].
    /// A backlog whose ring buffer would have to grow past what the
    /// broker-wide budget has left is not grown ([`Pushed::NoRoom`]).
    pub fn push_event(&self, event: &Arc<SharedEvent>, droppable: bool) -> Pushed {
        self.push_event_with(event, droppable, Growth::WithinBudget)
    }

    /// [`Client::push_event`], with [`Growth::Always`] after the hub made
    /// room for a [`Pushed::NoRoom`].
    pub fn push_event_with(
        &self,
        event: &Arc<SharedEvent>,
        droppable: bool,
        growth: Growth,
    ) -> Pushed {
        let cost = event.len() + ENTRY_BYTES;
        let pushed = protocol::push_event(self, cost, droppable, growth, |seq| {
            Outgoing::Event(Arc::clone(event), seq)
        });
        if pushed == Pushed::Dropped {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        pushed
    }

    /// Queues a frame for this client only. Never dropped: if it would
    /// overflow the hard limit the client is closed as a slow consumer instead.
    pub fn push_frame(&self, frame: Bytes) -> bool {
        protocol::push_frame(self, Outgoing::Frame(frame))
    }

    /// Closes after everything already queued has been written.
    pub fn close(&self, code: u16, reason: &str) {
        protocol::close(self, code, reason);
    }

    /// Closes now as a slow consumer, discarding what is queued.
    pub fn close_slow_consumer(&self) -> bool {
        protocol::close_slow_consumer(self)
    }

    /// Consumes one seq number so the client's gap detection fires.
    pub fn skip_seq(&self) {
        self.lock_queue().next_seq += 1;
        self.mark_hole();
    }

    /// Whether a close has been queued.
    pub fn is_closing(&self) -> bool {
        self.lock_queue().closing
    }

    /// Memory the queue's ring buffer holds now (its slots, used or not).
    pub fn slot_bytes(&self) -> usize {
        self.lock_queue().items.capacity() * std::mem::size_of::<Outgoing>()
    }

    /// Over this many queued bytes the client is behind: droppable events
    /// are dropped for it, and the broker-wide shedder may close it.
    pub fn soft_bytes(&self) -> usize {
        self.limits.soft_bytes
    }

    /// Bytes queued and not yet taken by the writer.
    pub fn queued_bytes(&self) -> usize {
        self.lock_queue().bytes
    }

    /// The client's backlog as the budget's shedder judges it; `None`
    /// when nothing waits or the client is closing already.
    pub fn backlog(&self) -> Option<Backlog> {
        let q = self.lock_queue();
        if q.closing || q.items.is_empty() {
            return None;
        }
        Some(Backlog {
            bytes: q.bytes,
            waiting_since: q.waiting_since.unwrap_or(0),
            stalled: q.stalled_since.is_some(),
        })
    }

    /// Counts `held` as the client's own, held outside its queue (an event
    /// stream's unwritten chunks).
    pub fn hold_outside(&self, held: Arc<dyn HeldOutside>) {
        self.outside
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(held);
    }

    /// Bytes held for the client outside its queue now.
    pub fn held_outside(&self) -> usize {
        let outside = self.outside.lock().unwrap_or_else(|p| p.into_inner());
        outside.iter().map(|h| h.held()).sum()
    }

    /// What the client's next push would add to its ring buffer when it
    /// must grow (0 when it has room): the room a [`Pushed::NoRoom`] asks for.
    pub fn ring_growth(&self) -> usize {
        let q = self.lock_queue();
        protocol::growth_bytes(self, &q).unwrap_or(0)
    }

    /// Called periodically (the broker's sweep) with the current time:
    /// closes the client as a slow consumer when it has had a backlog and
    /// made no progress for longer than the grace. Progress is a batch taken
    /// by the writer, which takes one only after the previous one was
    /// written and flushed, or bytes of a batch accepted by the socket; the stall clock starts at the first sweep that
    /// sees none, so it may run up to one sweep interval late, never early.
    pub fn sweep_stall(&self, now: Instant) -> Stall {
        protocol::sweep_stall(self, self.written(), now, self.limits.grace)
    }

    /// Waits for and takes the next batch: queued items in order, up to
    /// [`MAX_BATCH_BYTES`] (at least one). Never returns an empty batch; the
    /// caller stops after writing an [`Outgoing::Close`]. Calling it again is
    /// the writer's promise that the previous batch was written and flushed:
    /// that is the client's progress.
    pub async fn next_batch(&self) -> Vec<Outgoing> {
        std::future::poll_fn(|cx| self.poll_next_batch(cx)).await
    }

    /// [`Client::next_batch`] for a writer driven by hand; one writer per
    /// client (the queue wakes one task).
    pub fn poll_next_batch(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Vec<Outgoing>> {
        protocol::poll_next_batch(self, cx.waker())
    }

    /// For a handover: everything still queued (its bytes leave the
    /// budget), and the `seq` the next event would get. The writer takes
    /// nothing more after this.
    pub fn take_all(&self) -> (Vec<Outgoing>, u64) {
        use protocol::Item as _;
        let mut q = protocol::Env::lock_queue(self);
        for item in &q.items {
            protocol::Budget::sub(&*self.budget, item.counted());
        }
        q.bytes = 0;
        let items = q.items.drain(..).collect();
        (items, q.next_seq)
    }

    /// A client taken over from the previous instance: its events go on
    /// from `next_seq`.
    pub fn continue_seq(&self, next_seq: u64) {
        protocol::Env::lock_queue(self).next_seq = next_seq;
    }

    /// Whether the client was closed as a slow consumer; if not, the
    /// calling task is woken when it is (a writer waiting on its socket).
    pub fn poll_killed(&self, cx: &mut std::task::Context<'_>) -> bool {
        self.wake.register(cx.waker());
        self.killed.is_cancelled()
    }
}

impl Drop for Client {
    /// A client dropped with items still queued (its session ended without
    /// draining them) gives their count back; events uncount themselves.
    fn drop(&mut self) {
        let q = self.queue.get_mut().unwrap_or_else(|p| p.into_inner());
        protocol::give_back(q, &*self.budget);
    }
}

/// The client queue's protocol over the real lock, waker and budget.
impl protocol::Env for Client {
    type Item = Outgoing;
    type Budget = QueueBudget;
    type Guard<'a> = std::sync::MutexGuard<'a, Queue<Outgoing>>;

    fn lock_queue(&self) -> Self::Guard<'_> {
        // A panic while holding this lock cannot leave the queue inconsistent
        // in a way that matters more than losing the client, so poison is ignored.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counter(&self) -> &QueueBudget {
        &self.budget
    }

    fn soft_limit(&self) -> usize {
        self.limits.soft_bytes
    }

    fn hard_limit(&self) -> usize {
        self.hard_bytes()
    }

    fn wake_writer(&self) {
        self.wake.wake();
    }

    fn register_writer(&self, waker: &std::task::Waker) {
        self.wake.register(waker);
    }

    fn on_slow_consumer(&self) {
        tracing::warn!(client_id = self.id, "closing slow consumer");
        self.killed.cancel();
    }
}

impl protocol::Item for Outgoing {
    fn cost(&self) -> usize {
        Outgoing::cost(self)
    }

    fn counted(&self) -> usize {
        match self {
            Outgoing::Frame(b) => b.len(),
            Outgoing::Event(..) | Outgoing::Close(..) => 0,
        }
    }

    fn close(code: u16, reason: &str) -> Self {
        Outgoing::Close(code, reason.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(soft: usize, hard: usize) -> QueueLimits {
        QueueLimits {
            soft_bytes: soft,
            hard_bytes: hard,
            grace: Duration::from_secs(3600),
        }
    }

    fn head(n: usize) -> Arc<SharedEvent> {
        let head = EventHead::from_value("tick", &serde_json::json!({ "pad": "x".repeat(n) }));
        SharedEvent::new(head, &Arc::new(QueueBudget::new()))
    }

    #[tokio::test]
    async fn seq_is_contiguous_and_drops_consume_it() {
        let c = Client::new(1, limits(200, 10_000));
        let big = head(150);
        assert_eq!(c.push_event(&big, true), Pushed::Queued); // seq 1
        assert_eq!(c.push_event(&big, true), Pushed::Dropped); // seq 2 over soft
        assert_eq!(c.push_event(&big, false), Pushed::Queued); // seq 3, not droppable
        let seqs: Vec<u64> = c
            .next_batch()
            .await
            .into_iter()
            .map(|o| match o {
                Outgoing::Event(_, s) => s,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(seqs, vec![1, 3]);
        assert_eq!(c.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(c.queued_bytes(), 0);
    }

    #[tokio::test]
    async fn hard_limit_closes_and_frees_the_queue() {
        let c = Client::new(1, limits(10_000, 1_000));
        let h = head(300);
        let mut outcome = Pushed::Queued;
        for _ in 0..10 {
            outcome = c.push_event(&h, false);
            if outcome == Pushed::SlowConsumer {
                break;
            }
        }
        assert_eq!(outcome, Pushed::SlowConsumer);
        assert!(c.is_closing());
        assert_eq!(c.push_event(&h, false), Pushed::Closed);
        let batch = c.next_batch().await;
        assert!(matches!(&batch[..], [Outgoing::Close(1008, r)] if r == "slow consumer"));
        assert!(!c.push_frame(Bytes::from_static(b"{}")));
    }

    #[tokio::test]
    async fn graceful_close_keeps_earlier_frames() {
        let c = Client::new(1, limits(10, 20));
        assert!(c.push_frame(Bytes::from_static(b"first")));
        c.close(1011, "connect failed");
        let batch = c.next_batch().await;
        assert!(matches!(&batch[0], Outgoing::Frame(b) if &b[..] == b"first"));
        assert!(matches!(&batch[1], Outgoing::Close(1011, _)));
    }

    /// Only the push that makes the queue non-empty wakes the writer; every
    /// event must still reach a writer that drains, sleeps and wakes again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_writer_gets_every_event() {
        let c = std::sync::Arc::new(Client::new(1, limits(1 << 20, 8 << 20)));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let writer = {
            let c = std::sync::Arc::clone(&c);
            tokio::spawn(async move {
                loop {
                    for item in c.next_batch().await {
                        if let Outgoing::Event(_, seq) = item {
                            let _ = tx.send(seq);
                        }
                    }
                }
            })
        };
        let h = head(10);
        let mut expected = 1;
        for round in 0..200 {
            for _ in 0..(round % 5 + 1) {
                assert_eq!(c.push_event(&h, false), Pushed::Queued);
            }
            if round % 3 == 0 {
                tokio::task::yield_now().await;
            }
        }
        let total = (0..200).map(|r| r % 5 + 1).sum::<u64>();
        while expected <= total {
            let seq = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("the writer was woken for every event")
                .expect("writer alive");
            assert_eq!(seq, expected);
            expected += 1;
        }
        writer.abort();
    }

    /// Progress, not time over the soft limit, decides: a backlog that
    /// the writer keeps taking batches from is never stalled; one it takes
    /// nothing from for the grace is closed.
    #[tokio::test]
    async fn no_progress_for_the_grace_closes_progress_does_not() {
        let grace = Duration::from_secs(10);
        let c = Client::new(
            1,
            QueueLimits {
                soft_bytes: 10,
                hard_bytes: 1 << 30,
                grace,
            },
        );
        let h = head(50);
        let t0 = Instant::now();
        // Over the soft limit for a minute, with a batch taken every 5 s.
        for step in 0..12u32 {
            assert_eq!(c.push_event(&h, false), Pushed::Queued);
            assert_eq!(c.push_event(&h, false), Pushed::Queued);
            let now = t0 + Duration::from_secs(5) * step;
            assert_ne!(c.sweep_stall(now), Stall::Closed, "progressing at {step}");
            let _ = c.next_batch().await;
        }
        // Now the writer stops taking while a backlog waits.
        assert_eq!(c.push_event(&h, false), Pushed::Queued);
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(
            c.sweep_stall(t1),
            Stall::Progressing,
            "the last batch counts"
        );
        assert_eq!(c.sweep_stall(t1 + Duration::from_secs(1)), Stall::Waiting);
        assert_eq!(c.sweep_stall(t1 + grace), Stall::Waiting);
        assert_eq!(
            c.sweep_stall(t1 + Duration::from_secs(1) + grace),
            Stall::Closed
        );
        assert!(c.is_closing());
        // An idle client (nothing queued) is never stalled.
        let idle = Client::new(2, limits(10, 1 << 30));
        assert_eq!(idle.sweep_stall(t0), Stall::Progressing);
        assert_eq!(idle.sweep_stall(t0 + grace * 10), Stall::Progressing);
    }

    /// A batch holds at most `MAX_BATCH_BYTES` (but always one item), so a
    /// client reading a large backlog shows progress batch by batch.
    #[tokio::test]
    async fn batches_are_bounded_but_take_at_least_one_item() {
        let c = Client::new(1, limits(1 << 30, 1 << 30));
        let small = head(10 * 1024);
        for _ in 0..100 {
            c.push_event(&small, false);
        }
        let first = c.next_batch().await;
        let bytes: usize = first.iter().map(Outgoing::cost).sum();
        let each = small.len() + ENTRY_BYTES;
        assert!(bytes <= MAX_BATCH_BYTES && bytes + each > MAX_BATCH_BYTES);
        assert_eq!(c.queued_bytes(), 100 * each - bytes);
        let huge = Client::new(2, limits(1 << 30, 1 << 30));
        huge.push_event(&head(MAX_BATCH_BYTES * 3), false);
        huge.push_event(&small, false);
        assert_eq!(huge.next_batch().await.len(), 1);
        assert_eq!(huge.next_batch().await.len(), 1);
    }

    /// A frame up to half the hard limit reaches a client that has another
    /// one queued (a client one maximal frame behind keeps up).
    #[tokio::test]
    async fn two_large_frames_fit_under_the_hard_limit() {
        let c = Client::new(1, limits(1024, 2 * 100_000 + 64 + 2 * ENTRY_BYTES));
        assert!(c.push_frame(Bytes::from(vec![b' '; 100_000])));
        assert_eq!(c.push_event(&head(100_000 - 40), false), Pushed::Queued);
        assert!(!c.is_closing());
        assert!(!c.push_frame(Bytes::from(vec![b' '; 100])), "past hard");
    }

    /// The gateway's advertised buffer raises the hard limit: never stricter
    /// than a direct connection.
    #[tokio::test]
    async fn the_upstream_buffer_raises_the_hard_limit() {
        let budget = Arc::new(QueueBudget::new());
        let c = Client::with_budget(1, limits(10, 1000), Arc::clone(&budget));
        budget.set_upstream_hard(Some(10_000));
        for _ in 0..5 {
            assert!(c.push_frame(Bytes::from(vec![b' '; 1000])));
        }
        budget.set_upstream_hard(None);
        assert!(!c.push_frame(Bytes::from(vec![b' '; 1000])));
    }

    /// The budget counts an event once however many queues hold it (with
    /// its allocation's overhead), and releases it when its last holder
    /// lets go; frames count while queued; every queue's ring buffer counts
    /// as allocated, until the client is dropped.
    #[tokio::test]
    async fn the_budget_counts_shared_events_once() {
        let budget = Arc::new(QueueBudget::new());
        let a = Client::with_budget(1, limits(1 << 20, 1 << 20), Arc::clone(&budget));
        let b = Client::with_budget(2, limits(1 << 20, 1 << 20), Arc::clone(&budget));
        let ev = SharedEvent::new(
            EventHead::from_value("x", &serde_json::json!({"pad": "y".repeat(1000)})),
            &budget,
        );
        let len = ev.len() + EVENT_OVERHEAD_BYTES;
        a.push_event(&ev, false);
        b.push_event(&ev, false);
        drop(ev);
        let slots = |c: &Client| c.lock_queue().items.capacity() * ENTRY_BYTES;
        assert!(slots(&a) > 0);
        assert_eq!(
            budget.used(),
            len + slots(&a) + slots(&b),
            "shared: counted once"
        );
        a.push_frame(Bytes::from_static(b"12345"));
        assert_eq!(budget.used(), len + 5 + slots(&a) + slots(&b));
        let batch = a.next_batch().await;
        assert_eq!(
            budget.used(),
            len + slots(&a) + slots(&b),
            "the frame left the queue"
        );
        drop(batch);
        assert_eq!(
            budget.used(),
            len + slots(&a) + slots(&b),
            "b still holds the event"
        );
        assert!(b.close_slow_consumer());
        assert_eq!(
            budget.used(),
            slots(&a) + slots(&b),
            "released with its last holder"
        );
        b.push_frame(Bytes::from_static(b"ignored: closing"));
        a.push_frame(Bytes::from_static(b"left queued"));
        drop(a);
        drop(b);
        assert_eq!(budget.used(), 0, "dropped clients give everything back");
    }

    /// A reader that catches up gives its high-water ring buffer back.
    #[tokio::test]
    async fn a_queue_that_empties_gives_its_ring_buffer_back() {
        let budget = Arc::new(QueueBudget::new());
        let reader = Client::with_budget(1, limits(1 << 30, 1 << 30), Arc::clone(&budget));
        let ev = SharedEvent::new(EventHead::from_value("x", &serde_json::json!({})), &budget);
        for _ in 0..5_000 {
            reader.push_event(&ev, false);
        }
        assert!(reader.lock_queue().items.capacity() >= 5_000);
        let high = budget.used();
        while !reader.lock_queue().items.is_empty() {
            let _ = reader.next_batch().await;
        }
        assert_eq!(
            reader.lock_queue().items.capacity(),
            0,
            "shrunk when emptied"
        );
        assert!(budget.used() + 5_000 * ENTRY_BYTES <= high);
    }

    /// Bytes accepted by the socket within one large batch count as
    /// progress: a slow reader of a 25 MiB frame is not closed mid-frame.
    #[test]
    fn bytes_written_count_as_progress() {
        let c = Client::new(
            1,
            QueueLimits {
                soft_bytes: 1 << 20,
                hard_bytes: 1 << 24,
                grace: Duration::from_secs(10),
            },
        );
        let written = Arc::new(AtomicU64::new(0));
        c.count_written(Arc::clone(&written));
        let h = head(10);
        let now = Instant::now();
        assert_eq!(c.push_event(&h, false), Pushed::Queued);
        assert_eq!(
            c.sweep_stall(now),
            Stall::Waiting,
            "a backlog, nothing written"
        );
        let later = now + Duration::from_secs(9);
        written.fetch_add(4096, Ordering::Relaxed);
        assert_eq!(
            c.sweep_stall(later),
            Stall::Progressing,
            "bytes were written"
        );
        let much_later = later + Duration::from_secs(9);
        assert_eq!(
            c.sweep_stall(much_later),
            Stall::Waiting,
            "the clock restarted"
        );
        let end = much_later + Duration::from_secs(10);
        assert_eq!(c.sweep_stall(end), Stall::Closed);
    }
}
