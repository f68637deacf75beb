//! The bare relay of the requests scenario: the physical floor for a
//! forwarder on this machine. Clients connect to it over a unix socket as they
//! do to the broker; for each one it opens a loopback TCP connection to the
//! gateway double, as the broker's upstream does, and copies bytes both ways
//! untouched (`tokio::io::copy_bidirectional`, one task per connection). The
//! clients do the gateway's own WebSocket handshake through it.
//!
//! It runs on the broker's runtime (the same 2 `broker` worker threads), so
//! its CPU time is read exactly as the broker's is.

use std::net::SocketAddr;
use std::path::Path;

use tokio::net::{TcpStream, UnixListener};
use tokio::runtime::Handle;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

pub struct Relay {
    stop: CancellationToken,
    accepting: JoinHandle<()>,
}

impl Relay {
    /// Listens on `socket` (on `rt`) and relays every connection to `upstream`.
    pub async fn start(rt: &Handle, socket: &Path, upstream: SocketAddr) -> Result<Relay, String> {
        let socket = socket.to_owned();
        // Bound on the runtime that will poll it (its reactor registers the socket).
        let listener = rt
            .spawn(async move { UnixListener::bind(socket) })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("relay socket: {e}"))?;
        let stop = CancellationToken::new();
        let until = stop.clone();
        let accepting = rt.spawn(async move {
            // Dropped at the end: aborts every connection still open.
            let mut connections = JoinSet::new();
            loop {
                let accepted = tokio::select! {
                    _ = until.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut client, _)) = accepted else { break };
                connections.spawn(async move {
                    let Ok(mut gateway) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = gateway.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut gateway).await;
                });
                // Reap the ones that ended, so the set does not grow.
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Relay { stop, accepting })
    }

    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.accepting.await;
    }
}
