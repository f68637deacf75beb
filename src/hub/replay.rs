//! The replay log: a ring of recent events, each tagged with a broker-wide
//! cursor (`event_seq`), so HTTP clients can take a snapshot and then stream
//! everything after it, and resume where they left off (design §6; the
//! Holon event stream's cursor contract).
//!
//! The log lives inside the hub's lock: an event is logged and fanned out in
//! one step, and a snapshot or a new stream reads the log under the same
//! lock, so "state, then every event after its cursor" has no hole and no
//! overlap. Appending is O(1) (a `VecDeque` push plus evictions of what the
//! push pushed out) and shares the event's bytes with the client queues.
//!
//! Every event the broker receives is logged, broadcast or targeted, with
//! its [`Audience`]; a reader resuming from a cursor gets the events
//! [`may_see`] lets it see, the rule live delivery uses (design §11).
//!
//! Cursors are exclusive: resuming after N starts at the first event after
//! N. They increase by one per event, skip a number where the hub marks a
//! gap ([`ReplayLog::skip`]), stay at most [`MAX_CURSOR`] (2^53 − 1), and
//! are durable: they only grow across broker lives. With a state dir the
//! log is kept on disk ([`store`]) and the next life continues it (after a
//! `clawmux.gap` event for the downtime), so a cursor from before a restart
//! resumes; every life starts its cursors above the file's newest and
//! above the current time in microseconds, so above any earlier life's,
//! with a file or without. The broker life's [`epoch`](ReplayWindow::epoch)
//! is information only.

pub(crate) mod cursors;
mod cut;
pub(crate) mod store;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};

use super::{Client, ClientKind, Hub, TooManyClients};
use crate::protocol::{now_ms, EventHead};
use crate::sharing::{may_see, Audience, Reader};

pub use store::{file_bound, file_name, COMPACT_SLACK, SYNC_EVERY};

/// The event that marks a hole in the log: logged once per restart (the
/// downtime), and written by streams where the cursors they receive skip.
pub const GAP_EVENT: &str = "clawmux.gap";

/// The largest cursor handed out: `Number.MAX_SAFE_INTEGER`, so every
/// cursor reads exactly in JavaScript (and in any JSON parser that uses
/// doubles).
pub const MAX_CURSOR: u64 = (1 << 53) - 1;

/// A log continued from disk must leave this many cursors below
/// [`MAX_CURSOR`] (years of events at any real rate); one whose cursors
/// are closer (damage, a hand-edited file) starts a new epoch instead:
/// its history is dropped and the new life's cursors start at the current
/// time in microseconds, after a `clawmux.gap`.
pub const CURSOR_HEADROOM: u64 = 1 << 44;

/// The most bytes one event takes in the log. An event larger than this
/// (or than `replay_max_bytes`, if smaller) is kept with its longest
/// strings cut (keeping their start, ending in `…`) until it fits, and
/// `"clawmuxCut": true` added to its payload; live readers got it whole.
/// Tool results are what grows past it (a `read` of a large file).
pub const MAX_LOGGED_EVENT_BYTES: usize = 1024 * 1024;

/// One event as the log keeps it: the frame as received, who it was for,
/// and whether cursors were skipped just before it.
#[derive(Debug, Clone)]
pub struct Logged {
    pub head: EventHead,
    /// Who could see it live ([`may_see`] decides for history too).
    pub audience: Audience,
    /// Cursors right before this one were skipped (an upstream gap or
    /// reconnect): a reader resuming before them is told of the gap.
    pub gap_before: bool,
}

impl Logged {
    pub fn cursor(&self) -> u64 {
        self.head.cursor()
    }
}

/// The events a stream resuming from a cursor is sent first: those its
/// reader may see, each with whether a gap comes before it.
#[derive(Debug, Default)]
pub struct Backlog {
    pub events: Vec<(EventHead, bool)>,
    /// A gap comes after the last of them (before the first live event).
    pub gap_after: bool,
}

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
        ReplayLimits::from(&crate::config::Limits::default())
    }
}

impl From<&crate::config::Limits> for ReplayLimits {
    fn from(limits: &crate::config::Limits) -> Self {
        ReplayLimits {
            max_events: limits.replay_max_events,
            max_bytes: limits.replay_max_bytes,
        }
    }
}

/// What the log can replay right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayWindow {
    /// Names this broker life (information: cursors are valid across lives).
    pub epoch: Arc<str>,
    /// The oldest event still held; `newest_seq + 1` when none is held.
    /// Resuming after `oldest_seq - 1` or anything newer always works.
    pub oldest_seq: u64,
    /// The last cursor handed out (to an event or to a gap).
    pub newest_seq: u64,
}

/// An event id as `/v1/events` writes it (`id: <cursor>`) and reads it back
/// (`Last-Event-ID`, `after_seq`). Ids of older brokers
/// (`<epoch>:<cursor>`) are still read; their epoch is kept for
/// information and plays no part in resuming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventId {
    pub epoch: Option<String>,
    pub cursor: u64,
}

/// Text that is neither `<cursor>` nor `<epoch>:<cursor>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an event id: expected a cursor number (as in the stream's `id:` lines and /v1/state's newest_seq)")]
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
    /// The broker lives the request names (an old-style id's, `epoch=`):
    /// each must be one this log remembers, else its cursor could be a
    /// stranger's (an older clawmux's, whose cursors restarted at 1).
    pub lives: Vec<String>,
}

