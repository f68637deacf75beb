//! The recording format `clawmux record` writes and the double replays
//! (README "Record and replay"): JSON Lines, version [`VERSION`].
//!
//! Line 1 is the header:
//! `{"format":"clawmux-recording","version":1,"gateway_version":…,"broker_version":…,
//!   "started_at":"<RFC 3339>","started_ms":…,"hello":<hello-ok payload>,…}`.
//! Every other line is one frame or marker, in the order the broker saw them:
//! - `{"ms":…,"dir":"in","cursor":N,"frame":<event frame>}`: a gateway event
//!   (`cursor` is the broker's event cursor; absent for an event the broker
//!   sent only to some clients, e.g. `session.tool`);
//! - `{"ms":…,"dir":"out","frame":<req frame>}` / `{"ms":…,"dir":"in","frame":<res frame>}`:
//!   a request sent to the gateway through the broker and its answer(s),
//!   paired by the frame `id`;
//! - `{"ms":…,"dir":"in","gap":{"after":A,"next":B}}`: events were lost here;
//! - `{"ms":…,"end":"<why>"}`: the recorder stopped on purpose.
//!
//! Readers ignore fields and line kinds they do not know; a newer `version`
//! is refused. A last line cut short (the recorder was killed mid-write) is
//! reported in [`Recording::warnings`] and skipped; a broken line anywhere
//! else is an error.

use serde_json::Value;

/// The `format` value of a header line.
pub const FORMAT: &str = "clawmux-recording";
/// The format version this crate writes and reads (and every older one).
pub const VERSION: u64 = 1;

/// What a playing connection sends, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Played {
    /// A gateway event, `at_ms` after the recording's first timeline item.
    Event {
        at_ms: u64,
        event: String,
        payload: Value,
        state_version: Option<Value>,
    },
    /// One `seq` is skipped here (the recorded stream had a hole).
    Gap { at_ms: u64 },
}

impl Played {
    pub fn at_ms(&self) -> u64 {
        match self {
            Played::Event { at_ms, .. } | Played::Gap { at_ms } => *at_ms,
        }
    }
}

/// A recorded request and the answer frames the gateway gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    pub method: String,
    /// `null` when the request had none.
    pub params: Value,
    /// Each answer as `(ok, payload or error)`, in order (`agent` answers twice).
    pub answers: Vec<(bool, Value)>,
}

/// A parsed recording.
#[derive(Debug, Clone, Default)]
pub struct Recording {
    /// The header line as written.
    pub header: Value,
    /// The recorded `hello-ok` payload (`{}` when the header had none).
    pub hello: Value,
    pub timeline: Vec<Played>,
    /// Answered requests, in the order they were sent.
    pub exchanges: Vec<Exchange>,
    /// Problems that did not stop the parse (a cut-off last line).
    pub warnings: Vec<String>,
}

/// Why a recording cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordingError(pub String);

impl std::fmt::Display for RecordingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RecordingError {}

/// Largest recording file served: a replay holds its events and answers in
/// memory (parsed, several times the file's size), so a bigger file is
/// refused with this limit named; cut long sessions with `clawmux record
/// --max-bytes`.
pub const MAX_RECORDING_BYTES: u64 = 64 * 1024 * 1024;

/// Longest line read (one frame; the gateway's own `maxPayload` is 25 MiB).
/// The file is read line by line, never whole.
pub const MAX_LINE_BYTES: usize = 32 * 1024 * 1024;

/// Bad lines reported one by one; past this they are only counted.
const BAD_LINES_SHOWN: usize = 20;

