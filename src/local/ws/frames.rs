//! Server-to-client WebSocket frames (RFC 6455 §5.2) laid out for one
//! vectored write per batch, with no socket in sight.
//!
//! A frame the broker sends is unmasked: one byte FIN + opcode, the payload
//! length in 7 bits, or 126 and 16 bits, or 127 and 64 bits, then the
//! payload. An event's payload is its shared prefix (everything before the
//! `seq` value), this client's `seq` digits and its shared suffix; so the
//! only bytes written per client are a header and a number ([`Frames`]
//! keeps them, for a whole batch, in one scratch buffer) and everything
//! else is a slice of what the hub encoded once.

use std::io::IoSlice;

/// The opcode of a text frame.
pub const OP_TEXT: u8 = 0x1;
/// The opcode of a close frame.
pub const OP_CLOSE: u8 = 0x8;

/// The longest frame header the broker writes (no mask): 1 + 1 + 8 bytes.
pub const MAX_HEADER_BYTES: usize = 10;

/// A suffix at most this long is copied beside the client's `seq` digits
/// (one slice fewer per frame) rather than pointed at.
const COPY_SUFFIX_BYTES: usize = 16;

/// The most slices handed to one vectored write (Linux takes at most
/// `IOV_MAX`, 1,024; a batch needs several writes beyond this).
pub const MAX_SLICES: usize = 512;

/// A final, unmasked frame header for a payload of `len` bytes.
pub fn header(opcode: u8, len: usize) -> ([u8; MAX_HEADER_BYTES], usize) {
    let (head, n) = crate::boundary::frame_header(0x80 | opcode, len as u64, None);
    let mut h = [0u8; MAX_HEADER_BYTES];
    h.copy_from_slice(&head[..MAX_HEADER_BYTES]);
    (h, n)
}

/// What a queued item puts on the wire, borrowed from the item.
pub enum Payload<'a> {
    /// A text frame whose payload is these bytes (valid UTF-8).
    Text(&'a [u8]),
    /// A text frame: `prefix`, the decimal digits of `seq`, `suffix`.
    Event {
        prefix: &'a [u8],
        seq: u64,
        suffix: &'a [u8],
    },
}

/// An item that can be framed: the batch holds it until its bytes are written.
pub trait Framed {
    fn payload(&self) -> Payload<'_>;
}

/// One run of bytes in the batch's output.
#[derive(Debug, Clone, Copy)]
enum Chunk {
    /// `scratch[start..end]`: headers, digits, small suffixes.
    Scratch { start: usize, end: usize },
    /// The text of item `i`, or its event prefix.
    Head(usize),
    /// Item `i`'s event suffix.
    Tail(usize),
}

/// A batch of frames being written: the items, the per-client bytes in
/// one scratch buffer, and how far the socket has taken them.
pub struct Frames<T> {
    items: Vec<T>,
    scratch: Vec<u8>,
    chunks: Vec<Chunk>,
    /// For each frame, the offset in the output just past its last byte.
    frame_ends: Vec<usize>,
    /// Bytes of output so far, and bytes the socket has taken.
    total: usize,
    done: usize,
    /// The first chunk not wholly written, and how much of it is.
    at: usize,
    offset: usize,
}

impl<T> Default for Frames<T> {
    fn default() -> Self {
        Frames {
            items: Vec::new(),
            scratch: Vec::new(),
            chunks: Vec::new(),
            frame_ends: Vec::new(),
            total: 0,
            done: 0,
            at: 0,
            offset: 0,
        }
    }
}

impl<T: Framed> Frames<T> {
    /// Adds a frame for `item` at the end of the batch.
    pub fn push(&mut self, item: T) {
        let i = self.items.len();
        match item.payload() {
            Payload::Text(text) => {
                self.put_header(OP_TEXT, text.len());
                self.chunks.push(Chunk::Head(i));
                self.total += text.len();
            }
            Payload::Event {
                prefix,
                seq,
                suffix,
            } => {
                let mut digits = itoa::Buffer::new();
                let digits = digits.format(seq).as_bytes();
                self.put_header(OP_TEXT, prefix.len() + digits.len() + suffix.len());
                self.chunks.push(Chunk::Head(i));
                self.total += prefix.len();
                self.put_scratch(digits);
                if suffix.len() <= COPY_SUFFIX_BYTES {
                    self.put_scratch(suffix);
                } else {
                    self.chunks.push(Chunk::Tail(i));
                    self.total += suffix.len();
                }
            }
        }
        self.frame_ends.push(self.total);
        self.items.push(item);
    }

