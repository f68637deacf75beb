//! A client queue's protocol with no runtime inside: who may push, how a
//! push wakes the writer, how the writer takes batches, how a close ends
//! the queue, and what each step counts in the hub's budget.
//! `Client` runs it over a `std::sync::Mutex`, the real
//! `AtomicWaker` and the hub's `QueueBudget`; the loom model
//! (`model.rs`) runs the same functions over loom's mutex, loom's
//! `AtomicWaker` and a budget that fails the moment it would go negative,
//! through every interleaving of the hub's fan-out, a client's responses, a
//! close and the client's writer.
//!
//! The rules the functions keep, each under the queue's lock:
//! - **One order**: a push takes its seq and its place in the queue in one
//!   critical section, and the writer takes from the front.
//! - **No lost wake-up**: the writer registers its waker *before* it looks
//!   at the queue, and a push that makes the queue non-empty wakes it after
//!   letting go of the lock. Later pushes need not wake: the writer drains
//!   until it finds the queue empty before it waits again.
//! - **A close is final**: once `closing` is set nothing more is queued;
//!   a slow consumer's close discards the backlog, giving its count back
//!   as it goes, and tells the writer to give up before waking it.
//! - **Counted once**: a frame is counted from its push until it leaves
//!   the queue (taken, discarded, or left behind when the client goes);
//!   an event counts itself until its last holder drops it; the ring
//!   buffer counts its slots as allocated.
//! - **Waiting is dated**: a queue with items records when, on the
//!   budget's progress clock, it last had nothing waiting or its writer
//!   last took something ([`Queue::waiting_since`]); the hub sheds the
//!   queues that have waited longest first.

use std::collections::VecDeque;
use std::ops::DerefMut;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// Close code and reason for a client that does not read (design §5).
pub const SLOW_CONSUMER_CLOSE: (u16, &str) = (1008, "slow consumer");

/// The most bytes one `Client::next_batch` takes (at least one item is
/// always taken, however large). Taking a batch is the writer's progress
/// signal, so this bounds how much a client must read to count as reading
/// within `QueueLimits::grace`, and how much a writer holds outside the
/// queue. 256 KiB is a few hundred typical events: one flush per batch keeps
/// the fan-out cheap.
pub const MAX_BATCH_BYTES: usize = 256 * 1024;

/// A queue whose ring buffer has room for more than this many entries gives
/// the memory back when it empties: a client that fell behind once does not
/// keep its high-water allocation (a reader's queue rarely holds more).
const SHRINK_ABOVE_ENTRIES: usize = 256;

/// One queued item, as far as the protocol needs to know it.
pub(crate) trait Item {
    /// What it costs the client's own limits: its bytes and its slot.
    fn cost(&self) -> usize;
    /// Bytes the queue counts in the budget for it while it is queued (a
    /// frame's); an event counts itself for as long as it lives.
    fn counted(&self) -> usize;
    /// The item that closes the client's socket with this code and reason.
    fn close(code: u16, reason: &str) -> Self;
}

/// The broker-wide count queued memory is held to.
pub(crate) trait Budget {
    fn add(&self, n: usize);
    fn sub(&self, n: usize);
    /// Bytes counted now.
    fn used(&self) -> usize;
    fn limit(&self) -> usize;
    /// The next reading of the broker-wide progress clock: it only grows,
    /// one step per reading, so two queues' waits compare by when they
    /// began (see [`Queue::waiting_since`]).
    fn tick(&self) -> u64;
}

/// What the protocol works on: a client's locked queue, its writer's
/// wake-up and its budget.
pub(crate) trait Env {
    type Item: Item;
    type Budget: Budget;
    type Guard<'a>: DerefMut<Target = Queue<Self::Item>>
    where
        Self: 'a;
    fn lock_queue(&self) -> Self::Guard<'_>;
    fn counter(&self) -> &Self::Budget;
    /// Over this many queued bytes, droppable events are dropped.
    fn soft_limit(&self) -> usize;
    /// A push past this closes a client with a backlog.
    fn hard_limit(&self) -> usize;
    /// Wakes the task writing the client's socket.
    fn wake_writer(&self);
    /// Registers the writer's task to be woken by [`Env::wake_writer`].
    fn register_writer(&self, waker: &Waker);
    /// The client was closed as a slow consumer: a writer blocked on its
    /// socket must give up. Called under the lock, before the writer is woken.
    fn on_slow_consumer(&self);
}

/// The state behind a client's lock.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    pub items: VecDeque<T>,
    /// The ring buffer's capacity as counted in the budget (slots).
    pub slots_counted: usize,
    /// Bytes queued, each item with its slot ([`Item::cost`]).
    pub bytes: usize,
    pub next_seq: u64,
    /// Batches the writer has taken: its progress.
    pub batches_taken: u64,
    /// `batches_taken` as the last stall sweep saw it.
    pub batches_seen: u64,
    /// Bytes written (see `Client::written`) as the last stall sweep saw them.
    pub written_seen: u64,
    /// The first sweep that saw a backlog and no progress since the one before.
    pub stalled_since: Option<Instant>,
    /// While items wait: the progress clock's reading ([`Budget::tick`])
    /// when the queue last stopped being empty, or its writer last took a
    /// batch (or its socket last took bytes of one), whichever is later.
    /// The smaller it is, the longer the client has gone without reading.
    pub waiting_since: Option<u64>,
    pub closing: bool,
}

