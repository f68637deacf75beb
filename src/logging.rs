//! The broker's log: never blocking, never revealing a secret, never flooded.
//!
//! - **Non-blocking.** Lines go through `tracing-appender`'s worker thread
//!   with a bounded, lossy buffer ([`LOG_BUFFER_LINES`]): a stalled stderr
//!   (a slow journald, a pipe nobody reads) drops log lines instead of
//!   stalling fan-out, which may log while holding the hub lock. Keep the
//!   returned [`LogGuard`] alive until exit so the last lines are written.
//! - **No secrets.** The WebSocket library logs whole frames at debug/trace,
//!   and the broker's upstream `connect` frame carries the token (clients'
//!   frames may carry theirs). A filter at the sink caps the wire crates'
//!   targets at `info` whatever the directives say (a more specific
//!   `tungstenite::protocol=trace` used to win over a fixed
//!   `tungstenite=info` directive), so such frames never reach a formatter.
//! - **Not flooded.** [`RepeatLimiter`] lets through at most
//!   [`REPEATS_PER_WINDOW`] identical lines (same place, same fields) per
//!   [`REPEAT_WINDOW`] and then says how many it held back. Hand-written: the
//!   crates that throttle `tracing` events either key on the callsite alone
//!   (different messages from one place would be lost) or pull in a runtime
//!   of their own; this is ~60 lines.

use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Lines buffered for the log writer thread; past this, new lines are
/// dropped (counted by `tracing-appender`), never waited for.
pub const LOG_BUFFER_LINES: usize = 16 * 1024;

/// Identical lines allowed per [`REPEAT_WINDOW`] before the rest are held back.
pub const REPEATS_PER_WINDOW: u32 = 5;

/// The window of [`REPEATS_PER_WINDOW`].
pub const REPEAT_WINDOW: Duration = Duration::from_secs(10);

/// Distinct lines tracked at most; past it the table starts over.
const REPEAT_KEYS_MAX: usize = 4096;

/// Crates whose debug/trace output contains raw frames (and so tokens).
const WIRE_TARGETS: [&str; 2] = ["tungstenite", "tokio_tungstenite"];

/// Keeps the log writer alive; dropping it flushes what is buffered.
#[must_use]
pub struct LogGuard(#[allow(dead_code)] tracing_appender::non_blocking::WorkerGuard);

/// Whether an event from `meta` may be logged at all: the wire crates
/// only at `info` and above.
pub fn reveals_nothing(meta: &Metadata<'_>) -> bool {
    let wire = WIRE_TARGETS.iter().any(|t| {
        meta.target() == *t
            || meta
                .target()
                .strip_prefix(t)
                .is_some_and(|rest| rest.starts_with("::"))
    });
    !wire || *meta.level() <= Level::INFO
}

/// Installs the global subscriber for `directives` (an `EnvFilter` string;
/// an invalid one falls back to `info`).
pub fn init(directives: &str) -> LogGuard {
    let filter = EnvFilter::try_new(directives).unwrap_or_else(|_| EnvFilter::new("info"));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_BUFFER_LINES)
        .thread_name("clawmux-log")
        .finish(Escaping(std::io::stderr()));
    let fmt = human_layer(writer, std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::filter::filter_fn(reveals_nothing))
        .with(RepeatLimiter::default())
        .with(fmt)
        .try_init();
    LogGuard(guard)
}

/// The line format: a person reads it, so no module paths (`--log` still
/// filters by them) and every value escaped ([`EscapedFields`]).
fn human_layer<S, W>(writer: W, ansi: bool) -> impl Layer<S>
where
    S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + 'static,
{
    tracing_subscriber::fmt::layer()
        .fmt_fields(EscapedFields)
        .with_target(false)
        .with_writer(writer)
        .with_ansi(ansi)
}

/// Writes an event's (and a span's) fields like `tracing-subscriber`'s
/// default (`message` bare, then `name=value`, the name italic and `=`
/// dimmed on a terminal), but every value through
/// [`crate::sanitize::text`]: an ESC in a logged value (a gateway's
/// `server_version`, a client id, a session key) is written as `\e`, so
/// the only escape sequences left in a line are the formatter's own
/// styles, and a newline in a value cannot start a forged log line. (The
/// default escapes ESC in `message` only, not in other fields.)
#[derive(Debug, Default, Clone, Copy)]
pub struct EscapedFields;

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = EscapingVisitor {
            writer,
            result: Ok(()),
            first: true,
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct EscapingVisitor<'writer> {
    writer: Writer<'writer>,
    result: fmt::Result,
    first: bool,
}

