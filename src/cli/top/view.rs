//! `clawmux top`'s state and drawing: pure (no terminal, no socket), so it
//! is tested with ratatui's `TestBackend`.

use std::collections::{HashMap, VecDeque};

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Block, Borders, List, ListItem, ListState, Paragraph, Row, Sparkline, Table,
};
use ratatui::Frame;
use serde_json::Value;

use crate::activity::render::{
    args_summary, bytes, cut, duration, one_line, preview, preview_head, tool_outcome_at,
    unique_ids,
};
use crate::activity::{Activity, Item, Observed, Run, RunStatus, MAX_RUNS};
use crate::sanitize::{self, Shown};

/// Seconds of event rate kept for the sparkline (wider than any terminal
/// shows; older seconds are dropped).
pub const RATE_SECONDS: usize = 256;
/// Client rows shown at most (the title says how many there are).
pub const MAX_CLIENT_ROWS: usize = 5;
/// Seconds the footer tells of missed events (then the footer is clear
/// again: it is news, not a state).
pub const NOTICE_SECONDS: usize = 60;
/// The widest the client/mode column gets; a longer name is cut with `…`.
pub const CLIENT_COLUMN_CHARS: usize = 40;
/// What the footer says when events were missed (the full story is
/// `tail`'s; this must fit beside the keys on an 80-column terminal).
pub const MISSED_NOTICE: &str = "events missed (reconnect or restart); unfinished runs dropped";

/// What a key asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    None,
    Redraw,
    Quit,
}

/// A key, as `top` reads it (decoupled from crossterm for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Up,
    Down,
    Home,
    End,
    Toggle,
    Expand,
    Collapse,
    Char(char),
    Quit,
    /// The terminal changed size.
    Resize,
}

/// One line of the activity tree.
#[derive(Debug, Clone)]
struct TreeRow {
    /// Stable identity, so the selection follows a row as others arrive.
    key: String,
    /// The run it belongs to (expand/collapse), if any.
    run: Option<String>,
    line: Line<'static>,
}

/// When each run was last seen live: its newest gateway time then, and
/// the local time that event arrived. A run still going is timed on its own
/// clock from there (see [`App::run_clock`]).
type LiveSeen = HashMap<String, (u64, u64)>;

/// What the paused view draws: the activity, its live times and the clock
/// as they were when paused.
#[derive(Debug)]
struct Frozen {
    activity: Activity,
    live: LiveSeen,
    at_ms: u64,
}

/// Everything `top` shows.
#[derive(Debug)]
pub struct App {
    pub activity: Activity,
    /// [`LiveSeen`] of the runs of `activity`.
    live: LiveSeen,
    /// The view as it was when paused (drawn instead of the live one).
    frozen: Option<Frozen>,
    /// The last `/v1/state` document.
    pub state: Value,
    /// How the event stream is doing ("live", or why not).
    pub link: String,
    /// The last thing worth telling (missed events, a broker restart).
    pub notice: Option<String>,
    /// Seconds left before the notice is cleared.
    notice_left: usize,
    rates: VecDeque<u64>,
    this_second: u64,
    selected: Option<String>,
    /// Runs expanded or collapsed by hand (others: expanded while running,
    /// and the newest of each session).
    expanded: HashMap<String, bool>,
    pub session_filter: Option<String>,
    pub color: bool,
    /// Now (ms), for durations of what is still running.
    pub now_ms: u64,
}

impl App {
    pub fn new(color: bool, now_ms: u64) -> Self {
        App {
            activity: Activity::new(),
            live: HashMap::new(),
            frozen: None,
            state: Value::Null,
            link: "connecting".into(),
            notice: None,
            notice_left: 0,
            rates: VecDeque::new(),
            this_second: 0,
            selected: None,
            expanded: HashMap::new(),
            session_filter: None,
            color,
            now_ms,
        }
    }

    /// One gateway event from the stream, received at `received_ms` if it
    /// is live (`None`: replayed from the broker's log; its arrival says
    /// nothing of when it happened). The time is taken when the event
    /// arrives, not the clock of the last frame drawn.
    pub fn on_event(&mut self, name: &str, frame: &Value, received_ms: Option<u64>) {
        // The rate is of live events: the replayed backlog arrives at once
        // and would flatten every later second to nothing.
        if received_ms.is_some() {
            self.this_second += 1;
        }
        self.activity.apply(Observed {
            name,
            payload: &frame["payload"],
            received_ms,
        });
        let (Some(arrived), Some(run_id)) = (received_ms, frame["payload"]["runId"].as_str())
        else {
            return;
        };
        if let Some(run) = self.activity.run(run_id).filter(|r| r.last_ms > 0) {
            self.live.insert(run_id.to_owned(), (run.last_ms, arrived));
        }
        if self.live.len() > 2 * MAX_RUNS {
            let activity = &self.activity;
            self.live.retain(|id, _| activity.run(id).is_some());
        }
    }

