//! What the commands say when something is off, run as a user would: the
//! binary in a private home (`isolated_command`), a demo broker as a child
//! process where one is needed.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use crate::support::*;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");
/// A demo broker must be ready within this (a cold start under load).
const START_PATIENCE: Duration = Duration::from_secs(20);

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `clawmux ARGS` in `home` to its end (bounded), off the runtime.
async fn run(home: &Path, args: &[&str], tweak: impl FnOnce(&mut std::process::Command)) -> Output {
    let mut cmd = isolated_command(BIN, home);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    tweak(&mut cmd);
    let child = cmd.spawn().expect("clawmux runs");
    let pid = child.id();
    let waited = tokio::time::timeout(
        START_PATIENCE,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    match waited {
        Ok(out) => out.unwrap().unwrap(),
        Err(_) => {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
            panic!("clawmux {args:?} did not finish");
        }
    }
}

/// `clawmux serve --demo` in `home`, ready (its socket answers `/readyz`);
/// stderr goes to `home/demo.log`.
async fn demo(home: &Path, extra: &[&str]) -> (ChildGuard, PathBuf) {
    let log = home.join("demo.log");
    let mut cmd = isolated_command(BIN, home);
    cmd.args(["serve", "--demo"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let child = ChildGuard(cmd.spawn().expect("the demo starts"));
    let socket = home.join("run/clawmux.sock");
    wait_readyz(&socket, START_PATIENCE, &log).await;
    (child, socket)
}

/// A typo in config.toml: one rule for every command that reads it. Exit
/// 2, the file, the key, the line, the nearest real key and the valid ones,
/// what to do; nothing is served, nothing printed on stdout (`doctor` still
/// prints its report).
#[tokio::test]
async fn a_config_typo_stops_every_command_with_exit_2_and_a_suggestion() {
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join("config/clawmux/config.toml");
    std::fs::create_dir_all(cfg.parent().unwrap()).unwrap();
    std::fs::write(&cfg, "gatway_url = \"ws://127.0.0.1:1\"\n").unwrap();
    for args in [
        &["serve"][..],
        &["serve", "--demo"],
        &["status"],
        &["call", "health"],
        &["tail"],
        &["socket-path"],
        &["doctor"],
    ] {
        let out = run(home.path(), args, |_| {}).await;
        let (stdout, err) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 2, "{args:?}: {err}");
        assert!(
            lines[0].starts_with(&format!("clawmux: cannot load settings from {}: unknown key `gatway_url` at line 1 column 1 (did you mean `[gateway] url`? valid keys here: socket,", cfg.display()))
                && lines[0].ends_with("; fix or remove the file"),
            "{args:?}: {err}"
        );
        assert!(
            lines[1].starts_with("(studio.settings_load_failed; nothing was done"),
            "{args:?}: {err}"
        );
        if args[0] == "doctor" {
            assert!(stdout.contains("settings: FAILED"), "{stdout}");
        } else {
            assert!(stdout.is_empty(), "{args:?}: {stdout}");
        }
        assert!(!home.path().join("run/clawmux.sock").exists());
    }
}

/// `--replay` belongs to `--demo`: without it, a usage error (exit 2)
/// before anything starts.
#[tokio::test]
async fn serve_replay_without_demo_is_a_usage_error() {
    let home = tempfile::tempdir().unwrap();
    let out = run(home.path(), &["serve", "--replay", "nowhere.jsonl"], |_| {}).await;
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--replay needs --demo"), "{err}");
    assert!(!home.path().join("run/clawmux.sock").exists());
}

/// A second `serve` on a busy socket names the running broker's pid; a
/// second `serve --demo` fails before starting its gateway double. A
/// `doctor` meanwhile knows the demo (no `gateway_token_missing`). And the
/// demo's clean Ctrl-C logs no WARN.
#[tokio::test]
async fn a_busy_socket_names_the_pid_and_doctor_knows_the_demo() {
    let home = tempfile::tempdir().unwrap();
    let (mut first, socket) = demo(home.path(), &[]).await;
    let pid = first.0.id();

    let out = run(home.path(), &["serve"], |_| {}).await;
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("another clawmux is already serving"), "{err}");
    assert!(err.contains(&format!("(pid {pid})")), "{err}");
    assert!(err.contains(&format!("kill {pid}")), "{err}");

    let out = run(home.path(), &["serve", "--demo", "--log", "debug"], |_| {}).await;
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("(pid {pid})")), "{err}");
    assert!(
        !err.contains("gateway double started"),
        "the double must not start: {err}"
    );

    let out = run(home.path(), &["doctor"], |_| {}).await;
    let (report, err) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{report}{err}");
    assert!(!report.contains("gateway_token_missing"), "{report}");
    assert!(report.contains("serve --demo"), "{report}");
    assert!(report.contains(&format!("pid {pid}")), "{report}");
    let out = run(home.path(), &["doctor", "--json"], |_| {}).await;
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["ok"], true, "{doc}");
    assert_eq!(doc["gateway"]["demo"]["pid"], pid, "{doc}");

    signal(&first.0, rustix::process::Signal::INT);
    let status = wait_exit(&mut first.0).await;
    assert!(status.success(), "{status:?}");
    let log = std::fs::read_to_string(home.path().join("demo.log")).unwrap();
    assert!(
        !log.contains(" WARN "),
        "a clean Ctrl-C logs no warning:\n{log}"
    );
    assert!(!socket.exists());
}

