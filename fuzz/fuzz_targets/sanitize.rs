//! The sanitizer (`clawmux::sanitize`) as a property: whatever a gateway
//! or a client sends, no C0 control, DEL, C1 control or bidi control
//! (Unicode's `Bidi_Control`: U+061C, U+200E/F, U+202A–E, U+2066–9)
//! reaches a terminal through any of its functions, except what each one
//! documents keeping (`lines`: newlines; `styled_lines`: newlines and SGR
//! colour sequences). `quoted` is also reversible: its escapes read back
//! to the original text, so two texts never print alike. The JSON escaper
//! (`json`, `json_pretty`, `json_text`) keeps the JSON value it escapes
//! and lets nothing through but newlines and tabs.
#![no_main]

use clawmux::sanitize::{self, Keep};
use libfuzzer_sys::fuzz_target;

/// The characters that must not survive, by their definitions (not the
/// sanitizer's own table).
fn forbidden(c: char) -> bool {
    c.is_control() // C0, DEL and C1 (general category Cc)
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn assert_clean(what: &str, out: &str) {
    if let Some(c) = out.chars().find(|&c| forbidden(c)) {
        panic!("{what}: {c:?} survived in {out:?}");
    }
}

/// `styled_lines` keeps newlines and `ESC [ <digits/;> m`, nothing else.
fn assert_styled_clean(out: &str) {
    let mut rest = out;
    while let Some(c) = rest.chars().next() {
        if c == '\x1b' {
            let body = rest.strip_prefix("\x1b[").expect("ESC only starts an SGR");
            let params = body
                .bytes()
                .take_while(|b| b.is_ascii_digit() || *b == b';')
                .count();
            assert_eq!(
                body.as_bytes().get(params),
                Some(&b'm'),
                "ESC only starts an SGR: {out:?}"
            );
            rest = &body[params + 1..];
            continue;
        }
        assert!(
            c == '\n' || !forbidden(c),
            "styled_lines: {c:?} survived in {out:?}"
        );
        rest = &rest[c.len_utf8()..];
    }
}

/// Reads back what `quoted` wrote.
fn unquote(q: &str) -> String {
    let inner = q
        .strip_prefix('"')
        .and_then(|q| q.strip_suffix('"'))
        .expect("in quotes");
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            assert_ne!(c, '"', "a bare quote inside: {q:?}");
            out.push(c);
            continue;
        }
        match chars.next().expect("an escape is complete") {
            '\\' => out.push('\\'),
            '"' => out.push('"'),
            'e' => out.push('\x1b'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            'n' => out.push('\n'),
            'x' => {
                let hex: String = chars.by_ref().take(2).collect();
                out.push(char::from(u8::from_str_radix(&hex, 16).expect("\\xNN")));
            }
            'u' => {
                assert_eq!(chars.next(), Some('{'));
                let hex: String = chars.by_ref().take_while(|&c| c != '}').collect();
                out.push(char::from_u32(u32::from_str_radix(&hex, 16).expect("\\u{hex}")).unwrap());
            }
            other => panic!("unknown escape \\{other} in {q:?}"),
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, bytes)) = data.split_first() else {
        return;
    };
    let s = String::from_utf8_lossy(bytes);
    let max = usize::from(n);
    assert_clean("text", &sanitize::text(&s));
    assert!(sanitize::is_clean(&sanitize::text(&s)));
    assert_eq!(sanitize::is_clean(&s), sanitize::text(&s) == s);
    assert_clean("field", &sanitize::field(&s, max));
    assert_clean("Shown", &sanitize::Shown(&s).to_string());
    assert_eq!(sanitize::Shown(&s).to_string(), sanitize::text(&s));
    assert_clean("one_line", &sanitize::one_line(&s));
    let quoted = sanitize::quoted(&s);
    assert_clean("quoted", &quoted);
    assert_eq!(unquote(&quoted), s, "quoted reads back");
    for keep in [Keep::Start, Keep::End] {
        assert_clean("preview", &sanitize::preview(&s, max, keep));
    }
    for line in sanitize::lines(&s).split('\n') {
        assert_clean("lines", line);
    }
    assert_styled_clean(&sanitize::styled_lines(&s));
    // The JSON escaper: the same JSON, nothing a terminal acts on but
    // newlines and tabs. Outputs are compared with what they escape, both
    // parsed alike: serde_json's float parsing does not round-trip every
    // number, so `parse(json(v)) == v` would fail for reasons of its own.
    let parse = |t: &str| serde_json::from_str::<serde_json::Value>(t).expect("JSON");
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&s) {
        let compact = v.to_string();
        let pretty = serde_json::to_string_pretty(&v).expect("a value serializes");
        for (out, of) in [
            (sanitize::json(&v), compact),
            (sanitize::json_pretty(&v), pretty),
            (sanitize::json_text(&s).into_owned(), s.to_string()),
        ] {
            assert_eq!(parse(&out), parse(&of), "the same JSON: {out:?}");
            for part in out.split(['\n', '\t']) {
                assert_clean("json", part);
            }
        }
    }
    // Any text, JSON or not.
    for part in sanitize::json_text(&s).split(['\n', '\t']) {
        assert_clean("json_text", part);
    }
});
