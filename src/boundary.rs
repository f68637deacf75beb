//! Following a WebSocket byte stream's frames under its parser (RFC 6455
//! §5.2), so that a reader can stop at a message boundary and its
//! connection can move to the broker's next instance with the bytes read
//! past that boundary (design §11, a handover). Local clients
//! (`local::preconnect::Limited`) and the gateway socket
//! (`upstream::movable`) both read through a [`Follower`].
//!
//! Only frame boundaries are tracked; the parser above checks everything
//! else. Hand-written: no crate follows frame boundaries beneath
//! tungstenite, which reads ahead into its own buffer.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::ReadBuf;

/// A frame whose payload is larger than this is "large": a [`Follower`]
/// built with `split_large` hands its header to the parser alone (see
/// `local::preconnect`: the parser's buffer for it then holds exactly the
/// payload and can be given back once the frame is handled).
pub const LARGE_FRAME_BYTES: u64 = 2 * 1024;

/// Stops a [`Follower`] at the next message boundary for a handover: what
/// the socket gave beyond it stays unread, the bytes the next instance
/// feeds its own parser first.
#[derive(Debug, Clone, Default)]
pub struct Pause(Arc<PauseState>);

#[derive(Debug, Default)]
struct PauseState {
    requested: AtomicBool,
    /// Hand the parser nothing more, boundary or not.
    stopped: AtomicBool,
    /// The parser has been handed whole messages only.
    at_boundary: AtomicBool,
    /// Stopped now, the reader could move with what it read
    /// ([`Follower::carries`]).
    carries: AtomicBool,
    /// Writes on this socket are taken whole ([`Pause::spool_writes`]).
    spool: AtomicBool,
}

impl Pause {
    pub fn request(&self) {
        self.0.requested.store(true, Ordering::SeqCst);
    }

    fn requested(&self) -> bool {
        self.0.requested.load(Ordering::SeqCst)
    }

    /// Hands the parser nothing more, even inside a message: the message
    /// in progress then moves as the bytes read of it so far
    /// ([`Follower::take_carried`]). Undone by [`Pause::resume_reads`].
    pub fn stop(&self) {
        self.0.stopped.store(true, Ordering::SeqCst);
    }

    /// Undoes [`Pause::stop`] (a requested pause still holds).
    pub fn resume_reads(&self) {
        self.0.stopped.store(false, Ordering::SeqCst);
    }

    fn stopped(&self) -> bool {
        self.0.stopped.load(Ordering::SeqCst)
    }

    /// Whether everything handed to the parser ends with a whole message.
    pub fn at_boundary(&self) -> bool {
        self.0.at_boundary.load(Ordering::SeqCst)
    }

    /// Whether the reader, stopped now, could move with the bytes it read
    /// ([`Follower::carries`]: at a boundary, or inside a message it keeps
    /// a copy of).
    pub fn carries(&self) -> bool {
        self.0.carries.load(Ordering::SeqCst)
    }

    /// From now on every write on the socket this reader reads is taken
    /// whole: what the socket does not take at once is held, in order, and
    /// a flush writes what it can without waiting ([`WriteSpool`]). A
    /// connection that is moving uses it, so that its writer never holds
    /// half a frame and never waits for its peer to read: the held bytes
    /// move with it. Whoever turns it on must wake the writer (a write
    /// waiting on a full socket is polled again, and then taken).
    pub fn spool_writes(&self) {
        self.0.spool.store(true, Ordering::SeqCst);
    }

    /// Whether [`Pause::spool_writes`] was called.
    pub fn spooling(&self) -> bool {
        self.0.spool.load(Ordering::SeqCst)
    }

    /// Once requested: what `stream` (the parser reading through this
    /// pause's [`Follower`]) gives next (`Some(None)`: it ended), or `None`
    /// once it has stopped at the boundary with no whole message left to
    /// return. (A split stream also says "pending" while its other half is
    /// in use: read it so only while nothing else can take that half.)
    pub async fn next_before_boundary<S: futures_util::Stream + Unpin>(
        &self,
        stream: &mut S,
    ) -> Option<Option<S::Item>> {
        use futures_util::StreamExt;
        std::future::poll_fn(|cx| match stream.poll_next_unpin(cx) {
            Poll::Ready(m) => Poll::Ready(Some(m)),
            Poll::Pending if self.at_boundary() => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        })
        .await
    }
}

/// Where the bytes handed to the parser are in the peer's frames.
#[derive(Debug, Default)]
pub(crate) enum FrameCursor {
    /// Reading a header: its bytes so far.
    #[default]
    Header0,
    Header {
        bytes: [u8; 14],
        len: usize,
    },
    /// Reading a payload: bytes left.
    Payload(u64),
}

/// What one step of [`FrameCursor::advance_one`] did.
pub(crate) struct Advanced {
    pub taken: usize,
    /// A large frame's header ended here: hand it over alone.
    pub stop: bool,
    /// A data frame's header ended in this step.
    pub data: Option<DataHead>,
}

/// A data frame's header, as [`FrameCursor::advance_one`] read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DataHead {
    pub payload: u64,
    /// It begins a message (it is not a continuation).
    pub begins: bool,
    /// Its first byte: FIN, the reserved bits, the opcode.
    pub first: u8,
    /// The header's length in bytes.
    pub len: usize,
    pub mask: Option<[u8; 4]>,
}

impl FrameCursor {
    /// Follows `bytes` about to be handed to the parser up to the end of
    /// the current frame (or of a large frame's header). `in_message`
    /// follows data messages across frames: set by a data frame without
    /// FIN, cleared by one with FIN (control frames, which may come between
    /// fragments, leave it).
    /// A frame with a payload over `split_above` ends the step at the end
    /// of its header.
    pub(crate) fn advance_one(
        &mut self,
        bytes: &[u8],
        in_message: &mut bool,
        split_above: u64,
    ) -> Advanced {
        let mut i = 0;
        let mut data = None;
        while i < bytes.len() {
            match self {
                FrameCursor::Payload(left) => {
                    let take = (*left).min((bytes.len() - i) as u64);
                    i += take as usize;
                    *left -= take;
                    if *left == 0 {
                        *self = FrameCursor::Header0;
                        return Advanced {
                            taken: i,
                            stop: false,
                            data,
                        };
                    }
                }
                FrameCursor::Header0 => {
                    *self = FrameCursor::Header {
                        bytes: [0; 14],
                        len: 0,
                    };
                }
                FrameCursor::Header { bytes: head, len } => {
                    head[*len] = bytes[i];
                    *len += 1;
                    i += 1;
                    let Some(payload) = header_payload_len(&head[..*len]) else {
                        continue;
                    };
                    let (fin, control) = (head[0] & 0x80 != 0, head[0] & 0x08 != 0);
                    if !control {
                        let mask = (head[1] & 0x80 != 0).then(|| {
                            let at = *len - 4;
                            [head[at], head[at + 1], head[at + 2], head[at + 3]]
                        });
                        data = Some(DataHead {
                            payload,
                            begins: !*in_message,
                            first: head[0],
                            len: *len,
                            mask,
                        });
                        *in_message = !fin;
                    }
                    *self = if payload == 0 {
                        FrameCursor::Header0
                    } else {
                        FrameCursor::Payload(payload)
                    };
                    let stop = payload > split_above && i < bytes.len();
                    if payload == 0 || stop {
                        return Advanced {
                            taken: i,
                            stop,
                            data,
                        };
                    }
                }
            }
        }
        Advanced {
            taken: bytes.len(),
            stop: false,
            data,
        }
    }
}

