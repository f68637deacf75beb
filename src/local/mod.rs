//! The local side: the unix listener, peer-credential check, HTTP routes,
//! WebSocket sessions, and the HTTP API (`/v1/state`, `/v1/events`, `/v1/rpc`).

pub mod http;
pub mod preconnect;
pub mod rate;
pub mod rpc;
pub mod socket;
pub mod sse;
pub mod state;
pub mod ws;

use std::sync::Arc;

use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

use crate::broker::Ctx;

/// Cancelling it drops one HTTP connection at once: for a response stream
/// stuck behind a reader that does not read (hyper will not poll its body
/// again until the socket drains). Handlers find it in the request extensions.
#[derive(Debug, Clone)]
pub struct ConnectionKill(pub tokio_util::sync::CancellationToken);

/// Accepts connections until `stop` (cancelled first at shutdown, before the
/// sessions are told to end) and then drops the listener. Each connection is
/// served by its own task; its errors are logged and never reach the listener.
pub async fn accept_loop(listener: UnixListener, ctx: Arc<Ctx>, stop: CancellationToken) {
    let me = rustix::process::getuid().as_raw();
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // EMFILE and friends: log, back off a little, keep serving.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Peer credentials come from the kernel, not from anything the peer says.
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == me || ctx.allowed_uids.contains(&cred.uid()) => {}
            Ok(cred) => {
                tracing::warn!(
                    peer_uid = cred.uid(),
                    "refused a connection from another user"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!("cannot read peer credentials, refusing: {e}");
                continue;
            }
        }
        let ctx = Arc::clone(&ctx);
        let tracker = ctx.tracker.clone();
        tracker.spawn(async move {
            let cancel = ctx.cancel.clone();
            let kill = tokio_util::sync::CancellationToken::new();
            let kill_handle = ConnectionKill(kill.clone());
            let service = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
                req.extensions_mut().insert(kill_handle.clone());
                http::route(req, Arc::clone(&ctx))
            });
            let conn = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                res = conn.as_mut() => {
                    if let Err(e) = res {
                        tracing::debug!("local HTTP connection ended: {e}");
                    }
                }
                _ = kill.cancelled() => {}
                _ = cancel.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    tokio::select! {
                        _ = conn => {}
                        _ = kill.cancelled() => {}
                    }
                }
            }
        });
    }
}
