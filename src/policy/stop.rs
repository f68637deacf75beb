//! Chat messages the gateway reads as "stop": a `chat.send` whose message
//! is `/stop` or a stop word ("stop", "abort", "esc", "halt", "стоп",
//! "停止", …) starts no run; the gateway aborts every run in that session
//! instead, as `chat.abort {sessionKey}` would, and answers
//! `{ok, aborted, runIds}`. `sessions.send` is `chat.send` on the session's
//! key, so the same holds for it. The broker applies the abort ownership
//! rule to such messages ([`crate::dispatch`]): every local client shares
//! the broker's connection, so without it a client allowed only to write
//! could stop another client's run by chatting "/stop" to its session.
//!
//! Read from gateway 2026.9.6 (`src/gateway/server-methods/chat-send-*.ts`:
//! `stopCommand = isChatStopCommandText(message)` on the message after
//! `sanitizeChatSendMessageInput`; `src/gateway/chat-abort.ts` →
//! `src/auto-reply/reply/abort-primitives.ts` `isAbortRequestText`,
//! `abort-trigger-text.ts` `ABORT_TRIGGERS` and its normalization,
//! `src/auto-reply/commands-registry-normalize.ts` `normalizeCommandBody`;
//! `sessions-messaging.ts` forwards `sessions.send` to the `chat.send`
//! handler). The `agent` method reads no stop word (only `/new` and
//! `/reset`, which need admin), so its messages start runs as they are.
//!
//! Where the broker's reading could differ from the gateway's (whitespace
//! JavaScript trims and Rust does not, or the reverse), it errs towards
//! "stop": a message wrongly taken for one is refused only when another
//! client's run is live in that session.

use unicode_normalization::UnicodeNormalization as _;

/// The gateway's stop words (`ABORT_TRIGGERS`), matched against the whole
/// message after [`trigger_text`].
pub const STOP_WORDS: [&str; 43] = [
    "stop",
    "esc",
    "abort",
    "exit",
    "interrupt",
    "detente",
    "deten",
    "detén",
    "arrete",
    "arrête",
    "停止",
    "停下来",
    "暂停",
    "やめて",
    "止めて",
    "रुको",
    "توقف",
    "стоп",
    "остановись",
    "останови",
    "остановить",
    "прекрати",
    "halt",
    "anhalten",
    "aufhören",
    "hoer auf",
    "stopp",
    "pare",
    "stop openclaw",
    "openclaw stop",
    "stop action",
    "stop current action",
    "stop run",
    "stop current run",
    "stop agent",
    "stop the agent",
    "stop don't do anything",
    "stop dont do anything",
    "stop do not do anything",
    "stop doing anything",
    "do not do that",
    "please stop",
    "stop please",
];

/// The slash command that stops (`/stop`, also `/STOP`, `/stop:`, `/stop!`).
const STOP_COMMAND: &str = "/stop";

/// Whether the gateway reads `message` (a `chat.send` or `sessions.send`
/// message) as a stop request.
pub fn is_stop_message(message: &str) -> bool {
    // The gateway's input cleaning: NFC, then the controls it drops (it
    // refuses a message with NUL, which then stops nothing either way).
    let cleaned: String = message.nfc().filter(|&c| !dropped_control(c)).collect();
    let body = command_body(&cleaned);
    if body.is_empty() {
        return false;
    }
    let lower = body.to_lowercase();
    let trigger = trigger_text(&lower);
    lower == STOP_COMMAND || trigger == STOP_COMMAND || STOP_WORDS.contains(&trigger.as_str())
}

/// The C0 controls and DEL the gateway removes from a chat message
/// (`stripDisallowedChatControlChars`: all but tab, LF and CR).
fn dropped_control(c: char) -> bool {
    matches!(c, '\0'..='\x08' | '\x0b' | '\x0c' | '\x0e'..='\x1f' | '\x7f')
}

/// JavaScript's `trim()`/`\s` whitespace, and Rust's (U+0085 is only
/// Rust's, U+FEFF only JavaScript's): both, to err towards a match.
fn is_space(c: char) -> bool {
    c.is_whitespace() || c == '\u{feff}'
}

fn trim(s: &str) -> &str {
    s.trim_matches(is_space)
}