impl ResumePoint {
    /// `last_event_id` wins over `after_seq`: a reconnecting `EventSource`
    /// repeats its original URL and adds the last id it saw. A life named
    /// (`epoch=`, or the life in an old-style id) only has to be one of
    /// this log's: cursors are durable, so every life of the log reads them alike.
    pub fn new(
        last_event_id: Option<EventId>,
        after_seq: Option<EventId>,
        epoch: Option<String>,
    ) -> Self {
        let id = last_event_id.or(after_seq);
        ResumePoint {
            cursor: id.as_ref().map(|id| id.cursor),
            lives: id
                .and_then(|id| id.epoch)
                .into_iter()
                .chain(epoch)
                .collect(),
        }
    }
}

/// Why the log cannot start a stream where it was asked to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unresumable {
    /// Events after the cursor are no longer held (evicted, or from before
    /// the history this broker kept).
    Evicted,
    /// No broker life handed out this cursor (it is newer than the newest).
    Future,
    /// The request names a broker life this log does not remember (an
    /// older clawmux without durable cursors, or another state dir).
    UnknownLife(String),
}

/// A stream that cannot start: the client reloads `/v1/state` and streams
/// after its `newest_seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayUnavailable {
    pub window: ReplayWindow,
    /// The cursor asked for.
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
            Unresumable::Evicted => write!(
                f,
                "those events are no longer held (the broker holds events {}..={}; the oldest kept is in error.details.oldest_seq)",
                w.oldest_seq, w.newest_seq
            )?,
            Unresumable::Future => write!(
                f,
                "the cursor is newer than the newest the broker has handed out ({})",
                w.newest_seq
            )?,
            Unresumable::UnknownLife(e) => write!(
                f,
                "epoch {e} is not a broker life this replay log remembers (an older clawmux, or another state dir), so its cursors mean nothing here; cursors are plain numbers now (this broker is epoch {})",
                w.epoch
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

/// Microseconds since the Unix epoch: the first cursor of a life that
/// cannot continue an earlier one, above any cursor an earlier life handed
/// out (it would have needed more than one event per microsecond).
/// Below 2^53 until the year 2255, so JavaScript reads it exactly.
fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The ring of recent events.
#[derive(Debug)]
pub struct ReplayLog {
    epoch: Arc<str>,
    limits: ReplayLimits,
    events: VecDeque<Logged>,
    /// Cursors were skipped since the last logged event.
    pending_gap: bool,
    bytes: usize,
    newest_seq: u64,
    /// The newest cursor evicted (or the life's starting point): every
    /// event after it is still held, so resuming after it or anything newer
    /// works.
    floor: u64,
    /// The file the log is kept in, when it is.
    persist: Option<store::Persist>,
    /// The broker lives whose cursors this log holds, this one last.
    lives: Vec<String>,
    /// The cursors reserved in the state dir ([`cursors`]); `None`: the
    /// cursors are numbered by the clock.
    reservation: Option<Arc<cursors::Reservation>>,
}

impl Default for ReplayLog {
    fn default() -> Self {
        ReplayLog::new(ReplayLimits::default())
    }
}

impl ReplayLog {
    /// An empty in-memory log starting at cursor 0, with a fresh random
    /// epoch (tests; the broker uses [`ReplayLog::open`]).
    pub fn new(limits: ReplayLimits) -> Self {
        ReplayLog::starting_at(limits, 0)
    }

    fn starting_at(limits: ReplayLimits, base: u64) -> Self {
        let epoch = format!("{:016x}", rand::random::<u64>());
        ReplayLog {
            lives: vec![epoch.clone()],
            epoch: epoch.into(),
            limits,
            events: VecDeque::new(),
            pending_gap: false,
            bytes: 0,
            newest_seq: base,
            floor: base,
            persist: None,
            reservation: None,
        }
    }

    /// The first cursor at or above `at_least` this life may hand out, and
    /// its reservation in `cursor_file` (none: by the clock, above any
    /// earlier life's). Disk I/O: at start.
    fn first_cursor(
        cursor_file: Option<&Path>,
        at_least: u64,
        continued: bool,
    ) -> (u64, Option<Arc<cursors::Reservation>>) {
        let by_clock = || (at_least.max(now_micros()), None);
        let Some(path) = cursor_file else {
            return if continued {
                (at_least, None)
            } else {
                by_clock()
            };
        };
        let first = if continued {
            at_least
        } else {
            match cursors::first_allowed(path) {
                Ok(allowed) => at_least.max(allowed.unwrap_or(1)),
                Err(why) => {
                    tracing::warn!(%why, "replay log: numbering cursors by the clock");
                    return by_clock();
                }
            }
        };
        match cursors::Reservation::start(path, first) {
            Ok(reservation) => (first, Some(reservation)),
            Err(why) => {
                tracing::warn!(%why, "replay log: cannot reserve cursors; numbering them by the clock");
                if continued {
                    (at_least, None)
                } else {
                    by_clock()
                }
            }
        }
    }

    /// An in-memory log whose cursors start above any earlier life's.
    pub fn in_memory(limits: ReplayLimits) -> Self {
        ReplayLog::starting_at(limits, now_micros())
    }

    /// The log kept in `file` (`None`: in memory only): what the previous
    /// life left is loaded, a `clawmux.gap` event for the downtime is
    /// appended, and a writer thread keeps the file from then on. A file
    /// that cannot be used is logged and the log stays in memory. Does disk
    /// I/O: call it before the log is shared, never under the hub's lock.
    ///
    /// `handed_newest`: this life takes over from the previous instance
    /// (design §11), whose log handed out cursors up to this one. When that
    /// instance closed this very file there (it was cleanly closed and ends
    /// at that cursor), nothing was missed in between (what the gateway
    /// sent meanwhile waits on the connection that moved, or a reconnect
    /// says its own gap): the cursors go on from the last one, and no gap
    /// is logged, so history shows what the moved clients saw live.
    /// Otherwise (the file is another's, or older) it is a restart, above
    /// the handed cursor too.
    pub fn open(limits: ReplayLimits, file: Option<&Path>, handed_newest: Option<u64>) -> Self {
        ReplayLog::open_with(limits, file, None, handed_newest)
    }

    /// [`ReplayLog::open`], with the cursor reservation in `cursor_file`
    /// (see [`cursors`]; `None`: cursors by the clock).
    pub fn open_with(
        limits: ReplayLimits,
        file: Option<&Path>,
        cursor_file: Option<&Path>,
        handed_newest: Option<u64>,
    ) -> Self {
        let in_memory = || {
            let (first, reservation) =
                ReplayLog::first_cursor(cursor_file, handed_newest.map_or(1, |n| n + 1), false);
            let mut log = ReplayLog::starting_at(limits, first - 1);
            log.reservation = reservation;
            log
        };
        let Some(path) = file else {
            return in_memory();
        };
        let mut opened = match store::open(path, limits) {
            Ok(opened) => opened,
            Err(why) => {
                tracing::warn!(%why, "replay log: cannot use the file; history will not survive a restart");
                return in_memory();
            }
        };
        let mut loaded = std::mem::take(&mut opened.loaded);
        let mut new_epoch = false;
        let at_the_limit = loaded.newest > MAX_CURSOR - CURSOR_HEADROOM;
        if at_the_limit {
            // Continuing would run out of exact cursors: a new epoch, as
            // for a file damaged beyond use (its cursors are answered 410).
            tracing::warn!(
                file = %path.display(),
                newest = loaded.newest,
                "replay log: the file's cursors are too close to 2^53; starting a new epoch without its history"
            );
            loaded = store::Loaded {
                bad_lines: loaded.bad_lines.max(1),
                ..Default::default()
            };
        }
        let mut log = ReplayLog::starting_at(limits, loaded.floor);
        let mut lives = loaded.lives.clone();
        store::remember(&mut lives, &log.epoch);
        log.lives = lives;
        for (logged, _) in &loaded.events {
            log.push(logged.clone());
        }
        let known = loaded.newest.max(log.newest_seq);
        let clean = loaded.stopped_at.is_some();
        // The previous instance handed out cursors up to `handed_newest`,
        // and the file ends there: nothing is missing, nothing was written
        // after (whether or not it carries the stop record: an upgrade's
        // new instance that was not committed may have rewritten it, the
        // same records, before the old one serves again).
        let continued = loaded.any && handed_newest == Some(loaded.newest);
        // Every life starts its cursors above any earlier life's: above the
        // newest the file shows, and above the current time in
        // microseconds, which is above anything a life that kept no file
        // (`replay_persist = false`), or crashed before writing, handed out
        // (it would have needed more than one event per microsecond). A
        // life handed a file that ends at the cursor it was handed goes on
        // right after it.
        let (start, reservation) = if continued {
            ReplayLog::first_cursor(cursor_file, known + 1, true)
        } else {
            ReplayLog::first_cursor(
                cursor_file,
                (known + 1).max(handed_newest.map_or(0, |n| n + 1)),
                false,
            )
        };
        log.reservation = reservation;
        let gap = (loaded.any && !continued).then_some(start);
        match gap {
            Some(gap) => log.newest_seq = gap - 1,
            None if continued => {
                log.newest_seq = known;
                tracing::info!(
                    file = %path.display(),
                    held = log.events.len(),
                    after = known,
                    "replay log: continuing the previous instance's history (handed over)"
                );
            }
            None => {
                log.newest_seq = start - 1;
                log.floor = log.newest_seq;
                // Something was there (damaged beyond use): say so.
                new_epoch |= loaded.bad_lines > 0 || loaded.skipped_bytes > 0;
            }
        }
        let kept = loaded
            .events
            .into_iter()
            .filter(|(logged, _)| logged.cursor() > log.floor)
            .collect();
        match opened.start(limits, log.floor, kept, log.lives.clone()) {
            Ok(persist) => log.persist = Some(persist),
            Err(why) => {
                tracing::warn!(%why, "replay log: cannot write the file; history will not survive a restart")
            }
        }
        if let Some(gap) = gap {
            let started = now_ms();
            let stopped = loaded.stopped_at.or(loaded.last_ts);
            let payload = json!({
                "reason": "broker_restart",
                "after": known,
                "next": gap,
                "clean": clean,
                "stopped_at_ms": stopped,
                "started_at_ms": started,
                "down_ms": stopped.map(|s| started.saturating_sub(s)),
            });
            log.append(EventHead::from_value(GAP_EVENT, &payload), &Audience::All);
            tracing::info!(
                file = %path.display(),
                held = log.events.len(),
                after = known,
                clean,
                "replay log: continuing the previous broker life's history"
            );
        }
        if new_epoch {
            // What the file held is unknown or unusable: say so, with the
            // cursor the new epoch starts after.
            let payload = json!({
                "reason": "new_epoch",
                "after": log.newest_seq,
                "next": log.newest_seq + 1,
                "started_at_ms": now_ms(),
            });
            log.append(EventHead::from_value(GAP_EVENT, &payload), &Audience::All);
        }
        log
    }

    /// Holds a tagged event, evicting the oldest past the limits.
    fn push(&mut self, logged: Logged) {
        self.newest_seq = logged.cursor();
        self.bytes += logged.head.len();
        self.events.push_back(logged);
        while self.events.len() > self.limits.max_events || self.bytes > self.limits.max_bytes {
            match self.events.pop_front() {
                Some(old) => {
                    self.bytes -= old.head.len();
                    self.floor = old.cursor();
                }
                None => break,
            }
        }
    }

    /// Logs an event for `audience` under the next cursor and returns it
    /// tagged with that cursor (the tagged copy is what clients are sent,
    /// whole even when the log keeps it cut: [`MAX_LOGGED_EVENT_BYTES`]).
    /// Queues it for the file without blocking (no disk I/O here).
    pub fn append(&mut self, head: EventHead, audience: &Audience) -> EventHead {
        self.append_cut(head, None, audience)
    }

    /// [`ReplayLog::append`] of a gateway event, with the cut copy of it
    /// the log keeps when it is larger than [`MAX_LOGGED_EVENT_BYTES`]
    /// ([`cut_for_the_log`], made before the hub's lock is taken).
    pub fn append_cut(
        &mut self,
        head: EventHead,
        cut: Option<EventHead>,
        audience: &Audience,
    ) -> EventHead {
        if self.newest_seq >= MAX_CURSOR {
            self.new_epoch_at_the_limit();
        }
        self.check_reserved();
        let head = head.with_cursor(self.newest_seq + 1);
        let cap = MAX_LOGGED_EVENT_BYTES.min(self.limits.max_bytes);
        let kept = match cut {
            Some(cut) if cut.len() <= cap => cut,
            Some(cut) => fit_event(&cut, cap),
            None if head.len() > cap => fit_event(&head, cap),
            None => head.clone(),
        }
        .with_cursor(head.cursor());
        let logged = Logged {
            head: kept,
            audience: audience.clone(),
            gap_before: std::mem::take(&mut self.pending_gap),
        };
        if let Some(p) = &mut self.persist {
            if !p.sink.send(&logged) {
                self.persist = None;
            }
        }
        self.push(logged);
        head
    }

    /// Consumes a cursor with no event: the mark of an upstream gap or
    /// reconnect, which every stream then shows as a gap (as WebSocket
    /// clients see a skipped `seq`). Nothing is missing there, so it never
    /// makes a resume fail: streams resumed before it replay the events
    /// after it (and show the same gap).
    pub fn skip(&mut self) {
        if self.newest_seq >= MAX_CURSOR {
            self.new_epoch_at_the_limit();
        }
        self.check_reserved();
        self.newest_seq += 1;
        self.pending_gap = true;
    }

    /// The next cursor must be reserved on disk: when the renewal has not
    /// kept up (the disk is that slow), the cursors go on by the clock
    /// instead, which is above anything reserved, for the rest of this life.
    fn check_reserved(&mut self) {
        let Some(reservation) = &self.reservation else {
            return;
        };
        if reservation.covers(self.newest_seq + 1) {
            return;
        }
        tracing::warn!(
            newest = self.newest_seq,
            "replay log: the cursor reservation did not keep up; numbering cursors by the clock from here"
        );
        self.reservation = None;
        self.newest_seq = self.newest_seq.max(now_micros());
    }

    /// The cursors would pass [`MAX_CURSOR`] (only a log continued from a
    /// file past [`CURSOR_HEADROOM`] could get here): a new epoch, in memory,
    /// whose cursors start at the current time in microseconds; what the
    /// old one held is dropped, and its cursors are answered 410.
    fn new_epoch_at_the_limit(&mut self) {
        tracing::warn!(
            newest = self.newest_seq,
            "replay log: cursors reached 2^53 - 1; starting a new epoch (earlier cursors cannot resume)"
        );
        let old = self.newest_seq;
        let fresh =
            ReplayLog::starting_at(self.limits, now_micros().min(MAX_CURSOR - CURSOR_HEADROOM));
        *self = fresh;
        let payload = json!({
            "reason": "new_epoch",
            "after": old,
            "next": self.newest_seq + 1,
            "started_at_ms": now_ms(),
        });
        self.append(EventHead::from_value(GAP_EVENT, &payload), &Audience::All);
    }

    pub fn window(&self) -> ReplayWindow {
        ReplayWindow {
            epoch: Arc::clone(&self.epoch),
            oldest_seq: self
                .events
                .front()
                .map_or(self.newest_seq + 1, Logged::cursor),
            newest_seq: self.newest_seq,
        }
    }

    /// The events to send first to a stream of `reader` starting at
    /// `from`: those after its cursor that [`may_see`] lets it see (none
    /// for a stream from now), if the log holds them all, with the gaps
    /// between them.
    pub fn after(&self, from: &ResumePoint, reader: &Reader<'_>) -> Result<Backlog, Unresumable> {
        if let Some(stranger) = from.lives.iter().find(|e| !self.lives.contains(e)) {
            return Err(Unresumable::UnknownLife(stranger.clone()));
        }
        let Some(cursor) = from.cursor else {
            return Ok(Backlog::default());
        };
        if cursor > self.newest_seq {
            return Err(Unresumable::Future);
        }
        if cursor < self.floor {
            return Err(Unresumable::Evicted);
        }
        // Cursors increase but may skip (gaps): find the first one after `cursor`.
        let first = self.events.partition_point(|e| e.cursor() <= cursor);
        let mut backlog = Backlog::default();
        // A gap right before the first event is after `cursor` only when
        // it skipped a cursor newer than `cursor`.
        let mut gap = false;
        for logged in self.events.range(first..) {
            gap |= logged.gap_before && logged.cursor() > cursor + 1;
            if may_see(reader, &logged.head.name(), &logged.audience) {
                backlog
                    .events
                    .push((logged.head.clone(), std::mem::take(&mut gap)));
            }
        }
        let last = self
            .events
            .back()
            .map_or(cursor, Logged::cursor)
            .max(cursor);
        backlog.gap_after = gap || (self.pending_gap && self.newest_seq > last);
        Ok(backlog)
    }

    /// Events and bytes held now (for metrics).
    pub fn held(&self) -> (usize, usize) {
        (self.events.len(), self.bytes)
    }

    /// The file the log is being kept in.
    pub fn file(&self) -> Option<&Path> {
        self.persist.as_ref().map(|p| p.path.as_path())
    }
}

/// An event frame's name and payload, read back from the log.
#[derive(serde::Deserialize)]
struct FrameOf {
    event: String,
    #[serde(default)]
    payload: Option<Box<serde_json::value::RawValue>>,
}

/// `head` cut to at most `cap` bytes for the log: its payload's longest
/// strings cut until it fits, `"clawmuxCut": true` added (an object
/// payload); a payload that cannot be cut that far is kept as `null`.
fn fit_event(head: &EventHead, cap: usize) -> EventHead {
    #[derive(serde::Deserialize)]
    struct Frame<'a> {
        #[serde(borrow)]
        event: std::borrow::Cow<'a, str>,
        #[serde(borrow, default)]
        payload: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, rename = "stateVersion")]
        state_version: Option<&'a serde_json::value::RawValue>,
    }
    let frame = head.without_seq();
    let Ok(f) = serde_json::from_slice::<Frame>(&frame) else {
        return head.clone();
    };
    cut::fit_parts(&f.event, f.payload, f.state_version, cap).with_cursor(head.cursor())
}

