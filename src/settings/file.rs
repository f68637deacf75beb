//! The file model: `config.toml`'s sections as they are parsed (unknown keys
//! are errors, with the nearest real key suggested), and the readers of the
//! other settings files (Claw3D's JSON, OpenClaw's JSON5), whose errors name
//! the file and the position, never the contents.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::protocol::{ErrorShape, StudioCode};

/// `config.toml`. Unknown keys are errors, so a typo is reported, not ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ConfigFile {
    pub(super) socket: Option<PathBuf>,
    #[serde(default)]
    pub(super) gateway: GatewaySection,
    #[serde(default)]
    pub(super) limits: LimitsSection,
    #[serde(default)]
    pub(super) upstream: UpstreamSection,
    /// Further sockets, each with its own policy (`[[sockets]]`).
    #[serde(default)]
    pub(super) sockets: Vec<SocketSection>,
}

/// One `[[sockets]]` entry: a further socket whose clients get at most
/// this policy.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SocketSection {
    pub(super) name: String,
    pub(super) path: PathBuf,
    /// Octal, as a string (`"0660"`); default 0600.
    pub(super) mode: Option<String>,
    #[serde(default)]
    pub(super) uids: Vec<u32>,
    #[serde(default)]
    pub(super) gids: Vec<u32>,
    pub(super) scopes: Option<Vec<String>>,
    #[serde(default)]
    pub(super) allow_methods: Vec<String>,
    #[serde(default)]
    pub(super) deny_methods: Vec<String>,
    /// Observer powers (the request tap, `tool_events=all`); default off.
    #[serde(default)]
    pub(super) observe: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GatewaySection {
    pub(super) url: Option<String>,
    pub(super) token: Option<String>,
    pub(super) token_file: Option<PathBuf>,
    pub(super) password: Option<String>,
    pub(super) tls_fingerprint: Option<String>,
    pub(super) tls_ca_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LimitsSection {
    pub(super) connect_timeout_ms: Option<u64>,
    pub(super) connect_wait_ms: Option<u64>,
    pub(super) request_timeout_ms: Option<u64>,
    pub(super) run_timeout_ms: Option<u64>,
    pub(super) preconnect_max_bytes: Option<usize>,
    pub(super) max_frame_bytes: Option<usize>,
    pub(super) queue_soft_bytes: Option<usize>,
    pub(super) queue_hard_bytes: Option<usize>,
    pub(super) slow_grace_ms: Option<u64>,
    pub(super) queue_total_bytes: Option<usize>,
    pub(super) max_clients: Option<usize>,
    pub(super) max_inflight: Option<usize>,
    pub(super) request_rate: Option<u32>,
    pub(super) request_burst: Option<u32>,
    pub(super) replay_max_events: Option<usize>,
    pub(super) replay_max_bytes: Option<usize>,
    pub(super) replay_persist: Option<bool>,
    pub(super) sse_keepalive_ms: Option<u64>,
    pub(super) max_connections: Option<usize>,
    pub(super) header_read_timeout_ms: Option<u64>,
    pub(super) max_dedicated: Option<usize>,
    pub(super) send_buffer_bytes: Option<usize>,
    pub(super) upstream_open_rate: Option<u32>,
    pub(super) upstream_open_burst: Option<u32>,
    pub(super) upstream_open_rate_total: Option<u32>,
    pub(super) upstream_open_burst_total: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UpstreamSection {
    pub(super) handshake_timeout_ms: Option<u64>,
    pub(super) backoff_initial_ms: Option<u64>,
    pub(super) backoff_max_ms: Option<u64>,
    pub(super) write_timeout_ms: Option<u64>,
    pub(super) max_frame_bytes: Option<usize>,
    pub(super) device_identity: Option<bool>,
    pub(super) state_dir: Option<PathBuf>,
    pub(super) dedicated_origin: Option<String>,
}

pub(super) fn load_failed(path: &Path, why: impl std::fmt::Display) -> ErrorShape {
    ErrorShape::studio(
        StudioCode::SettingsLoadFailed,
        format!(
            "cannot load settings from {}: {why}; fix or remove the file",
            path.display()
        ),
    )
}

/// Reads a settings file: `None` when it does not exist. Only a regular
/// file of at most [`crate::files::CONFIG_MAX_BYTES`] is read (a FIFO or
/// `/dev/zero` is refused at once).
pub(super) fn read_optional(path: &Path) -> Result<Option<String>, ErrorShape> {
    crate::files::read_optional_string(path, crate::files::CONFIG_MAX_BYTES)
        .map_err(|e| load_failed(path, e))
}

/// Blanks quoted text in a parser message: serde messages can quote the
/// offending value, and that value may be a token.
pub(super) fn scrub(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    for c in message.chars() {
        if c == '"' || c == '`' {
            if !quoted {
                out.push_str("\"…\"");
            }
            quoted = !quoted;
        } else if !quoted {
            out.push(c);
        }
    }
    out
}

pub(super) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

pub(super) fn parse_toml(path: &Path, text: &str) -> Result<ConfigFile, ErrorShape> {
    toml::from_str(text).map_err(|e| {
        let start = e.span().map(|s| s.start);
        let at = start
            .map(|start| {
                let (l, c) = line_col(text, start);
                format!(" at line {l} column {c}")
            })
            .unwrap_or_default();
        let message = e.message().trim();
        let key = error_key(&e);
        let why = if let Some((key, valid)) = unknown_key(message) {
            // `[limts]`: the unknown key is a table header.
            let header = start.is_some_and(|s| text[..s.min(text.len())].ends_with('['));
            let what = match key.strip_prefix("unknown key `") {
                Some(name) if header => format!("unknown table `[{}]`", name.trim_end_matches('`')),
                _ => key,
            };
            format!("{what}{at}{valid}")
        } else if let Some(field) = message
            .strip_prefix("missing field `")
            .and_then(|f| f.strip_suffix('`'))
            .filter(|f| f.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            let table = key.map(|k| format!("{k} ")).unwrap_or_default();
            format!("{table}needs the key `{field}`{at}")
        } else if let Some(plain) = key.as_deref().and_then(|k| wrong_value(k, message)) {
            format!("{}{at}: {plain}", key.unwrap_or_default())
        } else if key.is_none() {
            format!("TOML syntax error{at}: {}", syntax_in_words(message))
        } else {
            format!("{}{at}: {}", key.unwrap_or_default(), scrub(message))
        };
        load_failed(path, why)
    })
}

/// The dotted key an error is about (`limits.max_clients`), if any: toml
/// names it only in its context-free rendering.
fn error_key(e: &toml::de::Error) -> Option<String> {
    let mut bare = e.clone();
    bare.set_input(None);
    let shown = bare.to_string();
    let key = shown
        .lines()
        .find_map(|l| l.strip_prefix("in `")?.strip_suffix('`'))?;
    Some(key.to_owned())
}

/// serde's "invalid type: string \"abc\", expected usize" as "expected a
/// whole number, found \"abc\"". The found value is shown (cut, and never
/// for a key that holds a secret): a number where text belongs is not a
/// token, and text where a number belongs is what the user must see.
fn wrong_value(key: &str, message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))?;
    let (found, expected) = rest.rsplit_once(", expected ")?;
    let expected = match expected {
        "usize" | "u64" => "a whole number (0 or more)".to_owned(),
        "u32" => format!("a whole number from 0 to {}", u32::MAX),
        "u16" => format!("a whole number from 0 to {}", u16::MAX),
        "a boolean" => "true or false".to_owned(),
        "a string" => "text in quotes".to_owned(),
        "a sequence" => "a list in brackets, e.g. [\"a\", \"b\"]".to_owned(),
        "path string" | "a path" => "a path in quotes".to_owned(),
        other => other.to_owned(),
    };
    let secret = key.ends_with("token") || key.ends_with("password");
    let found = if secret {
        "something else".to_owned()
    } else if let Some(s) = found.strip_prefix("string ") {
        cut(s, 40)
    } else if let Some(v) = ["integer ", "floating point ", "boolean "]
        .iter()
        .find_map(|p| found.strip_prefix(p))
    {
        cut(v.trim_matches('`'), 40)
    } else {
        found.to_owned()
    };
    Some(format!("expected {expected}, found {found}"))
}

fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_owned(),
    }
}

/// The TOML parser's words for the common mistakes, as a person would say them.
fn syntax_in_words(message: &str) -> String {
    let plain = match message.split(", expected").next().unwrap_or(message) {
        "unclosed table" => "a table header has no closing `]` (write e.g. `[limits]`)",
        "unclosed array" => "a list has no closing `]`",
        "unclosed array of tables" => "a `[[sockets]]` header has no closing `]]`",
        "string values must be quoted" => {
            "text must be in quotes (e.g. url = \"ws://localhost:18789\")"
        }
        "duplicate key" => "this key or table appears twice",
        "invalid basic string" | "invalid literal string" => {
            "a quoted text has no closing quote on its line"
        }
        "key with no value" => "a key has no `=` and value",
        _ => return scrub(message),
    };
    plain.to_owned()
}

/// Every key config.toml takes, as `(shown, spellings)`: `[gateway] url` is
/// also matched as `url`, `gateway_url` and `gateway.url`, so a key put in
/// the wrong table or with its table glued on still finds its real name.
/// Read from the structs themselves (serde names the valid keys when it
/// refuses one), so the list cannot drift from what is parsed.
pub(super) fn config_keys() -> Vec<(String, Vec<String>)> {
    const PROBE: &str = "__clawmux_probe__";
    fn fields<T: serde::de::DeserializeOwned>() -> Vec<String> {
        let probe = format!("{PROBE} = 0");
        match toml::from_str::<T>(&probe) {
            Err(e) => e
                .message()
                .split('`')
                .skip(3)
                .step_by(2)
                .map(str::to_owned)
                .collect(),
            Ok(_) => Vec::new(),
        }
    }
    let mut keys = Vec::new();
    let tables = [
        ("gateway", "[gateway]", fields::<GatewaySection>()),
        ("limits", "[limits]", fields::<LimitsSection>()),
        ("upstream", "[upstream]", fields::<UpstreamSection>()),
        ("sockets", "[[sockets]]", fields::<SocketSection>()),
    ];
    for top in fields::<ConfigFile>() {
        match tables.iter().find(|(name, _, _)| *name == top) {
            // A misspelt table header (`[limts]`) finds its table.
            Some((_, shown, _)) => keys.push((shown.to_string(), vec![top])),
            None => keys.push((top.clone(), vec![top])),
        }
    }
    for (name, shown, table) in tables {
        for key in table {
            keys.push((
                format!("{shown} {key}"),
                vec![
                    key.clone(),
                    format!("{name}_{key}"),
                    format!("{name}.{key}"),
                ],
            ));
        }
    }
    keys
}

