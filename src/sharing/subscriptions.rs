//! Reference-counted subscriptions to the gateway's connection-scoped
//! session events (gateway-protocol.md §4.2).
//!
//! The first local subscriber's request goes upstream, later ones are
//! answered here once the gateway confirmed; the last unsubscribe (or
//! disconnect) goes upstream. **Every change is decided and queued upstream
//! while [`Subscriptions::lock`] is held**, and the upstream queue is FIFO,
//! so the gateway sees changes in the order they were decided: a release
//! can never overtake a later subscribe.
//!
//! A subscription counts as *confirmed* only when the gateway answered `ok`
//! to the latest change sent for its key (a generation number tells them
//! apart); until then every subscribe is forwarded (the gateway's sets are
//! idempotent), so one failed upstream subscribe cannot strand others.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use serde_json::{json, Value};

/// What a client subscribed to, with session keys in canonical form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SubKey {
    /// `sessions.subscribe`: session list changes and every session's messages.
    Sessions,
    /// `sessions.messages.subscribe{key}`: one session's messages.
    Messages(String),
}

impl SubKey {
    /// The gateway method and params that (un)subscribe this key.
    pub fn request(&self, subscribe: bool) -> (&'static str, Value) {
        match (self, subscribe) {
            (SubKey::Sessions, true) => ("sessions.subscribe", json!({})),
            (SubKey::Sessions, false) => ("sessions.unsubscribe", json!({})),
            (SubKey::Messages(k), true) => ("sessions.messages.subscribe", json!({ "key": k })),
            (SubKey::Messages(k), false) => ("sessions.messages.unsubscribe", json!({ "key": k })),
        }
    }
}

#[derive(Debug, Default)]
struct Holders {
    /// Each holder, with the generation of the subscribe that admitted it
    /// (0: answered here, nothing sent), so the failure of an older
    /// subscribe cannot remove a client that has subscribed again since.
    clients: HashMap<u64, u64>,
    /// The gateway answered `ok` to the latest change sent for this key.
    confirmed: bool,
    /// The generation of the latest change sent for this key.
    sent_gen: u64,
}

/// What to do with one client's change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Answer the client here; nothing goes upstream.
    Answer,
    /// Send the change upstream now (still under the lock), tagged `gen`.
    Forward { gen: u64 },
}

/// The subscription table. Only reachable through [`Subscriptions::lock`].
#[derive(Debug, Default)]
pub struct SubscriptionState {
    keys: HashMap<SubKey, Holders>,
    next_gen: u64,
}

