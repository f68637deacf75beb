//! The README's and the book's client examples, run as written against
//! `clawmux serve --demo`, with `XDG_RUNTIME_DIR` set and unset, so the
//! documentation cannot rot.
//!
//! A block is tested when the line before its fence is
//! `<!-- readme-test: sh|python|node -->`, in README.md or any page under
//! docs/src/. `clawmux` on `PATH` is the binary under test; nothing gets a
//! `--socket`: the examples must find the broker the way a newcomer's shell
//! would. Each language is its own test, ignored (with the tool it needs
//! named in the `cargo test` summary) when build.rs did not find that tool:
//! `sh` needs `curl` and `jq`, `python` Python's `websockets`, `node` Node's
//! `ws`. Under `CI=true` none is ignored (`.ci/run` installs them all).

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

/// A test that was not ignored needs its tool: build.rs found it when the
/// tests were built, so a missing one here is a failure, said plainly.
fn require(present: bool, why: &str, ex: &Example) {
    assert!(
        present,
        "{} line {}: {why} (build.rs found it when the tests were built: `touch build.rs` after removing or installing a tool; `source .ci/doc-tools.sh` installs them all)",
        ex.file, ex.line
    );
}

#[derive(Debug)]
struct Example {
    /// README.md or docs/src/<page>.md.
    file: String,
    lang: String,
    code: String,
    /// 1-based line of the fence, for messages.
    line: usize,
}

/// The documents whose examples are run: the README and every book page.
fn documents() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![(
        "README.md".to_owned(),
        std::fs::read_to_string(root.join("README.md")).unwrap(),
    )];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs/src"))
        .expect("the book's pages")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    for page in pages {
        let name = page.strip_prefix(root).unwrap().display().to_string();
        docs.push((name, std::fs::read_to_string(&page).unwrap()));
    }
    docs
}

fn examples() -> Vec<Example> {
    let mut out = Vec::new();
    for (file, text) in documents() {
        examples_in(&file, &text, &mut out);
    }
    out
}

fn examples_in(file: &str, text: &str, out: &mut Vec<Example>) {
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        if let Some(lang) = lines[i]
            .strip_prefix("<!-- readme-test: ")
            .and_then(|r| r.strip_suffix(" -->"))
        {
            assert!(
                lines.get(i + 1).is_some_and(|l| l.starts_with("```")),
                "{file} line {}: a readme-test marker must precede a fence",
                i + 1
            );
            let start = i + 2;
            let end = (start..lines.len())
                .find(|&j| lines[j].starts_with("```"))
                .expect("a closed fence");
            out.push(Example {
                file: file.to_owned(),
                lang: lang.to_owned(),
                code: lines[start..end].join("\n") + "\n",
                line: i + 2,
            });
            i = end;
        }
        i += 1;
    }
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