/// The copy of a gateway event the replay log keeps when the event is
/// larger than [`MAX_LOGGED_EVENT_BYTES`] (`None`: it keeps the event
/// itself), made from its raw parts.
pub fn cut_for_the_log(
    name: &str,
    payload: Option<&serde_json::value::RawValue>,
    state_version: Option<&serde_json::value::RawValue>,
    head: &EventHead,
) -> Option<EventHead> {
    (head.len() > MAX_LOGGED_EVENT_BYTES)
        .then(|| cut::fit_parts(name, payload, state_version, MAX_LOGGED_EVENT_BYTES))
}

/// Where a broker with these settings keeps its replay log: in the state
/// dir (the device identity's), one file per socket; `None` when
/// `[limits] replay_persist = false` or there is no state dir.
/// The cursor reservation's file for `settings`: under the state dir,
/// whether or not the log is kept there.
pub fn cursor_file(settings: &crate::config::Settings) -> Option<PathBuf> {
    let dir = settings.upstream.device_identity.as_ref()?;
    Some(dir.join(cursors::file_name(&settings.socket_path)))
}

pub fn log_file(settings: &crate::config::Settings) -> Option<PathBuf> {
    if !settings.limits.replay_persist {
        return None;
    }
    let dir = settings.upstream.device_identity.as_ref()?;
    Some(dir.join(file_name(&settings.socket_path)))
}