impl SubscriptionState {
    fn gen(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    /// `client` subscribes to `key`.
    pub fn subscribe(&mut self, key: &SubKey, client: u64) -> Plan {
        let gen = self.next_gen + 1;
        let h = self.keys.entry(key.clone()).or_default();
        if h.confirmed {
            h.clients.entry(client).or_insert(0);
            return Plan::Answer;
        }
        h.clients.insert(client, gen);
        h.sent_gen = gen;
        self.next_gen = gen;
        Plan::Forward { gen }
    }

    /// A client taken over from the previous instance holds `key`
    /// (unconfirmed: the next session subscribes every held key again).
    pub fn restore(&mut self, key: SubKey, client: u64) {
        let h = self.keys.entry(key).or_default();
        h.clients.insert(client, 0);
        h.confirmed = false;
    }

    /// `client` unsubscribes from `key`: forwarded only when it was the last holder.
    pub fn unsubscribe(&mut self, key: &SubKey, client: u64) -> Plan {
        let Some(h) = self.keys.get_mut(key) else {
            return Plan::Answer;
        };
        if h.clients.remove(&client).is_none() || !h.clients.is_empty() {
            return Plan::Answer;
        }
        self.keys.remove(key);
        Plan::Forward { gen: self.gen() }
    }

    /// The gateway answered the subscribe sent as `gen` for `client` (`None`:
    /// the broker's own re-subscribe). Returns whether the client was
    /// removed: a failed subscribe removes its client only if that very
    /// subscribe admitted it (not a later one after an unsubscribe).
    pub fn settle_subscribe(
        &mut self,
        key: &SubKey,
        client: Option<u64>,
        gen: u64,
        ok: bool,
    ) -> bool {
        let Some(h) = self.keys.get_mut(key) else {
            return false;
        };
        if ok {
            if h.sent_gen == gen && !h.clients.is_empty() {
                h.confirmed = true;
            }
            return false;
        }
        let Some(client) = client else {
            return false;
        };
        if h.clients.get(&client) != Some(&gen) {
            return false;
        }
        h.clients.remove(&client);
        if h.clients.is_empty() {
            self.keys.remove(key);
        }
        true
    }

    /// A client left holding `keys`: the unsubscribes to send now, for the
    /// keys it held last.
    pub fn release(&mut self, client: u64, keys: impl IntoIterator<Item = SubKey>) -> Vec<SubKey> {
        let mut out = Vec::new();
        for key in keys {
            if let Plan::Forward { .. } = self.unsubscribe(&key, client) {
                out.push(key);
            }
        }
        out
    }

    /// A new upstream session: every held key is subscribed again, and
    /// unconfirmed until the gateway says so. Returns the keys with the
    /// generation each re-subscribe is sent as.
    pub fn resubscribe(&mut self) -> Vec<(SubKey, u64)> {
        let mut keys: Vec<SubKey> = self.keys.keys().cloned().collect();
        keys.sort();
        keys.into_iter()
            .map(|k| {
                let gen = self.gen();
                if let Some(h) = self.keys.get_mut(&k) {
                    h.confirmed = false;
                    h.sent_gen = gen;
                }
                (k, gen)
            })
            .collect()
    }

    /// The keys the gateway confirmed on the current session (what it holds
    /// for the connection), in order.
    pub fn confirmed_keys(&self) -> Vec<SubKey> {
        let mut keys: Vec<SubKey> = self
            .keys
            .iter()
            .filter(|(_, h)| h.confirmed)
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }

    /// The gateway session the previous instance handed over goes on, and
    /// holds `confirmed` for it: a held key among them is confirmed as it
    /// is (nothing sent); every other held key is subscribed again (with
    /// the generation to send it as); a confirmed key no one holds any
    /// more is to be unsubscribed.
    pub fn continue_session(&mut self, confirmed: &[SubKey]) -> (Vec<(SubKey, u64)>, Vec<SubKey>) {
        let mut keys: Vec<SubKey> = self.keys.keys().cloned().collect();
        keys.sort();
        let mut subscribe = Vec::new();
        for k in keys {
            if confirmed.contains(&k) {
                if let Some(h) = self.keys.get_mut(&k) {
                    h.confirmed = true;
                }
                continue;
            }
            let gen = self.gen();
            if let Some(h) = self.keys.get_mut(&k) {
                h.confirmed = false;
                h.sent_gen = gen;
            }
            subscribe.push((k, gen));
        }
        let drop = confirmed
            .iter()
            .filter(|k| !self.keys.contains_key(k))
            .cloned()
            .collect();
        (subscribe, drop)
    }

    /// The clients holding `key`.
    pub fn holders(&self, key: &SubKey) -> Vec<u64> {
        self.keys
            .get(key)
            .map(|h| h.clients.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Every key held by at least one client `holder` accepts, with the
    /// count of those holders.
    pub fn counts(&self, holder: impl Fn(u64) -> bool) -> HashMap<SubKey, usize> {
        self.keys
            .iter()
            .map(|(k, h)| (k.clone(), h.clients.keys().filter(|&&c| holder(c)).count()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

/// The shared subscription table.
#[derive(Debug, Default)]
pub struct Subscriptions {
    state: Mutex<SubscriptionState>,
}

impl Subscriptions {
    /// The one ordered place: decide a change and queue it upstream before
    /// letting go.
    pub fn lock(&self) -> MutexGuard<'_, SubscriptionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The clients holding `key`.
    pub fn holders(&self, key: &SubKey) -> Vec<u64> {
        self.lock().holders(key)
    }

    /// Local subscription counts: `sessions.subscribe` holders, and holders
    /// per `sessions.messages.subscribe` key (for state reporting and tests).
    pub fn counts(&self) -> (usize, HashMap<String, usize>) {
        self.counts_held_by(|_| true)
    }

    /// [`Self::counts`] among the clients `holder` accepts: a caller on a
    /// further socket is told only about its own socket's clients (the
    /// keys another client holds are that client's business).
    pub fn counts_held_by(&self, holder: impl Fn(u64) -> bool) -> (usize, HashMap<String, usize>) {
        let counts = self.lock().counts(holder);
        let mut sessions = 0;
        let mut messages = HashMap::new();
        for (k, n) in counts {
            match k {
                SubKey::Sessions => sessions = n,
                SubKey::Messages(key) => {
                    messages.insert(key, n);
                }
            }
        }
        (sessions, messages)
    }
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_subscribe_forwards_until_confirmed_then_answers_locally() {
        let mut s = SubscriptionState::default();
        let k = SubKey::Sessions;
        let Plan::Forward { gen: g1 } = s.subscribe(&k, 1) else {
            panic!("the first subscribe goes upstream")
        };
        let Plan::Forward { gen: g2 } = s.subscribe(&k, 2) else {
            panic!("unconfirmed: forwarded again")
        };
        s.settle_subscribe(&k, Some(1), g1, true);
        assert!(
            matches!(s.subscribe(&k, 3), Plan::Forward { .. }),
            "an older answer does not confirm"
        );
        let g3 = s.keys[&k].sent_gen;
        s.settle_subscribe(&k, Some(2), g2, true);
        s.settle_subscribe(&k, Some(3), g3, true);
        assert_eq!(s.subscribe(&k, 4), Plan::Answer);
        assert_eq!(s.holders(&k).len(), 4);
    }

    #[test]
    fn only_the_last_holder_unsubscribes_upstream() {
        let mut s = SubscriptionState::default();
        let k = SubKey::Messages("agent:main:main".into());
        s.subscribe(&k, 1);
        s.subscribe(&k, 2);
        assert_eq!(s.unsubscribe(&k, 1), Plan::Answer);
        assert_eq!(
            s.unsubscribe(&k, 1),
            Plan::Answer,
            "not held: nothing to send"
        );
        assert!(matches!(s.unsubscribe(&k, 2), Plan::Forward { .. }));
        assert!(s.holders(&k).is_empty());
    }

    /// A confirmation from before a release must not confirm the key after
    /// it was released and subscribed again (that subscribe is still queued
    /// behind the release).
    #[test]
    fn a_stale_confirmation_does_not_survive_a_release() {
        let mut s = SubscriptionState::default();
        let k = SubKey::Sessions;
        let Plan::Forward { gen: g1 } = s.subscribe(&k, 1) else {
            panic!()
        };
        assert_eq!(s.release(1, [k.clone()]), vec![k.clone()]);
        assert!(matches!(s.subscribe(&k, 2), Plan::Forward { .. }));
        s.settle_subscribe(&k, Some(1), g1, true);
        assert!(matches!(s.subscribe(&k, 3), Plan::Forward { .. }));
    }

    #[test]
    fn a_failed_subscribe_leaves_nothing_behind_and_resubscribe_lists_every_key() {
        let mut s = SubscriptionState::default();
        let k = SubKey::Messages("agent:main:x".into());
        let Plan::Forward { gen } = s.subscribe(&k, 1) else {
            panic!()
        };
        s.settle_subscribe(&k, Some(1), gen, false);
        assert!(s.counts(|_| true).is_empty());
        s.subscribe(&SubKey::Sessions, 1);
        s.subscribe(&k, 2);
        let again: Vec<SubKey> = s.resubscribe().into_iter().map(|(k, _)| k).collect();
        assert_eq!(again, vec![SubKey::Sessions, k]);
    }

    #[test]
    fn counts_among_some_holders_leave_out_the_keys_only_others_hold() {
        let mut s = SubscriptionState::default();
        let (mine, theirs) = (SubKey::Messages("m".into()), SubKey::Messages("t".into()));
        s.subscribe(&mine, 1);
        s.subscribe(&mine, 2);
        s.subscribe(&theirs, 2);
        assert_eq!(s.counts(|_| true).len(), 2);
        let only_one = s.counts(|c| c == 1);
        assert_eq!(only_one, HashMap::from([(mine, 1)]));
    }

    /// Subscribe (pending) → unsubscribe → subscribe again → the first one
    /// fails: the client keeps the subscription it holds now.
    #[test]
    fn an_old_failure_does_not_remove_a_newer_subscription() {
        let mut s = SubscriptionState::default();
        let k = SubKey::Sessions;
        let Plan::Forward { gen: first } = s.subscribe(&k, 1) else {
            panic!()
        };
        assert!(matches!(s.unsubscribe(&k, 1), Plan::Forward { .. }));
        let Plan::Forward { gen: again } = s.subscribe(&k, 1) else {
            panic!()
        };
        assert!(!s.settle_subscribe(&k, Some(1), first, false));
        assert_eq!(s.holders(&k), vec![1], "still subscribed");
        s.settle_subscribe(&k, Some(1), again, true);
        assert_eq!(s.subscribe(&k, 2), Plan::Answer, "confirmed");
        // Two clients on one unconfirmed key: each failure is its own.
        let m = SubKey::Messages("agent:main:y".into());
        let Plan::Forward { gen: a } = s.subscribe(&m, 1) else {
            panic!()
        };
        let Plan::Forward { gen: b } = s.subscribe(&m, 2) else {
            panic!()
        };
        assert!(s.settle_subscribe(&m, Some(1), a, false));
        assert_eq!(s.holders(&m), vec![2]);
        assert!(s.settle_subscribe(&m, Some(2), b, false));
        assert!(s.holders(&m).is_empty());
    }
}
