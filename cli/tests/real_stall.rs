//! Hung prefills on the real runtime: a SIGSTOPped prefill is never
//! reported by UCX on shm/tcp (measured: `real_frozen.rs`), so the
//! service's read-stall check is what finds one with reads in flight: its
//! own bound, or sooner `decode`'s timed-out reads (given up unanswered:
//! evidence, not completions). Slow is not hung, and an idle frozen
//! prefill cannot be told from an idle healthy one: both are kept, and the
//! snapshot says so.
//!
//! `decode` counts a read before its guard ends, and the last guard's end
//! is what lets the engine be released: whoever sees the `Released` event
//! sees the hung reads counted. The tests still wait for every count they
//! assert on (bounded, printing what they saw), and check that the count
//! was already there at the event, which is that guarantee.
//!
//! The bounds are the detector's, counted on the service's own clock: a
//! quiet stretch is judged exactly one bound after a check first saw it,
//! by a timer. Starved of CPU (measured once in 12 runs beside two busy
//! loops: no `stalled` within 3.5 s), the service's timers fire late and
//! the stall comes as much later; so each freeze measures how late a
//! timer on the service's runtime fires (a probe task beside it, sleeping
//! in 10 ms steps) and judges the stall against the bound plus that
//! lateness, twice (the check that starts the stretch, the timer that
//! judges it). A detector late in its own time still fails.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait::{check, until_async, MARGIN};
use common::{config, ms, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::ucx::settings::{detection_bound, UcxSettings};
use nixl_keepalive::{Config, EngineId, EngineState, Event, ReleaseReason, StallAction};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Found};

const STALL: Duration = Duration::from_secs(2);

fn stall_config() -> nixl_keepalive::Config {
    config(Duration::from_millis(500))
        .to_builder()
        .read_stall(Some(STALL), StallAction::Fail)
        .build()
        .expect("valid config")
}

fn options() -> DecodeOptions {
    DecodeOptions {
        // Longer than anything here: only the service ends a hung read.
        read_timeout: Duration::from_secs(60),
        read_pause: Duration::from_millis(5),
        probe_interval: Duration::from_millis(500),
        ..DecodeOptions::default()
    }
}

fn verified(d: &DecodeSide) -> u64 {
    d.decoder.stats().verified.load(Ordering::Relaxed)
}

fn abandoned(d: &DecodeSide) -> u64 {
    d.decoder.stats().abandoned.load(Ordering::Relaxed)
}

/// How often the lateness probe asks for a wake-up.
const PROBE_STEP: Duration = Duration::from_millis(10);

