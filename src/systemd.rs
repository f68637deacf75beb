//! systemd integration: socket activation (`LISTEN_FDS`), the notify protocol
//! (`READY=1`, `STATUS=`, `WATCHDOG=1`, `STOPPING=1`) and the gateway token
//! from `LoadCredential=`. Every piece is a no-op when the process was not
//! started by systemd, so `clawmux serve` behaves the same from a terminal.
//!
//! The wire formats come from the `sd-notify` crate; what is written here is
//! only the policy: which socket to take, what the status line says, and how
//! often the watchdog is fed.

use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::upstream::{Phase, Status};

/// The `LoadCredential=` name the unit uses for the gateway token; clawmux
/// reads `$CREDENTIALS_DIRECTORY/gateway-token`.
pub const TOKEN_CREDENTIAL: &str = "gateway-token";

/// The names an inherited socket may carry when systemd passes several
/// (`LISTEN_FDNAMES`; a socket unit's default name is the unit's name).
const SOCKET_NAMES: [&str; 2] = ["clawmux.socket", "clawmux"];

/// `STATUS=` updates are coalesced to at most one per this interval, so a
/// burst of clients connecting does not flood the service manager.
const STATUS_MIN_INTERVAL: Duration = Duration::from_millis(200);

/// Why an inherited socket cannot be used; `serve` exits 1 with this message.
#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("invalid socket-activation environment (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES): {0}")]
    Environment(std::io::Error),
    #[error("systemd passed {count} sockets ({names}) and none is named clawmux.socket; give clawmux a single ListenStream=")]
    Ambiguous { count: usize, names: String },
    #[error("the socket systemd passed as fd {fd} ({name}) is {why}; clawmux needs ListenStream=%t/clawmux.sock with Accept=no")]
    NotAUnixListener {
        fd: RawFd,
        name: String,
        why: String,
    },
}

/// A listening socket inherited from systemd.
#[derive(Debug)]
pub struct ActivatedSocket {
    pub listener: UnixListener,
    /// Its `LISTEN_FDNAMES` entry (`unknown` when systemd gave none).
    pub name: String,
    /// The other sockets systemd passed, by name: for the `[[sockets]]`
    /// policy sockets (`FileDescriptorName=` = the policy's `name`).
    pub others: Vec<(String, UnixListener)>,
}

static LISTEN_FDS_TAKEN: AtomicBool = AtomicBool::new(false);

/// What the service manager passed: the listening socket (socket
/// activation) and, apart, the descriptors a previous instance stored
/// (`FDSTORE=1`, names starting `clawmux-`; see [`crate::handover`]).
#[derive(Debug, Default)]
pub struct Passed {
    pub socket: Option<ActivatedSocket>,
    pub stored: Vec<(String, OwnedFd)>,
}

/// Whether a `LISTEN_FDNAMES` entry names a descriptor clawmux stored
/// itself rather than a socket unit's socket.
pub fn is_stored_name(name: &str) -> bool {
    name.starts_with("clawmux-")
}