    /// Events were missed (a gap, an upstream reconnect, a broker restart):
    /// runs whose end may be among them are forgotten.
    pub fn on_gap(&mut self, _what: String) {
        self.activity.forget_unfinished();
        self.notice = Some(MISSED_NOTICE.to_owned());
        self.notice_left = NOTICE_SECONDS;
    }

    /// A second passed: the rate sparkline moves on.
    pub fn next_second(&mut self) {
        self.rates.push_back(std::mem::take(&mut self.this_second));
        while self.rates.len() > RATE_SECONDS {
            self.rates.pop_front();
        }
        self.notice_left = self.notice_left.saturating_sub(1);
        if self.notice_left == 0 {
            self.notice = None;
        }
    }

    pub fn paused(&self) -> bool {
        self.frozen.is_some()
    }

    fn shown(&self) -> &Activity {
        self.frozen.as_ref().map_or(&self.activity, |f| &f.activity)
    }

    /// Now for the tree: the time it was paused at, while paused.
    fn clock(&self) -> u64 {
        self.frozen.as_ref().map_or(self.now_ms, |f| f.at_ms)
    }

    /// "Now" on a run's own clock, for what of it is still going: its
    /// newest gateway time when it was last seen live, plus the time since
    /// that event arrived. A run replayed from a recording (its times are
    /// the recording's) shows the recorded durations going on, not the time
    /// since it was recorded; a run known only from the broker's history
    /// shows what was recorded, up to its newest event; and the client's
    /// clock need not agree with the gateway's.
    fn run_clock(&self, run: &Run) -> Option<u64> {
        let live = self.frozen.as_ref().map_or(&self.live, |f| &f.live);
        match live.get(&run.id) {
            Some(&(ts, arrived)) => Some(ts + self.clock().saturating_sub(arrived)),
            None => Some(run.last_ms).filter(|t| *t > 0),
        }
    }

    /// Handles a key.
    pub fn key(&mut self, key: Key) -> Action {
        let rows = self.rows();
        let at = self.selected_index(&rows);
        let select = |app: &mut App, i: usize| {
            app.selected = rows
                .get(i.min(rows.len().saturating_sub(1)))
                .map(|r| r.key.clone());
        };
        match key {
            Key::Quit | Key::Char('q') => return Action::Quit,
            Key::Up | Key::Char('k') => select(self, at.saturating_sub(1)),
            Key::Down | Key::Char('j') => select(self, at + 1),
            Key::Home | Key::Char('g') => select(self, 0),
            Key::End | Key::Char('G') => select(self, rows.len().saturating_sub(1)),
            Key::Toggle | Key::Expand | Key::Collapse => {
                if let Some(run) = rows.get(at).and_then(|r| r.run.clone()) {
                    let open = self.is_expanded(&run);
                    let want = match key {
                        Key::Expand => true,
                        Key::Collapse => false,
                        _ => !open,
                    };
                    self.expanded.insert(run.clone(), want);
                    self.selected = Some(format!("r:{run}"));
                }
            }
            Key::Char('p') | Key::Char(' ') => {
                // Paused, the tree and its durations stay as they were.
                self.frozen = match self.frozen.take() {
                    Some(_) => None,
                    None => Some(Frozen {
                        activity: self.activity.clone(),
                        live: self.live.clone(),
                        at_ms: self.now_ms,
                    }),
                };
            }
            Key::Char('s') => {
                // Cycle: all sessions, then each session in turn.
                let sessions: Vec<String> = self
                    .shown()
                    .sessions()
                    .into_iter()
                    .map(|(k, _)| k)
                    .collect();
                self.session_filter = match &self.session_filter {
                    None => sessions.first().cloned(),
                    Some(cur) => sessions
                        .iter()
                        .position(|s| s == cur)
                        .and_then(|i| sessions.get(i + 1))
                        .cloned(),
                };
                self.selected = None;
            }
            Key::Resize => {}
            Key::Char(_) => return Action::None,
        }
        Action::Redraw
    }

    fn is_expanded(&self, run_id: &str) -> bool {
        if let Some(open) = self.expanded.get(run_id) {
            return *open;
        }
        let activity = self.shown();
        activity.run(run_id).is_some_and(|run| {
            run.running()
                || activity
                    .sessions()
                    .iter()
                    .find(|(k, _)| *k == run.session_key)
                    .and_then(|(_, runs)| runs.first())
                    .is_some_and(|newest| newest.id == run.id)
        })
    }

