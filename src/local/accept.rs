//! The accept loop: peer uid, the connection cap, running out of file
//! descriptors, and one task per admitted connection.

use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, Semaphore};
use tokio_util::sync::CancellationToken;

use super::fdlimit::{self, SpareFd};
use super::{http, ConnectionKill};
use crate::context::Ctx;
use crate::policy::SocketPolicy;

/// First pause after `accept` fails (out of descriptors, or any other
/// error); doubled per failure in a row up to [`ACCEPT_BACKOFF_MAX`], and
/// back to this after the next accepted connection.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between `accept` attempts while they keep failing.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// A repeated warning (accept failing, connections over the cap) is logged
/// at most once per this interval, with how many were not logged since.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// How long the spare descriptor waits for a connection to refuse after
/// `accept` said "too many open files" (the kernel says so even when
/// nobody is waiting); nobody there means the loop pauses instead.
const SPARE_ACCEPT_WAIT: Duration = Duration::from_millis(1);
/// A refused connection (over the cap, or out of descriptors) is answered
/// `503`, its write side shut, and then its request is read and dropped for
/// at most this long before the close (a lingering close), so the client
/// reads the answer instead of a broken pipe on its write: closing with the
/// request unread makes the kernel fail the client's write (`EPIPE`) and
/// reset its read. A client that reads the answer and closes ends the
/// linger at once.
const REFUSE_LINGER: Duration = Duration::from_secs(1);
/// The most a lingering refusal reads and drops before it closes anyway: a
/// request head fits many times over; a client streaming a body at it is
/// not waited for.
const REFUSE_DRAIN_MAX_BYTES: usize = 64 * 1024;
/// At most this many refused connections linger at once (each holds a
/// descriptor); more are closed right after the answer is written.
const REFUSE_LINGER_MAX: usize = 16;

/// Accepts connections until `stop` (cancelled first at shutdown, before the
/// sessions are told to end) and then drops the listener. Each connection is
/// served by its own task; its errors are logged and never reach the listener.
pub async fn accept_loop(
    listener: UnixListener,
    socket: Arc<SocketPolicy>,
    ctx: Arc<Ctx>,
    stop: CancellationToken,
) {
    let me = rustix::process::getuid().as_raw();
    let limits = &ctx.settings.limits;
    let soft = fdlimit::soft_limit();
    let cap = fdlimit::connection_budget(limits.max_connections(), soft);
    if cap < limits.max_connections() || cap < limits.max_clients {
        tracing::warn!(
            open_file_limit = soft,
            reserve = fdlimit::FD_RESERVE,
            max_clients = limits.max_clients,
            max_connections = limits.max_connections(),
            "the open-file limit cannot hold every allowed connection: at most {cap} are accepted; raise it (LimitNOFILE= in the unit, ulimit -n)"
        );
    }
    // Shared with the moved connections this socket's clients hold.
    if !ctx.slots.serves(&socket.name) {
        tracing::error!(socket = %socket.name, "no connection slots for this socket; not accepting");
        return;
    }
    let lingering = Arc::new(Semaphore::new(REFUSE_LINGER_MAX));
    let busy = busy_response(cap);
    let mut spare = SpareFd::open();
    let mut backoff = Backoff::default();
    let mut accept_warn = Throttle::default();
    let mut cap_warn = Throttle::default();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff.reset();
                spare.refill();
                stream
            }
            Err(e) => {
                // The spare may have been lost to another open (the
                // upstream connector's socket took the descriptor it freed):
                // take one back if any is free now.
                spare.refill();
                let refused = is_out_of_descriptors(&e)
                    && refuse_with_spare(&listener, &mut spare, &busy, &lingering).await;
                if let Some(unlogged) = accept_warn.ready(Instant::now()) {
                    tracing::warn!(
                        unlogged,
                        "accept failed: {e}; answering waiting connections 503 and retrying with a pause"
                    );
                }
                if refused {
                    // Progress: a waiting client was answered.
                    backoff.reset();
                    continue;
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff.next()) => {}
                    // The spare lent to a lingering refusal is back: the
                    // next waiting client can be answered now.
                    _ = spare.lent_back() => {}
                }
                continue;
            }
        };
        if limits.send_buffer_bytes > 0 {
            if let Err(e) =
                rustix::net::sockopt::set_socket_send_buffer_size(&stream, limits.send_buffer_bytes)
            {
                tracing::warn!(
                    "cannot set a connection's send buffer (limits.send_buffer_bytes): {e}"
                );
            }
        }
        // Peer credentials come from the kernel, not from anything the peer says.
        let peer_pid = match stream.peer_cred() {
            Ok(cred)
                if socket.admits(cred.uid(), cred.gid(), me)
                    || ctx.allowed_uids.contains(&cred.uid()) =>
            {
                super::PeerPid(
                    cred.pid().and_then(|p| u32::try_from(p).ok()),
                    Some(cred.uid()),
                )
            }
            Ok(cred) => {
                tracing::warn!(
                    peer_uid = cred.uid(),
                    peer_gid = cred.gid(),
                    socket = %socket.name,
                    "refused a connection from a user this socket does not admit"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!("cannot read peer credentials, refusing: {e}");
                continue;
            }
        };
        let Some(slot) = ctx.slots.take(&socket.name) else {
            if let Some(unlogged) = cap_warn.ready(Instant::now()) {
                tracing::warn!(
                    max_connections = cap,
                    socket = %socket.name,
                    share = ctx.slots.share(&socket.name),
                    unlogged,
                    "refused a connection: too many open connections on this socket"
                );
            }
            refuse(stream, busy.clone(), &lingering, None);
            continue;
        };
        let stream = CountedStream {
            stream,
            _slot: slot,
            spool: Arc::default(),
        };
        let tracker = ctx.tracker.clone();
        tracker.spawn(serve_connection(
            stream,
            peer_pid,
            Arc::clone(&socket),
            Arc::clone(&ctx),
        ));
    }
}