/// Runs one example and returns its stdout.
///
/// Shell examples run under `bash -eu` without `pipefail`, as in a reader's
/// shell: `… | head -n 4` ends a follow the way a reader would.
async fn run_example(home: &TestHome, with_xdg: bool, ex: &Example) -> String {
    let (program, args): (&str, Vec<String>) = match ex.lang.as_str() {
        "sh" => {
            for tool in ["curl", "jq"] {
                if ex.code.contains(&format!("{tool} ")) {
                    require(
                        available(tool, &["--version"]).await,
                        &format!("{tool} is not installed"),
                        ex,
                    );
                }
            }
            ("bash", vec!["-eu".into(), "-c".into(), ex.code.clone()])
        }
        "python" => {
            require(
                available("python3", &["-c", "import websockets"]).await,
                "python3 with websockets is not installed",
                ex,
            );
            ("python3", vec!["-c".into(), ex.code.clone()])
        }
        "node" => {
            require(
                available("node", &["-e", "require('ws')"]).await,
                "node with ws is not installed",
                ex,
            );
            ("node", vec!["-e".into(), ex.code.clone()])
        }
        other => panic!(
            "{} line {}: unknown readme-test language {other}",
            ex.file, ex.line
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
        .unwrap_or_else(|_| panic!("{} line {} ({}) did not finish", ex.file, ex.line, ex.lang))
        .expect("the interpreter runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} line {} ({}, XDG_RUNTIME_DIR {}) failed: {:?}\nstdout:\n{stdout}\nstderr:\n{}",
        ex.file,
        ex.line,
        ex.lang,
        if with_xdg { "set" } else { "unset" },
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs every `lang` example of the README and the book against a demo broker.
async fn readme_examples_work(with_xdg: bool, lang: &str) {
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
    wait_readyz(&socket, START_PATIENCE, &log_path).await;
    let all: Vec<Example> = examples().into_iter().filter(|e| e.lang == lang).collect();
    assert!(!all.is_empty(), "no {lang} example found");
    for ex in &all {
        let out = run_example(&home, with_xdg, ex).await;
        let at = format!("{} line {}", ex.file, ex.line);
        match ex.lang.as_str() {
            "sh" if ex.code.contains("/healthz") => {
                assert!(out.contains(r#""upstream":"ready""#), "{at}: {out}")
            }
            "sh" if ex.code.contains("/v1/rpc") => {
                assert!(!out.contains(r#""ok":false"#), "{at}: {out}");
                assert!(out.contains(r#""type":"res""#), "{at}: {out}");
            }
            "sh" if ex.code.contains("/metrics") => {
                assert!(out.contains("clawmux_upstream_phase"), "{at}: {out}")
            }
            "sh" if ex.code.contains("/v1/events") => {
                assert!(out.contains(r#""phase": "ready""#), "{at}: {out}");
                assert!(
                    out.contains("event: chat") || out.contains("event: agent"),
                    "{at}: no event streamed: {out}"
                );
            }
            "sh" if ex.code.contains("--run") => {
                let events = out
                    .lines()
                    .filter(|l| l.contains(" chat ") || l.contains(" agent "))
                    .count();
                assert!(events >= 1, "{at}: no event of the run: {out}");
            }
            "python" => assert!(
                out.contains("connect.challenge")
                    && out.contains("hello-ok")
                    && out.contains("res h1 ok=True"),
                "{at}: {out}"
            ),
            "node" => assert!(
                out.contains("hello-ok") && out.contains("health ok: true"),
                "{at}: {out}"
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
#[cfg_attr(
    not(all(has_tool = "curl", has_tool = "jq")),
    ignore = "needs curl and jq: `source .ci/doc-tools.sh` installs them (or apt-get install curl jq), then run the tests again"
)]
async fn readme_shell_examples_work_with_xdg_runtime_dir() {
    readme_examples_work(true, "sh").await;
}

#[tokio::test]
#[cfg_attr(
    not(all(has_tool = "curl", has_tool = "jq")),
    ignore = "needs curl and jq: `source .ci/doc-tools.sh` installs them (or apt-get install curl jq), then run the tests again"
)]
async fn readme_shell_examples_work_without_xdg_runtime_dir() {
    readme_examples_work(false, "sh").await;
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "python_websockets"),
    ignore = "needs python3 with websockets: `source .ci/doc-tools.sh` makes a venv with it and puts it on PATH, then run the tests again"
)]
async fn readme_python_examples_work_with_xdg_runtime_dir() {
    readme_examples_work(true, "python").await;
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "python_websockets"),
    ignore = "needs python3 with websockets: `source .ci/doc-tools.sh` makes a venv with it and puts it on PATH, then run the tests again"
)]
async fn readme_python_examples_work_without_xdg_runtime_dir() {
    readme_examples_work(false, "python").await;
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "node_ws"),
    ignore = "needs node with ws: `source .ci/doc-tools.sh` installs it and sets NODE_PATH, then run the tests again"
)]
async fn readme_node_examples_work_with_xdg_runtime_dir() {
    readme_examples_work(true, "node").await;
}

#[tokio::test]
#[cfg_attr(
    not(has_tool = "node_ws"),
    ignore = "needs node with ws: `source .ci/doc-tools.sh` installs it and sets NODE_PATH, then run the tests again"
)]
async fn readme_node_examples_work_without_xdg_runtime_dir() {
    readme_examples_work(false, "node").await;
}
