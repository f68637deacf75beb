//! A local requester and what it holds: the one owner of a client's share
//! of the broker (its pending requests, subscriptions, runs and narrower
//! session), released together when its [`Registration`] is dropped.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::hub::Client;
use crate::policy::Grant;
use crate::router::Requester;
use crate::sharing::SubKey;

use super::Dispatcher;

/// What one requester holds besides its pending requests (those are the
/// router's: [`Requester`]), so its departure costs only that.
#[derive(Debug, Default)]
pub struct Book {
    /// Its subscriptions (canonical keys).
    pub subs: HashSet<SubKey>,
    /// Runs it started that may still be live.
    pub runs: HashSet<String>,
}

/// A local requester: where its answers go, and what it holds.
#[derive(Debug)]
pub struct Member {
    /// What the router knows of it: its queue, budget and pending ids.
    pub requester: Arc<Requester>,
    book: Mutex<Book>,
    /// The grant whose narrower upstream session it has used (it holds
    /// that session open until it leaves).
    pub(crate) narrower: OnceLock<Grant>,
}

impl Member {
    pub fn new(requester: Requester) -> Self {
        Member {
            requester: Arc::new(requester),
            book: Mutex::new(Book::default()),
            narrower: OnceLock::new(),
        }
    }

    pub fn id(&self) -> u64 {
        self.requester.id()
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.requester.client
    }

    pub fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests in flight on its budget.
    pub fn inflight(&self) -> usize {
        self.requester.inflight()
    }

    /// The local process it came from (its pid; one of its own when none
    /// is known), for the rates that are per process.
    pub(crate) fn peer(&self) -> u64 {
        self.client()
            .identity
            .get()
            .and_then(|i| i.peer_pid)
            .map_or(u64::MAX - self.id(), u64::from)
    }
}

/// The owner of a requester's lifecycle: while it lives the requester may
/// send; dropping it releases the hub entry, pending requests,
/// subscriptions (the last holder's unsubscribes are queued upstream in
/// order), runs and its hold on a narrower session together.
#[derive(Debug)]
pub struct Registration {
    member: Arc<Member>,
    dispatcher: Arc<Dispatcher>,
}

impl Registration {
    pub(super) fn new(member: Arc<Member>, dispatcher: Arc<Dispatcher>) -> Self {
        Registration { member, dispatcher }
    }

    pub fn member(&self) -> &Arc<Member> {
        &self.member
    }

    pub fn client(&self) -> &Arc<Client> {
        self.member.client()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.dispatcher.release(&self.member);
    }
}
