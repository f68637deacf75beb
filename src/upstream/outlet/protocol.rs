//! The outlet's protocol with no socket and no runtime inside: who may hold
//! the gateway socket, when a request is written, refused or withdrawn, and
//! when a socket goes back into the slot. [`super::Outlet`] runs it over a
//! `std::sync::Mutex` and a real socket; the loom model (`model.rs`) runs
//! the same functions over loom's mutex and a recording socket, through
//! every interleaving of a few requesters, the connector's writer and a
//! session's end.
//!
//! Each request's fate is decided once, under the lock:
//! - **refused** at [`push`] (its generation is closed, or the queue is
//!   full): never queued, answered by the caller as not sent;
//! - **withdrawn** ([`State::withdraw`], [`State::close`]): taken out of the
//!   queue before it was written, answered as not sent;
//! - **taken** for writing (by a requester writing through, or the writer):
//!   from then on it counts as sent. A batch that could not be finished is
//!   put back in front of the queue, unless its generation was closed
//!   meanwhile: the close answered it as "may have been sent", and it is
//!   then dropped, never written after that answer.

use std::collections::VecDeque;
use std::ops::DerefMut;

use crate::upstream::Outbound;

/// A socket that writes without waiting.
pub(crate) trait TrySink {
    /// Writes from the front of `batch` what it can without waiting (each
    /// request written is removed from `batch`) and flushes; true when all
    /// of it was written and flushed.
    fn try_write(&mut self, batch: &mut VecDeque<Outbound>) -> bool;
}

/// The lock the protocol's state lives under.
pub(crate) trait Guarded<S> {
    type Guard<'a>: DerefMut<Target = State<S>>
    where
        Self: 'a;
    fn lock(&self) -> Self::Guard<'_>;
}

impl<S> Guarded<S> for std::sync::Mutex<State<S>> {
    type Guard<'a>
        = std::sync::MutexGuard<'a, State<S>>
    where
        S: 'a;
    fn lock(&self) -> Self::Guard<'_> {
        std::sync::Mutex::lock(self).unwrap_or_else(|p| p.into_inner())
    }
}

/// How many requests and bytes may wait in the queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub frames: usize,
    /// Bytes of queued requests; one request is always admitted into an
    /// empty queue, however large (it is bounded by the frame limit).
    pub bytes: usize,
}

/// Why a request was not queued. Either way it was never written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue holds its limit of requests or bytes.
    Full,
    /// Its session has ended, or the attempt that would have opened it failed.
    Closed,
}

/// Whom to wake once the lock is let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tell {
    Nobody,
    /// The connector's writer: a write is left for it to finish.
    Writer,
    /// The session's end, waiting for the socket to send its close frame.
    Closer,
}

/// The queue of requests to one gateway session and its socket's slot.
#[derive(Debug)]
pub(crate) struct State<S> {
    queue: VecDeque<Outbound>,
    queued_bytes: usize,
    /// The open session's socket while no one is writing to it.
    sink: Option<S>,
    /// The generation of the installed session.
    generation: u64,
    /// Every generation up to this one is over (its session ended or its
    /// attempt failed): requests for it are refused, never queued.
    /// Generations only grow (each attempt takes a new one), so a closed
    /// generation never opens.
    closed_through: u64,
    /// The installed session is open: its socket may be taken to write.
    open: bool,
    /// A write could not complete at once: until the connector's writer
    /// has finished it, only that writer (which can wait) writes.
    waiting: bool,
    limits: Limits,
}

impl<S> State<S> {
    pub fn new(limits: Limits) -> Self {
        State {
            queue: VecDeque::new(),
            queued_bytes: 0,
            sink: None,
            generation: 0,
            closed_through: 0,
            open: false,
            waiting: false,
            limits,
        }
    }

    /// Requests queued, and their bytes.
    pub fn queued(&self) -> (usize, usize) {
        (self.queue.len(), self.queued_bytes)
    }

    #[cfg(test)]
    pub fn is_waiting(&self) -> bool {
        self.waiting
    }

    #[cfg(test)]
    pub fn has_sink(&self) -> bool {
        self.sink.is_some()
    }

    pub fn admit(&mut self, out: Outbound) -> Result<(), (Refused, Outbound)> {
        if out.generation <= self.closed_through {
            return Err((Refused::Closed, out));
        }
        let len = out.text.len();
        if self.queue.len() >= self.limits.frames
            || (!self.queue.is_empty() && self.queued_bytes + len > self.limits.bytes)
        {
            return Err((Refused::Full, out));
        }
        self.queued_bytes += len;
        self.queue.push_back(out);
        Ok(())
    }

    /// Takes up to `max` queued requests for writing on `generation`'s
    /// socket. Only requests of the installed generation are ever queued
    /// while it is open (older ones are refused, a newer one cannot be
    /// attempted before it closes), so none is skipped.
    fn take(&mut self, max: usize) -> VecDeque<Outbound> {
        let n = self.queue.len().min(max);
        let batch: VecDeque<Outbound> = self.queue.drain(..n).collect();
        self.queued_bytes -= batch.iter().map(|o| o.text.len()).sum::<usize>();
        batch
    }

    /// Puts an unfinished batch back in front of the queue; requests whose
    /// generation closed meanwhile are dropped (see the module's note).
    fn put_back(&mut self, mut rest: VecDeque<Outbound>) {
        rest.retain(|o| o.generation > self.closed_through);
        self.queued_bytes += rest.iter().map(|o| o.text.len()).sum::<usize>();
        rest.append(&mut self.queue);
        self.queue = rest;
    }

