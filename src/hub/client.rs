//! One local client's outgoing side: a bounded queue counted in bytes, its
//! own event `seq`, and the accounting that decides when it is too slow.
//!
//! Producers (the upstream reader, the router) only ever push and never wait;
//! the client's writer task drains the queue in batches.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Notify;

use crate::protocol::EventHead;

/// Close code and reason for a client that does not read (design §5).
pub const SLOW_CONSUMER_CLOSE: (u16, &str) = (1008, "slow consumer");

/// One item waiting to be written to a client.
#[derive(Debug)]
pub enum Outgoing {
    /// A shared event and the seq this client gets for it.
    Event(EventHead, u64),
    /// A complete frame for this client only (responses, the challenge).
    Frame(Bytes),
    /// Close the WebSocket with this code and reason, after what precedes it.
    Close(u16, String),
}

impl Outgoing {
    fn cost(&self) -> usize {
        match self {
            Outgoing::Event(head, _) => head.len(),
            Outgoing::Frame(b) => b.len(),
            Outgoing::Close(..) => 0,
        }
    }
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
    pub soft_bytes: usize,
    pub hard_bytes: usize,
    pub grace: Duration,
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<Outgoing>,
    bytes: usize,
    next_seq: u64,
    over_soft_since: Option<Instant>,
    closing: bool,
}

/// A connected local client, shared by the hub, the router and its own tasks.
#[derive(Debug)]
pub struct Client {
    pub id: u64,
    pub kind: ClientKind,
    /// The `server.connId` this client was given in its `hello-ok`.
    pub conn_id: String,
    /// The client asked for tool-stream events at connect.
    pub tool_events: AtomicBool,
    /// The client connected with `operator.admin` (and the broker has it).
    pub admin: AtomicBool,
    /// Requests forwarded upstream and not yet answered.
    pub inflight: AtomicUsize,
    /// Events dropped for this client (soft limit).
    pub dropped: AtomicU64,
    /// Cancelled when the client is closed as a slow consumer, so a writer
    /// blocked on a full socket gives up instead of waiting forever.
    pub killed: tokio_util::sync::CancellationToken,
    limits: QueueLimits,
    queue: Mutex<Queue>,
    wake: Notify,
}

impl Client {
    pub fn new(id: u64, limits: QueueLimits) -> Self {
        Client {
            id,
            kind: ClientKind::Ws,
            conn_id: uuid::Uuid::new_v4().to_string(),
            tool_events: AtomicBool::new(false),
            admin: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
            killed: tokio_util::sync::CancellationToken::new(),
            limits,
            queue: Mutex::new(Queue {
                next_seq: 1,
                ..Queue::default()
            }),
            wake: Notify::new(),
        }
    }

    /// The same client, reached another way (set before it is shared).
    pub fn with_kind(mut self, kind: ClientKind) -> Self {
        self.kind = kind;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A panic while holding this lock cannot leave the queue inconsistent
        // in a way that matters more than losing the client, so poison is ignored.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues an event with this client's next seq. Droppable events are
    /// dropped over the soft limit (the seq is consumed so the client sees a
    /// gap); the hard limit or a soft-limit overrun longer than the grace
    /// closes the client.
    pub fn push_event(&self, head: &EventHead, droppable: bool) -> Pushed {
        let mut q = self.lock();
        if q.closing {
            return Pushed::Closed;
        }
        let seq = q.next_seq;
        q.next_seq += 1;
        if q.bytes >= self.limits.soft_bytes {
            // The clock is read only here: this runs once per client per
            // event, and a healthy client is never over its soft limit.
            let now = Instant::now();
            let since = *q.over_soft_since.get_or_insert(now);
            if self.limits.grace.is_zero() || now.duration_since(since) > self.limits.grace {
                self.close_slow(&mut q);
                return Pushed::SlowConsumer;
            }
            if droppable {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return Pushed::Dropped;
            }
        } else {
            q.over_soft_since = None;
        }
        let item = Outgoing::Event(head.clone(), seq);
        // A single event larger than the hard limit still goes to an idle
        // client: the limit is about a client falling behind, not event size.
        if !q.items.is_empty() && q.bytes + item.cost() > self.limits.hard_bytes {
            self.close_slow(&mut q);
            return Pushed::SlowConsumer;
        }
        q.bytes += item.cost();
        let was_empty = q.items.is_empty();
        q.items.push_back(item);
        drop(q);
        // The writer drains the whole queue at once, so only the push that
        // makes it non-empty needs to wake it: a later push finds the earlier
        // wake-up (or its stored permit) still pending. Waking per push cost
        // a fifth of the broker's fan-out time (measured by the benchmark).
        if was_empty {
            self.wake.notify_one();
        }
        Pushed::Queued
    }

    /// Queues a frame for this client only. Never dropped: if it would
    /// overflow the hard limit the client is closed as a slow consumer instead.
    pub fn push_frame(&self, frame: Bytes) -> bool {
        let mut q = self.lock();
        if q.closing {
            return false;
        }
        if q.bytes + frame.len() > self.limits.hard_bytes && !q.items.is_empty() {
            self.close_slow(&mut q);
            return false;
        }
        q.bytes += frame.len();
        q.items.push_back(Outgoing::Frame(frame));
        drop(q);
        self.wake.notify_one();
        true
    }

    /// Closes after everything already queued has been written.
    pub fn close(&self, code: u16, reason: &str) {
        let mut q = self.lock();
        if q.closing {
            return;
        }
        q.closing = true;
        q.items.push_back(Outgoing::Close(code, reason.to_owned()));
        drop(q);
        self.wake.notify_one();
    }

    /// Closes now, discarding what is queued (the client is not reading it).
    fn close_slow(&self, q: &mut Queue) {
        q.items.clear();
        q.bytes = 0;
        q.closing = true;
        let (code, reason) = SLOW_CONSUMER_CLOSE;
        q.items.push_back(Outgoing::Close(code, reason.into()));
        tracing::warn!(client_id = self.id, "closing slow consumer");
        self.killed.cancel();
        self.wake.notify_one();
    }

    /// Consumes one seq number so the client's gap detection fires.
    pub fn skip_seq(&self) {
        self.lock().next_seq += 1;
    }

    /// Whether a close has been queued.
    pub fn is_closing(&self) -> bool {
        self.lock().closing
    }

    /// Bytes queued and not yet taken by the writer.
    pub fn queued_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Waits for and takes everything queued. Returns an empty batch never;
    /// the caller stops after writing an [`Outgoing::Close`].
    pub async fn next_batch(&self) -> Vec<Outgoing> {
        loop {
            {
                let mut q = self.lock();
                if !q.items.is_empty() {
                    q.bytes = 0;
                    return q.items.drain(..).collect();
                }
            }
            self.wake.notified().await;
        }
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

    fn head(n: usize) -> EventHead {
        EventHead::from_value("tick", &serde_json::json!({ "pad": "x".repeat(n) }))
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

    #[tokio::test]
    async fn grace_overrun_closes() {
        let c = Client::new(
            1,
            QueueLimits {
                soft_bytes: 10,
                hard_bytes: 1 << 20,
                grace: Duration::ZERO,
            },
        );
        let h = head(50);
        assert_eq!(c.push_event(&h, false), Pushed::Queued);
        // Over the soft limit now; with zero grace the next push closes.
        assert_eq!(c.push_event(&h, false), Pushed::SlowConsumer);
    }
}
