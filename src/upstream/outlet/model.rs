//! The outlet's protocol model-checked with loom: every interleaving of a
//! few requesters writing through, the connector's writer, a session's end
//! and the next session's start, run over the very functions the outlet
//! uses (`protocol.rs`), with loom's mutex and a socket that records what
//! it is given. What each model proves:
//!
//! - `fates_are_decided_once`: a request is written, or refused/withdrawn
//!   (answered as not sent), never both, never twice; one requester's
//!   requests are written in the order it queued them; a socket only ever
//!   receives requests of its own generation; a write left for the writer
//!   always wakes it (no lost wake-up); nothing stays queued unwritten on
//!   an open session once the writer has run.
//! - `a_failed_attempt_never_writes_its_requests`: requests queued for an
//!   attempt that fails are refused or withdrawn, and the next session,
//!   which has a new generation, never writes them (the "runs twice").
//! - `an_old_socket_is_never_put_back`: a writer giving back the socket of
//!   an ended session never puts it over the next session's.

use std::collections::VecDeque;
use std::sync::Mutex as StdMutex;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

use super::protocol::{push, Guarded, Limits, Refused, State, Tell, TrySink};
use crate::upstream::Outbound;

impl<S> Guarded<S> for Mutex<State<S>> {
    type Guard<'a>
        = loom::sync::MutexGuard<'a, State<S>>
    where
        S: 'a;
    fn lock(&self) -> Self::Guard<'_> {
        Mutex::lock(self).unwrap()
    }
}

/// What every socket was given: (socket's generation, request id).
type Log = std::sync::Arc<StdMutex<Vec<(u64, String)>>>;

/// A socket that takes one request per call and then reports "would wait"
/// if more are left, so that both the write-through and the writer's path
/// are taken.
struct Recording {
    generation: u64,
    log: Log,
}

impl TrySink for Recording {
    fn try_write(&mut self, batch: &mut VecDeque<Outbound>) -> bool {
        if let Some(out) = batch.pop_front() {
            assert_eq!(
                out.generation, self.generation,
                "a socket got another generation's request"
            );
            self.log.lock().unwrap().push((self.generation, out.id));
        }
        batch.is_empty()
    }
}

fn out(generation: u64, id: &str) -> Outbound {
    Outbound {
        generation,
        id: id.to_owned(),
        text: id.to_owned(),
    }
}

type Outlet = Arc<Mutex<State<Recording>>>;

fn outlet() -> Outlet {
    Arc::new(Mutex::new(State::new(Limits {
        frames: 8,
        bytes: 1 << 20,
    })))
}

fn sink(generation: u64, log: &Log) -> Recording {
    Recording {
        generation,
        log: std::sync::Arc::clone(log),
    }
}

/// Pushes, recording a refusal and whether the writer was told.
fn push_recorded(o: &Outlet, out: Outbound, refused: &StdMutex<Vec<String>>, woken: &AtomicBool) {
    let id = out.id.clone();
    match push(&**o, out) {
        Ok(Tell::Writer) => woken.store(true, Ordering::SeqCst),
        Ok(_) => {}
        Err((Refused::Closed | Refused::Full, _)) => refused.lock().unwrap().push(id),
    }
}

/// The connector's writer, run to the end of what is left for it (its
/// socket write never waits here).
fn run_writer(o: &Outlet) {
    let Some((mut sink, generation)) = o.lock().unwrap().writer_take() else {
        return;
    };
    let mut held = None;
    loop {
        let mut batch = o.lock().unwrap().writer_batch(64);
        while !batch.is_empty() {
            sink.try_write(&mut batch);
        }
        held = held.or(Some(sink));
        if o.lock().unwrap().writer_done(&mut held, generation) {
            return;
        }
        sink = held.take().expect("kept while writing");
    }
}

/// Runs `f` under loom with a bounded number of preemptions per execution
/// (tokio's own models use 2–3): every interleaving with at most that many
/// forced switches is explored, which is where bugs of this size live, and
/// the suite stays fast.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
}

