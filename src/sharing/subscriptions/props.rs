//! Property tests of the subscription table ([`SubscriptionState`])
//! against a model of what it stands between: local clients that
//! subscribe, unsubscribe and leave in any order, a FIFO queue to the
//! gateway (what the broker decided under the lock, in that order), the
//! gateway's own per-connection set, and upstream sessions that end.
//!
//! What they prove, over every sequence proptest tries (and shrinks):
//!
//! - **Refcount**: the table's holders of each key are exactly the clients
//!   that subscribed and neither unsubscribed, left, nor had the subscribe
//!   that admitted them fail; a key nobody holds is not kept (no count of
//!   zero lingers). A client leaving releases upstream exactly the keys it
//!   held last.
//! - **No local answer is a lie**: a subscribe answered by the broker
//!   itself is answered only while the gateway holds that subscription and
//!   no change for the key is still on its way (the gateway answered `ok`
//!   to the latest one).
//! - **Upstream agrees once quiet**: with the queue drained, the gateway
//!   holds a key if and only if some local client holds it, across
//!   releases racing subscribes, failed subscribes and reconnects (when
//!   the gateway's answer depends on the key, as it does: a refused key is
//!   refused every time). With answers failing at random only the first
//!   two hold; see the note on [`a_failure_after_a_success_may_leave_the_gateway_subscribed`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use proptest::prelude::*;

use super::*;

/// Three keys: the session list, one session's messages, and one the
/// gateway refuses (an unknown session, say).
fn key(n: u8) -> SubKey {
    match n % 3 {
        0 => SubKey::Sessions,
        1 => SubKey::Messages("agent:main:main".into()),
        _ => SubKey::Messages("agent:main:refused".into()),
    }
}

fn refused(key: &SubKey) -> bool {
    matches!(key, SubKey::Messages(k) if k.ends_with("refused"))
}

#[derive(Debug, Clone)]
enum Op {
    Subscribe(u64, u8),
    Unsubscribe(u64, u8),
    Leave(u64),
    /// The gateway answers the next `n` changes in the queue (`fail`: a
    /// subscribe among them fails whatever its key, when answers are random).
    Answer(u8, bool),
    /// The upstream session ends (everything in flight fails) and a new
    /// one starts (the broker subscribes again to every held key).
    Reconnect,
}

fn op() -> impl Strategy<Value = Op> {
    let client = 1..5u64;
    prop_oneof![
        4 => (client.clone(), any::<u8>()).prop_map(|(c, k)| Op::Subscribe(c, k)),
        2 => (client.clone(), any::<u8>()).prop_map(|(c, k)| Op::Unsubscribe(c, k)),
        1 => client.prop_map(Op::Leave),
        4 => (1..4u8, any::<bool>()).prop_map(|(n, f)| Op::Answer(n, f)),
        1 => Just(Op::Reconnect),
    ]
}

/// One change on its way to the gateway.
#[derive(Debug)]
struct Change {
    key: SubKey,
    subscribe: bool,
    /// The client whose subscribe it is (`None`: the broker's re-subscribe,
    /// or an unsubscribe).
    client: Option<u64>,
    gen: u64,
}

#[derive(Default)]
struct World {
    table: SubscriptionState,
    upstream: VecDeque<Change>,
    /// The gateway's per-connection subscriptions.
    gateway: BTreeSet<SubKey>,
    /// The model: per client, each key it holds with the generation of the
    /// subscribe that admitted it (0: answered locally).
    books: HashMap<u64, HashMap<SubKey, u64>>,
    /// Answers may fail whatever the key.
    random_failures: bool,
}

