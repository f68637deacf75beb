//! Cursors a person can read and type: short numbers that only grow
//! across broker lives, kept by a reservation in the state dir.
//!
//! One small file per broker socket beside the replay log
//! (`cursors-<16 hex>.json`, 0600): `{"reserved":R,"stopped":N}`. Before a
//! life hands out a cursor above `R` it writes (and fsyncs) a larger `R`,
//! a block of [`BLOCK`] at a time, on a thread of its own ([`Reservation`]:
//! the hub only reads an atomic). A life that stops cleanly writes the
//! newest cursor it handed out as `stopped`; the next life goes on right
//! after it, or after `R` when the last one did not stop cleanly (a crash
//! may have handed out anything up to `R`, nothing above). So a cursor is
//! never handed out twice, and in normal use stays a few digits long.
//!
//! Without a state dir (`--no-device-identity`) there is nowhere to keep
//! this: such a life numbers its cursors by the clock (microseconds since
//! 1970, 16 digits), above anything an earlier life handed out.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::private_files::{ensure_private_dir, read_private, write_private, Existing};

/// Cursors reserved at a time. A life that crashes costs the next one at
/// most this many numbers; the reservation is renewed when half is used.
pub const BLOCK: u64 = 65_536;

/// What the file holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    /// No cursor above this was handed out.
    reserved: u64,
    /// The life that wrote it stopped cleanly, having handed out cursors up
    /// to this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stopped: Option<u64>,
}

/// The reservation file's name for a broker on `socket`.
pub fn file_name(socket: &Path) -> String {
    let log = super::store::file_name(socket);
    let hex = log
        .strip_prefix("replay-")
        .and_then(|s| s.strip_suffix(".jsonl"))
        .unwrap_or("0");
    format!("cursors-{hex}.json")
}

/// The first cursor this life may hand out, as far as the file knows
/// (`Ok(None)`: no file, no earlier life with this state dir; `Err`: it
/// cannot be read, and nothing is known).
pub fn first_allowed(path: &Path) -> Result<Option<u64>, String> {
    let Some(bytes) = read_private(path).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let saved: Saved = serde_json::from_slice(&bytes).map_err(|e| {
        format!(
            "{} does not read as a cursor reservation ({e})",
            path.display()
        )
    })?;
    Ok(Some(match saved.stopped {
        Some(n) if n <= saved.reserved => n + 1,
        _ => saved.reserved + 1,
    }))
}

/// The reservation of a life whose cursors start at `first`: at most
/// [`BLOCK`] ahead of the newest cursor handed out, renewed off the hub's
/// path.
#[derive(Debug)]
pub struct Reservation {
    path: PathBuf,
    /// Cursors up to this one are reserved on disk.
    durable: AtomicU64,
    /// A renewal is on its way.
    asked: AtomicBool,
    renew: SyncSender<u64>,
    /// Held while the file is written; `true` once the stop is recorded
    /// (no renewal may overwrite it).
    stopped: std::sync::Mutex<bool>,
}