/// At a stop, how long a connection that has not sent its first request yet
/// may take to send it before it is closed (it was accepted just before the
/// stop; its request is answered).
pub const FIRST_REQUEST_GRACE: Duration = Duration::from_millis(250);

/// One HTTP/1.1 connection, until it ends, is killed, or the broker stops.
async fn serve_connection(
    mut stream: CountedStream,
    peer_pid: super::PeerPid,
    socket: Arc<SocketPolicy>,
    ctx: Arc<Ctx>,
) {
    let cancel = ctx.cancel.clone();
    let kill = CancellationToken::new();
    let kill_handle = ConnectionKill(kill.clone());
    let header_read_timeout = ctx.settings.limits.header_read_timeout;
    let conn_fd = super::ConnFd(std::os::fd::AsRawFd::as_raw_fd(&stream.stream));
    let conn_socket = super::ConnSocket::new(conn_fd.0);
    stream.spool = Arc::clone(conn_socket.spool());
    let forget = conn_socket.clone();
    let asked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let first_request = Arc::clone(&asked);
    let service = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
        first_request.store(true, std::sync::atomic::Ordering::Relaxed);
        req.extensions_mut().insert(kill_handle.clone());
        req.extensions_mut().insert(Arc::clone(&socket));
        req.extensions_mut().insert(peer_pid);
        req.extensions_mut().insert(conn_fd);
        req.extensions_mut().insert(conn_socket.clone());
        http::route(req, Arc::clone(&ctx))
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        // Queued, not copied: an event stream's chunk is dropped only once
        // written whole, framing and all, which is what lets a handover
        // move the stream (`stream_body::Drained`). A unix socket takes
        // vectored writes, so hyper would choose this anyway; asked for so
        // it does not depend on that.
        .writev(true)
        .header_read_timeout(header_read_timeout)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    // Dropped before `conn` (which closes the socket): see `ConnSocket`.
    let _forget = forget.closing();
    tokio::select! {
        res = conn.as_mut() => {
            if let Err(e) = res {
                tracing::debug!("local HTTP connection ended: {e}");
            }
        }
        _ = kill.cancelled() => {}
        _ = cancel.cancelled() => {
            // A connection accepted just before the stop has not sent its
            // request yet, and a graceful shutdown closes a connection with
            // no request at once: give it a moment to send one, so a request
            // that was on its way is answered (one in flight always is).
            if !asked.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = kill.cancelled() => return,
                    _ = tokio::time::sleep(FIRST_REQUEST_GRACE) => {}
                }
            }
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = conn => {}
                _ = kill.cancelled() => {}
            }
        }
    }
}

