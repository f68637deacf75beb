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

/// How a broker starts: fresh, or taken over from the previous instance
/// (design §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Fresh,
    /// Handed over: the main connector waits for [`Sessions::take_over`]; the
    /// newest cursor the previous instance's event log handed out, when it
    /// said (its log goes on right after it).
    HandedOver {
        replay_newest: Option<u64>,
    },
}

impl Core {
    /// Builds the core and starts the main session's connector (tracked by
    /// `tracker`; it stops at `cancel`).
    pub fn start(
        settings: &Settings,
        tracker: &TaskTracker,
        cancel: &CancellationToken,
        start: Start,
    ) -> Core {
        let handed_over = start != Start::Fresh;
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
        hub.open_replay_log(
            settings,
            match start {
                Start::HandedOver { replay_newest } => replay_newest,
                Start::Fresh => None,
            },
        );
        let router = Arc::new(Router::new(
            limits.request_timeout,
            limits.run_timeout,
            limits.max_inflight,
        ));
        let sharing = Arc::new(Sharing::new());
        let sessions = Arc::new(Sessions::start(
            settings,
            &hub,
            &router,
            &sharing,
            tracker,
            cancel,
            handed_over,
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

/// The `reason` when the broker stops for its next instance (a `SIGUSR2`
/// upgrade): the socket keeps accepting, so clients reconnect at once.
pub const UPGRADE_REASON: &str = "clawmux upgrading";

/// One listening socket kept for a handover: a copy of its descriptor and
/// what the next instance needs to know of it.
#[derive(Debug)]
pub struct HeldListener {
    pub fd: std::os::fd::OwnedFd,
    /// `None` for the main socket, else the `[[sockets]]` name.
    pub policy: Option<String>,
    pub path: PathBuf,
    /// The socket file's inode, lock path and lock (when clawmux bound it).
    pub owned: Option<socket::SocketFileParts>,
}

impl HeldListener {
    fn new(
        listener: &tokio::net::UnixListener,
        policy: Option<String>,
        guard: &SocketGuard,
    ) -> HeldListener {
        // A copy that is closed on exec: only a handover's spawn passes it on.
        let fd = rustix::io::fcntl_dupfd_cloexec(listener, 3)
            .expect("a listener's descriptor can be copied");
        HeldListener {
            fd,
            policy,
            path: guard.path().to_owned(),
            owned: guard.handover_parts(),
        }
    }

    fn listener(&self) -> std::io::Result<std::os::unix::net::UnixListener> {
        Ok(rustix::io::fcntl_dupfd_cloexec(&self.fd, 3)?.into())
    }
}

/// A broker that stopped serving for its next instance but still holds its
/// sockets ([`crate::handover::old_instance::Released`]).
#[derive(Debug)]
pub struct Released {
    /// The settings it started with; what it connects to is `upstream`'s.
    settings: Settings,
    /// The stopped core's gateway session handle: a `SIGHUP` reload reaches
    /// its target until the core serving again (if any) takes over.
    upstream: crate::upstream::Upstream,
    guard: SocketGuard,
    policy_guards: Vec<SocketGuard>,
    held: Vec<HeldListener>,
    /// The clients, streams and connections stopped for the next instance.
    parcels: Vec<Box<dyn crate::parcels::Parcel>>,
    /// The gateway sessions and the runs, moving with them.
    core: crate::handover::clients::CoreParcels,
    /// When the clients were asked to stop: their pause began.
    stopped_at: std::time::Instant,
}

impl crate::handover::old_instance::Released for Released {
    type Broker = RunningBroker;

    fn take_clients(&mut self) -> crate::handover::clients::Packed {
        let packed = crate::handover::clients::pack(
            std::mem::take(&mut self.parcels),
            std::mem::take(&mut self.core),
        );
        tracing::info!(
            clients = packed.doc.clients.len(),
            dedicated = packed.doc.dedicated.len(),
            streams = packed.doc.streams.len(),
            "handover: clients ready to move"
        );
        packed
    }

    fn stopped_at(&self) -> std::time::Instant {
        self.stopped_at
    }

    fn finish(mut self) {
        self.guard.disarm();
        for g in &mut self.policy_guards {
            g.disarm();
        }
    }

    /// A fresh core takes the clients and the gateway session back.
    fn serve_again(
        mut self,
        packed: Option<crate::handover::clients::Packed>,
    ) -> Result<RunningBroker, SocketError> {
        let packed = packed.unwrap_or_else(|| self.take_clients());
        let Released {
            mut settings,
            upstream,
            guard,
            policy_guards,
            held,
            ..
        } = self;
        let io = |path: &Path| {
            let path = path.to_owned();
            move |cause| SocketError::Io { path, cause }
        };
        // What it last served (a reload's, also one during the upgrade),
        // not what it started with.
        upstream.target().apply_to(&mut settings);
        let main = held[0].listener().map_err(io(guard.path()))?;
        let mut policies = Vec::new();
        for (h, g) in held[1..].iter().zip(policy_guards) {
            let l = h.listener().map_err(io(&h.path))?;
            policies.push((h.policy.clone().unwrap_or_default(), l, g));
        }
        RunningBroker::serve_handed_over(
            settings,
            (main, guard),
            policies,
            Some(packed),
            crate::gate::Gate::opened(),
        )
    }
}

/// A broker serving on its socket.
#[derive(Debug)]
pub struct RunningBroker {
    ctx: Arc<Ctx>,
    guard: SocketGuard,
    /// The `[[sockets]]` sockets this broker bound.
    _policy_guards: Vec<SocketGuard>,
    /// A copy of every listener, for a handover and for serving again
    /// after one that failed.
    held: Vec<HeldListener>,
    /// The policy of each socket served (the main one first).
    policies: Vec<Arc<crate::policy::SocketPolicy>>,
    /// Cancelled first at shutdown: stop accepting before clients are told.
    accept_stop: CancellationToken,
    accept_task: tokio::task::JoinHandle<()>,
}

impl RunningBroker {
    /// Binds the socket and starts serving. Returns once the socket accepts
    /// connections (the upstream session opens in the background).
    pub async fn start(settings: Settings) -> Result<RunningBroker, SocketError> {
        Self::start_from(settings, None, None, crate::gate::Gate::opened())
    }

    /// Starts serving: on the sockets a previous instance handed over
    /// (`taken`, whose moved clients wait at `gate`), else on the one
    /// systemd passed (socket activation, see [`crate::systemd::take_passed`]:
    /// its file belongs to systemd and is never unlinked), else on its own,
    /// bound at `settings.socket_path`. `settings.socket_path` becomes the
    /// path actually served, so logs and tools show the truth.
    pub fn start_from(
        mut settings: Settings,
        taken: Option<crate::handover::Taken>,
        activated: Option<crate::systemd::ActivatedSocket>,
        gate: crate::gate::Gate,
    ) -> Result<RunningBroker, SocketError> {
        let served_path = |listener: &std::os::unix::net::UnixListener| {
            listener
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(PathBuf::from))
        };
        if let Some(t) = taken {
            crate::upgrade_record::took_over(
                t.state.from_pid,
                &t.state.from_version,
                t.clients.as_ref().map_or(0, |m| m.doc.clients.len()),
                t.clients.as_ref().map_or(0, |m| m.doc.streams.len()),
            );
            tracing::info!(
                from_pid = t.state.from_pid,
                from_version = %t.state.from_version,
                listeners = t.state.listeners.len(),
                clients = t.clients.as_ref().map_or(0, |m| m.doc.clients.len()),
                "took over from the previous instance"
            );
            let main = match (t.main, activated) {
                (Some(main), activated) => {
                    if let Some(socket) = activated {
                        tracing::warn!(name = %socket.name, "systemd also passed a socket; serving on the handed-over one");
                    }
                    main
                }
                (None, Some(socket)) => {
                    let path = served_path(&socket.listener)
                        .unwrap_or_else(|| settings.socket_path.clone());
                    (socket.listener, SocketGuard::activated(path))
                }
                (None, None) => {
                    return Err(SocketError::Io {
                        path: settings.socket_path.clone(),
                        cause: std::io::Error::other(
                            "the handed-over state has no main socket and systemd passed none",
                        ),
                    })
                }
            };
            return Self::serve_handed_over(settings, main, t.policies, t.clients, gate);
        }
        let (listener, guard, others) = match activated {
            Some(socket) => {
                if let Some(path) = served_path(&socket.listener) {
                    settings.socket_path = path;
                }
                let guard = SocketGuard::activated(settings.socket_path.clone());
                let others = socket
                    .others
                    .into_iter()
                    .map(|(n, l)| (n, l, None))
                    .collect();
                (socket.listener, guard, others)
            }
            None => {
                let (listener, guard) = socket::bind(&settings.socket_path)?;
                (listener, guard, Vec::new())
            }
        };
        let io = |cause| SocketError::Io {
            path: settings.socket_path.clone(),
            cause,
        };
        listener.set_nonblocking(true).map_err(io)?;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(io)?;
        Self::assemble(settings, listener, guard, others, Start::Fresh, gate)
    }

    /// Starts serving on the listeners the previous instance handed over
    /// ([`crate::handover`]), each with its guard: the main one, then the
    /// policy sockets by `[[sockets]]` name (one the settings no longer name
    /// is closed; one they newly name is bound). The clients and the
    /// gateway session in `packed` are taken over before the gateway
    /// session is read from (or, without one, before it connects), so no
    /// event reaches the broker before the clients it is for.
    fn serve_handed_over(
        mut settings: Settings,
        main: (std::os::unix::net::UnixListener, SocketGuard),
        policies: Vec<(String, std::os::unix::net::UnixListener, SocketGuard)>,
        packed: Option<crate::handover::clients::Packed>,
        gate: crate::gate::Gate,
    ) -> Result<RunningBroker, SocketError> {
        let (listener, guard) = main;
        settings.socket_path = guard.path().to_owned();
        let io = |source| SocketError::Io {
            path: settings.socket_path.clone(),
            cause: source,
        };
        listener.set_nonblocking(true).map_err(io)?;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(io)?;
        let others = policies
            .into_iter()
            .map(|(n, l, g)| (n, l, Some(g)))
            .collect();
        let start = Start::HandedOver {
            replay_newest: packed.as_ref().and_then(|m| m.doc.replay_newest),
        };
        let broker = Self::assemble(settings, listener, guard, others, start, gate)?;
        let n = crate::handover::clients::take_over(
            &broker.ctx,
            &broker.policies,
            packed.unwrap_or_default(),
        );
        if n > 0 {
            tracing::info!(clients = n, "took the clients over");
        }
        Ok(broker)
    }

    /// The assembly, on the main listener: `activated` are the policy
    /// sockets passed in, by name, with their guard (`None`: systemd's);
    /// the others are bound here.
    fn assemble(
        mut settings: Settings,
        listener: tokio::net::UnixListener,
        guard: SocketGuard,
        mut activated: Vec<(
            String,
            std::os::unix::net::UnixListener,
            Option<SocketGuard>,
        )>,
        start: Start,
        gate: crate::gate::Gate,
    ) -> Result<RunningBroker, SocketError> {
        let mut held = vec![HeldListener::new(&listener, None, &guard)];
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
            let (l, g) = match activated.iter().position(|(n, _, _)| *n == policy.name) {
                Some(i) => {
                    let (_, l, g) = activated.swap_remove(i);
                    if let Some(g) = &g {
                        policy.path = g.path().to_owned();
                    } else if let Some(p) = l
                        .local_addr()
                        .ok()
                        .and_then(|a| a.as_pathname().map(PathBuf::from))
                    {
                        policy.path = p;
                    }
                    l.set_nonblocking(true).map_err(io(&policy.path))?;
                    let g = g.unwrap_or_else(|| SocketGuard::activated(policy.path.clone()));
                    (l, g)
                }
                None => socket::bind_with_mode(&policy.path, policy.mode)?,
            };
            let l = tokio::net::UnixListener::from_std(l).map_err(io(&policy.path))?;
            held.push(HeldListener::new(&l, Some(policy.name.clone()), &g));
            tracing::info!(socket = %policy.name, path = %policy.path.display(), "policy socket listening");
            listeners.push((l, Arc::new(policy.clone())));
            policy_guards.push(g);
        }
        for (name, _, _) in &activated {
            tracing::warn!(
                name,
                "a socket was passed in that no [[sockets]] entry names; closing it"
            );
        }
        let main = listeners
            .iter()
            .find(|(_, p)| p.is_main())
            .map(|(_, p)| p.name.as_str());
        let others = || {
            listeners
                .iter()
                .filter(|(_, p)| !p.is_main())
                .map(|(_, p)| p.name.as_str())
        };
        let slots = crate::context::SocketSlots::new(
            main,
            others(),
            crate::local::fdlimit::connection_budget(
                settings.limits.max_connections(),
                crate::local::fdlimit::soft_limit(),
            ),
        );
        let handshakes = crate::context::SocketSlots::new(main, others(), MAX_HANDSHAKES);
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let Core {
            hub,
            router,
            sharing,
            sessions,
            dispatcher,
        } = Core::start(&settings, &tracker, &cancel, start);
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
            handshakes,
            dedicated,
            allowed_uids: Vec::new(),
            cancel,
            handover: crate::parcels::Handover::new(gate),
            tracker,
            slots,
        });
        ctx.tracker.spawn(sweep_deadlines(Arc::clone(&ctx)));
        let accept_stop = ctx.cancel.child_token();
        let policies = listeners.iter().map(|(_, p)| Arc::clone(p)).collect();
        let loops: Vec<_> = listeners
            .into_iter()
            .map(|(listener, policy)| {
                crate::local::accept_loop(listener, policy, Arc::clone(&ctx), accept_stop.clone())
            })
            .collect();
        // Nothing is accepted before the gate opens: a connection accepted
        // by an upgrade's new instance that then fails would be lost, while
        // in the backlog the old one serving again takes it.
        let (gate, stop) = (ctx.handover.gate.clone(), accept_stop.clone());
        let accept_task = ctx.tracker.spawn(async move {
            tokio::select! {
                biased;
                _ = stop.cancelled() => {}
                _ = gate.passed() => {
                    futures_util::future::join_all(loops).await;
                }
            }
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
            held,
            policies,
            accept_stop,
            accept_task,
        })
    }

