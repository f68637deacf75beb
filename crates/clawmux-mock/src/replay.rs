//! Replay: the double serves a [`Recording`] instead of its own behaviour.
//!
//! Every connection gets the recorded `hello-ok` (its own `server.connId`
//! and `auth`, the recorded features, snapshot and policy), then the
//! recorded events in order, stamped with its own fresh `seq` (a recorded
//! gap skips one), paced as recorded ([`Pace`]). A request is answered with
//! the answers recorded for the same method and params — the first such
//! request gets the first recorded exchange, the next the next, the last one
//! repeats — and otherwise `INVALID_REQUEST` naming what was asked. The
//! handshake (token, device proof) and `tick`s stay the double's own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::{sleep_until, Instant};

use crate::recording::{Played, Recording};
use crate::state::{lock, res_frame, EncodedEvent, Inner, Outbound};

/// With looping, the pause between the end of the recording and its next
/// start on a connection (also with [`Pace::Instant`], so a looping replay
/// never floods a client).
pub const LOOP_PAUSE: Duration = Duration::from_millis(500);

/// How fast recorded events are played.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pace {
    /// At the recorded pace divided by this factor (2.0 = twice as fast).
    Speed(f64),
    /// All at once, in order.
    Instant,
}

/// A recording being served.
#[derive(Debug)]
pub struct Replay {
    pub recording: Recording,
    pub pace: Pace,
    /// Start again after the end (after [`LOOP_PAUSE`]).
    pub looped: bool,
    /// How many times each group of identical requests was answered.
    served: Mutex<HashMap<usize, usize>>,
    /// The timeline encoded once, shared by every playing connection (not
    /// one copy per connection).
    encoded: Vec<(u64, Option<Arc<EncodedEvent>>)>,
    /// How many times a connection has played the recording to its end, so
    /// `serve --demo --replay` can say when the recording is over.
    ended: tokio::sync::watch::Sender<u64>,
}

impl Replay {
    pub fn new(recording: Recording, pace: Pace, looped: bool) -> Arc<Replay> {
        let encoded = encode(&recording);
        Arc::new(Replay {
            recording,
            pace,
            looped,
            served: Mutex::new(HashMap::new()),
            encoded,
            ended: tokio::sync::watch::Sender::new(0),
        })
    }

    /// Changes each time a connection has played the whole recording (the
    /// value counts the ends).
    pub fn ends(&self) -> tokio::sync::watch::Receiver<u64> {
        self.ended.subscribe()
    }

    /// The distinct methods that have a recorded answer, sorted.
    pub fn answered_methods(&self) -> Vec<&str> {
        let mut m: Vec<&str> = self
            .recording
            .exchanges
            .iter()
            .map(|e| e.method.as_str())
            .collect();
        m.sort_unstable();
        m.dedup();
        m
    }

    /// The `hello-ok` for one connection: the recorded one with this
    /// connection's `connId` and `auth`.
    pub(crate) fn hello(&self, conn_id: &str, auth: &Value) -> Value {
        let mut hello = self.recording.hello.clone();
        if !hello.is_object() {
            hello = json!({});
        }
        hello["type"] = json!("hello-ok");
        if !hello["server"].is_object() {
            hello["server"] = json!({});
        }
        hello["server"]["connId"] = json!(conn_id);
        hello["auth"] = auth.clone();
        hello
    }

    /// The answer frames for one request.
    pub(crate) fn answer(&self, id: &Value, method: &str, params: &Value) -> Vec<String> {
        let matching = self.recording.matching(method, params);
        let Some(&first) = matching.first() else {
            let known = self.answered_methods();
            let mut shown = params.to_string();
            if shown.len() > 200 {
                let cut = (0..=200)
                    .rev()
                    .find(|i| shown.is_char_boundary(*i))
                    .unwrap_or(0);
                shown.truncate(cut);
                shown.push('…');
            }
            let error = json!({
                "code": "INVALID_REQUEST",
                "message": format!(
                    "replay: no recorded answer for {method} with params {shown} ({})",
                    if known.is_empty() {
                        "the recording has no answers: `clawmux record --requests` records them".to_owned()
                    } else {
                        format!("recorded methods: {}", known.join(", "))
                    }
                ),
            });
            return vec![res_frame(id, Err(&error))];
        };
        let n = {
            let mut served = lock(&self.served);
            let count = served.entry(first).or_insert(0);
            let n = (*count).min(matching.len() - 1);
            *count += 1;
            n
        };
        self.recording.exchanges[matching[n]]
            .answers
            .iter()
            .map(|(ok, body)| res_frame(id, if *ok { Ok(body) } else { Err(body) }))
            .collect()
    }
}

/// The timeline as the frames' encoded parts.
fn encode(recording: &Recording) -> Vec<(u64, Option<Arc<EncodedEvent>>)> {
    recording
        .timeline
        .iter()
        .map(|item| match item {
            Played::Event {
                at_ms,
                event,
                payload,
                state_version,
            } => (
                *at_ms,
                Some(Arc::new(EncodedEvent {
                    name_json: Value::from(event.as_str()).to_string(),
                    payload_json: payload.to_string(),
                    state_version_json: state_version.as_ref().map(Value::to_string),
                })),
            ),
            Played::Gap { at_ms } => (*at_ms, None),
        })
        .collect()
}

/// Plays the recorded events to connection `index` until it ends (or the
/// recording does, without looping).
pub(crate) async fn play(inner: Arc<Inner>, index: u64, replay: Arc<Replay>) {
    let mut shutdown = inner.shutdown.subscribe();
    let events = &replay.encoded;
    loop {
        let start = Instant::now();
        for (at_ms, event) in events {
            if let Pace::Speed(speed) = replay.pace {
                // A pause too long to represent (a tiny speed) never ends:
                // waited out until shutdown instead of panicking.
                let due = Duration::try_from_secs_f64(*at_ms as f64 / 1000.0 / speed)
                    .ok()
                    .and_then(|offset| start.checked_add(offset));
                tokio::select! {
                    _ = async {
                        match due {
                            Some(due) => sleep_until(due).await,
                            None => std::future::pending().await,
                        }
                    } => {}
                    _ = crate::state::until_shutdown(&mut shutdown) => return,
                }
            }
            let conns = lock(&inner.conns);
            let Some(entry) = conns.get(&index).filter(|c| c.is_ready()) else {
                return;
            };
            match event {
                Some(event) => entry.send(Outbound::Event(Arc::clone(event)), event.approx_len()),
                None => entry.send(Outbound::SkipSeq, 0),
            }
        }
        replay.ended.send_modify(|n| *n += 1);
        if !replay.looped {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(LOOP_PAUSE) => {}
            _ = crate::state::until_shutdown(&mut shutdown) => return,
        }
    }
}