/// The payload length once `head` is a whole frame header (masked or not),
/// else `None`.
pub(crate) fn header_payload_len(head: &[u8]) -> Option<u64> {
    if head.len() < 2 {
        return None;
    }
    let mask = if head[1] & 0x80 != 0 { 4 } else { 0 };
    let (ext, payload) = match head[1] & 0x7f {
        126 => (2, None),
        127 => (8, None),
        n => (0, Some(u64::from(n))),
    };
    if head.len() < 2 + ext + mask {
        return None;
    }
    Some(payload.unwrap_or_else(|| {
        head[2..2 + ext]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    }))
}

/// A frame header (RFC 6455 §5.2): `first` (FIN, reserved bits, opcode),
/// the shortest length form for `len`, and the masking key if any; and
/// its length in bytes. The one encoder of frame headers: the `/ws`
/// writer's, a fragment's pieces and the gateway connection's own frames.
pub fn frame_header(first: u8, len: u64, mask: Option<[u8; 4]>) -> ([u8; 14], usize) {
    let mut head = [0u8; 14];
    head[0] = first;
    let masked = if mask.is_some() { 0x80 } else { 0 };
    let mut n = if len < 126 {
        head[1] = masked | len as u8;
        2
    } else if let Ok(short) = u16::try_from(len) {
        head[1] = masked | 126;
        head[2..4].copy_from_slice(&short.to_be_bytes());
        4
    } else {
        head[1] = masked | 127;
        head[2..10].copy_from_slice(&len.to_be_bytes());
        10
    };
    if let Some(key) = mask {
        head[n..n + 4].copy_from_slice(&key);
        n += 4;
    }
    (head, n)
}

/// Follows what a reader hands its WebSocket parser: frame by frame, and
/// when paused ([`Pause`]), nothing past the end of the current message.
#[derive(Debug)]
pub struct Follower {
    frames: FrameCursor,
    /// A data message has begun and its final frame has not ended yet.
    in_message: bool,
    pause: Pause,
    /// Bytes read from the socket and not handed to the parser yet: after a
    /// large frame's header (at most one read), at a pause, or the unread
    /// bytes a previous instance passed on.
    held_back: Vec<u8>,
    /// Hand a large frame's header to the parser alone.
    split_large: bool,
    /// Payload bytes of the data message handed over last (or in
    /// progress), counted from its first frame's header: what the parser
    /// will hold for it.
    message_bytes: u64,
    /// Before the frames, an HTTP response's head is handed over (the
    /// client side's upgrade, `101 Switching Protocols`): its last bytes
    /// so far, until its blank line ends it (`None`).
    http_head: Option<[u8; 3]>,
    /// The bytes handed to the parser since the last message boundary, so
    /// that a message half read can move ([`Follower::carrying`]).
    partial: Partial,
    /// Fragments with a payload in this range are handed over in pieces
    /// ([`Follower::fragments_in_pieces`]).
    in_pieces: Option<std::ops::RangeInclusive<u64>>,
    /// The fragment being handed over in pieces.
    pieces: Option<Pieces>,
}

/// A fragment with more payload than this is handed to the parser in
/// pieces of this size at most (see [`Follower::fragments_in_pieces`]):
/// the size of a local client's idle read buffer, which a piece then
/// never outgrows. (At most 65,535: a piece's length takes two bytes.)
pub const PIECE_BYTES: u64 = LARGE_FRAME_BYTES;

/// A fragment being handed to the parser as frames of at most
/// [`PIECE_BYTES`] (RFC 6455 §5.4: an intermediary may change how a
/// message is fragmented when no extension is in use). Each piece is
/// masked with the fragment's key turned by the piece's offset in the
/// payload, so the payload bytes pass as they came, never unmasked here.
#[derive(Debug)]
struct Pieces {
    /// Bytes of the fragment's own header still at the front of
    /// `held_back` (it is never handed over).
    skip: usize,
    /// Payload bytes of the fragment not handed over yet.
    frame_left: u64,
    /// Payload bytes of the piece in progress not handed over yet.
    piece_left: u64,
    /// Payload bytes handed over so far.
    offset: u64,
    /// The fragment's first header byte: FIN, reserved bits (none), opcode.
    first: u8,
    mask: Option<[u8; 4]>,
}

impl Pieces {
    /// The next piece's header (and its length in bytes); the piece is then
    /// in progress.
    fn next_header(&mut self) -> ([u8; 14], usize) {
        let len = self.frame_left.min(PIECE_BYTES);
        let (first_piece, last_piece) = (self.offset == 0, len == self.frame_left);
        // The first piece has the fragment's opcode, the others continue it;
        // the last has its FIN.
        let first = if first_piece { self.first & 0x0f } else { 0 }
            | if last_piece { self.first & 0x80 } else { 0 };
        let turn = (self.offset % 4) as usize;
        let mask = self
            .mask
            .map(|key| std::array::from_fn(|j| key[(turn + j) % 4]));
        self.piece_left = len;
        frame_header(first, len, mask)
    }
}

/// A copy of the message in progress, as handed to the parser, kept up
/// to `limit` bytes (no copy at all with a limit of 0). Reads that end on
/// a message boundary, as a peer's whole messages usually do, copy nothing.
#[derive(Debug, Default)]
struct Partial {
    limit: usize,
    bytes: Vec<u8>,
    /// The message in progress outgrew `limit`: it cannot be carried.
    overflowed: bool,
}

/// A partial copy's buffer larger than this is not kept after its message ends.
const KEEP_PARTIAL_BYTES: usize = 4096;

impl Partial {
    /// `handed` went to the parser; the last message boundary in it, if
    /// any, was `boundary` bytes in.
    fn keep(&mut self, handed: &[u8], boundary: Option<usize>) {
        if self.limit == 0 {
            return;
        }
        let rest = match boundary {
            Some(b) => {
                self.bytes.clear();
                if self.bytes.capacity() > KEEP_PARTIAL_BYTES {
                    self.bytes = Vec::new();
                }
                self.overflowed = false;
                &handed[b..]
            }
            None => handed,
        };
        if self.overflowed || rest.is_empty() {
            return;
        }
        if self.bytes.len() + rest.len() > self.limit {
            self.overflowed = true;
            self.bytes = Vec::new();
        } else {
            self.bytes.extend_from_slice(rest);
        }
    }
}