/// `status` in a shell without XDG_RUNTIME_DIR, while the broker runs with
/// it: the message names the place tried, why, and where a broker listens.
#[tokio::test]
async fn status_without_xdg_runtime_dir_says_where_the_broker_is() {
    let home = tempfile::tempdir().unwrap();
    let (_demo, socket) = demo(home.path(), &[]).await;
    let tmp = home.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let out = run(home.path(), &["status"], |cmd| {
        cmd.env_remove("XDG_RUNTIME_DIR").env("TMPDIR", &tmp);
    })
    .await;
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    let tried = tmp.join(format!(
        "clawmux-{}/clawmux.sock",
        rustix::process::getuid().as_raw()
    ));
    assert!(
        err.contains(&format!(
            "at {} (the default without XDG_RUNTIME_DIR, which is not set here)",
            tried.display()
        )),
        "{err}"
    );
    assert!(err.lines().count() <= 3, "{err}");
    assert!(
        err.contains(&format!("listening at {}", socket.display())),
        "{err}"
    );
    assert!(
        err.contains(&format!("--socket {}", socket.display())),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "export XDG_RUNTIME_DIR={}",
            socket.parent().unwrap().display()
        )),
        "{err}"
    );
}

/// `call helth` names the nearest methods the gateway announced; `--scopes`
/// acts with fewer scopes (the broker refuses what they do not cover).
#[tokio::test]
async fn call_suggests_methods_and_acts_with_fewer_scopes() {
    let home = tempfile::tempdir().unwrap();
    let (_demo, _socket) = demo(home.path(), &[]).await;
    let out = run(home.path(), &["call", "helth"], |_| {}).await;
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("unknown method: helth"), "{err}");
    assert!(err.contains("did you mean health"), "{err}");

    let out = run(home.path(), &["call", "--scopes", "read", "status"], |_| {}).await;
    let (payload, err) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(payload.trim_start().starts_with('{'), "{payload}");
    let out = run(
        home.path(),
        &["call", "--scopes", "operator.read", "logs.tail"],
        |_| {},
    )
    .await;
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("missing scope: operator.admin"), "{err}");
    // With the session's full scopes the broker lets it through.
    let out = run(home.path(), &["call", "logs.tail"], |_| {}).await;
    assert!(!text(&out).1.contains("missing scope"), "{}", text(&out).1);
}

/// `clawmux man` prints roff when piped.
#[tokio::test]
async fn man_is_roff_in_a_pipe() {
    let home = tempfile::tempdir().unwrap();
    let out = run(home.path(), &["man"], |_| {}).await;
    let (roff, _) = text(&out);
    assert!(
        roff.starts_with(".ie") || roff.contains("\n.TH clawmux"),
        "{roff}"
    );
}

/// `clawmux man` on a terminal shows the formatted page (through `man -l`).
#[tokio::test]
#[cfg_attr(
    not(all(has_tool = "man", has_tool = "script")),
    ignore = "needs man and script: `source .ci/doc-tools.sh` installs them (or apt-get install man-db bsdutils), then run the tests again"
)]
async fn man_is_formatted_on_a_terminal() {
    let home = tempfile::tempdir().unwrap();
    // `script` gives the command a pseudo-terminal as its stdout.
    let mut cmd = isolated_command("script", home.path());
    cmd.args(["-qec", &format!("{BIN} man"), "/dev/null"])
        .env("MANPAGER", "cat")
        .env("PAGER", "cat")
        .env("MANWIDTH", "80")
        .env("TERM", "dumb")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let (shown, err) = text(&out);
    assert!(out.status.success(), "{shown}{err}");
    assert!(!shown.contains(".TH"), "formatted, not roff: {shown}");
    assert!(shown.contains("General Commands Manual"), "{shown}");
}

/// Every man page has EXIT STATUS and ENVIRONMENT; clawmux-top(1) lists
/// its keys.
#[tokio::test]
async fn man_pages_have_exit_status_environment_and_tops_keys() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("man");
    let out = run(
        home.path(),
        &["man", "--dir", dir.to_str().unwrap()],
        |_| {},
    )
    .await;
    assert!(out.status.success(), "{}", text(&out).1);
    let mut pages = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let roff = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(roff.contains(".SH \"EXIT STATUS\""), "{name}");
        assert!(
            roff.contains(".SH \"ENVIRONMENT\"\n.TP\nCLAWMUX_SOCKET"),
            "{name}"
        );
        assert!(
            roff.contains(".SH OPTIONS") || name == "clawmux-completions.1",
            "{name}: {roff}"
        );
        pages += 1;
    }
    assert!(pages >= 10, "{pages} pages");
    let top = std::fs::read_to_string(dir.join("clawmux-top.1")).unwrap();
    for key in ["q, Esc, Ctrl\\-C", "p, Space", "Enter", "\ns\n"] {
        assert!(top.contains(key), "{key:?} in {top}");
    }
    let status = std::fs::read_to_string(dir.join("clawmux-status.1")).unwrap();
    assert!(
        status.contains("No broker answers on the socket"),
        "{status}"
    );
    let serve = std::fs::read_to_string(dir.join("clawmux-serve.1")).unwrap();
    assert!(serve.contains("Forced stop"), "{serve}");
}
