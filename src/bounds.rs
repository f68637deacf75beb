//! Which values a duration or count setting may take, checked where the
//! value is read (flags, `config.toml`), so a typo or an absurd number is a
//! clear error at start and never a panic later (an `Instant` plus a
//! near-`u64::MAX` duration overflows on the first request).

use std::time::Duration;

/// The longest duration any setting accepts: one day. Every timeout, wait,
/// grace period and backoff in clawmux is meant in seconds or minutes; a
/// value above this is refused with a message naming the setting.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// Whether zero is a meaningful value for a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zero {
    /// Zero means "at once" (e.g. `connect_wait`: answer without waiting).
    Allowed,
    /// Zero would make the broker useless (every request timing out at
    /// once, a reconnect loop without a pause, no client admitted).
    Refused,
}

/// Checks a duration given in milliseconds for the setting `name`.
pub fn duration_ms(name: &str, ms: u64, zero: Zero) -> Result<Duration, String> {
    check_duration(name, Duration::from_millis(ms), zero, "ms")
}

/// Checks a duration given in whole seconds for the setting `name`.
pub fn duration_secs(name: &str, secs: u64, zero: Zero) -> Result<Duration, String> {
    check_duration(name, Duration::from_secs(secs), zero, "s")
}

/// Parses and checks a duration given in (possibly fractional) seconds.
pub fn duration_secs_f64(name: &str, text: &str, zero: Zero) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{name} must be a number of seconds, not {text:?}"))?;
    if !secs.is_finite() || secs < 0.0 || secs > MAX_DURATION.as_secs_f64() {
        return Err(out_of_range(name, zero, "s"));
    }
    check_duration(name, Duration::from_secs_f64(secs), zero, "s")
}

fn check_duration(name: &str, d: Duration, zero: Zero, unit: &str) -> Result<Duration, String> {
    if d > MAX_DURATION || (zero == Zero::Refused && d.is_zero()) {
        return Err(out_of_range(name, zero, unit));
    }
    Ok(d)
}

fn out_of_range(name: &str, zero: Zero, unit: &str) -> String {
    let max = match unit {
        "ms" => format!("{} ms", MAX_DURATION.as_millis()),
        _ => format!("{} s", MAX_DURATION.as_secs()),
    };
    match zero {
        Zero::Allowed => format!("{name} must be from 0 to {max} (one day)"),
        Zero::Refused => format!("{name} must be more than 0 and at most {max} (one day)"),
    }
}

/// Checks a count (clients, bytes, frames per second) that must be above zero.
pub fn positive<T: Copy + PartialEq + Default + std::fmt::Display>(
    name: &str,
    value: T,
) -> Result<T, String> {
    if value == T::default() {
        return Err(format!("{name} must be more than 0"));
    }
    Ok(value)
}

/// Blocks at least this large are mapped on their own and unmapped when
/// freed ([`return_large_blocks_at_once`]), unless glibc has free heap
/// space for one: freeing one is followed by [`return_free_memory`].
pub const MAPPED_BLOCK_BYTES: usize = 1 << 20;

