//! CPU time per thread group and resident memory, read from `/proc`.
//!
//! Every component of an in-process run lives on threads with its own name
//! (`bench-gw`, `broker`, `clients`), so one read of `/proc/self/task/*`
//! splits the process's CPU time by component. Read by hand: a `/proc`
//! crate would bring a parser for hundreds of fields to read three.

use std::collections::HashMap;
use std::time::Duration;

/// Thread-name prefixes the harness gives its components.
pub const GATEWAY_THREAD: &str = "bench-gw";
pub const BROKER_THREAD: &str = "broker";
pub const CLIENTS_THREAD: &str = "clients";

/// CPU time consumed so far by the threads of this process, by name prefix.
#[derive(Debug, Clone, Default)]
pub struct CpuSnapshot(HashMap<String, Duration>);

impl CpuSnapshot {
    pub fn take() -> CpuSnapshot {
        let mut by_name: HashMap<String, Duration> = HashMap::new();
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return CpuSnapshot(by_name);
        };
        for task in tasks.flatten() {
            let dir = task.path();
            let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let used = thread_cpu(&dir).unwrap_or_default();
            *by_name.entry(group_of(name.trim())).or_default() += used;
        }
        CpuSnapshot(by_name)
    }

    /// CPU time of a thread group between `earlier` and `self`.
    pub fn since(&self, earlier: &CpuSnapshot, group: &str) -> Duration {
        let now = self.0.get(group).copied().unwrap_or_default();
        let then = earlier.0.get(group).copied().unwrap_or_default();
        now.saturating_sub(then)
    }
}

fn group_of(thread: &str) -> String {
    for group in [GATEWAY_THREAD, BROKER_THREAD, CLIENTS_THREAD] {
        if thread.starts_with(group) {
            return group.to_owned();
        }
    }
    "other".to_owned()
}

/// A thread's CPU time: `schedstat` (nanoseconds) when the kernel has it,
/// else `stat` utime+stime (clock ticks, 10 ms resolution).
fn thread_cpu(dir: &std::path::Path) -> Option<Duration> {
    if let Ok(text) = std::fs::read_to_string(dir.join("schedstat")) {
        if let Some(ns) = text.split_whitespace().next().and_then(|v| v.parse().ok()) {
            return Some(Duration::from_nanos(ns));
        }
    }
    stat_cpu(&std::fs::read_to_string(dir.join("stat")).ok()?)
}

/// utime + stime from a `stat` line (fields 14 and 15, after the `(comm)`).
fn stat_cpu(stat: &str) -> Option<Duration> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // after_comm starts at field 3 (state), so field N is fields[N - 3].
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(TICK * ticks as u32)
}

/// CPU time (user + system) of another process, e.g. the `clawmux serve` child.
pub fn process_cpu(pid: u32) -> Option<Duration> {
    stat_cpu(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Resident set size of a process in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The 1-minute load average, to say in the report what else was running.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Machine-wide busy CPU time and this process's own (with its waited-for
/// children), to tell how much CPU other programs used during a run.
#[derive(Debug, Clone, Copy)]
pub struct MachineCpu {
    busy: Duration,
    own: Duration,
    at: std::time::Instant,
}

impl MachineCpu {
    pub fn take() -> MachineCpu {
        MachineCpu {
            busy: machine_busy().unwrap_or_default(),
            own: own_cpu_with_children().unwrap_or_default(),
            at: std::time::Instant::now(),
        }
    }

    /// Cores' worth of CPU that other processes used on average since `earlier`.
    pub fn others_since(&self, earlier: &MachineCpu) -> f64 {
        let busy = self.busy.saturating_sub(earlier.busy);
        let own = self.own.saturating_sub(earlier.own);
        busy.saturating_sub(own).as_secs_f64() / self.at.duration_since(earlier.at).as_secs_f64()
    }
}

/// Clock ticks per second of /proc/stat and /proc/<pid>/stat (USER_HZ).
const TICK: Duration = Duration::from_millis(10);

/// Non-idle time of all cores: user+nice+system+irq+softirq+steal of the `cpu` line.
fn machine_busy() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let ticks = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)? + f.get(7)?;
    Some(TICK * ticks as u32)
}

/// utime+stime+cutime+cstime of this process.
fn own_cpu_with_children() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let f: Vec<u64> = after_comm
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|v| v.parse().ok())
        .collect();
    Some(TICK * f.iter().sum::<u64>() as u32)
}
