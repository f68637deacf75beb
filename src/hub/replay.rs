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
//! Cursors are exclusive: resuming after N starts at the first event after
//! N. They increase by one per event, and skip a number where the hub marks
//! a gap ([`ReplayLog::skip`]). They are valid only within one broker life,
//! named by its [`epoch`](ReplayWindow::epoch), so a stream's ids carry both
//! ([`EventId`], `<epoch>:<cursor>`) and a cursor that names no life, or
//! another one, is never resumed.

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
    /// Resuming after `oldest_seq - 1` or anything newer always works.
    pub oldest_seq: u64,
    /// The last cursor handed out (to an event or to a gap); 0 before the first.
    pub newest_seq: u64,
}

/// An event id as `/v1/events` writes it (`id: <epoch>:<cursor>`) and reads
/// it back (`Last-Event-ID`, `after_seq`): a cursor and, when the text names
/// one, the broker life it belongs to. A bare number is a cursor of no
/// known life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventId {
    pub epoch: Option<String>,
    pub cursor: u64,
}

/// Text that is neither `<epoch>:<cursor>` nor `<cursor>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an event id: expected <epoch>:<cursor> (as in the stream's `id:` lines) or a cursor number")]
pub struct BadEventId(pub String);

impl std::str::FromStr for EventId {
    type Err = BadEventId;

    fn from_str(text: &str) -> Result<Self, BadEventId> {
        let bad = || BadEventId(text.to_owned());
        let (epoch, cursor) = match text.trim().rsplit_once(':') {
            Some((epoch, cursor)) => (Some(epoch), cursor),
            None => (None, text.trim()),
        };
        // `u64::from_str` also takes a leading `+`; an id is digits only.
        if cursor.is_empty() || !cursor.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let cursor = cursor.parse().map_err(|_| bad())?;
        if let Some(e) = epoch {
            if e.is_empty() || !e.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad());
            }
        }
        Ok(EventId {
            epoch: epoch.map(str::to_owned),
            cursor,
        })
    }
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.epoch {
            Some(epoch) => write!(f, "{epoch}:{}", self.cursor),
            None => write!(f, "{}", self.cursor),
        }
    }
}

/// Where a stream asked to start, before the log has checked it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResumePoint {
    /// Resume after this cursor (exclusive); `None`: from now on.
    pub cursor: Option<u64>,
    /// The broker lives the request names (its cursor's and `epoch=`'s);
    /// every one must be this broker's. A cursor with none is refused: it
    /// could be from any life, and resuming it could give a wrong history.
    pub lives: Vec<String>,
}

impl ResumePoint {
    /// `last_event_id` wins over `after_seq`: a reconnecting `EventSource`
    /// repeats its original URL and adds the last id it saw. `epoch` is the
    /// `epoch=` parameter, which qualifies whichever cursor is used.
    pub fn new(
        last_event_id: Option<EventId>,
        after_seq: Option<EventId>,
        epoch: Option<String>,
    ) -> Self {
        let id = last_event_id.or(after_seq);
        let cursor = id.as_ref().map(|id| id.cursor);
        let lives = id
            .and_then(|id| id.epoch)
            .into_iter()
            .chain(epoch)
            .collect();
        ResumePoint { cursor, lives }
    }
}

/// Why the log cannot start a stream where it was asked to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unresumable {
    /// The request names another broker life (this broker restarted since).
    OtherLife(String),
    /// A cursor that names no broker life at all.
    NoLife,
    /// Events after the cursor were evicted from the ring.
    Evicted,
    /// The cursor is newer than any this broker life handed out.
    Future,
}

/// A stream that cannot start: the client reloads `/v1/state` and streams
/// after its `newest_seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayUnavailable {
    pub window: ReplayWindow,
    /// The cursor asked for; `None` for a stream "from now" of another life.
    pub cursor: Option<u64>,
    pub why: Unresumable,
}

impl std::fmt::Display for ReplayUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = &self.window;
        match self.cursor {
            Some(c) => write!(f, "cannot resume after {c}: ")?,
            None => write!(f, "cannot stream: ")?,
        }
        match &self.why {
            Unresumable::OtherLife(e) => write!(
                f,
                "the cursor is from another broker life (epoch {e}; this broker is epoch {}, it restarted since)",
                w.epoch
            )?,
            Unresumable::NoLife => write!(
                f,
                "a bare cursor does not say which broker life it is from (this broker is epoch {}); \
                 resume with the stream's own id (<epoch>:<cursor>) or add epoch=<epoch>",
                w.epoch
            )?,
            Unresumable::Evicted => write!(
                f,
                "those events are no longer held: this broker (epoch {}) holds events {}..={}",
                w.epoch, w.oldest_seq, w.newest_seq
            )?,
            Unresumable::Future => write!(
                f,
                "the cursor is newer than the newest this broker life has handed out ({}, epoch {})",
                w.newest_seq, w.epoch
            )?,
        }
        write!(f, "; reload /v1/state and stream after its newest_seq")
    }
}

