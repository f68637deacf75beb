//! The request path into a gateway session: a bounded queue, and the write
//! itself done by whoever queued a request, when the socket is free.
//!
//! A local client's task that queues a request writes it to the gateway's
//! socket itself when no one else is writing and the write completes at
//! once (the common case: a socket with room). A request then costs no
//! hand-off to the connector's task, which the benchmark's profile showed
//! as the broker's largest cost over a bare relay: a wake-up of that task
//! per request, often of the runtime's other worker thread too, and a
//! second read of the gateway socket by the woken task.
//!
//! Whatever cannot be written at once (the socket is full, or another
//! thread holds its lock for a moment) is left to the connector's writer,
//! which waits on the socket with the write timeout as before. Order is
//! kept: the queue and the socket are taken under one lock, and whoever
//! holds the socket drains the queue before giving it back.
//!
//! Hand-written: a combining writer over a `Sink`, which no crate offers.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::stream::SplitSink;
use futures_util::{Sink, SinkExt};
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::handshake::Ws;
use super::Outbound;

/// The writing half of a gateway session's socket.
pub(crate) type UpSink = SplitSink<Ws, Message>;

/// Requests written per flush at most by the connector's writer.
const WRITE_BATCH: usize = 64;

/// How long the end of a session waits for its socket to come back from a
/// writer (who never holds it across a wait: this is a safety bound).
const UNINSTALL_WAIT: Duration = Duration::from_secs(1);

/// The socket, held by the connector's writer: back in the slot on drop.
struct Held<'a> {
    outlet: &'a Outlet,
    sink: Option<UpSink>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            self.outlet.lock().sink = Some(sink);
            self.outlet.returned.notify_one();
        }
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<Outbound>,
    /// The open session's socket while no one is writing to it.
    sink: Option<UpSink>,
    /// The generation of the open session (requests for another are dropped).
    generation: u64,
    /// A session is open: its socket may be taken to write. Once it ends, a
    /// writer still holding the socket gives it back for the close frame
    /// and no one takes it again (requests queued meanwhile wait for the
    /// next session, never go to the old socket).
    open: bool,
    /// A write could not complete at once: until the connector's writer has
    /// finished it, only that writer (which can wait) writes.
    waiting: bool,
}

/// Why the connector's writer stopped.
pub(crate) enum WriterEnd {
    /// A write did not complete within the write timeout.
    Stalled(Duration),
    Failed(WsError),
}

/// What a write that must not wait managed.
enum Now {
    /// Everything written and flushed.
    Done,
    /// Not finished (the socket is full, its lock taken, or it failed): the
    /// requests not taken are returned, and the connector's writer finishes.
    Unfinished(VecDeque<Outbound>),
}

/// The queue of requests to one upstream session, shared by the handle
/// (which queues and writes through) and the connector (which installs the
/// socket of each session and finishes what cannot be written at once).
pub(crate) struct Outlet {
    state: Mutex<State>,
    /// Wakes the connector's writer: a write for it to finish.
    wake: Notify,
    /// Wakes the connector waiting at the session's end for the socket.
    returned: Notify,
    capacity: usize,
}

impl std::fmt::Debug for Outlet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outlet")
            .field("queued", &self.lock().queue.len())
            .finish()
    }
}

/// The queue holds `capacity` requests already.
pub(crate) struct Full;

