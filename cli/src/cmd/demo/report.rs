//! What happened: the incidents and what the service did about each, the
//! log lines the live view shows, the safety violations seen, and the
//! closing summary (tables or JSON).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nixl_keepalive::fake::Held;
use nixl_keepalive::{Config, EngineId, Event, PeerAddr, ReleaseReason, WaitedFor};
use serde::Serialize;
use tokio::time::Instant;

/// `println!` that ignores a closed stdout (`demo | head`) instead of
/// panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// What the service must do about an incident.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Expect {
    /// Release the engine, within the bound.
    Release,
    /// Keep it: nothing a keepalive should act on happened.
    Keep,
}

/// One incident and what became of it.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Incident {
    /// Index in the list, from 1.
    pub(super) n: usize,
    #[serde(skip)]
    prefill: usize,
    /// Seconds from the start of the scenario.
    pub(super) at_s: f64,
    pub(super) incident: &'static str,
    pub(super) address: String,
    pub(super) engine: String,
    pub(super) expect: Expect,
    /// The bound the release is checked against, in seconds.
    pub(super) bound_s: Option<f64>,
    /// Seconds from the incident to the first sign of it (an event, or the
    /// mark the release reports).
    pub(super) detected_after_s: Option<f64>,
    /// What said so first.
    pub(super) detected_by: Option<String>,
    /// Seconds from the incident to the Released event.
    pub(super) released_after_s: Option<f64>,
    pub(super) release_reason: Option<&'static str>,
    /// What the release waited for after the mark.
    pub(super) waited_for: Option<Waited>,
    /// `ok`, or what went wrong.
    pub(super) check: String,
    #[serde(skip)]
    open: bool,
    #[serde(skip)]
    at: Duration,
    #[serde(skip)]
    engine_id: EngineId,
    #[serde(skip)]
    bound: Option<Duration>,
}

/// [`WaitedFor`], printable.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Waited {
    pub(super) seconds: f64,
    pub(super) reads_in_flight_at_mark: u64,
    pub(super) handshake: bool,
}

impl From<WaitedFor> for Waited {
    fn from(w: WaitedFor) -> Self {
        Waited {
            seconds: w.duration.as_secs_f64(),
            reads_in_flight_at_mark: w.reads_in_flight_at_mark,
            handshake: w.handshake,
        }
    }
}

impl Waited {
    fn text(&self) -> String {
        let mut what = Vec::new();
        if self.reads_in_flight_at_mark > 0 {
            what.push(format!("{} read(s)", self.reads_in_flight_at_mark));
        }
        if self.handshake {
            what.push("a handshake".to_string());
        }
        if what.is_empty() {
            "nothing".to_string()
        } else {
            format!("{}, {:.2}s", what.join(" + "), self.seconds)
        }
    }
}

/// Events seen, by kind.
#[derive(Clone, Debug, Default, Serialize)]
pub(super) struct EventCounts {
    pub(super) registered: u64,
    pub(super) unreachable: u64,
    pub(super) replaced: u64,
    pub(super) retiring: u64,
    pub(super) reads_failed: u64,
    pub(super) stalled: u64,
    pub(super) transient_errors: u64,
    pub(super) conflicts: u64,
    pub(super) released: u64,
    pub(super) released_by_reason: BTreeMap<&'static str, u64>,
    /// Events the listener missed (it fell behind the event capacity).
    pub(super) lagged: u64,
}

impl EventCounts {
    pub(super) fn count(&mut self, event: &Event) {
        match event {
            Event::Registered { .. } => self.registered += 1,
            Event::Unreachable { .. } => self.unreachable += 1,
            Event::Replaced { .. } => self.replaced += 1,
            Event::Retiring { .. } => self.retiring += 1,
            Event::ReadsFailed { .. } => self.reads_failed += 1,
            Event::Stalled { .. } => self.stalled += 1,
            Event::TransientError { .. } | Event::TransportPanicked { .. } => {
                self.transient_errors += 1
            }
            Event::Conflict { .. } => self.conflicts += 1,
            Event::Released { reason, .. } => {
                self.released += 1;
                *self.released_by_reason.entry(reason.as_str()).or_default() += 1;
            }
            // A kind this build does not count: still in the log.
            _ => {}
        }
    }
}