impl Follower {
    /// A follower whose first bytes are `unread`: read from the socket by
    /// the previous instance and not handed to its parser (they start at a
    /// message boundary, so the frames are followed from there).
    pub fn new(unread: Vec<u8>, split_large: bool) -> Self {
        let pause = Pause::default();
        // Nothing handed to the parser yet: a boundary.
        pause.0.at_boundary.store(true, Ordering::SeqCst);
        pause.0.carries.store(true, Ordering::SeqCst);
        Follower {
            frames: FrameCursor::default(),
            in_message: false,
            pause,
            held_back: unread,
            split_large,
            message_bytes: 0,
            http_head: None,
            partial: Partial::default(),
            in_pieces: None,
            pieces: None,
        }
    }

    /// Hands a fragment (a data frame of a message sent in several) whose
    /// payload is larger than `above` and at most `up_to` to the parser in
    /// pieces of at most [`PIECE_BYTES`]. tungstenite reserves a frame's
    /// whole payload in its read buffer, copies it into the message it
    /// collects and keeps that buffer: a fragment whole is held twice while
    /// collected, and its size stays afterwards. In pieces the message it
    /// collects (which the budgets count) is the only copy. A larger
    /// fragment is handed whole, for the parser to refuse at its header.
    /// `above` should be at least the copy kept for carrying: a message
    /// handed in pieces is never carried half read (it is read to its end).
    pub fn fragments_in_pieces(&mut self, above: u64, up_to: u64) {
        self.in_pieces = Some(above.saturating_add(1)..=up_to);
    }

    /// Keeps a copy of the message in progress, up to `limit` bytes, so
    /// that a reader stopped inside it ([`Pause::stop`]) can move with what
    /// it read of it ([`Follower::take_carried`]).
    pub fn carrying(mut self, limit: usize) -> Self {
        self.partial.limit = limit;
        self
    }

    /// After [`Pause::stop`], once the parser has returned every whole
    /// message it was handed: the bytes the next instance's parser is
    /// given first (the message in progress from its first byte, then
    /// the bytes read and not handed over). `None` when the message in
    /// progress cannot be carried (larger than the copy kept of it, or
    /// inside the upgrade response): the reader must then stop at its end.
    pub fn take_carried(&mut self) -> Option<Vec<u8>> {
        if !self.carries() {
            return None;
        }
        if self.at_message_boundary() {
            return Some(self.take_unread());
        }
        let mut carried = std::mem::take(&mut self.partial.bytes);
        carried.append(&mut self.held_back);
        Some(carried)
    }

    /// Whether [`Follower::take_carried`] would give the bytes to move
    /// with now (at a boundary, or inside a message it holds a copy of).
    pub fn carries(&self) -> bool {
        self.http_head.is_none()
            && (self.at_message_boundary() || (self.partial.limit > 0 && !self.partial.overflowed))
    }

    /// A follower for a socket that first reads the HTTP response to its
    /// WebSocket upgrade: the response's head is handed over up to its end
    /// and no further in one read (so the parser's handshake keeps no
    /// frame bytes of its own), and the frames are followed from there.
    pub fn after_http_response(split_large: bool) -> Self {
        let follower = Follower {
            http_head: Some([0; 3]),
            ..Follower::new(Vec::new(), split_large)
        };
        // Not a boundary to move at until the frames begin.
        follower.pause.0.at_boundary.store(false, Ordering::SeqCst);
        follower.pause.0.carries.store(false, Ordering::SeqCst);
        follower
    }

    /// The handle that pauses this reader at a message boundary.
    pub fn pause(&self) -> Pause {
        self.pause.clone()
    }

    /// Whether writes on this reader's socket are taken whole
    /// ([`Pause::spool_writes`]).
    pub fn spooling(&self) -> bool {
        self.pause.spooling()
    }

