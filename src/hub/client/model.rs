//! The client queue's protocol model-checked with loom: every interleaving
//! of the hub's fan-out, a second pusher (the router's responses, another
//! publisher), a close (the shedder, the stall sweep, the client's own
//! session) and the client's writer, run over the very functions the
//! client uses (`protocol.rs`), with loom's mutex, loom's `AtomicWaker`
//! (the writer really sleeps: a lost wake-up is a deadlock loom reports)
//! and a budget that fails the moment it would go below zero. What each
//! model proves:
//!
//! - `order_is_kept_and_no_wake_up_is_lost`: the writer receives every
//!   pushed item, each pusher's in the order it pushed them, events in
//!   increasing `seq`; a push after the writer found the queue empty still
//!   wakes it; the budget is back to zero when the client leaves.
//! - `a_closed_queue_accepts_nothing_and_gives_back_once`: once a slow
//!   consumer's close is queued, no push is accepted and the close is the
//!   last item the writer gets; the writer is told to give up (killed) and
//!   woken; what the close discarded is given back to the budget exactly
//!   once (never below zero, exact when all is dropped).
//! - `a_graceful_close_comes_after_what_was_queued`: a close queued by the
//!   client's session (`going away`) wakes a sleeping writer, reaches it
//!   after everything accepted before it, in order, and nothing pushed
//!   after it is accepted.
//! - `a_client_leaving_gives_everything_back`: a client that closes and
//!   goes away while pushes are under way and its writer holds a batch
//!   gives back everything, whichever holder lets go last: the count
//!   never goes below zero and ends at zero.

use std::future::poll_fn;

// The budget and the events' reference counts are plain `std` atomics, as
// in the real code: they are added to and taken from, never read to decide
// anything here, so their interleavings cannot change an outcome and
// exploring them would only multiply the executions. What loom explores is
// the queue's lock, the writer's waker and the threads.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use loom::future::{block_on, AtomicWaker};
use loom::sync::{Mutex, MutexGuard};
use loom::thread;

use super::protocol::{self, Budget, Env, Pushed, Queue};

/// A budget that fails as soon as it would count below zero (an item
/// given back twice, or one never counted).
#[derive(Debug, Default)]
struct Counted(AtomicUsize);

impl Budget for Counted {
    fn add(&self, n: usize) {
        self.0.fetch_add(n, Ordering::SeqCst);
    }

    fn sub(&self, n: usize) {
        let before = self.0.fetch_sub(n, Ordering::SeqCst);
        assert!(before >= n, "the budget went below zero ({before} - {n})");
    }