impl<T> Queue<T> {
    /// An empty queue whose first event gets seq 1.
    pub fn new() -> Self {
        Queue {
            items: VecDeque::new(),
            slots_counted: 0,
            bytes: 0,
            next_seq: 1,
            batches_taken: 0,
            batches_seen: 0,
            written_seen: 0,
            stalled_since: None,
            waiting_since: None,
            closing: false,
        }
    }
}

/// What one entry's slot in the ring buffer costs.
fn slot_bytes<T>() -> usize {
    std::mem::size_of::<T>()
}

/// What happened to a pushed event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    Queued,
    /// Dropped because the client is over its soft limit; a seq was consumed.
    Dropped,
    /// The client was already closing; nothing was queued.
    Closed,
    /// This push closed the client as a slow consumer.
    SlowConsumer,
    /// Not queued (no seq consumed): the queue's ring buffer would have to
    /// grow past what the broker-wide budget has left. The hub makes room
    /// (closing the queues that have waited longest, which may be this
    /// one) and pushes again with [`Growth::Always`].
    NoRoom,
}

/// Whether a push may grow a backlog's ring buffer past what the
/// broker-wide budget has left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// Only within the budget: past it the push is refused ([`Pushed::NoRoom`]).
    WithinBudget,
    /// Whatever the budget has left (the hub already made what room it could).
    Always,
}

/// What a stall sweep found for one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    /// Empty queue, or the writer took a batch since the last sweep.
    Progressing,
    /// A backlog and no progress, for less than the grace so far.
    Waiting,
    /// The sweep closed the client as a slow consumer.
    Closed,
}

/// Queues the event `make` builds from the client's next seq, `cost` bytes
/// with its slot (see `Client::push_event`).
pub(crate) fn push_event<E: Env>(
    c: &E,
    cost: usize,
    droppable: bool,
    growth: Growth,
    make: impl FnOnce(u64) -> E::Item,
) -> Pushed {
    let mut q = c.lock_queue();
    if q.closing {
        return Pushed::Closed;
    }
    let seq = q.next_seq;
    // A healthy client is under its soft limit: one comparison.
    if q.bytes + cost > c.soft_limit() {
        if droppable && q.bytes >= c.soft_limit() {
            q.next_seq += 1;
            return Pushed::Dropped;
        }
        // A single event larger than the hard limit still goes to an
        // idle client: the limit is about falling behind, not event size.
        if !q.items.is_empty() && q.bytes + cost > c.hard_limit() {
            q.next_seq += 1;
            close_slow(c, &mut q);
            return Pushed::SlowConsumer;
        }
    }
    // A backlog whose ring buffer must grow past what the broker-wide
    // budget has left does not grow before the hub has chosen whom to
    // close for it: growing first and shedding after would take every
    // such queue's doubling past the budget at once (stalled clients grow
    // in step), and closing the queue that grows would close a reader
    // that is behind for a moment while clients that stopped reading
    // stay open.
    if growth == Growth::WithinBudget && growth_over_budget(c, &q) {
        return Pushed::NoRoom;
    }
    q.next_seq += 1;
    q.bytes += cost;
    let was_empty = q.items.is_empty();
    if was_empty {
        q.waiting_since = Some(c.counter().tick());
    }
    q.items.push_back(make(seq));
    recount_slots(c, &mut q);
    drop(q);
    // The writer takes batches until the queue is empty before it waits
    // again (it registers its waker before it looks), so only the push
    // that makes the queue non-empty needs to wake it: any later push
    // finds a writer that has not looked yet. Waking per push cost a
    // fifth of the broker's fan-out time (measured by the benchmark).
    if was_empty {
        c.wake_writer();
    }
    Pushed::Queued
}

/// Queues a frame for this client only (see `Client::push_frame`).
pub(crate) fn push_frame<E: Env>(c: &E, frame: E::Item) -> bool {
    let mut q = c.lock_queue();
    if q.closing {
        return false;
    }
    let cost = frame.cost();
    if q.bytes + cost > c.hard_limit() && !q.items.is_empty() {
        close_slow(c, &mut q);
        return false;
    }
    q.bytes += cost;
    c.counter().add(frame.counted());
    if q.items.is_empty() {
        q.waiting_since = Some(c.counter().tick());
    }
    q.items.push_back(frame);
    recount_slots(c, &mut q);
    drop(q);
    c.wake_writer();
    true
}

/// Closes after everything already queued has been written.
pub(crate) fn close<E: Env>(c: &E, code: u16, reason: &str) {
    let mut q = c.lock_queue();
    if q.closing {
        return;
    }
    q.closing = true;
    q.items.push_back(E::Item::close(code, reason));
    recount_slots(c, &mut q);
    drop(q);
    c.wake_writer();
}

