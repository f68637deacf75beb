//! Local files are read only if they are regular files, up to a cap: a
//! config symlinked to `/dev/zero` or replaced by a FIFO
//! fails the SIGHUP reload at once with a clear log line and the old
//! settings keep serving; `--token-file /dev/zero` and an oversized token
//! file are refused at start.

use std::path::Path;
use std::process::Command;

use crate::support::*;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

/// The binary in a private home.
fn clawmux(home: &Path) -> Command {
    isolated_command(BIN, home)
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
        let sock = home.path().join("c.sock");
        let (code, err) = run(
            home.path(),
            &[
                "serve",
                "--gateway-url",
                "ws://127.0.0.1:9",
                "--token-file",
                file,
                "--socket",
                sock.to_str().unwrap(),
            ],
        )
        .await;
        assert_ne!(code, Some(0), "{err}");
        assert!(err.contains(&want), "{file}: {err}");
        assert!(err.contains(file), "names the file: {err}");
    }
}

/// Runs the binary to completion in `home`: (exit code, stderr).
async fn run(home: &Path, args: &[&str]) -> (Option<i32>, String) {
    let (code, _, err) = run_clawmux_in(home, args, PATIENCE).await;
    (Some(code), err)
}

#[tokio::test]
async fn a_replay_speed_out_of_range_is_a_usage_error() {
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("r.jsonl");
    std::fs::write(
        &file,
        "{\"format\":\"clawmux-recording\",\"version\":1,\"hello\":{}}\n{\"ms\":1,\"dir\":\"in\",\"frame\":{\"type\":\"event\",\"event\":\"tick\",\"payload\":{}}}\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    for speed in ["1e-300", "0.0001", "1001", "NaN"] {
        let (code, err) = run(
            home.path(),
            &[
                "mock-gateway",
                "--port",
                "0",
                "--replay",
                f,
                "--speed",
                speed,
            ],
        )
        .await;
        assert_eq!(code, Some(2), "--speed {speed}: {err}");
        assert!(
            err.contains("--speed takes a number from 0.001 to 1000"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn record_out_onto_an_existing_readable_file_leaves_it_private() {
    use std::os::unix::fs::PermissionsExt;
    let h = start().await;
    crate::http_api::until_ready(&h.socket()).await;
    let home = tempfile::tempdir().unwrap();
    let out = home.path().join("session.jsonl");
    std::fs::write(&out, "old contents\n").unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut record = ChildGuard(
        clawmux(home.path())
            .arg("record")
            .arg("--socket")
            .arg(h.socket())
            .arg("--out")
            .arg(&out)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("the header is written", || {
        std::fs::read_to_string(&out).is_ok_and(|t| t.contains("clawmux-recording"))
    })
    .await;
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "mode {mode:o}");
    sigterm(&record.0);
    wait_exit(&mut record.0).await;
}

/// `record -o` never writes through a symbolic link: one to an existing
/// file leaves the file (its contents and mode) as it was, a dangling one
/// creates nothing; both are refused as a usage error .
#[tokio::test]
async fn record_out_onto_a_symbolic_link_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let h = start().await;
    crate::http_api::until_ready(&h.socket()).await;
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep me\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    let link = dir.path().join("session.jsonl");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let nowhere = dir.path().join("nowhere");
    let dangling = dir.path().join("dangling.jsonl");
    std::os::unix::fs::symlink(&nowhere, &dangling).unwrap();
    let socket = h.socket();
    for out in [&link, &dangling] {
        let (code, _, err) = run_clawmux(&[
            "record",
            "--socket",
            socket.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .await;
        assert_eq!(code, 2, "{out:?}: {err}");
        assert!(err.contains("symbolic link"), "{err}");
        assert!(std::fs::symlink_metadata(out).unwrap().is_symlink());
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me\n");
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "the target is not chmodded: {mode:o}");
    assert!(!nowhere.exists(), "a dangling link's target is not created");
}