#[test]
fn fates_are_decided_once() {
    model(|| {
        let log: Log = Default::default();
        let refused = std::sync::Arc::new(StdMutex::new(Vec::new()));
        let woken = Arc::new(AtomicBool::new(false));
        let o = outlet();
        o.lock().unwrap().install(sink(1, &log), 1);

        let requester = |ids: &'static [&'static str]| {
            let (o, refused, woken) = (o.clone(), refused.clone(), woken.clone());
            thread::spawn(move || {
                for id in ids {
                    push_recorded(&o, out(1, id), &refused, &woken);
                }
            })
        };
        let a = requester(&["a1", "a2"]);
        let b = requester(&["b1"]);

        // The connector: the session ends, the next one opens.
        let withdrawn = o.lock().unwrap().close(1);
        let _old = o.lock().unwrap().take_closed_sink(1);
        o.lock().unwrap().install(sink(2, &log), 2);

        a.join().unwrap();
        b.join().unwrap();
        if o.lock().unwrap().is_waiting() {
            assert!(
                woken.load(Ordering::SeqCst),
                "a write was left but no one woke the writer"
            );
        }
        run_writer(&o);

        let written: Vec<String> = log
            .lock()
            .unwrap()
            .iter()
            .map(|(_, id)| id.clone())
            .collect();
        let refused = refused.lock().unwrap().clone();
        for id in ["a1", "a2", "b1"] {
            let times = written.iter().filter(|w| *w == id).count();
            assert!(times <= 1, "{id} written {times} times");
            let answered = refused.contains(&id.to_owned()) || withdrawn.contains(&id.to_owned());
            assert!(
                !(times == 1 && answered),
                "{id} both written and answered as not sent"
            );
        }
        let a1 = written.iter().position(|w| w == "a1");
        let a2 = written.iter().position(|w| w == "a2");
        if let (Some(a1), Some(a2)) = (a1, a2) {
            assert!(a1 < a2, "one requester's order is kept");
        }
        assert_eq!(o.lock().unwrap().queued(), (0, 0), "nothing left queued");
    });
}

#[test]
fn a_failed_attempt_never_writes_its_requests() {
    model(|| {
        let log: Log = Default::default();
        let refused = std::sync::Arc::new(StdMutex::new(Vec::new()));
        let woken = Arc::new(AtomicBool::new(false));
        let o = outlet();
        // Attempt 1 is under way: a requester queues for it, then for the
        // session after (as a client retrying would).
        let requester = {
            let (o, refused, woken) = (o.clone(), refused.clone(), woken.clone());
            thread::spawn(move || {
                push_recorded(&o, out(1, "early"), &refused, &woken);
                push_recorded(&o, out(2, "retry"), &refused, &woken);
            })
        };
        let withdrawn = o.lock().unwrap().close(1);
        o.lock().unwrap().install(sink(2, &log), 2);
        requester.join().unwrap();
        run_writer(&o);

        let log = log.lock().unwrap().clone();
        let refused = refused.lock().unwrap().clone();
        assert!(
            !log.iter().any(|(_, id)| id == "early"),
            "the failed attempt's request was written"
        );
        assert!(
            refused.contains(&"early".to_owned()) ^ withdrawn.contains(&"early".to_owned()),
            "the failed attempt's request is answered once as not sent"
        );
        assert_eq!(log, vec![(2, "retry".to_owned())], "the retry runs once");
    });
}

#[test]
fn an_old_socket_is_never_put_back() {
    model(|| {
        let log: Log = Default::default();
        let o = outlet();
        {
            let mut st = o.lock().unwrap();
            st.install(sink(1, &log), 1);
            st.install_waiting_for_test();
        }
        let (old, generation) = o.lock().unwrap().writer_take().expect("taken");
        let writer = {
            let o = o.clone();
            thread::spawn(move || {
                let _ = o.lock().unwrap().writer_dropped(old, generation);
            })
        };
        o.lock().unwrap().close(1);
        let _ = o.lock().unwrap().take_closed_sink(1);
        o.lock().unwrap().install(sink(2, &log), 2);
        writer.join().unwrap();
        let mut st = o.lock().unwrap();
        let now = st.take_closed_sink(2).expect("the slot holds a socket");
        assert_eq!(now.generation, 2, "the old socket was put over the new one");
    });
}