/// `normalizeCommandBody` as far as it can make `/stop`: a text that is
/// not a command is only trimmed; a command is cut to its first line, and
/// `/cmd: rest` is read as `/cmd rest`.
fn command_body(text: &str) -> String {
    let trimmed = trim(text);
    if !trimmed.starts_with('/') {
        return trimmed.to_owned();
    }
    let line = match trimmed.find('\n') {
        Some(at) => trim(&trimmed[..at]),
        None => trimmed,
    };
    // `^/([^\s:]+)\s*:(.*)$`
    let name_len = line[1..]
        .find(|c: char| is_space(c) || c == ':')
        .unwrap_or(line.len() - 1);
    let (name, after) = line[1..].split_at(name_len);
    match after.trim_start_matches(is_space).strip_prefix(':') {
        Some(rest) if !name.is_empty() => match rest.trim_start_matches(is_space) {
            "" => format!("/{name}"),
            rest => format!("/{name} {rest}"),
        },
        _ => line.to_owned(),
    }
}

/// `normalizeAbortTriggerText` on lowercased text: curly and back quotes
/// as `'`, whitespace runs as one space, trailing punctuation dropped,
/// then trimmed.
fn trigger_text(lower: &str) -> String {
    let mut out = String::with_capacity(lower.len());
    let mut in_space = false;
    for c in lower.chars() {
        if is_space(c) {
            if !in_space {
                out.push(' ');
            }
            in_space = true;
            continue;
        }
        in_space = false;
        out.push(if matches!(c, '’' | '`') { '\'' } else { c });
    }
    let kept = out.trim_end_matches(|c: char| ".!?！？…,，。;；:：'\"’”)]}".contains(c));
    trim(kept).to_owned()
}

/// What a `chat.send` (or `sessions.send`, which is `chat.send` on the
/// session's key) does to the session's running run, if one is live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    /// It queues behind the run (`queueMode` `followup` or `collect`, or a
    /// `/queue followup` directive): the run is left alone.
    Leaves,
    /// It names no mode: the session's own mode applies, `steer` unless an
    /// admin set another, so it is injected into the running run.
    Default,
    /// It steers or interrupts the run on purpose: `queueMode` `steer` or
    /// `interrupt`, a `/queue steer` or `/queue interrupt` directive, the
    /// `/steer` (`/tell`) command, or a session reset (`/new`, `/reset`).
    Takes,
}

/// How a `chat.send`'s `queueMode` and message touch the running run.
///
/// Read from gateway 2026.9.6: `chat-send-handler.ts` (`p.queueMode ===
/// "steer"` → `resolveCurrentMessageInjectionTarget`, `"interrupt"` →
/// `resolveCurrentInterruptTarget` → `interruptReplyRunTarget`);
/// `get-reply.ts` (`extractQueueDirective`, `resolveQueueSettings`, whose
/// default mode is `steer`, and `shouldSteer`); `queue/normalize.ts`
/// (`normalizeQueueMode`; `steer-backlog` is a retired name the
/// `chat.send` schema refuses); `commands-steer.ts` (`/steer`, `/tell`:
/// `queueModeOverride: "steer"`). A `queueMode` the schema refuses
/// (`steer-backlog`, `Interrupt`) is answered by the gateway with an
/// error and touches nothing.
pub fn touch(queue_mode: Option<&str>, message: Option<&str>) -> Touch {
    let directive = message.and_then(queue_directive);
    if matches!(queue_mode, Some("steer" | "interrupt"))
        || matches!(directive, Some(Touch::Takes))
        || message.is_some_and(|m| is_reset_message(m) || is_steer_command(m))
    {
        return Touch::Takes;
    }
    match queue_mode {
        Some(_) => Touch::Leaves,
        None => directive.unwrap_or(Touch::Default),
    }
}

/// Whether a `chat.send` interrupts the session's running run before its
/// own starts: `queueMode: "interrupt"`, an interrupting `/queue`
/// directive, or a session reset. (A session whose *persisted* queue mode
/// is `interrupt` interrupts on every message; the broker cannot see that
/// setting.)
pub fn interrupts_run(queue_mode: Option<&str>, message: Option<&str>) -> bool {
    queue_mode == Some("interrupt")
        || message.is_some_and(|m| queue_directive_interrupts(m) || is_reset_message(m))
}

