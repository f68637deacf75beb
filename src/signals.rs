//! The `serve` process's signals, held from its first instruction.
//!
//! The default action of `SIGUSR2`, `SIGHUP`, `SIGTERM` and `SIGINT` ends the
//! process. A broker must never be ended by one of them before it can handle
//! it: an upgrade's new instance is signalled (a second upgrade, a reload)
//! as soon as it serves, and if that killed it no process would serve the
//! socket. So the rule is: *blocked, then handled*.
//! - [`hold`] blocks them first thing in `main`; an upgrade's old instance
//!   starts the new one with them already blocked ([`hold_in_child`]), so no
//!   instruction of the new process runs with the default action.
//! - [`ServeSignals::install`] registers tokio's handlers, then unblocks: a
//!   signal that arrived meanwhile was kept pending by the kernel and is
//!   delivered to the handler, never lost.
//! - A command that is not `serve` gives the mask back at once
//!   ([`Held::release`]), so `clawmux tail` still ends on a hang-up.
//!
//! Written against `libc` directly: `pthread_sigmask` is one call and no
//! crate in the tree wraps it (tokio and rustix only install handlers).

use tokio::signal::unix::{signal, Signal, SignalKind};

/// The signals [`hold`] blocks.
const HELD: [libc::c_int; 4] = [libc::SIGUSR2, libc::SIGHUP, libc::SIGTERM, libc::SIGINT];

/// The held signals, blocked in the calling thread until [`Held::release`].
#[must_use = "held signals are unblocked by release() or ServeSignals::install"]
pub struct Held(());

fn held_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initializes the set it is given; sigaddset with
    // a valid signal number on an initialized set cannot fail.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for sig in HELD {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

fn mask(how: libc::c_int) {
    let set = held_set();
    // SAFETY: `set` is an initialized sigset_t that outlives the call;
    // pthread_sigmask only reads it (the old mask is not asked for).
    unsafe {
        libc::pthread_sigmask(how, &set, std::ptr::null_mut());
    }
}

/// Blocks the held signals in the calling thread (and in every thread it
/// starts afterwards, which inherit its mask). Call it first in `main`.
pub fn hold() -> Held {
    mask(libc::SIG_BLOCK);
    Held(())
}

impl Held {
    /// Unblocks the held signals in the calling thread (also when the
    /// process started with them blocked, as an upgrade's new instance
    /// does): pending ones are delivered now, to their handler or to the
    /// default action.
    pub fn release(self) {
        mask(libc::SIG_UNBLOCK);
    }
}

/// Makes `command`'s process start with the held signals blocked (the
/// standard library resets a child's mask before its `pre_exec` hooks run,
/// so the block is set there). The new instance unblocks them once its
/// handlers are installed.
pub fn hold_in_child(command: &mut tokio::process::Command) {
    let set = held_set();
    // SAFETY: the hook runs in the child between fork and exec, where only
    // async-signal-safe functions may be called: pthread_sigmask (as
    // sigprocmask in a single-threaded child) is one, and the hook
    // allocates nothing (`set` was built before the fork and is copied in).
    unsafe {
        command.pre_exec(move || {
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
}

/// The serve process's handlers, installed once, before anything else the
/// process does, and handed to the code that acts on each signal.
pub struct ServeSignals {
    /// Stop (SIGTERM).
    pub term: Signal,
    /// Stop (SIGINT, Ctrl-C).
    pub int: Signal,
    /// Hand over to the binary now at this program's path.
    pub usr2: Signal,
    /// Re-read the settings.
    pub hup: Signal,
}

impl ServeSignals {
    /// Registers the handlers (inside a tokio runtime), then unblocks the
    /// held signals in this thread. Any signal sent since [`hold`] is
    /// delivered to its handler now.
    pub fn install(held: Held) -> std::io::Result<ServeSignals> {
        let installed = (|| {
            Ok(ServeSignals {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
                usr2: signal(SignalKind::user_defined2())?,
                hup: signal(SignalKind::hangup())?,
            })
        })();
        held.release();
        installed
    }

    /// The signals that stop the process, for a command that only stops.
    pub fn stops(self) -> StopSignals {
        StopSignals {
            term: self.term,
            int: self.int,
        }
    }
}

/// SIGTERM and SIGINT.
pub struct StopSignals {
    pub term: Signal,
    pub int: Signal,
}

impl StopSignals {
    /// Waits for either; returns its name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
