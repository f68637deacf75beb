//! A requester and what it holds: the one owner of a local client's share of
//! the broker (its pending requests, subscriptions and runs), released
//! together when its [`Registration`] is dropped.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::hub::Client;
use crate::sharing::SubKey;

use super::Dispatcher;

/// What one requester holds, so its departure costs only that.
#[derive(Debug, Default)]
pub struct Book {
    /// Upstream ids of its requests waiting for an answer.
    pub pending: HashSet<String>,
    /// Its subscriptions (canonical keys).
    pub subs: HashSet<SubKey>,
    /// Runs it started that may still be live.
    pub runs: HashSet<String>,
}

/// Whose in-flight budget a requester spends.
#[derive(Debug)]
enum Budget {
    /// Its own (`Client::inflight`): a WebSocket client, the broker itself.
    Own,
    /// One shared by every requester of a kind (`/v1/rpc`: each HTTP request
    /// is a fresh requester, so a per-request budget would bound nothing).
    Shared(Arc<AtomicUsize>, &'static str),
}

/// A local requester: where its answers go, and what it holds.
#[derive(Debug)]
pub struct Member {
    /// Its queue: answers (and, once admitted, events) go here.
    pub client: Arc<Client>,
    budget: Budget,
    book: Mutex<Book>,
    /// The grant whose narrower upstream session it has used (it holds
    /// that session open until it leaves).
    pub(crate) aux_grant: std::sync::OnceLock<crate::policy::Grant>,
}

impl Member {
    /// A requester spending its own in-flight budget.
    pub fn new(client: Arc<Client>) -> Self {
        Member {
            client,
            budget: Budget::Own,
            book: Mutex::new(Book::default()),
            aux_grant: Default::default(),
        }
    }

    /// A requester spending a budget shared with others of its kind.
    pub fn with_shared_budget(
        client: Arc<Client>,
        budget: Arc<AtomicUsize>,
        name: &'static str,
    ) -> Self {
        Member {
            client,
            budget: Budget::Shared(budget, name),
            book: Mutex::new(Book::default()),
            aux_grant: Default::default(),
        }
    }

    pub fn id(&self) -> u64 {
        self.client.id
    }

    pub fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counter(&self) -> &AtomicUsize {
        match &self.budget {
            Budget::Own => &self.client.inflight,
            Budget::Shared(n, _) => n,
        }
    }

    /// Who the in-flight cap counts, for the refusal message.
    pub fn budget_name(&self) -> &'static str {
        match &self.budget {
            Budget::Own => "this client",
            Budget::Shared(_, name) => name,
        }
    }

    /// Takes an in-flight slot for `upstream_id`; false at the cap.
    pub(crate) fn take_slot(&self, upstream_id: &str, max: usize) -> bool {
        let counter = self.counter();
        if counter.fetch_add(1, Ordering::AcqRel) >= max {
            counter.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        self.book().pending.insert(upstream_id.to_owned());
        true
    }

    /// Gives back the slot of an answered, failed or forgotten request.
    pub(crate) fn release_slot(&self, upstream_id: &str) {
        if self.book().pending.remove(upstream_id) {
            self.counter().fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The ids of its pending requests.
    pub(crate) fn pending_ids(&self) -> Vec<String> {
        self.book().pending.iter().cloned().collect()
    }

    /// Requests in flight on its budget.
    pub fn inflight(&self) -> usize {
        self.counter().load(Ordering::Relaxed)
    }
}

/// The owner of a requester's lifecycle: while it lives the requester may
/// send; dropping it releases the hub entry, pending requests,
/// subscriptions (the last holder's unsubscribes are queued upstream in
/// order) and runs together.
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
        &self.member.client
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.dispatcher.release(&self.member);
    }
}