/// Whether `message` is the `/steer <message>` command (or its alias
/// `/tell`), which injects its text into the running run.
pub fn is_steer_command(message: &str) -> bool {
    let cleaned: String = message.nfc().filter(|&c| !dropped_control(c)).collect();
    let lower = trim(&cleaned).to_lowercase();
    ["/steer", "/tell"].iter().any(|command| {
        lower.strip_prefix(command).is_some_and(|rest| {
            rest.is_empty() || rest.starts_with(|c: char| is_space(c) || c == ':')
        })
    })
}

/// Whether `message` is a session reset (`/new` or `/reset`, alone or
/// followed by whitespace and a first message, after `normalizeCommandBody`):
/// the gateway then resets the session and interrupts its running run
/// (`get-reply.ts` `resetTriggered` → `activeRunQueueMode = "interrupt"`).
/// It honours a reset from the broker's connection (it holds
/// `operator.admin`, `isResetAuthorizedForContext`); sessions configured
/// with other `session.resetTriggers` are not seen here.
pub fn is_reset_message(message: &str) -> bool {
    let cleaned: String = message.nfc().filter(|&c| !dropped_control(c)).collect();
    let body = command_body(&cleaned).to_lowercase();
    ["/new", "/reset"].iter().any(|trigger| {
        body.strip_prefix(trigger)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(is_space))
    })
}

/// Whether `message` carries a `/queue` directive (`/queue interrupt`,
/// `/queue: abort`, `hi /queue interrupts debounce:0`) that makes this
/// message interrupt.
pub fn queue_directive_interrupts(message: &str) -> bool {
    queue_modes(message).any(|mode| mode == "interrupt")
}

/// What the `/queue` directives in `message` say: [`Touch::Takes`] when
/// any of them names `steer` or `interrupt`, [`Touch::Leaves`] when they
/// name only `followup` or `collect`, none without a mode.
fn queue_directive(message: &str) -> Option<Touch> {
    let mut touch = None;
    for mode in queue_modes(message) {
        if mode == "steer" || mode == "interrupt" {
            return Some(Touch::Takes);
        }
        touch = Some(Touch::Leaves);
    }
    touch
}