impl Recording {
    /// Reads a recording file: a regular file of at most
    /// [`MAX_RECORDING_BYTES`], line by line.
    pub fn load(path: &std::path::Path) -> Result<Recording, RecordingError> {
        use std::io::{BufRead as _, Read as _};
        use std::os::unix::fs::OpenOptionsExt as _;
        let cannot = |why: String| {
            RecordingError(format!(
                "cannot read the recording {}: {why}",
                path.display()
            ))
        };
        // O_NONBLOCK: opening a FIFO does not wait for a writer.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc_o_nonblock())
            .open(path)
            .map_err(|e| cannot(e.to_string()))?;
        let meta = file.metadata().map_err(|e| cannot(e.to_string()))?;
        if !meta.is_file() {
            return Err(cannot("it is not a regular file".into()));
        }
        if meta.len() > MAX_RECORDING_BYTES {
            return Err(cannot(format!(
                "it is {} MiB, above the {} MiB a replay holds in memory; record a shorter session (clawmux record --max-bytes)",
                meta.len().div_ceil(1024 * 1024),
                MAX_RECORDING_BYTES / (1024 * 1024)
            )));
        }
        let mut reader = std::io::BufReader::new(file.take(MAX_RECORDING_BYTES + 1));
        let mut parser = Parser::default();
        let mut buf = Vec::new();
        let mut number = 0;
        loop {
            buf.clear();
            let n = (&mut reader)
                .take(MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| cannot(e.to_string()))?;
            if n == 0 {
                break;
            }
            number += 1;
            if buf.len() > MAX_LINE_BYTES {
                return Err(RecordingError(format!(
                    "recording {}: line {number} is longer than {} MiB",
                    path.display(),
                    MAX_LINE_BYTES / (1024 * 1024)
                )));
            }
            let complete = buf.last() == Some(&b'\n');
            let line = String::from_utf8_lossy(&buf);
            parser
                .line(number, &line, complete)
                .map_err(|e| RecordingError(format!("recording {}: {e}", path.display())))?;
        }
        parser
            .finish()
            .map_err(|e| RecordingError(format!("recording {}: {e}", path.display())))
    }

    /// Parses the text of a recording.
    pub fn parse(text: &str) -> Result<Recording, RecordingError> {
        let mut parser = Parser::default();
        let mut rest = text;
        let mut number = 0;
        while !rest.is_empty() {
            number += 1;
            let (line, complete, next) = match rest.find('\n') {
                Some(at) => (&rest[..at], true, &rest[at + 1..]),
                None => (rest, false, ""),
            };
            parser.line(number, line, complete)?;
            rest = next;
        }
        parser.finish()
    }

    /// The recorded gateway version (header `gateway_version`).
    pub fn gateway_version(&self) -> Option<&str> {
        self.header.get("gateway_version").and_then(Value::as_str)
    }

    /// The exchanges recorded for `method` with exactly these `params`
    /// (absent params match `null`).
    pub fn matching(&self, method: &str, params: &Value) -> Vec<usize> {
        self.exchanges
            .iter()
            .enumerate()
            .filter(|(_, e)| e.method == method && &e.params == params)
            .map(|(i, _)| i)
            .collect()
    }
}

/// `O_NONBLOCK`, as `open(2)` takes it.
fn libc_o_nonblock() -> i32 {
    // Linux and the BSDs differ; std exposes no constant, the OS does.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        0o4000
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        0x0004
    }
}

/// Builds a [`Recording`] one line at a time (a file is never held whole).
#[derive(Default)]
struct Parser {
    rec: Option<Recording>,
    /// A line that was not JSON: fine only if it is the last one and was
    /// cut short (the recorder was killed mid-write).
    broken: Option<(usize, String, bool)>,
    first_ms: Option<u64>,
    /// Request id → index in `exchanges`.
    by_id: std::collections::HashMap<String, usize>,
    /// Lines that could not be used (reported as warnings).
    bad_lines: usize,
    first_bad: Option<String>,
}

impl Parser {
    fn line(&mut self, number: usize, line: &str, complete: bool) -> Result<(), RecordingError> {
        if line.trim().is_empty() {
            return Ok(());
        }
        if let Some((n, e, _)) = self.broken.take() {
            return Err(RecordingError(format!("line {n} is not JSON: {e}")));
        }
        let value = match serde_json::from_str::<Value>(line) {
            Ok(v) => v,
            Err(e) => {
                if number == 1 || self.rec.is_none() {
                    return Err(RecordingError(format!("line {number} is not JSON: {e}")));
                }
                self.broken = Some((number, e.to_string(), complete));
                return Ok(());
            }
        };
        match &mut self.rec {
            None => {
                self.rec = Some(header(value)?);
                Ok(())
            }
            Some(_) => self.item(number, value),
        }
    }

    fn bad(&mut self, number: usize, why: &str) {
        self.bad_lines += 1;
        let text = format!("line {number}: {why}; skipped");
        if self.first_bad.is_none() {
            self.first_bad = Some(text.clone());
        }
        let rec = self.rec.as_mut().expect("after the header");
        if self.bad_lines <= BAD_LINES_SHOWN {
            rec.warnings.push(text);
        }
    }

