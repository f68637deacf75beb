//! What this process knows of upgrades, for `/v1/state` (`broker.upgrade`)
//! and `clawmux upgrade`, which signals the broker and reads the outcome
//! there: whether this broker can hand over at all, how many upgrades it
//! tried and why the last one failed, and what it took over itself.
//! One record per process: an upgrade replaces the process.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};

static CAN_UPGRADE: AtomicBool = AtomicBool::new(false);
static ATTEMPTS: AtomicU64 = AtomicU64::new(0);
static FAILURES: AtomicU64 = AtomicU64::new(0);
static LAST_FAILURE: Mutex<Option<String>> = Mutex::new(None);
static TOOK_OVER: Mutex<Option<Value>> = Mutex::new(None);

/// This broker acts on `SIGUSR2` (the demo does not).
pub fn set_can_upgrade(can: bool) {
    CAN_UPGRADE.store(can, Ordering::Relaxed);
}

/// An upgrade starts.
pub fn attempt() {
    ATTEMPTS.fetch_add(1, Ordering::Relaxed);
}

/// The upgrade failed and this process serves on; `why` is said as logged.
pub fn failed(why: &str) {
    *LAST_FAILURE.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.to_owned());
    FAILURES.fetch_add(1, Ordering::Relaxed);
}

/// This process took over from `from_pid`: what moved to it.
pub fn took_over(from_pid: u32, from_version: &str, clients: usize, streams: usize) {
    *TOOK_OVER.lock().unwrap_or_else(|p| p.into_inner()) = Some(json!({
        "from_pid": from_pid,
        "from_version": from_version,
        "clients": clients,
        "streams": streams,
    }));
}

/// `broker.upgrade` in `/v1/state`.
pub fn to_json() -> Value {
    json!({
        "can_upgrade": CAN_UPGRADE.load(Ordering::Relaxed),
        "attempts": ATTEMPTS.load(Ordering::Relaxed),
        "failures": FAILURES.load(Ordering::Relaxed),
        "last_failure": *LAST_FAILURE.lock().unwrap_or_else(|p| p.into_inner()),
        "took_over": *TOOK_OVER.lock().unwrap_or_else(|p| p.into_inner()),
    })
}
