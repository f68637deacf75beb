//! The README's client examples, run as written against `clawmux serve
//! --demo`, with `XDG_RUNTIME_DIR` set and unset, so the README cannot rot.
//!
//! A block is tested when the line before its fence is
//! `<!-- readme-test: sh|python|node -->`. `clawmux` on `PATH` is the binary
//! under test; nothing gets a `--socket`: the examples must find the broker
//! the way a newcomer's shell would. A tool that is not installed here
//! (websocat, Python's `websockets`, Node's `ws`) is reported as SKIPPED.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::support::*;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");
/// One example may take this long (the `agent` call waits for a whole run).
const EXAMPLE_PATIENCE: Duration = Duration::from_secs(60);
/// The demo broker must be ready within this (a cold start under a CPU hog).
const START_PATIENCE: Duration = Duration::from_secs(20);

#[derive(Debug)]
struct Example {
    lang: String,
    code: String,
    /// 1-based line of the fence, for messages.
    line: usize,
}

fn examples() -> Vec<Example> {
    let readme = include_str!("../../README.md");
    let lines: Vec<&str> = readme.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if let Some(lang) = lines[i]
            .strip_prefix("<!-- readme-test: ")
            .and_then(|r| r.strip_suffix(" -->"))
        {
            assert!(
                lines.get(i + 1).is_some_and(|l| l.starts_with("```")),
                "README line {}: a readme-test marker must precede a fence",
                i + 1
            );
            let start = i + 2;
            let end = (start..lines.len())
                .find(|&j| lines[j].starts_with("```"))
                .expect("a closed fence");
            out.push(Example {
                lang: lang.to_owned(),
                code: lines[start..end].join("\n") + "\n",
                line: i + 2,
            });
            i = end;
        }
        i += 1;
    }
    out
}

/// The environment of a newcomer's shell: a private home, `clawmux` on
/// `PATH`, and `XDG_RUNTIME_DIR` set or not.
fn shell_env(home: &TestHome, with_xdg: bool, cmd: &mut Command) {
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin_dir.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    let mut std_cmd = std::process::Command::new("true");
    home.apply(&mut std_cmd);
    for (k, v) in std_cmd.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.env("PATH", std::env::join_paths(dirs).unwrap())
        .env_remove("NO_COLOR")
        .env("TMPDIR", home.path().join("tmp"));
    if !with_xdg {
        cmd.env_remove("XDG_RUNTIME_DIR");
    }
}

async fn available(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success())
}

/// Runs one example; `None` when its tool is missing here (SKIPPED).
async fn run_example(home: &TestHome, with_xdg: bool, ex: &Example) -> Option<String> {
    let (program, args): (&str, Vec<String>) = match ex.lang.as_str() {
        "sh" => {
            let websocat = available("websocat", &["--version"]).await;
            let code: String = ex
                .code
                .lines()
                .map(|l| {
                    if l.starts_with("websocat ") && !websocat {
                        eprintln!(
                            "SKIPPED (websocat not installed): README line {}: {l}",
                            ex.line
                        );
                        "true".to_owned()
                    } else {
                        l.to_owned()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n");
            (
                "bash",
                vec!["-euo".into(), "pipefail".into(), "-c".into(), code],
            )
        }
        "python" => {
            if !available("python3", &["-c", "import websockets"]).await {
                eprintln!(
                    "SKIPPED (python3 with websockets not installed): README line {}",
                    ex.line
                );
                return None;
            }
            ("python3", vec!["-c".into(), ex.code.clone()])
        }
        "node" => {
            if !available("node", &["-e", "require('ws')"]).await {
                eprintln!(
                    "SKIPPED (node with ws not installed): README line {}",
                    ex.line
                );
                return None;
            }
            ("node", vec!["-e".into(), ex.code.clone()])
        }
        other => panic!(
            "README line {}: unknown readme-test language {other}",
            ex.line
        ),
    };
    let mut cmd = Command::new(program);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    shell_env(home, with_xdg, &mut cmd);
    let out = tokio::time::timeout(EXAMPLE_PATIENCE, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("README line {} ({}) did not finish", ex.line, ex.lang))
        .expect("the interpreter runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "README line {} ({}, XDG_RUNTIME_DIR {}) failed: {:?}\nstdout:\n{stdout}\nstderr:\n{}",
        ex.line,
        ex.lang,
        if with_xdg { "set" } else { "unset" },
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Some(stdout)
}

async fn readme_examples_work(with_xdg: bool) {
    let home = TestHome::new();
    let tmp = home.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let log_path = home.path().join("demo.log");
    let mut demo = Command::new(BIN);
    demo.args(["serve", "--demo"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .kill_on_drop(true);
    shell_env(&home, with_xdg, &mut demo);
    let mut demo = demo.spawn().expect("the demo starts");
    let socket: PathBuf = if with_xdg {
        home.path().join("run/clawmux.sock")
    } else {
        tmp.join(format!(
            "clawmux-{}/clawmux.sock",
            rustix::process::getuid().as_raw()
        ))
    };
    let deadline = tokio::time::Instant::now() + START_PATIENCE;
    loop {
        if socket.exists() && http_get(&socket, "/readyz").await.0 == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the demo never got ready on {}: {}",
            socket.display(),
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all = examples();
    for lang in ["sh", "python", "node"] {
        assert!(
            all.iter().any(|e| e.lang == lang),
            "no {lang} example found"
        );
    }
    for ex in &all {
        let Some(out) = run_example(&home, with_xdg, ex).await else {
            continue;
        };
        match ex.lang.as_str() {
            "sh" if ex.code.contains("/healthz") => {
                assert!(
                    out.contains(r#""upstream":"ready""#),
                    "line {}: {out}",
                    ex.line
                )
            }
            "sh" if ex.code.contains("/v1/rpc") => {
                assert!(!out.contains(r#""ok":false"#), "line {}: {out}", ex.line);
                assert!(out.contains(r#""type":"res""#), "line {}: {out}", ex.line);
            }
            "sh" if ex.code.contains("/metrics") => {
                assert!(
                    out.contains("clawmux_upstream_phase"),
                    "line {}: {out}",
                    ex.line
                )
            }
            "python" => assert!(
                out.contains("connect.challenge")
                    && out.contains("hello-ok")
                    && out.contains("res h1 ok=True"),
                "line {}: {out}",
                ex.line
            ),
            "node" => assert!(
                out.contains("hello-ok") && out.contains("health ok: true"),
                "line {}: {out}",
                ex.line
            ),
            _ => {}
        }
    }
    sigterm_tokio(&demo);
    let _ = tokio::time::timeout(PATIENCE, demo.wait()).await;
}

fn sigterm_tokio(child: &tokio::process::Child) {
    if let Some(pid) = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

#[tokio::test]
async fn readme_examples_work_with_xdg_runtime_dir() {
    readme_examples_work(true).await;
}

#[tokio::test]
async fn readme_examples_work_without_xdg_runtime_dir() {
    readme_examples_work(false).await;
}
