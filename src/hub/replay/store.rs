//! The replay log on disk, so cursors and history outlive a broker life.
//!
//! One file per broker socket under the state dir
//! (`replay-<16 hex of sha256(socket path)>.jsonl`, 0600 in a 0700 dir),
//! one JSON object a line:
//!
//! - `{"v":1,"floor":F}`: every cursor up to `F` is gone (the first line
//!   after a rewrite, and written when an event too large to keep pushes
//!   everything out);
//! - `{"seq":N,"ts":MS,"to":"some","gap":1,"frame":{…}}`: a logged event,
//!   its frame without `seq`; `to` is there for a targeted event (its
//!   client ids belong to the life that received it and are not kept),
//!   `gap` when cursors were skipped just before it;
//! - `{"stop":N,"ts":MS}`: a clean stop; `N` is the newest cursor the life
//!   handed out (gaps included).
//!
//! The hub never touches the disk: [`Sink::send`] is a `try_send` on a
//! bounded channel (no I/O, never blocks) and a writer thread appends what
//! it receives, batched. Fsync policy: the writer `write(2)`s each batch at
//! once (so a crash of the broker process loses only what was still in the
//! channel, normally nothing) and fsyncs at most every [`SYNC_EVERY`] while
//! there is something new, at every rewrite, and at a clean stop (so an OS
//! crash or power loss loses at most about the last second). When the
//! channel is full (the disk cannot keep up) events are left out of the
//! file with a warning; after a restart a replay shows them as a gap.
//!
//! The file is bounded: the writer mirrors the in-memory ring (same limits,
//! same evictions) and rewrites the file from it whenever the file has
//! grown past twice what the mirror holds plus [`COMPACT_SLACK`], so it
//! never exceeds [`file_bound`]. Each broker start rewrites it too, which
//! drops a torn last line (a crash mid-write) and anything unparsable:
//! what is valid is kept, the rest is logged and skipped.
//!
//! (The writer is a plain thread with a std channel: its work is blocking
//! file I/O, which must not run on the async runtime, and it needs nothing
//! beyond `std`.)

use std::collections::VecDeque;
use std::fs::{File, OpenOptions, Permissions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Logged, ReplayLimits, MAX_CURSOR};
use crate::private_files::{ensure_private_dir, write_private, Existing};
use crate::protocol::{now_ms, EventHead};

/// How often the writer fsyncs while events arrive.
pub const SYNC_EVERY: Duration = Duration::from_secs(1);
/// How long a start waits for the previous life's writer to let go.
const LOCK_WAIT: Duration = Duration::from_secs(3);
/// Records the channel holds before the hub leaves events out of the file.
const CHANNEL_RECORDS: usize = 8192;
/// The file may grow this much beyond twice what is kept before a rewrite.
pub const COMPACT_SLACK: u64 = 64 * 1024;
/// The writer writes at most about this much per batch.
const BATCH_BYTES: usize = 1024 * 1024;
/// A line's bytes beyond its frame (`{"seq":…,"ts":…,"to":…,"gap":1,"frame":` and `}\n`),
/// at most, counted against [`EventHead::len`] (which adds 16 itself).
const LINE_OVERHEAD: usize = 96;
const FORMAT: u32 = 1;

/// The log file's name for a broker on `socket`.
pub fn file_name(socket: &Path) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(socket.as_os_str().as_encoded_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("replay-{hex}.jsonl")
}

/// The largest the file gets with these limits (and the most read back):
/// twice what is kept, plus [`COMPACT_SLACK`], plus one line.
pub fn file_bound(limits: ReplayLimits) -> u64 {
    let kept = limits
        .max_bytes
        .saturating_add(limits.max_events.saturating_mul(LINE_OVERHEAD)) as u64;
    kept.saturating_mul(2)
        .saturating_add(COMPACT_SLACK)
        .saturating_add((limits.max_bytes + LINE_OVERHEAD) as u64)
}

