//! The replay log: a ring of recent events, each tagged with a broker-wide
//! cursor (`event_seq`), so HTTP clients can take a snapshot and then stream
//! everything after it, and resume where they left off (design §6).
//!
//! The log lives inside the hub's lock: an event is logged and fanned out in
//! one step, and a snapshot or a new stream reads the log under the same
//! lock, so "state, then every event after its cursor" has no hole and no
//! overlap. Appending is O(1) (a `VecDeque` push plus evictions of what the
//! push pushed out) and shares the event's bytes with the client queues.
//!
//! Cursors are exclusive: resuming after N starts at N+1. They are valid only
//! within one broker life, named by its [`epoch`](ReplayWindow::epoch).

use std::collections::VecDeque;
use std::sync::Arc;

use serde_json::Value;

use super::{Client, ClientKind, Hub, TooManyClients};
use crate::protocol::EventHead;

/// How much history the log keeps (from [`crate::config::Limits`]).
#[derive(Debug, Clone, Copy)]
pub struct ReplayLimits {
    /// Events kept at most.
    pub max_events: usize,
    /// Encoded bytes kept at most.
    pub max_bytes: usize,
}

impl Default for ReplayLimits {
    fn default() -> Self {
        let limits = crate::config::Limits::default();
        ReplayLimits {
            max_events: limits.replay_max_events,
            max_bytes: limits.replay_max_bytes,
        }
    }
}

/// What the log can replay right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayWindow {
    /// Names this broker life; cursors from another epoch mean nothing here.
    pub epoch: Arc<str>,
    /// The oldest event still held; `newest_seq + 1` when none is held.
    pub oldest_seq: u64,
    /// The last cursor handed out; 0 before the first event.
    pub newest_seq: u64,
}

impl ReplayWindow {
    /// Whether a stream can resume after `cursor` without missing anything.
    pub fn covers(&self, cursor: u64) -> bool {
        cursor.saturating_add(1) >= self.oldest_seq && cursor <= self.newest_seq
    }
}

/// Why a stream could not start where it asked.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The cursor is outside the window or from another epoch; the client
    /// reloads `/v1/state` and streams from its `newest_seq`.
    #[error(
        "cannot resume there: this broker (epoch {}) holds events {}..={}",
        .0.epoch, .0.oldest_seq, .0.newest_seq
    )]
    ReplayUnavailable(ReplayWindow),
    #[error(transparent)]
    TooManyClients(#[from] TooManyClients),
}

/// The ring of recent events.
#[derive(Debug)]
pub struct ReplayLog {
    epoch: Arc<str>,
    limits: ReplayLimits,
    events: VecDeque<EventHead>,
    bytes: usize,
    newest_seq: u64,
}

impl Default for ReplayLog {
    fn default() -> Self {
        ReplayLog::new(ReplayLimits::default())
    }
}

impl ReplayLog {
    /// An empty log with a fresh random epoch.
    pub fn new(limits: ReplayLimits) -> Self {
        ReplayLog {
            epoch: format!("{:016x}", rand::random::<u64>()).into(),
            limits,
            events: VecDeque::new(),
            bytes: 0,
            newest_seq: 0,
        }
    }

    /// Logs an event under the next cursor and returns it tagged with that
    /// cursor (the tagged copy is what clients are sent).
    pub fn append(&mut self, head: EventHead) -> EventHead {
        self.newest_seq += 1;
        let head = head.with_cursor(self.newest_seq);
        self.bytes += head.len();
        self.events.push_back(head.clone());
        while self.events.len() > self.limits.max_events || self.bytes > self.limits.max_bytes {
            match self.events.pop_front() {
                Some(old) => self.bytes -= old.len(),
                None => break,
            }
        }
        head
    }

    pub fn window(&self) -> ReplayWindow {
        ReplayWindow {
            epoch: Arc::clone(&self.epoch),
            oldest_seq: self
                .events
                .front()
                .map_or(self.newest_seq + 1, EventHead::cursor),
            newest_seq: self.newest_seq,
        }
    }

    /// Events after `cursor` (exclusive), if the log still holds all of them.
    /// `epoch`, when given, must be this log's.
    pub fn after(&self, cursor: u64, epoch: Option<&str>) -> Result<Vec<EventHead>, ReplayWindow> {
        let window = self.window();
        if epoch.is_some_and(|e| e != &*self.epoch) || !window.covers(cursor) {
            return Err(window);
        }
        // Cursors are contiguous, so the first event to send is at a known index.
        let skip = (cursor + 1 - window.oldest_seq) as usize;
        Ok(self.events.iter().skip(skip).cloned().collect())
    }