/// The queue modes named by the `/queue` directives in `message`. The
/// gateway reads the first `/queue` (preceded by whitespace or the start,
/// followed by whitespace, `:` or the end), then its tokens until one is
/// neither a mode nor an option; `reset`, `default` or `clear` end them.
/// Every `/queue` is read here, and every mode among its tokens counts,
/// to err towards touching the run.
fn queue_modes(message: &str) -> impl Iterator<Item = &'static str> {
    let lower = message.to_lowercase();
    let mut modes = Vec::new();
    let mut from = 0;
    while let Some(at) = lower[from..].find("/queue").map(|i| from + i) {
        from = at + "/queue".len();
        let before_ok = lower[..at].chars().next_back().is_none_or(is_space);
        let after = &lower[from..];
        let after_ok = after.chars().next().is_none_or(|c| is_space(c) || c == ':');
        if !(before_ok && after_ok) {
            continue;
        }
        // `skipDirectiveArgPrefix`: whitespace then one `:`.
        let args = after.trim_start_matches(is_space);
        let args = args.strip_prefix(':').unwrap_or(after);
        for token in args.split(is_space).filter(|t| !t.is_empty()) {
            match token {
                "interrupt" | "interrupts" | "abort" => modes.push("interrupt"),
                "steer" | "steering" => modes.push("steer"),
                "followup" | "follow-ups" | "followups" => modes.push("followup"),
                "collect" | "coalesce" => modes.push("collect"),
                "reset" | "default" | "clear" => break,
                option
                    if ["debounce", "cap", "drop"].iter().any(|name| {
                        option
                            .strip_prefix(name)
                            .is_some_and(|rest| rest.starts_with([':', '=']))
                    }) => {}
                _ => break,
            }
        }
    }
    modes.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupt_queue_mode_or_directive_interrupts_the_running_run() {
        assert!(interrupts_run(Some("interrupt"), Some("hello")));
        for mode in ["steer", "followup", "collect", "Interrupt", ""] {
            assert!(!interrupts_run(Some(mode), Some("hello")), "{mode}");
        }
        for message in [
            "/queue interrupt",
            "/queue interrupt what now?",
            "/QUEUE Abort",
            "/queue:interrupt",
            "/queue : interrupts",
            "look here /queue debounce:0 cap=2 interrupt",
            "/queue steer interrupt",
            "/queue\ninterrupt",
            // Every `/queue` is read (the gateway reads the first).
            "/queue hi /queue interrupt",
        ] {
            assert!(interrupts_run(None, Some(message)), "{message:?}");
        }
        for message in [
            "interrupt",
            "/queue",
            "/queue steer",
            "/queue reset interrupt",
            "/queue hello interrupt",
            "/queued interrupt",
            "x/queue interrupt",
            "/queue collect",
        ] {
            assert!(!interrupts_run(None, Some(message)), "{message:?}");
        }
        assert!(!interrupts_run(None, None));
        // A session reset interrupts too.
        for message in ["/new", "/RESET", " /reset: start over", "/new\nhello"] {
            assert!(interrupts_run(None, Some(message)), "{message:?}");
        }
        for message in ["/newer", "/resetting", "please /reset", "new"] {
            assert!(!interrupts_run(None, Some(message)), "{message:?}");
        }
    }

    #[test]
    fn what_a_send_does_to_the_running_run() {
        for (mode, message) in [
            (Some("steer"), "hi"),
            (Some("interrupt"), "hi"),
            (None, "/queue steer hi"),
            (None, "/queue: steering"),
            (Some("followup"), "/queue interrupt"),
            (None, "/steer do this"),
            (None, "/TELL: that"),
            (None, "/reset"),
        ] {
            assert_eq!(
                touch(mode, Some(message)),
                Touch::Takes,
                "{mode:?} {message:?}"
            );
        }
        for (mode, message) in [
            (Some("followup"), "hi"),
            (Some("collect"), "hi"),
            (None, "/queue followup hi"),
            (None, "/queue collect"),
            // Refused by the gateway's schema: nothing runs.
            (Some("steer-backlog"), "hi"),
            (Some("Steer"), "hi"),
        ] {
            assert_eq!(
                touch(mode, Some(message)),
                Touch::Leaves,
                "{mode:?} {message:?}"
            );
        }
        for message in ["hi", "/steering", "/queue", "/queued steer", "/telling"] {
            assert_eq!(touch(None, Some(message)), Touch::Default, "{message:?}");
        }
        assert_eq!(touch(None, None), Touch::Default);
    }

    #[test]
    fn the_stop_command_in_the_forms_the_gateway_reads() {
        for stop in [
            "/stop",
            "/STOP",
            " /stop ",
            "/stop:",
            "/stop :",
            "/stop!",
            "/stop.",
            "/stop\nand more lines",
            "/st\u{1}op",
            "\u{feff}/stop",
        ] {
            assert!(is_stop_message(stop), "{stop:?}");
        }
        for not in [
            "/stop now",
            "/stop: now",
            "/stopped",
            "/stop@bot",
            "/status",
            "/",
            "",
        ] {
            assert!(!is_stop_message(not), "{not:?}");
        }
    }

    #[test]
    fn stop_words_alone_after_the_gateways_normalization() {
        for stop in [
            "stop",
            "Stop!",
            "  STOP.  ",
            "please   stop",
            "Stop don’t do anything",
            "stop dont do anything?!",
            "停止",
            "Стоп!",
            "halt",
            "esc",
            "interrupt…",
            // NFD input is composed first; a dropped control joins the word.
            "dete\u{301}n",
            "arre\u{302}te",
            "st\x7fop",
            "ab\u{1b}ort",
        ] {
            assert!(is_stop_message(stop), "{stop:?}");
        }
        for not in [
            "stop the music",
            "don't stop",
            "stop. .",
            "stopping",
            "wait",
            "hello",
            "aufhoren",
        ] {
            assert!(!is_stop_message(not), "{not:?}");
        }
    }

    #[test]
    fn whitespace_only_or_empty_is_no_stop() {
        assert!(!is_stop_message("   \n\t"));
        assert!(!is_stop_message(""));
    }
}
