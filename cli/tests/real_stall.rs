//! Hung prefills on the real runtime: a SIGSTOPped prefill is never
//! reported by UCX on shm/tcp (measured: `real_frozen.rs`), so the
//! service's read-stall check is what finds one with reads in flight. Slow
//! is not hung, and an idle frozen prefill cannot be told from an idle
//! healthy one: both are kept, and the snapshot says so.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{config, ms, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_keepalive::{EngineId, EngineState, Event, ReleaseReason, StallAction};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Handshake};
use nixl_sys::testing::runtime_or_skip;

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

#[test]
fn a_frozen_prefill_with_reads_in_flight_is_stalled_released_and_read_again_after_sigcont() {
    let Some(rt) = runtime_or_skip() else { return };
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
        let id = EngineId::from(frozen.engine.as_str());
        let healthy_id = EngineId::from(healthy.engine.as_str());
        let mut waiting = vec![id.clone(), healthy_id.clone()];
        d.wait_for(Duration::from_secs(10), |e| {
            if let Event::Registered { engine, .. } = e {
                waiting.retain(|w| w != engine);
            }
            waiting.is_empty().then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        frozen.signal("STOP");
        let t0 = Instant::now();
        let before = verified(&d);
        let ((reads, stalled_for), stalled_at) = d
            .wait_for(STALL * 4, |e| match e {
                Event::Stalled {
                    engine,
                    reads_in_flight,
                    stalled_for,
                    failed: true,
                } if *engine == id => Some((*reads_in_flight, *stalled_for)),
                _ => None,
            })
            .await;
        let (reason, released_at) = d
            .wait_for(Duration::from_secs(10), |e| match e {
                Event::Released { engine, reason, .. } if *engine == id => Some(*reason),
                _ => None,
            })
            .await;
        assert_eq!(reason, ReleaseReason::Stalled);
        assert!(
            verified(&d) > before,
            "the healthy prefill's reads went on meanwhile"
        );
        let abandoned = d.decoder.stats().abandoned.load(Ordering::Relaxed);
        assert!(abandoned >= 1, "the hung reads were abandoned, none hangs");
        let releases = d.decoder.stats().abandoned_release.lock().unwrap().clone();
        // Measured with nixl-cu12 1.5.1: releasing a READ in progress to a
        // frozen peer (UCX over shm/tcp) is accepted; the request is gone.
        let named: Vec<String> = releases
            .iter()
            .map(|(raw, n)| format!("{}x{n}", nixl_sys::NixlStatus::from_raw(*raw).name()))
            .collect();
        assert!(
            releases.keys().all(|raw| *raw == 0),
            "releaseXferReq of a READ to a frozen peer: {named:?}"
        );
        report(&format!(
            "SIGSTOP with {reads} read(s) in flight: stalled after {} (no completion for {}; bound {} x 1.25), released {} later; {abandoned} read(s) abandoned, releaseXferReq said {named:?}",
            ms(stalled_at - t0),
            ms(stalled_for),
            ms(STALL),
            ms(released_at - stalled_at)
        ));
        // SIGCONT: the same process answers again, and the reader loop
        // registers it afresh and reads from it.
        frozen.signal("CONT");
        let t1 = Instant::now();
        let (_, again) = d
            .wait_for(Duration::from_secs(20), |e| {
                matches!(e, Event::Registered { engine, .. } if *engine == id).then_some(())
            })
            .await;
        let engine = d.decoder.handle().engine(&id).expect("registered again");
        let resumed = verified(&d);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(verified(&d) > resumed);
        assert_eq!(engine.state(), EngineState::Live);
        assert_eq!(d.decoder.stats().corrupt.load(Ordering::Relaxed), 0);
        report(&format!(
            "after SIGCONT: registered again {} later, reads verified",
            ms(again - t1)
        ));
        stop.cancel();
        for r in readers {
            r.await.unwrap();
        }
        d.stop().await;
    })
}

#[test]
fn a_slow_prefill_whose_reads_still_complete_is_never_marked() {
    let Some(rt) = runtime_or_skip() else { return };
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
        d.wait_for(Duration::from_secs(10), |e| {
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
fn an_idle_frozen_prefill_is_kept_and_the_snapshot_says_who_can_retire_it() {
    let Some(rt) = runtime_or_skip() else { return };
    let _serial = serial();
    common::block_on(async move {
        let p = PrefillProc::start(&PrefillSpec::default());
        let mut d = DecodeSide::start(rt, stall_config(), options());
        let c = match d.decoder.connect(&p.addr, None).await.expect("handshake") {
            Handshake::New(c) => c,
            Handshake::Unchanged => unreachable!(),
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
