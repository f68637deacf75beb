//! A local client at a handover (design §11): stopped at a message
//! boundary and left for the next instance ([`hand_over`]), and served
//! again there from where it stopped ([`resume`]).

use std::sync::Arc;
use std::task::Poll;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::WebSocketStream;

use super::{
    config, finish, handle_frame, poll_incoming, serve_requests, Conn, Incoming, Restarts, Served,
    WriterEnd,
};
use crate::context::Ctx;
use crate::dispatch::Registration;
use crate::local::preconnect::{Limited, PreconnectBudget};

/// A client taken over from the previous instance ([`crate::handover`]):
/// serves it from where that one stopped, on its socket, with the bytes it
/// had read and not parsed.
pub async fn resume(
    stream: tokio::net::UnixStream,
    unread: Vec<u8>,
    registration: Registration,
    restarts: Restarts,
    ctx: Arc<Ctx>,
) {
    use tokio_tungstenite::tungstenite::protocol::Role;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let budget = PreconnectBudget::new(0);
    budget.lift();
    let client = Arc::clone(registration.client());
    client.count_written(budget.written());
    // The unread bytes go through the reader, which follows their frames.
    let io = Limited::with_unread(stream, budget, unread);
    let config = config(&ctx);
    let pause = io.pause();
    let ws = WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await;
    let mut conn = Conn::new(ws, Arc::clone(&client), pause);
    conn.ws
        .get_mut()
        .charge_messages_to(Arc::clone(client.budget()));
    tracing::debug!(client_id = client.id, "local client taken over");
    let serving = ctx.handoff.serving();
    // The gateway session is taken over (or opened again) right after the
    // clients: a request read before it is ready would be refused, so the
    // client waits for it as a connecting client does (`connect_wait`).
    // Events queued meanwhile are written once it is.
    // (A stop or another handover meanwhile is seen by `serve_requests`.)
    // Set up before the gate, so the commit wakes only I/O; nothing is
    // read or written before it (a stop before then writes nothing).
    tokio::select! {
        biased;
        _ = ctx.cancel.cancelled() => return,
        _ = ctx.gate.passed() => {}
    }
    let deadline = std::time::Instant::now() + ctx.settings.limits.connect_wait;
    tokio::select! {
        _ = ctx.upstream().wait_ready(deadline) => {}
        _ = ctx.handoff.requested.cancelled() => {}
        _ = ctx.cancel.cancelled() => {}
    }
    let served = serve_requests(&mut conn, &registration, &ctx, restarts).await;
    if served == Served::HandOver {
        // Every client moves, a mirror one too: a direct gateway connection
        // would see nothing of the broker's handover (when the gateway
        // connection cannot move, the next instance closes it).
        match hand_over(conn, registration, fd, restarts, &ctx).await {
            Ok(()) => return,
            Err((conn, registration)) => {
                client.close(1012, "service restart");
                drop(serving);
                return finish(conn, registration).await;
            }
        }
    }
    drop(serving);
    finish(conn, registration).await
}

/// How long a client may take, at a handover, to finish the message it is
/// sending and to take the batch being written, before it is closed
/// instead of moved (`1012`; it reconnects and resumes by cursor).
pub const HANDOVER_PAUSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Stops a client for the next instance (design §11): no more reads past
/// the message in progress (the messages already read are handled as
/// usual), the batch being written written whole, then the socket, the
/// unread bytes and the registration (with the queue not yet written) are
/// left for the handover. On failure the connection is given back to be
/// closed as at any stop.
pub(super) async fn hand_over<T>(
    mut conn: Conn<T>,
    registration: Registration,
    fd: std::os::fd::RawFd,
    restarts: Restarts,
    ctx: &Arc<Ctx>,
) -> Result<(), (Conn<T>, Registration)>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let pause = conn.pause.clone();
    pause.request();
    let member = Arc::clone(registration.member());
    let stopped = tokio::time::timeout(HANDOVER_PAUSE_TIMEOUT, async {
        loop {
            let read = std::future::poll_fn(|cx| {
                if let Poll::Ready(end) = conn.writer.poll_drive(cx, &mut conn.ws, &conn.client) {
                    return Poll::Ready(Err(end));
                }
                match poll_incoming(&mut conn.ws, cx) {
                    Poll::Ready(i) => Poll::Ready(Ok(Some(i))),
                    Poll::Pending if pause.at_boundary() => Poll::Ready(Ok(None)),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match read {
                Ok(Some(Incoming::Text(text))) => handle_frame(&text, &member, ctx),
                Ok(None) => break,
                // The client left or broke the protocol meanwhile.
                Ok(Some(_)) | Err(_) => return false,
            }
        }
        std::future::poll_fn(|cx| {
            conn.writer
                .poll_batch_written(cx, &mut conn.ws, &conn.client)
        })
        .await
    })
    .await;
    if stopped != Ok(true) {
        tracing::info!(
            client_id = conn.client.id,
            "handover: client not at a boundary in time; closing it"
        );
        conn.writer.hold = false;
        if conn.writer.ended == Some(WriterEnd::Held) {
            conn.writer.ended = None;
        }
        return Err((conn, registration));
    }
    // SAFETY: `fd` is the descriptor of the socket under `conn`, which
    // owns it and is alive here (it is dropped only below), so borrowing
    // it for the duplication cannot outlive or alias a closed descriptor.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let Ok(copy) = rustix::io::fcntl_dupfd_cloexec(borrowed, 3) else {
        return Err((conn, registration));
    };
    let Conn { mut ws, .. } = conn;
    let unread = ws.get_mut().take_unread();
    ctx.handoff.leave(crate::context::Parcel {
        registration,
        fd: copy,
        unread,
        mirror: restarts == Restarts::Mirror,
    });
    // Dropping `ws` closes this instance's descriptor only: the socket
    // stays open, through the copy, for the next instance.
    drop(ws);
    Ok(())
}