/// Takes the descriptors systemd passed (`LISTEN_FDS`, for this process per
/// `LISTEN_PID`): the listening socket, if any, and the stored ones. Only
/// the first call takes anything; later calls return nothing.
///
/// # Safety
///
/// Call it before this process opens any file descriptor other than 0–2
/// (first thing in `main`): the descriptors from 3 on that `LISTEN_FDS`
/// names are then the ones the service manager passed, and nothing in the
/// process owns them, so taking ownership of them here cannot alias a
/// descriptor some other object will close or use.
pub unsafe fn take_passed() -> Result<Passed, ActivationError> {
    if LISTEN_FDS_TAKEN.swap(true, Ordering::SeqCst) {
        return Ok(Passed::default());
    }
    // Checks LISTEN_PID against our pid, verifies each fd is open (fcntl)
    // and marks it close-on-exec.
    let passed: Vec<(RawFd, String)> = sd_notify::listen_fds_with_names()
        .map_err(ActivationError::Environment)?
        .collect();
    let owned: Vec<(OwnedFd, String)> = passed
        .into_iter()
        // SAFETY: per this function's contract, these fds were inherited and
        // are owned by nothing else; sd-notify verified they are open, and the
        // swap above guarantees they are taken once.
        .map(|(fd, name)| (unsafe { OwnedFd::from_raw_fd(fd) }, name))
        .collect();
    let (stored, mut owned): (Vec<_>, Vec<_>) = owned
        .into_iter()
        .partition(|(_, name)| is_stored_name(name));
    let stored = stored.into_iter().map(|(fd, name)| (name, fd)).collect();
    let names: Vec<&str> = owned.iter().map(|(_, n)| n.as_str()).collect();
    let Some(index) = choose_socket(&names)? else {
        return Ok(Passed {
            socket: None,
            stored,
        });
    };
    let (fd, name) = owned.swap_remove(index);
    if let Err(why) = check_unix_listener(&fd) {
        return Err(ActivationError::NotAUnixListener {
            fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
            name,
            why,
        });
    }
    // The others serve policy sockets of the same name; one that is not a
    // listening unix socket is closed here (its policy socket is bound by
    // clawmux instead).
    let others = owned
        .into_iter()
        .filter_map(|(fd, name)| match check_unix_listener(&fd) {
            Ok(()) => {
                let listener = UnixListener::from(fd);
                crate::local::socket::size_backlog(&listener);
                Some((name, listener))
            }
            Err(why) => {
                tracing::warn!(name, "ignoring a passed socket: {why}");
                None
            }
        })
        .collect();
    let listener = UnixListener::from(fd);
    crate::local::socket::size_backlog(&listener);
    Ok(Passed {
        socket: Some(ActivatedSocket {
            listener,
            name,
            others,
        }),
        stored,
    })
}

/// Which of the passed sockets (by `LISTEN_FDNAMES` entry) to serve on: the
/// only one, or the one named after the socket unit.
fn choose_socket(names: &[&str]) -> Result<Option<usize>, ActivationError> {
    match names {
        [] => Ok(None),
        [_] => Ok(Some(0)),
        _ => {
            let named: Vec<usize> = (0..names.len())
                .filter(|&i| SOCKET_NAMES.contains(&names[i]))
                .collect();
            match named[..] {
                [i] => Ok(Some(i)),
                _ => Err(ActivationError::Ambiguous {
                    count: names.len(),
                    names: names.join(", "),
                }),
            }
        }
    }
}

/// The fd must be a listening unix stream socket (`Accept=no`).
pub fn check_unix_listener(fd: impl AsFd) -> Result<(), String> {
    use rustix::net::{sockopt, AddressFamily, SocketType};
    let fd = fd.as_fd();
    let domain = sockopt::socket_domain(fd).map_err(|e| format!("not a socket ({e})"))?;
    if domain != AddressFamily::UNIX {
        return Err("not a unix socket (ListenStream= must be a path)".into());
    }
    let kind = sockopt::socket_type(fd).map_err(|e| format!("unreadable ({e})"))?;
    if kind != SocketType::STREAM {
        return Err("not a stream socket (use ListenStream=, not ListenDatagram=)".into());
    }
    if !sockopt::socket_acceptconn(fd).map_err(|e| format!("unreadable ({e})"))? {
        return Err("not listening (Accept=yes passes connections, not the listener)".into());
    }
    Ok(())
}

/// The `STATUS=` line: the upstream phase (with the error code or the server
/// version) and the number of connected clients. Only codes, never messages,
/// so it stays one short line and can never carry a secret.
pub fn status_line(status: &Status, clients: usize) -> String {
    let clients = match clients {
        1 => "1 client".to_owned(),
        n => format!("{n} clients"),
    };
    let code = || {
        status
            .last_error
            .as_ref()
            .map_or_else(|| "no error".to_owned(), |e| e.code.clone())
    };
    let upstream = match status.phase {
        Phase::Ready => match &status.hello {
            Some(h) => format!("upstream ready (gateway {})", h.server_version),
            None => "upstream ready".to_owned(),
        },
        Phase::Backoff => match status.retry_after_ms() {
            Some(ms) => format!(
                "upstream backoff ({}), retry in {} s",
                code(),
                ms.div_ceil(1000)
            ),
            None => format!("upstream backoff ({})", code()),
        },
        Phase::Rejected => format!("upstream rejected ({}): fix the settings", code()),
        Phase::Stopped => return "stopping".to_owned(),
        phase => format!("upstream {}", phase.as_str()),
    };
    let line = format!("{upstream}; {clients}");
    // One line, whatever a gateway puts in its version string.
    line.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn notify(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!("cannot notify the service manager: {e}");
    }
}