    /// The sockets were stored for the next start (systemd's store): leave
    /// their files in place at the stop.
    pub fn keep_socket_files(&mut self) {
        self.guard.disarm();
        for g in &mut self._policy_guards {
            g.disarm();
        }
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

    /// Stops in order, never taking longer than `deadline` (and the event
    /// log's close, [`REPLAY_LOG_CLOSE_WAIT`] at least):
    /// 1. stop accepting (a socket-activated listener keeps queueing new
    ///    connections in systemd for the next start);
    /// 2. queue the gateway's own `shutdown` event (`{reason}`, with each
    ///    client's next `seq`) for every connected client;
    /// 3. close every client `1001 going away` after what is queued, and the
    ///    upstream sessions (main and narrower) with a normal close;
    /// 4. wait for all of it until the deadline; a client that does not read
    ///    is cut off (its writer is abandoned), so it cannot hold the exit;
    /// 5. close the event log (its last records written).
    ///
    /// Returns false when the deadline cut something off.
    pub async fn shutdown(mut self, deadline: Duration) -> bool {
        self.stop_serving(deadline, Some(SHUTDOWN_REASON)).await
    }

    /// The socket policies this broker serves, by `[[sockets]]` name
    /// (`default`: the main socket).
    pub fn policies(&self) -> &[Arc<crate::policy::SocketPolicy>] {
        &self.policies
    }

    /// `reason`: the `shutdown` event's, for the clients still connected
    /// (`None` at a handover: the clients left are moving).
    async fn stop_serving(&mut self, deadline: Duration, reason: Option<&str>) -> bool {
        tracing::info!(
            clients = self.ctx.hub.client_count(),
            deadline_ms = deadline.as_millis() as u64,
            reason,
            "clawmux shutting down"
        );
        let until = tokio::time::Instant::now() + deadline;
        self.accept_stop.cancel();
        if !self.accept_task.is_finished() {
            let _ = tokio::time::timeout_at(until, &mut self.accept_task).await;
        }
        if let Some(reason) = reason {
            self.ctx
                .hub
                .publish_local("shutdown", &serde_json::json!({ "reason": reason }));
        }
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
        // Closing the log writes its last records: local work, which waits
        // on no peer, so however short the deadline it gets its own bound.
        let log_until = until.max(tokio::time::Instant::now() + REPLAY_LOG_CLOSE_WAIT);
        if tokio::time::timeout_at(log_until, self.ctx.hub.close_replay_log())
            .await
            .is_err()
        {
            tracing::warn!("the replay log did not close before the shutdown deadline");
            clean = false;
        }
        clean
    }
}

/// A handover drives the serving broker through this (its protocol is
/// [`crate::handover`]'s, below this assembly).
impl crate::handover::old_instance::Broker for RunningBroker {
    type Released = Released;