/// The run's record, shared by the scenario, the decoder and the view.
pub(super) struct Timeline {
    origin: Instant,
    inner: Mutex<Record>,
}

#[derive(Default)]
struct Record {
    incidents: Vec<Incident>,
    log: Vec<String>,
    violations: Vec<String>,
    events: Vec<LoggedEvent>,
}

/// One event of the service with when it came (seconds of the scenario):
/// the JSON summary's `event_log`, the library's own serialization of the
/// event beside `at_s`.
#[derive(Clone, Debug, Serialize)]
pub(super) struct LoggedEvent {
    at_s: f64,
    #[serde(flatten)]
    event: Event,
}

impl Timeline {
    pub(super) fn new(origin: Instant) -> Self {
        Timeline {
            origin,
            inner: Mutex::new(Record::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Record> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Time since the start of the scenario.
    pub(super) fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }

    /// A line for the live view.
    pub(super) fn log(&self, line: String) {
        let line = format!("[{}] {line}", clock(self.now()));
        self.lock().log.push(line);
    }

    /// Log lines from index `from` on, and the next index.
    pub(super) fn log_since(&self, from: usize) -> (Vec<String>, usize) {
        let record = self.lock();
        let from = from.min(record.log.len());
        (record.log[from..].to_vec(), record.log.len())
    }

    /// A safety violation: counted in the summary, and the exit code.
    pub(super) fn violation(&self, what: String) {
        let line = format!("[{}] VIOLATION: {what}", clock(self.now()));
        let mut record = self.lock();
        record.log.push(line.clone());
        record.violations.push(line);
    }

    pub(super) fn open_incident(
        &self,
        prefill: usize,
        incident: &'static str,
        address: &PeerAddr,
        engine: &EngineId,
        expect: Expect,
        bound: Option<Duration>,
    ) {
        let at = self.now();
        let mut record = self.lock();
        // A new incident on an engine ends the wait for the old one's
        // "nothing happened".
        for i in record.incidents.iter_mut() {
            if i.open && &i.engine_id == engine && i.expect == Expect::Keep {
                i.open = false;
                i.check = "kept (ok)".into();
            }
        }
        let n = record.incidents.len() + 1;
        record.log.push(format!(
            "[{}] #{n} {incident}: {engine} at {address}{}",
            clock(at),
            match (expect, bound) {
                (Expect::Release, Some(b)) => format!(" (must be released within {})", human(b)),
                (Expect::Release, None) => " (must be released)".to_string(),
                (Expect::Keep, _) => " (must be kept)".to_string(),
            }
        ));
        record.incidents.push(Incident {
            n,
            prefill,
            at_s: at.as_secs_f64(),
            incident,
            address: address.to_string(),
            engine: engine.to_string(),
            expect,
            bound_s: bound.map(|b| b.as_secs_f64()),
            detected_after_s: None,
            detected_by: None,
            released_after_s: None,
            release_reason: None,
            waited_for: None,
            check: "open".into(),
            open: true,
            at,
            engine_id: engine.clone(),
            bound,
        });
    }

    /// Whether an incident on `prefill` still waits for its outcome.
    pub(super) fn has_open_incident_at(&self, prefill: usize) -> bool {
        self.lock()
            .incidents
            .iter()
            .any(|i| i.open && i.prefill == prefill && i.expect == Expect::Release)
    }

    /// Feeds one event of the service: its outcome for the incident it
    /// closes, and the event itself, as the library renders it (its
    /// `Display` in the log, its `Serialize` in the JSON summary).
    pub(super) fn on_event(&self, event: &Event) {
        let now = self.now();
        let mut record = self.lock();
        match event {
            Event::Unreachable {
                engine,
                status,
                source,
                ..
            } => record.detect(engine, now, format!("{} ({source})", status.name())),
            Event::Replaced { old, new, .. } => record.detect(
                old,
                now,
                if old == new {
                    "registered again".into()
                } else {
                    format!("replaced by {new}")
                },
            ),
            Event::Retiring { engine, .. } => record.detect(engine, now, "peer gone".into()),
            Event::Released {
                engine,
                reason,
                waited_for,
                ..
            } => record.release(engine, now, *reason, *waited_for),
            _ => {}
        }
        record.log.push(format!("[{}] {event}", clock(now)));
        record.events.push(LoggedEvent {
            at_s: now.as_secs_f64(),
            event: event.clone(),
        });
    }

    /// Closes the incidents at the end of the run and returns them.
    fn close(&self, end: Duration, interrupted: bool) -> (Vec<Incident>, Vec<String>) {
        let mut record = self.lock();
        let mut late = Vec::new();
        for i in record.incidents.iter_mut().filter(|i| i.open) {
            i.open = false;
            match i.expect {
                Expect::Keep => i.check = "kept (ok)".into(),
                Expect::Release => {
                    let cut = interrupted || i.bound.is_none_or(|b| i.at + b > end);
                    if cut {
                        i.check = "cut by the end of the run".into();
                    } else {
                        i.check = "NOT RELEASED".into();
                        late.push(format!(
                            "#{} {} of {}: not released by the end of the run",
                            i.n, i.incident, i.engine
                        ));
                    }
                }
            }
        }
        record
            .violations
            .extend(late.into_iter().map(|l| format!("[end] VIOLATION: {l}")));
        (record.incidents.clone(), record.violations.clone())
    }

    /// Every event of the service seen so far, in order.
    fn events(&self) -> Vec<LoggedEvent> {
        self.lock().events.clone()
    }
}

impl Record {
    fn open_for(&mut self, engine: &EngineId) -> Option<&mut Incident> {
        self.incidents
            .iter_mut()
            .find(|i| i.open && &i.engine_id == engine)
    }

    fn detect(&mut self, engine: &EngineId, now: Duration, by: String) {
        if let Some(i) = self.open_for(engine) {
            if i.detected_after_s.is_none() {
                i.detected_after_s = Some(now.saturating_sub(i.at).as_secs_f64());
                i.detected_by = Some(by);
            }
        }
    }

    fn release(
        &mut self,
        engine: &EngineId,
        now: Duration,
        reason: ReleaseReason,
        waited: WaitedFor,
    ) {
        let mut violation = None;
        match self.open_for(engine) {
            Some(i) if i.expect == Expect::Keep && reason == ReleaseReason::Shutdown => {
                i.open = false;
                i.check = "kept (ok)".into();
            }
            Some(i) => {
                i.open = false;
                let after = now.saturating_sub(i.at);
                if i.detected_after_s.is_none() {
                    // No event named the mark (prepare_reload marks
                    // silently): the release says when it was.
                    let mark = now.saturating_sub(waited.duration);
                    i.detected_after_s = Some(mark.saturating_sub(i.at).as_secs_f64());
                    i.detected_by = Some(format!("marked {}", reason.as_str()));
                }
                i.released_after_s = Some(after.as_secs_f64());
                i.release_reason = Some(reason.as_str());
                i.waited_for = Some(waited.into());
                i.check = match (i.expect, i.bound) {
                    (Expect::Keep, _) => {
                        violation = Some(format!(
                            "#{} {}: {} released ({}) though it had to be kept",
                            i.n,
                            i.incident,
                            engine,
                            reason.as_str()
                        ));
                        "RELEASED (had to be kept)".into()
                    }
                    (Expect::Release, Some(bound)) if after > bound => {
                        violation = Some(format!(
                            "#{} {}: {} released after {}, over its bound of {}",
                            i.n,
                            i.incident,
                            engine,
                            human(after),
                            human(bound)
                        ));
                        "LATE".into()
                    }
                    (Expect::Release, _) => "ok".into(),
                };
            }
            None if reason == ReleaseReason::Shutdown => {}
            None => {
                violation = Some(format!(
                    "{engine} released ({}) though nothing happened to it",
                    reason.as_str()
                ))
            }
        }
        if let Some(v) = violation {
            let line = format!("[{}] VIOLATION: {v}", clock(now));
            self.log.push(line.clone());
            self.violations.push(line);
        }
    }
}

/// The flags that shaped the run.
#[derive(Clone, Debug, Serialize)]
pub(super) struct RunInfo {
    pub(super) prefills: usize,
    pub(super) ranks: usize,
    pub(super) readers: usize,
    pub(super) seed: Option<u64>,
    #[serde(serialize_with = "secs")]
    pub(super) duration: Duration,
    #[serde(serialize_with = "opt_secs")]
    pub(super) ucx_keepalive: Option<Duration>,
    /// Push mode: the transfers were writes into decodes.
    pub(super) push: bool,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

fn opt_secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// Reads as the decoder counted them.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Reads {
    pub(super) ok: u64,
    pub(super) refused_marked_engine: u64,
    pub(super) failed_by_service: u64,
    pub(super) remote_disconnect: u64,
    pub(super) other_error: u64,
    pub(super) handshakes_ok: u64,
    pub(super) handshakes_failed: u64,
}

/// NIXL state still held at the end.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Leaked {
    pub(super) remote_metadata: usize,
    pub(super) dlist_handles: usize,
}

/// The run, as the summary prints it.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Outcome {
    pub(super) run: Option<RunInfo>,
    pub(super) service_config: String,
    pub(super) virtual_seconds: f64,
    pub(super) wall_seconds: f64,
    pub(super) interrupted: bool,
    pub(super) incidents: Vec<Incident>,
    pub(super) reads: Reads,
    pub(super) events: EventCounts,
    /// Every event of the service, in order, as the library serializes
    /// it (`"event": <kind>` and the fields its line shows), with `at_s`.
    pub(super) event_log: Vec<LoggedEvent>,
    /// Release calls the transport got from the service.
    pub(super) transport_releases: u64,
    /// Registrations the service handed back at shutdown (released by the
    /// runtime itself).
    pub(super) returned_at_stop: usize,
    pub(super) released: u64,
    pub(super) leaked: Leaked,
    pub(super) violations: Vec<String>,
}