/// Whether the service manager keeps a file descriptor store for this
/// service: `NOTIFY_SOCKET` is set, and `$FDSTORE` (systemd 254 and later
/// set it to `FileDescriptorStoreMax=`) or `$CLAWMUX_FDSTORE` (the
/// installed unit sets it to the same value, for older systemd such as
/// Debian 12's 252, which keeps a store but does not say so) is above 0.
/// A unit installed before handovers existed sets neither: its stop stays
/// the polite one (`shutdown` event, `1001`), as the store it lacks would
/// only close what was stored.
pub fn keeps_a_store() -> bool {
    let positive = |var: &str| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    };
    std::env::var_os("NOTIFY_SOCKET").is_some()
        && (positive("FDSTORE") || positive("CLAWMUX_FDSTORE"))
}

/// What the service manager is doing to the service as it sends `SIGTERM`
/// ([`stopping`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopping {
    /// A stop (`systemctl stop`, a logout, a shutdown): nothing will take
    /// what is stored, so the stop is the polite one.
    ForGood,
    /// A restart: the next start takes over what is stored.
    Restart,
    /// Not known (no `systemctl`, no bus, no job): stored, as for a restart.
    Unknown,
}

/// How long [`stopping`] waits for `systemctl`.
pub const STOPPING_QUERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Asks the service manager, at `SIGTERM`, whether its job on this service
/// is a stop or a restart: `systemd` sends `SIGTERM` for both, and only the
/// job tells them apart (`systemctl list-jobs`: `restart` while the stop of
/// a restart runs, `stop` for a stop). Its unit is read from the
/// process's cgroup (`…/user@1000.service/…/clawmux.service`), `--user`
/// when it runs under a user manager.
pub async fn stopping() -> Stopping {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let (unit, user) = own_unit(&cgroup);
    let mut cmd = tokio::process::Command::new("systemctl");
    if user {
        cmd.arg("--user");
    }
    cmd.args(["list-jobs", "--no-legend", "--plain", &unit])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    match tokio::time::timeout(STOPPING_QUERY_TIMEOUT, cmd.output()).await {
        Ok(Ok(out)) if out.status.success() => job_on(&String::from_utf8_lossy(&out.stdout), &unit),
        _ => Stopping::Unknown,
    }
}

/// The service unit a process runs in, by its cgroup path, and whether a
/// user manager runs it; `clawmux.service` under the user manager when the
/// path names no service (as the installed unit).
fn own_unit(cgroup: &str) -> (String, bool) {
    let path = cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .or_else(|| {
            cgroup
                .lines()
                .find_map(|l| l.split_once(":name=systemd:").map(|(_, p)| p))
        })
        .unwrap_or("");
    let unit = path
        .rsplit('/')
        .find(|c| c.ends_with(".service") && !c.starts_with("user@"));
    match unit {
        Some(unit) => (unit.to_owned(), path.contains("/user@")),
        None => ("clawmux.service".to_owned(), true),
    }
}

/// Reads `systemctl list-jobs --no-legend --plain` (`<id> <unit> <type>
/// <state>` per line): the job on `unit`.
fn job_on(list: &str, unit: &str) -> Stopping {
    for line in list.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.get(1) == Some(&unit) {
            return match cols.get(2).copied() {
                Some("stop") => Stopping::ForGood,
                Some("restart" | "try-restart" | "reload-or-restart" | "try-reload-or-restart") => {
                    Stopping::Restart
                }
                _ => Stopping::Unknown,
            };
        }
    }
    Stopping::Unknown
}

