//! The local socket: permissions, stale and live sockets, peer uid (design §8).

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use crate::support::*;

#[tokio::test]
async fn socket_is_0600_in_a_new_0700_dir_and_removed_on_shutdown() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    settings.socket_path = dir.path().join("nested/run/clawmux.sock");
    let broker = RunningBroker::start(settings.clone()).await.unwrap();
    let meta = std::fs::metadata(&settings.socket_path).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);
    let dmeta = std::fs::metadata(settings.socket_path.parent().unwrap()).unwrap();
    assert_eq!(dmeta.mode() & 0o777, 0o700);
    broker.shutdown(std::time::Duration::from_secs(2)).await;
    assert!(!settings.socket_path.exists());
}

#[tokio::test]
async fn a_second_broker_on_a_live_socket_refuses_to_start() {
    let h = start().await;
    let mut settings = test_settings(h.dir.path(), &h.gw.url(), Some("test-token"));
    settings.socket_path = h.socket();
    let err = RunningBroker::start(settings)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("another clawmux"), "{err}");
    assert!(
        err.contains(&h.socket().display().to_string()),
        "names the path: {err}"
    );
    // The first broker is untouched.
    h.connected().await;
}

#[tokio::test]
async fn a_stale_socket_file_is_replaced() {
    let gw = MockGateway::start(mock_config()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let settings = test_settings(dir.path(), &gw.url(), Some("test-token"));
    // A crashed broker leaves its socket file behind with nobody listening.
    drop(std::os::unix::net::UnixListener::bind(&settings.socket_path).unwrap());
    assert!(settings.socket_path.exists());
    let broker = RunningBroker::start(settings)
        .await
        .expect("stale socket replaced");
    let mut c = WsClient::open(broker.socket_path(), "/ws").await;
    c.handshake().await;
}

#[tokio::test]
async fn a_regular_file_at_the_path_is_never_deleted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let settings = test_settings(dir.path(), "ws://127.0.0.1:9", Some("t"));
    std::fs::write(&settings.socket_path, b"precious").unwrap();
    let err = RunningBroker::start(settings.clone())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&settings.socket_path).unwrap(), b"precious");
}

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

/// Why the tests that act as another uid (chown, setuid) are `#[ignore]`d
/// in the plain test command: they need root. Ignored, they show as
/// `ignored` in the summary instead of passing without testing; `.ci/run`
/// (as root) runs them.
const NEEDS_ROOT: &str = "needs root to act as another uid";

/// Fails clearly when an ignored root-only test is run without root.
fn require_root() {
    assert_eq!(
        rustix::process::getuid().as_raw(),
        0,
        "{NEEDS_ROOT}: run as root"
    );
}

/// Another user is refused before any byte is read, even if the file mode
/// would let them in. Needs root (to act as another uid) and curl.
#[tokio::test]
#[ignore = "needs root to act as another uid: cargo test --test it -- --ignored socket:: (.ci/run does, as root)"]
async fn another_uid_is_refused_by_peer_credentials() {
    use std::os::unix::process::CommandExt;
    require_root();
    assert!(
        std::path::Path::new("/usr/bin/curl").exists(),
        "this test needs /usr/bin/curl (to connect as another uid)"
    );
    // The broker runs as its own process here, as in production, with a
    // private HOME and XDG dirs.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("c.sock");
    let _broker = ChildGuard(
        isolated_command(BIN, &dir.path().join("home"))
            .arg("serve")
            .arg("--socket")
            .arg(&sock)
            .args(["--gateway-url", "ws://127.0.0.1:9", "--token", "t"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("socket exists", || sock.exists()).await;
    // Open the door on purpose: the peer-uid check must still hold.
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let socket = sock.clone();
    let curl = move |uid: Option<u32>| {
        let mut cmd = std::process::Command::new("/usr/bin/curl");
        cmd.args(["-sS", "-m", "5", "--unix-socket"])
            .arg(&socket)
            .arg("http://localhost/healthz");
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        cmd.output().expect("curl runs")
    };
    // Some sandboxes refuse the cross-uid connect itself now and then
    // (curl exit 7); what matters is that no attempt gets an answer and at
    // least one gets far enough to be cut off by the broker (52 empty reply,
    // 56 connection reset).
    let (mine, theirs) = tokio::task::spawn_blocking(move || {
        let mine = curl(None);
        // Until one attempt is cut off by the broker (bounded: 20 tries).
        let mut theirs = Vec::new();
        for _ in 0..20 {
            let out = curl(Some(65534));
            let cut_off = matches!(out.status.code(), Some(52) | Some(56));
            theirs.push(out);
            if cut_off {
                break;
            }
        }
        (mine, theirs)
    })
    .await
    .unwrap();
    assert!(mine.status.success(), "owner gets an answer");
    assert!(
        String::from_utf8_lossy(&mine.stdout).contains("\"upstream\":"),
        "the owner gets /healthz"
    );
    for out in &theirs {
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "another uid got an answer: {out:?}"
        );
    }
    // If the sandbox refused every cross-uid connect itself (curl exit 7,
    // seen once in ~40 runs under a CPU hog), the broker's own check could
    // not be reached this time: say so rather than fail or pass silently.
    if theirs.iter().all(|o| o.status.code() == Some(7)) {
        eprintln!("SKIPPED the broker-side part of another_uid_is_refused_by_peer_credentials: the sandbox refused all {} cross-uid connects before the broker saw them", theirs.len());
        return;
    }
    assert!(
        theirs
            .iter()
            .any(|o| matches!(o.status.code(), Some(52) | Some(56))),
        "another uid was never cut off after connecting: {theirs:?}"
    );
}

/// The CLI checks whose socket it is talking to before it sends anything:
/// a socket file owned by another user is refused with a clear error (exit
/// 3), whatever answers there. Needs root to chown the socket.
#[tokio::test]
#[ignore = "needs root to act as another uid: cargo test --test it -- --ignored socket:: (.ci/run does, as root)"]
async fn the_cli_refuses_a_socket_owned_by_another_user() {
    require_root();
    let h = start().await;
    // `status` exits 0 only once the upstream session is ready.
    let _ready = h.connected().await;
    let socket = h.socket();
    let home = h.dir.path().join("home");
    let status = |socket: std::path::PathBuf, home: std::path::PathBuf| async move {
        let mut cmd = isolated_command(BIN, &home);
        cmd.arg("status").arg("--socket").arg(&socket);
        tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap()
    };
    std::os::unix::fs::chown(&socket, Some(65534), Some(65534)).unwrap();
    let out = status(socket.clone(), home.clone()).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("refusing to talk to"), "{err}");
    assert!(err.contains("uid 65534"), "{err}");
    assert!(out.stdout.is_empty());
    // Given back to us, the same socket is trusted.
    std::os::unix::fs::chown(&socket, Some(0), Some(0)).unwrap();
    let out = status(socket, home).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