impl Outcome {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build(
        timeline: &Timeline,
        reads: Reads,
        transport_releases: u64,
        events: EventCounts,
        held: Held,
        returned_at_stop: usize,
        interrupted: bool,
        elapsed: Duration,
        config: Config,
    ) -> Outcome {
        let (incidents, mut violations) = timeline.close(elapsed, interrupted);
        if events.lagged == 0 && events.released != transport_releases {
            violations.push(format!(
                "[end] VIOLATION: {} Released events but {} releases reached the transport",
                events.released, transport_releases
            ));
        }
        Outcome {
            run: None,
            service_config: config.to_string(),
            virtual_seconds: elapsed.as_secs_f64(),
            wall_seconds: 0.0,
            interrupted,
            incidents,
            reads,
            released: events.released,
            events,
            event_log: timeline.events(),
            transport_releases,
            returned_at_stop,
            leaked: Leaked {
                remote_metadata: held.remote_metadata,
                dlist_handles: held.dlist_handles,
            },
            violations,
        }
    }

    pub(super) fn leaked(&self) -> usize {
        self.leaked.remote_metadata + self.leaked.dlist_handles
    }
}

/// Prints the summary; its last line is the `summary:` line.
pub(super) fn print(outcome: &Outcome, run: &RunInfo, json: bool, real_time: bool, wall: Duration) {
    let mut outcome = outcome.clone();
    outcome.run = Some(run.clone());
    outcome.wall_seconds = wall.as_secs_f64();
    if json {
        match serde_json::to_string(&outcome) {
            Ok(text) => outln!("{text}"),
            Err(e) => eprintln!("error: cannot write the JSON summary: {e}"),
        }
    } else {
        print_tables(&outcome, real_time, wall);
    }
    outln!(
        "summary: released={} leaked={} violations={}",
        outcome.released,
        outcome.leaked(),
        outcome.violations.len()
    );
}