/// Stores descriptors in the service manager's store, each under its name
/// (`FDSTORE=1`, `FDNAME=`), for the next start of the service.
pub fn store(fds: &[(String, OwnedFd)]) -> std::io::Result<()> {
    for (name, fd) in fds {
        sd_notify::notify_with_fds(
            &[NotifyState::FdStore, NotifyState::FdName(name)],
            &[fd.as_fd()],
        )?;
    }
    Ok(())
}

/// Removes a stored descriptor by name (`FDSTOREREMOVE=1`, `FDNAME=`).
pub fn remove_stored(name: &str) {
    notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(name)]);
}

/// Tells the service manager this process is the service's main process
/// now (after a `SIGUSR2` upgrade; needs `NotifyAccess=all`), and ready.
pub fn now_main_process() {
    notify(&[NotifyState::MainPid(std::process::id()), NotifyState::Ready]);
}

/// Keeps the service manager informed while the broker runs.
#[derive(Debug)]
pub struct Notifier {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    ctx: Arc<Ctx>,
}

impl Notifier {
    /// Sends `READY=1` with a first `STATUS=` (the broker is listening; the
    /// gateway session may still be opening), then keeps `STATUS=` current
    /// and feeds the watchdog every `WATCHDOG_USEC / 2` when one is set.
    pub fn start(ctx: &Arc<Ctx>) -> Notifier {
        let status = status_line(&ctx.upstream().status(), ctx.hub.client_count());
        notify(&[NotifyState::Ready, NotifyState::Status(&status)]);
        let watchdog = sd_notify::watchdog_enabled();
        if let Some(timeout) = watchdog {
            tracing::info!(
                timeout_ms = timeout.as_millis() as u64,
                "systemd watchdog enabled"
            );
        }
        let stop = CancellationToken::new();
        let task = tokio::spawn(keep_informed(
            Arc::clone(ctx),
            stop.clone(),
            watchdog,
            status,
        ));
        Notifier {
            stop,
            task,
            ctx: Arc::clone(ctx),
        }
    }

