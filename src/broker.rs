//! Assembly: binds the socket, starts the connector, the request sweeper and
//! the accept loop, and shuts them down in order.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Settings;
use crate::driver::Driver;
use crate::hub::{Hub, QueueLimits, ReplayLimits};
use crate::local::socket::{self, SocketError, SocketGuard};
use crate::router::Router;
use crate::upstream::Upstream;

/// What every task of a running broker shares.
#[derive(Debug)]
pub struct Ctx {
    pub settings: Settings,
    pub hub: Arc<Hub>,
    pub router: Arc<Router>,
    pub driver: Arc<Driver>,
    pub upstream: Upstream,
    /// Other uids (besides the broker's own) allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// Cancelled at shutdown: every task reaches a safe point and ends.
    pub cancel: CancellationToken,
    /// Every connection and session task, so shutdown can wait for them.
    pub tracker: TaskTracker,
}

/// How often pending requests are checked against their deadlines.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// A broker serving on its socket.
#[derive(Debug)]
pub struct RunningBroker {
    ctx: Arc<Ctx>,
    guard: SocketGuard,
    upstream_task: tokio::task::JoinHandle<()>,
}

impl RunningBroker {
    /// Binds the socket and starts serving. Returns once the socket accepts
    /// connections (the upstream session opens in the background).
    pub async fn start(settings: Settings) -> Result<RunningBroker, SocketError> {
        let (listener, guard) = socket::bind(&settings.socket_path)?;
        let listener =
            tokio::net::UnixListener::from_std(listener).map_err(|source| SocketError::Io {
                path: settings.socket_path.clone(),
                source,
            })?;
        Ok(Self::start_with_listener(settings, listener, guard))
    }

    fn start_with_listener(
        settings: Settings,
        listener: tokio::net::UnixListener,
        guard: SocketGuard,
    ) -> RunningBroker {
        let limits = &settings.limits;
        let hub = Arc::new(Hub::new(
            QueueLimits {
                soft_bytes: limits.queue_soft_bytes,
                hard_bytes: limits.queue_hard_bytes,
                grace: limits.slow_grace,
            },
            limits.max_clients,
        ));
        hub.set_replay_limits(ReplayLimits {
            max_events: limits.replay_max_events,
            max_bytes: limits.replay_max_bytes,
        });
        let router = Arc::new(Router::new(
            limits.request_timeout,
            limits.run_timeout,
            limits.max_inflight,
        ));
        let cancel = CancellationToken::new();
        let driver = Arc::new(Driver::new());
        let (upstream, upstream_task) = Upstream::spawn(
            &settings,
            Arc::clone(&hub),
            Arc::clone(&router),
            Arc::clone(&driver),
            cancel.child_token(),
        );
        let ctx = Arc::new(Ctx {
            settings,
            hub,
            router,
            driver,
            upstream,
            allowed_uids: Vec::new(),
            cancel,
            tracker: TaskTracker::new(),
        });
        ctx.tracker.spawn(sweep_deadlines(Arc::clone(&ctx)));
        ctx.tracker
            .spawn(crate::local::accept_loop(listener, Arc::clone(&ctx)));
        tracing::info!(socket = %guard.path().display(), gateway = %ctx.settings.gateway_url, "clawmux listening");
        RunningBroker {
            ctx,
            guard,
            upstream_task,
        }
    }

    pub fn socket_path(&self) -> &Path {
        self.guard.path()
    }

    pub fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Stops accepting, closes every client `1001 going away`, closes the
    /// upstream session, and waits for tasks up to `deadline`.
    pub async fn shutdown(self, deadline: Duration) {
        tracing::info!("clawmux shutting down");
        self.ctx.cancel.cancel();
        self.ctx.tracker.close();
        let until = Instant::now() + deadline;
        if tokio::time::timeout_at(until.into(), self.ctx.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("some connections did not finish before the shutdown deadline");
        }
        let _ = tokio::time::timeout_at(until.into(), self.upstream_task).await;
        drop(self.guard);
    }
}

async fn sweep_deadlines(ctx: Arc<Ctx>) {
    let mut interval = tokio::time::interval(SWEEP_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = interval.tick() => {
                let expired = ctx.router.expire(Instant::now());
                if expired > 0 {
                    tracing::info!(expired, "requests timed out");
                }
            }
        }
    }
}

/// The socket path for tests and tools that did not choose one.
pub fn socket_path_or_default(path: Option<PathBuf>) -> PathBuf {
    path.unwrap_or_else(crate::config::default_socket_path)
}