/// Why a stream could not start where it asked.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("{0}")]
    ReplayUnavailable(ReplayUnavailable),
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
    /// The newest cursor evicted (0 before any eviction): every event after
    /// it is still held, so resuming after it or anything newer works.
    floor: u64,
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
            floor: 0,
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
                Some(old) => {
                    self.bytes -= old.len();
                    self.floor = old.cursor();
                }
                None => break,
            }
        }
        head
    }

    /// Consumes a cursor with no event: the mark of an upstream gap or
    /// reconnect, which every stream then shows as a skipped id (as
    /// WebSocket clients see a skipped `seq`). Nothing is missing there, so
    /// it never makes a resume fail: streams resumed before it replay the
    /// events after it (and show the same skip).
    pub fn skip(&mut self) {
        self.newest_seq += 1;
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

    /// The events to send first to a stream starting at `from`: those after
    /// its cursor (none for a stream from now), if the log holds them all
    /// and every broker life `from` names is this one.
    pub fn after(&self, from: &ResumePoint) -> Result<Vec<EventHead>, Unresumable> {
        if let Some(other) = from.lives.iter().find(|e| **e != *self.epoch) {
            return Err(Unresumable::OtherLife(other.clone()));
        }
        let Some(cursor) = from.cursor else {
            return Ok(Vec::new());
        };
        if from.lives.is_empty() {
            return Err(Unresumable::NoLife);
        }
        if cursor > self.newest_seq {
            return Err(Unresumable::Future);
        }
        if cursor < self.floor {
            return Err(Unresumable::Evicted);
        }
        // Cursors increase but may skip (gaps): find the first one after `cursor`.
        let first = self.events.partition_point(|e| e.cursor() <= cursor);
        Ok(self.events.range(first..).cloned().collect())
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
    /// events to send first (see [`ReplayLog::after`]) and the window at
    /// that moment. One lock covers both, so the backlog and the live events
    /// meet exactly.
    pub fn admit_at_cursor(
        &self,
        client: &Arc<Client>,
        from: &ResumePoint,
    ) -> Result<(Vec<EventHead>, ReplayWindow), SubscribeError> {
        let mut inner = self.lock();
        let backlog = inner.replay.after(from).map_err(|why| {
            SubscribeError::ReplayUnavailable(ReplayUnavailable {
                window: inner.replay.window(),
                cursor: from.cursor,
                why,
            })
        })?;
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

    /// Resuming after `cursor` of `log`'s own life.
    fn at(log: &ReplayLog, cursor: u64) -> ResumePoint {
        ResumePoint {
            cursor: Some(cursor),
            lives: vec![log.window().epoch.to_string()],
        }
    }

    fn id(text: &str) -> EventId {
        text.parse().unwrap()
    }

    #[test]
    fn event_ids_parse_with_and_without_a_life() {
        assert_eq!(
            id("5f0c9a1b2c3d4e5f:42"),
            EventId {
                epoch: Some("5f0c9a1b2c3d4e5f".into()),
                cursor: 42
            }
        );
        assert_eq!(
            id(" 42 "),
            EventId {
                epoch: None,
                cursor: 42
            }
        );
        assert_eq!(id("ab:0").to_string(), "ab:0");
        assert_eq!(id("7").to_string(), "7");
        for bad in [
            "",
            ":",
            "ab:",
            ":5",
            "+5",
            "ab:+5",
            "ab:-1",
            "a b:5",
            "ab:5x",
            "abc",
            "ab:18446744073709551616",
        ] {
            assert_eq!(
                bad.parse::<EventId>(),
                Err(BadEventId(bad.to_owned())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn resume_points_take_the_header_first_and_collect_every_life() {
        let p = ResumePoint::new(Some(id("a:7")), Some(id("b:3")), Some("c".into()));
        assert_eq!(p.cursor, Some(7));
        assert_eq!(p.lives, ["a", "c"], "after_seq's life is not used");
        let p = ResumePoint::new(None, Some(id("3")), Some("c".into()));
        assert_eq!((p.cursor, &p.lives[..]), (Some(3), &["c".to_owned()][..]));
        let p = ResumePoint::new(Some(id("3")), None, None);
        assert_eq!((p.cursor, p.lives.is_empty()), (Some(3), true));
        assert_eq!(ResumePoint::new(None, None, None), ResumePoint::default());
    }

    #[test]
    fn count_bound_evicts_oldest_and_replay_is_exclusive() {
        let mut log = log(5, usize::MAX);
        assert_eq!(
            log.after(&at(&log, 0)).unwrap().len(),
            0,
            "empty log, cursor 0"
        );
        for n in 1..=12 {
            assert_eq!(log.append(event(n)).cursor(), n);
        }
        let w = log.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (8, 12));
        for cursor in 7..=12 {
            let expected: Vec<u64> = (cursor + 1..=12).collect();
            assert_eq!(cursors(&log.after(&at(&log, cursor)).unwrap()), expected);
        }
        assert_eq!(log.after(&at(&log, 6)).err(), Some(Unresumable::Evicted));
        assert_eq!(log.after(&at(&log, 13)).err(), Some(Unresumable::Future));
        assert_eq!(
            log.after(&ResumePoint::default()).unwrap().len(),
            0,
            "from now"
        );
    }

    #[test]
    fn every_life_named_must_be_this_one_and_a_cursor_must_name_one() {
        let mut a = log(10, usize::MAX);
        let b = log(10, usize::MAX);
        let (ea, eb) = (a.window().epoch.to_string(), b.window().epoch.to_string());
        assert_ne!(ea, eb);
        a.append(event(1));
        assert_eq!(a.after(&at(&a, 0)).unwrap().len(), 1);
        assert_eq!(
            a.after(&at(&b, 0)).err(),
            Some(Unresumable::OtherLife(eb.clone()))
        );
        let both = ResumePoint {
            cursor: Some(0),
            lives: vec![ea.clone(), eb.clone()],
        };
        assert_eq!(
            a.after(&both).err(),
            Some(Unresumable::OtherLife(eb.clone()))
        );
        let from_now_of_b = ResumePoint {
            cursor: None,
            lives: vec![eb.clone()],
        };
        assert_eq!(
            a.after(&from_now_of_b).err(),
            Some(Unresumable::OtherLife(eb))
        );
        let bare = ResumePoint {
            cursor: Some(0),
            lives: vec![],
        };
        assert_eq!(a.after(&bare).err(), Some(Unresumable::NoLife));
    }

    #[test]
    fn a_gap_skips_a_cursor_and_resuming_around_it_works() {
        let mut log = log(3, usize::MAX);
        log.append(event(1));
        log.append(event(2));
        log.skip();
        assert_eq!(
            log.window().newest_seq,
            3,
            "the skipped cursor is handed out"
        );
        assert_eq!(log.append(event(4)).cursor(), 4);
        assert_eq!(cursors(&log.after(&at(&log, 2)).unwrap()), [4]);
        assert_eq!(cursors(&log.after(&at(&log, 3)).unwrap()), [4]);
        assert_eq!(cursors(&log.after(&at(&log, 1)).unwrap()), [2, 4]);
        // Evict 1 and 2: the skipped 3 is not "missing", so resuming after
        // 2 (the last event before the gap) still works.
        log.append(event(5));
        log.append(event(6));
        let w = log.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (4, 6));
        assert_eq!(cursors(&log.after(&at(&log, 2)).unwrap()), [4, 5, 6]);
        assert_eq!(log.after(&at(&log, 1)).err(), Some(Unresumable::Evicted));
        // A gap at the end: resuming at the newest cursor is fine.
        log.skip();
        assert!(log.after(&at(&log, 7)).unwrap().is_empty());
        assert_eq!(
            cursors(&log.after(&at(&log, 6)).unwrap()),
            Vec::<u64>::new()
        );
        assert_eq!(log.after(&at(&log, 8)).err(), Some(Unresumable::Future));
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
            none.after(&at(&none, 1)).unwrap().is_empty(),
            "resume at newest works"
        );
        assert_eq!(none.after(&at(&none, 0)).err(), Some(Unresumable::Evicted));
    }

    #[test]
    fn unavailable_messages_say_why_and_what_to_do() {
        let window = ReplayWindow {
            epoch: "e2".into(),
            oldest_seq: 10,
            newest_seq: 20,
        };
        let msg = |cursor, why| {
            ReplayUnavailable {
                window: window.clone(),
                cursor,
                why,
            }
            .to_string()
        };
        let future = msg(Some(25), Unresumable::Future);
        assert!(future.contains("newer than the newest"), "{future}");
        assert!(!future.contains("no longer held"), "{future}");
        let old = msg(Some(3), Unresumable::Evicted);
        assert!(
            old.contains("no longer held") && old.contains("10..=20"),
            "{old}"
        );
        let other = msg(Some(3), Unresumable::OtherLife("e1".into()));
        assert!(other.contains("another broker life (epoch e1"), "{other}");
        let bare = msg(Some(3), Unresumable::NoLife);
        assert!(bare.contains("<epoch>:<cursor>"), "{bare}");
        for m in [future, old, other, bare] {
            assert!(
                m.ends_with("reload /v1/state and stream after its newest_seq"),
                "{m}"
            );
        }
    }
}