    /// The broker it reports on.
    pub fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Stops reporting without telling the service manager anything (the
    /// broker was handed over: the next instance reports now).
    pub fn abandon(self) {
        self.stop.cancel();
        self.task.abort();
    }

    /// Sends `STOPPING=1`; no more status or watchdog messages follow.
    pub fn stopping(self) {
        self.stop.cancel();
        self.task.abort();
        notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }
}

async fn keep_informed(
    ctx: Arc<Ctx>,
    stop: CancellationToken,
    watchdog: Option<Duration>,
    mut last_status: String,
) {
    let mut upstream = ctx.upstream().subscribe();
    let mut clients = ctx.hub.watch_client_count();
    let mut upstream_open = true;
    let mut clients_open = true;
    let mut ping = watchdog.map(|timeout| {
        let mut i = tokio::time::interval((timeout / 2).max(Duration::from_millis(1)));
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let mut dirty = false;
    let mut next_status_at = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = async { ping.as_mut().expect("guarded").tick().await }, if ping.is_some() => {
                // Touch the client registry and the upstream status on the way:
                // if either were deadlocked this task would hang here, the pings
                // would stop, and systemd would restart the service.
                let _ = (ctx.hub.client_count(), ctx.upstream().phase());
                notify(&[NotifyState::Watchdog]);
            }
            changed = upstream.changed(), if upstream_open => {
                upstream_open = changed.is_ok();
                dirty = true;
            }
            changed = clients.changed(), if clients_open => {
                clients_open = changed.is_ok();
                dirty = true;
            }
            _ = tokio::time::sleep_until(next_status_at.into()), if dirty => {
                dirty = false;
                next_status_at = Instant::now() + STATUS_MIN_INTERVAL;
                let line = status_line(&upstream.borrow_and_update(), *clients.borrow_and_update());
                if line != last_status {
                    notify(&[NotifyState::Status(&line)]);
                    last_status = line;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_and_its_job_are_read_from_the_cgroup_and_systemctl() {
        let user = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/clawmux.service\n";
        assert_eq!(own_unit(user), ("clawmux.service".to_owned(), true));
        let system =
            "12:name=systemd:/system.slice/clawmux@x.service\n0::/system.slice/clawmux@x.service\n";
        assert_eq!(own_unit(system), ("clawmux@x.service".to_owned(), false));
        assert_eq!(own_unit("0::/\n"), ("clawmux.service".to_owned(), true));
        let jobs = "41 other.service start waiting\n42 clawmux.service stop running\n";
        assert_eq!(job_on(jobs, "clawmux.service"), Stopping::ForGood);
        assert_eq!(
            job_on("7 clawmux.service restart running\n", "clawmux.service"),
            Stopping::Restart
        );
        assert_eq!(job_on("", "clawmux.service"), Stopping::Unknown);
        assert_eq!(
            job_on("7 clawmux.service start waiting\n", "clawmux.service"),
            Stopping::Unknown
        );
    }
    use crate::protocol::{ErrorShape, StudioCode};
    use crate::upstream::UpstreamHello;

    fn status(phase: Phase) -> Status {
        Status {
            phase,
            generation: 1,
            ..Status::initial()
        }
    }

    #[test]
    fn status_lines_name_the_phase_and_the_clients() {
        let mut ready = status(Phase::Ready);
        ready.hello = Some(Arc::new(UpstreamHello {
            payload: serde_json::json!({}),
            protocol: 4,
            server_version: "2026.9.6\nx".into(),
            scopes: vec![],
            lost_scopes: vec![],
            max_payload: None,
            challenge_extra: Default::default(),
        }));
        assert_eq!(
            status_line(&ready, 1),
            "upstream ready (gateway 2026.9.6 x); 1 client"
        );
        let mut backoff = status(Phase::Backoff);
        backoff.last_error = Some(ErrorShape::studio(
            StudioCode::UpstreamError,
            "secret-free message",
        ));
        backoff.retry_at = Some(Instant::now() + Duration::from_millis(2500));
        assert_eq!(
            status_line(&backoff, 0),
            "upstream backoff (studio.upstream_error), retry in 3 s; 0 clients"
        );
        let mut rejected = status(Phase::Rejected);
        rejected.last_error = Some(ErrorShape::studio(StudioCode::GatewayTokenMissing, "m"));
        assert_eq!(
            status_line(&rejected, 2),
            "upstream rejected (studio.gateway_token_missing): fix the settings; 2 clients"
        );
        assert_eq!(
            status_line(&status(Phase::Connecting), 0),
            "upstream connecting; 0 clients"
        );
        assert_eq!(status_line(&status(Phase::Stopped), 3), "stopping");
    }

    #[test]
    fn the_only_socket_or_the_one_named_after_the_unit() {
        assert!(choose_socket(&[]).unwrap().is_none());
        assert_eq!(choose_socket(&["anything"]).unwrap(), Some(0));
        assert_eq!(
            choose_socket(&["other.socket", "clawmux.socket"]).unwrap(),
            Some(1)
        );
        let err = choose_socket(&["a", "b"]).unwrap_err().to_string();
        assert!(err.contains("2 sockets (a, b)"), "{err}");
    }

    #[test]
    fn only_listening_unix_stream_sockets_are_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("l.sock")).unwrap();
        assert!(check_unix_listener(&listener).is_ok());
        let stream = std::os::unix::net::UnixStream::connect(dir.path().join("l.sock")).unwrap();
        assert!(check_unix_listener(&stream)
            .unwrap_err()
            .contains("not listening"));
        let dgram = std::os::unix::net::UnixDatagram::unbound().unwrap();
        assert!(check_unix_listener(&dgram)
            .unwrap_err()
            .contains("not a stream"));
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(check_unix_listener(&tcp)
            .unwrap_err()
            .contains("not a unix socket"));
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(check_unix_listener(&file)
            .unwrap_err()
            .contains("not a socket"));
    }
}