    fn used(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    fn limit(&self) -> usize {
        usize::MAX
    }

    fn tick(&self) -> u64 {
        CLOCK.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// The progress clock (its readings are only compared by the hub, never
/// by the queue protocol itself).
static CLOCK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An event shared by the queues it was pushed to, counted until its last
/// holder drops it (as `SharedEvent`).
#[derive(Debug)]
struct Event {
    name: &'static str,
    budget: Arc<Counted>,
}

/// What one event or frame is in the model: small beside the limits.
const BYTES: usize = 100;

impl Event {
    fn new(name: &'static str, budget: &Arc<Counted>) -> Arc<Self> {
        budget.add(BYTES);
        Arc::new(Event {
            name,
            budget: Arc::clone(budget),
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.budget.sub(BYTES);
    }
}

#[derive(Debug)]
enum Item {
    Event(Arc<Event>, u64),
    Frame(&'static str),
    Close(u16),
}

impl protocol::Item for Item {
    fn cost(&self) -> usize {
        match self {
            Item::Event(..) | Item::Frame(_) => BYTES + std::mem::size_of::<Item>(),
            Item::Close(_) => 0,
        }
    }

    fn counted(&self) -> usize {
        match self {
            Item::Frame(_) => BYTES,
            Item::Event(..) | Item::Close(_) => 0,
        }
    }

    fn close(code: u16, _reason: &str) -> Self {
        Item::Close(code)
    }
}

/// One client: its queue, its writer's waker, and whether it was killed.
struct Client {
    queue: Mutex<Queue<Item>>,
    waker: AtomicWaker,
    budget: Arc<Counted>,
    killed: AtomicBool,
}

impl Env for Client {
    type Item = Item;
    type Budget = Counted;
    type Guard<'a> = MutexGuard<'a, Queue<Item>>;

    fn lock_queue(&self) -> Self::Guard<'_> {
        self.queue.lock().unwrap()
    }

    fn counter(&self) -> &Counted {
        &self.budget
    }

    fn soft_limit(&self) -> usize {
        1 << 20
    }

    fn hard_limit(&self) -> usize {
        1 << 20
    }

    fn wake_writer(&self) {
        self.waker.wake();
    }

    fn register_writer(&self, waker: &std::task::Waker) {
        self.waker.register_by_ref(waker);
    }

    fn on_slow_consumer(&self) {
        self.killed.store(true, Ordering::SeqCst);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        protocol::give_back(self.queue.get_mut().unwrap(), &*self.budget);
    }
}

fn client(budget: &Arc<Counted>) -> Arc<Client> {
    Arc::new(Client {
        queue: Mutex::new(Queue::new()),
        waker: AtomicWaker::new(),
        budget: Arc::clone(budget),
        killed: AtomicBool::new(false),
    })
}

/// The hub's fan-out: a new event, pushed, then let go by the hub.
fn publish(c: &Client, name: &'static str) -> Pushed {
    let event = Event::new(name, &c.budget);
    let cost = BYTES + std::mem::size_of::<Item>();
    protocol::push_event(c, cost, false, protocol::Growth::WithinBudget, |seq| {
        Item::Event(event, seq)
    })
}

/// The writer: sleeps until the queue has something, then takes a batch.
fn next_batch(c: &Client) -> Vec<Item> {
    block_on(poll_fn(|cx| protocol::poll_next_batch(c, cx.waker())))
}

/// What the writer got: a name per item (`close` for a close), and the
/// seqs of the events in the order received.
fn names(items: &[Item]) -> Vec<&'static str> {
    items
        .iter()
        .map(|i| match i {
            Item::Event(e, _) => e.name,
            Item::Frame(n) => n,
            Item::Close(1008) => "slow consumer",
            Item::Close(_) => "close",
        })
        .collect()
}

fn before(got: &[&str], a: &str, b: &str) -> bool {
    let at = |n| got.iter().position(|g| *g == n);
    matches!((at(a), at(b)), (Some(a), Some(b)) if a < b)
}

/// Runs `f` under loom with at most two forced preemptions per execution
/// (tokio's own models use 2–3; `LOOM_MAX_PREEMPTIONS` overrides it). The
/// writer really sleeps and wakes here, which multiplies the executions:
/// at three the four models take 13 to 23 s instead of 2 s, and each guard
/// they check already fails at two (the mutations listed in the book's
/// status page).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = builder.preemption_bound.or(Some(2));
    builder.check(f);
}

#[test]
fn order_is_kept_and_no_wake_up_is_lost() {
    model(|| {
        let budget = Arc::new(Counted::default());
        let c = client(&budget);
        let fan_out = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                assert_eq!(publish(&c, "e1"), Pushed::Queued);
                assert_eq!(publish(&c, "e2"), Pushed::Queued);
            })
        };
        let other = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                assert!(protocol::push_frame(&*c, Item::Frame("r1")));
                assert_eq!(publish(&c, "e3"), Pushed::Queued);
            })
        };
        // The writer: a lost wake-up leaves it asleep, which loom reports
        // as a deadlock.
        let mut got = Vec::new();
        let mut seqs = Vec::new();
        while got.len() < 4 {
            let batch = next_batch(&c);
            got.extend(names(&batch));
            seqs.extend(batch.iter().filter_map(|i| match i {
                Item::Event(_, seq) => Some(*seq),
                _ => None,
            }));
        }
        fan_out.join().unwrap();
        other.join().unwrap();
        assert!(before(&got, "e1", "e2"), "the fan-out's order: {got:?}");
        assert!(
            before(&got, "r1", "e3"),
            "the second pusher's order: {got:?}"
        );
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "seqs in queue order: {seqs:?}"
        );
        assert_eq!(seqs.len(), 3);
        drop(c);
        assert_eq!(budget.used(), 0, "the client left: all given back");
    });
}