fn event_line(out: &mut Vec<u8>, logged: &Logged, ts: u64) {
    let head = &logged.head;
    let _ = write!(out, r#"{{"seq":{},"ts":{ts},"#, head.cursor());
    if logged.audience.is_targeted() {
        out.extend_from_slice(br#""to":"some","#);
    }
    if logged.gap_before {
        out.extend_from_slice(br#""gap":1,"#);
    }
    out.extend_from_slice(br#""frame":"#);
    // A raw line break in JSON can only be insignificant whitespace.
    out.extend(
        head.without_seq()
            .iter()
            .map(|&b| if b == b'\n' || b == b'\r' { b' ' } else { b }),
    );
    out.extend_from_slice(b"}\n");
}

fn floor_line(out: &mut Vec<u8>, floor: u64, lives: &[String]) {
    let lives = serde_json::to_string(lives).unwrap_or_else(|_| "[]".into());
    let _ = writeln!(out, r#"{{"v":{FORMAT},"floor":{floor},"lives":{lives}}}"#);
}

fn stop_line(out: &mut Vec<u8>, newest: u64, ts: u64) {
    let _ = writeln!(out, r#"{{"stop":{newest},"ts":{ts}}}"#);
}

/// The broker lives (epochs) a log remembers, newest last: enough to tell
/// an old-style `<epoch>:<cursor>` id of this log from a stranger's.
pub const MAX_LIVES: usize = 32;

/// Adds `epoch` to `lives` (newest last, at most [`MAX_LIVES`]).
pub fn remember(lives: &mut Vec<String>, epoch: &str) {
    lives.retain(|e| e != epoch);
    lives.push(epoch.to_owned());
    let over = lives.len().saturating_sub(MAX_LIVES);
    lives.drain(..over);
}

/// What a previous life left in the file.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Events in cursor order, with the time they were written.
    pub events: Vec<(Logged, u64)>,
    /// Every cursor up to this one is gone.
    pub floor: u64,
    /// The newest cursor the file shows handed out.
    pub newest: u64,
    /// `Some(ts)` when the last record is a clean stop (at `ts`).
    pub stopped_at: Option<u64>,
    /// When the last record was written.
    pub last_ts: Option<u64>,
    /// The file held at least one valid record.
    pub any: bool,
    /// Lines that were not valid records (a torn last line after a crash,
    /// corruption), skipped.
    pub bad_lines: usize,
    /// Bytes at the start left unread (the file was over the read cap).
    pub skipped_bytes: u64,
    /// The broker lives that wrote the file, oldest first.
    pub lives: Vec<String>,
}

#[derive(Deserialize)]
struct Line<'a> {
    seq: Option<u64>,
    ts: Option<u64>,
    #[serde(borrow)]
    frame: Option<&'a RawValue>,
    floor: Option<u64>,
    stop: Option<u64>,
    lives: Option<Vec<String>>,
    to: Option<&'a str>,
    gap: Option<u8>,
}

#[derive(Deserialize)]
struct Frame<'a> {
    #[serde(rename = "type")]
    kind: std::borrow::Cow<'a, str>,
    event: String,
    #[serde(borrow)]
    payload: Option<&'a RawValue>,
    #[serde(borrow, rename = "stateVersion")]
    state_version: Option<&'a RawValue>,
}

/// Parses the file's bytes; `cut` says they start mid-file (over the read
/// cap), so the first line may be a fragment.
pub fn parse(bytes: &[u8], cut: bool) -> Loaded {
    let mut loaded = Loaded::default();
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    // After the last newline: empty, or a line torn by a crash mid-write.
    if let Some(last) = lines.pop() {
        if !last.is_empty() {
            loaded.bad_lines += 1;
        }
    }
    if cut && !lines.is_empty() {
        let first = lines.remove(0);
        loaded.skipped_bytes += first.len() as u64 + 1;
    }
    for line in lines {
        if !record(&mut loaded, line) {
            loaded.bad_lines += 1;
        }
    }
    loaded
}

/// Applies one line; false when it is not a valid record.
fn record(loaded: &mut Loaded, line: &[u8]) -> bool {
    let Ok(l) = serde_json::from_slice::<Line>(line) else {
        return false;
    };
    match l {
        Line {
            seq: Some(seq),
            frame: Some(frame),
            ts,
            to,
            gap,
            ..
        } => {
            let Ok(f) = serde_json::from_str::<Frame>(frame.get()) else {
                return false;
            };
            // Cursors only increase and stay exact in JavaScript; anything
            // else is not this log's. A nameless event is not one either:
            // the gateway frame decoder drops those, so the broker never
            // logs one (found by the `replay_log` fuzz target).
            if f.kind != "event"
                || f.event.is_empty()
                || seq <= loaded.newest.max(loaded.floor)
                || seq > MAX_CURSOR
            {
                return false;
            }
            let head = EventHead::encode(&f.event, f.payload, f.state_version).with_cursor(seq);
            let audience = match to {
                None => crate::sharing::Audience::All,
                // Client ids of another life mean nothing here: targeted,
                // for observers only.
                Some(_) => crate::sharing::Audience::Only(Vec::new()),
            };
            let logged = Logged {
                head,
                audience,
                gap_before: gap.is_some_and(|g| g != 0),
            };
            loaded.events.push((logged, ts.unwrap_or(0)));
            loaded.newest = seq;
            loaded.last_ts = ts.or(loaded.last_ts);
            loaded.stopped_at = None;
        }
        Line {
            floor: Some(floor),
            seq: None,
            lives,
            ..
        } if floor <= MAX_CURSOR => {
            for life in lives.iter().flatten() {
                remember(&mut loaded.lives, life);
            }
            loaded.floor = loaded.floor.max(floor);
            loaded.newest = loaded.newest.max(floor);
            let keep = loaded.events.partition_point(|(e, _)| e.cursor() <= floor);
            loaded.events.drain(..keep);
        }
        Line {
            stop: Some(stop),
            seq: None,
            ts,
            ..
        } if stop <= MAX_CURSOR => {
            loaded.newest = loaded.newest.max(stop);
            let ts = ts.unwrap_or(0);
            loaded.stopped_at = Some(ts);
            loaded.last_ts = Some(ts);
        }
        _ => return false,
    }
    loaded.any = true;
    true
}

/// Refuses a file or directory owned by another user; tightens loose modes
/// (the rules of [`crate::private_files`]).
fn check_private(path: &Path, file: &File) -> io::Result<()> {
    let meta = file.metadata()?;
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(io::Error::other(format!(
            "{} is owned by uid {}, not by this user (uid {me})",
            path.display(),
            meta.uid()
        )));
    }
    if !meta.is_file() {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        tracing::warn!(file = %path.display(), mode = format!("{:o}", meta.mode() & 0o777), "replay log is open to other users; setting it to 0600");
        file.set_permissions(Permissions::from_mode(0o600))?;
    }
    Ok(())
}

fn open_private(path: &Path, create: bool, append: bool) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(create || append)
        .append(append)
        .create(create)
        .mode(0o600)
        // NONBLOCK: opening a FIFO put in the file's place would otherwise
        // wait for a writer forever (the broker hung at start, socket
        // bound, nothing logged); it is opened at once and refused below
        // as not a regular file. Regular files ignore the flag.
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)?;
    check_private(path, &file)?;
    Ok(file)
}

