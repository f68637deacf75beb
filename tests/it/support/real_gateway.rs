//! The real OpenClaw Gateway for the interop tests (`tests/interop*.rs`),
//! run by `../shared/peers/openclaw-gateway.sh` on loopback in its own
//! process group, and the real `openclaw` CLI run by the same script (its
//! HOME, state dir and TMPDIR are a fresh temp dir per call: nothing touches
//! the real HOME). Include with `#[path = "support/real_gateway.rs"]`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{http_get, test_settings, Settings};

/// The gateway token every interop test uses.
pub const TOKEN: &str = "interop-token";
/// First start may include the install.
pub const FIRST_START: Duration = Duration::from_secs(300);

pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/peers/openclaw-gateway.sh")
}

/// Whether the peers script is here; prints why not (a visible skip).
pub fn peers_present(test: &str) -> bool {
    if script().exists() {
        return true;
    }
    eprintln!(
        "SKIPPED {test}: {} is missing (CI clones shared/ beside the repo)",
        script().display()
    );
    false
}

/// The real gateway, run by the peers script in its own process group.
pub struct Gateway {
    child: Option<tokio::process::Child>,
    pub log: PathBuf,
    pub port: u16,
}

impl Gateway {
    pub fn start(port: u16, log: PathBuf) -> Gateway {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("gateway log file");
        let child = tokio::process::Command::new("bash")
            .arg(script())
            .env("PORT", port.to_string())
            .env("TOKEN", TOKEN)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("the peers script starts");
        Gateway {
            child: Some(child),
            log,
            port,
        }
    }

    fn pid(&self) -> Option<rustix::process::Pid> {
        let id = self.child.as_ref()?.id()?;
        rustix::process::Pid::from_raw(id as i32)
    }

    /// SIGTERM to the script (it stops the gateway and cleans its state
    /// dir); returns how long the exit took.
    pub async fn stop(&mut self) -> Duration {
        let t = Instant::now();
        if let (Some(pid), Some(mut child)) = (self.pid(), self.child.take()) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            if tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .is_err()
            {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                let _ = child.wait().await;
                panic!("the gateway did not stop within 30 s of SIGTERM");
            }
        }
        t.elapsed()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Waits until `GET /startupz` answers 200 (the gateway answers
    /// `connect` with `UNAVAILABLE` before that). A gateway that exits
    /// before it is ready (seen once: "database is not open" on a fresh
    /// state dir under load) is started again, once, with a note.
    pub async fn wait_ready(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        let mut restarted = false;
        loop {
            if startupz(self.port).await == Some(200) {
                return;
            }
            let exited = self
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            if exited {
                assert!(
                    !restarted,
                    "the gateway exited twice before it was ready\n{}",
                    self.log_tail()
                );
                eprintln!(
                    "NOTE: the gateway exited before it was ready; starting it again\n{}",
                    self.log_tail()
                );
                self.child = None;
                *self = Gateway::start(self.port, self.log.clone());
                restarted = true;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway was not ready within {within:?}\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Gateway {
    /// A failed test still stops the gateway: SIGTERM, then SIGKILL to its
    /// process group if it lingers.
    fn drop(&mut self) {
        let Some(pid) = self.pid() else { return };
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let mut child = self.child.take().expect("child");
        for _ in 0..100 {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
}

/// The status of `GET /startupz`, or `None` when nothing answers.
async fn startupz(port: u16) -> Option<u16> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(b"GET /startupz HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.ok()?;
        std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

pub fn broker_settings(dir: &Path, port: u16, token: &str) -> Settings {
    let mut s = test_settings(dir, &format!("ws://127.0.0.1:{port}"), Some(token));
    // Real-gateway pace: the default 1 s first retry, capped at 4 s so a
    // restart is picked up promptly; the gateway's 15 s handshake budget.
    s.upstream.backoff_initial = Duration::from_secs(1);
    s.upstream.backoff_max = Duration::from_secs(4);
    s.upstream.handshake_timeout = Duration::from_secs(15);
    // The default: below Claw3D's 13 s connect timeout, so a client that
    // connects while the gateway restarts gets an answer before it gives up.
    s.limits.connect_wait = Duration::from_secs(10);
    s
}

pub async fn wait_phase(socket: &Path, phase: &str, within: Duration, gw: &Gateway) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let (_, body) = http_get(socket, "/healthz").await;
        if body["upstream"] == phase {
            return body;
        }
        if Instant::now() > deadline {
            panic!(
                "upstream not {phase} within {within:?}: {body}\ngateway log:\n{}",
                gw.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What one run of the real `openclaw` CLI printed.
#[derive(Debug)]
pub struct CliRun {
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// The real `openclaw` CLI (`openclaw-gateway.sh cli ARGS`), with `env`
/// words for the openclaw process (`OC_EXTRA_ENV`), killed after `within`.
pub async fn openclaw_cli(args: &[String], env: &str, within: Duration) -> CliRun {
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg(script())
        .arg("cli")
        .args(args)
        .env("OC_EXTRA_ENV", env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .process_group(0);
    let child = cmd.spawn().expect("the peers script runs the cli");
    let pid = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32));
    match tokio::time::timeout(within, child.wait_with_output()).await {
        Ok(out) => {
            let out = out.expect("cli output");
            CliRun {
                status: out.status.code(),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        }
        Err(_) => {
            if let Some(pid) = pid {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            panic!("openclaw {args:?} did not finish within {within:?}");
        }
    }
}

/// Runs the CLI until its stdout has `lines` lines (then kills it: for
/// `logs --follow`, which never ends by itself) or `within` passes.
pub async fn openclaw_cli_lines(
    args: &[String],
    env: &str,
    lines: usize,
    within: Duration,
) -> CliRun {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new("bash")
        .arg(script())
        .arg("cli")
        .args(args)
        .env("OC_EXTRA_ENV", env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .process_group(0)
        .spawn()
        .expect("the peers script runs the cli");
    let pid = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32));
    let mut reader = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while got.len() < lines {
        match tokio::time::timeout_at(deadline, reader.next_line()).await {
            Ok(Ok(Some(line))) => got.push(line),
            _ => break,
        }
    }
    let status = child.try_wait().ok().flatten().and_then(|s| s.code());
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::TERM);
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    CliRun {
        status,
        stdout: got.join("\n"),
        stderr: String::new(),
    }
}