/// The known key nearest to `wanted` (a small edit distance, or a close
/// Jaro-Winkler similarity, as `call`'s method suggestions use), if any.
pub(super) fn nearest_config_key(wanted: &str) -> Option<String> {
    let wanted = wanted.to_ascii_lowercase().replace('-', "_");
    config_keys()
        .into_iter()
        .filter_map(|(shown, spellings)| {
            spellings
                .iter()
                .filter_map(|k| {
                    let edits = strsim::damerau_levenshtein(&wanted, k);
                    let similar = strsim::jaro_winkler(&wanted, k);
                    (edits <= 2 || similar >= 0.9).then_some(similar - edits as f64)
                })
                .max_by(f64::total_cmp)
                .map(|score| (score, shown))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, shown)| shown)
}

/// serde's "unknown field `x`, expected one of `a`, `b`" as a message that
/// names the key, then (after the position the caller puts between) the
/// nearest known key and the valid ones. Key names are not secrets, but a
/// "key" that does not look like one (a pasted token?) is still hidden.
pub(super) fn unknown_key(message: &str) -> Option<(String, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let looks_like_a_key = key.len() <= 64
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    let key = if looks_like_a_key { key } else { "…" };
    let valid: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
    let near = looks_like_a_key
        .then(|| nearest_config_key(key))
        .flatten()
        .map(|k| format!("did you mean `{k}`? "))
        .unwrap_or_default();
    Some((
        format!("unknown key `{key}`"),
        if valid.is_empty() {
            format!(" ({near}this table takes no keys)")
        } else {
            format!(" ({near}valid keys here: {})", valid.join(", "))
        },
    ))
}

/// JSON (Claw3D) or JSON5 (OpenClaw) into a `Value`; errors carry only the position.
pub(super) fn parse_json_like(path: &Path, text: &str, json5: bool) -> Result<Value, ErrorShape> {
    if json5 {
        json5::from_str::<Value>(text).map_err(|e| match e {
            json5::Error::Message {
                location: Some(l), ..
            } => load_failed(
                path,
                format!("JSON5 syntax error at line {} column {}", l.line, l.column),
            ),
            json5::Error::Message { .. } => load_failed(path, "not valid JSON5"),
        })
    } else {
        serde_json::from_str::<Value>(text).map_err(|e| {
            load_failed(
                path,
                format!(
                    "JSON syntax error at line {} column {}",
                    e.line(),
                    e.column()
                ),
            )
        })
    }
}