/// Closes now as a slow consumer, discarding what is queued; false if
/// the client was already closing.
pub(crate) fn close_slow_consumer<E: Env>(c: &E) -> bool {
    let mut q = c.lock_queue();
    if q.closing {
        return false;
    }
    close_slow(c, &mut q);
    true
}

/// Closes now, discarding what is queued (the client is not reading it).
fn close_slow<E: Env>(c: &E, q: &mut Queue<E::Item>) {
    for item in q.items.drain(..) {
        c.counter().sub(item.counted());
    }
    // The backlog's ring buffer goes too, not only its items.
    q.items = VecDeque::new();
    q.bytes = 0;
    q.waiting_since = None;
    q.closing = true;
    let (code, reason) = SLOW_CONSUMER_CLOSE;
    q.items.push_back(E::Item::close(code, reason));
    recount_slots(c, q);
    c.on_slow_consumer();
    c.wake_writer();
}

/// Brings the budget's count of this queue's ring buffer up to date
/// after it may have grown or shrunk.
fn recount_slots<E: Env>(c: &E, q: &mut Queue<E::Item>) {
    let slots = q.items.capacity();
    let each = slot_bytes::<E::Item>();
    if slots > q.slots_counted {
        c.counter().add((slots - q.slots_counted) * each);
    } else if slots < q.slots_counted {
        c.counter().sub((q.slots_counted - slots) * each);
    }
    q.slots_counted = slots;
}

/// Whether the next push would grow the ring buffer by more than the
/// broker-wide budget has left (`VecDeque` doubles when full).
/// Only a backlog past the soft limit is judged: a reader's queue grows
/// freely (it counts, and the hub sheds after the publish).
fn growth_over_budget<E: Env>(c: &E, q: &Queue<E::Item>) -> bool {
    match growth_bytes(c, q) {
        Some(growth) => c.counter().used().saturating_add(growth) > c.counter().limit(),
        None => false,
    }
}

/// What the next push would add to the ring buffer of a backlog past the
/// soft limit, if it must grow (`VecDeque` doubles when full).
pub(crate) fn growth_bytes<E: Env>(c: &E, q: &Queue<E::Item>) -> Option<usize> {
    let slots = q.items.capacity();
    if q.items.len() < slots || slots < SHRINK_ABOVE_ENTRIES || q.bytes <= c.soft_limit() {
        return None;
    }
    Some(slots * slot_bytes::<E::Item>())
}

/// The stall sweep for one client, `written` being the bytes its socket
/// has accepted so far (see `Client::sweep_stall`).
pub(crate) fn sweep_stall<E: Env>(c: &E, written: u64, now: Instant, grace: Duration) -> Stall {
    let mut q = c.lock_queue();
    if !q.closing && !q.items.is_empty() && written != q.written_seen {
        // Bytes of a batch reached the socket: the wait starts again.
        q.waiting_since = Some(c.counter().tick());
    }
    if q.closing
        || q.items.is_empty()
        || q.batches_taken != q.batches_seen
        || written != q.written_seen
    {
        q.batches_seen = q.batches_taken;
        q.written_seen = written;
        q.stalled_since = None;
        return Stall::Progressing;
    }
    let since = *q.stalled_since.get_or_insert(now);
    if now.duration_since(since) >= grace {
        close_slow(c, &mut q);
        return Stall::Closed;
    }
    Stall::Waiting
}

/// The writer's next batch: queued items in order, up to
/// [`MAX_BATCH_BYTES`] (at least one), or `Pending` with the writer
/// registered to be woken by the next push.
pub(crate) fn poll_next_batch<E: Env>(c: &E, waker: &Waker) -> Poll<Vec<E::Item>> {
    // Registered before looking, so a push after the look wakes it.
    c.register_writer(waker);
    let mut q = c.lock_queue();
    if q.items.is_empty() {
        return Poll::Pending;
    }
    let mut taken = 0;
    let mut n = 0;
    for item in &q.items {
        if n > 0 && taken + item.cost() > MAX_BATCH_BYTES {
            break;
        }
        taken += item.cost();
        c.counter().sub(item.counted());
        n += 1;
    }
    q.bytes -= taken;
    q.batches_taken += 1;
    let batch = q.items.drain(..n).collect();
    q.waiting_since = (!q.items.is_empty()).then(|| c.counter().tick());
    if q.items.is_empty() && q.items.capacity() > SHRINK_ABOVE_ENTRIES {
        q.items = VecDeque::new();
        recount_slots(c, &mut q);
    }
    Poll::Ready(batch)
}

/// A client going away with items still queued (its session ended without
/// draining them) gives their count back, and its ring buffer's; events
/// uncount themselves.
pub(crate) fn give_back<T: Item, B: Budget>(q: &Queue<T>, budget: &B) {
    for item in &q.items {
        budget.sub(item.counted());
    }
    budget.sub(q.slots_counted * slot_bytes::<T>());
}