    /// After a pause: the bytes read from the socket and not handed to the
    /// parser (the start of the peer's next message, if any).
    pub fn take_unread(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held_back)
    }

    /// Payload bytes of the data message in progress or handed over last,
    /// from its first frame's header on.
    pub fn message_bytes(&self) -> u64 {
        self.message_bytes
    }

    /// Whether the bytes handed over end at a message boundary.
    pub fn between_messages(&self) -> bool {
        self.at_message_boundary()
    }

    /// (Inside an HTTP response's head there is none: a pause then waits
    /// for the first message to end.)
    fn at_message_boundary(&self) -> bool {
        self.http_head.is_none() && matches!(self.frames, FrameCursor::Header0) && !self.in_message
    }

    /// How many of `bytes`, about to be handed to the parser, may be handed
    /// now: up to a large frame's header (when splitting), and when paused
    /// up to the end of the current message.
    fn advance(&mut self, bytes: &[u8]) -> usize {
        if let Some(tail) = &mut self.http_head {
            for (i, &b) in bytes.iter().enumerate() {
                // The blank line: `\r\n\r\n`, or `\n\n` (bare line feeds,
                // which HTTP parsers accept too).
                let ends = b == b'\n' && (tail[2] == b'\n' || tail[1..] == *b"\n\r");
                *tail = [tail[1], tail[2], b];
                if ends {
                    self.http_head = None;
                    self.pause.0.at_boundary.store(true, Ordering::SeqCst);
                    self.pause.0.carries.store(true, Ordering::SeqCst);
                    return i + 1;
                }
            }
            return bytes.len();
        }
        let stop_at_message_end = self.pause.requested();
        let mut boundary = self.at_message_boundary().then_some(0);
        let mut i = 0;
        // A fragment handed over in pieces must end its step at its header.
        let split_above = match &self.in_pieces {
            Some(range) => LARGE_FRAME_BYTES.min(range.start().saturating_sub(1)),
            None => LARGE_FRAME_BYTES,
        };
        // Where the frame of the last step began, if it began in `bytes`.
        let mut header_start = None;
        let mut in_pieces = false;
        while i < bytes.len() {
            if stop_at_message_end && self.at_message_boundary() {
                break;
            }
            header_start = matches!(self.frames, FrameCursor::Header0).then_some(i);
            let n = self
                .frames
                .advance_one(&bytes[i..], &mut self.in_message, split_above);
            i += n.taken;
            if self.at_message_boundary() {
                boundary = Some(i);
            }
            match n.data {
                Some(head) if head.begins => self.message_bytes = head.payload,
                // A frame header may declare up to 2^63 bytes: the sum of a
                // hostile message's fragments saturates (and is refused by
                // any budget) rather than wrapping.
                Some(head) => self.message_bytes = self.message_bytes.saturating_add(head.payload),
                None => {}
            }
            if let (Some(head), Some(start)) = (n.data, header_start) {
                if self.goes_in_pieces(&head) {
                    // Handed up to the fragment's header; the header itself
                    // never is (see `Follower::poll_pieces`).
                    self.pieces = Some(Pieces {
                        skip: head.len,
                        frame_left: head.payload,
                        piece_left: 0,
                        offset: 0,
                        first: head.first,
                        mask: head.mask,
                    });
                    i = start;
                    in_pieces = true;
                    break;
                }
            }
            if n.stop && self.split_large {
                break;
            }
        }
        if let (true, false, FrameCursor::Header { .. }, Some(start)) = (
            self.in_pieces.is_some(),
            in_pieces,
            &self.frames,
            header_start,
        ) {
            // A header begun and not ended: held back whole until its end
            // is read, so that a fragment to hand over in pieces is known
            // before any byte of its header is handed over.
            self.frames = FrameCursor::Header0;
            i = start;
            if self.at_message_boundary() {
                boundary = Some(i);
            }
        }
        self.pause
            .0
            .at_boundary
            .store(self.at_message_boundary(), Ordering::SeqCst);
        self.partial.keep(&bytes[..i], boundary);
        if in_pieces {
            // Larger than any copy kept: read to its end before a handover.
            self.partial.overflowed = true;
            self.partial.bytes = Vec::new();
        }
        self.pause.0.carries.store(self.carries(), Ordering::SeqCst);
        i
    }

    /// Whether the data frame `head` begins is a fragment to hand over in
    /// pieces ([`Follower::fragments_in_pieces`]).
    fn goes_in_pieces(&self, head: &DataHead) -> bool {
        let (fin, reserved, opcode) =
            (head.first & 0x80 != 0, head.first & 0x70, head.first & 0x0f);
        // Text, binary or continuation, without extension bits: a frame
        // the parser refuses is handed as it came, for it to refuse.
        let fragment = (!fin || opcode == 0) && reserved == 0 && opcode <= 2;
        fragment
            && self
                .in_pieces
                .as_ref()
                .is_some_and(|range| range.contains(&head.payload))
    }

    /// A read for the parser: the held-back bytes first, else
    /// `read_socket`; whatever may not be handed over yet is held back.
    /// Paused at a boundary, or stopped, it stays `Pending` and registers
    /// no wake-up: the handover polls the session itself.
    pub fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        read_socket: impl FnOnce(&mut Context<'_>, &mut ReadBuf<'_>) -> Poll<io::Result<()>>,
    ) -> Poll<io::Result<()>> {
        if self.pause.stopped() || (self.pause.requested() && self.at_message_boundary()) {
            return Poll::Pending;
        }
        if self.pieces.is_some() {
            return self.poll_pieces(cx, buf, read_socket);
        }
        let start = buf.filled().len();
        if self.held_back.is_empty() {
            let polled = read_socket(cx, buf);
            if !matches!(polled, Poll::Ready(Ok(()))) {
                return polled;
            }
        } else {
            let held = std::mem::take(&mut self.held_back);
            let n = buf.remaining().min(held.len());
            let k = self.advance(&held[..n]);
            if k > 0 || n == 0 {
                buf.put_slice(&held[..k]);
                if k < held.len() {
                    self.held_back = held[k..].to_vec();
                }
                return Poll::Ready(Ok(()));
            }
            if self.pieces.is_some() {
                self.held_back = held;
                return self.poll_pieces(cx, buf, read_socket);
            }
            // Only the start of a frame header is held: the socket's next
            // bytes go behind it, and the two are followed together.
            if buf.remaining() <= held.len() {
                // The parser makes room for a whole header before it reads one.
                self.held_back = held;
                return Poll::Ready(Err(io::Error::other(
                    "a read buffer smaller than a frame header",
                )));
            }
            buf.put_slice(&held);
            match read_socket(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() == start + held.len() => {
                    // The stream ended inside a header: the parser says so.
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Ok(())) => {}
                other => {
                    buf.set_filled(start);
                    self.held_back = held;
                    return other;
                }
            }
        }
        let read = buf.filled().len() - start;
        if read == 0 {
            return Poll::Ready(Ok(()));
        }
        let k = self.advance(&buf.filled()[start..]);
        if k < read {
            self.held_back = buf.filled()[start + k..].to_vec();
            buf.set_filled(start + k);
        }
        if k > 0 {
            return Poll::Ready(Ok(()));
        }
        if self.pieces.is_some() {
            // A fragment's header came first: its first piece's goes now.
            return self.poll_pieces(cx, buf, |_, _| Poll::Ready(Ok(())));
        }
        // Nothing to hand over yet (the start of a header, which waits for
        // its end): try again at once, the socket may hold the rest.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// A read for the parser inside a fragment handed over in pieces: the
    /// next piece's header, or payload bytes of the piece in progress (from
    /// the held-back bytes, else the socket), never past the piece's end.
    fn poll_pieces(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        read_socket: impl FnOnce(&mut Context<'_>, &mut ReadBuf<'_>) -> Poll<io::Result<()>>,
    ) -> Poll<io::Result<()>> {
        let Some(pieces) = self.pieces.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        if pieces.skip > 0 {
            let skip = pieces.skip.min(self.held_back.len());
            self.held_back.drain(..skip);
            pieces.skip -= skip;
        }
        if pieces.piece_left == 0 {
            let (head, n) = pieces.next_header();
            if buf.remaining() < n {
                // The parser makes room for a whole header before it reads one.
                return Poll::Ready(Err(io::Error::other(
                    "a read buffer smaller than a frame header",
                )));
            }
            buf.put_slice(&head[..n]);
            return Poll::Ready(Ok(()));
        }
        let want = usize::try_from(pieces.piece_left)
            .unwrap_or(usize::MAX)
            .min(buf.remaining());
        let took = if self.held_back.is_empty() {
            let start = buf.filled().len();
            match read_socket(cx, buf) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            let read = buf.filled().len() - start;
            let took = read.min(want);
            if read > took {
                self.held_back = buf.filled()[start + took..].to_vec();
                buf.set_filled(start + took);
            }
            took
        } else {
            let took = want.min(self.held_back.len());
            buf.put_slice(&self.held_back[..took]);
            self.held_back.drain(..took);
            took
        };
        // (Nothing taken: the stream ended inside the fragment, which the
        // parser says, or the parser gave no room.)
        pieces.piece_left -= took as u64;
        pieces.frame_left -= took as u64;
        pieces.offset += took as u64;
        if pieces.frame_left == 0 {
            self.pieces = None;
            self.frames = FrameCursor::Header0;
            self.pause
                .0
                .at_boundary
                .store(self.at_message_boundary(), Ordering::SeqCst);
            self.pause.0.carries.store(self.carries(), Ordering::SeqCst);
        }
        Poll::Ready(Ok(()))
    }
}

