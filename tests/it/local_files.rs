//! Local files are read only if they are regular files, up to a cap (issue
//! 24, point 5): a config symlinked to `/dev/zero` or replaced by a FIFO
//! fails the SIGHUP reload at once with a clear log line and the old
//! settings keep serving; `--token-file /dev/zero` and an oversized token
//! file are refused at start.

use std::path::Path;
use std::process::Command;

use crate::support::*;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

fn clawmux(home: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("HOME", home)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("XDG_STATE_HOME", home.join("state"));
    cmd
}

fn log_has(log: &Path, needle: &str) -> bool {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .contains(needle)
}

#[tokio::test]
async fn sighup_with_a_device_or_a_fifo_as_config_keeps_the_old_settings() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join("clawmux.toml");
    std::fs::write(
        &cfg,
        format!(
            "[gateway]\nurl = \"{}\"\ntoken = \"test-token\"\n[upstream]\ndevice_identity = false\n",
            gw.url()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cfg, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let socket = home.path().join("c.sock");
    let log = home.path().join("broker.log");
    let mut broker = ChildGuard(
        clawmux(home.path())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--config")
            .arg(&cfg)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || socket.exists()).await;
    let mut c = WsClient::open(&socket, "/ws").await;
    c.handshake().await;

    // config.toml -> /dev/zero: refused at once (it used to grow memory
    // without bound and log nothing).
    std::fs::remove_file(&cfg).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &cfg).unwrap();
    signal(&broker.0, rustix::process::Signal::HUP);
    eventually("the /dev/zero reload failure is logged", || {
        log_has(&log, "settings reload failed") && log_has(&log, "a character device")
    })
    .await;
    assert_eq!(c.request("health", json!({})).await["ok"], true);

    // A FIFO nobody writes: refused at once (it used to block the reload).
    std::fs::remove_file(&cfg).unwrap();
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &cfg,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    signal(&broker.0, rustix::process::Signal::HUP);
    eventually("the FIFO reload failure is logged", || {
        log_has(&log, "a FIFO, not a regular file")
    })
    .await;
    assert_eq!(c.request("health", json!({})).await["ok"], true);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(cfg.to_str().unwrap()),
        "names the file: {text}"
    );
    sigterm(&broker.0);
    wait_exit(&mut broker.0).await;
}

#[tokio::test]
async fn token_files_that_are_devices_or_too_large_are_refused_at_start() {
    let home = tempfile::tempdir().unwrap();
    let big = home.path().join("token");
    std::fs::write(&big, vec![b'a'; 64 * 1024 + 1]).unwrap();
    std::fs::set_permissions(&big, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    for (file, want) in [
        (
            "/dev/zero",
            "a character device, not a regular file".to_owned(),
        ),
        (
            big.to_str().unwrap(),
            "larger than 64 KiB (the limit for this file)".to_owned(),
        ),
    ] {
        let mut cmd = clawmux(home.path());
        cmd.args([
            "serve",
            "--gateway-url",
            "ws://127.0.0.1:9",
            "--token-file",
            file,
            "--socket",
        ])
        .arg(home.path().join("c.sock"));
        let out = tokio::time::timeout(
            PATIENCE,
            tokio::task::spawn_blocking(move || cmd.output().unwrap()),
        )
        .await
        .expect("refused at once, not after reading without end")
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(&want), "{file}: {err}");
        assert!(err.contains(file), "names the file: {err}");
    }
}