fn print_tables(o: &Outcome, real_time: bool, wall: Duration) {
    outln!();
    outln!("incidents (times from the incident; bound = the most the settings allow):");
    let header = [
        "#",
        "at",
        "incident",
        "address",
        "engine",
        "detected",
        "by",
        "released",
        "reason",
        "waited for",
        "bound",
        "check",
    ];
    let rows: Vec<Vec<String>> = o
        .incidents
        .iter()
        .map(|i| {
            vec![
                i.n.to_string(),
                clock(Duration::from_secs_f64(i.at_s)),
                i.incident.to_string(),
                i.address.clone(),
                i.engine.clone(),
                i.detected_after_s
                    .map(|s| format!("+{s:.2}s"))
                    .unwrap_or_else(|| "-".into()),
                i.detected_by.clone().unwrap_or_else(|| "-".into()),
                i.released_after_s
                    .map(|s| format!("+{s:.2}s"))
                    .unwrap_or_else(|| "-".into()),
                i.release_reason.unwrap_or("-").to_string(),
                i.waited_for.map(|w| w.text()).unwrap_or_else(|| "-".into()),
                i.bound_s
                    .map(|s| format!("{s:.1}s"))
                    .unwrap_or_else(|| "-".into()),
                i.check.clone(),
            ]
        })
        .collect();
    print_table(&header, &rows);
    let r = &o.reads;
    let push = o.run.as_ref().is_some_and(|run| run.push);
    outln!();
    outln!(
        "{}: {} ok, {} refused (engine marked), {} failed by the service, {} REMOTE_DISCONNECT, {} other errors; handshakes: {} ok, {} failed or retried",
        if push { "writes (push mode)" } else { "reads" },
        r.ok, r.refused_marked_engine, r.failed_by_service, r.remote_disconnect, r.other_error, r.handshakes_ok, r.handshakes_failed
    );
    let e = &o.events;
    let reasons: Vec<String> = e
        .released_by_reason
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    outln!(
        "events: {} registered, {} unreachable, {} stalled, {} replaced, {} transient errors, {} reads-failed, {} released ({}){}",
        e.registered,
        e.unreachable,
        e.stalled,
        e.replaced,
        e.transient_errors,
        e.reads_failed,
        e.released,
        reasons.join(" "),
        if e.lagged > 0 {
            format!("; {} events missed by the listener", e.lagged)
        } else {
            String::new()
        }
    );
    outln!(
        "at shutdown: {} registration(s) handed back by the service; still held: {} remote metadata, {} dlist handles",
        o.returned_at_stop, o.leaked.remote_metadata, o.leaked.dlist_handles
    );
    for v in &o.violations {
        outln!("{v}");
    }
    if real_time {
        outln!(
            "real time: {} scenario in {:.1} s",
            human(Duration::from_secs_f64(o.virtual_seconds)),
            wall.as_secs_f64()
        );
    } else {
        outln!(
            "virtual time: {} scenario in {:.1} s",
            human(Duration::from_secs_f64(o.virtual_seconds)),
            wall.as_secs_f64()
        );
    }
}

/// Prints rows under a header, columns padded to their widest cell.
pub(super) fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_string()
    };
    outln!("{}", line(header.to_vec()));
    for row in rows {
        outln!("{}", line(row.iter().map(String::as_str).collect()));
    }
}

/// `+MM:SS.s`.
pub(super) fn clock(d: Duration) -> String {
    let s = d.as_secs_f64();
    format!("+{:02}:{:04.1}", (s / 60.0) as u64, s % 60.0)
}

/// `10 min`, `90 s`, `250 ms`.
pub(super) fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 60.0 && (s % 60.0).abs() < 1e-9 {
        format!("{} min", s as u64 / 60)
    } else if s >= 1.0 {
        format!("{} s", trim(s))
    } else {
        format!("{} ms", trim(s * 1000.0))
    }
}

fn trim(x: f64) -> String {
    let t = format!("{x:.1}");
    t.strip_suffix(".0").map(str::to_string).unwrap_or(t)
}
