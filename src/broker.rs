//! Assembly: binds the sockets, builds the core and the shared
//! [`Ctx`], starts the sessions, the request sweeper and the accept loops,
//! and shuts them down in order.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::context::{Ctx, MAX_HANDSHAKES};

use crate::config::Settings;
use crate::dispatch::Dispatcher;
use crate::hub::{Hub, QueueLimits};
use crate::local::socket::{self, SocketError, SocketGuard};
use crate::router::Router;
use crate::sessions::Sessions;
use crate::sharing::Sharing;

/// The broker's core: everything between the local side and the gateway.
pub struct Core {
    pub hub: Arc<Hub>,
    pub router: Arc<Router>,
    pub sharing: Arc<Sharing>,
    pub sessions: Arc<Sessions>,
    pub dispatcher: Arc<Dispatcher>,
}

impl Core {
    /// Builds the core and starts the main session's connector (tracked by
    /// `tracker`; it stops at `cancel`).
    pub fn start(settings: &Settings, tracker: &TaskTracker, cancel: &CancellationToken) -> Core {
        let limits = &settings.limits;
        let hub = Arc::new(Hub::new(
            QueueLimits {
                soft_bytes: limits.queue_soft_bytes,
                hard_bytes: limits.queue_hard_bytes,
                grace: limits.slow_grace,
            },
            limits.max_clients,
        ));
        hub.set_queue_budget(limits.queue_total_bytes);
        hub.open_replay_log(settings);
        let router = Arc::new(Router::new(
            limits.request_timeout,
            limits.run_timeout,
            limits.max_inflight,
        ));
        let sharing = Arc::new(Sharing::new());
        let sessions = Arc::new(Sessions::start(
            settings, &hub, &router, &sharing, tracker, cancel,
        ));
        let dispatcher = Arc::new(Dispatcher::new(
            Arc::clone(&hub),
            Arc::clone(&router),
            Arc::clone(&sharing),
            Arc::clone(&sessions),
        ));
        Core {
            hub,
            router,
            sharing,
            sessions,
            dispatcher,
        }
    }
}

/// How often pending requests are checked against their deadlines, and
/// client queues for stalls (the resolution of `slow_grace`).
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// The `reason` of the `shutdown` event local clients get when the broker stops.
pub const SHUTDOWN_REASON: &str = "clawmux stopping";

/// A broker serving on its socket.
#[derive(Debug)]
pub struct RunningBroker {
    ctx: Arc<Ctx>,
    guard: SocketGuard,
    /// The `[[sockets]]` sockets this broker bound.
    _policy_guards: Vec<SocketGuard>,
    /// Cancelled first at shutdown: stop accepting before clients are told.
    accept_stop: CancellationToken,
    accept_task: tokio::task::JoinHandle<()>,
}

impl RunningBroker {
    /// Binds the socket and starts serving. Returns once the socket accepts
    /// connections (the upstream session opens in the background).
    pub async fn start(settings: Settings) -> Result<RunningBroker, SocketError> {
        let (listener, guard) = socket::bind(&settings.socket_path)?;
        let listener =
            tokio::net::UnixListener::from_std(listener).map_err(|source| SocketError::Io {
                path: settings.socket_path.clone(),
                cause: source,
            })?;
        Self::start_with_listener(settings, listener, guard)
    }

