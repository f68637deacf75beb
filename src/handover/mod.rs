//! Handing the broker over to its next instance (design §11), so
//! a restart or an upgrade keeps its sockets: nothing that connects in
//! between is refused, and a new binary that cannot start leaves the old
//! one serving.
//!
//! What moves (state [`FORMAT`] 1): every listening socket (the main one
//! and the `[[sockets]]` policy sockets) with its socket file's lock, in
//! the state; once the old instance has released, every `/ws` client and
//! the `ws://` gateway connection ([`clients`]): each socket with what it
//! was in the middle of. docs/src/restarts.md says what does not move.
//!
//! Two ways in, one format:
//! - `SIGUSR2` ([`old_instance::upgrade`]): the broker starts the `clawmux` at the path it
//!   was started from with the same arguments, passes the state (a sealed
//!   memfd) and the descriptors by inheritance, named in [`FDS_ENV`], and
//!   talks to it over a control socket: `valid` (the new one read and
//!   checked everything) → `released` (the old one stopped serving, so the
//!   event log and the gateway session are free) → `serving` (the new one
//!   accepts). The old one exits only then; if the new one fails at any
//!   step, the old one serves again on the same sockets and logs why.
//! - systemd's file descriptor store ([`old_instance::store_for_next_start`]): on SIGTERM, under a
//!   service manager that keeps a store, the state and the sockets
//!   clawmux bound itself are stored (`FDSTORE=1`, `FDNAME=`); the next
//!   start gets them in `LISTEN_FDS`/`LISTEN_FDNAMES` and takes them over,
//!   then removes them from the store (`FDSTOREREMOVE=1`).
//!
//! One home: the old instance's half ([`old_instance`], which drives the
//! serving broker through its [`old_instance::Broker`] trait), the new
//! instance's ([`new_instance`]), the control protocol ([`upgrade`]), the
//! documents ([`state`], [`clients`]) and the packing and taking over of
//! every parcel ([`clients`]). Each moving thing's own stop, parcel and
//! take-over live next to its serving code ([`crate::parcels`]).
//!
//! A state is taken whole or not at all ([`Inherited::take`]): every
//! descriptor it names must be there and be what it says before any is
//! used; otherwise every passed descriptor is closed and the new instance
//! starts fresh (binds its own sockets: a normal restart).

pub mod clients;
pub mod gateway;
pub mod new_instance;
pub mod old_instance;
pub mod state;
pub mod upgrade;
pub mod wire;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

pub use state::{State, Unreadable, FORMAT};

use crate::local::socket::SocketGuard;

/// The environment variable that names the descriptors a `SIGUSR2`
/// upgrade passes to the new instance: `name=fd,name=fd,…`.
pub const FDS_ENV: &str = "CLAWMUX_HANDOVER_FDS";

/// The descriptor name of the control socket of a `SIGUSR2` upgrade.
pub const CONTROL_FD_NAME: &str = "clawmux-control";

/// Where the inherited descriptors came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A `SIGUSR2` upgrade: the old instance waits on the control socket.
    Upgrade,
    /// systemd's file descriptor store.
    Store,
}

/// Descriptors passed to this process for a handover, by name.
#[derive(Debug)]
pub struct Inherited {
    pub source: Source,
    fds: Vec<(String, OwnedFd)>,
}

/// What a handover gives the new instance: its sockets, ready to serve.
#[derive(Debug)]
pub struct Taken {
    pub state: State,
    /// `None` when the main socket stayed systemd's (socket activation).
    pub main: Option<(UnixListener, SocketGuard)>,
    pub policies: Vec<(String, UnixListener, SocketGuard)>,
    /// The clients (and the gateway session) stored with the state
    /// (systemd's store; a `SIGUSR2` upgrade passes them once the old
    /// instance stopped serving).
    pub clients: Option<clients::Packed>,
}

impl Inherited {
    /// The descriptors named in [`FDS_ENV`], if it is set (and removes it, so
    /// nothing this process starts inherits the names).
    ///
    /// # Safety
    ///
    /// Call it first thing in `main`, before anything opens a descriptor:
    /// the numbers in [`FDS_ENV`] are then descriptors the old instance left
    /// open for this process, owned by nothing else here, so taking
    /// ownership cannot alias a descriptor another object closes. Each is
    /// checked to be open (`fcntl`) before it is taken, and taken once.
    pub unsafe fn take_from_env() -> Option<Result<Inherited, String>> {
        let value = std::env::var(FDS_ENV).ok()?;
        // SAFETY (of the environment change): called before any other
        // thread exists (first thing in main), so nothing reads the
        // environment concurrently.
        unsafe { std::env::remove_var(FDS_ENV) };
        let mut fds = Vec::new();
        for entry in value.split(',').filter(|e| !e.is_empty()) {
            let Some((name, number)) = entry.split_once('=') else {
                return Some(Err(format!("{FDS_ENV}: {entry:?} is not name=fd")));
            };
            let Ok(raw) = number.parse::<RawFd>() else {
                return Some(Err(format!("{FDS_ENV}: {number:?} is not a descriptor")));
            };
            if raw < 3
                || fds
                    .iter()
                    .any(|(_, fd): &(String, OwnedFd)| fd.as_raw_fd() == raw)
            {
                return Some(Err(format!("{FDS_ENV}: descriptor {raw} cannot be taken")));
            }
            // SAFETY: see the function's contract; `fcntl_getfd` on a
            // borrowed descriptor first proves it is open.
            let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
            if rustix::io::fcntl_getfd(borrowed).is_err() {
                return Some(Err(format!("{FDS_ENV}: descriptor {raw} is not open")));
            }
            // SAFETY: open (checked above), inherited for this process and
            // named once (duplicates refused above).
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
            fds.push((name.to_owned(), fd));
        }
        Some(Ok(Inherited {
            source: Source::Upgrade,
            fds,
        }))
    }

