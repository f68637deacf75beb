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
use std::os::fd::OwnedFd;

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use tokio::sync::oneshot;

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
///
/// The refusal closes lingering (it reads the client's request first, so
/// the client sees the answer, not a broken pipe), which takes a while; the
/// spare is *lent* to it meanwhile and given back as the refused socket's
/// own descriptor, shut down both ways, never closed in between: a
/// descriptor closed and re-opened would be taken by the next `accept`
/// first, leaving no spare for the connection after it.
#[derive(Debug)]
pub struct SpareFd {
    held: Option<OwnedFd>,
    lent: Option<oneshot::Receiver<OwnedFd>>,
}

impl SpareFd {
    pub fn open() -> Self {
        SpareFd {
            held: open_dev_null(),
            lent: None,
        }
    }

    /// Gives the descriptor back to the process; `false` if there was none.
    pub fn release(&mut self) -> bool {
        self.held.take().is_some()
    }

    /// The descriptor just released is in use (a lingering refusal): it
    /// comes back through the returned sender, or, if the sender is
    /// dropped, the next [`refill`](Self::refill) re-opens one.
    pub fn lend(&mut self) -> oneshot::Sender<OwnedFd> {
        let (give_back, lent) = oneshot::channel();
        self.lent = Some(lent);
        give_back
    }

    /// Takes a descriptor back: the lent one if it has come back, else a
    /// free one if any (a failure leaves it empty; it is tried again after
    /// the next accepted connection). A lent descriptor that comes back
    /// when the spare is already held is closed.
    pub fn refill(&mut self) {
        if let Some(lent) = &mut self.lent {
            match lent.try_recv() {
                Ok(fd) => {
                    self.lent = None;
                    if self.held.is_none() {
                        self.held = Some(fd);
                    }
                }
                Err(oneshot::error::TryRecvError::Closed) => self.lent = None,
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
        }
        if self.held.is_none() {
            self.held = open_dev_null();
        }
    }
}

impl SpareFd {
    /// Resolves once a lent descriptor has come back (or will not), having
    /// taken it; never while nothing is lent. The accept loop waits on this
    /// beside its pause, so the next waiting connection is answered as soon
    /// as the refusal before it has ended.
    pub async fn lent_back(&mut self) {
        let Some(lent) = &mut self.lent else {
            return std::future::pending().await;
        };
        let back = lent.await.ok();
        self.lent = None;
        if let (None, Some(fd)) = (&self.held, back) {
            self.held = Some(fd);
        }
    }
}

fn open_dev_null() -> Option<OwnedFd> {
    File::open("/dev/null").ok().map(OwnedFd::from)
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

    #[test]
    fn a_lent_spare_comes_back_as_the_descriptor_it_was_lent_as() {
        let mut spare = SpareFd::open();
        assert!(spare.release());
        let give_back = spare.lend();
        let (ours, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = OwnedFd::from(ours);
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        give_back.send(fd).unwrap();
        spare.refill();
        let held = spare.held.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        assert_eq!(held, Some(raw), "the lent descriptor itself, not a new one");
        // A sender dropped without giving back: a fresh one is opened.
        assert!(spare.release());
        drop(spare.lend());
        spare.refill();
        assert!(spare.release());
    }
}
