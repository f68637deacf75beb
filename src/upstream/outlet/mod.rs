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

#[cfg(test)]
mod model;
mod protocol;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::stream::SplitSink;
use futures_util::{Sink, SinkExt};
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

pub use self::protocol::Refused;
use self::protocol::{Guarded, Limits, State, Tell, TrySink};
use super::handshake::Ws;
use super::Outbound;

/// The writing half of a gateway session's socket.
pub(crate) struct UpSink {
    sink: SplitSink<Ws, Message>,
    /// Where a large request is written beside tungstenite, when the
    /// socket offers it (see [`LARGE_REQUEST_BYTES`]).
    raw: Option<super::movable::RawWrites>,
}

impl UpSink {
    /// The writing half of `ws`'s socket: large requests go beside
    /// tungstenite when `raw` is given (`UpstreamIo::raw_writes`).
    pub fn new(sink: SplitSink<Ws, Message>, raw: Option<super::movable::RawWrites>) -> Self {
        UpSink { sink, raw }
    }

    /// tungstenite's half again (for a close frame, or to reunite it).
    pub fn into_inner(self) -> SplitSink<Ws, Message> {
        self.sink
    }

    /// Where `out` goes beside tungstenite, if it does.
    fn raw_for(&self, out: &Outbound) -> Option<&super::movable::RawWrites> {
        self.raw
            .as_ref()
            .filter(|_| out.text.len() > LARGE_REQUEST_BYTES)
    }
}

/// A request larger than this is framed by the outlet into a buffer of its
/// own, written beside tungstenite and freed once written: tungstenite
/// copies every frame into its write buffer first, which then keeps the
/// largest frame's size for the life of the connection (a 24 MiB request
/// kept 24 MiB). Smaller ones share tungstenite's buffer, whose normal
/// size is about twice this.
pub const LARGE_REQUEST_BYTES: usize = 64 * 1024;

/// `text` as a client's WebSocket text frame (RFC 6455 §5.2), masked with
/// a fresh random key as a client's frames must be (§5.3). Framed in place:
/// the text is masked where it is and moved up by the header's length,
/// within the room [`encode_req`](crate::protocol::frames::encode_req)
/// leaves for it, so no second buffer of its size is made.
fn masked_text_frame(text: String) -> Vec<u8> {
    let key: [u8; 4] = rand::random();
    let mut frame = text.into_bytes();
    let mut words = frame.chunks_exact_mut(4);
    for word in &mut words {
        for (b, k) in word.iter_mut().zip(key) {
            *b ^= k;
        }
    }
    for (b, k) in words.into_remainder().iter_mut().zip(key) {
        *b ^= k;
    }
    let len = frame.len();
    let (head, n) = crate::boundary::frame_header(0x81, len as u64, Some(key));
    frame.resize(len + n, 0);
    frame.copy_within(..len, n);
    frame[..n].copy_from_slice(&head[..n]);
    frame
}

/// Requests written per flush at most by the connector's writer.
const WRITE_BATCH: usize = 64;

/// How long the end of a session waits for its socket to come back from a
/// writer (who never holds it across a wait: this is a safety bound). A
/// writer that gives it back later finds a newer generation installed and
/// drops it instead.
const UNINSTALL_WAIT: Duration = Duration::from_secs(1);

/// The socket, held by the connector's writer: back in the slot on drop
/// (if its session is still the installed one).
struct Held<'a> {
    outlet: &'a Outlet,
    sink: Option<UpSink>,
    generation: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            let tell = self.outlet.st().writer_dropped(sink, self.generation);
            self.outlet.tell(tell);
        }
    }
}

/// `write`, unless the socket takes nothing of it for `timeout` (`None`):
/// a slow gateway that goes on reading is waited for, however long the
/// batch takes (up to 16 MiB of requests and a large one). Without a
/// count of what the socket took (`progress`), the whole write is bounded
/// by `timeout`.
async fn written_unless_stalled<T>(
    write: impl std::future::Future<Output = T>,
    progress: Option<&super::movable::RawWrites>,
    timeout: Duration,
) -> Option<T> {
    let mut write = std::pin::pin!(write);
    let taken = || progress.map(super::movable::RawWrites::taken);
    let look = (timeout / 4).max(Duration::from_millis(1));
    let (mut seen, mut since) = (taken(), tokio::time::Instant::now());
    loop {
        if let Ok(done) = tokio::time::timeout(look, write.as_mut()).await {
            return Some(done);
        }
        let now = taken();
        if now != seen {
            (seen, since) = (now, tokio::time::Instant::now());
        } else if since.elapsed() >= timeout {
            return None;
        }
    }
}

