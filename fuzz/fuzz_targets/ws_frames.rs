//! The `/ws` frame writer (`clawmux::fuzz_api::WsFrames`) as a property:
//! whatever events (a shared prefix, a `seq`, a shared suffix) and texts a
//! batch holds, however the socket takes its bytes (any piece sizes,
//! vectored or copied), and wherever it is cut and closed, tungstenite's
//! client-side reader reads exactly the frames begun before the cut, in
//! order, then the close frame.
#![no_main]

use std::io::IoSlice;

use clawmux::fuzz_api::{WsFramed, WsFrames, WsPayload};
use libfuzzer_sys::fuzz_target;
use tungstenite::protocol::{Role, WebSocket};
use tungstenite::Message;

enum Item {
    Text(String),
    Event(String, u64, String),
}

impl WsFramed for Item {
    fn payload(&self) -> WsPayload<'_> {
        match self {
            Item::Text(t) => WsPayload::Text(t.as_bytes()),
            Item::Event(p, seq, s) => WsPayload::Event {
                prefix: p.as_bytes(),
                seq: *seq,
                suffix: s.as_bytes(),
            },
        }
    }
}

impl Item {
    fn text(&self) -> String {
        match self {
            Item::Text(t) => t.clone(),
            Item::Event(p, seq, s) => format!("{p}{seq}{s}"),
        }
    }
}

/// Reads the input as items, then the socket's piece sizes; `.1` is how
/// many strings may still be made long enough for a 64-bit length (one
/// per input keeps an execution small).
struct Input<'a>(&'a [u8], usize);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn string(&mut self) -> Option<String> {
        let len = usize::from(self.byte()?).min(self.0.len());
        let (s, rest) = self.0.split_at(len);
        self.0 = rest;
        let mut s = String::from_utf8_lossy(s).into_owned();
        // Long enough, now and then, for the 16- and 64-bit length forms.
        let repeat = usize::from(self.byte()? >> 4);
        if repeat > 12 && !s.is_empty() && self.1 > 0 {
            self.1 -= 1;
            s = s.repeat(70_000 / s.len() + 1);
        } else if repeat > 8 && !s.is_empty() {
            s = s.repeat(200 / s.len() + 1);
        }
        Some(s)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data, 1);
    let Some(flags) = input.byte() else { return };
    let mut items = Vec::new();
    while items.len() < 32 {
        match input.byte() {
            Some(0) | None => break,
            Some(tag) if tag & 1 == 0 => match input.string() {
                Some(t) => items.push(Item::Text(t)),
                None => break,
            },
            Some(tag) => {
                let (Some(p), Some(s)) = (input.string(), input.string()) else {
                    break;
                };
                let seq = u64::from(tag).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (tag % 64);
                items.push(Item::Event(p, seq, s));
            }
        }
    }
    let pieces: Vec<usize> = input.0.iter().map(|&b| usize::from(b) * 97 + 1).collect();
    let vectored = flags & 1 == 1;
    // Where the socket stops taking bytes before the cut (none: no cut).
    let cut_at = (flags & 2 == 2).then(|| usize::from(flags >> 2) * 4099);

    let expected: Vec<String> = items.iter().map(Item::text).collect();
    let mut frames = WsFrames::default();
    for item in items {
        frames.push(item);
    }
    let mut wire = Vec::new();
    let mut k = 0;
    let take = |frames: &mut WsFrames<Item>, wire: &mut Vec<u8>, limit: usize| {
        let mut got = Vec::new();
        if vectored {
            let mut slices = [IoSlice::new(&[]); 16];
            let n = frames.slices(&mut slices);
            assert!(n > 0 || frames.is_empty());
            for s in &slices[..n] {
                got.extend_from_slice(s);
            }
            got.truncate(limit);
        } else {
            frames.copy_into(&mut got, limit);
        }
        frames.advance(got.len());
        wire.extend_from_slice(&got);
        got.len()
    };
    let mut next_piece = || {
        k += 1;
        pieces.get(k % pieces.len().max(1)).copied().unwrap_or(4096)
    };
    if let Some(cut_at) = cut_at {
        while wire.len() < cut_at && !frames.is_empty() {
            let limit = next_piece().min(cut_at - wire.len());
            take(&mut frames, &mut wire, limit);
        }
        frames.cut_after_current();
        frames.push_close(1008, "slow consumer");
    }
    while !frames.is_empty() {
        let limit = next_piece();
        assert!(take(&mut frames, &mut wire, limit) > 0, "no progress");
    }

    let mut ws = WebSocket::from_raw_socket(std::io::Cursor::new(wire), Role::Client, None);
    let mut read = Vec::new();
    let mut closed = false;
    loop {
        match ws.read() {
            Ok(Message::Text(t)) => {
                assert!(!closed, "a frame after the close");
                read.push(t.as_str().to_owned());
            }
            Ok(Message::Close(Some(c))) => {
                assert_eq!(u16::from(c.code), 1008);
                closed = true;
            }
            Ok(other) => panic!("unexpected {other:?}"),
            Err(tungstenite::Error::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break
            }
            Err(tungstenite::Error::ConnectionClosed) => break,
            Err(tungstenite::Error::Protocol(
                tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
            )) => break,
            Err(e) => panic!("tungstenite refused the frames: {e}"),
        }
    }
    assert_eq!(closed, cut_at.is_some(), "the close frame");
    if cut_at.is_some() {
        assert!(read.len() <= expected.len());
        assert_eq!(
            read,
            expected[..read.len()],
            "the frames begun before the cut"
        );
    } else {
        assert_eq!(read, expected, "every frame, in order");
    }
});
