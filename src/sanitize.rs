//! The one sanitizer for text a human-facing command prints: every string
//! that came from the gateway or from a local client (session keys, run
//! ids, event and tool names, tool arguments, error codes and messages,
//! `client.id`/`displayName`/`version`...) goes through it before it
//! reaches a terminal, so nobody allowed to start a run can set the
//! window title, write the clipboard (OSC 52), move the cursor, or reverse
//! the text on the owner's screen.
//!
//! - C0 controls (and DEL) are shown escaped: `\e`, `\x07`, `\t`, `\r`,
//!   `\n` (a newline inside a field is not the line's own), `\x7f`.
//! - C1 controls (U+0080–U+009F) are shown as `\u{9b}`.
//! - Bidi controls and other invisible format characters (U+061C,
//!   U+200B–U+200F, U+202A–U+202E, U+2060–U+2064, U+2066–U+2069, U+FEFF)
//!   are shown as `\u{202e}`.
//! - [`field`] also cuts an overlong field with `…`.
//!
//! JSON outputs (`tail --json`, `--hud`, `status --json`, `call`,
//! `doctor --json`, `record`) go through [`json`] / [`json_pretty`] /
//! [`json_text`] instead: serde escapes C0 controls, `"` and `\` but
//! writes DEL, C1 and bidi characters raw (JSON allows them), so those are
//! written as `\u009b`, `\u202e`: the output stays exact JSON with the
//! same value, and shows nothing a terminal would act on.
//!
//! Hand-written: the crates that strip ANSI sequences (`strip-ansi-escapes`,
//! `console`) remove well-formed sequences but pass bare controls, C1 and
//! bidi characters through; this is one `match` over chars.

use std::borrow::Cow;
use std::fmt::{self, Write as _};

/// How one character is shown, if it must be escaped.
fn escape_of(c: char, keep_newline: bool) -> Option<Escaped> {
    Some(match c {
        '\n' if keep_newline => return None,
        '\x1b' => Escaped::Named("\\e"),
        '\t' => Escaped::Named("\\t"),
        '\r' => Escaped::Named("\\r"),
        '\n' => Escaped::Named("\\n"),
        '\0'..='\x1f' | '\x7f' => Escaped::Hex(c as u32),
        '\u{80}'..='\u{9f}'
        | '\u{061c}'
        | '\u{200b}'..='\u{200f}'
        | '\u{202a}'..='\u{202e}'
        | '\u{2060}'..='\u{2064}'
        | '\u{2066}'..='\u{2069}'
        | '\u{feff}' => Escaped::Unicode(c as u32),
        _ => return None,
    })
}

enum Escaped {
    Named(&'static str),
    Hex(u32),
    Unicode(u32),
}

impl fmt::Display for Escaped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Escaped::Named(s) => f.write_str(s),
            Escaped::Hex(n) => write!(f, "\\x{n:02x}"),
            Escaped::Unicode(n) => write!(f, "\\u{{{n:x}}}"),
        }
    }
}

/// Whether `s` would be shown as it is.
pub fn is_clean(s: &str) -> bool {
    !s.chars().any(|c| escape_of(c, false).is_some())
}

fn escape_into(out: &mut String, s: &str, keep_newline: bool) {
    for c in s.chars() {
        match escape_of(c, keep_newline) {
            Some(e) => {
                let _ = write!(out, "{e}");
            }
            None => out.push(c),
        }
    }
}

/// `s` with every control and invisible format character escaped
/// (newlines too: a field is one line).
pub fn text(s: &str) -> Cow<'_, str> {
    if is_clean(s) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    escape_into(&mut out, s, false);
    Cow::Owned(out)
}

/// Like [`text`], but keeps newlines: for a message of several lines the
/// command prints as they are (each line is still escaped).
pub fn lines(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| escape_of(c, true).is_some()) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    escape_into(&mut out, s, true);
    Cow::Owned(out)
}