#[test]
fn a_closed_queue_accepts_nothing_and_gives_back_once() {
    model(|| {
        let budget = Arc::new(Counted::default());
        let c = client(&budget);
        // The hub's fan-out and a response for the client, one after the
        // other (two pushers and a close would be four threads with the
        // writer: the model would take minutes).
        let pushers = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let event = publish(&c, "e1");
                let frame = protocol::push_frame(&*c, Item::Frame("r1"));
                // Once the close is queued, nothing is.
                if event == Pushed::Closed {
                    assert!(!frame, "a closed queue took a frame");
                }
            })
        };
        let shedder = {
            let c = Arc::clone(&c);
            thread::spawn(move || assert!(protocol::close_slow_consumer(&*c)))
        };
        // The writer runs until its close.
        let mut got = Vec::new();
        while got.last() != Some(&"slow consumer") {
            let batch = next_batch(&c);
            got.extend(names(&batch));
        }
        pushers.join().unwrap();
        shedder.join().unwrap();
        assert!(
            c.killed.load(Ordering::SeqCst),
            "the writer was told to give up"
        );
        let closes = got.iter().filter(|n| **n == "slow consumer").count();
        assert_eq!(closes, 1, "one close: {got:?}");
        assert!(
            c.lock_queue().items.is_empty(),
            "nothing queued after the close"
        );
        assert!(!protocol::push_frame(&*c, Item::Frame("late")));
        assert_eq!(publish(&c, "late"), Pushed::Closed);
        // Everything the close discarded was given back, once: what is
        // left is the queue's ring buffer.
        let slots = c.lock_queue().slots_counted * std::mem::size_of::<Item>();
        assert_eq!(budget.used(), slots, "given back exactly once");
        drop(c);
        assert_eq!(budget.used(), 0);
    });
}

#[test]
fn a_client_leaving_gives_everything_back() {
    model(|| {
        let budget = Arc::new(Counted::default());
        let c = client(&budget);
        let fan_out = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                publish(&c, "e1");
                publish(&c, "e2");
            })
        };
        let router = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                protocol::push_frame(&*c, Item::Frame("r1"));
                protocol::push_frame(&*c, Item::Frame("r2"));
            })
        };
        // The client's session: its writer takes one batch and holds it
        // while the session closes and lets go of the client.
        let held = next_batch(&c);
        protocol::close(&*c, 1000, "bye");
        drop(c);
        drop(held);
        fan_out.join().unwrap();
        router.join().unwrap();
        assert_eq!(budget.used(), 0, "the client left: all given back");
    });
}

#[test]
fn a_graceful_close_comes_after_what_was_queued() {
    model(|| {
        let budget = Arc::new(Counted::default());
        let c = client(&budget);
        let pushers = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let event = publish(&c, "e1") == Pushed::Queued;
                let frame = protocol::push_frame(&*c, Item::Frame("r1"));
                assert!(event || !frame, "a closed queue took a frame");
                [("e1", event), ("r1", frame)]
            })
        };
        // The client's session, closing it (`going away`, a bad frame).
        let session = {
            let c = Arc::clone(&c);
            thread::spawn(move || protocol::close(&*c, 1001, "going away"))
        };
        // The writer, asleep until there is something, runs until the close.
        let mut got = Vec::new();
        while got.last() != Some(&"close") {
            let batch = next_batch(&c);
            got.extend(names(&batch));
        }
        let pushed = pushers.join().unwrap();
        session.join().unwrap();
        let accepted: Vec<&str> = pushed.iter().filter(|p| p.1).map(|p| p.0).collect();
        assert_eq!(
            got[..got.len() - 1],
            accepted[..],
            "everything queued before the close, in order, then the close"
        );
        assert!(
            !c.killed.load(Ordering::SeqCst),
            "a graceful close kills nothing"
        );
        drop(c);
        assert_eq!(budget.used(), 0, "the client left: all given back");
    });
}