impl Outlet {
    pub fn new(capacity: usize) -> Self {
        Outlet {
            state: Mutex::default(),
            wake: Notify::new(),
            returned: Notify::new(),
            capacity,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `out` and, if the socket is free, writes what is queued now,
    /// on the caller's thread, without waiting.
    pub fn push(&self, out: Outbound) -> Result<(), Full> {
        let mut st = self.lock();
        if st.queue.len() >= self.capacity {
            return Err(Full);
        }
        st.queue.push_back(out);
        // Someone holds the socket (they drain the queue before giving it
        // back), the connector's writer is finishing a write (it drains
        // after), or no session is open (its writer drains at the start).
        if st.waiting || !st.open {
            return Ok(());
        }
        let Some(sink) = st.sink.take() else {
            return Ok(());
        };
        self.write_through(st, sink);
        Ok(())
    }

    /// Writes the queue into `sink` until it is empty or a write would wait;
    /// then gives the socket back (and, if unfinished, wakes the writer).
    fn write_through<'a>(&'a self, mut st: MutexGuard<'a, State>, mut sink: UpSink) {
        loop {
            let generation = st.generation;
            let batch = std::mem::take(&mut st.queue);
            drop(st);
            let now = write_now(&mut sink, batch, generation);
            st = self.lock();
            let unfinished = match now {
                Now::Done => false,
                Now::Unfinished(mut rest) => {
                    // What was not taken goes first, before anything queued since.
                    rest.append(&mut st.queue);
                    st.queue = rest;
                    true
                }
            };
            if st.open && !unfinished && !st.queue.is_empty() {
                continue;
            }
            // Done, or the connector's writer finishes, or the session ended
            // meanwhile (the socket goes back for its close frame; what was
            // queued waits for the next session).
            st.sink = Some(sink);
            let tell = if !st.open {
                Some(&self.returned)
            } else if unfinished {
                st.waiting = true;
                Some(&self.wake)
            } else {
                None
            };
            drop(st);
            if let Some(notify) = tell {
                notify.notify_one();
            }
            return;
        }
    }

    /// A session opened: its socket, its generation.
    pub fn install(&self, sink: UpSink, generation: u64) {
        let mut st = self.lock();
        st.sink = Some(sink);
        st.generation = generation;
        st.open = true;
        // Requests queued while it was opening (a narrower session queues
        // them) are written by the connector's writer as it starts.
        st.waiting = !st.queue.is_empty();
    }

    /// The session ended: its socket back, for the close frame. A writer
    /// holding it gives it back promptly (a requester's write never waits;
    /// the connector's writer is dropped first and returns it on drop); the
    /// wait is bounded all the same.
    pub async fn uninstall(&self) -> Option<UpSink> {
        let wait = async {
            loop {
                let returned = self.returned.notified();
                tokio::pin!(returned);
                returned.as_mut().enable();
                {
                    let mut st = self.lock();
                    st.open = false;
                    st.waiting = false;
                    if let Some(sink) = st.sink.take() {
                        return sink;
                    }
                }
                returned.await;
            }
        };
        tokio::time::timeout(UNINSTALL_WAIT, wait).await.ok()
    }

    /// The connector's writer for one session: finishes what could not be
    /// written at once, waiting on the socket for at most `write_timeout`.
    /// Returns only when a write failed or made no progress in time.
    pub async fn writer(&self, write_timeout: Duration) -> WriterEnd {
        loop {
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let job = {
                let mut st = self.lock();
                if st.waiting {
                    // Taken from the slot; a writer holding it gives it back soon.
                    st.sink.take().map(|sink| (sink, st.generation))
                } else {
                    None
                }
            };
            let Some((sink, generation)) = job else {
                notified.await;
                continue;
            };
            // Given back to the slot however this future ends (it is
            // dropped mid-write when the session ends for another reason).
            let mut held = Held {
                outlet: self,
                sink: Some(sink),
            };
            loop {
                let batch: Vec<Outbound> = {
                    let mut st = self.lock();
                    let n = st.queue.len().min(WRITE_BATCH);
                    st.queue.drain(..n).collect()
                };
                let sink = held.sink.as_mut().expect("held until dropped");
                let write = async {
                    for out in batch.into_iter().filter(|o| o.generation == generation) {
                        sink.feed(Message::text(out.text)).await?;
                    }
                    sink.flush().await
                };
                match tokio::time::timeout(write_timeout, write).await {
                    Err(_) => return WriterEnd::Stalled(write_timeout),
                    Ok(Err(e)) => return WriterEnd::Failed(e),
                    Ok(Ok(())) => {}
                }
                let mut st = self.lock();
                if st.queue.is_empty() {
                    st.waiting = false;
                    st.sink = held.sink.take();
                    break;
                }
            }
        }
    }

    /// The first request queued, taken (tests look at what would be written).
    #[cfg(test)]
    pub fn pop_queued(&self) -> Option<Outbound> {
        self.lock().queue.pop_front()
    }
}

/// Writes `batch` and flushes, never waiting: every poll is made with a
/// waker that does nothing, and a `Pending` hands the rest to the
/// connector's writer, which polls again with its own.
fn write_now(sink: &mut UpSink, mut batch: VecDeque<Outbound>, generation: u64) -> Now {
    let mut cx = Context::from_waker(Waker::noop());
    let mut sink = Pin::new(sink);
    while let Some(out) = batch.pop_front() {
        if out.generation != generation {
            continue;
        }
        match sink.as_mut().poll_ready(&mut cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(_)) | Poll::Pending => {
                batch.push_front(out);
                return Now::Unfinished(batch);
            }
        }
        if sink.as_mut().start_send(Message::text(out.text)).is_err() {
            return Now::Unfinished(batch);
        }
    }
    match sink.as_mut().poll_flush(&mut cx) {
        Poll::Ready(Ok(())) => Now::Done,
        Poll::Ready(Err(_)) | Poll::Pending => Now::Unfinished(batch),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use futures_util::stream::SplitStream;
    use futures_util::StreamExt;
    use tokio::net::UnixStream;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::WebSocketStream;

    /// A session's socket: the broker's writing and reading halves, and the
    /// gateway's end.
    async fn session() -> (UpSink, SplitStream<Ws>, WebSocketStream<UnixStream>) {
        let (a, b) = UnixStream::pair().unwrap();
        let io: Box<dyn super::super::UpstreamIo> = Box::new(a);
        let ws = WebSocketStream::from_raw_socket(io, Role::Client, None).await;
        let gateway = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let (sink, stream) = ws.split();
        (sink, stream, gateway)
    }

    /// An outlet with session 7's socket installed, and the gateway's end
    /// (and the reading half the connector would hold).
    async fn pair() -> (Arc<Outlet>, WebSocketStream<UnixStream>, SplitStream<Ws>) {
        let (sink, stream, gateway) = session().await;
        let outlet = Arc::new(Outlet::new(1024));
        outlet.install(sink, 7);
        (outlet, gateway, stream)
    }

    /// The connector's writer, running.
    fn spawn_writer(outlet: &Arc<Outlet>) -> tokio::task::JoinHandle<WriterEnd> {
        let outlet = Arc::clone(outlet);
        tokio::spawn(async move { outlet.writer(Duration::from_secs(5)).await })
    }

    /// Queues 64 KiB requests until one cannot be written at once (the
    /// gateway reads nothing); returns how many were queued.
    fn fill(outlet: &Outlet) -> usize {
        let big = "x".repeat(64 * 1024);
        let mut sent = 0;
        while !outlet.lock().waiting {
            assert!(sent < 512, "the socket never filled");
            outlet.push(out(7, format!("{sent}:{big}"))).ok().unwrap();
            sent += 1;
        }
        sent
    }

    fn out(generation: u64, text: String) -> Outbound {
        Outbound { generation, text }
    }

    async fn next_text(gateway: &mut WebSocketStream<UnixStream>) -> String {
        let msg = tokio::time::timeout(Duration::from_secs(5), gateway.next())
            .await
            .expect("a frame in time")
            .expect("open")
            .expect("a frame");
        msg.into_text().unwrap().to_string()
    }

    /// The caller writes: no writer task runs, and the request arrives.
    #[tokio::test]
    async fn a_request_is_written_by_its_caller_when_the_socket_is_free() {
        let (outlet, mut gateway, _reader) = pair().await;
        assert!(outlet.push(out(7, "one".into())).is_ok());
        assert!(outlet.push(out(6, "stale".into())).is_ok());
        assert!(outlet.push(out(7, "two".into())).is_ok());
        assert_eq!(next_text(&mut gateway).await, "one");
        assert_eq!(
            next_text(&mut gateway).await,
            "two",
            "another generation's is dropped"
        );
        assert!(!outlet.lock().waiting);
        assert!(outlet.lock().sink.is_some(), "the socket is given back");
    }

    /// A full socket: the caller hands over, the writer finishes, in order.
    #[tokio::test]
    async fn what_cannot_be_written_at_once_is_finished_by_the_writer_in_order() {
        let (outlet, mut gateway, _reader) = pair().await;
        let mut sent = fill(&outlet);
        // Queued behind the unfinished write, never ahead of it.
        for _ in 0..3 {
            outlet.push(out(7, format!("{sent}:"))).ok().unwrap();
            sent += 1;
        }
        let writer = spawn_writer(&outlet);
        for i in 0..sent {
            let text = next_text(&mut gateway).await;
            assert!(text.starts_with(&format!("{i}:")), "request {i} in order");
        }
        assert!(!outlet.lock().waiting, "the writer finished");
        writer.abort();
    }

    /// A gateway that stops reading: the writer gives up after the timeout.
    #[tokio::test]
    async fn a_gateway_that_stops_reading_stalls_the_writer() {
        let (outlet, _gateway, _reader) = pair().await;
        fill(&outlet);
        let end = tokio::time::timeout(
            Duration::from_secs(5),
            outlet.writer(Duration::from_millis(100)),
        )
        .await
        .expect("the writer gives up in time");
        assert!(matches!(end, WriterEnd::Stalled(_)));
        assert!(
            outlet.uninstall().await.is_some(),
            "the socket is back for the close"
        );
    }

    /// A session that ended: requests queued afterwards are not written to
    /// its socket; the next session's writer sends them.
    #[tokio::test]
    async fn requests_after_a_session_ended_wait_for_the_next() {
        let (outlet, _old_gateway, _reader) = pair().await;
        assert!(outlet.uninstall().await.is_some(), "the socket is back");
        outlet.push(out(8, "next".into())).ok().unwrap();
        assert_eq!(outlet.lock().queue.len(), 1, "kept for the next session");
        let (sink, _reader, mut gateway) = session().await;
        outlet.install(sink, 8);
        let writer = spawn_writer(&outlet);
        assert_eq!(next_text(&mut gateway).await, "next");
        writer.abort();
    }

    /// The connector's writer dropped mid-write (its session ended for
    /// another reason) gives the socket back for the close frame.
    #[tokio::test]
    async fn a_writer_dropped_mid_write_gives_the_socket_back() {
        let (outlet, _gateway, _reader) = pair().await;
        fill(&outlet);
        let stuck = tokio::time::timeout(
            Duration::from_millis(50),
            outlet.writer(Duration::from_secs(60)),
        )
        .await;
        assert!(stuck.is_err(), "the gateway reads nothing: the write waits");
        let sink = tokio::time::timeout(Duration::from_secs(5), outlet.uninstall())
            .await
            .expect("at once");
        assert!(sink.is_some(), "the socket is back for the close");
    }

    /// The queue is bounded.
    #[tokio::test]
    async fn a_full_queue_refuses() {
        let outlet = Outlet::new(2);
        assert!(outlet.push(out(1, "a".into())).is_ok());
        assert!(outlet.push(out(1, "b".into())).is_ok());
        assert!(outlet.push(out(1, "c".into())).is_err());
    }
}