/// Makes every allocation of [`MAPPED_BLOCK_BYTES`] or more a mapping of
/// its own, unmapped as soon as it is freed (glibc's `M_MMAP_THRESHOLD`,
/// which also stops glibc raising that threshold by itself). Without it a
/// large frame freed in one of the runtime's per-thread heaps stayed
/// resident (`malloc_trim` gave back part of it): 10 clients that each got
/// a 16 MiB answer, +37 to +41 MiB after, and +0.2 MiB with it. Only large
/// frames pay a mapping each; the hot path's allocations are far smaller.
/// Called first thing in `main`. Elsewhere than glibc, nothing.
pub fn return_large_blocks_at_once() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` takes two plain integers and changes a setting of
    // glibc's allocator under its own lock; it is documented as callable at
    // any time, and it touches no live allocation (blocks already
    // allocated keep where they are).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES as libc::c_int);
    }
}

/// What [`reserve_thread_heap`] grows each runtime thread's heap by.
pub const THREAD_HEAP_RESERVE_BYTES: usize = 16 << 20;

/// Grows this thread's heap once by about `bytes` and frees it again, so
/// that its later growth up to there costs no system call. glibc gives
/// each thread of the runtime a heap of its own, which it grows by one
/// `mprotect` per page as the thread allocates (the process's main heap
/// grows by 128 KiB at a time; these only by what each allocation needs),
/// and every `mprotect` takes the process's memory map lock for writing:
/// a new instance taking over 1,000 clients made about 3,800 of them in
/// its pause. A heap that shrinks keeps its pages writable (they are only
/// given back, `MADV_DONTNEED`), so growing it once in large blocks and
/// freeing them leaves the room: nothing becomes resident (the blocks
/// are never written), only address space is set aside. (Under a strict
/// overcommit limit glibc unmaps what a heap gives back: the room goes
/// with it, and growth costs what it did.) Called as each
/// thread of the serve runtime starts. Elsewhere than glibc, nothing.
pub fn reserve_thread_heap(bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // Below the mapping threshold, so each comes from the heap.
        let block = MAPPED_BLOCK_BYTES - (64 << 10);
        let mut blocks: Vec<Vec<u8>> = Vec::with_capacity(bytes.div_ceil(block));
        for _ in 0..bytes.div_ceil(block) {
            // Where memory is short (a strict overcommit limit), less room
            // is set aside, and nothing fails.
            let mut room = Vec::new();
            if room.try_reserve_exact(block).is_err() {
                break;
            }
            blocks.push(room);
        }
        // Allocated, not optimized away, then freed together.
        drop(std::hint::black_box(blocks));
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = bytes;
}

/// Marks `n` more bytes of `buf` written: a buffer written to its end lets
/// go of its allocation at once. A `BytesMut` advanced to its end still
/// holds all of it (its capacity then reads 0, so a check of the capacity
/// cannot tell): the spools under the sockets kept the largest frame they
/// ever held, 20 MiB after a 20 MiB request.
pub fn written(buf: &mut bytes::BytesMut, n: usize) {
    bytes::Buf::advance(buf, n);
    if buf.is_empty() {
        *buf = bytes::BytesMut::new();
    }
}

/// Hands the allocator's free memory back to the system (glibc's
/// `malloc_trim`: the top of the heap and whole free pages inside it). The
/// broker calls it after a burst of queued events was released, so its
/// resident size comes back near idle instead of staying at the peak.
/// Elsewhere than glibc, nothing.
pub fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes a plain integer and only walks glibc's own
    // heap under glibc's own locks; it is documented as safe to call at any
    // time from any thread, and it invalidates no live allocation (it
    // releases only memory that is already free).
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread's heap is writable over the whole reserve once the
    /// blocks are freed: its growth there needs no `mprotect`. Checked in
    /// a process of its own ([`reserve_probe`]): there the reserving thread
    /// surely has a heap of its own (in this one, with many threads alive,
    /// glibc may give it the main heap, which is grown and trimmed
    /// otherwise).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_reserved_thread_heap_stays_writable_after_the_blocks_are_freed() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "bounds::tests::reserve_probe", "--ignored"])
            .args(["--nocapture", "--test-threads", "1"])
            .env(PROBE_ENV, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("reserve-probe ").map(|(_, answer)| answer))
            .unwrap_or_else(|| panic!("the probe's answer in {stdout:?}"));
        let (writable, perms) = line.split_once(' ').unwrap();
        let writable: usize = writable.parse().unwrap();
        assert!(perms.starts_with("rw"), "{line}");
        assert!(
            writable >= THREAD_HEAP_RESERVE_BYTES,
            "the thread's heap is writable over {} KiB only",
            writable >> 10
        );
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    const PROBE_ENV: &str = "CLAWMUX_TEST_RESERVE_PROBE";

    /// Run by the test above in a process of its own: reserves a thread's
    /// heap as the serve runtime does, frees a large block from its top and
    /// prints the size and permissions of the mapping it lay in.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    #[ignore = "run by a_reserved_thread_heap_stays_writable_after_the_blocks_are_freed"]
    fn reserve_probe() {
        if std::env::var_os(PROBE_ENV).is_none() {
            return;
        }
        return_large_blocks_at_once();
        let (size, perms) = std::thread::spawn(|| {
            reserve_thread_heap(THREAD_HEAP_RESERVE_BYTES);
            // A large block comes from the top of this thread's heap, where
            // the reserve's blocks were; freed, it is given back as they were.
            let probe = std::hint::black_box(Vec::<u8>::with_capacity(MAPPED_BLOCK_BYTES / 2));
            let at = probe.as_ptr() as usize;
            drop(probe);
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines()
                .find_map(|line| {
                    let (range, rest) = line.split_once(' ')?;
                    let (start, end) = range.split_once('-')?;
                    let start = usize::from_str_radix(start, 16).ok()?;
                    let end = usize::from_str_radix(end, 16).ok()?;
                    let perms = rest.split_whitespace().next()?.to_owned();
                    (start <= at && at < end).then_some((end - start, perms))
                })
                .expect("the mapping of a heap allocation")
        })
        .join()
        .unwrap();
        println!("reserve-probe {size} {perms}");
    }

    #[test]
    fn durations_are_bounded_by_a_day() {
        assert_eq!(
            duration_ms("x_ms", 1500, Zero::Refused),
            Ok(Duration::from_millis(1500))
        );
        assert_eq!(duration_ms("x_ms", 0, Zero::Allowed), Ok(Duration::ZERO));
        let err = duration_ms("limits.request_timeout_ms", 0, Zero::Refused).unwrap_err();
        assert!(err.contains("limits.request_timeout_ms") && err.contains("more than 0"));
        let err = duration_ms("limits.request_timeout_ms", u64::MAX, Zero::Refused).unwrap_err();
        assert!(err.contains("86400000 ms"), "{err}");
        assert!(duration_secs("--request-timeout", u64::MAX, Zero::Refused).is_err());
        assert!(duration_secs("--request-timeout", 86_400, Zero::Refused).is_ok());
        assert!(duration_secs("--request-timeout", 86_401, Zero::Refused).is_err());
    }

    #[test]
    fn fractional_seconds() {
        let p = |t| duration_secs_f64("--shutdown-timeout", t, Zero::Allowed);
        assert_eq!(p("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(p("0"), Ok(Duration::ZERO));
        for bad in ["-1", "NaN", "inf", "1e300", "x", "86400.5"] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn counts_must_be_positive() {
        assert_eq!(positive("limits.max_clients", 5usize), Ok(5));
        assert!(positive("limits.max_clients", 0usize)
            .unwrap_err()
            .contains("limits.max_clients"));
        assert!(positive("limits.request_rate", 0u32).is_err());
    }
}