/// Reads at most `cap` bytes: the whole file, or its last `cap` bytes
/// (`true`: the start was cut). Hand-written and kept to this one
/// function so it can become the shared capped reader (`src/files.rs`).
fn read_capped(file: &mut File, cap: u64) -> io::Result<(Vec<u8>, bool)> {
    let len = file.metadata()?.len();
    let cut = len > cap;
    if cut {
        file.seek(SeekFrom::Start(len - cap))?;
    }
    let mut bytes = Vec::with_capacity(len.min(cap) as usize);
    file.take(cap).read_to_end(&mut bytes)?;
    Ok((bytes, cut))
}

/// The file, locked for this broker and read, before the ring is built
/// from it and the writer starts.
pub struct Opened {
    path: PathBuf,
    lock: File,
    pub loaded: Loaded,
}

/// Locks and reads the log at `path` (creating its 0700 directory).
pub fn open(path: &Path, limits: ReplayLimits) -> Result<Opened, String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    ensure_private_dir(dir).map_err(|e| e.to_string())?;
    let lock_path = path.with_extension("lock");
    let lock = open_private(&lock_path, true, false)
        .map_err(|e| format!("{}: {e}", lock_path.display()))?;
    // The previous life's writer holds the lock until its last fsync.
    let deadline = Instant::now() + LOCK_WAIT;
    while let Err(e) =
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
    {
        if Instant::now() >= deadline {
            return Err(format!(
                "{} is locked ({e}): another broker on the same socket uses it",
                lock_path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let loaded = match open_private(path, false, false) {
        Ok(mut file) => {
            let (bytes, cut) = read_capped(&mut file, file_bound(limits))
                .map_err(|e| format!("{}: {e}", path.display()))?;
            parse(&bytes, cut)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Loaded::default(),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if loaded.bad_lines > 0 || loaded.skipped_bytes > 0 {
        tracing::warn!(
            file = %path.display(),
            bad_lines = loaded.bad_lines,
            skipped_bytes = loaded.skipped_bytes,
            kept = loaded.events.len(),
            "replay log: skipped what was not valid (a torn last line after a crash, or damage); kept the rest"
        );
    }
    Ok(Opened {
        path: path.to_owned(),
        lock,
        loaded,
    })
}

impl Opened {
    /// Rewrites the file from what the ring kept (`floor`, `kept` with
    /// their times) and starts the writer.
    pub fn start(
        self,
        limits: ReplayLimits,
        floor: u64,
        kept: Vec<(Logged, u64)>,
        lives: Vec<String>,
    ) -> Result<Persist, String> {
        let mut writer = Writer {
            _lock: self.lock,
            path: self.path.clone(),
            file: None,
            file_len: 0,
            limits,
            mirror: VecDeque::new(),
            mirror_bytes: 0,
            mirror_lines: 0,
            floor,
            lives,
            dirty: false,
            last_sync: Instant::now(),
            buf: Vec::new(),
        };
        let mut line = Vec::new();
        for (logged, ts) in kept {
            line.clear();
            event_line(&mut line, &logged, ts);
            writer.keep(logged, ts, line.len());
        }
        writer
            .rewrite()
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        let (tx, rx) = std::sync::mpsc::sync_channel(CHANNEL_RECORDS);
        let (done_tx, done) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("clawmux-replay-log".into())
            .spawn(move || {
                writer.run(rx);
                let _ = done_tx.send(());
            })
            .map_err(|e| format!("cannot start the replay log writer: {e}"))?;
        Ok(Persist {
            path: self.path,
            sink: Sink { tx, full: false },
            done,
        })
    }
}

/// What the writer receives.
enum Record {
    Event(Logged),
    Stop(u64),
}

/// The hub's end of the writer: lives in the ring, under the hub's lock.
#[derive(Debug)]
pub struct Sink {
    tx: SyncSender<Record>,
    /// Events are being left out (the channel was full); warned once.
    full: bool,
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Record::Event(l) => write!(f, "Event({})", l.cursor()),
            Record::Stop(n) => write!(f, "Stop({n})"),
        }
    }
}

impl Sink {
    /// Queues `head` for the file without blocking; false once the writer
    /// is gone (it failed and said why).
    pub fn send(&mut self, logged: &Logged) -> bool {
        let head = &logged.head;
        match self.tx.try_send(Record::Event(logged.clone())) {
            Ok(()) => {
                if std::mem::take(&mut self.full) {
                    tracing::info!(
                        cursor = head.cursor(),
                        "replay log: the writer caught up; events are persisted again"
                    );
                }
                true
            }
            Err(TrySendError::Full(_)) => {
                if !std::mem::replace(&mut self.full, true) {
                    tracing::warn!(
                        cursor = head.cursor(),
                        "replay log: the disk is not keeping up; events are left out of the file (after a restart they replay as a gap)"
                    );
                }
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }
}

/// A running persistent log: its path and its writer (which holds the
/// file's lock until it has written and synced its last record).
#[derive(Debug)]
pub struct Persist {
    pub path: PathBuf,
    pub sink: Sink,
    done: tokio::sync::oneshot::Receiver<()>,
}

impl Persist {
    /// Writes the clean-stop record (`newest`: the last cursor handed
    /// out), fsyncs, and waits for the writer to finish.
    pub async fn close(self, newest: u64) {
        let tx = self.sink.tx.clone();
        drop(self.sink);
        // Blocking send: the channel may be full at shutdown.
        let _ = tokio::task::spawn_blocking(move || tx.send(Record::Stop(newest))).await;
        let _ = self.done.await;
        tracing::info!(file = %self.path.display(), newest, "replay log closed");
    }
}

struct Kept {
    logged: Logged,
    ts: u64,
    line: usize,
}

/// The writer thread's state: the file and a mirror of the ring.
struct Writer {
    /// Held for the writer's whole life: no other broker uses the file.
    _lock: File,
    path: PathBuf,
    file: Option<File>,
    file_len: u64,
    limits: ReplayLimits,
    mirror: VecDeque<Kept>,
    /// As the ring counts them ([`EventHead::len`]).
    mirror_bytes: usize,
    /// Their lines' bytes in the file.
    mirror_lines: u64,
    floor: u64,
    /// Written with every floor record (the first line of each rewrite).
    lives: Vec<String>,
    dirty: bool,
    last_sync: Instant,
    buf: Vec<u8>,
}

impl Writer {
    /// Adds an event to the mirror and evicts as the ring does; false when
    /// the event itself did not stay (it is larger than the limits).
    /// `line`: the bytes of its line in the file.
    fn keep(&mut self, logged: Logged, ts: u64, line: usize) -> bool {
        let cursor = logged.cursor();
        self.mirror_bytes += logged.head.len();
        self.mirror_lines += line as u64;
        self.mirror.push_back(Kept { logged, ts, line });
        while self.mirror.len() > self.limits.max_events
            || self.mirror_bytes > self.limits.max_bytes
        {
            let Some(old) = self.mirror.pop_front() else {
                break;
            };
            self.mirror_bytes -= old.logged.head.len();
            self.mirror_lines -= old.line as u64;
            self.floor = old.logged.cursor();
        }
        self.mirror
            .back()
            .is_some_and(|k| k.logged.cursor() == cursor)
    }

    /// Replaces the file with the floor and what the mirror keeps.
    fn rewrite(&mut self) -> io::Result<()> {
        let mut out = Vec::with_capacity(self.mirror_lines as usize + 32);
        floor_line(&mut out, self.floor, &self.lives);
        for k in &self.mirror {
            event_line(&mut out, &k.logged, k.ts);
        }
        write_private(&self.path, &out, Existing::Replace).map_err(io::Error::other)?;
        self.file = Some(open_private(&self.path, false, true)?);
        self.file_len = out.len() as u64;
        self.dirty = false;
        self.last_sync = Instant::now();
        Ok(())
    }

    /// Takes one record into the batch; true for the stop.
    fn take(&mut self, record: Record) -> bool {
        match record {
            Record::Event(logged) => {
                let ts = now_ms();
                let start = self.buf.len();
                event_line(&mut self.buf, &logged, ts);
                let line = self.buf.len() - start;
                if !self.keep(logged, ts, line) {
                    // Too large to keep: a floor record instead.
                    self.buf.truncate(start);
                    floor_line(&mut self.buf, self.floor, &self.lives);
                }
                false
            }
            Record::Stop(newest) => {
                stop_line(&mut self.buf, newest, now_ms());
                true
            }
        }
    }

    /// The file (with what the batch holds) has outgrown what is kept.
    fn over(&self) -> bool {
        self.file_len + self.buf.len() as u64 > self.mirror_lines.saturating_mul(2) + COMPACT_SLACK
    }

    fn flush(&mut self, stop: bool) -> io::Result<()> {
        if !self.buf.is_empty() {
            let file = self
                .file
                .as_mut()
                .ok_or_else(|| io::Error::other("closed"))?;
            file.write_all(&self.buf)?;
            self.file_len += self.buf.len() as u64;
            self.buf.clear();
            self.dirty = true;
        }
        if !stop && self.over() {
            return self.rewrite();
        }
        if self.dirty && (stop || self.last_sync.elapsed() >= SYNC_EVERY) {
            if let Some(file) = &self.file {
                file.sync_data()?;
            }
            self.dirty = false;
            self.last_sync = Instant::now();
        }
        Ok(())
    }

    fn run(mut self, rx: Receiver<Record>) {
        loop {
            let wait = if self.dirty {
                SYNC_EVERY.saturating_sub(self.last_sync.elapsed())
            } else {
                Duration::from_secs(3600)
            };
            let mut stop = match rx.recv_timeout(wait) {
                Ok(record) => self.take(record),
                Err(RecvTimeoutError::Timeout) => false,
                // The hub is gone without a clean stop: sync what we have.
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = self.flush(true);
                    return;
                }
            };
            // A batch ends where the file would outgrow its bound, so a
            // rewrite comes at most one line late.
            while !stop && self.buf.len() < BATCH_BYTES && !self.over() {
                match rx.try_recv() {
                    Ok(record) => stop = self.take(record),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            if let Err(e) = self.flush(stop) {
                tracing::error!(file = %self.path.display(), error = %e, "replay log: cannot write; history from here on will not survive a restart");
                return;
            }
            if stop {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u64) -> Logged {
        Logged {
            head: EventHead::from_value("tick", &serde_json::json!({ "n": n, "s": "a\nb" }))
                .with_cursor(n),
            audience: crate::sharing::Audience::All,
            gap_before: false,
        }
    }

    #[test]
    fn lines_round_trip_and_a_torn_tail_is_dropped() {
        let mut out = Vec::new();
        floor_line(&mut out, 2, &["a".into(), "b".into()]);
        for n in [3, 4, 6] {
            event_line(&mut out, &event(n), 100 + n);
        }
        let whole = parse(&out, false);
        assert_eq!(whole.bad_lines, 0);
        assert_eq!((whole.floor, whole.newest), (2, 6));
        assert_eq!(whole.lives, ["a", "b"]);
        let cursors: Vec<u64> = whole.events.iter().map(|(e, _)| e.cursor()).collect();
        assert_eq!(cursors, [3, 4, 6]);
        assert_eq!(
            whole.events[2].0.head.without_seq(),
            event(6).head.without_seq()
        );
        assert_eq!(whole.last_ts, Some(106));
        assert!(whole.stopped_at.is_none());

        stop_line(&mut out, 9, 200);
        let stopped = parse(&out, false);
        assert_eq!((stopped.newest, stopped.stopped_at), (9, Some(200)));

        // A crash mid-write: the last line is torn; a damaged line in the
        // middle is skipped too. What is valid stays.
        let mut torn = out.clone();
        torn.truncate(out.len() - 5);
        let t = parse(&torn, false);
        assert_eq!((t.bad_lines, t.newest, t.stopped_at), (1, 6, None));
        let mut damaged = Vec::new();
        event_line(&mut damaged, &event(3), 1);
        damaged.extend_from_slice(b"{\"seq\":4,\"fr\0\n");
        event_line(&mut damaged, &event(5), 1);
        event_line(&mut damaged, &event(5), 1); // not increasing
        let d = parse(&damaged, false);
        assert_eq!(d.bad_lines, 2);
        assert_eq!(d.events.len(), 2);
    }

    /// A line the broker could not have written (an event without a name,
    /// which the frame decoder refuses) is skipped, not replayed as an
    /// SSE record with an empty `event:`.
    #[test]
    fn a_nameless_event_is_not_a_record() {
        let lines =
            b"{\"seq\":1,\"ts\":1,\"frame\":{\"type\":\"event\",\"event\":\"\",\"payload\":{}}}\n";
        let loaded = parse(lines, false);
        assert_eq!((loaded.events.len(), loaded.bad_lines), (0, 1));
    }

    #[test]
    fn a_cut_read_drops_the_first_fragment_and_floors_evict() {
        let mut out = Vec::new();
        for n in 1..=4 {
            event_line(&mut out, &event(n), n);
        }
        floor_line(&mut out, 3, &[]);
        event_line(&mut out, &event(7), 7);
        let all = parse(&out, false);
        let cursors: Vec<u64> = all.events.iter().map(|(e, _)| e.cursor()).collect();
        assert_eq!((cursors, all.floor), (vec![4, 7], 3));
        let cut = parse(&out[10..], true);
        assert_eq!(cut.bad_lines, 0);
        assert!(cut.skipped_bytes > 0);
    }

    #[test]
    fn lives_are_remembered_newest_last_and_bounded() {
        let mut lives = Vec::new();
        for n in 0..40 {
            remember(&mut lives, &format!("e{n}"));
        }
        remember(&mut lives, "e20");
        assert_eq!(lives.len(), MAX_LIVES);
        assert_eq!(lives.last().unwrap(), "e20");
        assert_eq!(lives[0], "e8");
    }

    /// The hub's side never waits for the disk: with the writer stuck (a
    /// full channel), sending returns at once and leaves the event out.
    #[test]
    fn a_full_channel_never_blocks_the_hub() {
        let (tx, rx) = std::sync::mpsc::sync_channel(2);
        let mut sink = Sink { tx, full: false };
        let started = Instant::now();
        for n in 1..=1000 {
            assert!(sink.send(&event(n)), "the writer is alive");
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(sink.full);
        let queued: Vec<u64> = rx
            .try_iter()
            .map(|r| match r {
                Record::Event(h) => h.cursor(),
                Record::Stop(_) => 0,
            })
            .collect();
        assert_eq!(queued, [1, 2]);
        assert!(sink.send(&event(1001)), "room again");
        assert!(!sink.full);
        drop(rx);
        assert!(!sink.send(&event(1002)), "the writer is gone");
    }

    #[test]
    fn file_names_differ_by_socket() {
        let a = file_name(Path::new("/run/a.sock"));
        assert!(
            a.starts_with("replay-") && a.ends_with(".jsonl") && a.len() == 29,
            "{a}"
        );
        assert_ne!(a, file_name(Path::new("/run/b.sock")));
    }
}