    /// What a handover passes on: the state and the descriptors it names
    /// (copies; this instance's own stay open until it exits).
    fn handover(
        &self,
    ) -> std::io::Result<(crate::handover::State, Vec<(String, std::os::fd::OwnedFd)>)> {
        collect(&self.held)
    }

    /// Stops serving for the next instance ([`crate::handover`]): as
    /// [`RunningBroker::shutdown`], with `shutdown {reason: "clawmux
    /// upgrading"}`, but the sockets stay bound and open, for the next
    /// instance or for serving again if it fails.
    async fn release(mut self, deadline: Duration) -> Released {
        let until = tokio::time::Instant::now() + deadline;
        self.accept_stop.cancel();
        if tokio::time::timeout_at(until, &mut self.accept_task)
            .await
            .is_ok()
        {
            // Finished: `stop_serving` must not poll it again.
            self.accept_task = tokio::spawn(async {});
        }
        // 1. Every client stops where it is and is left for the next
        //    instance (or closed `1012`, if it cannot move). Stopping waits
        //    on no peer, so it has its own bound, not the shutdown
        //    timeout's (which may be 0): what has not stopped when the
        //    parcels are packed cannot move.
        self.ctx.handover.requested.cancel();
        let stopped_at = std::time::Instant::now();
        let paused = tokio::time::Instant::now() + CLIENTS_STOP_WAIT;
        if !self.ctx.handover.all_left(paused).await {
            tracing::warn!("handover: some clients did not stop in time");
        }
        // 2. The gateway session stops at a message boundary and moves
        //    with them, unless it cannot (`wss://`): its requests in flight
        //    for the moving clients move too; every other one is answered
        //    here (failed, with whether it was sent).
        let core = crate::handover::clients::pack_core(&self.ctx).await;
        // 3. The sessions end: each request still in flight on them is
        //    answered (failed, with whether it was sent) into its client's
        //    queue.
        if !self
            .stop_serving(
                until.saturating_duration_since(tokio::time::Instant::now()),
                None,
            )
            .await
        {
            tracing::warn!("handover: the stop did not finish within its deadline");
        }
        let parcels = self.ctx.handover.take();
        let mut core = core;
        core.replay_newest = Some(self.ctx.hub.replay_window().newest_seq);

        Released {
            settings: self.ctx.settings.clone(),
            upstream: self.ctx.upstream().clone(),
            guard: self.guard,
            policy_guards: self._policy_guards,
            held: self.held,
            parcels,
            core,
            stopped_at,
        }
    }
}

/// The least a stop waits for the replay log to close (its last records
/// written), whatever `--shutdown-timeout` says: a stop takes at most its
/// deadline and this.
pub const REPLAY_LOG_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// How long a handover's clients have to stop ([`RunningBroker`]'s
/// `release`): stopping waits on no peer, so the shutdown timeout does not
/// shorten it.
const CLIENTS_STOP_WAIT: Duration =
    Duration::from_millis(crate::local::ws::HANDOVER_PAUSE_TIMEOUT.as_millis() as u64 + 500);

/// The most a handover's release takes beyond its deadline: the bounds of
/// its steps that wait on no peer, which the shutdown timeout does not
/// shorten (the clients' stop, the gateway sessions', all at once, and
/// the event log's close).
pub const RELEASE_OWN_BOUNDS: Duration = Duration::from_millis(
    (CLIENTS_STOP_WAIT.as_millis()
        + crate::handover::gateway::UPSTREAM_HANDOVER_WAIT.as_millis()
        + REPLAY_LOG_CLOSE_WAIT.as_millis()) as u64,
);

// The new instance of an upgrade waits for the release for the shutdown
// timeout and its margin: the release's own bounds fit in that margin.
const _: () =
    assert!(RELEASE_OWN_BOUNDS.as_millis() < crate::handover::upgrade::RELEASE_MARGIN.as_millis());

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

/// The state and the descriptors that go with it (copies of the broker's
/// own, closed on exec), for an upgrade or the systemd store.
pub(crate) fn collect(
    held: &[HeldListener],
) -> std::io::Result<(
    crate::handover::state::State,
    Vec<(String, std::os::fd::OwnedFd)>,
)> {
    let mut fds = Vec::new();
    let mut listeners = Vec::new();
    for h in held {
        let fd_name = match &h.policy {
            None => crate::handover::state::MAIN_LISTENER.to_owned(),
            Some(name) => crate::handover::state::policy_listener(name),
        };
        fds.push((fd_name.clone(), rustix::io::fcntl_dupfd_cloexec(&h.fd, 3)?));
        let owned = match &h.owned {
            None => None,
            Some(file) => {
                fds.push((
                    crate::handover::state::lock_name(&fd_name),
                    rustix::io::fcntl_dupfd_cloexec(&file.lock, 3)?,
                ));
                Some(crate::handover::state::OwnedSocket {
                    ino: file.ino,
                    lock_path: file.lock_path.clone(),
                })
            }
        };
        listeners.push(crate::handover::state::Listener {
            fd_name,
            policy: h.policy.clone(),
            path: h.path.clone(),
            owned,
        });
    }
    let state = crate::handover::state::State {
        format: crate::handover::state::FORMAT,
        from_version: env!("CARGO_PKG_VERSION").to_owned(),
        from_pid: std::process::id(),
        listeners,
    };
    Ok((state, fds))
}
