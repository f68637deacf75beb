//! Subscriptions under concurrency: many clients subscribing, unsubscribing
//! and disconnecting without awaiting each step must leave the gateway
//! subscribed to exactly what the broker believes its clients hold.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::support::*;
use rand::Rng;
use serde_json::json;

/// The broker's view: (sessions held by anyone, message keys held by anyone).
fn broker_view(h: &Harness) -> (bool, BTreeSet<String>) {
    let (sessions, messages) = h.broker.ctx().sharing.subscriptions.counts();
    (
        sessions > 0,
        messages
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, _)| k)
            .collect(),
    )
}

/// The gateway's view: the one upstream connection's subscriptions.
fn gateway_view(h: &Harness) -> Option<(bool, BTreeSet<String>)> {
    let conns = h.gw.subscriptions();
    let [(sessions, keys)] = conns.as_slice() else {
        return None;
    };
    Some((*sessions, keys.iter().cloned().collect()))
}

const KEYS: [&str; 2] = ["agent:main:main", "agent:main:side"];

fn random_change(rng: &mut impl Rng, id: &str) -> serde_json::Value {
    let key = KEYS[rng.random_range(0..KEYS.len())];
    let (method, params) = match rng.random_range(0..4) {
        0 => ("sessions.subscribe", json!({})),
        1 => ("sessions.unsubscribe", json!({})),
        2 => ("sessions.messages.subscribe", json!({"key": key})),
        _ => ("sessions.messages.unsubscribe", json!({"key": key})),
    };
    json!({"type":"req","id":id,"method":method,"params":params})
}

/// Randomized: per round, every client fires a few changes without waiting
/// for answers and some of them disconnect at once; then the two views must
/// agree. Bounded in rounds and in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_changes_and_disconnects_leave_gateway_and_broker_in_agreement() {
    const ROUNDS: usize = 1500;
    const CLIENTS: usize = 4;
    let time_box = Duration::from_secs(40);
    let h = start().await;
    let mut rng = rand::rng();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(h.connected().await.0);
    }
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS && started.elapsed() < time_box {
        rounds += 1;
        // Fire changes from every client without awaiting any answer.
        let mut leaving = Vec::new();
        for (i, c) in clients.iter_mut().enumerate() {
            for n in 0..rng.random_range(1..4) {
                c.send_json(&random_change(&mut rng, &format!("r{rounds}-{n}")))
                    .await;
            }
            if rng.random_bool(0.3) {
                leaving.push(i);
            }
        }
        // Those leaving go at once (their answers unread); the others keep on.
        for i in leaving.into_iter().rev() {
            let gone = clients.swap_remove(i);
            drop(gone);
        }
        // Newcomers subscribe at once too, racing the releases.
        while clients.len() < CLIENTS {
            let (mut c, _) = h.connected().await;
            c.send_json(&random_change(&mut rng, "new")).await;
            clients.push(c);
        }
        // A barrier per client: its answers are read up to here.
        for c in clients.iter_mut() {
            assert_eq!(c.request("health", json!({})).await["ok"], true);
        }
        let what = format!("round {rounds}: the gateway holds what the broker believes");
        eventually_async(&what, || {
            let (b, g) = (broker_view(&h), gateway_view(&h));
            let seen = (g.as_ref() != Some(&b))
                .then(|| format!("the gateway holds {g:?} but the broker believes {b:?}"));
            async move { seen.map_or(Ok(()), Err) }
        })
        .await;
    }
    assert!(rounds >= 100, "only {rounds} rounds ran in {time_box:?}");
    eprintln!("{rounds} rounds in {:?}", started.elapsed());
}