    /// Adds a close frame (code and a reason already cut to fit 123 bytes).
    pub fn push_close(&mut self, code: u16, reason: &str) {
        let reason = &reason.as_bytes()[..reason.len().min(123)];
        self.put_header(OP_CLOSE, 2 + reason.len());
        self.put_scratch(&code.to_be_bytes());
        self.put_scratch(reason);
        self.frame_ends.push(self.total);
    }

    fn put_header(&mut self, opcode: u8, len: usize) {
        let (h, n) = header(opcode, len);
        self.put_scratch(&h[..n]);
    }

    /// Appends bytes to the scratch buffer, extending the last chunk when
    /// it is the scratch run just before them and not yet written.
    fn put_scratch(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let start = self.scratch.len();
        self.scratch.extend_from_slice(bytes);
        let end = self.scratch.len();
        self.total += bytes.len();
        // A run the socket has wholly taken is not extended.
        let open = self.chunks.len() > self.at;
        match self.chunks.last_mut() {
            Some(Chunk::Scratch { end: last, .. }) if open && *last == start => *last = end,
            _ => self.chunks.push(Chunk::Scratch { start, end }),
        }
    }

    fn chunk_bytes(&self, chunk: Chunk) -> &[u8] {
        match chunk {
            Chunk::Scratch { start, end } => &self.scratch[start..end],
            Chunk::Head(i) => match self.items[i].payload() {
                Payload::Text(text) => text,
                Payload::Event { prefix, .. } => prefix,
            },
            Chunk::Tail(i) => match self.items[i].payload() {
                Payload::Text(_) => &[],
                Payload::Event { suffix, .. } => suffix,
            },
        }
    }

    /// The items framed in this batch.
    pub fn items(&self) -> &[T] {
        &self.items
    }

    /// Whether every byte of the batch has been taken by the socket.
    pub fn is_empty(&self) -> bool {
        self.at >= self.chunks.len()
    }

