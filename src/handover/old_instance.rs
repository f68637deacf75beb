//! The old instance's half of a handover: a `SIGUSR2` upgrade
//! ([`upgrade`], talking to its [`Successor`]) and a stop under a service
//! manager that keeps a file descriptor store ([`store_for_next_start`]).
//!
//! Both drive the serving broker through [`Broker`] and [`Released`]: the
//! broker assembles everything a handover moves, so it sits above this
//! layer; it implements the two traits (`crate::broker`), and this half of
//! the protocol needs nothing else of it.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::time::Duration;

use super::clients::{self, Packed};
use super::state::{self, State};
use super::upgrade::{Program, Successor, SERVE_TIMEOUT, START_TIMEOUT};
use crate::local::socket::SocketError;

/// The serving broker, as a handover drives it.
pub trait Broker: Sized + Send {
    /// The broker once it stopped serving for its next instance.
    type Released: Released<Broker = Self> + Send;

    /// What a handover passes on: the state and the descriptors it names
    /// (copies; this instance's own stay open until it exits).
    fn handover(&self) -> std::io::Result<(State, Vec<(String, OwnedFd)>)>;

    /// Stops serving for the next instance within `deadline`; the sockets
    /// stay bound and open, for it or for serving again.
    fn release(self, deadline: Duration) -> impl Future<Output = Self::Released> + Send;
}

/// A broker that stopped serving for its next instance but still holds its
/// sockets: [`Released::finish`] once the next instance serves, or
/// [`Released::serve_again`] if it failed.
pub trait Released: Sized {
    type Broker;

    /// What moves: the clients document and the sockets (taken once; the
    /// clients' queues are emptied into it).
    fn take_clients(&mut self) -> Packed;

    /// When its clients were asked to stop: the pause they see began.
    fn stopped_at(&self) -> std::time::Instant;

    /// The next instance serves: leave the socket files (now its) in place.
    fn finish(self);

    /// The next instance failed: serve again on the same sockets, taking
    /// the clients and the gateway session back as the next instance
    /// would have. `packed`: what [`Released::take_clients`] gave, if it
    /// was called.
    fn serve_again(self, packed: Option<Packed>) -> Result<Self::Broker, SocketError>;
}

/// How an upgrade ended.
#[derive(Debug)]
pub enum Outcome<B> {
    /// The new instance (this process) serves: this one exits, or stays
    /// for its terminal.
    Upgraded(super::upgrade::Next, Moved),
    /// This one serves (still, or again): why the upgrade did not happen.
    StillServing(B, String),
    /// The new one failed after this one stopped, and serving again failed
    /// too: the process ends with this error.
    Lost(String),
}

/// What an instance packed for the one that now serves, still held here:
/// its copies of the moved sockets, the clients' entries, their
/// registrations in this instance's core and its own connections on them.
#[derive(Debug)]
pub struct Moved(Box<Packed>);

impl Moved {
    /// This process stays (for its terminal): its memory comes back, let
    /// go of on a thread of its own at the lowest priority (as
    /// [`Moved::leave_to_exit`] says why), while this one goes on standing
    /// in for the new instance.
    pub fn let_go(self) {
        self.let_go_then(|| {});
    }

    /// This process is about to exit: it lets go of everything at the
    /// lowest priority first, and returns once it has. Taking a thousand
    /// clients apart (a lock or two, a deregistration, a `close` and a few
    /// frees for each) and the exit itself would otherwise take the CPU
    /// the next instance needs just then, to deliver what queued during
    /// the pause; at the lowest priority they run only on a core nothing
    /// else wants, which on a busy machine can take a while. Meanwhile the
    /// caller still hears signals: what is asked of this process until it
    /// exits is the new instance's. Its copies of the moved sockets close
    /// here, as they would have: a connection the next instance ends must
    /// not stay open in this process.
    pub async fn leave_to_exit(self) {
        lowest_priority();
        crate::test_hook::hold_at("hold-before-exit").await;
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        self.let_go_then(move || {
            let _ = done_tx.send(());
        });
        // An error: the thread could not start, and it was let go of here.
        let _ = done_rx.await;
    }

    /// Lets go of what was packed on a thread of its own, inside the
    /// runtime, as where it was packed (letting a client go may talk to
    /// what runs there), at the lowest priority, then calls `then`. Where
    /// no thread can be started, on this one.
    fn let_go_then(self, then: impl FnOnce() + Send + 'static) {
        let packed = self.0;
        let runtime = tokio::runtime::Handle::try_current().ok();
        let spawned = std::thread::Builder::new()
            .name("clawmux-let-go".into())
            .spawn(move || {
                let _inside = runtime.as_ref().map(tokio::runtime::Handle::enter);
                // This thread's own priority (on Linux, pid 0 is the caller).
                let _ = rustix::process::setpriority_process(None, LOWEST_PRIORITY);
                drop(packed);
                then();
            });
        if let Err(e) = spawned {
            tracing::debug!("cannot start a thread to let the moved clients go ({e})");
        }
    }
}

/// The lowest scheduling priority (nice value) a thread can have.
const LOWEST_PRIORITY: i32 = 19;

/// Every thread of this process at the lowest scheduling priority (nice
/// 19; a thread started later inherits it). On Linux a priority is a
/// thread's own, so each is set; one that cannot be (gone meanwhile) is
/// left as it is. Lowering a priority needs no privilege.
fn lowest_priority() {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    for task in tasks.flatten() {
        let tid = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok());
        if let Some(tid) = tid.and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::setpriority_process(Some(tid), LOWEST_PRIORITY);
        }
    }
}