impl Visit for EscapingVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "generation" {
            // Counted within its session (the `session` field names it),
            // not the broker-wide number that keeps sessions apart.
            let shown = crate::sessions::narrower::generation_in_session(value);
            self.record_debug(field, &shown);
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.record_debug(field, &format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let name = field.name();
        // `log` records' metadata, printed by the formatter itself.
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        let text = format!("{value:?}");
        let shown = crate::sanitize::text(&text);
        let sep = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        let name = name.strip_prefix("r#").unwrap_or(name);
        self.result = match (name, self.writer.has_ansi_escapes()) {
            ("message", _) => write!(self.writer, "{sep}{shown}"),
            (name, true) => write!(
                self.writer,
                "{sep}\x1b[3m{name}\x1b[0m\x1b[2m=\x1b[0m{shown}"
            ),
            (name, false) => write!(self.writer, "{sep}{name}={shown}"),
        };
    }
}

/// Shows every control and invisible character of a log line escaped
/// ([`crate::sanitize::styled_lines`]) but the formatter's own colours and
/// the line's newline: logged values (client ids, session keys, gateway
/// messages) cannot drive the terminal the log is read on. The values
/// were escaped already ([`EscapedFields`]), so an SGR sequence left in the
/// line is the formatter's; this is the second line of defence (and
/// covers what the formatter writes itself).
pub struct Escaping<W>(pub W);

impl<W: std::io::Write> std::io::Write for Escaping<W> {
    /// Takes one whole formatted line (the appender's worker writes each
    /// line with one call).
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        self.0
            .write_all(crate::sanitize::styled_lines(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Holds back lines repeated more than [`REPEATS_PER_WINDOW`] times per
/// [`REPEAT_WINDOW`] (see the module docs).
#[derive(Debug, Default)]
pub struct RepeatLimiter {
    seen: Mutex<HashMap<u64, Seen>>,
}

#[derive(Debug)]
struct Seen {
    window_start: Instant,
    count: u32,
    held_back: u64,
}

/// Hashes an event's fields (the message included).
struct FieldHasher<'a>(&'a mut std::collections::hash_map::DefaultHasher);

impl Visit for FieldHasher<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        field.name().hash(self.0);
        format!("{value:?}").hash(self.0);
    }
}

impl RepeatLimiter {
    /// Decides for one line (`key`: its place and fields) at `now`. Returns
    /// whether to log it, and how many identical lines were held back in the
    /// window that just ended (to say so).
    pub fn admit(&self, key: u64, now: Instant) -> (bool, u64) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= REPEAT_KEYS_MAX && !seen.contains_key(&key) {
            seen.clear();
        }
        let entry = seen.entry(key).or_insert(Seen {
            window_start: now,
            count: 0,
            held_back: 0,
        });
        let mut reported = 0;
        if now.duration_since(entry.window_start) >= REPEAT_WINDOW {
            reported = std::mem::take(&mut entry.held_back);
            entry.window_start = now;
            entry.count = 0;
        }
        entry.count += 1;
        if entry.count > REPEATS_PER_WINDOW {
            entry.held_back += 1;
            return (false, reported);
        }
        (true, reported)
    }
}

impl<S: Subscriber> Layer<S> for RepeatLimiter {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        event.metadata().callsite().hash(&mut hasher);
        event.record(&mut FieldHasher(&mut hasher));
        let (log, held_back) = self.admit(hasher.finish(), Instant::now());
        if held_back > 0 {
            tracing::warn!(
                target: "clawmux::logging",
                held_back,
                "the next line was repeated {held_back} more times in the last {} s (not shown)",
                REPEAT_WINDOW.as_secs()
            );
        }
        log
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_reach_the_terminal_escaped() {
        use std::io::Write as _;
        let mut out = Escaping(Vec::new());
        out.write_all("\x1b[32mINFO\x1b[0m client=\x1b]52;c;aGk=\x07 \u{202e}x\n".as_bytes())
            .unwrap();
        assert_eq!(
            String::from_utf8(out.0).unwrap(),
            "\x1b[32mINFO\x1b[0m client=\\e]52;c;aGk=\\x07 \\u{202e}x\n"
        );
    }

