//! The pause a reader sees when the broker hands itself over (`SIGUSR2`,
//! docs/src/restarts.md): `clawmux serve` as a child process with N
//! connected WebSocket clients while the double sends a numbered event
//! every few milliseconds (a tenth of them `/v1/events` streams, and a
//! tenth WebSocket clients that stop reading around each handover, their
//! sockets full: the broker's send buffers are set small);
//! several handovers in a row. Per handover, the largest gap between two
//! events any reading client or stream received (its own connection stays
//! open throughout), and the time from the signal to the old instance's
//! exit (it exits once the new one says it serves). Every numbered event
//! must arrive once, in order, the non-reading clients' too once they read
//! again.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::Message;

use crate::clients;
use crate::double::MockThread;
use crate::fanout::BENCH_TOKEN;
use crate::source::now_ns;
use crate::Config;

/// Milliseconds between two events from the double.
pub const TICK_MS: u64 = 5;

/// The broker's `send_buffer_bytes` in this scenario.
const SEND_BUFFER_BYTES: usize = 4096;

/// How long the non-reading clients stop reading before each signal.
const STALL_BEFORE: Duration = Duration::from_millis(150);

/// What one run measured.
pub struct Pauses {
    pub clients: usize,
    /// Event streams (`/v1/events`) read beside the clients.
    pub streams: usize,
    /// WebSocket clients (among `clients`) not reading during each handover.
    pub stalled: usize,
    /// Per handover: the largest gap between two events any client saw.
    pub gaps: Vec<Duration>,
    /// Per handover, the baseline: the largest gap any reading client saw
    /// in as long a window just before, with no handover (the machine's
    /// own delivery spread, which every gap above includes).
    pub quiet: Vec<Duration>,
    /// Per handover: from `SIGUSR2` to the old instance's exit (the new
    /// one serves).
    pub took: Vec<Duration>,
    /// Per handover, as the old instance logged it (`paused_ms`): from
    /// stopping its clients to the new instance's word that it serves, the
    /// part of the gap that is the broker's own work.
    pub paused: Vec<Duration>,
    /// Per handover, with `HANDOVER_BENCH_AGAINST`: which build the old
    /// and the new instance were (`'A'`: `HANDOVER_BENCH_BINARY`, `'B'`:
    /// the other); empty otherwise.
    pub builds: Vec<(char, char)>,
    /// Clients whose connection ended during the run (should be 0).
    pub lost: usize,
    /// Numbered events a client did not receive, after its first, summed
    /// over the clients (should be 0: the gateway connection moves too).
    pub skipped: u64,
    /// Numbered events a client received again or out of order (should be 0).
    pub repeated: u64,
}

#[derive(Default)]
struct Reader {
    last_ns: AtomicU64,
    max_gap_ns: AtomicU64,
    /// The last event number received, plus one (0: none yet).
    next_n: AtomicU64,
    skipped: AtomicU64,
    repeated: AtomicU64,
    /// It stops reading around each handover (not counted in the gaps).
    stalls: bool,
}

