//! The open-file limit: every local connection is a file descriptor, and so
//! is the upstream socket the broker must always be able to re-open.
//!
//! At start `serve` raises the soft `RLIMIT_NOFILE` to the hard limit (the
//! soft default, often 1024, is too low for `max_clients`). The accept loop
//! then admits at most [`connection_budget`] connections, keeping
//! [`FD_RESERVE`] descriptors for everything else, and holds one spare
//! descriptor ([`SpareFd`]) to answer a connection cleanly even when the
//! process has no descriptor left.

use std::fs::File;

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Descriptors kept free for everything that is not a local connection: the
/// runtime (epoll, wakers, signal pipes), stdio, the listener, the upstream
/// socket (so the gateway session can always reconnect), the lock file, the
/// device key and token files, settings files on reload, and the spare.
/// The connection cap is lowered so that this many always stay free.
pub const FD_RESERVE: u64 = 32;

/// What the start-up raise did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Raise {
    /// Soft was below hard and is now hard.
    Raised { from: u64, to: u64 },
    /// Nothing to do: soft already equals hard, or the hard limit is infinite
    /// (Linux refuses an infinite open-file limit).
    Unchanged { soft: Option<u64> },
}

/// Raises the soft open-file limit to the hard one. Under the systemd unit
/// this is usually a no-op (`LimitNOFILE=` sets both) and `setrlimit` is
/// filtered anyway (`SystemCallFilter=~@resources`), so a failure is only
/// worth a log line.
pub fn raise_to_hard() -> rustix::io::Result<Raise> {
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    match (current, maximum) {
        (Some(soft), Some(hard)) if soft < hard => {
            setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(hard),
                    maximum: Some(hard),
                },
            )?;
            Ok(Raise::Raised {
                from: soft,
                to: hard,
            })
        }
        _ => Ok(Raise::Unchanged { soft: current }),
    }
}

/// The soft open-file limit now (`None`: unlimited).
pub fn soft_limit() -> Option<u64> {
    getrlimit(Resource::Nofile).current
}

/// How many local connections may be open at once: the configured cap, but
/// never more than the soft limit leaves after [`FD_RESERVE`] (and at least
/// one, so a tiny limit still serves someone).
pub fn connection_budget(configured: usize, soft_limit: Option<u64>) -> usize {
    match soft_limit {
        None => configured,
        Some(soft) => {
            let room = usize::try_from(soft.saturating_sub(FD_RESERVE)).unwrap_or(usize::MAX);
            configured.min(room).max(1)
        }
    }
}

/// One descriptor held in reserve (`/dev/null`), the classic libev trick:
/// when `accept` fails with "too many open files", the spare is closed, the
/// waiting connection is accepted into its slot, answered `503` and closed,
/// and the spare is re-opened. Without it a waiting connection would sit in
/// the backlog unanswered and the listener would report readable forever.
#[derive(Debug)]
pub struct SpareFd(Option<File>);

impl SpareFd {
    pub fn open() -> Self {
        SpareFd(File::open("/dev/null").ok())
    }

    /// Gives the descriptor back to the process; `false` if there was none.
    pub fn release(&mut self) -> bool {
        self.0.take().is_some()
    }

    /// Takes a descriptor back if one is free (a failure leaves it empty;
    /// it is tried again after the next accepted connection).
    pub fn refill(&mut self) {
        if self.0.is_none() {
            self.0 = File::open("/dev/null").ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_keeps_the_reserve() {
        assert_eq!(connection_budget(1088, None), 1088);
        assert_eq!(connection_budget(1088, Some(65_536)), 1088);
        assert_eq!(connection_budget(1088, Some(1024)), 1024 - 32);
        assert_eq!(connection_budget(1088, Some(64)), 32);
        assert_eq!(connection_budget(1088, Some(10)), 1, "never zero");
    }

    #[test]
    fn spare_can_be_released_and_refilled() {
        let mut spare = SpareFd::open();
        assert!(spare.release());
        assert!(!spare.release());
        spare.refill();
        assert!(spare.release());
    }
}
