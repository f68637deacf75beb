//! The wait a handover does for an event stream's chunks
//! ([`super::Drained`]) model-checked with loom: hyper letting go of chunks
//! on other threads while the handover's task waits, over the very
//! functions the stream uses ([`super::let_go`], [`super::poll_all_written`]),
//! with loom's atomic count and loom's `AtomicWaker` (the waiting task
//! really sleeps: a lost wake-up is a deadlock loom reports).
//!
//! - `the_wait_ends_once_every_chunk_is_written`: however the drops
//!   interleave with the wait, the wait ends, and only when nothing is held.

use std::future::poll_fn;
use std::sync::Arc;

use loom::future::{block_on, AtomicWaker};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use super::{let_go, poll_all_written, Held};

#[derive(Default)]
struct Cell {
    bytes: AtomicUsize,
    waker: AtomicWaker,
}

impl Held for Cell {
    fn add(&self, n: usize) {
        self.bytes.fetch_add(n, Ordering::AcqRel);
    }

    fn sub(&self, n: usize) -> usize {
        let before = self.bytes.fetch_sub(n, Ordering::AcqRel);
        assert!(before >= n, "let go of more than was held");
        before
    }

    fn load(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    fn register(&self, waker: &std::task::Waker) {
        self.waker.register_by_ref(waker);
    }

    fn wake(&self) {
        self.waker.wake();
    }
}

#[test]
fn the_wait_ends_once_every_chunk_is_written() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = builder.preemption_bound.or(Some(3));
    builder.check(|| {
        let held = Arc::new(Cell::default());
        // Two chunks taken by hyper before the handover waits.
        held.add(3);
        held.add(5);
        let writers: Vec<_> = [3, 5]
            .into_iter()
            .map(|n| {
                let held = Arc::clone(&held);
                thread::spawn(move || let_go(&*held, n))
            })
            .collect();
        block_on(poll_fn(|cx| poll_all_written(&*held, cx)));
        assert_eq!(held.load(), 0, "the wait ended with a chunk held");
        for w in writers {
            w.join().unwrap();
        }
    });
}