impl Reservation {
    /// Reserves the first block (written before any cursor is handed out)
    /// and starts the thread that renews it. Disk I/O: call it at start.
    pub fn start(path: &Path, first: u64) -> Result<Arc<Reservation>, String> {
        if let Some(dir) = path.parent() {
            ensure_private_dir(dir).map_err(|e| e.to_string())?;
        }
        // Never lowered: another life of this socket (an upgrade's instance
        // that did not take over) may hold a larger reservation.
        let before = read_private(path)
            .ok()
            .flatten()
            .and_then(|b| serde_json::from_slice::<Saved>(&b).ok())
            .map_or(0, |s| s.reserved);
        let reserved = first.saturating_sub(1).saturating_add(BLOCK).max(before);
        write(
            path,
            Saved {
                reserved,
                stopped: None,
            },
        )?;
        let (renew, asks) = sync_channel::<u64>(1);
        let this = Arc::new(Reservation {
            path: path.to_owned(),
            durable: AtomicU64::new(reserved),
            asked: AtomicBool::new(false),
            renew,
            stopped: std::sync::Mutex::new(false),
        });
        let weak = Arc::downgrade(&this);
        std::thread::Builder::new()
            .name("clawmux-cursors".into())
            .spawn(move || {
                for target in asks {
                    let Some(this) = weak.upgrade() else { return };
                    let stopped = this.stopped.lock().unwrap_or_else(|p| p.into_inner());
                    if *stopped {
                        return;
                    }
                    match write(
                        &this.path,
                        Saved {
                            reserved: target,
                            stopped: None,
                        },
                    ) {
                        Ok(()) => this.durable.fetch_max(target, Ordering::AcqRel),
                        Err(why) => {
                            tracing::warn!(%why, "replay log: cannot renew the cursor reservation");
                            0
                        }
                    };
                    drop(stopped);
                    this.asked.store(false, Ordering::Release);
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(this)
    }

    /// Whether `cursor` may be handed out now (it is reserved on disk);
    /// asks for the next block once half of this one is used. Never
    /// blocks and does no I/O.
    pub fn covers(&self, cursor: u64) -> bool {
        let durable = self.durable.load(Ordering::Acquire);
        if cursor.saturating_add(BLOCK / 2) > durable && !self.asked.swap(true, Ordering::AcqRel) {
            let target = durable.max(cursor).saturating_add(BLOCK);
            if self.renew.try_send(target).is_err() {
                self.asked.store(false, Ordering::Release);
            }
        }
        cursor <= durable
    }

    /// At a clean stop: the newest cursor handed out, so the next life
    /// goes on right after it. Disk I/O (at shutdown).
    pub fn stopped(&self, newest: u64) {
        let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        *stopped = true;
        let saved = Saved {
            reserved: self.durable.load(Ordering::Acquire).max(newest),
            stopped: Some(newest),
        };
        if let Err(why) = write(&self.path, saved) {
            tracing::warn!(%why, "replay log: cannot record the newest cursor at the stop");
        }
    }
}

fn write(path: &Path, saved: Saved) -> Result<(), String> {
    let text = serde_json::to_vec(&saved).expect("plain numbers");
    write_private(path, &text, Existing::Replace)
        .map(|_| ())
        .map_err(|e| format!("cannot write {} ({e})", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_stop_goes_on_right_after_and_a_crash_after_the_reservation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("cursors-0.json");
        assert_eq!(first_allowed(&path), Ok(None), "no earlier life");
        let first = Reservation::start(&path, 1).unwrap();
        assert!(first.covers(1));
        assert!(first.covers(BLOCK / 2));
        // A crash now: anything up to the reservation may have been used.
        assert_eq!(first_allowed(&path).unwrap(), Some(BLOCK + 1));
        assert!(!first.covers(BLOCK + 1), "not reserved on disk yet");
        first.stopped(41);
        assert_eq!(first_allowed(&path).unwrap(), Some(42), "a clean stop");
        drop(first);
        std::fs::write(&path, b"{\"reserved\":").unwrap();
        assert!(
            first_allowed(&path).is_err(),
            "unreadable: nothing is known"
        );
    }

    /// Using half a block asks for the next one, written off the caller's
    /// thread; cursors it covers are then allowed.
    #[test]
    fn the_reservation_is_renewed_before_it_runs_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cursors-0.json");
        let r = Reservation::start(&path, 100).unwrap();
        let end = 99 + BLOCK;
        assert!(r.covers(end - BLOCK / 2 + 1), "half used: renewal asked");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !r.covers(end + 1) {
            assert!(std::time::Instant::now() < deadline, "renewed in time");
            std::thread::yield_now();
        }
        assert!(first_allowed(&path).unwrap().unwrap() > end + 1);
    }
}
