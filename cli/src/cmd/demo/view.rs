//! The live view: on a terminal, a table of every engine refreshed in
//! place with the latest events under it; otherwise the events as plain
//! lines and a status line every simulated minute.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::FakeResources;
use nixl_keepalive::{KeepaliveHandle, Snapshot};
use table::EngineRows;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::decoder::Decoder;
use super::report::{clock, Timeline};

/// The running view.
pub(super) struct View {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl View {
    /// Draws a last frame and stops.
    pub(super) async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Starts the view. `tty`: refresh a table in place; else plain lines.
pub(super) fn start(
    handle: KeepaliveHandle<FakeResources>,
    decoder: Decoder,
    timeline: Arc<Timeline>,
    duration: Duration,
    tty: bool,
) -> View {
    let stop = CancellationToken::new();
    let task = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut screen = Screen {
                tty,
                drawn_lines: 0,
                last_draw: None,
                log_from: 0,
                next_status: Duration::from_secs(60),
                duration,
            };
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                let last = tokio::select! {
                    _ = tick.tick() => false,
                    _ = stop.cancelled() => true,
                };
                let Ok(snapshot) = handle.snapshot().await else {
                    break;
                };
                screen.draw(&snapshot, &decoder, &timeline, last);
                if last {
                    break;
                }
            }
        })
    };
    View { stop, task }
}

struct Screen {
    tty: bool,
    drawn_lines: usize,
    last_draw: Option<std::time::Instant>,
    log_from: usize,
    next_status: Duration,
    duration: Duration,
}

/// Engines shown at most; the rest are summed up in one line.
const MAX_ROWS: usize = 24;
/// Latest events shown under the table.
const RECENT: usize = 8;

impl Screen {
    fn draw(&mut self, snapshot: &Snapshot, decoder: &Decoder, timeline: &Timeline, last: bool) {
        let now = timeline.now();
        if !self.tty {
            let (lines, next) = timeline.log_since(self.log_from);
            self.log_from = next;
            let mut out = std::io::stdout().lock();
            for line in lines {
                let _ = writeln!(out, "{line}");
            }
            if now >= self.next_status || last {
                self.next_status = now + Duration::from_secs(60);
                let _ = writeln!(out, "[{}] {}", clock(now), status_line(snapshot, decoder));
            }
            return;
        }
        // On a terminal: redraw at most every 40 ms of wall time (the
        // virtual clock can run a minute in a few milliseconds).
        let wall = std::time::Instant::now();
        if !last
            && self
                .last_draw
                .is_some_and(|t| wall.duration_since(t) < Duration::from_millis(40))
        {
            return;
        }
        self.last_draw = Some(wall);
        let (log, _) = timeline.log_since(0);
        let mut frame = String::new();
        let _ = writeln!(
            frame,
            "t={} of {}   {}",
            clock(now),
            clock(self.duration),
            status_line(snapshot, decoder)
        );
        let rows = EngineRows::from(snapshot);
        frame.push_str(&rows.render(MAX_ROWS));
        let _ = writeln!(frame, "latest events:");
        for line in log.iter().skip(log.len().saturating_sub(RECENT)) {
            let _ = writeln!(frame, "  {}", truncate(line, 150));
        }
        let mut out = std::io::stdout().lock();
        if self.drawn_lines > 0 {
            // Back to the top of the previous frame, and clear below.
            let _ = write!(out, "\x1b[{}A\x1b[J", self.drawn_lines);
        }
        let _ = out.write_all(frame.as_bytes());
        let _ = out.flush();
        self.drawn_lines = frame.lines().count();
    }
}

fn status_line(snapshot: &Snapshot, decoder: &Decoder) -> String {
    let r = decoder.reads();
    let mut by_state = std::collections::BTreeMap::new();
    for e in &snapshot.engines {
        *by_state.entry(e.state.as_str()).or_insert(0usize) += 1;
    }
    let states: Vec<String> = by_state.iter().map(|(k, v)| format!("{v} {k}")).collect();
    format!(
        "engines: {}   reads: {} ok, {} failed, {} refused",
        if states.is_empty() {
            "none".to_string()
        } else {
            states.join(", ")
        },
        r.ok,
        r.failed_by_service + r.remote_disconnect + r.other_error,
        r.refused_marked_engine,
    )
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max - 1).collect();
        t.push('…');
        t
    }
}

mod table {
    //! The engine table of a snapshot, as text.

    use std::fmt::Write as _;

    use nixl_keepalive::Snapshot;

    use super::truncate;

    pub(super) struct EngineRows {
        rows: Vec<[String; 6]>,
    }

    impl From<&Snapshot> for EngineRows {
        fn from(snapshot: &Snapshot) -> Self {
            let mut engines: Vec<_> = snapshot.engines.iter().collect();
            engines.sort_by(|a, b| {
                (a.address.as_str(), a.engine.as_str())
                    .cmp(&(b.address.as_str(), b.engine.as_str()))
            });
            let rows = engines
                .into_iter()
                .map(|e| {
                    let heartbeat = match &e.last_heartbeat {
                        Some(h) => format!(
                            "{} {:.1}s ago",
                            h.status.name().trim_start_matches("NIXL_"),
                            h.ago.as_secs_f64()
                        ),
                        None => "-".to_string(),
                    };
                    let why = if e.state == nixl_keepalive::EngineState::Live {
                        format!("{} lease(s)", e.leases.len())
                    } else {
                        e.why.clone()
                    };
                    [
                        e.address.to_string(),
                        e.engine.to_string(),
                        e.state.as_str().to_string(),
                        e.reads_in_flight.to_string(),
                        heartbeat,
                        truncate(&why, 70),
                    ]
                })
                .collect();
            EngineRows { rows }
        }
    }

    impl EngineRows {
        pub(super) fn render(&self, max: usize) -> String {
            let header = [
                "address",
                "engine",
                "state",
                "reads",
                "last heartbeat",
                "leases / why kept",
            ];
            let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
            for row in self.rows.iter().take(max) {
                for (w, c) in widths.iter_mut().zip(row) {
                    *w = (*w).max(c.chars().count());
                }
            }
            let mut out = String::new();
            let mut line = |cells: Vec<&str>| {
                let padded: Vec<String> = cells
                    .iter()
                    .zip(&widths)
                    .map(|(c, w)| format!("{c:<w$}"))
                    .collect();
                let _ = writeln!(out, "  {}", padded.join("  ").trim_end());
            };
            line(header.to_vec());
            for row in self.rows.iter().take(max) {
                line(row.iter().map(String::as_str).collect());
            }
            if self.rows.len() > max {
                let _ = writeln!(out, "  ... {} more engines", self.rows.len() - max);
            }
            out
        }
    }
}
