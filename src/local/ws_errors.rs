//! What a WebSocket read error means for a route: one classification for
//! `/ws` and `/ws/dedicated` (and the dedicated relay's gateway side), so
//! the two routes cannot drift apart again . It matches on error
//! variants, never on an error's text.

use std::io;

use tokio_tungstenite::tungstenite::error::ProtocolError;
use tokio_tungstenite::tungstenite::Error as WsError;

/// The error a read past the pre-`connect` budget fails with (see
/// [`super::preconnect`]); a route closes `1009` on it. Its own type, so a
/// route recognises it by type, not by its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBudget;

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("more bytes before connect than preconnect_max_bytes")
    }
}

impl std::error::Error for OverBudget {}

impl From<OverBudget> for io::Error {
    fn from(e: OverBudget) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// What a route does after a read from a WebSocket failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFailure {
    /// The peer is gone (EOF or reset without a close frame, an I/O error):
    /// nothing can reach it, so the route ends quietly.
    Ended,
    /// A frame over the limit (`max_frame_bytes`, or the pre-`connect`
    /// budget): close `1009`.
    TooLarge,
    /// The peer broke the protocol: close with this code and reason
    /// (RFC 6455 §7.4.1: 1007 for invalid UTF-8, 1002 for a protocol error).
    Invalid(u16, &'static str),
}

/// Maps a read error to what the route does. `side` names the peer in the
/// debug log ("local client", "gateway").
pub fn classify(e: &WsError, side: &str) -> ReadFailure {
    match e {
        WsError::Capacity(_) => ReadFailure::TooLarge,
        WsError::Io(io) if is_over_budget(io) => ReadFailure::TooLarge,
        WsError::Utf8(_) => ReadFailure::Invalid(1007, "invalid utf-8"),
        // EOF with no close frame: the peer is gone, a close would reach no one.
        WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake) => ReadFailure::Ended,
        WsError::Protocol(p) => {
            tracing::debug!("{side} broke the WebSocket protocol: {p}");
            ReadFailure::Invalid(1002, "protocol error")
        }
        other => {
            tracing::debug!("{side} read error: {other}");
            ReadFailure::Ended
        }
    }
}

fn is_over_budget(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<OverBudget>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_tungstenite::tungstenite::error::CapacityError;

    fn io_error(e: io::Error) -> WsError {
        WsError::Io(e)
    }

    #[test]
    fn a_frame_over_the_limit_is_too_large() {
        let e = WsError::Capacity(CapacityError::MessageTooLong {
            size: 2,
            max_size: 1,
        });
        assert_eq!(classify(&e, "t"), ReadFailure::TooLarge);
    }

    #[test]
    fn over_budget_is_too_large_by_type_not_text() {
        assert_eq!(
            classify(&io_error(OverBudget.into()), "t"),
            ReadFailure::TooLarge
        );
        // The same words in another error are just a read error.
        let lookalike = io::Error::new(io::ErrorKind::InvalidData, OverBudget.to_string());
        assert_eq!(classify(&io_error(lookalike), "t"), ReadFailure::Ended);
    }

    #[test]
    fn invalid_utf8_closes_1007() {
        assert_eq!(
            classify(&WsError::Utf8("invalid utf-8 sequence".into()), "t"),
            ReadFailure::Invalid(1007, "invalid utf-8")
        );
    }

    #[test]
    fn a_reset_without_close_ends_quietly() {
        let e = WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake);
        assert_eq!(classify(&e, "t"), ReadFailure::Ended);
    }

    #[test]
    fn other_protocol_errors_close_1002() {
        for p in [
            ProtocolError::NonZeroReservedBits,
            ProtocolError::UnmaskedFrameFromClient,
            ProtocolError::FragmentedControlFrame,
        ] {
            assert_eq!(
                classify(&WsError::Protocol(p), "t"),
                ReadFailure::Invalid(1002, "protocol error")
            );
        }
    }

    #[test]
    fn io_errors_and_closed_connections_end_quietly() {
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        for e in [
            io_error(reset),
            WsError::ConnectionClosed,
            WsError::AlreadyClosed,
        ] {
            assert_eq!(classify(&e, "t"), ReadFailure::Ended);
        }
    }
}