fn is_out_of_descriptors(e: &io::Error) -> bool {
    let raw = e.raw_os_error();
    raw == Some(rustix::io::Errno::MFILE.raw_os_error())
        || raw == Some(rustix::io::Errno::NFILE.raw_os_error())
}

/// The answer to a connection the broker will not serve.
fn busy_response(cap: usize) -> Bytes {
    let body = serde_json::json!({"ok": false, "error": {
        "code": crate::protocol::StudioCode::TooManyClients.as_str(),
        "message": format!(
            "clawmux has too many open connections ({cap}); close some, or raise limits.max_connections and the open-file limit"
        ),
    }})
    .to_string();
    Bytes::from(format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncache-control: no-store\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    ))
}

/// Out of descriptors: frees the spare, accepts one waiting connection
/// into its slot, answers it `503` with a lingering close ([`refuse`]), and
/// takes the spare back. While the refusal lingers its descriptor is the
/// spare's, lent to it and handed back when the linger ends (the loop waits
/// for that beside its pause); the linger ends as soon as the client has
/// read the answer and closed. Returns whether a connection was waiting
/// (then the loop tries again at once: each round answers a real client, so
/// it cannot spin).
async fn refuse_with_spare(
    listener: &UnixListener,
    spare: &mut SpareFd,
    busy: &Bytes,
    lingering: &Arc<Semaphore>,
) -> bool {
    if !spare.release() {
        return false;
    }
    // The listener was readable a moment ago; do not wait for more.
    let waiting = tokio::time::timeout(SPARE_ACCEPT_WAIT, listener.accept()).await;
    let refused = if let Ok(Ok((stream, _))) = waiting {
        refuse(stream, busy.clone(), lingering, Some(spare.lend()));
        true
    } else {
        false
    };
    spare.refill();
    refused
}

/// Answers `503` and closes, lingering: the answer is written, the write
/// side shut, and the client's request read and dropped until it closes,
/// for at most [`REFUSE_LINGER`] and [`REFUSE_DRAIN_MAX_BYTES`], so the
/// client's write of its request does not fail before it reads the answer.
/// With [`REFUSE_LINGER_MAX`] refusals already lingering, the answer is
/// written (best effort, never blocking: a fresh socket's buffer holds it)
/// and the connection closed at once. `give_back`: the descriptor is the
/// lent spare's; it is shut down and handed back instead of closed.
fn refuse(
    stream: UnixStream,
    busy: Bytes,
    lingering: &Arc<Semaphore>,
    give_back: Option<oneshot::Sender<OwnedFd>>,
) {
    let Ok(permit) = Arc::clone(lingering).try_acquire_owned() else {
        if let Ok(mut stream) = stream.into_std() {
            let _ = stream.write(&busy);
        }
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::time::timeout(REFUSE_LINGER, linger(&mut stream, &busy)).await;
        if let (Some(give_back), Ok(stream)) = (give_back, stream.into_std()) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            let _ = give_back.send(OwnedFd::from(stream));
        }
    });
}

/// The lingering close itself, without its time bound.
async fn linger(stream: &mut UnixStream, busy: &[u8]) -> io::Result<()> {
    stream.write_all(busy).await?;
    stream.shutdown().await?;
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < REFUSE_DRAIN_MAX_BYTES {
        match stream.read(&mut sink).await? {
            0 => break,
            n => drained += n,
        }
    }
    Ok(())
}