    /// Starts serving on a listener systemd passed in (socket activation,
    /// see [`crate::systemd::take_activated_listener`]). The socket file
    /// belongs to systemd and is never unlinked; `settings.socket_path` is
    /// replaced by the listener's own path so logs and tools show the truth.
    pub fn start_with_activated(
        mut settings: Settings,
        listener: std::os::unix::net::UnixListener,
        others: Vec<(String, std::os::unix::net::UnixListener)>,
    ) -> Result<RunningBroker, SocketError> {
        if let Some(path) = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(PathBuf::from))
        {
            settings.socket_path = path;
        }
        let io = |source| SocketError::Io {
            path: settings.socket_path.clone(),
            cause: source,
        };
        listener.set_nonblocking(true).map_err(io)?;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(io)?;
        let guard = SocketGuard::activated(settings.socket_path.clone());
        Self::start_with_listener_and(settings, listener, guard, others)
    }

    fn start_with_listener(
        settings: Settings,
        listener: tokio::net::UnixListener,
        guard: SocketGuard,
    ) -> Result<RunningBroker, SocketError> {
        Self::start_with_listener_and(settings, listener, guard, Vec::new())
    }

    /// `activated`: policy sockets systemd passed, by name; the others are bound here.
    fn start_with_listener_and(
        mut settings: Settings,
        listener: tokio::net::UnixListener,
        guard: SocketGuard,
        mut activated: Vec<(String, std::os::unix::net::UnixListener)>,
    ) -> Result<RunningBroker, SocketError> {
        // The `[[sockets]]` sockets, each with its own policy (bound before
        // anything starts, so a socket that cannot be bound stops `serve`).
        let mut listeners = vec![(
            listener,
            Arc::new(crate::policy::SocketPolicy::main(
                settings.socket_path.clone(),
            )),
        )];
        let mut policy_guards = Vec::new();
        for policy in &mut settings.sockets {
            let io = |path: &Path| {
                let path = path.to_owned();
                move |cause| SocketError::Io { path, cause }
            };
            let (l, g) = match activated.iter().position(|(n, _)| *n == policy.name) {
                Some(i) => {
                    let (_, l) = activated.swap_remove(i);
                    if let Some(p) = l
                        .local_addr()
                        .ok()
                        .and_then(|a| a.as_pathname().map(PathBuf::from))
                    {
                        policy.path = p;
                    }
                    l.set_nonblocking(true).map_err(io(&policy.path))?;
                    (l, SocketGuard::activated(policy.path.clone()))
                }
                None => socket::bind_with_mode(&policy.path, policy.mode)?,
            };
            let l = tokio::net::UnixListener::from_std(l).map_err(io(&policy.path))?;
            tracing::info!(socket = %policy.name, path = %policy.path.display(), "policy socket listening");
            listeners.push((l, Arc::new(policy.clone())));
            policy_guards.push(g);
        }
        for (name, _) in &activated {
            tracing::warn!(
                name,
                "systemd passed a socket no [[sockets]] entry names; closing it"
            );
        }
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let Core {
            hub,
            router,
            sharing,
            sessions,
            dispatcher,
        } = Core::start(&settings, &tracker, &cancel);
        let dedicated = Arc::new(crate::dedicated_registry::Dedicated::new(
            settings.limits.max_dedicated,
        ));
        let ctx = Arc::new(Ctx {
            settings,
            hub,
            router,
            sharing,
            sessions,
            dispatcher,
            handshakes: Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES)),
            dedicated,
            allowed_uids: Vec::new(),
            cancel,
            tracker,
        });
        ctx.tracker.spawn(sweep_deadlines(Arc::clone(&ctx)));
        let accept_stop = ctx.cancel.child_token();
        let loops: Vec<_> = listeners
            .into_iter()
            .map(|(listener, policy)| {
                crate::local::accept_loop(listener, policy, Arc::clone(&ctx), accept_stop.clone())
            })
            .collect();
        let accept_task = ctx.tracker.spawn(async move {
            futures_util::future::join_all(loops).await;
        });
        tracing::info!(
            socket = %guard.path().display(),
            activated = guard.is_activated(),
            gateway = %crate::config::redact_url(&ctx.settings.gateway_url),
            "clawmux listening"
        );
        Ok(RunningBroker {
            ctx,
            guard,
            _policy_guards: policy_guards,
            accept_stop,
            accept_task,
        })
    }

    pub fn socket_path(&self) -> &Path {
        self.guard.path()
    }

    pub fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Whether the listener came from systemd.
    pub fn is_socket_activated(&self) -> bool {
        self.guard.is_activated()
    }

    /// Stops in order, never taking longer than `deadline`:
    /// 1. stop accepting (a socket-activated listener keeps queueing new
    ///    connections in systemd for the next start);
    /// 2. queue the gateway's own `shutdown` event (`{reason}`, with each
    ///    client's next `seq`) for every connected client;
    /// 3. close every client `1001 going away` after what is queued, and the
    ///    upstream sessions (main and narrower) with a normal close;
    /// 4. wait for all of it until the deadline; a client that does not read
    ///    is cut off (its writer is abandoned), so it cannot hold the exit.
    ///
    /// Returns false when the deadline cut something off.
    pub async fn shutdown(mut self, deadline: Duration) -> bool {
        tracing::info!(
            clients = self.ctx.hub.client_count(),
            deadline_ms = deadline.as_millis() as u64,
            "clawmux shutting down"
        );
        let until = tokio::time::Instant::now() + deadline;
        self.accept_stop.cancel();
        let _ = tokio::time::timeout_at(until, &mut self.accept_task).await;
        self.ctx.hub.publish_local(
            "shutdown",
            &serde_json::json!({ "reason": SHUTDOWN_REASON }),
        );
        self.ctx.cancel.cancel();
        self.ctx.tracker.close();
        let mut clean = true;
        if tokio::time::timeout_at(until, self.ctx.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                tasks = self.ctx.tracker.len(),
                "some connections or gateway sessions did not finish before the shutdown deadline"
            );
            clean = false;
        }
        if tokio::time::timeout_at(until, self.ctx.hub.close_replay_log())
            .await
            .is_err()
        {
            tracing::warn!("the replay log did not close before the shutdown deadline");
            clean = false;
        }
        clean
    }
}

/// Queued bytes whose release, since the last time memory was handed
/// back, makes the sweep hand free memory back to the system.
const RETURN_MEMORY_AFTER: usize = 32 * 1024 * 1024;

async fn sweep_deadlines(ctx: Arc<Ctx>) {
    let mut interval = tokio::time::interval(SWEEP_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The most the queues held since memory was last handed back.
    let mut queued_peak = 0usize;
    loop {
        tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            _ = interval.tick() => {
                let now = Instant::now();
                ctx.hub.sweep_stalled(now);
                // After a burst (slow clients cut, queues drained) the
                // allocator keeps the freed pages: hand them back, so the
                // broker's memory comes back near idle.
                let queued = ctx.hub.queue_budget().used();
                queued_peak = queued_peak.max(queued);
                if queued_peak.saturating_sub(queued) >= RETURN_MEMORY_AFTER {
                    crate::bounds::return_free_memory();
                    queued_peak = queued;
                }
                let expired = ctx.router.expire(now);
                if expired > 0 {
                    tracing::info!(expired, "requests timed out");
                }
            }
        }
    }
}