/// How late timers on the current runtime fire, at worst since it was
/// started: a task that sleeps in [`PROBE_STEP`]s and keeps the largest
/// overshoot. The service's timers run on the same runtime and threads,
/// so they are starved alike.
struct Lateness {
    worst_us: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Lateness {
    fn start() -> Lateness {
        let worst_us = Arc::new(AtomicU64::new(0));
        let worst = worst_us.clone();
        let task = tokio::spawn(async move {
            loop {
                let due = tokio::time::Instant::now() + PROBE_STEP;
                tokio::time::sleep_until(due).await;
                let late = due.elapsed().as_micros() as u64;
                worst.fetch_max(late, Ordering::Relaxed);
            }
        });
        Lateness { worst_us, task }
    }

    /// The worst lateness so far.
    fn worst(&self) -> Duration {
        Duration::from_micros(self.worst_us.load(Ordering::Relaxed))
    }
}

impl Drop for Lateness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long a frozen, stalled prefill is watched for a release that must
/// not come (its given-up reads fence it).
const FENCE_WATCH: Duration = Duration::from_secs(2);

/// Freezes `frozen` while both prefills are read; waits for its stall
/// (within `bound` of the SIGSTOP plus twice the worst timer lateness of
/// the service's runtime meanwhile, printing what it saw otherwise) and
/// its reads given up, checks that it is fenced (not released) while
/// frozen, then SIGCONT: its given-up READs complete, it is released, and
/// it is registered and read again. Returns (stop -> stalled, resume ->
/// released, reads at the mark, stalled_for, given_up, resume ->
/// registered again).
async fn freeze_and_thaw(
    d: &mut DecodeSide,
    frozen: &PrefillProc,
    healthy: &PrefillProc,
    bound: Duration,
    options: &DecodeOptions,
) -> (Duration, Duration, u64, Duration, u64, Duration) {
    let id = EngineId::from(frozen.engine.as_str());
    let healthy_id = EngineId::from(healthy.engine.as_str());
    let mut waiting = vec![id.clone(), healthy_id.clone()];
    d.wait_for(MARGIN, |e| {
        if let Event::Registered { engine, .. } = e {
            waiting.retain(|w| w != engine);
        }
        waiting.is_empty().then_some(())
    })
    .await;
    // Reads from both are going on before the freeze.
    let start = verified(d);
    until_async("reads verified from both prefills", MARGIN, || {
        check(verified(d) >= start + 20, verified(d))
    })
    .await;
    let lateness = Lateness::start();
    frozen.signal("STOP");
    let t0 = Instant::now();
    let before = verified(d);
    let abandoned_before = abandoned(d);
    // Waited for past the bound (MARGIN), and judged against the bound
    // plus the lateness measured meanwhile.
    let ((reads, stalled_for, given_up), stalled_at) = d
        .wait_for(bound + MARGIN, |e| match e {
            Event::Stalled {
                engine,
                reads_in_flight,
                stalled_for,
                given_up,
                failed: true,
                ..
            } if *engine == id => Some((*reads_in_flight, *stalled_for, *given_up)),
            _ => None,
        })
        .await;
    let late = lateness.worst();
    drop(lateness);
    let allowed = bound + late * 2;
    assert!(
        stalled_at - t0 <= allowed,
        "stalled {:?} after the freeze: over the bound {bound:?} plus twice the service \
         runtime's worst timer lateness {late:?} meanwhile",
        stalled_at - t0,
    );
    if late > Duration::from_millis(100) {
        report(&format!(
            "timers on the service's runtime fired up to {} late during the freeze (allowed {} instead of {})",
            ms(late),
            ms(allowed),
            ms(bound)
        ));
    }
    // The hung reads are given up at the stall (their requests failed
    // now), and their transfers fence the engine: no release while it
    // stays frozen, their landing slots lent.
    let counted = until_async("the hung reads given up", MARGIN, || {
        let n = abandoned(d) - abandoned_before;
        check(n >= 1, n).map(|()| n)
    })
    .await;
    d.assert_fenced_for(&id, FENCE_WATCH, "frozen").await;
    let lent = d.decoder.stats().slots_lent.load(Ordering::Relaxed);
    assert!(
        lent >= 1,
        "no landing slot lent to a given-up read ({counted} given up)"
    );
    until_async(
        "the healthy prefill's reads went on meanwhile",
        MARGIN,
        || check(verified(d) > before, (before, verified(d))),
    )
    .await;
    frozen.signal("CONT");
    let t1 = Instant::now();
    // Resumed: the given-up READs complete, the engine is released.
    let (reason, released_at) = d
        .wait_for(MARGIN, |e| match e {
            Event::Released { engine, reason, .. } if *engine == id => Some(*reason),
            _ => None,
        })
        .await;
    assert_eq!(reason, ReleaseReason::Stalled);
    until_async("the given-up reads' slots handed back", MARGIN, || {
        let lent = d.decoder.stats().slots_lent.load(Ordering::Relaxed);
        check(lent == 0, lent)
    })
    .await;
    let ended = d.decoder.stats().given_up_ended.lock().unwrap().clone();
    assert!(
        ended.keys().all(|raw| *raw == 0),
        "a given-up READ to a resumed prefill ended with {ended:?}, not SUCCESS"
    );
    // The reader handshakes again at its next try: an attempt begun while
    // frozen ends (at most one handshake timeout), then at most one retry
    // pause and one handshake.
    let reregistered = options.retry_max + options.handshake_timeout * 2 + MARGIN;
    let (_, again) = d
        .wait_for(reregistered, |e| {
            matches!(e, Event::Registered { engine, .. } if *engine == id).then_some(())
        })
        .await;
    // In the directory before its event is published.
    let engine = d.decoder.handle().engine(&id).expect("registered again");
    let resumed = verified(d);
    until_async("a read verified after SIGCONT", MARGIN, || {
        check(verified(d) > resumed, (resumed, engine.state()))
    })
    .await;
    assert_eq!(engine.state(), EngineState::Live);
    assert_eq!(d.decoder.stats().corrupt.load(Ordering::Relaxed), 0);
    (
        stalled_at - t0,
        released_at - t1,
        reads,
        stalled_for,
        given_up,
        again - t1,
    )
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_frozen_prefill_with_reads_in_flight_is_stalled_fenced_released_on_sigcont_and_read_again() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let frozen = PrefillProc::start(&PrefillSpec::default());
        let healthy = PrefillProc::start(&PrefillSpec::default());
        let mut d = DecodeSide::start(rt, stall_config(), options());
        let stop = d.shutdown.child_token();
        let readers = [
            d.decoder.spawn(frozen.addr.clone(), stop.clone()),
            d.decoder.spawn(healthy.addr.clone(), stop.clone()),
        ];
        // 1.25 bounds plus the slack the frozen bound documents.
        let bound = STALL + STALL / 4 + Duration::from_secs(1);
        let (stalled, released, reads, stalled_for, given_up, again) =
            freeze_and_thaw(&mut d, &frozen, &healthy, bound, &options()).await;
        assert!(stalled_for >= STALL, "marked after {stalled_for:?} only");
        assert!(
            stalled >= STALL,
            "marked {stalled:?} after the freeze, before the bound"
        );
        assert_eq!(given_up, 0, "decode's reads do not time out here");
        let ended = d.decoder.stats().given_up_ended.lock().unwrap().clone();
        let named: Vec<String> = ended
            .iter()
            .map(|(raw, n)| format!("{}x{n}", nixl_agent::NixlStatus::from_raw(*raw).name()))
            .collect();
        report(&format!(
            "bound {}: SIGSTOP with {reads} read(s) in flight: stalled after {} (no completion for {}), requests failed then, engine fenced while frozen; after SIGCONT the given-up READs ended {named:?} and it was released {} later, registered again {} later, reads verified",
            ms(STALL),
            ms(stalled),
            ms(stalled_for),
            ms(released),
            ms(again)
        ));
        stop.cancel();
        for r in readers {
            r.await.unwrap();
        }
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn with_every_default_a_frozen_prefill_with_reads_in_flight_is_stalled_within_the_frozen_bound() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let frozen = PrefillProc::start(&PrefillSpec::default());
        let healthy = PrefillProc::start(&PrefillSpec::default());
        let config = Config::default();
        let options = DecodeOptions::default();
        // The documented bound: what the start-up line and the gauge say.
        let gap = config.heartbeat_interval().unwrap() + config.jitter();
        let bound = detection_bound(&UcxSettings::defaults(), gap)
            .with_read_stall(config.read_stall())
            .frozen
            .expect("the read-stall check is on by default");
        let mut d = DecodeSide::start(rt, config.clone(), options.clone());
        let stop = d.shutdown.child_token();
        let readers = [
            d.decoder.spawn(frozen.addr.clone(), stop.clone()),
            d.decoder.spawn(healthy.addr.clone(), stop.clone()),
        ];
        let (stalled, released, reads, stalled_for, given_up, again) =
            freeze_and_thaw(&mut d, &frozen, &healthy, bound, &options).await;
        report(&format!(
            "every default (read stall {}, decode read timeout {}): SIGSTOP -> stalled {} ({reads} read(s) in flight, {given_up} given up as timed out, quiet for {}; documented bound {}), fenced while frozen; SIGCONT -> released {}, registered again {} later, reads verified",
            ms(config.read_stall().unwrap()),
            ms(options.read_timeout),
            ms(stalled),
            ms(stalled_for),
            ms(bound),
            ms(released),
            ms(again)
        ));
        // With the defaults decode's timed-out reads decide (the report
        // says how many), never sooner than a read could time out.
        assert!(
            stalled
                >= options.read_timeout.min(config.read_stall().unwrap())
                    - Duration::from_millis(100),
            "stalled {stalled:?} after the freeze: sooner than any read could time out"
        );
        stop.cancel();
        for r in readers {
            r.await.unwrap();
        }
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_slow_prefill_whose_reads_still_complete_is_never_marked() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let slow = PrefillProc::start(&PrefillSpec::default());
        let healthy = PrefillProc::start(&PrefillSpec::default());
        let mut d = DecodeSide::start(rt, stall_config(), options());
        let stop = d.shutdown.child_token();
        let readers = [
            d.decoder.spawn(slow.addr.clone(), stop.clone()),
            d.decoder.spawn(healthy.addr.clone(), stop.clone()),
        ];
        let id = EngineId::from(slow.engine.as_str());
        d.wait_for(MARGIN, |e| {
            matches!(e, Event::Registered { engine, .. } if *engine == id).then_some(())
        })
        .await;
        // Throttled: stopped 1.2 s, running 0.3 s, for 12 s. Its reads
        // complete only in the running windows, never 2 s apart.
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(12) {
            slow.signal("STOP");
            tokio::time::sleep(Duration::from_millis(1200)).await;
            slow.signal("CONT");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let events = d.drain();
        let marked: Vec<&Event> = events
            .iter()
            .filter(|e| match e {
                Event::Stalled { engine, .. }
                | Event::Unreachable { engine, .. }
                | Event::Released { engine, .. } => *engine == id,
                _ => false,
            })
            .collect();
        assert!(marked.is_empty(), "a slow prefill was marked: {marked:?}");
        let engine = d.decoder.handle().engine(&id).expect("still registered");
        assert_eq!(engine.state(), EngineState::Live);
        report(&format!(
            "a prefill stopped 1.2 s of every 1.5 s for 12 s (read-stall bound {}): never marked; {} reads verified overall",
            ms(STALL),
            verified(&d)
        ));
        stop.cancel();
        for r in readers {
            r.await.unwrap();
        }
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn an_idle_frozen_prefill_is_kept_and_the_snapshot_says_who_can_retire_it() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let p = PrefillProc::start(&PrefillSpec::default());
        let mut d = DecodeSide::start(rt, stall_config(), options());
        let c = match d.decoder.connect(&p.addr, None).await.expect("handshake") {
            Found::New(c) => c,
            Found::Unchanged => unreachable!(),
        };
        p.signal("STOP");
        tokio::time::sleep(STALL * 3).await;
        let id = EngineId::from(p.engine.as_str());
        let snapshot = d.decoder.handle().snapshot().await.unwrap();
        let why = snapshot.engine(&id).expect("kept").why.clone();
        p.signal("CONT");
        assert_eq!(c.engine.state(), EngineState::Live);
        assert!(
            !d.drain()
                .iter()
                .any(|e| matches!(e, Event::Stalled { .. } | Event::Released { .. })),
            "nothing to tell an idle frozen prefill from an idle healthy one"
        );
        assert!(
            why.contains("only a membership signal or the router"),
            "{why}"
        );
        report(&format!(
            "idle and frozen for {}: kept; why: {why}",
            ms(STALL * 3)
        ));
        d.stop().await;
    })
}
