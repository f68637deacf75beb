//! The message follower under the WebSocket parser (`clawmux::boundary`):
//! what it hands the parser and what it holds back must be exactly the
//! bytes it read, in order, however they arrive and wherever a handover
//! pauses it; a paused follower at a boundary reads nothing more.
//!
//! Input: a mode byte (bit 0: after an HTTP response head, bit 1: split
//! large frames, bit 2: hand fragments over 64 bytes over in pieces), the
//! read size (1-256), the pause point (a count of bytes read, 0 = never),
//! then the stream. In pieces, what is handed is not the bytes read (their
//! sameness as messages is `boundary`'s property test): then only that
//! nothing panics, every read ends, and a pause still holds.
#![no_main]

use std::task::{Context, Poll};

use clawmux::boundary::Follower;
use libfuzzer_sys::fuzz_target;
use tokio::io::ReadBuf;

fuzz_target!(|data: &[u8]| {
    let [mode, size, pause_at, stream @ ..] = data else {
        return;
    };
    let size = usize::from(*size).max(1);
    let pause_at = usize::from(*pause_at) * 4;
    let mut follower = if mode & 1 == 1 {
        Follower::after_http_response(mode & 2 == 2)
    } else {
        Follower::new(Vec::new(), mode & 2 == 2)
    };
    let pieces = mode & 4 == 4;
    if pieces {
        follower.fragments_in_pieces(64, u64::MAX);
    }
    let pause = follower.pause();
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut fed = 0;
    let mut handed = Vec::new();
    let mut buf = vec![0u8; 4096];
    // Bounded: each round hands at least one byte (or a piece's header),
    // reads one chunk, or stops.
    for _ in 0..stream.len() * 4 + 16 {
        if pause_at > 0 && fed >= pause_at {
            pause.request();
        }
        let mut rb = ReadBuf::new(&mut buf);
        let polled = follower.poll_read(&mut cx, &mut rb, |_, out| {
            let n = size.min(stream.len() - fed).min(out.remaining());
            out.put_slice(&stream[fed..fed + n]);
            fed += n;
            Poll::Ready(Ok(()))
        });
        match polled {
            Poll::Ready(Ok(())) => {
                let got = rb.filled();
                if got.is_empty() {
                    // End of the stream (nothing left to read or hold).
                    assert_eq!(fed, stream.len());
                    break;
                }
                handed.extend_from_slice(got);
            }
            Poll::Ready(Err(e)) => panic!("no read fails here: {e}"),
            // In pieces, the start of a header waits for its end (the
            // follower asks to be polled again).
            Poll::Pending if pieces && !pause.at_boundary() => continue,
            Poll::Pending => {
                assert!(pause.at_boundary(), "pending only when paused at a boundary");
                break;
            }
        }
    }
    handed.extend(follower.take_unread());
    if !pieces {
        assert_eq!(handed, stream[..fed], "handed and held back are what was read");
    }
});