/// The hub's HTTP-facing side: snapshots with a cursor and streams that start
/// at one, both under the lock that publishing takes.
impl Hub {
    /// Opens the replay log as `settings` say (limits, and the file under
    /// the state dir unless persistence is off) and continues what the
    /// previous broker life left there. At startup, before any event; the
    /// disk work happens before the hub's lock is taken.
    /// `handed_newest`: see [`ReplayLog::open`].
    pub fn open_replay_log(&self, settings: &crate::config::Settings, handed_newest: Option<u64>) {
        let log = ReplayLog::open_with(
            ReplayLimits::from(&settings.limits),
            log_file(settings).as_deref(),
            cursor_file(settings).as_deref(),
            handed_newest,
        );
        // The runs in flight as the log left them (a run that spans the
        // restart is still one run).
        let mut activity = crate::activity::Activity::for_feed();
        for logged in &log.events {
            let frame = logged.head.without_seq();
            if let Ok(f) = serde_json::from_slice::<FrameOf>(&frame) {
                super::Projected::parse(&f.event, f.payload.as_deref())
                    .apply(&mut activity, &f.event);
            }
        }
        let mut inner = self.lock();
        inner.replay = log;
        inner.activity = activity;
    }

    /// The gateway snapshot, the replay window and the runs in flight,
    /// taken together: streaming after `newest_seq` continues exactly
    /// where they stop.
    /// (The snapshot shared: a pointer taken under the lock, not a copy.)
    pub fn snapshot_with_runs(&self) -> (Arc<Value>, ReplayWindow, Value) {
        let inner = self.lock();
        (
            Arc::clone(&inner.snapshot),
            inner.replay.window(),
            crate::activity::runs_in_flight(&inner.activity),
        )
    }