    /// Gives back the socket taken under `generation`. A socket of an older
    /// generation is never put over a newer session's: it is dropped.
    fn give_back(&mut self, sink: S, generation: u64, unfinished: bool) -> Tell {
        if generation != self.generation {
            return Tell::Nobody;
        }
        self.sink = Some(sink);
        if !self.open {
            Tell::Closer
        } else if unfinished {
            self.waiting = true;
            Tell::Writer
        } else {
            Tell::Nobody
        }
    }

    /// A session opened: its socket and its generation. Requests queued
    /// for it while it was opening are left to the connector's writer.
    pub fn install(&mut self, sink: S, generation: u64) {
        debug_assert!(
            generation > self.closed_through,
            "a closed generation never opens"
        );
        self.sink = Some(sink);
        self.generation = generation;
        self.open = true;
        self.waiting = !self.queue.is_empty();
    }

    /// Closes every generation up to `generation` (its session ended, or
    /// its attempt failed): requests for it are refused from now on, and
    /// those still queued are withdrawn. Returns their upstream ids: they
    /// were never written.
    pub fn close(&mut self, generation: u64) -> Vec<String> {
        self.closed_through = self.closed_through.max(generation);
        if self.generation <= generation {
            self.open = false;
            self.waiting = false;
        }
        let closed = self.closed_through;
        let mut withdrawn = Vec::new();
        let mut bytes = 0;
        self.queue.retain(|o| {
            let keep = o.generation > closed;
            if !keep {
                bytes += o.text.len();
                withdrawn.push(o.id.clone());
            }
            keep
        });
        self.queued_bytes -= bytes;
        withdrawn
    }

    /// The socket of `generation`'s session, once no one writes to it (for
    /// its close frame).
    pub fn take_closed_sink(&mut self, generation: u64) -> Option<S> {
        if self.generation == generation {
            self.sink.take()
        } else {
            None
        }
    }

    /// Takes request `id` out of the queue if it has not been taken for
    /// writing: true means it will never be written.
    pub fn withdraw(&mut self, id: &str) -> bool {
        match self.queue.iter().position(|o| o.id == id) {
            Some(i) => {
                if let Some(o) = self.queue.remove(i) {
                    self.queued_bytes -= o.text.len();
                }
                true
            }
            None => false,
        }
    }

    /// The connector's writer takes the socket when a write is left for it.
    pub fn writer_take(&mut self) -> Option<(S, u64)> {
        if self.waiting {
            self.sink.take().map(|sink| (sink, self.generation))
        } else {
            None
        }
    }

    /// The writer's next batch of at most `max`.
    pub fn writer_batch(&mut self, max: usize) -> VecDeque<Outbound> {
        self.take(max)
    }

    /// The writer wrote a batch: it gives the socket back (true) once the
    /// queue is empty, or keeps writing (false, the socket stays with it).
    pub fn writer_done(&mut self, held: &mut Option<S>, generation: u64) -> bool {
        if !self.queue.is_empty() && self.open && self.generation == generation {
            return false;
        }
        self.waiting = false;
        if let Some(sink) = held.take() {
            self.give_back(sink, generation, false);
        }
        true
    }

    /// The writer was dropped with these still in its batch (never handed
    /// to the socket): back at the front of the queue, in order.
    pub fn writer_unfinished(&mut self, left: VecDeque<Outbound>) {
        self.put_back(left);
    }

    /// The writer let go of the socket mid-write (it was dropped): back in
    /// the slot if its session is still the installed one.
    pub fn writer_dropped(&mut self, sink: S, generation: u64) -> Tell {
        self.give_back(sink, generation, false)
    }
}

/// Queues `out` and, if the socket is free, writes what is queued now on
/// the caller's thread, without waiting. Returns whom to wake, or the
/// request back with why it was refused.
pub(crate) fn push<G, S>(outlet: &G, out: Outbound) -> Result<Tell, (Refused, Outbound)>
where
    G: Guarded<S>,
    S: TrySink,
{
    let mut st = outlet.lock();
    st.admit(out)?;
    Ok(flush_locked(outlet, st))
}

/// Writes what is queued now if the socket is free, on the caller's
/// thread, without waiting. Returns whom to wake.
pub(crate) fn flush<G, S>(outlet: &G) -> Tell
where
    G: Guarded<S>,
    S: TrySink,
{
    flush_locked(outlet, outlet.lock())
}

fn flush_locked<'a, G, S>(outlet: &'a G, mut st: G::Guard<'a>) -> Tell
where
    G: Guarded<S>,
    S: TrySink,
{
    // Someone holds the socket (they drain the queue before giving it
    // back), the writer is finishing a write (it drains after), or no
    // session is open (its writer drains at the start).
    if st.waiting || !st.open || st.queue.is_empty() {
        return Tell::Nobody;
    }
    let Some(sink) = st.sink.take() else {
        return Tell::Nobody;
    };
    let generation = st.generation;
    drop(st);
    write_through(outlet, sink, generation)
}

/// Writes the queue into `sink` until it is empty or a write would wait,
/// then gives the socket back (see [`State::give_back`]).
fn write_through<G, S>(outlet: &G, mut sink: S, generation: u64) -> Tell
where
    G: Guarded<S>,
    S: TrySink,
{
    let mut st = outlet.lock();
    loop {
        let mut batch = st.take(usize::MAX);
        drop(st);
        let done = sink.try_write(&mut batch);
        st = outlet.lock();
        if !done {
            st.put_back(batch);
        }
        if done && st.open && st.generation == generation && !st.queue.is_empty() {
            continue;
        }
        return st.give_back(sink, generation, !done);
    }
}

#[cfg(test)]
impl<S> State<S> {
    /// Marks a write as left for the writer (tests take the writer's part).
    pub fn install_waiting_for_test(&mut self) {
        self.waiting = true;
    }
}
