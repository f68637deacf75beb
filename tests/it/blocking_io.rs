//! The broker's runtime never waits on a disk: the device-token file is
//! written (read, written, `fsync`ed) off the runtime threads, so a slow or
//! stuck disk delays only that write, never the clients.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::support::*;

/// How long the stand-in for a stuck disk holds the write when the test
/// does not release it first (then the test fails: it could not run).
const STUCK_DISK: Duration = Duration::from_secs(5);

/// One runtime thread, as in a small service: a blocking call on it
/// stops everything.
#[tokio::test(flavor = "current_thread")]
async fn a_stuck_device_token_write_does_not_stall_the_broker() {
    // The gateway holds its hello-ok a moment, so the token file can be
    // replaced by a FIFO after the broker looked for a stored token and
    // before it stores the one the gateway mints: reading the FIFO blocks
    // like a stuck disk until the test writes to it.
    let faults = Faults {
        hello_delay: Some(Duration::from_millis(500)),
        ..Faults::default()
    };
    let h = start_faulty(mock_config(), faults, |s| {
        s.upstream.handshake_timeout = Duration::from_secs(10);
    })
    .await;
    let state = h.dir.path().join("state");
    let tokens = state.join(clawmux::upstream::identity::TOKENS_FILE);
    eventually("the broker sent its connect", || {
        !h.gw.connects().is_empty()
    })
    .await;
    rustix::fs::mkfifoat(rustix::fs::CWD, &tokens, rustix::fs::Mode::from(0o600)).unwrap();

    // The "disk": waits for the broker to open the file, reports it, then
    // holds it until the test says so (or STUCK_DISK passes).
    let (opened_tx, opened_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let held_to_the_end = Arc::new(AtomicBool::new(false));
    let disk = {
        let held_to_the_end = Arc::clone(&held_to_the_end);
        std::thread::spawn(move || {
            let deadline = Instant::now() + PATIENCE;
            let mut fifo = loop {
                // Succeeds once the broker has the FIFO open for reading.
                match std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&tokens)
                {
                    Ok(f) => break f,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => panic!("the broker never opened the token file: {e}"),
                }
            };
            let _ = opened_tx.send(());
            if release_rx.recv_timeout(STUCK_DISK).is_err() {
                held_to_the_end.store(true, Ordering::SeqCst);
            }
            fifo.write_all(b"{}").unwrap();
        })
    };

    // While the write is stuck, the broker still answers.
    tokio::time::timeout(PATIENCE, opened_rx)
        .await
        .expect("the broker reads the token file in time")
        .expect("the disk thread reports");
    let (code, _) = http_get(&h.socket(), "/healthz").await;
    assert_eq!(code, 200);
    let _ = release_tx.send(());
    disk.join().unwrap();
    assert!(
        !held_to_the_end.load(Ordering::SeqCst),
        "the broker's runtime was blocked by the device-token write"
    );
    // And the token is stored once the disk answers.
    let (mut c, _) = h.connected().await;
    assert_eq!(c.request("health", serde_json::json!({})).await["ok"], true);
    eventually("the device token is stored", || {
        std::fs::metadata(state.join(clawmux::upstream::identity::TOKENS_FILE))
            .is_ok_and(|m| m.is_file())
    })
    .await;
}

/// A request never waits on the state directory: the device key is loaded
/// once, at start, and a narrower session opened by a request uses it. The
/// key file is replaced by a FIFO (opening it for reading blocks until a
/// writer comes, like a stuck disk) before a read-only client's first
/// request opens its narrower session: the request is answered all the same.
#[tokio::test]
async fn opening_a_narrower_session_does_not_read_the_state_dir() {
    let h = start().await;
    let (mut admin, _) = h.connected().await;
    assert_eq!(
        admin.request("health", serde_json::json!({})).await["ok"],
        true
    );
    let key = h
        .dir
        .path()
        .join("state")
        .join(clawmux::upstream::identity::KEY_FILE);
    std::fs::remove_file(&key).unwrap();
    rustix::fs::mkfifoat(rustix::fs::CWD, &key, rustix::fs::Mode::from(0o600)).unwrap();
    // Whatever happens, the FIFO is opened for writing once, later, so a
    // reader stuck on it (the defect) is released and the test can end.
    let release = {
        let key = key.clone();
        std::thread::spawn(move || {
            std::thread::sleep(PATIENCE * 2);
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&key);
        })
    };
    let (mut reader, _) = h.connected_as(&["operator.read"]).await;
    let res = tokio::time::timeout(PATIENCE, reader.request("status", serde_json::json!({})))
        .await
        .expect("a request that opens a narrower session is answered without touching the disk");
    assert_eq!(res["ok"], true, "{res}");
    drop(release);
}