impl World {
    fn model_holders(&self) -> BTreeMap<SubKey, BTreeSet<u64>> {
        let mut out: BTreeMap<SubKey, BTreeSet<u64>> = BTreeMap::new();
        for (client, keys) in &self.books {
            for k in keys.keys() {
                out.entry(k.clone()).or_default().insert(*client);
            }
        }
        out
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Subscribe(c, k) => {
                let k = key(k);
                match self.table.subscribe(&k, c) {
                    Plan::Answer => {
                        prop_assert!(
                            self.gateway.contains(&k),
                            "answered locally while the gateway does not hold {k:?}"
                        );
                        prop_assert!(
                            !self.upstream.iter().any(|ch| ch.key == k),
                            "answered locally while a change for {k:?} is on its way"
                        );
                        self.books.entry(c).or_default().entry(k).or_insert(0);
                    }
                    Plan::Forward { gen } => {
                        self.books.entry(c).or_default().insert(k.clone(), gen);
                        self.upstream.push_back(Change {
                            key: k,
                            subscribe: true,
                            client: Some(c),
                            gen,
                        });
                    }
                }
            }
            Op::Unsubscribe(c, k) => {
                let k = key(k);
                let held = self.books.entry(c).or_default().remove(&k).is_some();
                let last = held && !self.books.values().any(|b| b.contains_key(&k));
                match self.table.unsubscribe(&k, c) {
                    Plan::Answer => prop_assert!(!last, "the last holder's release stayed local"),
                    Plan::Forward { gen } => {
                        prop_assert!(last, "a release went upstream with holders left");
                        self.upstream.push_back(Change {
                            key: k,
                            subscribe: false,
                            client: None,
                            gen,
                        });
                    }
                }
            }
            Op::Leave(c) => {
                let keys: Vec<SubKey> = self
                    .books
                    .remove(&c)
                    .unwrap_or_default()
                    .into_keys()
                    .collect();
                let mut expected: Vec<SubKey> = keys
                    .iter()
                    .filter(|k| !self.books.values().any(|b| b.contains_key(*k)))
                    .cloned()
                    .collect();
                let mut released = self.table.release(c, keys);
                expected.sort();
                released.sort();
                prop_assert_eq!(
                    &released,
                    &expected,
                    "a leaver releases the keys it held last"
                );
                for k in released {
                    self.upstream.push_back(Change {
                        key: k,
                        subscribe: false,
                        client: None,
                        gen: 0,
                    });
                }
            }
            Op::Answer(n, fail) => {
                for _ in 0..n {
                    let Some(change) = self.upstream.pop_front() else {
                        break;
                    };
                    if !change.subscribe {
                        self.gateway.remove(&change.key);
                        continue;
                    }
                    let failed = refused(&change.key) || (self.random_failures && fail);
                    let ok = !failed;
                    if ok {
                        self.gateway.insert(change.key.clone());
                    }
                    self.settle(change, ok)?;
                }
            }
            Op::Reconnect => {
                while let Some(change) = self.upstream.pop_front() {
                    if change.subscribe {
                        self.settle(change, false)?;
                    }
                }
                self.gateway.clear();
                let again = self.table.resubscribe();
                let keys: Vec<SubKey> = again.iter().map(|(k, _)| k.clone()).collect();
                let held: Vec<SubKey> = self.model_holders().into_keys().collect();
                prop_assert_eq!(keys, held, "a new session subscribes every held key again");
                for (k, gen) in again {
                    self.upstream.push_back(Change {
                        key: k,
                        subscribe: true,
                        client: None,
                        gen,
                    });
                }
            }
        }
        self.check()
    }

    /// The gateway answered a subscribe (`ok`), or it failed.
    fn settle(&mut self, change: Change, ok: bool) -> Result<(), TestCaseError> {
        let removed = self
            .table
            .settle_subscribe(&change.key, change.client, change.gen, ok);
        // The model: a failure removes its client only if that very
        // subscribe admitted it.
        let expected = !ok
            && change.client.is_some_and(|c| {
                let book = self.books.entry(c).or_default();
                let admitted = book.get(&change.key) == Some(&change.gen);
                if admitted {
                    book.remove(&change.key);
                }
                admitted
            });
        prop_assert_eq!(removed, expected, "settling {:?} ok={}", change, ok);
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let model = self.model_holders();
        // The table's own keys (not `counts`, which leaves out a key with no
        // holder): a key nobody holds must not linger.
        let kept: BTreeSet<&SubKey> = self.table.keys.keys().collect();
        let held: BTreeSet<&SubKey> = model.keys().collect();
        prop_assert_eq!(kept, held, "keys kept vs held");
        let counts = self.table.counts(|_| true);
        for (k, clients) in &model {
            prop_assert_eq!(counts.get(k), Some(&clients.len()), "count of {:?}", k);
        }
        for (k, clients) in &model {
            let holders: BTreeSet<u64> = self.table.holders(k).into_iter().collect();
            prop_assert_eq!(&holders, clients, "holders of {:?}", k);
        }
        if self.upstream.is_empty() && !self.random_failures {
            let held: BTreeSet<SubKey> = model.into_keys().collect();
            prop_assert_eq!(
                &self.gateway,
                &held,
                "quiet: the gateway holds what clients hold"
            );
        }
        Ok(())
    }
}

fn run(ops: Vec<Op>, random_failures: bool) -> Result<(), TestCaseError> {
    let mut world = World {
        random_failures,
        ..World::default()
    };
    for op in ops {
        world.apply(op)?;
    }
    // Drain: whatever is still on its way is answered.
    world.apply(Op::Answer(u8::MAX, false))?;
    Ok(())
}

/// A fixed seed, so the suite runs the same cases every time (as every
/// test here must); `PROPTEST_RNG_SEED=<n>` explores others.
fn config(cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::with_cases(cases);
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        config.rng_seed = proptest::test_runner::RngSeed::Fixed(0x0063_6c61_776d_7578);
    }
    config
}

proptest! {
    #![proptest_config(config(512))]

    /// Refcount, local answers and upstream agreement, with the gateway
    /// refusing by key.
    #[test]
    fn the_table_and_the_gateway_agree(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, false)?;
    }

    /// Refcount and local answers still hold when any answer may fail.
    #[test]
    fn refcounts_hold_whatever_the_gateway_answers(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, true)?;
    }
}

/// Found by the model with random answers, left as it is: when an earlier
/// subscribe for a key succeeded and a later one fails, and the failing
/// one's client was the last holder, the key leaves the table but nothing
/// unsubscribes upstream, so the gateway keeps sending that key's events
/// (to nobody: targeted events go to holders only). A gateway answers a
/// subscribe by its key, so this takes a transient failure (an upstream
/// error answer) between two subscribes of one key; the next subscriber
/// sends a fresh subscribe, which is idempotent upstream.
#[test]
fn a_failure_after_a_success_may_leave_the_gateway_subscribed() {
    let mut s = SubscriptionState::default();
    let k = SubKey::Sessions;
    let Plan::Forward { gen: first } = s.subscribe(&k, 1) else {
        panic!()
    };
    let Plan::Forward { gen: second } = s.subscribe(&k, 2) else {
        panic!("unconfirmed: forwarded again")
    };
    s.settle_subscribe(&k, Some(1), first, true); // the gateway now holds it
    assert_eq!(
        s.unsubscribe(&k, 1),
        Plan::Answer,
        "client 2 still holds it"
    );
    assert!(s.settle_subscribe(&k, Some(2), second, false));
    assert!(
        s.counts(|_| true).is_empty(),
        "nobody holds it, and no unsubscribe was planned"
    );
}
