//! `clawmux install-service` and the unit files it writes: idempotence,
//! refusal to overwrite changed files, and `systemd-analyze verify` /
//! `security --offline` on the installed units (skipped with a note when
//! systemd-analyze is absent; `.ci/systemd-tools.sh` installs it in CI).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// A private runtime dir that looks like a running user manager's: its
/// private socket at `systemd/private` (nothing listens; only its presence
/// is checked, so no real user manager is involved).
fn runtime_with_user_manager() -> tempfile::TempDir {
    let runtime = tempfile::tempdir().unwrap();
    std::fs::create_dir(runtime.path().join("systemd")).unwrap();
    drop(std::os::unix::net::UnixListener::bind(runtime.path().join("systemd/private")).unwrap());
    runtime
}

/// `clawmux install-service ARGS` with its config home in `config` and,
/// where a user manager is wanted, a runtime dir that has one.
fn install_service(config: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let runtime = runtime_with_user_manager();
    install_service_in(config, Some(runtime.path()), args)
}

fn install_service_in(
    config: &Path,
    runtime: Option<&Path>,
    args: &[&str],
) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.arg("install-service")
        .args(args)
        .env("HOME", config)
        .env("XDG_CONFIG_HOME", config);
    match runtime {
        Some(dir) => cmd.env("XDG_RUNTIME_DIR", dir),
        None => cmd.env_remove("XDG_RUNTIME_DIR"),
    };
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn install_service_writes_units_idempotently_and_keeps_changed_files() {
    let config = tempfile::tempdir().unwrap();
    let units = config.path().join("systemd/user");
    let service = units.join("clawmux.service");
    let socket = units.join("clawmux.socket");

    let (code, out, err) = install_service(config.path(), &["--dry-run"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("clawmux.service: would be written"), "{out}");
    assert!(out.contains(&format!("ExecStart={BIN} serve")), "{out}");
    assert!(!units.exists(), "a dry run writes nothing");

    let (code, out, err) = install_service(config.path(), &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        std::fs::read_to_string(&socket).unwrap(),
        include_str!("../../systemd/clawmux.socket")
    );
    let written = std::fs::read_to_string(&service).unwrap();
    assert!(
        written.contains(&format!("\nExecStart={BIN} serve ")),
        "{written}"
    );
    assert!(written.contains("\nType=notify\n"));
    assert!(out.contains("systemctl --user daemon-reload"), "{out}");
    assert!(
        out.contains("systemctl --user enable --now clawmux.socket"),
        "{out}"
    );
    assert!(out.contains("does not exist yet"), "token hint: {out}");

    let token = config.path().join("clawmux/gateway-token");
    std::fs::create_dir_all(token.parent().unwrap()).unwrap();
    std::fs::write(&token, "t").unwrap();
    let (code, out, _) = install_service(config.path(), &[]);
    assert_eq!(code, Some(0));
    assert_eq!(out.matches(": unchanged").count(), 2, "idempotent: {out}");
    assert!(!out.contains("does not exist yet"), "{out}");

    std::fs::write(&service, format!("{written}# my change\n")).unwrap();
    let (code, _, err) = install_service(config.path(), &[]);
    assert_eq!(code, Some(1), "a changed unit is not overwritten");
    assert!(
        err.contains("clawmux.service") && err.contains("--force"),
        "{err}"
    );
    assert!(std::fs::read_to_string(&service)
        .unwrap()
        .ends_with("# my change\n"));

    let (code, out, _) = install_service(config.path(), &["--dry-run", "--force"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("clawmux.service: would be replaced"), "{out}");
    assert!(std::fs::read_to_string(&service)
        .unwrap()
        .ends_with("# my change\n"));

    let (code, out, _) = install_service(config.path(), &["--force"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("clawmux.service: replaced"), "{out}");
    assert_eq!(std::fs::read_to_string(&service).unwrap(), written);
}

/// Without a user manager (no runtime dir, or one without its sockets)
/// install-service writes nothing, says why and what to do, and exits 1;
/// `--dry-run` still shows the plan with the note; `--force` writes anyway.
#[test]
fn install_service_without_a_user_manager_says_what_to_do() {
    let config = tempfile::tempdir().unwrap();
    let units = config.path().join("systemd/user");
    let empty_runtime = tempfile::tempdir().unwrap();
    for runtime in [None, Some(empty_runtime.path())] {
        let (code, out, err) = install_service_in(config.path(), runtime, &[]);
        assert_eq!(code, Some(1), "{out}{err}");
        assert!(err.contains("no systemd user manager"), "{err}");
        assert!(err.contains("loginctl enable-linger $USER"), "{err}");
        assert!(err.contains("clawmux serve"), "{err}");
        assert!(err.contains("Nothing was written"), "{err}");
        if runtime.is_none() {
            assert!(err.contains("XDG_RUNTIME_DIR is not set"), "{err}");
        } else {
            assert!(err.contains("systemd/private"), "{err}");
        }
        assert!(!units.exists(), "nothing written");
    }
    let (code, out, err) = install_service_in(config.path(), None, &["--dry-run"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("would be written"), "{out}");
    assert!(out.contains("no systemd user manager"), "{out}");
    assert!(!units.exists(), "a dry run writes nothing");
    let (code, out, err) = install_service_in(config.path(), None, &["--force"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(units.join("clawmux.service").exists(), "{out}");
    assert!(out.contains("loginctl enable-linger"), "{out}");
}

/// `systemd-analyze` on the units as installed (with this binary in
/// ExecStart), run with a private runtime dir.
fn systemd_analyze(args: &[&str]) -> std::process::Output {
    let tool =
        which("systemd-analyze").expect("systemd-analyze is installed (bash .ci/systemd-tools.sh)");
    let runtime = tempfile::tempdir().unwrap();
    Command::new(tool)
        .args(args)
        .env("XDG_RUNTIME_DIR", runtime.path())
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .unwrap()
}

#[test]
#[ignore = "needs systemd-analyze: bash .ci/systemd-tools.sh, then cargo test --test it -- --ignored install_service:: (.ci/run does)"]
fn installed_units_pass_systemd_analyze_verify_and_security() {
    let config = tempfile::tempdir().unwrap();
    let (code, _, err) = install_service(config.path(), &[]);
    assert_eq!(code, Some(0), "{err}");
    let units = config.path().join("systemd/user");
    let service = units.join("clawmux.service");
    let socket = units.join("clawmux.socket");
    let (service, socket) = (service.to_str().unwrap(), socket.to_str().unwrap());

    let verify = systemd_analyze(&["verify", "--user", service, socket]);
    let stderr = String::from_utf8_lossy(&verify.stderr);
    assert!(verify.status.success(), "systemd-analyze verify: {stderr}");
    assert!(
        !stderr.contains("Unknown"),
        "no unknown directives: {stderr}"
    );

    let security = systemd_analyze(&[
        "security",
        "--offline=true",
        "--user",
        "--no-pager",
        service,
    ]);
    let stdout = String::from_utf8_lossy(&security.stdout);
    let Some(score) = stdout
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for clawmux.service: "))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok())
    else {
        panic!(
            "this systemd-analyze cannot score units offline: {}",
            String::from_utf8_lossy(&security.stderr)
        );
    };
    eprintln!("clawmux.service exposure: {score}");
    assert!(score <= 2.5, "exposure {score} > 2.5:\n{stdout}");
}