impl Reader {
    /// A `bench.tick` event arrived now.
    fn received(&self, text: &str) {
        let now = now_ns();
        let prev = self.last_ns.swap(now, Ordering::Relaxed);
        if prev > 0 {
            self.max_gap_ns.fetch_max(now - prev, Ordering::Relaxed);
        }
        if let Some(n) = tick_number(text) {
            let expected = self.next_n.swap(n + 1, Ordering::Relaxed);
            if expected > 0 && n > expected {
                self.skipped.fetch_add(n - expected, Ordering::Relaxed);
            } else if expected > 0 && n < expected {
                self.repeated.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The number of a `bench.tick` event (`"n":<digits>`), without parsing
/// the whole frame.
fn tick_number(text: &str) -> Option<u64> {
    let at = text.find("\"n\":")? + 4;
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

async fn state(socket: &Path) -> Option<Value> {
    let mut s = UnixStream::connect(socket).await.ok()?;
    s.write_all(b"GET /v1/state HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&out);
    let body = text.split("\r\n\r\n").nth(1)?;
    // Chunked or not: the JSON object is the text between the outer braces.
    let start = body.find('{')?;
    let end = body.rfind('}')?;
    serde_json::from_str(&body[start..=end]).ok()
}

async fn until<T>(
    what: &str,
    within: Duration,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> Result<T, String> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(format!("handover bench: {what} not within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Whether process `pid` has exited (a zombie counts: it is not serving).
fn gone(pid: u32) -> bool {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return true;
    };
    rustix::process::test_kill_process(p).is_err()
        || std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

/// One run of handovers; with `stall`, a tenth of the WebSocket clients
/// stop reading around each.
pub async fn run(cfg: &Config, binary: &Path, stall: bool) -> Result<Pauses, String> {
    // HANDOVER_BENCH_ROUNDS: more handovers per run, for a comparison of
    // two binaries that machine noise would hide in ten.
    let rounds = std::env::var("HANDOVER_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|r| *r > 0)
        .unwrap_or(10);
    let (n, rounds) = if cfg.smoke {
        (4, 2)
    } else {
        (cfg.idle_clients, rounds)
    };
    let mock = MockThread::start()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("clawmux.sock");
    let log_path = std::env::var_os("HANDOVER_BENCH_LOG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| dir.path().join("broker.log"));
    let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
    // Small kernel send buffers: a client that stops reading has a full
    // socket within a few events, whatever the machine's default.
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!("[limits]\nsend_buffer_bytes = {SEND_BUFFER_BYTES}\n"),
    )
    .map_err(|e| e.to_string())?;
    // HANDOVER_BENCH_AGAINST: a second build, compared with `binary` in
    // the same run, handover by handover (the machine's drift between two
    // runs is larger than a change to either instance's half).
    let builds = match std::env::var_os("HANDOVER_BENCH_AGAINST") {
        Some(other) => Some(Builds::install(dir.path(), binary, Path::new(&other))?),
        None => None,
    };
    let binary = builds.as_ref().map_or(binary, |b| b.serving.as_path());
    let mut child = std::process::Command::new(binary)
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--gateway-url", &mock.gw.url(), "--token", BENCH_TOKEN])
        .args(["--no-device-identity", "--shutdown-timeout", "5"])
        .arg("--config")
        .arg(&config)
        .env("HOME", dir.path())
        .env_remove("CLAWMUX_CONFIG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| e.to_string())?;
    let result = measure(n, rounds, stall, &socket, &mock, builds.as_ref())
        .await
        .map(|p| Pauses {
            paused: logged_pauses(&log_path),
            ..p
        });
    // The last instance is not our child (after the first handover).
    if let Some(s) = state(&socket).await {
        if let Some(pid) = s["broker"]["pid"].as_u64() {
            signal(pid as u32, rustix::process::Signal::KILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    result
}

async fn measure(
    n: usize,
    rounds: usize,
    stall: bool,
    socket: &Path,
    mock: &MockThread,
    builds: Option<&Builds>,
) -> Result<Pauses, String> {
    until("the broker", Duration::from_secs(20), async || {
        state(socket)
            .await
            .filter(|s| s["upstream"]["phase"] == "ready")
    })
    .await?;
    // A tenth of the clients (at least one) are event streams.
    let streams = (n / 10).max(1);
    let n = n.saturating_sub(streams).max(1);
    // Another tenth (at least one) of the WebSocket clients stop reading
    // around each handover: the last ones.
    let stalled = if stall { (n / 10).max(1).min(n) } else { 0 };
    let readers: Arc<Vec<Reader>> = Arc::new(
        (0..n + streams)
            .map(|i| Reader {
                stalls: i >= n - stalled && i < n,
                ..Reader::default()
            })
            .collect(),
    );
    let lost = Arc::new(AtomicUsize::new(0));
    // Whether the non-reading clients read (they do between handovers).
    let (read_tx, read_rx) = tokio::sync::watch::channel(true);
    for i in 0..n {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|e| e.to_string())?;
        let mut ws = clients::handshake(stream, Some(BENCH_TOKEN)).await?;
        let readers = Arc::clone(&readers);
        let lost = Arc::clone(&lost);
        let mut may_read = read_rx.clone();
        tokio::spawn(async move {
            loop {
                if readers[i].stalls {
                    // Not reading: its socket fills, and the broker's
                    // writer stops in the middle of a batch.
                    if may_read.wait_for(|r| *r).await.is_err() {
                        break;
                    }
                }
                let msg = tokio::select! {
                    msg = ws.next() => msg,
                    _ = may_read.changed(), if readers[i].stalls => continue,
                };
                let Some(Ok(msg)) = msg else { break };
                let Message::Text(text) = msg else { continue };
                if !text.as_str().contains("\"bench.tick\"") {
                    continue;
                }
                readers[i].received(text.as_str());
            }
            lost.fetch_add(1, Ordering::Relaxed);
        });
    }
    for i in n..n + streams {
        let mut stream = UnixStream::connect(socket)
            .await
            .map_err(|e| e.to_string())?;
        stream
            .write_all(b"GET /v1/events?events=bench.tick HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        let readers = Arc::clone(&readers);
        let lost = Arc::clone(&lost);
        tokio::spawn(async move {
            // Records end with a blank line; the chunked encoding's size
            // lines fall between them, and a record names its number once.
            let mut buf = Vec::new();
            let mut chunk = vec![0u8; 64 * 1024];
            while let Ok(got) = stream.read(&mut chunk).await {
                if got == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..got]);
                while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                    let record: Vec<u8> = buf.drain(..end + 2).collect();
                    let text = String::from_utf8_lossy(&record);
                    if text.contains("event: bench.tick") {
                        readers[i].received(&text);
                    }
                }
            }
            lost.fetch_add(1, Ordering::Relaxed);
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let gw = mock.gw.clone();
        let stop = Arc::clone(&stop);
        mock.handle.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
            // Bounded: at most ten minutes of events.
            for seq in 0..(600_000 / TICK_MS) {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                tick.tick().await;
                gw.broadcast("bench.tick", json!({ "n": seq }));
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut gaps = Vec::new();
    let mut quiet = Vec::new();
    // As long as a handover's window (from the reset of the gaps to their
    // reading): the last round's, and 100 ms before the first.
    let mut window = Duration::from_millis(100);
    let mut took = Vec::new();
    let mut pairs = Vec::new();
    let mut serving = 'A';
    for round in 0..rounds {
        // Each of A→A, A→B, B→A and B→B, in turn: the new instance is the
        // build installed at the program's path now.
        if let Some(builds) = builds {
            let next = if round % 4 < 2 { 'B' } else { 'A' };
            builds.put(next)?;
            pairs.push((serving, next));
            serving = next;
        }
        let pid = until("the broker's pid", Duration::from_secs(10), async || {
            state(socket).await?["broker"]["pid"].as_u64()
        })
        .await?;
        reset_gaps(&readers);
        tokio::time::sleep(window).await;
        quiet.push(Duration::from_nanos(largest_gap(&readers)));
        let _ = read_tx.send(false);
        tokio::time::sleep(STALL_BEFORE).await;
        reset_gaps(&readers);
        let signalled = Instant::now();
        signal(pid as u32, rustix::process::Signal::USR2);
        // The old instance exits once the new one says it serves. Watched
        // by its pid, not by asking the socket: a `/v1/state` of 1,000
        // clients is tens of ms of the broker's CPU, which would land in
        // the very pause measured here.
        until(
            "the old instance's exit",
            Duration::from_secs(30),
            async || gone(pid as u32).then_some(()),
        )
        .await?;
        took.push(signalled.elapsed());
        // Every client is served by the new instance and receiving again.
        let receiving = until(
            "every client receiving",
            Duration::from_secs(30),
            async || {
                let since = now_ns();
                tokio::time::sleep(Duration::from_millis(4 * TICK_MS)).await;
                let silent = readers
                    .iter()
                    .filter(|r| !r.stalls && r.last_ns.load(Ordering::Relaxed) <= since)
                    .count();
                (silent <= lost.load(Ordering::Relaxed)).then_some(())
            },
        )
        .await;
        if let Err(e) = receiving {
            let since = now_ns();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let silent = readers
                .iter()
                .filter(|r| r.last_ns.load(Ordering::Relaxed) <= since)
                .count();
            return Err(format!(
                "{e}: {silent} of {} silent, {} connections ended",
                n + streams,
                lost.load(Ordering::Relaxed)
            ));
        }
        gaps.push(Duration::from_nanos(largest_gap(&readers)));
        window = signalled.elapsed();
        // Asked only now: a `/v1/state` of 1,000 clients is milliseconds of
        // the new instance's CPU, which would land in the pause measured.
        until("the new instance", Duration::from_secs(30), async || {
            state(socket)
                .await
                .filter(|s| s["broker"]["pid"].as_u64().is_some_and(|p| p != pid))
        })
        .await?;
        // The non-reading clients read again, and catch up.
        let _ = read_tx.send(true);
        until(
            "the non-reading clients receiving again",
            Duration::from_secs(30),
            async || {
                let since = now_ns();
                tokio::time::sleep(Duration::from_millis(4 * TICK_MS)).await;
                let silent = readers
                    .iter()
                    .filter(|r| r.stalls && r.last_ns.load(Ordering::Relaxed) <= since)
                    .count();
                (silent <= lost.load(Ordering::Relaxed)).then_some(())
            },
        )
        .await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = producer.await;
    let sum = |f: fn(&Reader) -> &AtomicU64| {
        readers
            .iter()
            .map(|r| f(r).load(Ordering::Relaxed))
            .sum::<u64>()
    };
    Ok(Pauses {
        clients: n,
        streams,
        stalled,
        gaps,
        quiet,
        took,
        paused: Vec::new(),
        builds: pairs,
        lost: lost.load(Ordering::Relaxed),
        skipped: sum(|r| &r.skipped),
        repeated: sum(|r| &r.repeated),
    })
}

/// Starts every reader's largest gap afresh.
fn reset_gaps(readers: &[Reader]) {
    for r in readers {
        r.max_gap_ns.store(0, Ordering::Relaxed);
    }
}

/// The largest gap any reading client saw since the gaps were reset.
fn largest_gap(readers: &[Reader]) -> u64 {
    readers
        .iter()
        .filter(|r| !r.stalls)
        .map(|r| r.max_gap_ns.load(Ordering::Relaxed))
        .max()
        .unwrap_or(0)
}

/// Two builds taking turns at one program path: an upgrade starts whatever
/// is there (the path the broker was started from), as after a package
/// upgrade.
struct Builds {
    /// The path the broker runs from.
    serving: std::path::PathBuf,
    a: std::path::PathBuf,
    b: std::path::PathBuf,
}

impl Builds {
    fn install(dir: &Path, a: &Path, b: &Path) -> Result<Builds, String> {
        let builds = Builds {
            serving: dir.join("clawmux"),
            a: dir.join("clawmux-a"),
            b: dir.join("clawmux-b"),
        };
        for (from, to) in [(a, &builds.a), (b, &builds.b), (a, &builds.serving)] {
            std::fs::copy(from, to).map_err(|e| format!("{}: {e}", from.display()))?;
        }
        Ok(builds)
    }

    /// Puts build `which` at the program path (a rename: the running
    /// instance keeps its own file).
    fn put(&self, which: char) -> Result<(), String> {
        let from = if which == 'A' { &self.a } else { &self.b };
        let next = self.serving.with_extension("next");
        std::fs::copy(from, &next).map_err(|e| e.to_string())?;
        std::fs::rename(&next, &self.serving).map_err(|e| e.to_string())
    }
}

/// The `paused_ms` of every handover in the broker's log, in order.
fn logged_pauses(log: &Path) -> Vec<Duration> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains("the new instance serves; exiting"))
        .filter_map(|l| {
            let at = l.find("paused_ms=")? + "paused_ms=".len();
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok().map(Duration::from_millis)
        })
        .collect()
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

/// Prints the two runs as a Markdown table: every client reading, and a
/// tenth not reading around each handover.
pub fn print(all_read: &Pauses, some_stall: &Pauses) {
    let ms = |d: Duration| format!("{:.0} ms", d.as_secs_f64() * 1e3);
    let sorted = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    println!(
        "\n### Handover (SIGUSR2) with {} connected clients and {} event streams\n",
        all_read.clients, all_read.streams
    );
    println!(
        "An event every {TICK_MS} ms from the double; {} handovers in a row, twice: every client \
         reading, then {} of the WebSocket clients not reading from {} ms before each signal \
         until the new instance serves (the broker's `send_buffer_bytes` = {SEND_BUFFER_BYTES} \
         in both: their sockets are full). The gaps are those of the clients and streams that \
         read.\n",
        all_read.gaps.len(),
        some_stall.stalled,
        STALL_BEFORE.as_millis()
    );
    println!("| figure | clients not reading | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    for p in [all_read, some_stall] {
        let rows: [(&str, &[Duration]); 4] = [
            ("largest delivery gap any reading client saw, per handover", &p.gaps),
            (
                "baseline: the same in as long a window just before, with no handover",
                &p.quiet,
            ),
            ("SIGUSR2 → the new instance serves (the old one exited)", &p.took),
            (
                "the broker's own pause: clients stopped → the new instance serves (its log's `paused_ms`)",
                &p.paused,
            ),
        ];
        for (figure, values) in rows {
            let values = sorted(values);
            println!(
                "| {figure} | {} | {} | {} | {} |",
                p.stalled,
                ms(quantile(&values, 0.5)),
                ms(quantile(&values, 0.99)),
                ms(*values.last().unwrap_or(&Duration::ZERO))
            );
        }
    }
    for p in [all_read, some_stall] {
        if p.builds.is_empty() {
            continue;
        }
        println!(
            "\n{} not reading, by build (A and B below), medians:\n",
            p.stalled
        );
        let ms1 = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
        println!("| old → new instance | handovers | largest gap | the broker's own pause |");
        println!("|---|---|---|---|");
        for pair in [('A', 'A'), ('A', 'B'), ('B', 'A'), ('B', 'B')] {
            let of = |values: &[Duration]| {
                let picked: Vec<Duration> = p
                    .builds
                    .iter()
                    .zip(values)
                    .filter(|(b, _)| **b == pair)
                    .map(|(_, v)| *v)
                    .collect();
                sorted(&picked)
            };
            let (gaps, paused) = (of(&p.gaps), of(&p.paused));
            println!(
                "| {} → {} | {} | {} | {} |",
                pair.0,
                pair.1,
                gaps.len(),
                ms1(quantile(&gaps, 0.5)),
                ms1(quantile(&paused, 0.5))
            );
        }
    }
    let ratio = |a: Duration, b: Duration| b.as_secs_f64() / a.as_secs_f64().max(1e-9);
    println!(
        "\nmedian gap with a tenth not reading / with all reading: {:.2}",
        ratio(
            quantile(&sorted(&all_read.gaps), 0.5),
            quantile(&sorted(&some_stall.gaps), 0.5)
        )
    );
    for p in [all_read, some_stall] {
        println!(
            "\n{} not reading: median gap over the baseline: {:.2} ({} more)",
            p.stalled,
            ratio(
                quantile(&sorted(&p.quiet), 0.5),
                quantile(&sorted(&p.gaps), 0.5)
            ),
            ms(quantile(&sorted(&p.gaps), 0.5).saturating_sub(quantile(&sorted(&p.quiet), 0.5)))
        );
    }
    for p in [all_read, some_stall] {
        println!(
            "\n{} not reading: clients whose connection ended: {}; numbered events a client missed: {}; received twice or out of order: {}",
            p.stalled, p.lost, p.skipped, p.repeated
        );
    }
}