    fn item(&mut self, number: usize, line: Value) -> Result<(), RecordingError> {
        let ms = line.get("ms").and_then(Value::as_u64).unwrap_or(0);
        let first_ms = &mut self.first_ms;
        let mut at = || ms.saturating_sub(*first_ms.get_or_insert(ms));
        let dir = line.get("dir").and_then(Value::as_str).unwrap_or("");
        let rec = self.rec.as_mut().expect("after the header");
        if line.get("gap").is_some() {
            rec.timeline.push(Played::Gap { at_ms: at() });
            return Ok(());
        }
        let Some(frame) = line.get("frame") else {
            // Another kind of line (`end`, or one a newer recorder writes).
            return Ok(());
        };
        if !frame.is_object() {
            self.bad(number, "its frame is not a JSON object");
            return Ok(());
        }
        match (dir, frame.get("type").and_then(Value::as_str)) {
            ("in", Some("event")) => {
                let Some(event) = frame.get("event").and_then(Value::as_str) else {
                    return Err(RecordingError(format!(
                        "line {number}: event without a name"
                    )));
                };
                rec.timeline.push(Played::Event {
                    at_ms: at(),
                    event: event.to_owned(),
                    payload: frame.get("payload").cloned().unwrap_or(Value::Null),
                    state_version: frame.get("stateVersion").cloned(),
                });
            }
            ("out", Some("req")) => {
                let (Some(id), Some(method)) = (
                    frame.get("id").map(Value::to_string),
                    frame.get("method").and_then(Value::as_str),
                ) else {
                    return Err(RecordingError(format!(
                        "line {number}: request without id or method"
                    )));
                };
                self.by_id.insert(id, rec.exchanges.len());
                rec.exchanges.push(Exchange {
                    method: method.to_owned(),
                    params: frame.get("params").cloned().unwrap_or(Value::Null),
                    answers: Vec::new(),
                });
            }
            ("in", Some("res")) => {
                let id = frame.get("id").map(Value::to_string).unwrap_or_default();
                // An answer to a request sent before the recording began.
                let Some(&i) = self.by_id.get(&id) else {
                    return Ok(());
                };
                let ok = frame.get("ok").and_then(Value::as_bool).unwrap_or(false);
                let body = if ok {
                    frame.get("payload").cloned().unwrap_or(Value::Null)
                } else {
                    frame.get("error").cloned().unwrap_or(Value::Null)
                };
                rec.exchanges[i].answers.push((ok, body));
            }
            (_, None) => self.bad(number, "its frame has no \"type\""),
            ("in" | "out", Some(_)) => {}
            _ => self.bad(number, "its \"dir\" is neither \"in\" nor \"out\""),
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Recording, RecordingError> {
        let Some(mut rec) = self.rec.take() else {
            return Err(RecordingError("empty: expected a header line first".into()));
        };
        if let Some((number, e, complete)) = self.broken.take() {
            if complete {
                return Err(RecordingError(format!("line {number} is not JSON: {e}")));
            }
            rec.warnings.push(format!(
                "line {number} is incomplete (the recording was cut off mid-line); it was skipped"
            ));
        }
        if self.bad_lines > BAD_LINES_SHOWN {
            rec.warnings.push(format!(
                "{} more lines were skipped for the same reasons",
                self.bad_lines - BAD_LINES_SHOWN
            ));
        }
        // A request never answered while recording has nothing to replay.
        rec.exchanges.retain(|e| !e.answers.is_empty());
        if rec.timeline.is_empty() && rec.exchanges.is_empty() && self.bad_lines > 0 {
            return Err(RecordingError(format!(
                "nothing to replay: none of its {} frame lines is usable ({})",
                self.bad_lines,
                self.first_bad.unwrap_or_default()
            )));
        }
        Ok(rec)
    }
}

/// Checks the header line and starts the recording.
fn header(header: Value) -> Result<Recording, RecordingError> {
    if header.get("format").and_then(Value::as_str) != Some(FORMAT) {
        return Err(RecordingError(format!(
            "line 1 is not a {FORMAT} header (\"format\":\"{FORMAT}\" expected)"
        )));
    }
    let version = header.get("version").and_then(Value::as_u64).unwrap_or(0);
    if version == 0 || version > VERSION {
        return Err(RecordingError(format!(
            "format version {} is not one this clawmux reads (1 to {VERSION}); use a newer clawmux",
            header.get("version").unwrap_or(&Value::Null)
        )));
    }
    let hello = header
        .get("hello")
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| Value::Object(Default::default()));
    Ok(Recording {
        header,
        hello,
        ..Recording::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = r#"{"format":"clawmux-recording","version":1,"gateway_version":"2026.9.6","started_ms":1000,"hello":{"type":"hello-ok"}}"#;

    #[test]
    fn events_answers_and_gaps() {
        let text = format!(
            "{HEADER}\n{}\n{}\n{}\n{}\n{}\n",
            r#"{"ms":1500,"dir":"in","cursor":3,"frame":{"type":"event","event":"chat","payload":{"a":1}}}"#,
            r#"{"ms":1600,"dir":"out","frame":{"type":"req","id":"cm-1","method":"health"}}"#,
            r#"{"ms":1610,"dir":"in","frame":{"type":"res","id":"cm-1","ok":true,"payload":{"ok":true}}}"#,
            r#"{"ms":1700,"dir":"in","gap":{"after":3,"next":5}}"#,
            r#"{"ms":1800,"dir":"in","cursor":5,"frame":{"type":"event","event":"tick","payload":{},"stateVersion":{"presence":1,"health":1}}}"#,
        );
        let rec = Recording::parse(&text).unwrap();
        assert!(rec.warnings.is_empty());
        assert_eq!(rec.gateway_version(), Some("2026.9.6"));
        assert_eq!(rec.timeline.len(), 3);
        assert_eq!(rec.timeline[0].at_ms(), 0);
        assert_eq!(rec.timeline[1], Played::Gap { at_ms: 200 });
        assert_eq!(rec.timeline[2].at_ms(), 300);
        assert_eq!(rec.matching("health", &Value::Null), vec![0]);
        assert_eq!(
            rec.exchanges[0].answers,
            vec![(true, serde_json::json!({"ok":true}))]
        );
    }

    #[test]
    fn a_cut_off_last_line_is_a_warning_elsewhere_an_error() {
        let cut = format!("{HEADER}\n{{\"ms\":1500,\"dir\":\"in\",\"fra");
        let rec = Recording::parse(&cut).unwrap();
        assert_eq!(rec.warnings.len(), 1);
        assert!(rec.warnings[0].contains("line 2"), "{:?}", rec.warnings);
        let broken = format!("{HEADER}\n{{\"ms\":1500,\n{HEADER}\n");
        let e = Recording::parse(&broken).unwrap_err();
        assert!(e.0.contains("line 2 is not JSON"), "{e}");
    }

    #[test]
    fn headers_are_checked() {
        assert!(Recording::parse("").unwrap_err().0.contains("empty"));
        assert!(Recording::parse("{\"x\":1}\n")
            .unwrap_err()
            .0
            .contains("not a clawmux-recording header"));
        let newer = r#"{"format":"clawmux-recording","version":2}"#;
        assert!(Recording::parse(newer)
            .unwrap_err()
            .0
            .contains("format version 2"));
    }

    #[test]
    fn lines_whose_frame_is_not_an_object_are_reported_and_all_bad_fails() {
        let good = r#"{"ms":1500,"dir":"in","cursor":3,"frame":{"type":"event","event":"chat","payload":{}}}"#;
        let text = format!(
            "{HEADER}\n{}\n{good}\n{}\n",
            r#"{"ms":1400,"dir":"in","frame":"not an object"}"#,
            r#"{"ms":1600,"dir":"in","frame":{"event":"chat"}}"#,
        );
        let rec = Recording::parse(&text).unwrap();
        assert_eq!(rec.timeline.len(), 1);
        assert_eq!(
            rec.warnings,
            [
                "line 2: its frame is not a JSON object; skipped",
                "line 4: its frame has no \"type\"; skipped"
            ]
        );
        let text = format!("{HEADER}\n{}\n", r#"{"ms":1,"dir":"in","frame":[1]}"#);
        let e = Recording::parse(&text).unwrap_err();
        assert_eq!(
            e.0,
            "nothing to replay: none of its 1 frame lines is usable (line 2: its frame is not a JSON object; skipped)"
        );
    }

    #[test]
    fn files_are_read_line_by_line_and_only_regular_ones_under_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        let event =
            r#"{"ms":1500,"dir":"in","frame":{"type":"event","event":"tick","payload":{}}}"#;
        let mut text = format!("{HEADER}\n");
        for _ in 0..1000 {
            text.push_str(event);
            text.push('\n');
        }
        text.push_str("{\"ms\":15"); // cut off mid-line
        std::fs::write(&path, &text).unwrap();
        let rec = Recording::load(&path).unwrap();
        assert_eq!(rec.timeline.len(), 1000);
        assert!(
            rec.warnings[0].contains("line 1002 is incomplete"),
            "{:?}",
            rec.warnings
        );

        let big = dir.path().join("big.jsonl");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_RECORDING_BYTES + 1).unwrap(); // sparse: nothing is written
        let e = Recording::load(&big).unwrap_err();
        assert!(
            e.0.contains("above the 64 MiB a replay holds in memory"),
            "{e}"
        );

        let e = Recording::load(std::path::Path::new("/dev/zero")).unwrap_err();
        assert!(e.0.contains("not a regular file"), "{e}");
    }
}