/// Exponential pause between failing accepts (hand-written: two lines; the
/// backoff crates bring jitter and clocks this loop does not need).
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            next: ACCEPT_BACKOFF_MIN,
        }
    }
}

impl Backoff {
    fn next(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(ACCEPT_BACKOFF_MAX);
        now
    }

    fn reset(&mut self) {
        self.next = ACCEPT_BACKOFF_MIN;
    }
}

/// Lets a repeated warning through once per [`WARN_EVERY`].
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    unlogged: u64,
}

impl Throttle {
    /// `Some(n)`: log now; `n` occurrences were swallowed since the last line.
    fn ready(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < WARN_EVERY => {
                self.unlogged += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}

/// A connection that holds one of the cap's slots for as long as it is
/// open, through a WebSocket upgrade too (hyper hands this very stream to
/// the session), so the cap counts every open local socket.
#[derive(Debug)]
struct CountedStream {
    stream: UnixStream,
    _slot: crate::slots::Slot,
    /// Takes hyper's writes whole once an event stream's response begins
    /// ([`super::stream_body::Spool`]).
    spool: Arc<super::stream_body::Spool>,
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match this.spool.poll_write_vectored(&mut this.stream, cx, bufs) {
            Some(polled) => polled,
            None => Pin::new(&mut this.stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match this.spool.poll_flush(&mut this.stream, cx) {
            Some(polled) => polled,
            None => Pin::new(&mut this.stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.spool.is_taken() {
            // The socket has moved: shutting it down would end it there too.
            return Poll::Ready(Ok(()));
        }
        if let Some(flushed) = this.spool.poll_flush(&mut this.stream, cx) {
            std::task::ready!(flushed)?;
        }
        Pin::new(&mut this.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::default();
        let delays: Vec<_> = (0..9).map(|_| b.next().as_millis()).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.next(), ACCEPT_BACKOFF_MIN);
    }

    #[test]
    fn throttle_logs_once_per_interval_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut t = Throttle::default();
        assert_eq!(t.ready(t0), Some(0));
        for i in 1..=20 {
            assert_eq!(t.ready(t0 + Duration::from_millis(i * 50)), None);
        }
        assert_eq!(t.ready(t0 + WARN_EVERY), Some(20));
        assert_eq!(t.ready(t0 + WARN_EVERY + Duration::from_secs(1)), None);
    }

    #[tokio::test]
    async fn a_lingering_refusal_reads_a_late_request_then_closes() {
        let (ours, mut client) = UnixStream::pair().unwrap();
        let lingering = Arc::new(Semaphore::new(1));
        let (give_back, returned) = oneshot::channel();
        refuse(ours, busy_response(1), &lingering, Some(give_back));
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 503 "));
        // Written after the answer was read to its end: still accepted.
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        drop(client);
        // The client's close ends the linger long before its time bound.
        let fd = tokio::time::timeout(REFUSE_LINGER / 2, returned)
            .await
            .expect("ended by the client's close")
            .expect("the descriptor handed back");
        drop(fd);
        assert_eq!(lingering.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_lingering_refusal_drains_a_bounded_number_of_bytes() {
        let (ours, mut client) = UnixStream::pair().unwrap();
        let lingering = Arc::new(Semaphore::new(1));
        refuse(ours, busy_response(1), &lingering, None);
        // A client that never closes and keeps writing: the broker stops
        // reading after REFUSE_DRAIN_MAX_BYTES and closes, well before the
        // time bound; the client's write then fails.
        let chunk = vec![b'x'; 4096];
        let writes = async {
            let mut written = 0usize;
            while client.write_all(&chunk).await.is_ok() {
                written += chunk.len();
            }
            written
        };
        let written = tokio::time::timeout(REFUSE_LINGER / 2, writes)
            .await
            .expect("closed after the drain bound, not the time bound");
        assert!(written >= REFUSE_DRAIN_MAX_BYTES, "{written}");
    }

    #[test]
    fn busy_answer_is_a_complete_http_response() {
        let b = busy_response(7);
        let text = std::str::from_utf8(&b).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "studio.too_many_clients");
    }
}
