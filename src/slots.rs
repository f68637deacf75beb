//! Slots shared out between the sockets the broker serves, so one
//! socket's clients cannot take what another's need: each socket has its
//! own share, and every slot also counts against one total.
//!
//! The main socket (the owner's) may use the whole total; the further
//! `[[sockets]]` share what is left of it after [`MAIN_RESERVE_PERCENT`]
//! kept for the main socket, in equal parts. So the main socket always
//! has at least that reserve free of other sockets' clients, each further
//! socket has its own part whatever the others do, and all of them
//! together never exceed the total (the open-file budget, for
//! connections). With no further sockets, the main socket has it all.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The share of each total no further socket's clients may take: the main
/// socket's reserve.
pub const MAIN_RESERVE_PERCENT: usize = 50;

/// One slot: of its socket's share and of the total, held until dropped.
#[derive(Debug)]
pub struct Slot {
    _share: OwnedSemaphorePermit,
    _total: OwnedSemaphorePermit,
}

/// The slots of every socket the broker serves.
#[derive(Debug)]
pub struct SocketSlots {
    total: Arc<Semaphore>,
    shares: HashMap<String, (usize, Arc<Semaphore>)>,
}

impl Default for SocketSlots {
    /// No socket served.
    fn default() -> Self {
        SocketSlots::new(None, [], 0)
    }
}

impl SocketSlots {
    /// `total` slots between `main` (may be absent: not served) and the
    /// `others` sockets.
    pub fn new<'a>(
        main: Option<&str>,
        others: impl IntoIterator<Item = &'a str>,
        total: usize,
    ) -> SocketSlots {
        let others: Vec<&str> = others.into_iter().collect();
        let reserve = total * MAIN_RESERVE_PERCENT / 100;
        let each = match others.len() {
            0 => 0,
            n => ((total - reserve) / n).max(1),
        };
        let mut shares: HashMap<String, (usize, Arc<Semaphore>)> = others
            .into_iter()
            .map(|name| (name.to_owned(), (each, Arc::new(Semaphore::new(each)))))
            .collect();
        if let Some(main) = main {
            shares.insert(main.to_owned(), (total, Arc::new(Semaphore::new(total))));
        }
        SocketSlots {
            total: Arc::new(Semaphore::new(total)),
            shares,
        }
    }

    /// Whether `socket` has slots here (it is served).
    pub fn serves(&self, socket: &str) -> bool {
        self.shares.contains_key(socket)
    }

    /// How many slots `socket` may hold at most.
    pub fn share(&self, socket: &str) -> Option<usize> {
        self.shares.get(socket).map(|(n, _)| *n)
    }

    /// A slot of `socket`, or `None` when its share or the total is used up
    /// (or it is not served).
    pub fn take(&self, socket: &str) -> Option<Slot> {
        let (_, share) = self.shares.get(socket)?;
        let share = Arc::clone(share).try_acquire_owned().ok()?;
        let total = Arc::clone(&self.total).try_acquire_owned().ok()?;
        Some(Slot {
            _share: share,
            _total: total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_main_socket_keeps_its_reserve_and_each_other_socket_its_part() {
        let slots = SocketSlots::new(Some("default"), ["a", "b"], 128);
        assert_eq!(slots.share("a"), Some(32));
        let a: Vec<Slot> = std::iter::from_fn(|| slots.take("a")).collect();
        assert_eq!(a.len(), 32, "a's part, whatever is free");
        let b: Vec<Slot> = std::iter::from_fn(|| slots.take("b")).collect();
        assert_eq!(b.len(), 32, "b's part is its own");
        let main: Vec<Slot> = std::iter::from_fn(|| slots.take("default")).collect();
        assert_eq!(main.len(), 64, "the rest, at least the reserve");
        drop(a);
        let main_more: Vec<Slot> = std::iter::from_fn(|| slots.take("default")).collect();
        assert_eq!(main_more.len(), 32, "the main socket may use any free slot");
        assert!(
            slots.take("b").is_none() && slots.take("a").is_none(),
            "the total"
        );
        assert!(slots.take("other").is_none(), "not served");
    }

    #[test]
    fn alone_the_main_socket_has_it_all() {
        let slots = SocketSlots::new(Some("default"), [], 5);
        let all: Vec<Slot> = std::iter::from_fn(|| slots.take("default")).collect();
        assert_eq!(all.len(), 5);
    }
}
