//! Colour for the CLI's human output, decided by `anstream` (the crate clap
//! itself uses): on for a terminal, off when piped, off with `NO_COLOR`, on
//! with `CLICOLOR_FORCE` (`NO_COLOR` wins), off with `TERM=dumb`.

use anstyle::{AnsiColor, Style};

/// Paints words when colour is wanted; returns them unchanged otherwise.
#[derive(Debug, Clone, Copy)]
pub struct Paint {
    enabled: bool,
}

impl Paint {
    /// Colour exactly when `anstream` would use it on stdout.
    pub fn stdout() -> Paint {
        Paint {
            enabled: anstream::AutoStream::choice(&std::io::stdout())
                != anstream::ColorChoice::Never,
        }
    }

    /// Colour exactly when `anstream` would use it on stderr.
    pub fn stderr() -> Paint {
        Paint {
            enabled: anstream::AutoStream::choice(&std::io::stderr())
                != anstream::ColorChoice::Never,
        }
    }

    /// Never colour (tests, `--json`).
    pub fn plain() -> Paint {
        Paint { enabled: false }
    }

    /// Always colour (tests).
    pub fn always() -> Paint {
        Paint { enabled: true }
    }

    pub fn paint(&self, style: Style, text: &str) -> String {
        if self.enabled {
            format!("{style}{text}{style:#}")
        } else {
            text.to_owned()
        }
    }

    /// Success: green.
    pub fn good(&self, text: &str) -> String {
        self.paint(AnsiColor::Green.on_default(), text)
    }

    /// Needs attention: yellow.
    pub fn warn(&self, text: &str) -> String {
        self.paint(AnsiColor::Yellow.on_default(), text)
    }

    /// Failure: bold red.
    pub fn bad(&self, text: &str) -> String {
        self.paint(AnsiColor::Red.on_default().bold(), text)
    }

    /// Less important detail (times, cursors): dimmed.
    pub fn dim(&self, text: &str) -> String {
        self.paint(Style::new().dimmed(), text)
    }

    /// A name to find at a glance (event names, labels): bold.
    pub fn strong(&self, text: &str) -> String {
        self.paint(Style::new().bold(), text)
    }

    /// An upstream phase in its colour: ready green, rejected/stopped red, others yellow.
    pub fn phase(&self, phase: &str) -> String {
        match phase {
            "ready" => self.good(phase),
            "rejected" | "stopped" => self.bad(phase),
            _ => self.warn(phase),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_is_unchanged_and_colour_wraps() {
        assert_eq!(Paint::plain().good("ok"), "ok");
        let c = Paint::always().good("ok");
        assert!(
            c.starts_with("\x1b[") && c.contains("ok") && c.ends_with("\x1b[0m"),
            "{c:?}"
        );
    }
}