/// Hands the broker over to a new instance of `program`. Nothing is lost
/// or repeated either way: until the new instance says `valid` this broker
/// serves untouched; until it says `commit` it can serve every moved
/// client again exactly (the new one touched none); after, they are the
/// new instance's (the control protocol: [`super::upgrade`]).
pub async fn upgrade<B: Broker>(
    broker: B,
    program: &Program,
    shutdown_timeout: Duration,
) -> Outcome<B> {
    let (state, fds) = match broker.handover() {
        Ok(x) => x,
        Err(e) => return Outcome::StillServing(broker, format!("cannot copy the sockets: {e}")),
    };
    let mut next = match Successor::spawn(program, &state, fds) {
        Ok(next) => next,
        Err(e) => {
            let why = format!("cannot start {}: {e}", program.path.display());
            return Outcome::StillServing(broker, why);
        }
    };
    tracing::info!(pid = next.pid(), program = %program.path.display(), "upgrade: new instance started");
    if let Err(why) = next.expect("valid", START_TIMEOUT).await {
        next.abandon();
        return Outcome::StillServing(broker, why);
    }
    let mut released = broker.release(shutdown_timeout).await;
    let packed = released.take_clients();
    let clients = packed.doc.clients.len();
    let ready = match next.send_released(&packed).await {
        Ok(()) => next.expect("ready", SERVE_TIMEOUT).await,
        Err(e) => Err(format!("cannot pass the clients to the new instance ({e})")),
    };
    // Until `commit` is written the new instance has read and written
    // nothing moved: this one can serve it all again, exactly (no byte
    // twice, none lost).
    let committed = match ready {
        Ok(()) => next
            .commit()
            .await
            .map_err(|e| format!("the new instance is gone before the commit ({e})")),
        Err(why) => Err(why),
    };
    if let Err(why) = committed {
        next.end().await;
        return match released.serve_again(Some(packed)) {
            Ok(broker) => Outcome::StillServing(broker, why),
            Err(e) => Outcome::Lost(format!("{why}; serving again failed too: {e}")),
        };
    }
    // Committed: the moved sockets are the new instance's alone, whatever
    // happens next.
    match next.expect("serving", SERVE_TIMEOUT).await {
        Ok(()) => {
            tracing::info!(
                pid = next.pid(),
                clients,
                paused_ms = released.stopped_at().elapsed().as_millis() as u64,
                "upgrade: the new instance serves; exiting"
            );
            released.finish();
            Outcome::Upgraded(next.into_next(), Moved(Box::new(packed)))
        }
        Err(why) => {
            // It failed after it took everything: its clients lose their
            // connection (nothing is sent twice) and reconnect here, where
            // the event log goes on with a restart gap they are told of.
            next.end().await;
            drop(packed);
            crate::systemd::now_main_process();
            let why = format!("{why} (after the commit: its clients reconnect)");
            match released.serve_again(Some(Default::default())) {
                Ok(broker) => Outcome::StillServing(broker, why),
                Err(e) => Outcome::Lost(format!("{why}; serving again failed too: {e}")),
            }
        }
    }
}

/// Under a service manager with a file descriptor store: hands the broker
/// over to its next start through the store (design §11). The clients stop
/// where they are and are stored with their sockets, the state and the
/// sockets clawmux bound itself (a socket systemd passed stays systemd's);
/// the next start takes them over, so a restart is a pause. A stop the
/// broker cannot tell from a restart ([`crate::systemd::stopping`])
/// leaves them to systemd, which closes them once the service is down:
/// clients see their connection end without a close frame, and reconnect
/// when it is back (docs/src/restarts.md).
pub async fn store_for_next_start<B: Broker>(
    broker: B,
    shutdown_timeout: Duration,
) -> std::io::Result<()> {
    let (mut state, mut fds) = broker.handover()?;
    // What systemd passed stays in systemd's hands.
    state.listeners.retain(|l| l.owned.is_some());
    fds.retain(|(name, _)| {
        state
            .listeners
            .iter()
            .any(|l| *name == l.fd_name || *name == state::lock_name(&l.fd_name))
    });
    let mut released = broker.release(shutdown_timeout).await;
    let packed = released.take_clients();
    let clients = packed.doc.clients.len();
    fds.push((state::STATE_FD_NAME.to_owned(), state.to_memfd()?));
    fds.push((clients::CLIENTS_FD_NAME.to_owned(), packed.doc.to_memfd()?));
    if let Some(frames) = packed.doc.frames_memfd()? {
        fds.push((clients::FRAMES_FD_NAME.to_owned(), frames));
    }
    if let Some(fd) = packed.upstream {
        fds.push((clients::UPSTREAM_FD_NAME.to_owned(), fd));
    }
    fds.extend(
        packed
            .clients
            .into_iter()
            .map(|(id, fd)| (clients::client_fd_name(id), fd)),
    );
    for (i, (client, gateway)) in packed.dedicated.into_iter().enumerate() {
        let (client_name, gateway_name) = clients::dedicated_fd_names(i);
        fds.push((client_name, client));
        fds.push((gateway_name, gateway));
    }
    for (i, stream) in packed.streams.into_iter().enumerate() {
        fds.push((clients::stream_fd_name(i), stream));
    }
    for (i, session) in packed.narrower.into_iter().enumerate() {
        fds.push((clients::narrower_fd_name(i), session));
    }
    match crate::systemd::store(&fds) {
        Ok(()) => {
            released.finish();
            tracing::info!(
                descriptors = fds.len(),
                clients,
                "stored the sockets and clients for the next start"
            );
        }
        Err(e) => tracing::warn!(
            "cannot store the sockets and clients for the next start ({e}); they are closed"
        ),
    }
    tracing::info!("clawmux stopped");
    Ok(())
}
