//! One socket's clients cannot take what another socket's need: handshake
//! and connection slots are shared out per socket, with a reserve for the
//! main (owner's) socket.

use clawmux::policy::{Grant, MethodFilter, SocketPolicy};
use tokio::io::AsyncReadExt;

use crate::support::*;

fn read_only_socket(path: &std::path::Path) -> SocketPolicy {
    SocketPolicy {
        name: "dashboard".into(),
        path: path.to_owned(),
        mode: 0o660,
        uids: Vec::new(),
        gids: Vec::new(),
        scopes: Some(Grant::new(["operator.read"])),
        methods: MethodFilter::default(),
        observe: false,
    }
}

/// A further socket's clients that upgrade and never send `connect` fill
/// that socket's share of the handshake slots (half of them: the other
/// half is the main socket's reserve), and no more: the next one there is
/// closed `1013`, while the owner's new clients on the main socket still
/// connect.
#[tokio::test]
async fn silent_upgrades_on_one_socket_leave_the_main_socket_its_handshakes() {
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro.sock");
    let h = start_with(mock_config(), |s| s.sockets = vec![read_only_socket(&ro)]).await;
    let _ready = h.connected().await;
    let mut silent = Vec::new();
    let mut refused = 0;
    for _ in 0..clawmux::context::MAX_HANDSHAKES + 2 {
        let mut c = WsClient::open(&ro, "/ws").await;
        match c.recv().await {
            Got::Json(v) => {
                assert_eq!(v["event"], "connect.challenge", "{v}");
                silent.push(c);
            }
            Got::Close(code, reason) => {
                assert_eq!(code, 1013, "{reason}");
                refused += 1;
            }
            Got::Eof => panic!("closed without a close frame"),
        }
    }
    let share =
        clawmux::context::MAX_HANDSHAKES * (100 - clawmux::slots::MAIN_RESERVE_PERCENT) / 100;
    assert_eq!(silent.len(), share, "the socket's share");
    assert_eq!(refused, clawmux::context::MAX_HANDSHAKES + 2 - share);
    for _ in 0..3 {
        let (_c, hello) = h.connected().await;
        assert_eq!(hello["type"], "hello-ok", "{hello}");
    }
}

/// Connections work the same way: a further socket holds at most its
/// share of `max_connections` (the next is answered `503`), and the main
/// socket's connections are still accepted.
#[tokio::test]
async fn one_socket_cannot_take_every_connection() {
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro.sock");
    let h = start_with(mock_config(), |s| {
        s.sockets = vec![read_only_socket(&ro)];
        s.limits.max_connections = Some(8);
    })
    .await;
    // Held open without a request: each holds a slot.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(tokio::net::UnixStream::connect(&ro).await.unwrap());
    }
    let mut over = tokio::net::UnixStream::connect(&ro).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, over.read_to_end(&mut answer))
        .await
        .expect("answered in time")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    // The main socket: the owner's clients connect.
    for _ in 0..3 {
        let (_c, hello) = h.connected().await;
        assert_eq!(hello["type"], "hello-ok", "{hello}");
    }
}