    /// Closes the replay log's file at shutdown: records the newest cursor
    /// handed out (so the next life continues right after it), fsyncs, and
    /// waits for the writer. Events logged after this stay in memory only.
    pub async fn close_replay_log(&self) {
        let (taken, reservation) = {
            let mut inner = self.lock();
            let newest = inner.replay.newest_seq;
            (
                inner.replay.persist.take().map(|p| (p, newest)),
                inner.replay.reservation.take().map(|r| (r, newest)),
            )
        };
        if let Some((persist, newest)) = taken {
            persist.close(newest).await;
        }
        if let Some((reservation, newest)) = reservation {
            let _ = tokio::task::spawn_blocking(move || reservation.stopped(newest)).await;
        }
    }

    /// The file the replay log is kept in, if any.
    pub fn replay_file(&self) -> Option<PathBuf> {
        self.lock().replay.file().map(Path::to_owned)
    }

    /// A new client of `kind`, not yet receiving events.
    pub fn new_client_of_kind(&self, kind: ClientKind) -> Arc<Client> {
        let id = self
            .next_client_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(self.client_with_id(id).with_kind(kind))
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
    ) -> Result<(Backlog, ReplayWindow), SubscribeError> {
        let mut inner = self.lock();
        let backlog = inner.replay.after(from, &client.reader()).map_err(|why| {
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

    /// Closes a log with a file as a stop does; its newest cursor.
    async fn close(mut log: ReplayLog) -> u64 {
        let newest = log.newest_seq;
        log.persist.take().expect("a file").close(newest).await;
        newest
    }

    /// A handover goes on right after the cursor the previous instance
    /// handed out, with no gap, only when the file ends there; a file that
    /// does not (another life's, an older one) is a restart, above the
    /// handed cursor too.
    #[tokio::test]
    async fn a_handed_over_log_goes_on_only_from_the_file_the_previous_instance_closed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("replay.jsonl");
        let limits = ReplayLimits {
            max_events: 100,
            max_bytes: 1 << 20,
        };
        let mut first = ReplayLog::open(limits, Some(&file), None);
        for n in 0..3 {
            first.append(event(n), &Audience::All);
        }
        let newest = close(first).await;
        let mut next = ReplayLog::open(limits, Some(&file), Some(newest));
        assert_eq!(next.newest_seq, newest, "no gap, no jump");
        assert!(next.events.iter().all(|e| e.head.name() != GAP_EVENT));
        let continued = next.append(event(3), &Audience::All);
        assert_eq!(continued.cursor(), newest + 1);
        let newest = close(next).await;
        // The file an upgrade's new instance rewrote (the same records, no
        // stop record) before it was killed uncommitted: the old instance
        // serving again goes on from it, with no gap, as nothing is missing.
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains(r#"{"stop":"#), "{text}");
        let rewritten: String = text
            .lines()
            .filter(|l| !l.starts_with(r#"{"stop":"#))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&file, rewritten).unwrap();
        let again = ReplayLog::open(limits, Some(&file), Some(newest));
        assert_eq!(again.newest_seq, newest, "no gap, no jump");
        assert!(again.events.iter().all(|e| e.head.name() != GAP_EVENT));
        let newest = close(again).await;
        // The previous instance handed out more than this file holds (it
        // did not write it, or not all of it): a restart, above both.
        let handed = newest + 1_000_000_000_000;
        let other = ReplayLog::open(limits, Some(&file), Some(handed));
        let gap = other.events.back().unwrap();
        assert_eq!(gap.head.name(), GAP_EVENT);
        assert!(gap.cursor() > handed, "{} <= {handed}", gap.cursor());
    }

    fn event(n: u64) -> EventHead {
        EventHead::from_value("tick", &serde_json::json!({ "n": format!("{n:04}") }))
    }

    fn cursors(backlog: &Backlog) -> Vec<u64> {
        backlog.events.iter().map(|(e, _)| e.cursor()).collect()
    }

    fn everyone() -> crate::policy::Grant {
        crate::policy::Grant::new(crate::policy::scopes::REQUESTED_SCOPES)
    }

    /// Resumes for a plain reader (not an observer) with every scope.
    trait After {
        fn from(&self, p: &ResumePoint) -> Result<Backlog, Unresumable>;
    }

    impl After for ReplayLog {
        fn from(&self, p: &ResumePoint) -> Result<Backlog, Unresumable> {
            let grant = everyone();
            self.after(
                p,
                &Reader {
                    id: 1,
                    grant: &grant,
                    observer: false,
                },
            )
        }
    }

    /// Resuming after `cursor`.
    fn at(_log: &ReplayLog, cursor: u64) -> ResumePoint {
        ResumePoint {
            cursor: Some(cursor),
            lives: vec![],
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
    fn resume_points_take_the_header_first_and_collect_lives() {
        let p = ResumePoint::new(Some(id("a:7")), Some(id("b:3")), Some("c".into()));
        assert_eq!(
            (p.cursor, &p.lives[..]),
            (Some(7), &["a".to_owned(), "c".to_owned()][..])
        );
        let p = ResumePoint::new(None, Some(id("3")), None);
        assert_eq!((p.cursor, p.lives.is_empty()), (Some(3), true));
        assert_eq!(ResumePoint::new(None, None, None), ResumePoint::default());
    }

    #[test]
    fn count_bound_evicts_oldest_and_replay_is_exclusive() {
        let mut log = log(5, usize::MAX);
        assert_eq!(
            log.from(&at(&log, 0)).unwrap().events.len(),
            0,
            "empty log, cursor 0"
        );
        for n in 1..=12 {
            assert_eq!(log.append(event(n), &Audience::All).cursor(), n);
        }
        let w = log.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (8, 12));
        for cursor in 7..=12 {
            let expected: Vec<u64> = (cursor + 1..=12).collect();
            assert_eq!(cursors(&log.from(&at(&log, cursor)).unwrap()), expected);
        }
        assert_eq!(log.from(&at(&log, 6)).err(), Some(Unresumable::Evicted));
        assert_eq!(log.from(&at(&log, 13)).err(), Some(Unresumable::Future));
        assert_eq!(
            log.from(&ResumePoint::default()).unwrap().events.len(),
            0,
            "from now"
        );
    }

    #[test]
    fn lives_without_a_file_start_above_every_earlier_cursor() {
        let mut a = ReplayLog::in_memory(ReplayLimits::default());
        for n in 0..1000 {
            a.append(event(n), &Audience::All);
        }
        let b = ReplayLog::in_memory(ReplayLimits::default());
        let (wa, wb) = (a.window(), b.window());
        assert_ne!(wa.epoch, wb.epoch);
        assert!(wb.newest_seq > wa.newest_seq, "{wa:?} {wb:?}");
        assert!(wb.newest_seq < 1 << 53, "exact in JavaScript");
        // An earlier life's cursor is gone here, never misread.
        assert_eq!(
            b.from(&at(&b, wa.newest_seq)).err(),
            Some(Unresumable::Evicted)
        );
        assert!(b.from(&at(&b, wb.newest_seq)).unwrap().events.is_empty());
        // A life it does not know is refused, whatever the cursor; its own is fine.
        let named = |life: &str| ResumePoint {
            cursor: Some(wb.newest_seq),
            lives: vec![life.to_owned()],
        };
        assert_eq!(
            b.from(&named(&wa.epoch)).err(),
            Some(Unresumable::UnknownLife(wa.epoch.to_string()))
        );
        assert!(b.from(&named(&wb.epoch)).is_ok());
    }

    #[test]
    fn a_gap_skips_a_cursor_and_resuming_around_it_works() {
        let mut log = log(3, usize::MAX);
        log.append(event(1), &Audience::All);
        log.append(event(2), &Audience::All);
        log.skip();
        assert_eq!(
            log.window().newest_seq,
            3,
            "the skipped cursor is handed out"
        );
        assert_eq!(log.append(event(4), &Audience::All).cursor(), 4);
        assert_eq!(cursors(&log.from(&at(&log, 2)).unwrap()), [4]);
        assert_eq!(cursors(&log.from(&at(&log, 3)).unwrap()), [4]);
        assert_eq!(cursors(&log.from(&at(&log, 1)).unwrap()), [2, 4]);
        // Evict 1 and 2: the skipped 3 is not "missing", so resuming after
        // 2 (the last event before the gap) still works.
        log.append(event(5), &Audience::All);
        log.append(event(6), &Audience::All);
        let w = log.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (4, 6));
        assert_eq!(cursors(&log.from(&at(&log, 2)).unwrap()), [4, 5, 6]);
        assert_eq!(log.from(&at(&log, 1)).err(), Some(Unresumable::Evicted));
        // A gap at the end: resuming at the newest cursor is fine.
        log.skip();
        assert!(log.from(&at(&log, 7)).unwrap().events.is_empty());
        assert_eq!(cursors(&log.from(&at(&log, 6)).unwrap()), Vec::<u64>::new());
        assert_eq!(log.from(&at(&log, 8)).err(), Some(Unresumable::Future));
    }

    #[test]
    fn bytes_bound_evicts_oldest_and_cursor_survives_an_empty_log() {
        let one = event(1).len();
        let mut log = log(100, one * 3);
        for n in 1..=10 {
            log.append(event(n), &Audience::All);
        }
        assert_eq!(log.held(), (3, one * 3));
        assert_eq!(log.window().oldest_seq, 8);
        let mut none = self::log(0, usize::MAX);
        none.append(event(1), &Audience::All);
        let w = none.window();
        assert_eq!((w.oldest_seq, w.newest_seq), (2, 1));
        assert!(
            none.from(&at(&none, 1)).unwrap().events.is_empty(),
            "resume at newest works"
        );
        assert_eq!(none.from(&at(&none, 0)).err(), Some(Unresumable::Evicted));
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
            old.contains("no longer held") && old.contains("10..=20") && old.contains("oldest_seq"),
            "{old}"
        );
        let stranger = msg(Some(3), Unresumable::UnknownLife("e1".into()));
        assert!(
            stranger.contains("epoch e1 is not a broker life"),
            "{stranger}"
        );
        for m in [future, old, stranger] {
            assert!(
                m.ends_with("reload /v1/state and stream after its newest_seq"),
                "{m}"
            );
        }
    }

    /// History applies the one filter: a targeted event is replayed to an
    /// observer and to the clients it was addressed to, never to another
    /// reader; the reader's grant applies to every event.
    #[test]
    fn history_gives_each_reader_what_it_would_have_seen_live() {
        let mut log = log(100, usize::MAX);
        log.append(event(1), &Audience::All);
        let tool = EventHead::from_value("agent", &serde_json::json!({"stream": "tool"}));
        log.append(tool, &Audience::Only(vec![7]));
        log.append(event(3), &Audience::All);
        let full = everyone();
        let none = crate::policy::Grant::new(Vec::<&str>::new());
        let seen = |id, grant: &crate::policy::Grant, observer| {
            let b = log
                .after(
                    &at(&log, 0),
                    &Reader {
                        id,
                        grant,
                        observer,
                    },
                )
                .unwrap();
            cursors(&b)
        };
        assert_eq!(seen(1, &full, false), [1, 3], "a plain reader");
        assert_eq!(seen(7, &full, false), [1, 2, 3], "the addressee");
        assert_eq!(seen(1, &full, true), [1, 2, 3], "an observer");
        assert_eq!(
            seen(1, &none, true),
            [1, 3],
            "no operator.read: no agent events"
        );
    }

    /// A gap is reported where cursors were skipped after the resume
    /// point, also when the events around it are not the reader's.
    #[test]
    fn gaps_are_told_where_cursors_were_skipped_not_where_events_were_hidden() {
        let mut log = log(100, usize::MAX);
        log.append(event(1), &Audience::All);
        log.append(event(2), &Audience::Only(vec![9]));
        log.append(event(3), &Audience::All);
        log.skip(); // 4
        log.append(event(5), &Audience::Only(vec![9]));
        log.append(event(6), &Audience::All);
        let b = log.from(&at(&log, 0)).unwrap();
        let flags: Vec<(u64, bool)> = b.events.iter().map(|(e, g)| (e.cursor(), *g)).collect();
        assert_eq!(flags, [(1, false), (3, false), (6, true)]);
        assert!(!b.gap_after);
        // Resuming after the skipped cursor itself: nothing missing.
        let b = log.from(&at(&log, 4)).unwrap();
        assert_eq!(
            b.events.iter().map(|(_, g)| *g).collect::<Vec<_>>(),
            [false]
        );
        log.skip(); // 7
        let b = log.from(&at(&log, 6)).unwrap();
        assert!(
            b.events.is_empty() && b.gap_after,
            "a gap after the last event"
        );
        assert!(!log.from(&at(&log, 7)).unwrap().gap_after);
    }

    /// An event over the per-event cap is kept cut, marked; the copy
    /// returned (what live readers get) is whole.
    #[test]
    fn an_event_over_the_cap_is_logged_cut_and_delivered_whole() {
        let mut log = log(10, 4096);
        let big = "x".repeat(10_000);
        let head = EventHead::from_value("agent", &serde_json::json!({"text": big, "n": 1}));
        let live = log.append(head.clone(), &Audience::All);
        assert_eq!(live.without_seq(), head.without_seq());
        let kept = &log.from(&at(&log, 0)).unwrap().events[0].0;
        assert!(kept.len() <= 4096, "{}", kept.len());
        let frame: Value = serde_json::from_slice(&kept.without_seq()).unwrap();
        assert_eq!(frame["payload"]["clawmuxCut"], true);
        assert_eq!(frame["payload"]["n"], 1);
        assert!(frame["payload"]["text"].as_str().unwrap().ends_with('…'));
        assert_eq!(log.held().0, 1, "kept, not evicted");
    }

    /// Cursors stay exact in JavaScript: at the limit the log starts a new
    /// epoch with a gap instead of passing it or wrapping.
    #[test]
    fn cursors_never_pass_two_to_the_53rd() {
        let mut log = ReplayLog::starting_at(ReplayLimits::default(), MAX_CURSOR - 1);
        let epoch = log.window().epoch;
        assert_eq!(log.append(event(1), &Audience::All).cursor(), MAX_CURSOR);
        let next = log.append(event(2), &Audience::All).cursor();
        assert!(next <= MAX_CURSOR - CURSOR_HEADROOM + 2, "{next}");
        assert_ne!(log.window().epoch, epoch, "a new epoch");
        assert_eq!(
            log.from(&at(&log, MAX_CURSOR)).err(),
            Some(Unresumable::Future),
            "the old epoch's cursors are not resumed"
        );
        let b = log.from(&at(&log, next - 2)).unwrap();
        let names: Vec<_> = b
            .events
            .iter()
            .map(|(e, _)| e.name().into_owned())
            .collect();
        assert_eq!(names, [GAP_EVENT, "tick"], "a gap first");
    }
}