/// [`text`], cut to at most `max_chars` characters of the original (the
/// escapes do not count against it) with `…` at the end when cut.
pub fn field(s: &str, max_chars: usize) -> Cow<'_, str> {
    match s.char_indices().nth(max_chars) {
        None => text(s),
        Some((at, _)) => {
            let mut out = String::with_capacity(at + 8);
            escape_into(&mut out, &s[..at], false);
            out.push('…');
            Cow::Owned(out)
        }
    }
}

/// A value that shows its text escaped when formatted: `format!("{}",
/// sanitize::Shown(name))`, without an allocation when it is clean.
#[derive(Debug, Clone, Copy)]
pub struct Shown<'a>(pub &'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            match escape_of(c, false) {
                Some(e) => write!(f, "{e}")?,
                None => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// `s` on one line for a preview: line breaks and tabs become spaces, every
/// other control and invisible character is escaped.
pub fn one_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' | '\r' | '\t' => out.push(' '),
            _ => match escape_of(c, false) {
                Some(e) => {
                    let _ = write!(out, "{e}");
                }
                None => out.push(c),
            },
        }
    }
    out
}

/// `s` in double quotes, like Rust's `{:?}`: `"` and `\` are escaped (so
/// a literal `\e` in the text is told apart from an escaped ESC) and every
/// control and invisible character is shown escaped as in [`text`].
pub fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            _ => match escape_of(c, false) {
                Some(e) => {
                    let _ = write!(out, "{e}");
                }
                None => out.push(c),
            },
        }
    }
    out.push('"');
    out
}

/// Which end of an overlong text a [`preview`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// The beginning, `…` at the end.
    Start,
    /// The end (of a cumulative text), `…` at the beginning.
    End,
}

/// A quoted one-line preview: line breaks and tabs as spaces, at most
/// `max_chars` characters of the original kept (cut with `…`), then
/// [`quoted`] (escapes do not count against the length and are never cut).
pub fn preview(s: &str, max_chars: usize, keep: Keep) -> String {
    let flat: String = s
        .chars()
        .map(|c| {
            if matches!(c, '\n' | '\r' | '\t') {
                ' '
            } else {
                c
            }
        })
        .collect();
    let n = flat.chars().count();
    if n <= max_chars {
        return quoted(&flat);
    }
    match keep {
        Keep::Start => {
            let head: String = flat.chars().take(max_chars).collect();
            quoted(&format!("{head}…"))
        }
        Keep::End => {
            let tail: String = flat.chars().skip(n - max_chars).collect();
            quoted(&format!("…{tail}"))
        }
    }
}

/// `value` as one line of JSON for a terminal: serde's compact text through
/// [`json_text`].
pub fn json(value: &serde_json::Value) -> String {
    json_text(&value.to_string()).into_owned()
}

/// `value` as indented JSON for a terminal: serde's pretty text through
/// [`json_text`].
pub fn json_pretty(value: &serde_json::Value) -> String {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    json_text(&text).into_owned()
}