    /// The descriptors a previous instance stored in systemd's store
    /// (`None` when there are none). They are removed from the store at
    /// once: a state is read by one start only.
    pub fn from_store(stored: Vec<(String, OwnedFd)>) -> Option<Inherited> {
        if stored.is_empty() {
            return None;
        }
        for (name, _) in &stored {
            crate::systemd::remove_stored(name);
        }
        Some(Inherited {
            source: Source::Store,
            fds: stored,
        })
    }

    /// Descriptor names, for the log.
    pub fn names(&self) -> Vec<&str> {
        self.fds.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Takes the control socket of a `SIGUSR2` upgrade out.
    pub fn control(&mut self) -> Option<std::os::unix::net::UnixStream> {
        let i = self.fds.iter().position(|(n, _)| n == CONTROL_FD_NAME)?;
        Some(self.fds.swap_remove(i).1.into())
    }

    fn take_fd(&mut self, name: &str) -> Option<OwnedFd> {
        let i = self.fds.iter().position(|(n, _)| n == name)?;
        Some(self.fds.swap_remove(i).1)
    }

    /// Reads and checks the state and every descriptor it names. Whole or
    /// not at all: on any error every descriptor is closed (dropped). The
    /// socket files' guards remove them only once `after` is open (an
    /// upgrade's new instance owns them only from the old one's commit on:
    /// until then, however it fails, the old one serves on them).
    pub fn take(mut self, after: &crate::gate::Gate) -> Result<Taken, Unreadable> {
        let state_fd = self
            .take_fd(state::STATE_FD_NAME)
            .ok_or_else(|| Unreadable::Invalid("no state descriptor was passed".into()))?;
        let state = State::from_fd(&state_fd)?;
        let mut main = None;
        let mut policies = Vec::new();
        for l in &state.listeners {
            let fd = self.take_fd(&l.fd_name).ok_or_else(|| {
                Unreadable::Invalid(format!(
                    "the state names {} but it was not passed",
                    l.fd_name
                ))
            })?;
            let listener = UnixListener::from(fd);
            check_listener(&listener)
                .map_err(|why| Unreadable::Invalid(format!("{}: {why}", l.fd_name)))?;
            let guard = match &l.owned {
                None => SocketGuard::activated(l.path.clone()),
                Some(owned) => {
                    let lock_name = state::lock_name(&l.fd_name);
                    let lock = self.take_fd(&lock_name).ok_or_else(|| {
                        Unreadable::Invalid(format!("{lock_name} was not passed"))
                    })?;
                    rustix::fs::fstat(&lock).map_err(|e| {
                        Unreadable::Invalid(format!("{lock_name} is not a file ({e})"))
                    })?;
                    SocketGuard::handed_over(
                        l.path.clone(),
                        owned.ino,
                        owned.lock_path.clone(),
                        lock,
                    )
                    .removed_only_after(after)
                }
            };
            match &l.policy {
                None => main = Some((listener, guard)),
                Some(name) => policies.push((name.clone(), listener, guard)),
            }
        }
        let clients = match self.take_fd(clients::CLIENTS_FD_NAME) {
            None => None,
            Some(doc) => {
                let mut doc = clients::Clients::from_fd(&doc)?;
                // Refused there when it is missing, or there and not named.
                doc.read_frames(self.take_fd(clients::FRAMES_FD_NAME))?;
                let mut fds = Vec::new();
                for c in &doc.clients {
                    let name = clients::client_fd_name(c.id);
                    let fd = self
                        .take_fd(&name)
                        .ok_or_else(|| Unreadable::Invalid(format!("{name} was not passed")))?;
                    fds.push((c.id, fd));
                }
                let upstream = match doc.upstream {
                    None => None,
                    Some(_) => Some(self.take_fd(clients::UPSTREAM_FD_NAME).ok_or_else(|| {
                        Unreadable::Invalid(format!("{} was not passed", clients::UPSTREAM_FD_NAME))
                    })?),
                };
                let mut dedicated = Vec::new();
                for i in 0..doc.dedicated.len() {
                    let (client, gateway) = clients::dedicated_fd_names(i);
                    let mut take = |name: &str| {
                        self.take_fd(name)
                            .ok_or_else(|| Unreadable::Invalid(format!("{name} was not passed")))
                    };
                    dedicated.push((take(&client)?, take(&gateway)?));
                }
                // The `n` descriptors named `name(0)`, `name(1)`, ….
                let mut numbered = |n: usize, name: fn(usize) -> String| {
                    (0..n)
                        .map(|i| {
                            let name = name(i);
                            self.take_fd(&name).ok_or_else(|| {
                                Unreadable::Invalid(format!("{name} was not passed"))
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()
                };
                let streams = numbered(doc.streams.len(), clients::stream_fd_name)?;
                let narrower = numbered(doc.narrower.len(), clients::narrower_fd_name)?;
                Some(clients::Packed {
                    doc,
                    clients: fds,
                    upstream,
                    dedicated,
                    streams,
                    narrower,
                    leftovers: Vec::new(),
                })
            }
        };
        for (name, _) in &self.fds {
            tracing::warn!(
                name,
                "a passed descriptor no handover state names; closing it"
            );
        }
        Ok(Taken {
            state,
            main,
            policies,
            clients,
        })
    }
}

/// A handed-over listener must be a listening unix stream socket. (Its
/// address is not compared with the path: clawmux binds under a temporary
/// name and renames the socket file into place, so the kernel keeps the
/// temporary name as the address.)
fn check_listener(listener: &UnixListener) -> Result<(), String> {
    crate::systemd::check_unix_listener(listener)
}