    fn selected_index(&self, rows: &[TreeRow]) -> usize {
        self.selected
            .as_ref()
            .and_then(|k| rows.iter().position(|r| &r.key == k))
            .unwrap_or(0)
    }

    fn style(&self, color: Color) -> Style {
        if self.color {
            Style::default().fg(color)
        } else {
            Style::default()
        }
    }

    fn status_style(&self, status: &RunStatus) -> Style {
        self.style(match status {
            RunStatus::Running => Color::Yellow,
            RunStatus::Ok => Color::Green,
            RunStatus::Aborted => Color::Magenta,
            RunStatus::Error(_) => Color::Red,
        })
    }

    /// The activity tree as lines, sessions by latest activity, runs newest first.
    fn rows(&self) -> Vec<TreeRow> {
        let mut rows = Vec::new();
        let dim = if self.color {
            Style::default().add_modifier(Modifier::DIM)
        } else {
            Style::default()
        };
        let sessions = self.shown().sessions();
        // Run ids as short as they can be while no two look alike.
        let ids = unique_ids(
            sessions
                .iter()
                .flat_map(|(_, runs)| runs.iter().map(|r| r.id.as_str())),
        );
        let at_bound =
            sessions.iter().map(|(_, r)| r.len()).sum::<usize>() >= crate::activity::MAX_RUNS;
        for (session, runs) in &sessions {
            if self.session_filter.as_ref().is_some_and(|f| f != session) {
                continue;
            }
            let running = runs.iter().filter(|r| r.running()).count();
            // At the bound older runs were forgotten: say what is kept.
            let kept = if at_bound {
                format!(" (of the newest {} kept)", crate::activity::MAX_RUNS)
            } else {
                String::new()
            };
            rows.push(TreeRow {
                key: format!("s:{session}"),
                run: None,
                line: Line::from(vec![
                    Span::styled(
                        sanitize::text(session).into_owned(),
                        self.style(Color::Cyan).add_modifier(Modifier::BOLD),
                    ),
                    Span::styled(
                        format!(
                            "  {} run{}{kept}, {running} running",
                            runs.len(),
                            if runs.len() == 1 { "" } else { "s" }
                        ),
                        dim,
                    ),
                ]),
            });
            for run in runs {
                let open = self.is_expanded(&run.id);
                let id = ids.get(run.id.as_str()).cloned().unwrap_or_default();
                rows.push(self.run_row(run, &id, open));
                if open {
                    self.run_children(run, &mut rows);
                }
            }
        }
        rows
    }

    fn run_row(&self, run: &Run, id: &str, open: bool) -> TreeRow {
        let took = run
            .duration_ms(self.run_clock(run))
            .map(|d| format!(" {}", duration(d)))
            .unwrap_or_default();
        let status = match &run.status {
            RunStatus::Error(message) => format!("error: {}", one_line(message)),
            other => other.as_str().to_owned(),
        };
        let tools = run
            .items
            .iter()
            .filter(|i| matches!(i, Item::Tool(_)))
            .count();
        let mut spans = vec![
            Span::raw(format!(" {} run {id} ", if open { "▾" } else { "▸" },)),
            Span::styled(status, self.status_style(&run.status)),
            Span::raw(took),
        ];
        if tools > 0 {
            spans.push(Span::raw(format!(
                ", {tools} tool{}",
                if tools == 1 { "" } else { "s" }
            )));
        }
        if !open && !run.output.is_empty() {
            spans.push(Span::raw(format!("  {}", preview(&run.output))));
        }
        TreeRow {
            key: format!("r:{}", run.id),
            run: Some(run.id.clone()),
            line: Line::from(spans),
        }
    }