/// The writer's batch: a request leaves it only as the socket takes it,
/// and what it still holds goes back to the front of the queue if the
/// writer is dropped mid-write (a handover, another end of the session),
/// where it is written or withdrawn unwritten like any queued request,
/// never lost as if sent.
struct Batch<'a> {
    outlet: &'a Outlet,
    left: VecDeque<Outbound>,
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        if !self.left.is_empty() {
            self.outlet
                .st()
                .writer_unfinished(std::mem::take(&mut self.left));
        }
    }
}

/// Why the connector's writer stopped.
pub(crate) enum WriterEnd {
    /// A write did not complete within the write timeout.
    Stalled(Duration),
    Failed(WsError),
}

/// The queue of requests to one upstream session, shared by the handle
/// (which queues and writes through) and the connector (which installs the
/// socket of each session and finishes what cannot be written at once).
/// The protocol itself is in `protocol.rs`, model-checked in `model.rs`.
pub(crate) struct Outlet {
    state: Mutex<State<UpSink>>,
    /// Wakes the connector's writer: a write for it to finish.
    wake: Notify,
    /// Wakes the connector waiting at the session's end for the socket.
    returned: Notify,
}

impl std::fmt::Debug for Outlet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (queued, bytes) = self.st().queued();
        f.debug_struct("Outlet")
            .field("queued", &queued)
            .field("bytes", &bytes)
            .finish()
    }
}

impl crate::router::Withdraw for Outlet {
    fn withdraw(&self, upstream_id: &str) -> bool {
        Outlet::withdraw(self, upstream_id)
    }
}

impl TrySink for UpSink {
    /// Every poll is made with a waker that does nothing: a `Pending`
    /// hands the rest to the connector's writer, which polls again with
    /// its own.
    fn try_write(&mut self, batch: &mut VecDeque<Outbound>) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        while let Some(out) = batch.front() {
            let raw = self.raw_for(out).cloned();
            let mut sink = Pin::new(&mut self.sink);
            if let Some(raw) = raw {
                // Beside tungstenite once it holds nothing unwritten.
                match sink.as_mut().poll_flush(&mut cx) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(_)) | Poll::Pending => return false,
                }
                let Some(out) = batch.pop_front() else { break };
                raw.push(masked_text_frame(out.text));
                continue;
            }
            match sink.as_mut().poll_ready(&mut cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(_)) | Poll::Pending => return false,
            }
            let Some(out) = batch.pop_front() else { break };
            // A failed send ends the session (the reader sees it); the
            // request counts as sent: its answer is "may have run".
            if sink.as_mut().start_send(Message::text(out.text)).is_err() {
                return false;
            }
        }
        matches!(
            Pin::new(&mut self.sink).poll_flush(&mut cx),
            Poll::Ready(Ok(()))
        )
    }
}