    /// The unwritten bytes, in order, as at most `out.len()` slices; the
    /// number of slices filled.
    pub fn slices<'a>(&'a self, out: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (k, chunk) in self.chunks[self.at.min(self.chunks.len())..]
            .iter()
            .enumerate()
        {
            if n == out.len() {
                break;
            }
            let bytes = self.chunk_bytes(*chunk);
            let bytes = if k == 0 { &bytes[self.offset..] } else { bytes };
            if !bytes.is_empty() {
                out[n] = IoSlice::new(bytes);
                n += 1;
            }
        }
        n
    }

    /// Copies the unwritten bytes into `out` (for a socket without
    /// vectored writes), at most `max`; the bytes copied.
    pub fn copy_into(&self, out: &mut Vec<u8>, max: usize) -> usize {
        let before = out.len();
        for (k, chunk) in self.chunks[self.at.min(self.chunks.len())..]
            .iter()
            .enumerate()
        {
            let room = max - (out.len() - before);
            if room == 0 {
                break;
            }
            let bytes = self.chunk_bytes(*chunk);
            let bytes = if k == 0 { &bytes[self.offset..] } else { bytes };
            out.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
        out.len() - before
    }

    /// The socket took `n` more bytes.
    pub fn advance(&mut self, mut n: usize) {
        self.done += n;
        while n > 0 && self.at < self.chunks.len() {
            let left = self.chunk_bytes(self.chunks[self.at]).len() - self.offset;
            if n < left {
                self.offset += n;
                return;
            }
            n -= left;
            self.at += 1;
            self.offset = 0;
        }
        // Chunks of no bytes are passed over too.
        while self.at < self.chunks.len() && self.chunk_bytes(self.chunks[self.at]).is_empty() {
            self.at += 1;
        }
    }

    /// Whether the bytes written so far end exactly where a frame ends (or
    /// nothing is written): another frame may follow on the socket now.
    pub fn at_frame_boundary(&self) -> bool {
        self.done == 0
            || self.done >= self.total
            || self.frame_ends.binary_search(&self.done).is_ok()
    }

    /// Drops the frames not yet begun: what is left to write is the rest
    /// of the frame in progress, if any (the socket may then take another
    /// frame after it). The items stay held until the batch is dropped.
    pub fn cut_after_current(&mut self) {
        // The first frame end at or past what is written.
        let cut = match self.frame_ends.binary_search(&self.done) {
            Ok(k) | Err(k) => self.frame_ends.get(k).copied().unwrap_or(self.total),
        };
        let mut start = 0;
        let mut keep = self.chunks.len();
        for (k, chunk) in self.chunks.iter_mut().enumerate() {
            if start >= cut {
                keep = k;
                break;
            }
            let len = match *chunk {
                Chunk::Scratch { start, end } => end - start,
                Chunk::Head(i) => match self.items[i].payload() {
                    Payload::Text(text) => text.len(),
                    Payload::Event { prefix, .. } => prefix.len(),
                },
                Chunk::Tail(i) => match self.items[i].payload() {
                    Payload::Text(_) => 0,
                    Payload::Event { suffix, .. } => suffix.len(),
                },
            };
            if start + len > cut {
                // Frames end inside a scratch run only (headers and digits
                // of neighbouring frames share one).
                if let Chunk::Scratch { start: s, end } = chunk {
                    *end = *s + (cut - start);
                }
                keep = k + 1;
                break;
            }
            start += len;
        }
        self.chunks.truncate(keep);
        if self.at >= keep {
            // Everything kept is written (empty chunks past it went).
            self.at = keep;
            self.offset = 0;
        }
        self.total = cut;
        self.frame_ends.retain(|&e| e <= cut);
    }

    /// The unwritten bytes, for a socket that moves to another writer: the
    /// rest of the frame in progress, then `between` (frames of another
    /// writer that wait for a frame boundary), then the frames not begun.
    /// The batch is emptied.
    pub fn take_unwritten(&mut self, between: &[u8]) -> Vec<u8> {
        let current = if self.at_frame_boundary() {
            0
        } else {
            let end = match self.frame_ends.binary_search(&self.done) {
                Ok(k) | Err(k) => self.frame_ends.get(k).copied().unwrap_or(self.total),
            };
            end - self.done
        };
        let mut rest = Vec::with_capacity(self.total - self.done);
        self.copy_into(&mut rest, usize::MAX);
        let mut out = Vec::with_capacity(rest.len() + between.len());
        out.extend_from_slice(&rest[..current]);
        out.extend_from_slice(between);
        out.extend_from_slice(&rest[current..]);
        self.clear(0);
        out
    }

    /// Empties the batch (its items are dropped), keeping the buffers'
    /// capacity unless they grew past `keep_bytes` of scratch.
    pub fn clear(&mut self, keep_bytes: usize) {
        self.items.clear();
        self.chunks.clear();
        self.frame_ends.clear();
        self.scratch.clear();
        self.total = 0;
        self.done = 0;
        self.at = 0;
        self.offset = 0;
        if self.scratch.capacity() > keep_bytes {
            self.scratch = Vec::new();
            self.chunks = Vec::new();
            self.frame_ends = Vec::new();
            self.items = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio_tungstenite::tungstenite::protocol::{Role, WebSocket};
    use tokio_tungstenite::tungstenite::Message;

    #[derive(Debug, Clone)]
    enum Item {
        Text(Vec<u8>),
        Event(Vec<u8>, u64, Vec<u8>),
    }

    impl Framed for Item {
        fn payload(&self) -> Payload<'_> {
            match self {
                Item::Text(t) => Payload::Text(t),
                Item::Event(p, seq, s) => Payload::Event {
                    prefix: p,
                    seq: *seq,
                    suffix: s,
                },
            }
        }
    }

    impl Item {
        fn expected(&self) -> String {
            match self {
                Item::Text(t) => String::from_utf8(t.clone()).unwrap(),
                Item::Event(p, seq, s) => format!(
                    "{}{seq}{}",
                    std::str::from_utf8(p).unwrap(),
                    std::str::from_utf8(s).unwrap()
                ),
            }
        }
    }

    /// Writes the batch as a socket would take it, `chunk` bytes a write
    /// at most, through `slices` (or `copy_into` when `vectored` is false).
    fn write_out(
        frames: &mut Frames<Item>,
        mut chunk: impl FnMut() -> usize,
        vectored: bool,
    ) -> Vec<u8> {
        let mut wire = Vec::new();
        while !frames.is_empty() {
            let limit = chunk().max(1);
            let mut got = Vec::new();
            if vectored {
                let mut slices = [IoSlice::new(&[]); 8];
                let n = frames.slices(&mut slices);
                assert!(n > 0, "unwritten bytes give a slice");
                for s in &slices[..n] {
                    got.extend_from_slice(s);
                }
                got.truncate(limit);
            } else {
                frames.copy_into(&mut got, limit);
            }
            wire.extend_from_slice(&got);
            frames.advance(got.len());
        }
        wire
    }

    /// What tungstenite's client-side reader makes of the bytes.
    fn read_all(wire: Vec<u8>) -> Vec<Message> {
        let mut ws = WebSocket::from_raw_socket(std::io::Cursor::new(wire), Role::Client, None);
        let mut out = Vec::new();
        loop {
            match ws.read() {
                Ok(m) => out.push(m),
                Err(tokio_tungstenite::tungstenite::Error::Io(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof
                        || e.kind() == std::io::ErrorKind::WouldBlock =>
                {
                    return out
                }
                Err(tokio_tungstenite::tungstenite::Error::ConnectionClosed) => return out,
                Err(tokio_tungstenite::tungstenite::Error::Protocol(p)) => {
                    // The stream ended after a close frame was answered.
                    assert!(matches!(
                        p,
                        tokio_tungstenite::tungstenite::error::ProtocolError::ResetWithoutClosingHandshake
                    ), "{p}");
                    return out;
                }
                Err(e) => panic!("tungstenite refused the frames: {e}"),
            }
        }
    }

    #[test]
    fn headers_use_the_shortest_length_form() {
        assert_eq!(header(OP_TEXT, 0).1, 2);
        assert_eq!(&header(OP_TEXT, 125).0[..2], &[0x81, 125]);
        assert_eq!(&header(OP_TEXT, 126).0[..4], &[0x81, 126, 0, 126]);
        assert_eq!(&header(OP_TEXT, 65_535).0[..4], &[0x81, 126, 0xff, 0xff]);
        let (h, n) = header(OP_TEXT, 65_536);
        assert_eq!(&h[..n], &[0x81, 127, 0, 0, 0, 0, 0, 1, 0, 0]);
    }

    #[test]
    fn a_batch_reads_back_as_its_messages_then_a_close() {
        let mut frames = Frames::default();
        let items = vec![
            Item::Event(
                br#"{"type":"event","event":"tick","seq":"#.to_vec(),
                7,
                b"}".to_vec(),
            ),
            Item::Text(br#"{"type":"res","id":"1","ok":true}"#.to_vec()),
            Item::Event(vec![b'x'; 70_000], u64::MAX, vec![b'y'; 300]),
        ];
        for item in items.clone() {
            frames.push(item);
        }
        frames.push_close(1008, "slow consumer");
        let messages = read_all(write_out(&mut frames, || 3, true));
        assert_eq!(messages.len(), 4);
        for (m, item) in messages.iter().zip(&items) {
            assert_eq!(m, &Message::text(item.expected()));
        }
        let Message::Close(Some(close)) = &messages[3] else {
            panic!("a close frame: {:?}", messages[3]);
        };
        assert_eq!(u16::from(close.code), 1008);
        assert_eq!(close.reason.as_str(), "slow consumer");
    }

    /// Cut mid-frame, a batch keeps the rest of that frame only: the
    /// socket then holds whole frames, and a close after them reads back.
    #[test]
    fn a_cut_batch_ends_on_a_frame_boundary() {
        let mut frames = Frames::default();
        for seq in 1..=3 {
            frames.push(Item::Event(b"{\"a\":".to_vec(), seq, b"}".to_vec()));
        }
        frames.advance(3);
        assert!(!frames.at_frame_boundary());
        frames.cut_after_current();
        let mut wire = write_out(&mut frames, || 100, true);
        // What the socket had taken before the cut.
        let mut whole = vec![0x81, 7];
        whole.extend_from_slice(b"{\"a\":1}");
        assert_eq!(wire.len() + 3, whole.len());
        let mut closing = Frames::<Item>::default();
        closing.push_close(1008, "slow consumer");
        wire.extend(write_out(&mut closing, || 100, true));
        let mut all = whole[..3].to_vec();
        all.extend(wire);
        let messages = read_all(all);
        assert_eq!(messages[0], Message::text("{\"a\":1}"));
        assert!(matches!(messages[1], Message::Close(_)));
        assert_eq!(messages.len(), 2);
    }

    fn text() -> impl Strategy<Value = String> {
        proptest::string::string_regex("[ -~é\u{1F600}]{0,200}").unwrap()
    }

    fn item() -> impl Strategy<Value = Item> {
        prop_oneof![
            text().prop_map(|t| Item::Text(t.into_bytes())),
            (text(), any::<u64>(), text(), 0usize..70_000).prop_map(|(p, seq, s, pad)| {
                // Some prefixes long enough for the 16- and 64-bit lengths.
                let mut p = p.into_bytes();
                p.resize(p.len() + pad % 3 * (pad / 3), b'p');
                Item::Event(p, seq, s.into_bytes())
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Any batch, written in any pieces, vectored or copied, is read by
        /// tungstenite as exactly its messages, in order.
        #[test]
        fn any_batch_in_any_pieces_reads_back(
            items in proptest::collection::vec(item(), 0..40),
            pieces in proptest::collection::vec(1usize..5_000, 1..50),
            vectored in any::<bool>(),
        ) {
            let mut frames = Frames::default();
            for item in items.clone() {
                frames.push(item);
            }
            let mut k = 0;
            let wire = write_out(&mut frames, || { k += 1; pieces[k % pieces.len()] }, vectored);
            let messages = read_all(wire);
            let expected: Vec<Message> = items.iter().map(|i| Message::text(i.expected())).collect();
            prop_assert_eq!(messages, expected);
        }

        /// Cut after any number of bytes written, then closed, a batch
        /// reads back as the frames begun before the cut, then the close.
        #[test]
        fn a_batch_cut_anywhere_then_closed_reads_back(
            items in proptest::collection::vec(item(), 1..20),
            written in 0usize..200_000,
        ) {
            let mut frames = Frames::default();
            for item in items.clone() {
                frames.push(item);
            }
            let mut wire = Vec::new();
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let n = frames.slices(&mut slices);
            for s in &slices[..n] {
                wire.extend_from_slice(s);
            }
            let whole = wire.len();
            wire.truncate(written.min(whole));
            frames.advance(wire.len());
            frames.cut_after_current();
            frames.push_close(1008, "slow consumer");
            wire.extend(write_out(&mut frames, || 1000, true));
            let messages = read_all(wire);
            let (close, texts) = messages.split_last().unwrap();
            prop_assert!(matches!(close, Message::Close(Some(_))), "{:?}", close);
            let expected: Vec<Message> =
                items.iter().take(texts.len()).map(|i| Message::text(i.expected())).collect();
            prop_assert_eq!(texts, &expected[..]);
        }

        /// Stopped after any number of bytes written, a batch's unwritten
        /// bytes (with another writer's frame between, as a pong waiting
        /// for a boundary) continue the stream exactly: every message reads
        /// back once, in order, and the other frame after the frame that
        /// was in progress.
        #[test]
        fn a_batch_stopped_anywhere_continues_from_its_unwritten_bytes(
            items in proptest::collection::vec(item(), 1..20),
            written in 0usize..200_000,
        ) {
            let mut frames = Frames::default();
            for item in items.clone() {
                frames.push(item);
            }
            let mut wire = Vec::new();
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let n = frames.slices(&mut slices);
            for s in &slices[..n] {
                wire.extend_from_slice(s);
            }
            wire.truncate(written.min(wire.len()));
            frames.advance(wire.len());
            // Frames begun (whole or in part) before the stop: those that
            // start before the bytes written end.
            let mut start = 0;
            let mut begun = 0;
            for item in &items {
                let mut one = Frames::default();
                one.push(item.clone());
                if start < wire.len() {
                    begun += 1;
                }
                start += one.total;
            }
            let pong = [0x8a, 0x01, b'p'];
            wire.extend(frames.take_unwritten(&pong));
            prop_assert!(frames.is_empty());
            let messages = read_all(wire);
            let mut expected: Vec<Message> =
                items.iter().map(|i| Message::text(i.expected())).collect();
            expected.insert(begun, Message::Pong(b"p".to_vec().into()));
            prop_assert_eq!(messages, expected);
        }
    }
}