    fn run_children(&self, run: &Run, rows: &mut Vec<TreeRow>) {
        let child = |key: String, spans: Vec<Span<'static>>| TreeRow {
            key,
            run: Some(run.id.clone()),
            line: Line::from(spans),
        };
        for (n, item) in run.items.iter().enumerate() {
            let key = format!("i:{}:{n}", run.id);
            match item {
                Item::Thinking(t) => {
                    let end = if t.done {
                        t.ended_ms
                    } else {
                        self.run_clock(run)
                    };
                    let took = end
                        .zip(t.started_ms)
                        .map(|(e, s)| format!(" {}", duration(e.saturating_sub(s))))
                        .unwrap_or_default();
                    rows.push(child(
                        key,
                        vec![
                            Span::raw("     "),
                            Span::styled("thinking", self.style(Color::Blue)),
                            Span::raw(format!("{took} {}", preview(&t.text))),
                        ],
                    ));
                }
                Item::Tool(call) => {
                    let indent = if call.parent_call_id.is_some() {
                        "       "
                    } else {
                        "     "
                    };
                    let outcome_style = match (call.is_error, call.interrupted) {
                        (_, true) | (Some(true), _) => self.style(Color::Red),
                        (None, _) => self.style(Color::Yellow),
                        _ => self.style(Color::Green),
                    };
                    rows.push(child(
                        key,
                        vec![
                            Span::raw(indent),
                            Span::styled(
                                format!("tool {}", Shown(&call.name)),
                                self.style(Color::Magenta),
                            ),
                            Span::raw(format!(" {} ", args_summary(&call.args))),
                            Span::styled(tool_outcome_at(call, self.run_clock(run)), outcome_style),
                        ],
                    ));
                }
            }
        }
        if run.dropped_items > 0 {
            rows.push(child(
                format!("d:{}", run.id),
                vec![Span::raw(format!(
                    "     … {} more not kept",
                    run.dropped_items
                ))],
            ));
        }
        if !run.output.is_empty() {
            let label = if run.running() {
                "assistant (streaming)"
            } else {
                "assistant"
            };
            rows.push(child(
                format!("o:{}", run.id),
                vec![
                    Span::raw("     "),
                    Span::styled(label, self.style(Color::Cyan)),
                    Span::raw(format!(" {}", preview(&run.output))),
                ],
            ));
        }
        if !run.running() {
            let end = match &run.status {
                RunStatus::Error(message) => format!("error: {}", preview_head(message)),
                other => other.as_str().to_owned(),
            };
            let took = run
                .duration_ms(None)
                .map(|d| format!(" after {}", duration(d)))
                .unwrap_or_default();
            rows.push(child(
                format!("e:{}", run.id),
                vec![
                    Span::raw("     "),
                    Span::styled(format!("end {end}"), self.status_style(&run.status)),
                    Span::raw(took),
                ],
            ));
        }
    }
}

/// Draws the whole dashboard.
pub fn draw(frame: &mut Frame, app: &App) {
    let clients = app.state["clients"].as_array().cloned().unwrap_or_default();
    let client_rows = clients.len().min(MAX_CLIENT_ROWS);
    let [header, spark, table, tree, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Length(client_rows as u16 + 2),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    draw_header(frame, app, header);
    draw_rate(frame, app, spark);
    draw_clients(frame, app, &clients, table);
    draw_tree(frame, app, tree);
    let help = "q quit  ↑↓ move  ⏎ expand  s session  p pause";
    let right = match (&app.notice, app.link.as_str()) {
        (_, link) if link != "live" => sanitize::text(link).into_owned(),
        (Some(n), _) => sanitize::text(n).into_owned(),
        _ => String::new(),
    };
    let width = footer.width as usize;
    let right = cut(&right, width.saturating_sub(help.chars().count() + 2));
    let gap = width.saturating_sub(help.chars().count() + right.chars().count());
    frame.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled(help, app.style(Color::DarkGray)),
            Span::raw(" ".repeat(gap)),
            Span::styled(right, app.style(Color::Yellow)),
        ])),
        footer,
    );
}

fn draw_header(frame: &mut Frame, app: &App, area: Rect) {
    let s = &app.state;
    let phase = s["upstream"]["phase"].as_str().unwrap_or("unknown");
    let phase_style = app.style(if phase == "ready" {
        Color::Green
    } else {
        Color::Red
    });
    let version = s["upstream"]["server_version"].as_str().unwrap_or("-");
    let up = s["broker"]["uptime_ms"]
        .as_u64()
        .map(uptime)
        .unwrap_or_else(|| "-".into());
    let rate = app.rates.back().copied().unwrap_or(0);
    // What does not fit the width is left out, least useful first (the
    // version, then the uptime, then the rate), rather than cut mid-word.
    let running = format!("  {} running", app.shown().running());
    let optional = [
        format!("  gateway {}", sanitize::field(version, 40)),
        format!("  up {up}"),
        format!("  {rate} ev/s"),
    ];
    let paused = if app.paused() { " PAUSED" } else { "" };
    let fixed = "clawmux top".len()
        + paused.len()
        + "  upstream ".len()
        + phase.chars().count()
        + running.len();
    let width = area.width as usize;
    let mut keep = [true; 3];
    let mut used = fixed + optional.iter().map(|o| o.chars().count()).sum::<usize>();
    for (i, part) in optional.iter().enumerate() {
        if used <= width {
            break;
        }
        keep[i] = false;
        used -= part.chars().count();
    }
    let mut spans = vec![Span::styled(
        "clawmux top",
        Style::default().add_modifier(Modifier::BOLD),
    )];
    if app.paused() {
        spans.push(Span::styled(
            paused,
            app.style(Color::Yellow).add_modifier(Modifier::BOLD),
        ));
    }
    spans.extend([
        Span::raw("  upstream "),
        Span::styled(sanitize::field(phase, 24).into_owned(), phase_style),
    ]);
    let rest: String = optional
        .iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(o, _)| o.as_str())
        .chain([running.as_str()])
        .collect();
    spans.push(Span::raw(rest));
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// `2d03h`, `1h02m`, `3m05s`, `42s`: short, for the header.
fn uptime(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, (s / 60) % 60),
        _ => format!("{}d{:02}h", s / 86_400, (s / 3600) % 24),
    }
}