    /// Events and bytes held now (for metrics).
    pub fn held(&self) -> (usize, usize) {
        (self.events.len(), self.bytes)
    }
}

/// The hub's HTTP-facing side: snapshots with a cursor and streams that start
/// at one, both under the lock that publishing takes.
impl Hub {
    /// Sets how much history the replay log keeps (at startup, before any
    /// event: it starts a new, empty log).
    pub fn set_replay_limits(&self, limits: ReplayLimits) {
        self.lock().replay = ReplayLog::new(limits);
    }

    /// A new client of `kind`, not yet receiving events.
    pub fn new_client_of_kind(&self, kind: ClientKind) -> Arc<Client> {
        let id = self
            .next_client_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(self.client_with_id(id).with_kind(kind))
    }

    /// The gateway snapshot and the replay window, taken together: streaming
    /// after `newest_seq` continues exactly where the snapshot stops.
    pub fn snapshot_with_window(&self) -> (Value, ReplayWindow) {
        let inner = self.lock();
        (inner.snapshot.clone(), inner.replay.window())
    }

    pub fn replay_window(&self) -> ReplayWindow {
        self.lock().replay.window()
    }

    /// Events and bytes the replay log holds now.
    pub fn replay_held(&self) -> (usize, usize) {
        self.lock().replay.held()
    }

    /// Starts delivering live events to `client` and returns the logged
    /// events after `cursor` to send first (with no cursor: none, live from
    /// now on), and the window at that moment. One lock covers both, so the
    /// backlog and the live events meet exactly.
    pub fn admit_at_cursor(
        &self,
        client: &Arc<Client>,
        cursor: Option<u64>,
        epoch: Option<&str>,
    ) -> Result<(Vec<EventHead>, ReplayWindow), SubscribeError> {
        let mut inner = self.lock();
        let backlog = match cursor {
            Some(cursor) => inner
                .replay
                .after(cursor, epoch)
                .map_err(SubscribeError::ReplayUnavailable)?,
            None => {
                let window = inner.replay.window();
                if epoch.is_some_and(|e| e != &*window.epoch) {
                    return Err(SubscribeError::ReplayUnavailable(window));
                }
                Vec::new()
            }
        };
        if inner.clients.len() >= self.max_clients {
            return Err(TooManyClients(self.max_clients).into());
        }
        inner.clients.insert(client.id, Arc::clone(client));
        Ok((backlog, inner.replay.window()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(max_events: usize, max_bytes: usize) -> ReplayLog {
        ReplayLog::new(ReplayLimits {
            max_events,
            max_bytes,
        })
    }

    fn event(n: u64) -> EventHead {
        EventHead::from_value("tick", &serde_json::json!({ "n": format!("{n:04}") }))
    }

    fn cursors(events: &[EventHead]) -> Vec<u64> {
        events.iter().map(EventHead::cursor).collect()
    }

    #[test]
    fn resuming_from_every_cursor_in_the_window_is_exact() {
        let mut log = log(5, usize::MAX);
        assert_eq!(log.after(0, None).unwrap().len(), 0, "empty log, cursor 0");
        for n in 1..=12 {
            assert_eq!(log.append(event(n)).cursor(), n);
        }
        let w = log.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (8, 12));
        for cursor in 7..=12 {
            let expected: Vec<u64> = (cursor + 1..=12).collect();
            assert_eq!(cursors(&log.after(cursor, None).unwrap()), expected);
        }
        assert!(log.after(6, None).is_err(), "event 7 was evicted");
        assert!(log.after(13, None).is_err(), "a cursor from the future");
    }

    #[test]
    fn epochs_must_match() {
        let mut a = log(10, usize::MAX);
        let b = log(10, usize::MAX);
        assert_ne!(a.window().epoch, b.window().epoch);
        a.append(event(1));
        let epoch = a.window().epoch;
        assert_eq!(a.after(0, Some(&epoch)).unwrap().len(), 1);
        let err = a.after(0, Some(&b.window().epoch)).unwrap_err();
        assert_eq!(err.newest_seq, 1);
    }

    #[test]
    fn bytes_bound_evicts_oldest_and_cursor_survives_an_empty_log() {
        let one = event(1).len();
        let mut log = log(100, one * 3);
        for n in 1..=10 {
            log.append(event(n));
        }
        assert_eq!(log.held(), (3, one * 3));
        assert_eq!(log.window().oldest_seq, 8);
        let mut none = self::log(0, usize::MAX);
        none.append(event(1));
        let w = none.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (2, 1));
        assert!(
            none.after(1, None).unwrap().is_empty(),
            "resume at newest works"
        );
        assert!(none.after(0, None).is_err());
    }
}
