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

impl Recording {
    /// Reads a recording file.
    pub fn load(path: &std::path::Path) -> Result<Recording, RecordingError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RecordingError(format!("cannot read the recording {}: {e}", path.display()))
        })?;
        Recording::parse(&text)
            .map_err(|e| RecordingError(format!("recording {}: {e}", path.display())))
    }

    /// Parses the text of a recording.
    pub fn parse(text: &str) -> Result<Recording, RecordingError> {
        let mut lines: Vec<(usize, &str)> = text
            .split('\n')
            .enumerate()
            .map(|(i, l)| (i + 1, l))
            .filter(|(_, l)| !l.trim().is_empty())
            .collect();
        let complete = text.ends_with('\n');
        let mut warnings = Vec::new();
        let mut values = Vec::with_capacity(lines.len());
        let last_number = lines.last().map(|(n, _)| *n);
        for (number, line) in lines.drain(..) {
            match serde_json::from_str::<Value>(line) {
                Ok(v) => values.push((number, v)),
                Err(_) if !complete && Some(number) == last_number && number > 1 => {
                    warnings.push(format!(
                        "line {number} is incomplete (the recording was cut off mid-line); it was skipped"
                    ));
                }
                Err(e) => return Err(RecordingError(format!("line {number} is not JSON: {e}"))),
            }
        }
        let mut values = values.into_iter();
        let Some((_, header)) = values.next() else {
            return Err(RecordingError("empty: expected a header line first".into()));
        };
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
        let mut rec = Recording {
            header,
            hello,
            warnings,
            ..Recording::default()
        };
        let mut first_ms: Option<u64> = None;
        // Request id → index in `exchanges`.
        let mut by_id = std::collections::HashMap::new();
        for (number, line) in values {
            let ms = line.get("ms").and_then(Value::as_u64).unwrap_or(0);
            let at = |first: &mut Option<u64>| ms.saturating_sub(*first.get_or_insert(ms));
            let dir = line.get("dir").and_then(Value::as_str).unwrap_or("");
            if line.get("gap").is_some() {
                rec.timeline.push(Played::Gap {
                    at_ms: at(&mut first_ms),
                });
                continue;
            }
            let Some(frame) = line.get("frame") else {
                continue;
            };
            match (dir, frame.get("type").and_then(Value::as_str)) {
                ("in", Some("event")) => {
                    let Some(event) = frame.get("event").and_then(Value::as_str) else {
                        return Err(RecordingError(format!(
                            "line {number}: event without a name"
                        )));
                    };
                    rec.timeline.push(Played::Event {
                        at_ms: at(&mut first_ms),
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
                    by_id.insert(id, rec.exchanges.len());
                    rec.exchanges.push(Exchange {
                        method: method.to_owned(),
                        params: frame.get("params").cloned().unwrap_or(Value::Null),
                        answers: Vec::new(),
                    });
                }
                ("in", Some("res")) => {
                    let id = frame.get("id").map(Value::to_string).unwrap_or_default();
                    // An answer to a request sent before the recording began.
                    let Some(&i) = by_id.get(&id) else { continue };
                    let ok = frame.get("ok").and_then(Value::as_bool).unwrap_or(false);
                    let body = if ok {
                        frame.get("payload").cloned().unwrap_or(Value::Null)
                    } else {
                        frame.get("error").cloned().unwrap_or(Value::Null)
                    };
                    rec.exchanges[i].answers.push((ok, body));
                }
                _ => {}
            }
        }
        // A request never answered while recording has nothing to replay.
        rec.exchanges.retain(|e| !e.answers.is_empty());
        Ok(rec)
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
}