impl Outlet {
    /// An outlet holding at most `frames` requests and `bytes` of them.
    pub fn new(frames: usize, bytes: usize) -> Self {
        Outlet {
            state: Mutex::new(State::new(Limits { frames, bytes })),
            wake: Notify::new(),
            returned: Notify::new(),
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State<UpSink>> {
        Guarded::lock(&self.state)
    }

    fn tell(&self, tell: Tell) {
        match tell {
            Tell::Nobody => {}
            Tell::Writer => self.wake.notify_one(),
            Tell::Closer => self.returned.notify_one(),
        }
    }

    /// Queues `out` and, if the socket is free, writes what is queued now,
    /// on the caller's thread, without waiting. A refused request was
    /// never queued: the caller answers it as not sent.
    pub fn push(&self, out: Outbound) -> Result<(), (Refused, Outbound)> {
        let tell = protocol::push(&self.state, out)?;
        self.tell(tell);
        Ok(())
    }

    /// Queues `out` without writing it (see [`Outlet::flush`]).
    pub fn queue(&self, out: Outbound) -> Result<(), (Refused, Outbound)> {
        self.st().admit(out)
    }

    /// Writes what is queued now if the socket is free, without waiting.
    pub fn flush(&self) {
        let tell = protocol::flush(&self.state);
        self.tell(tell);
    }

    /// A session opened: its socket, its generation.
    pub fn install(&self, sink: UpSink, generation: u64) {
        self.st().install(sink, generation);
    }

    /// Closes `generation` (its session ended or its attempt failed):
    /// returns the ids of the requests withdrawn unwritten; any request
    /// for it pushed from now on is refused.
    pub fn close(&self, generation: u64) -> Vec<String> {
        self.st().close(generation)
    }

    /// Takes request `id` out of the queue if it was not written yet.
    pub fn withdraw(&self, id: &str) -> bool {
        self.st().withdraw(id)
    }

    /// The closed session's socket back, for the close frame. A writer
    /// holding it gives it back promptly (a requester's write never waits;
    /// the connector's writer is dropped first and returns it on drop); the
    /// wait is bounded all the same.
    pub async fn uninstall(&self, generation: u64) -> Option<UpSink> {
        let wait = async {
            loop {
                let returned = self.returned.notified();
                tokio::pin!(returned);
                returned.as_mut().enable();
                if let Some(sink) = self.st().take_closed_sink(generation) {
                    return sink;
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
            let job = self.st().writer_take();
            let Some((sink, generation)) = job else {
                notified.await;
                continue;
            };
            // Given back to the slot however this future ends (it is
            // dropped mid-write when the session ends for another reason).
            let mut held = Held {
                outlet: self,
                sink: Some(sink),
                generation,
            };
            loop {
                // Taken for writing: each counts as sent once the socket
                // takes it (see [`Batch`]).
                let mut batch = Batch {
                    outlet: self,
                    left: self.st().writer_batch(WRITE_BATCH),
                };
                let up = held.sink.as_mut().expect("held until dropped");
                let progress = up.raw.clone();
                let write = async {
                    while let Some(out) = batch.left.front() {
                        if let Some(raw) = up.raw_for(out).cloned() {
                            // Beside tungstenite once it holds nothing unwritten.
                            up.sink.flush().await?;
                            let out = batch.left.pop_front().expect("looked at");
                            raw.push(masked_text_frame(out.text));
                        } else {
                            std::future::poll_fn(|cx| Pin::new(&mut up.sink).poll_ready(cx))
                                .await?;
                            let out = batch.left.pop_front().expect("looked at");
                            Pin::new(&mut up.sink).start_send(Message::text(out.text))?;
                        }
                    }
                    up.sink.flush().await
                };
                match written_unless_stalled(write, progress.as_ref(), write_timeout).await {
                    None => return WriterEnd::Stalled(write_timeout),
                    Some(Err(e)) => return WriterEnd::Failed(e),
                    Some(Ok(())) => {}
                }
                if self.st().writer_done(&mut held.sink, generation) {
                    break;
                }
            }
        }
    }

    /// The first request queued, taken (tests look at what would be written).
    #[cfg(test)]
    pub fn pop_queued(&self) -> Option<Outbound> {
        self.st().writer_batch(1).pop_front()
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
    /// (Through a movable socket, as a plaintext session's: large requests
    /// are written beside tungstenite.)
    async fn session() -> (UpSink, SplitStream<Ws>, WebSocketStream<UnixStream>) {
        session_on(Under::Movable).await
    }

    /// What the session's socket is under its WebSocket.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Under {
        /// A plaintext session's socket (writes beside tungstenite).
        Movable,
        /// A TLS session's wrapper (writes beside tungstenite, through it).
        Spooled,
        /// Nothing: every request goes through tungstenite.
        Bare,
    }

    async fn session_on(under: Under) -> (UpSink, SplitStream<Ws>, WebSocketStream<UnixStream>) {
        use super::super::movable::{Movable, SocketKind, Spooled};
        let (a, b) = UnixStream::pair().unwrap();
        let io: Box<dyn super::super::UpstreamIo> = match under {
            Under::Movable => Box::new(Movable::moved(a, SocketKind::Unix, Vec::new(), Vec::new())),
            Under::Spooled => Box::new(Spooled::new(a)),
            Under::Bare => Box::new(a),
        };
        let raw = io.raw_writes();
        assert_eq!(raw.is_some(), under != Under::Bare);
        let ws = WebSocketStream::from_raw_socket(io, Role::Client, None).await;
        let gateway = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
        let (sink, stream) = ws.split();
        (UpSink::new(sink, raw), stream, gateway)
    }

    /// Large requests written beside tungstenite and small ones through
    /// it, by the caller and by the writer, reach the gateway whole and in
    /// order, on every kind of socket.
    #[tokio::test]
    async fn large_and_small_requests_arrive_whole_and_in_order() {
        for under in [Under::Movable, Under::Spooled, Under::Bare] {
            let (sink, _reader, mut gateway) = session_on(under).await;
            let outlet = Arc::new(Outlet::new(1024, 64 << 20));
            outlet.install(sink, 7);
            let writer = spawn_writer(&outlet);
            let sizes = [3, LARGE_REQUEST_BYTES + 1, 10, 3 << 20, 70_000, 5, 1 << 20];
            let texts: Vec<String> = sizes
                .iter()
                .enumerate()
                .map(|(i, n)| format!("{i}:{}", "é".repeat(n / 2)))
                .collect();
            for t in &texts {
                outlet.push(out(7, t.clone())).ok().unwrap();
            }
            for t in &texts {
                assert!(next_text(&mut gateway).await == *t, "whole, in order");
            }
            writer.abort();
        }
    }

    /// A large request is framed in the buffer it was encoded in: no second
    /// buffer of its size exists, even for a moment. The frame is the
    /// request, masked, after a header that says so.
    #[test]
    fn a_large_request_is_framed_in_the_buffer_it_was_encoded_in() {
        let pad = format!(r#"{{"pad":"{}"}}"#, "x".repeat(3 << 20));
        let params = serde_json::value::RawValue::from_string(pad).unwrap();
        // A method whose escaping takes more than the spare bytes the
        // encoder counts for its fixed parts.
        let method = "x\u{1}\u{1}\"\"";
        let text = crate::protocol::frames::encode_req("up-\"1\"", method, Some(&params));
        assert!(
            text.capacity() >= text.len() + crate::protocol::frames::FRAME_HEADER_ROOM,
            "room for the header: {} of {}",
            text.capacity() - text.len(),
            crate::protocol::frames::FRAME_HEADER_ROOM
        );
        assert!(
            text.capacity() < text.len() + 4096,
            "a buffer the request's size, not one grown by doubling: {} for {}",
            text.capacity(),
            text.len()
        );
        let (plain, at) = (text.clone(), text.as_ptr());
        let frame = masked_text_frame(text);
        assert_eq!(frame.as_ptr(), at, "framed where it was encoded");
        assert_eq!(
            &frame[..2],
            &[0x81, 0x80 | 127],
            "final text, masked, 64-bit length"
        );
        assert_eq!(
            u64::from_be_bytes(frame[2..10].try_into().unwrap()),
            plain.len() as u64
        );
        let key = &frame[10..14];
        let unmasked: Vec<u8> = frame[14..]
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ key[i % 4])
            .collect();
        assert!(unmasked == plain.as_bytes(), "the request, unmasked");
    }

    /// An outlet with session 7's socket installed, and the gateway's end
    /// (and the reading half the connector would hold).
    async fn pair() -> (Arc<Outlet>, WebSocketStream<UnixStream>, SplitStream<Ws>) {
        let (sink, stream, gateway) = session().await;
        let outlet = Arc::new(Outlet::new(1024, 64 << 20));
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
        while !outlet.st().is_waiting() {
            assert!(sent < 512, "the socket never filled");
            outlet.push(out(7, format!("{sent}:{big}"))).ok().unwrap();
            sent += 1;
        }
        sent
    }

    fn out(generation: u64, text: String) -> Outbound {
        let id = format!("cm-{}", text.split(':').next().unwrap_or_default());
        Outbound {
            generation,
            id,
            text,
        }
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
        outlet.close(6);
        assert_eq!(
            outlet.push(out(6, "stale".into())).map_err(|e| e.0),
            Err(Refused::Closed),
            "a closed generation's request is refused, never queued"
        );
        assert!(outlet.push(out(7, "two".into())).is_ok());
        assert_eq!(next_text(&mut gateway).await, "one");
        assert_eq!(next_text(&mut gateway).await, "two");
        assert!(!outlet.st().is_waiting());
        assert!(outlet.st().has_sink(), "the socket is given back");
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
        assert!(!outlet.st().is_waiting(), "the writer finished");
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
        outlet.close(7);
        assert!(
            outlet.uninstall(7).await.is_some(),
            "the socket is back for the close"
        );
    }

    /// A gateway that reads slowly but steadily is waited for, however
    /// long the writer's batch takes in all: only a write the socket takes
    /// nothing of for the write timeout is a stall. (Before: the timeout
    /// bounded the whole batch, and this session was ended mid-write.)
    /// On paused time: the reader's pace and the timeout are figures this
    /// test sets, not this machine's speed.
    #[tokio::test(start_paused = true)]
    async fn a_slow_gateway_that_goes_on_reading_is_not_a_stall() {
        const REQUESTS: usize = 120;
        let (outlet, mut gateway, _reader) = pair().await;
        let big = "x".repeat(60 * 1024);
        for i in 0..REQUESTS {
            outlet.push(out(7, format!("{i}:{big}"))).ok().unwrap();
        }
        assert!(outlet.st().is_waiting(), "more than the socket holds");
        let writer = {
            let outlet = Arc::clone(&outlet);
            tokio::spawn(async move { outlet.writer(Duration::from_millis(300)).await })
        };
        // About 8 ms a request: each batch of 64 takes longer than the
        // write timeout, and the socket takes something every few ms.
        for i in 0..REQUESTS {
            tokio::time::sleep(Duration::from_millis(8)).await;
            let text = next_text(&mut gateway).await;
            assert!(text.starts_with(&format!("{i}:")), "request {i} in order");
            assert!(!writer.is_finished(), "the writer gave up at request {i}");
        }
        writer.abort();
    }

    /// A session that ended: its requests are refused from then on;
    /// requests for the next one wait for it, and its writer sends them.
    #[tokio::test]
    async fn requests_after_a_session_ended_wait_for_the_next() {
        let (outlet, _old_gateway, _reader) = pair().await;
        assert!(outlet.close(7).is_empty());
        assert!(outlet.uninstall(7).await.is_some(), "the socket is back");
        assert_eq!(
            outlet.push(out(7, "late".into())).map_err(|e| e.0),
            Err(Refused::Closed)
        );
        outlet.push(out(8, "next".into())).ok().unwrap();
        assert_eq!(outlet.st().queued().0, 1, "kept for the next session");
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
        outlet.close(7);
        let sink = tokio::time::timeout(Duration::from_secs(5), outlet.uninstall(7))
            .await
            .expect("at once");
        assert!(sink.is_some(), "the socket is back for the close");
    }

    /// The writer dropped mid-batch (a handover ends the session while the
    /// gateway reads nothing): each request of its batch is either written
    /// or withdrawn by the close, never neither. (Before: the rest of the
    /// batch was dropped as if sent, and at a handover its client waited
    /// for an answer that could not come.)
    #[tokio::test]
    async fn a_writer_dropped_mid_batch_leaves_each_request_written_or_withdrawn() {
        let (outlet, mut gateway, reader) = pair().await;
        let mut sent = fill(&outlet);
        // More than tungstenite buffers before it must write: the writer
        // stops inside its batch.
        let big = "x".repeat(64 * 1024);
        for _ in 0..5 {
            outlet.push(out(7, format!("{sent}:{big}"))).ok().unwrap();
            sent += 1;
        }
        let stuck = tokio::time::timeout(
            Duration::from_millis(50),
            outlet.writer(Duration::from_secs(60)),
        )
        .await;
        assert!(stuck.is_err(), "the gateway reads nothing: the write waits");
        let withdrawn = outlet.close(7);
        let sink = tokio::time::timeout(Duration::from_secs(5), outlet.uninstall(7))
            .await
            .expect("at once")
            .expect("the socket is back");
        // The gateway reads again; what the writing half took goes on (as
        // a handover's flush sends it), then the socket closes.
        let read = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(Ok(msg)) = gateway.next().await {
                if let Message::Text(t) = msg {
                    got.push(format!("cm-{}", t.split(':').next().unwrap_or_default()));
                }
            }
            got
        });
        let mut sink = sink.into_inner();
        tokio::time::timeout(Duration::from_secs(5), sink.close())
            .await
            .expect("written in time")
            .unwrap();
        drop((sink, reader));
        let got = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("read in time")
            .unwrap();
        for i in 0..sent {
            let id = format!("cm-{i}");
            let (written, back) = (got.contains(&id), withdrawn.contains(&id));
            assert!(
                written != back,
                "{id}: written {written}, withdrawn {back} ({} written, {} withdrawn)",
                got.len(),
                withdrawn.len()
            );
        }
        assert!(
            !withdrawn.is_empty(),
            "the case this is about: the writer stopped inside its batch"
        );
    }

    /// The queue is bounded in requests.
    #[tokio::test]
    async fn a_full_queue_refuses() {
        let outlet = Outlet::new(2, 1 << 20);
        assert!(outlet.push(out(1, "a".into())).is_ok());
        assert!(outlet.push(out(1, "b".into())).is_ok());
        assert_eq!(
            outlet.push(out(1, "c".into())).map_err(|e| e.0),
            Err(Refused::Full)
        );
    }

    /// The queue is bounded in bytes, counting what waits (before: 250
    /// requests of 8 MiB held 1,658 MiB while the gateway did not read);
    /// one request of any size fits an empty queue.
    #[tokio::test]
    async fn the_queue_is_bounded_in_bytes() {
        let outlet = Outlet::new(1024, 100);
        let big = |i: usize| out(1, format!("{i}:{}", "x".repeat(60)));
        assert!(outlet.push(big(0)).is_ok(), "the first always fits");
        assert_eq!(
            outlet.push(big(1)).map_err(|e| e.0),
            Err(Refused::Full),
            "62 + 62 > 100"
        );
        assert!(outlet.push(out(1, "2:small".into())).is_ok());
        assert_eq!(outlet.st().queued(), (2, 62 + 7));
        assert!(outlet.withdraw("cm-0"));
        assert_eq!(
            outlet.st().queued(),
            (1, 7),
            "withdrawn bytes are given back"
        );
        assert_eq!(outlet.close(1), vec!["cm-2".to_owned()]);
        assert_eq!(outlet.st().queued(), (0, 0), "closed bytes are given back");
    }

    /// Before: a request queued for a session that is still opening, whose
    /// attempt then fails, is withdrawn (its client is answered "not sent")
    /// and the next attempt, with a new generation, never writes it.
    #[tokio::test]
    async fn a_failed_attempt_withdraws_its_requests_and_the_next_never_writes_them() {
        let outlet = Arc::new(Outlet::new(1024, 1 << 20));
        outlet
            .push(out(8, "1:queued while opening".into()))
            .ok()
            .unwrap();
        assert_eq!(
            outlet.close(8),
            vec!["cm-1".to_owned()],
            "withdrawn unwritten"
        );
        assert_eq!(
            outlet.push(out(8, "2:late".into())).map_err(|e| e.0),
            Err(Refused::Closed)
        );
        outlet.push(out(9, "3:for the next".into())).ok().unwrap();
        let (sink, _reader, mut gateway) = session().await;
        outlet.install(sink, 9);
        let writer = spawn_writer(&outlet);
        assert_eq!(next_text(&mut gateway).await, "3:for the next");
        outlet.push(out(9, "4:after".into())).ok().unwrap();
        assert_eq!(
            next_text(&mut gateway).await,
            "4:after",
            "nothing else came first"
        );
        writer.abort();
    }

    /// Before: a socket given back after its session's end was given up
    /// on (the 1 s wait) is not put over the next session's socket.
    #[tokio::test]
    async fn an_old_socket_is_never_put_back_over_a_newer_session() {
        let (outlet, _old_gateway, _reader) = pair().await;
        // A writer takes the old socket and holds it past the session's end.
        let taken = {
            let mut st = outlet.st();
            st.install_waiting_for_test();
            st.writer_take()
        };
        let (old_sink, old_generation) = taken.expect("the writer holds the socket");
        outlet.close(7);
        let (sink, _reader2, mut gateway) = session().await;
        outlet.install(sink, 8);
        let tell = outlet.st().writer_dropped(old_sink, old_generation);
        assert_eq!(tell, Tell::Nobody);
        outlet.push(out(8, "5:new".into())).ok().unwrap();
        assert_eq!(
            next_text(&mut gateway).await,
            "5:new",
            "written to the new socket"
        );
    }
}
