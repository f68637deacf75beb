//! The broker-wide queue budget's one rule: who is closed when the queues
//! hold more than `queue_total_bytes` ([`Hub::shed`]). Publishing, the
//! stall sweep and a ring buffer that must grow all ask it; nothing else
//! closes a client for the budget.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Backlog, Client, Hub, HubInner};

impl Hub {
    /// Keeps the broker-wide queued bytes, with `room` bytes more, within
    /// the budget: while they are over it, closes (`1008 slow consumer`)
    /// the client that has gone longest without reading — the smallest
    /// [`Backlog::waiting_since`]: no batch taken, no bytes written, since
    /// its backlog began — then the next. A client reading through a large
    /// backlog has taken something recently, so every client that stopped
    /// reading before it is closed before it is; the size of a backlog
    /// decides nothing (a reader behind for a moment is often the largest).
    /// If only clients that keep reading are left and the total is still
    /// over, the slowest of them goes: the budget is the broker's memory
    /// bound, and each reader's own limits (hard limit, no-progress grace)
    /// would not hold it.
    ///
    /// Bytes held outside the queues of clients already closed (the
    /// unwritten chunks of an event stream, freed when its connection ends
    /// or is cut, up to a couple of seconds later) do not count: closing
    /// another client would not free them sooner.
    ///
    /// Only a backlog that is part of what put the broker over is closed:
    /// one the stall sweep has seen waiting with no progress, or one over
    /// the client's soft limit or its fair share of the budget (the budget
    /// divided among the queues). A client within both that keeps up is not
    /// closed for bytes held elsewhere (writers' batches mid-write, streams
    /// being cut), which the stall sweep and the streams' own bounds
    /// handle.
    pub(super) fn shed(&self, inner: &HubInner, room: usize) {
        let limit = self.queue_budget.limit();
        let over = |leaving: usize| {
            let used = self.queue_budget.used().saturating_sub(leaving);
            used.saturating_add(room) > limit
        };
        if !over(0) {
            return;
        }
        let all = || inner.clients.values().chain(inner.watched.values());
        let mut leaving: usize = all()
            .filter(|c| c.is_closing())
            .map(|c| c.held_outside())
            .sum();
        let queues = inner.clients.len() + inner.watched.len();
        let fair_share = limit / queues.max(1);
        let mut candidates: Vec<(Backlog, &Arc<Client>)> = all()
            .filter_map(|c| c.backlog().map(|b| (b, c)))
            .filter(|(b, c)| b.stalled || b.bytes > c.soft_bytes().min(fair_share))
            .collect();
        candidates.sort_unstable_by_key(|(b, _)| b.waiting_since);
        for (backlog, client) in candidates {
            if !over(leaving) {
                break;
            }
            if client.close_slow_consumer() {
                leaving += client.held_outside();
                tracing::warn!(
                    client_id = client.id,
                    backlog = backlog.bytes,
                    stalled = backlog.stalled,
                    budget = limit,
                    "broker-wide queue budget exceeded: closed the client that had gone longest without reading"
                );
                self.stats.slow_closes.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use serde_json::json;
    use std::time::{Duration, Instant};

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    fn admitted(hub: &Hub) -> Arc<Client> {
        let c = hub.new_client();
        c.set_access(crate::policy::Access::unrestricted());
        hub.admit(&c, |_| Bytes::new()).unwrap();
        c
    }

    fn limits(soft_bytes: usize) -> QueueLimits {
        QueueLimits {
            soft_bytes,
            hard_bytes: 1 << 30,
            grace: Duration::from_secs(3600),
        }
    }

    /// A reader that keeps taking batches but is behind (its backlog the
    /// largest, as a reader's is for a moment in a flood) is not closed
    /// while clients that stopped reading are open: they go first, however
    /// small their backlogs; the reader goes only when it is the last one
    /// left over the budget.
    #[tokio::test]
    async fn a_reader_behind_outlasts_every_client_that_stopped_reading() {
        let hub = Hub::new(limits(64 * 1024), 10);
        let reader = admitted(&hub);
        let _ = reader.next_batch().await; // the empty hello
        let pad = "p".repeat(100_000);
        // Three events of 100 kB for each batch (two of them) it takes.
        for n in 0..30 {
            hub.publish(
                "test.event",
                Some(&raw(json!({"n": n, "pad": pad}))),
                None,
                &Audience::All,
            );
            if n % 3 == 2 {
                assert_eq!(reader.next_batch().await.len(), 2);
            }
        }
        // Two clients that stop reading, each with an answer it never takes.
        let stalled = [admitted(&hub), admitted(&hub)];
        for c in &stalled {
            assert!(c.push_frame(Bytes::from(vec![b' '; 400_000])));
        }
        // The reader goes on reading: it is 8 events (800 kB) behind.
        assert_eq!(reader.next_batch().await.len(), 2);
        let behind = reader.queued_bytes();
        assert!(behind > 2 * stalled[0].queued_bytes(), "{behind}");
        hub.set_queue_budget(hub.queue_budget().used() - 600_000);
        hub.sweep_stalled(Instant::now());
        assert!(
            stalled.iter().all(|c| c.is_closing()),
            "both stopped reading"
        );
        assert!(!reader.is_closing(), "the largest backlog, still reading");
        assert!(!hub.queue_budget().is_over());
        // Only the reader is left over a budget that shrank: it goes too.
        hub.set_queue_budget(hub.queue_budget().used() - 1);
        hub.sweep_stalled(Instant::now());
        assert!(reader.is_closing());
        assert_eq!(hub.stats.slow_closes.load(Ordering::Relaxed), 3);
    }

    /// A reader behind whose queue's ring buffer must grow past what the
    /// budget has left gets the room from a client that stopped reading,
    /// instead of being closed for growing.
    #[tokio::test]
    async fn room_to_grow_is_made_from_clients_that_stopped_reading() {
        let hub = Hub::new(limits(64 * 1024), 10);
        let stalled = [admitted(&hub), admitted(&hub)];
        for c in &stalled {
            assert!(c.push_frame(Bytes::from(vec![b' '; 400_000])));
        }
        let reader = admitted(&hub);
        let _ = reader.next_batch().await;
        let pad = "p".repeat(10_000);
        let only_reader = Audience::Only(vec![reader.id]);
        let publish = |n: u32| {
            let event = raw(json!({"n": n, "pad": pad}));
            hub.publish("test.event", Some(&event), None, &only_reader);
        };
        for n in 0..500 {
            publish(n);
        }
        let _ = reader.next_batch().await;
        // Its ring buffer full (512 entries): the next event must grow it.
        let mut n = 500;
        while reader.ring_growth() == 0 {
            publish(n);
            n += 1;
        }
        let growth = reader.ring_growth();
        hub.set_queue_budget(hub.queue_budget().used() + growth / 2);
        publish(n);
        assert!(!reader.is_closing(), "it grew");
        assert!(
            stalled[0].is_closing(),
            "room was made from a stalled client"
        );
        assert!(!stalled[1].is_closing(), "only as many as needed");
        assert!(!hub.queue_budget().is_over());
    }

    /// Bytes held for a client outside its queue (a stream's chunks hyper
    /// has not written) are on their way out once it is closed: nobody
    /// else is closed for them while they go.
    #[tokio::test]
    async fn a_closed_streams_unwritten_chunks_close_nobody_else() {
        #[derive(Debug)]
        struct Unwritten(usize);
        impl HeldOutside for Unwritten {
            fn held(&self) -> usize {
                self.0
            }
        }
        let hub = Hub::new(limits(64 * 1024), 10);
        let reader = admitted(&hub);
        let _ = reader.next_batch().await;
        let stream = admitted(&hub);
        let chunks = hub.queue_budget().hold(1_000_000);
        stream.hold_outside(Arc::new(Unwritten(1_000_000)));
        let pad = "p".repeat(100_000);
        for n in 0..6 {
            let event = raw(json!({"n": n, "pad": pad}));
            hub.publish("test.event", Some(&event), None, &Audience::All);
        }
        // The reader takes a batch: behind, but reading.
        let _ = reader.next_batch().await;
        // Over by more than closing the stream frees from the queues.
        hub.set_queue_budget(hub.queue_budget().used() - 500_000);
        hub.sweep_stalled(Instant::now());
        assert!(stream.is_closing(), "it stopped reading");
        assert!(!reader.is_closing(), "its chunks are leaving: no one else");
        let event = raw(json!({"n": 6, "pad": pad}));
        hub.publish("test.event", Some(&event), None, &Audience::All);
        assert!(!reader.is_closing(), "still leaving, still no one else");
        drop(chunks);
        assert!(!hub.queue_budget().is_over());
    }

    /// When only clients that keep reading are over the budget, the one
    /// that took something longest ago goes first, whatever the sizes.
    #[tokio::test]
    async fn with_only_readers_over_the_budget_the_slowest_goes() {
        let hub = Hub::new(limits(64 * 1024), 10);
        let (slow, fast) = (admitted(&hub), admitted(&hub));
        let _ = slow.next_batch().await;
        let _ = fast.next_batch().await;
        let pad = "p".repeat(100_000);
        let event = |n: u32| raw(json!({"n": n, "pad": pad}));
        for n in 0..10 {
            hub.publish("test.event", Some(&event(n)), None, &Audience::All);
        }
        let _ = slow.next_batch().await;
        for n in 10..14 {
            let only_fast = Audience::Only(vec![fast.id]);
            hub.publish("test.event", Some(&event(n)), None, &only_fast);
        }
        let _ = fast.next_batch().await;
        assert!(fast.queued_bytes() > slow.queued_bytes());
        hub.set_queue_budget(hub.queue_budget().used() - 1);
        hub.sweep_stalled(Instant::now());
        assert!(slow.is_closing(), "it read longest ago");
        assert!(!fast.is_closing(), "closing one was enough");
    }

    /// Over the broker-wide budget the client that has read nothing for
    /// longest is closed first, and only as many as needed; readers are
    /// untouched.
    #[tokio::test]
    async fn the_budget_closes_the_client_that_read_nothing_longest_first() {
        let hub = Hub::new(
            QueueLimits {
                soft_bytes: 1 << 30,
                hard_bytes: 1 << 30,
                grace: Duration::from_secs(10),
            },
            10,
        );
        let clients: Vec<_> = (0..3)
            .map(|_| {
                let c = hub.new_client();
                c.set_access(crate::policy::Access::unrestricted());
                hub.admit(&c, |_| Bytes::new()).unwrap();
                c
            })
            .collect();
        let _ = clients[2].next_batch().await; // the empty hello
        let pad = "p".repeat(10_000);
        let event = |n: u64| raw(json!({"n": n, "pad": pad}));
        // Client 0 is behind by 10 events, client 1 by 5, client 2 reads.
        for n in 0..10 {
            hub.publish("test.event", Some(&event(n)), None, &Audience::All);
            if n == 4 {
                let _ = clients[1].next_batch().await;
            }
            let _ = clients[2].next_batch().await;
        }
        let used = hub.queue_budget().used();
        assert!(
            used > 100_000 && used < 110_000,
            "shared events count once: {used}"
        );
        hub.set_queue_budget(used + 5_000);
        hub.publish("test.event", Some(&event(10)), None, &Audience::All);
        assert!(clients[0].is_closing(), "it never read");
        assert!(!clients[1].is_closing() && !clients[2].is_closing());
        assert_eq!(hub.stats.slow_closes.load(Ordering::Relaxed), 1);
        assert!(!hub.queue_budget().is_over());
        let batch = clients[0].next_batch().await;
        assert!(matches!(&batch[..], [Outgoing::Close(1008, r)] if r == "slow consumer"));
    }

    /// Bytes held outside the queues (here a writer's batch mid-write) keep
    /// the budget over after the one large backlog is closed: the clients
    /// that keep up, each with one small event queued, stay open (before:
    /// reading clients with a 106-byte backlog were closed).
    #[tokio::test]
    async fn the_budget_never_closes_a_client_that_keeps_up() {
        let hub = Hub::new(
            QueueLimits {
                soft_bytes: 1 << 20,
                hard_bytes: 1 << 30,
                grace: Duration::from_secs(10),
            },
            10,
        );
        let clients: Vec<_> = (0..3)
            .map(|_| {
                let c = hub.new_client();
                c.set_access(crate::policy::Access::unrestricted());
                hub.admit(&c, |_| Bytes::new()).unwrap();
                c
            })
            .collect();
        let (busy, stalled, reader) = (&clients[0], &clients[1], &clients[2]);
        for c in &clients {
            let _ = c.next_batch().await; // the empty hello
        }
        let pad = "p".repeat(100_000);
        for n in 0..10 {
            hub.publish(
                "test.event",
                Some(&raw(json!({"n": n, "pad": pad}))),
                None,
                &Audience::All,
            );
            let _ = reader.next_batch().await;
        }
        // The busy client's writer holds all ten, mid-write.
        let mut held = Vec::new();
        while busy.queued_bytes() > 0 {
            held.extend(busy.next_batch().await);
        }
        assert_eq!(held.len(), 10);
        hub.set_queue_budget(hub.queue_budget().used() - 5_000);
        hub.publish(
            "test.event",
            Some(&raw(json!({"n": 10}))),
            None,
            &Audience::All,
        );
        assert!(stalled.is_closing(), "the large backlog is closed");
        assert!(hub.queue_budget().is_over(), "the batch is still held");
        assert!(!reader.is_closing(), "one small event queued: keeping up");
        assert!(!busy.is_closing(), "one small event queued: keeping up");
        assert_eq!(hub.stats.slow_closes.load(Ordering::Relaxed), 1);
        drop(held);
    }

    /// A watched queue (a HUD stream's request tap) gets no events, and its
    /// backlog is shed and swept like a client's.
    #[tokio::test]
    async fn watched_queues_are_shed_and_swept() {
        let hub = Hub::new(
            QueueLimits {
                soft_bytes: 1 << 20,
                hard_bytes: 8 << 20,
                grace: Duration::from_secs(10),
            },
            2,
        );
        let reader = hub.new_client();
        reader.set_access(crate::policy::Access::unrestricted());
        hub.admit(&reader, |_| Bytes::new()).unwrap();
        let _ = reader.next_batch().await;
        let tap = hub.new_client_of_kind(ClientKind::Sse);
        hub.watch(&tap);
        for _ in 0..20 {
            assert!(tap.push_frame(Bytes::from(vec![b' '; 100_000])));
        }
        hub.set_queue_budget(1 << 20);
        hub.publish("test.event", Some(&raw(json!({}))), None, &Audience::All);
        assert!(tap.is_closing(), "the tap's backlog was shed");
        assert!(!reader.is_closing());
        assert!(!hub.queue_budget().is_over());
        let batch = reader.next_batch().await;
        assert_eq!(batch.len(), 1, "the reader got the event, the tap none");
        let stalled = hub.new_client_of_kind(ClientKind::Sse);
        hub.watch(&stalled);
        assert!(stalled.push_frame(Bytes::from_static(b"request")));
        let t0 = std::time::Instant::now();
        hub.sweep_stalled(t0);
        hub.sweep_stalled(t0 + Duration::from_secs(11));
        assert!(stalled.is_closing(), "no progress within the grace");
        hub.remove(stalled.id);
        hub.remove(tap.id);
    }

    /// With many clients that do not read and small events, the queues'
    /// slots outweigh the shared events: they count, so the budget closes
    /// backlogs instead of letting slots grow with every event (before:
    /// 980 stalled clients × 50,000 events of 1 KiB reached 1.2 GiB of RSS
    /// against a 256 MiB budget that counted only the shared events).
    #[tokio::test]
    async fn many_small_events_to_stalled_clients_stay_within_the_budget() {
        let hub = Hub::new(
            QueueLimits {
                soft_bytes: 1 << 20,
                hard_bytes: 50 << 20,
                grace: Duration::from_secs(3600),
            },
            200,
        );
        let limit = 2 << 20;
        hub.set_queue_budget(limit);
        let clients: Vec<_> = (0..100)
            .map(|_| {
                let c = hub.new_client();
                c.set_access(crate::policy::Access::unrestricted());
                hub.admit(&c, |_| Bytes::new()).unwrap();
                c
            })
            .collect();
        let pad = "p".repeat(100);
        for n in 0..20_000u32 {
            hub.publish(
                "test.event",
                Some(&raw(json!({"n": n, "pad": pad}))),
                None,
                &Audience::All,
            );
            let used = hub.queue_budget().used();
            assert!(used <= limit, "event {n}: {used} counted, budget {limit}");
            // What the queues really hold: their slots (and the events,
            // shared, at most `n` of them).
            let slots: usize = clients.iter().map(|c| c.slot_bytes()).sum();
            assert!(
                slots <= used,
                "event {n}: the queues hold {slots} bytes of slots, the budget counts {used}"
            );
        }
        let closed = clients.iter().filter(|c| c.is_closing()).count();
        assert!(closed >= 90, "backlogs were closed, not grown: {closed}");
        assert!(hub.stats.slow_closes.load(Ordering::Relaxed) >= 90);
        drop(clients);
        for id in 1..=100 {
            hub.remove(id);
        }
        assert_eq!(hub.queue_budget().used(), 0, "all given back");
    }
}