fn draw_rate(frame: &mut Frame, app: &App, area: Rect) {
    let [label, bars] = Layout::horizontal([Constraint::Length(9), Constraint::Min(1)]).areas(area);
    frame.render_widget(Paragraph::new("events/s "), label);
    let width = bars.width as usize;
    let data: Vec<u64> = app.rates.iter().rev().take(width).rev().copied().collect();
    frame.render_widget(
        Sparkline::default()
            .data(&data)
            .style(app.style(Color::Green)),
        bars,
    );
}

fn draw_clients(frame: &mut Frame, app: &App, clients: &[Value], area: Rect) {
    let header = Row::new([
        "id",
        "kind",
        "client/mode",
        "pid",
        "since",
        "queue",
        "drops",
        "infl",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = clients.iter().take(MAX_CLIENT_ROWS).map(|c| {
        let who = cut(&client_name(c), CLIENT_COLUMN_CHARS);
        let since = c["connected_at_ms"]
            .as_u64()
            .map(|at| duration(app.now_ms.saturating_sub(at)))
            .unwrap_or_default();
        Row::new([
            c["id"].to_string(),
            sanitize::text(c["kind"].as_str().unwrap_or("?")).into_owned(),
            who,
            c["peer_pid"]
                .as_u64()
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            since,
            c["queue_bytes"]
                .as_u64()
                .map(|b| bytes(b as usize))
                .unwrap_or_default(),
            c["drops"].to_string(),
            c["inflight"].to_string(),
        ])
    });
    // As wide as the longest name shown (bounded), not the rest of the line.
    let who_width = clients
        .iter()
        .take(MAX_CLIENT_ROWS)
        .map(|c| client_name(c).chars().count().min(CLIENT_COLUMN_CHARS))
        .max()
        .unwrap_or(0)
        .max("client/mode".len());
    let widths = [
        Constraint::Length(4),
        Constraint::Length(4),
        Constraint::Length(who_width as u16),
        Constraint::Length(7),
        Constraint::Length(9),
        Constraint::Length(9),
        Constraint::Length(5),
        Constraint::Length(4),
    ];
    let title = format!(" Clients ({}) ", clients.len());
    frame.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(Block::new().borders(Borders::TOP).title(title)),
        area,
    );
}

/// A client as its declared `client.id/mode`, escaped.
fn client_name(c: &Value) -> String {
    let declared = &c["declared"];
    match (declared["client_id"].as_str(), declared["mode"].as_str()) {
        (Some(id), Some(mode)) => format!("{}/{}", Shown(id), Shown(mode)),
        (Some(id), None) => sanitize::text(id).into_owned(),
        _ if c["tool_observer"] == true => "(observer)".to_owned(),
        _ => "-".to_owned(),
    }
}

fn draw_tree(frame: &mut Frame, app: &App, area: Rect) {
    let rows = app.rows();
    let at = app.selected_index(&rows);
    let title = format!(
        " Activity · session: {} ",
        Shown(app.session_filter.as_deref().unwrap_or("all"))
    );
    let empty = rows.is_empty();
    let items: Vec<ListItem> = rows.into_iter().map(|r| ListItem::new(r.line)).collect();
    let block = Block::new().borders(Borders::TOP).title(title);
    if empty {
        frame.render_widget(
            Paragraph::new("  no agent runs yet (runs appear here as they start)").block(block),
            area,
        );
        return;
    }
    let mut state = ListState::default().with_selected(Some(at));
    frame.render_stateful_widget(
        List::new(items)
            .block(block)
            .highlight_style(Style::default().add_modifier(Modifier::REVERSED)),
        area,
        &mut state,
    );
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod look_tests;