/// JSON text (serialized here, or received as it is, like a `/v1/events`
/// record's `data`) with every character [`text`] would escape, but for
/// newlines and tabs, written as a JSON escape inside strings (`\u009b`,
/// `\u202e`, `\u007f`): the same JSON value, nothing a terminal acts on.
/// Outside strings, where valid JSON has only spaces, tabs, newlines and
/// carriage returns, a carriage return becomes a space (the same JSON; it
/// could otherwise overwrite the line) and any other such character (not
/// valid JSON anyway) is written as `\u001b` too.
pub fn json_text(s: &str) -> Cow<'_, str> {
    let changed = |c: char| escape_of(c, false).is_some() && !matches!(c, '\n' | '\t');
    if !s.chars().any(changed) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    let (mut in_string, mut escaped) = (false, false);
    for c in s.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if c == '\r' {
            out.push(' ');
            continue;
        }
        if changed(c) {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// For text a program's own formatter wrote (a log line): newlines and the
/// formatter's own SGR styles ([`OWN_SGR`]) are kept, every other control
/// and invisible character is escaped, so a value logged from a client or
/// the gateway cannot carry an OSC, a cursor move or a bidi override to the
/// terminal, nor an SGR that hides (`ESC[8m`) or recolours the line. The
/// values themselves are escaped before the line is formed
/// ([`crate::logging::EscapedFields`]): this keeps only what the formatter
/// could have written.
pub fn styled_lines(s: &str) -> Cow<'_, str> {
    if lines(s) == s {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(c) = rest.chars().next() {
        if c == '\x1b' {
            if let Some(len) = sgr_len(rest) {
                out.push_str(&rest[..len]);
                rest = &rest[len..];
                continue;
            }
        }
        match escape_of(c, true) {
            Some(e) => {
                let _ = write!(out, "{e}");
            }
            None => out.push(c),
        }
        rest = &rest[c.len_utf8()..];
    }
    Cow::Owned(out)
}

/// The SGR parameters the log formatter writes (`tracing-subscriber`
/// through `nu-ansi-term`): reset, bold, dimmed, italic, their ends, and
/// the level colours. Not conceal (8), reverse (7), background colours or
/// black, which could hide text.
const OWN_SGR: [&str; 13] = [
    "0", "1", "2", "3", "22", "23", "31", "32", "33", "34", "35", "36", "39",
];

/// The length of the SGR sequence `s` starts with, if it starts with one
/// made of [`OWN_SGR`] parameters only.
fn sgr_len(s: &str) -> Option<usize> {
    let body = s.strip_prefix("\x1b[")?;
    let len = body
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b';')
        .count();
    let own = body[..len].split(';').all(|p| OWN_SGR.contains(&p));
    (own && body.as_bytes().get(len) == Some(&b'm')).then_some(2 + len + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No character a terminal would act on or hide is left.
    fn visible(s: &str) -> bool {
        s.chars().all(|c| escape_of(c, false).is_none())
    }

    #[test]
    fn osc_and_csi_sequences_are_shown_escaped() {
        let key = "main\x1b]0;pwned\x07\x1b]52;c;aGk=\x07";
        let shown = text(key);
        assert_eq!(shown, "main\\e]0;pwned\\x07\\e]52;c;aGk=\\x07");
        assert!(visible(&shown));
        assert_eq!(text("\u{9b}31m"), "\\u{9b}31m", "C1 CSI");
        assert_eq!(text("a\tb\r\nc\x7f"), "a\\tb\\r\\nc\\x7f");
        assert_eq!(Shown("\x1b[2J").to_string(), "\\e[2J");
    }

    #[test]
    fn bidi_and_invisible_characters_are_escaped() {
        assert_eq!(text("abc\u{202e}fed"), "abc\\u{202e}fed");
        for c in [
            '\u{061c}', '\u{200b}', '\u{200f}', '\u{202a}', '\u{2066}', '\u{2069}', '\u{feff}',
        ] {
            let s = c.to_string();
            assert!(visible(&text(&s)), "{:?}", c);
            assert_ne!(text(&s), s);
        }
        // Ordinary non-ASCII text is kept.
        assert_eq!(text("Grüße — 日本 ✓"), "Grüße — 日本 ✓");
        assert!(matches!(text("plain"), Cow::Borrowed(_)));
    }

    #[test]
    fn lines_keep_their_newlines_only() {
        assert_eq!(lines("one\ntwo\x1b]0;x\x07"), "one\ntwo\\e]0;x\\x07");
    }

    #[test]
    fn fields_are_cut_with_an_ellipsis() {
        assert_eq!(field("abcdef", 3), "abc…");
        assert_eq!(field("abc", 3), "abc");
        assert_eq!(field("ab\x1bcd", 3), "ab\\e…");
        assert_eq!(field("日本語です", 2), "日本…");
    }

    #[test]
    fn previews_flatten_quote_and_cut_without_splitting_an_escape() {
        assert_eq!(preview("Hello\nthere", 60, Keep::Start), "\"Hello there\"");
        assert_eq!(preview("abcdef", 3, Keep::Start), "\"abc…\"");
        assert_eq!(preview("abcdef", 3, Keep::End), "\"…def\"");
        assert_eq!(
            preview("a\u{202e}b\x1b]0;x\x07", 60, Keep::Start),
            "\"a\\u{202e}b\\e]0;x\\x07\""
        );
        assert_eq!(quoted(r#"say "\e""#), r#""say \"\\e\"""#);
        assert_eq!(one_line("a\nb\u{9b}"), "a b\\u{9b}");
    }

    #[test]
    fn json_outputs_escape_c1_del_and_bidi_and_keep_their_value() {
        let hostile =
            "a\u{9b}31m\u{7f}\u{202e}\u{2066}\u{200e}\u{200f}\u{61c}\u{85}\x1b]0;x\x07 Grüße";
        let value = serde_json::json!({"k\u{202a}": hostile, "n": [1, "\u{9d}"]});
        let raw = value.to_string();
        assert!(raw.contains('\u{9b}'), "serde writes C1 raw: {raw:?}");
        for out in [json(&value), json_pretty(&value)] {
            assert!(visible(&out.replace('\n', "")), "{out:?}");
            for escape in [
                "\\u009b", "\\u007f", "\\u202e", "\\u2066", "\\u200e", "\\u200f", "\\u061c",
                "\\u202a", "\\u009d", "\\u001b",
            ] {
                assert!(out.contains(escape), "{escape} in {out}");
            }
            assert!(out.contains("Grüße"), "ordinary text is kept: {out}");
            let back: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(back, value, "the same JSON value");
        }
        assert!(json_pretty(&value).contains('\n'));
        assert!(!json(&value).contains('\n'));
        assert!(matches!(json_text(r#"{"a":"plain"}"#), Cow::Borrowed(_)));
    }

    #[test]
    fn json_text_received_as_is_is_escaped_in_and_out_of_strings() {
        // An escaped quote does not end the string; a CR between tokens
        // (valid JSON) becomes a space.
        let text = "{\"a\":\"x\\\"\u{9b}\",\r\"b\":\"\\\\\u{202e}\"}";
        let out = json_text(text);
        assert_eq!(out, "{\"a\":\"x\\\"\\u009b\", \"b\":\"\\\\\\u202e\"}");
        let back: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(back["a"], "x\"\u{9b}");
        assert_eq!(back["b"], "\\\u{202e}");
        // Not JSON at all: still nothing raw.
        assert!(visible(&json_text("\x1b[2J\u{9b}")));
    }

    #[test]
    fn log_lines_keep_colours_and_newlines_only() {
        let line = "\x1b[2m10:00\x1b[0m \x1b[32mINFO\x1b[0m client=\x1b]0;x\x07\u{202e}\n";
        assert_eq!(
            styled_lines(line),
            "\x1b[2m10:00\x1b[0m \x1b[32mINFO\x1b[0m client=\\e]0;x\\x07\\u{202e}\n"
        );
        assert_eq!(styled_lines("\x1b[2Jx"), "\\e[2Jx", "only SGR is kept");
        // Only the formatter's own styles: not conceal, reverse, black or
        // a background, nor an empty reset.
        for hiding in [
            "\x1b[8m",
            "\x1b[7m",
            "\x1b[30m",
            "\x1b[2;40m",
            "\x1b[38;5;0m",
            "\x1b[m",
        ] {
            let shown = styled_lines(hiding);
            assert!(shown.starts_with("\\e["), "{hiding:?} shown as {shown:?}");
        }
        assert_eq!(
            styled_lines("\x1b[1;32mok\x1b[22;0m"),
            "\x1b[1;32mok\x1b[22;0m"
        );
        assert!(matches!(styled_lines("plain\n"), Cow::Borrowed(_)));
    }
}
