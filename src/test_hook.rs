//! The test suite's hook into a debug build's handover
//! (tests/it/handover.rs): one environment variable, inherited by the new
//! instance of an upgrade, that makes an instance fail, wait or take its
//! time at a named point. A release build, the one users install and run
//! as a service, never reads it, so no environment can make a broker fail
//! on purpose.
//!
//! The points:
//! - where the new instance fails: `after-valid` (an error returned),
//!   `before-ready` or `after-commit` (it exits);
//! - where an instance waits (at most 10 s) until a file exists:
//!   `hold-before-ready:<file>`, the new one before it says `ready`;
//!   `hold-before-exit:<file>`, the old one, once the new one serves,
//!   before it lets go of what it packed and exits; `hold-in-stop:<file>`,
//!   an instance that stops, before it closes its clients;
//!   `hold-before-serving:<file>`, an instance that answers on its socket,
//!   before it acts on its signals;
//! - where an instance takes its time: `pause-before-answers:<ms>`, a
//!   gateway session that ends, before it answers its requests in flight.
//!
//! Several points go in one value, separated by commas. In a `<file>`,
//! `%p` stands for the waiting process's pid, so a test can let one
//! instance go on and hold the others.

use std::time::Duration;

/// The variable's name.
pub const UPGRADE_FAULT: &str = "CLAWMUX_TEST_UPGRADE_FAULT";

/// [`UPGRADE_FAULT`]'s value, in a build with debug assertions (the test
/// suite's) only.
fn upgrade_fault() -> Option<String> {
    if cfg!(debug_assertions) {
        std::env::var(UPGRADE_FAULT).ok()
    } else {
        None
    }
}

/// Whether [`UPGRADE_FAULT`] names `point`, a point where the new instance
/// fails.
pub fn fails_at(point: &str) -> bool {
    upgrade_fault().is_some_and(|fault| fault.split(',').any(|one| one == point))
}

/// What follows `point:` in [`UPGRADE_FAULT`], if it names `point`.
fn argument(point: &str) -> Option<String> {
    let fault = upgrade_fault()?;
    fault.split(',').find_map(|one| {
        let rest = one.strip_prefix(point)?.strip_prefix(':')?;
        Some(rest.to_owned())
    })
}

/// At a `hold-…:<file>` point named `point`: waits until that file exists,
/// at most 10 s. Anywhere else (and in a release build) returns at once.
pub async fn hold_at(point: &str) {
    let Some(file) = argument(point) else {
        return;
    };
    let file = file.replace("%p", &std::process::id().to_string());
    let file = std::path::Path::new(&file);
    for _ in 0..1000 {
        if file.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// At a `pause-…:<ms>` point named `point`: waits that many milliseconds
/// (at most 10 s). Anywhere else (and in a release build) returns at once.
pub async fn pause_at(point: &str) {
    let Some(ms) = argument(point).and_then(|ms| ms.parse::<u64>().ok()) else {
        return;
    };
    tokio::time::sleep(Duration::from_millis(ms.min(10_000))).await;
}