/// Polls once with a waker that does nothing. For a reader stopped with
/// [`Pause::stop`]: what its parser already holds whole, without waiting
/// (`Pending`: nothing more, and no wake-up will come). A split stream
/// also says "pending" while its other half is in use: poll it so only
/// while nothing else can hold that half.
pub fn poll_now<T>(poll: impl FnOnce(&mut Context<'_>) -> Poll<T>) -> Poll<T> {
    let waker = futures_util::task::noop_waker();
    poll(&mut Context::from_waker(&waker))
}

/// Bytes written on a socket and not taken by it yet, held in order and
/// written before anything else: those a previous instance left unwritten
/// (the rest of a frame), the rest of a write the socket took only part
/// of, and, once the connection is moving ([`Pause::spool_writes`]),
/// whatever the socket does not take at once. A write is thus taken whole
/// or not at all: the writer above never holds the rest of a frame, so
/// a whole frame pushed here ([`WriteSpool::push`]) always lands between
/// two of its frames, never inside one. (By hand: the held bytes must be
/// taken out for a handover, which no buffered writer offers.)
#[derive(Debug, Default)]
pub struct WriteSpool {
    /// (Written from its front: `advance` is O(1), however large.)
    bytes: bytes::BytesMut,
    /// Bytes the socket has taken through this spool, held or not: how a
    /// writer tells a slow peer (it goes on) from one that takes nothing.
    taken: u64,
}

impl WriteSpool {
    /// A spool holding `unwritten`, to be written first.
    pub fn with(unwritten: Vec<u8>) -> Self {
        WriteSpool {
            bytes: bytes::BytesMut::from(&unwritten[..]),
            taken: 0,
        }
    }

    /// Bytes the socket has taken through this spool so far.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    fn took(&mut self, n: usize) {
        self.taken += n as u64;
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Holds `frame` (whole frames) after the held bytes, to be written
    /// next: taken over whole when nothing is held, not copied.
    pub fn push(&mut self, frame: Vec<u8>) {
        if self.bytes.is_empty() {
            self.bytes = bytes::BytesMut::from(bytes::Bytes::from(frame));
        } else {
            self.bytes.extend_from_slice(&frame);
        }
    }

    /// Holds what is left of `buf` after the socket took `took` of it
    /// (held bytes come first, so it is only called with none held).
    fn hold_rest(&mut self, buf: &[u8], took: usize) {
        self.bytes.extend_from_slice(&buf[took.min(buf.len())..]);
    }

    /// The held bytes, for the next instance.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.bytes).to_vec()
    }

    /// Writes the held bytes for as long as the socket takes them.
    pub fn poll_drain<W: tokio::io::AsyncWrite + Unpin>(
        &mut self,
        socket: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while !self.bytes.is_empty() {
            let n =
                std::task::ready!(std::pin::Pin::new(&mut *socket).poll_write(cx, &self.bytes))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.took(n);
            crate::bounds::written(&mut self.bytes, n);
        }
        Poll::Ready(Ok(()))
    }

    /// A write of `buf` on `socket`, after the held bytes. `spooling`: it
    /// is taken whole, however little the socket takes; otherwise it waits
    /// for the held bytes to be written, then is taken whole if the socket
    /// takes any of it (the rest held), and waits if it takes none.
    pub fn poll_write<W: tokio::io::AsyncWrite + Unpin>(
        &mut self,
        socket: &mut W,
        cx: &mut Context<'_>,
        buf: &[u8],
        spooling: bool,
    ) -> Poll<io::Result<usize>> {
        if !spooling {
            std::task::ready!(self.poll_drain(socket, cx))?;
            let n = std::task::ready!(std::pin::Pin::new(socket).poll_write(cx, buf))?;
            self.took(n);
            if n > 0 {
                self.hold_rest(buf, n);
                return Poll::Ready(Ok(buf.len()));
            }
            return Poll::Ready(Ok(n));
        }
        if let Poll::Ready(Err(e)) = self.poll_drain(socket, cx) {
            return Poll::Ready(Err(e));
        }
        if !self.bytes.is_empty() {
            self.bytes.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        match std::pin::Pin::new(socket).poll_write(cx, buf) {
            Poll::Pending => self.bytes.extend_from_slice(buf),
            Poll::Ready(Ok(n)) => {
                self.took(n);
                self.bytes.extend_from_slice(&buf[n.min(buf.len())..]);
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
        }
        Poll::Ready(Ok(buf.len()))
    }

    /// A flush of `socket` after the held bytes; `spooling`: without
    /// waiting for them (what the socket takes now is written, the rest
    /// stays held).
    pub fn poll_flush<W: tokio::io::AsyncWrite + Unpin>(
        &mut self,
        socket: &mut W,
        cx: &mut Context<'_>,
        spooling: bool,
    ) -> Poll<io::Result<()>> {
        match self.poll_drain(socket, cx) {
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending if !spooling => return Poll::Pending,
            _ => {}
        }
        std::pin::Pin::new(socket).poll_flush(cx)
    }
}

// Why a large frame's header goes to the parser alone (see
// `FrameCursor`): tungstenite reserves a whole frame's
// payload in its read buffer as soon as it has the header, reads the
// payload into it, and splits the payload off the front; the rest of that
// allocation stays its read buffer, so one 25 MiB request kept 25 MiB for
// the life of the connection (before: 80 clients pinned 2,003 MiB). It
// offers no way to shrink the buffer (0.28, and 0.29 alike). But
// `BytesMut`, when it must grow while the allocation is shared, moves to a
// fresh one of its original (idle) size and lets go of the old one. So: a
// large frame's header is handed over alone (the payload bytes read with it
// are held back), the reservation is then exactly the payload and nothing
// of the next frame lands in it; and the session keeps the payload
// ([`ReleaseReadBuffer`]) until the parser's next read has moved to a fresh
// buffer. Both steps are plain safe code; if a later tungstenite or bytes
// changes either behaviour, the buffer is merely kept again, and
// `a_large_request_does_not_pin_its_read_buffer` fails.

/// Gives a large frame's read buffer back (see above): keeps the
/// last large payload the parser returned until the parser has been polled
/// again, which moves its buffer to a fresh, idle-sized allocation while
/// the old one is still shared.
#[derive(Debug, Default)]
pub struct ReleaseReadBuffer {
    payload: Option<bytes::Bytes>,
}

impl ReleaseReadBuffer {
    /// Call after every poll of the parser, with the frame it returned, if any.
    pub fn after_poll(&mut self, returned: Option<&bytes::Bytes>) {
        if let Some(released) = self.payload.take() {
            // A freed large buffer goes back to the system: a block that
            // large is mostly a mapping of its own, unmapped as it is freed
            // (`crate::bounds::return_large_blocks_at_once`), but glibc
            // serves one from free heap space when it has some, and keeps
            // that resident otherwise.
            if released.len() >= crate::bounds::MAPPED_BLOCK_BYTES && released.is_unique() {
                drop(released);
                crate::bounds::return_free_memory();
            }
        }
        self.payload = returned
            .filter(|p| p.len() as u64 > LARGE_FRAME_BYTES)
            .cloned();
    }
}

/// A WebSocket's reading half that gives a large frame's read buffer back
/// once the frame is handled ([`ReleaseReadBuffer`]): for sessions that
/// read with `next()` (`/ws/dedicated`, the gateway connection).
pub struct Releasing<R> {
    inner: R,
    release: ReleaseReadBuffer,
}

impl<R> Releasing<R> {
    pub fn new(inner: R) -> Self {
        Releasing {
            inner,
            release: ReleaseReadBuffer::default(),
        }
    }

    pub fn into_inner(self) -> R {
        self.inner
    }
}

impl<R> futures_util::Stream for Releasing<R>
where
    R: futures_util::Stream<
            Item = Result<
                tokio_tungstenite::tungstenite::Message,
                tokio_tungstenite::tungstenite::Error,
            >,
        > + Unpin,
{
    type Item = R::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<R::Item>> {
        use tokio_tungstenite::tungstenite::Message;
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        let payload = match &polled {
            Poll::Ready(Some(Ok(Message::Text(t)))) => Some(bytes::Bytes::from(t.clone())),
            Poll::Ready(Some(Ok(Message::Binary(b)))) => Some(b.clone()),
            _ => None,
        };
        self.release.after_poll(payload.as_ref());
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A masked client frame header with a payload of `len` bytes.
    fn header(len: u64) -> Vec<u8> {
        let (head, n) = frame_header(0x81, len, Some([1, 2, 3, 4]));
        head[..n].to_vec()
    }

    impl FrameCursor {
        /// All of `bytes` that may be handed over now (as the reader does
        /// when not paused).
        fn advance(&mut self, bytes: &[u8]) -> usize {
            let mut in_message = false;
            let mut i = 0;
            while i < bytes.len() {
                let n = self.advance_one(&bytes[i..], &mut in_message, LARGE_FRAME_BYTES);
                i += n.taken;
                if n.stop {
                    break;
                }
            }
            i
        }
    }

    /// Small frames pass whole, however they are split; a large frame's
    /// header is cut from the payload bytes read with it, and the frame
    /// after the large one is found again.
    #[test]
    fn a_large_frame_header_is_handed_over_alone() {
        let mut stream = Vec::new();
        for len in [5u64, 125, 126, 2000] {
            stream.extend(header(len));
            stream.extend(std::iter::repeat_n(b'a', len as usize));
        }
        let mut cursor = FrameCursor::default();
        for piece in stream.chunks(7) {
            assert_eq!(
                cursor.advance(piece),
                piece.len(),
                "small frames pass whole"
            );
        }
        let big = 16u64 << 20;
        let mut read = header(big);
        let head = read.len();
        read.extend(std::iter::repeat_n(b'b', 100));
        let mut cursor = FrameCursor::default();
        assert_eq!(cursor.advance(&read), head, "the header alone");
        assert_eq!(cursor.advance(&read[head..]), 100);
        // The rest of the payload, then a small frame: whole again.
        let mut rest = vec![b'b'; (big - 100) as usize];
        rest.extend(header(3));
        rest.extend(b"xyz");
        assert_eq!(cursor.advance(&rest), rest.len());
        assert!(matches!(cursor, FrameCursor::Header0));
        assert_eq!(header_payload_len(&header(70_000)), Some(70_000));
        assert_eq!(header_payload_len(&header(70_000)[..5]), None);
    }

    /// Unmasked (server) frames are followed too: a follower that does not
    /// split large frames, paused inside a message, hands over the rest of
    /// that message and keeps the next one, large or not.
    /// Fragments whose headers declare 2^63 − 1 bytes each: the message's
    /// count saturates instead of overflowing (found by the `boundary`
    /// fuzz target).
    #[test]
    fn fragments_declaring_huge_lengths_saturate_the_message_count() {
        let huge = |first: u8| {
            let mut f = vec![first, 127];
            f.extend_from_slice(&(u64::MAX >> 1).to_be_bytes());
            f
        };
        let mut follower = Follower::new(Vec::new(), false);
        // A text frame without FIN, then (as if its payload had passed) a
        // continuation: each header alone, as the follower sees them.
        follower.advance(&huge(0x01));
        let mut other = Follower::new(Vec::new(), false);
        other.message_bytes = u64::MAX - 1;
        other.in_message = true;
        other.advance(&huge(0x00));
        assert_eq!(other.message_bytes(), u64::MAX);
        assert!(follower.message_bytes() >= u64::MAX >> 1);
    }

    #[test]
    fn an_unmasked_stream_pauses_at_the_end_of_a_message() {
        let frame = |payload: &[u8]| {
            let mut f = vec![0x81, 126];
            f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
            f.extend_from_slice(payload);
            f
        };
        let first = frame(&[b'a'; 3000]);
        let second = frame(&[b'b'; 3000]);
        let mut follower = Follower::new(Vec::new(), false);
        assert_eq!(follower.advance(&first[..10]), 10);
        follower.pause().request();
        let mut rest = first[10..].to_vec();
        rest.extend(&second);
        assert_eq!(follower.advance(&rest), first.len() - 10);
        assert!(follower.pause().at_boundary());
    }

    /// On the client side of an upgrade, the HTTP response's head is
    /// handed over alone, however it is split, and the frames after it are
    /// followed from their first byte.
    #[test]
    fn the_upgrade_response_is_handed_over_up_to_its_end() {
        let head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n";
        let mut wire = head.to_vec();
        wire.extend([0x81, 3, b'a', b'b', b'c']);
        let mut follower = Follower::after_http_response(false);
        assert_eq!(follower.advance(&wire[..20]), 20);
        assert!(
            !follower.pause().at_boundary(),
            "inside the response's head"
        );
        assert_eq!(
            follower.advance(&wire[20..]),
            head.len() - 20,
            "the head, no frame"
        );
        assert_eq!(follower.advance(&wire[head.len()..head.len() + 2]), 2);
        assert!(!follower.pause().at_boundary(), "inside the first frame");
        follower.pause().request();
        assert_eq!(
            follower.advance(&wire[head.len() + 2..]),
            3,
            "the rest of it"
        );
        assert!(follower.pause().at_boundary());
        // Bare line feeds end a head too.
        let mut follower = Follower::after_http_response(false);
        let head = b"HTTP/1.1 101 Switching Protocols\nUpgrade: websocket\n\n";
        let mut wire = head.to_vec();
        wire.extend([0x81, 1, b'a']);
        assert_eq!(follower.advance(&wire), head.len());
        assert_eq!(follower.advance(&wire[head.len()..]), 3);
    }

    /// Unmasked frames: a text message of `len` bytes in `fragments` frames.
    fn message(len: usize, fragments: usize, fill: u8) -> Vec<u8> {
        let mut out = Vec::new();
        let per = len.div_ceil(fragments.max(1)).max(1);
        let mut left = len;
        let mut first = true;
        loop {
            let n = left.min(per);
            left -= n;
            let fin = if left == 0 { 0x80 } else { 0 };
            out.push(fin | if first { 0x1 } else { 0x0 });
            match n {
                0..=125 => out.push(n as u8),
                126..=0xffff => {
                    out.push(126);
                    out.extend_from_slice(&(n as u16).to_be_bytes());
                }
                _ => {
                    out.push(127);
                    out.extend_from_slice(&(n as u64).to_be_bytes());
                }
            }
            out.extend(std::iter::repeat_n(fill, n));
            first = false;
            if left == 0 {
                return out;
            }
        }
    }

    /// Reads `stream` through a follower in `pieces`, stops after `reads`
    /// reads, and gives (the bytes handed to the parser, what it carries).
    fn stop_after(
        stream: &[u8],
        pieces: &[usize],
        reads: usize,
        limit: usize,
    ) -> (Vec<u8>, Option<Vec<u8>>) {
        let mut follower = Follower::new(Vec::new(), true).carrying(limit);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut handed = Vec::new();
        let mut at = 0;
        for k in 0..reads {
            let mut space = vec![0u8; 64 * 1024];
            let mut buf = ReadBuf::new(&mut space);
            let piece = pieces[k % pieces.len()];
            let polled = follower.poll_read(&mut cx, &mut buf, |_, buf| {
                let n = piece.min(stream.len() - at).min(buf.remaining());
                buf.put_slice(&stream[at..at + n]);
                at += n;
                Poll::Ready(Ok(()))
            });
            assert!(matches!(polled, Poll::Ready(Ok(()))));
            handed.extend_from_slice(buf.filled());
        }
        follower.pause().stop();
        let mut space = [0u8; 16];
        let mut buf = ReadBuf::new(&mut space);
        assert!(
            follower
                .poll_read(&mut cx, &mut buf, |_, _| panic!("no read once stopped"))
                .is_pending(),
            "stopped: nothing more is handed over"
        );
        let mut carried = follower.take_carried();
        if let Some(c) = &mut carried {
            // What the socket still holds comes after.
            c.extend_from_slice(&stream[at..]);
        }
        (handed, carried)
    }

    /// A writer that holds what the socket did not take and writes it
    /// later (tungstenite: a pong written from inside a read, the socket
    /// nearly full), and a whole frame pushed in between: the frame comes
    /// after the whole write, never inside it. Held, the rest of the write
    /// went on the socket after the frame.
    #[test]
    fn a_frame_pushed_after_a_write_the_socket_took_part_of_comes_after_all_of_it() {
        let (mut ours, mut theirs) = tokio::io::duplex(8);
        let mut spool = WriteSpool::with(Vec::new());
        let pong = b"PONG-FRAME-WHOLE";
        let mut at = 0;
        let mut pushed = false;
        let mut wire = Vec::new();
        let read = |theirs: &mut tokio::io::DuplexStream, wire: &mut Vec<u8>| {
            let mut room = [0u8; 64];
            let mut buf = ReadBuf::new(&mut room);
            let _ = poll_now(|cx| {
                tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut *theirs), cx, &mut buf)
            });
            wire.extend_from_slice(buf.filled());
        };
        for _ in 0..64 {
            if at < pong.len() {
                if let Poll::Ready(Ok(n)) =
                    poll_now(|cx| spool.poll_write(&mut ours, cx, &pong[at..], false))
                {
                    at += n;
                }
            }
            if !pushed {
                spool.push(b"<RAW>".to_vec());
                pushed = true;
            }
            let _ = poll_now(|cx| spool.poll_drain(&mut ours, cx));
            read(&mut theirs, &mut wire);
        }
        assert!(spool.is_empty(), "everything written");
        assert_eq!(
            String::from_utf8_lossy(&wire),
            "PONG-FRAME-WHOLE<RAW>",
            "the frame pushed lands after the write, whole"
        );
    }

    /// Writes `chunks` through a spool onto a socket that takes at most
    /// `room` bytes (nobody reads it), spooling from chunk `spool_from` on;
    /// gives what the socket took and what the spool holds.
    fn spooled(chunks: &[Vec<u8>], room: usize, spool_from: usize) -> (Vec<u8>, Vec<u8>) {
        let (mut ours, mut theirs) = tokio::io::duplex(room.max(1));
        let mut spool = WriteSpool::with(Vec::new());
        for (i, chunk) in chunks.iter().enumerate() {
            let spooling = i >= spool_from;
            let mut at = 0;
            while at < chunk.len() {
                match poll_now(|cx| spool.poll_write(&mut ours, cx, &chunk[at..], spooling)) {
                    Poll::Ready(Ok(n)) => at += n,
                    Poll::Ready(Err(e)) => panic!("{e}"),
                    // Not spooling, the socket full: what is left of the
                    // chunk goes once spooling begins.
                    Poll::Pending => break,
                }
            }
            if at < chunk.len() {
                assert!(!spooling, "a spooled write is taken whole");
                let rest = &chunk[at..];
                assert!(matches!(
                    poll_now(|cx| spool.poll_write(&mut ours, cx, rest, true)),
                    Poll::Ready(Ok(n)) if n == rest.len()
                ));
            }
        }
        let flushed = poll_now(|cx| spool.poll_flush(&mut ours, cx, true));
        assert!(
            matches!(flushed, Poll::Ready(Ok(()))),
            "a spooled flush waits for nothing"
        );
        let mut took = vec![0u8; room.max(1)];
        let mut buf = ReadBuf::new(&mut took);
        let _ = poll_now(|cx| {
            tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut theirs), cx, &mut buf)
        });
        let n = buf.filled().len();
        took.truncate(n);
        (took, spool.take())
    }

    /// A client's message (masked with `key`) in `fragments` frames.
    fn masked_message(payload: &[u8], fragments: usize, key: [u8; 4], text: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let per = payload.len().div_ceil(fragments.max(1)).max(1);
        let parts: Vec<&[u8]> = if payload.is_empty() {
            vec![&[][..]]
        } else {
            payload.chunks(per).collect()
        };
        for (i, part) in parts.iter().enumerate() {
            let fin = if i + 1 == parts.len() { 0x80 } else { 0 };
            let opcode = match (i, text) {
                (0, true) => 1,
                (0, false) => 2,
                _ => 0,
            };
            let mut head = header(part.len() as u64);
            head[0] = fin | opcode;
            let at = head.len() - 4;
            head[at..].copy_from_slice(&key);
            out.extend(head);
            out.extend(part.iter().enumerate().map(|(j, b)| b ^ key[j % 4]));
        }
        out
    }

    /// Reads `stream` through a follower that hands fragments larger than
    /// `above` over in pieces, `chunk` bytes a socket read, into reads of
    /// `room` bytes: what the parser is handed.
    fn through_pieces(stream: &[u8], above: u64, chunk: usize, room: usize) -> Vec<u8> {
        let mut follower = Follower::new(Vec::new(), true).carrying(above as usize);
        follower.fragments_in_pieces(above, u64::MAX);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let (mut handed, mut at) = (Vec::new(), 0);
        let mut space = vec![0u8; room];
        for _ in 0..stream.len() * 4 + 16 {
            let mut buf = ReadBuf::new(&mut space);
            let polled = follower.poll_read(&mut cx, &mut buf, |_, buf| {
                let n = chunk.min(stream.len() - at).min(buf.remaining());
                buf.put_slice(&stream[at..at + n]);
                at += n;
                Poll::Ready(Ok(()))
            });
            match polled {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
                Poll::Ready(Ok(())) => handed.extend_from_slice(buf.filled()),
                Poll::Ready(Err(e)) => panic!("{e}"),
                // The start of a header, waiting for its end.
                Poll::Pending => {}
            }
        }
        assert_eq!(at, stream.len(), "read to the end");
        assert!(follower.between_messages(), "ends at a boundary");
        handed
    }

    /// The messages a server's parser reads from `wire`.
    fn parsed(wire: Vec<u8>) -> Vec<tungstenite::Message> {
        use tokio_tungstenite::tungstenite;
        struct Io(std::io::Cursor<Vec<u8>>);
        impl std::io::Read for Io {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.0.read(buf)
            }
        }
        impl std::io::Write for Io {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let config = tungstenite::protocol::WebSocketConfig::default().read_buffer_size(2048);
        let mut ws = tungstenite::WebSocket::from_raw_socket(
            Io(std::io::Cursor::new(wire)),
            tungstenite::protocol::Role::Server,
            Some(config),
        );
        let mut out = Vec::new();
        while let Ok(m) = ws.read() {
            out.push(m);
        }
        out
    }

    use tokio_tungstenite::tungstenite;

    /// A fragment of 24 MiB is handed over as pieces of at most
    /// [`PIECE_BYTES`], masked so that the parser reads the same message;
    /// the fragments under the limit and a whole large frame pass as they
    /// came.
    #[test]
    fn a_large_fragment_is_handed_over_in_pieces_that_make_the_same_message() {
        let big = "é".repeat(12 << 20);
        let mut stream = masked_message(big.as_bytes(), 2, [9, 8, 7, 6], true);
        let small = masked_message(b"small", 1, [1, 2, 3, 4], true);
        stream.extend(&small);
        let whole = masked_message(&[7u8; 100_000], 1, [5, 5, 6, 6], false);
        stream.extend(&whole);
        let handed = through_pieces(&stream, 64 * 1024, 70_000, 2048);
        let mut frames = 0;
        let mut at = 0;
        while at < handed.len() {
            let len = (2..=14)
                .find_map(|n| header_payload_len(&handed[at..at + n]).map(|p| (n, p)))
                .unwrap();
            frames += 1;
            assert!(
                len.1 <= PIECE_BYTES || len.1 == 100_000,
                "no fragment over a piece"
            );
            at += len.0 + len.1 as usize;
        }
        assert!(
            frames > (24 << 20) / PIECE_BYTES as usize,
            "{frames} frames"
        );
        assert!(
            handed.ends_with(&whole) && handed[..handed.len() - whole.len()].ends_with(&small),
            "frames not cut pass as they came"
        );
        let messages = parsed(handed);
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[0].to_text().unwrap(), big);
        assert_eq!(messages[1].to_text().unwrap(), "small");
        assert_eq!(messages[2].len(), 100_000);
    }

    /// Paused inside a fragment handed over in pieces, a follower cannot
    /// carry it (it is larger than any copy kept), reads it to its end
    /// and stops there.
    #[test]
    fn a_pause_inside_pieces_waits_for_the_message_end() {
        let mut stream = masked_message(&[3u8; 300_000], 3, [1, 2, 3, 4], false);
        let next = masked_message(b"next", 1, [4, 3, 2, 1], true);
        stream.extend(&next);
        let mut follower = Follower::new(Vec::new(), true).carrying(64 * 1024);
        follower.fragments_in_pieces(64 * 1024, u64::MAX);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let (mut handed, mut at) = (Vec::new(), 0);
        let mut read = |follower: &mut Follower, handed: &mut Vec<u8>| {
            let mut space = [0u8; 2048];
            let mut buf = ReadBuf::new(&mut space);
            let polled = follower.poll_read(&mut cx, &mut buf, |_, buf| {
                let n = 4096.min(stream.len() - at).min(buf.remaining());
                buf.put_slice(&stream[at..at + n]);
                at += n;
                Poll::Ready(Ok(()))
            });
            handed.extend_from_slice(buf.filled());
            polled.is_ready()
        };
        for _ in 0..40 {
            assert!(read(&mut follower, &mut handed));
        }
        assert!(!follower.carries(), "inside pieces: not carried");
        follower.pause().request();
        let mut reads = 0;
        while read(&mut follower, &mut handed) {
            reads += 1;
            assert!(reads < 10_000, "stops at the message end");
        }
        assert!(follower.pause().at_boundary());
        assert_eq!(
            follower.take_carried().unwrap(),
            next,
            "the next message waits"
        );
        let messages = parsed(handed);
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].len(), 300_000);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// However the socket splits them and whatever room the parser
        /// gives, fragments in pieces make the messages the client sent.
        #[test]
        fn fragments_in_pieces_make_the_messages_sent(
            messages in proptest::collection::vec((0usize..12_000, 1usize..5, proptest::prelude::any::<[u8; 4]>(), proptest::prelude::any::<bool>()), 1..6),
            chunk in 1usize..6000,
            room in 14usize..6000,
            above in 0u64..3000,
        ) {
            let mut stream = Vec::new();
            let mut sent = Vec::new();
            for (i, (len, fragments, key, text)) in messages.iter().enumerate() {
                // Two-byte characters, so pieces cut some in half.
                let payload: Vec<u8> = if *text {
                    "ü".repeat(len / 2).into_bytes()
                } else {
                    (0..*len).map(|j| (i + j) as u8).collect()
                };
                stream.extend(masked_message(&payload, *fragments, *key, *text));
                sent.push(payload);
            }
            let handed = through_pieces(&stream, above, chunk, room);
            let got: Vec<Vec<u8>> = parsed(handed).into_iter().map(|m| m.into_data().to_vec()).collect();
            proptest::prop_assert_eq!(got, sent);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// Whatever the socket takes and whenever spooling begins, what it
        /// took and then what the spool holds are the writes, byte for
        /// byte, in order.
        #[test]
        fn a_spool_holds_exactly_what_the_socket_did_not_take(
            chunks in proptest::collection::vec(proptest::collection::vec(0u8..255, 0..3000), 1..12),
            room in 1usize..8000,
            spool_from in 0usize..12,
        ) {
            let (took, held) = spooled(&chunks, room, spool_from);
            let mut sent = took;
            sent.extend(held);
            proptest::prop_assert_eq!(sent, chunks.concat());
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// Stopped after any read, a follower carries exactly the bytes the
        /// next instance needs: the whole messages it handed over, then
        /// what it carries, are the stream, byte for byte; and inside a
        /// message larger than its copy it says it cannot carry.
        #[test]
        fn a_reader_stopped_anywhere_carries_the_rest_of_the_stream(
            messages in proptest::collection::vec((0usize..9000, 1usize..4), 1..8),
            pieces in proptest::collection::vec(1usize..5000, 1..10),
            reads in 0usize..40,
            limit in proptest::prop_oneof![proptest::strategy::Just(usize::MAX >> 1), 1usize..20_000],
        ) {
            let mut stream = Vec::new();
            let mut ends = vec![0];
            for (i, (len, fragments)) in messages.iter().enumerate() {
                stream.extend(message(*len, *fragments, b'a' + i as u8));
                ends.push(stream.len());
            }
            let (handed, carried) = stop_after(&stream, &pieces, reads, limit);
            // The whole messages handed over end at the last boundary.
            let whole = *ends.iter().filter(|e| **e <= handed.len()).max().unwrap();
            match carried {
                Some(carried) => {
                    let mut again = stream[..whole].to_vec();
                    again.extend(carried);
                    proptest::prop_assert_eq!(again, stream);
                }
                None => proptest::prop_assert!(
                    handed.len() - whole > limit,
                    "refused with {} bytes of the message in progress handed over (limit {})",
                    handed.len() - whole,
                    limit
                ),
            }
        }
    }
}