    /// A line buffer the formatter writes to (through [`Escaping`]).
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What the broker's formatter writes for one event, on a terminal
    /// (colours on) and not.
    fn formatted(ansi: bool, log: impl FnOnce()) -> String {
        let lines = Lines::default();
        let sink = lines.clone();
        let fmt = human_layer(move || Escaping(sink.clone()), ansi);
        tracing::subscriber::with_default(tracing_subscriber::registry().with(fmt), log);
        let bytes = lines.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn an_sgr_in_a_logged_value_is_escaped_and_the_formatters_own_kept() {
        // A gateway's version that would hide the rest of the line, or
        // colour it, and a newline that would forge a line.
        let version = "2026\x1b[8m\x1b[30;40mhidden\x1b[0m\n2026-01-01 INFO forged";
        let colour = formatted(true, || {
            let _span = tracing::info_span!("session", key = "k\x1b[31m").entered();
            tracing::info!(server_version = %version, id = ?"c\x1b[7m", "ready \x1b[8mx");
        });
        for raw in ["\x1b[8m", "\x1b[30;40m", "\x1b[31m", "\x1b[7m"] {
            assert!(!colour.contains(raw), "{raw:?} raw in {colour:?}");
        }
        assert!(
            colour.contains("\\e[8m\\e[30;40mhidden\\e[0m\\n2026"),
            "{colour:?}"
        );
        assert!(colour.contains("\x1b[32m INFO\x1b[0m") || colour.contains("\x1b[32mINFO"));
        assert!(
            colour.contains("\x1b[3mserver_version\x1b[0m\x1b[2m=\x1b[0m"),
            "{colour:?}"
        );
        assert_eq!(colour.matches('\n').count(), 1, "one line: {colour:?}");
        let plain = formatted(false, || tracing::info!(server_version = %version, "ready"));
        assert!(!plain.contains('\x1b'), "{plain:?}");
        assert!(plain.contains("server_version=2026\\e[8m"), "{plain:?}");
    }

    /// A line says what happened in words a user reads: no module path,
    /// and a session's generation counted within that session.
    #[test]
    fn lines_carry_no_module_path_nor_a_broker_wide_generation() {
        let base = crate::sessions::narrower::GENERATION_BASE;
        let line = formatted(
            false,
            || tracing::info!(session = %"narrow", generation = base + 1, "upstream session ready"),
        );
        assert!(!line.contains("clawmux::"), "{line:?}");
        assert!(line.contains("session=narrow generation=1\n"), "{line:?}");
        assert!(!line.contains(&(base + 1).to_string()), "{line:?}");
        let main = formatted(false, || tracing::info!(generation = 3u64, "ready"));
        assert!(main.contains("generation=3"), "{main:?}");
    }

    #[test]
    fn repeats_are_held_back_and_counted() {
        let limiter = RepeatLimiter::default();
        let t0 = Instant::now();
        for _ in 0..REPEATS_PER_WINDOW {
            assert_eq!(limiter.admit(1, t0), (true, 0));
        }
        assert_eq!(limiter.admit(1, t0), (false, 0));
        assert_eq!(limiter.admit(1, t0), (false, 0));
        assert_eq!(
            limiter.admit(2, t0),
            (true, 0),
            "another line is not held back"
        );
        assert_eq!(
            limiter.admit(1, t0 + REPEAT_WINDOW),
            (true, 2),
            "the count is told"
        );
    }

    #[test]
    fn wire_crates_are_capped_at_info() {
        use tracing::callsite::Identifier;
        use tracing::metadata::Kind;
        struct Cs;
        impl tracing::Callsite for Cs {
            fn set_interest(&self, _: tracing::subscriber::Interest) {}
            fn metadata(&self) -> &Metadata<'_> {
                unreachable!()
            }
        }
        static CS: Cs = Cs;
        let meta = |target: &'static str, level| {
            Metadata::new(
                "e",
                target,
                level,
                None,
                None,
                None,
                tracing::field::FieldSet::new(&[], Identifier(&CS)),
                Kind::EVENT,
            )
        };
        assert!(!reveals_nothing(&meta(
            "tungstenite::protocol",
            Level::TRACE
        )));
        assert!(!reveals_nothing(&meta("tokio_tungstenite", Level::DEBUG)));
        assert!(reveals_nothing(&meta("tungstenite::protocol", Level::INFO)));
        assert!(reveals_nothing(&meta("tungstenite_like", Level::TRACE)));
        assert!(reveals_nothing(&meta("clawmux::upstream", Level::TRACE)));
    }
}
