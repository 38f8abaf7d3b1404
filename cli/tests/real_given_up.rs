//! Issue 43 on the real runtime, with `decode`'s reader: a frozen prefill
//! costs no request a hang and the decode no landing slot for good.
//!
//! Cycles (`NIXL_KEEPALIVE_FREEZE_CYCLES`, 20 by default) of a prefill
//! SIGSTOPped with reads in flight, then resumed (SIGCONT) or, every
//! fourth, SIGKILLed and started again at the same address. Each cycle
//! checks: the hung reads are given up (their requests failed) within the
//! stall bound; the engine is not released while they may run (every
//! given-up READ was seen to end before its `Released` event); once the
//! prefill resumes or dies the READs end and every landing slot is free
//! again; and the reads into the reused slots verify byte for byte (no late
//! byte of a given-up READ lands in them). It prints the slots held per
//! cycle.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::wait::{check, until_async, MARGIN};
use common::{config, ms, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::{EngineId, Event, ReleaseReason, StallAction};
use nixl_keepalive_cli::pd::decode::DecodeOptions;

const STALL: Duration = Duration::from_secs(2);

/// How long a frozen prefill is watched for a release that must not come.
const FENCE_WATCH: Duration = Duration::from_millis(1500);

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_frozen_prefill_fails_its_reads_at_once_and_gives_every_slot_back_when_it_resumes_or_dies() {
    let rt = real_runtime();
    let _serial = serial();
    let cycles: usize = std::env::var("NIXL_KEEPALIVE_FREEZE_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    common::block_on(async move {
        let mut p = PrefillProc::start(&PrefillSpec::default());
        let config = config(Duration::from_millis(500))
            .to_builder()
            .read_stall(Some(STALL), StallAction::Fail)
            .build()
            .expect("valid config");
        let options = DecodeOptions {
            // Longer than anything here: the service's stall decides.
            read_timeout: Duration::from_secs(60),
            read_pause: Duration::from_millis(5),
            probe_interval: Duration::from_millis(500),
            ..DecodeOptions::default()
        };
        let mut d = DecodeSide::start(rt, config, options);
        let stop = d.shutdown.child_token();
        let reader = d.decoder.spawn(p.addr.clone(), stop.clone());
        let decoder = d.decoder.clone();
        let stats = decoder.stats();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let mut rows = Vec::new();
        for cycle in 0..cycles {
            let id = EngineId::from(p.engine.as_str());
            d.wait_for(MARGIN * 2, |e| {
                matches!(e, Event::Registered { engine, .. } if *engine == id).then_some(())
            })
            .await;
            let start = load(&stats.verified);
            until_async("reads verified before the freeze", MARGIN, || {
                check(load(&stats.verified) >= start + 10, load(&stats.verified))
            })
            .await;
            let given_before = load(&stats.abandoned);
            let ended_before: u64 = stats.given_up_ended.lock().unwrap().values().sum();
            p.signal("STOP");
            let stopped = Instant::now();
            // Failed within the stall bound (1.25 bounds, plus margin).
            let given = until_async(
                "the hung reads given up",
                STALL + STALL / 4 + MARGIN,
                || {
                    let n = load(&stats.abandoned) - given_before;
                    check(n >= 1, n).map(|()| n)
                },
            )
            .await;
            let failed_in = stopped.elapsed();
            d.assert_fenced_for(&id, FENCE_WATCH, &format!("cycle {cycle}, frozen"))
                .await;
            let held = load(&stats.slots_lent);
            assert!(held >= 1, "cycle {cycle}: no slot held by a given-up read");
            let resume = cycle % 4 != 3;
            let ended_at = Instant::now();
            if resume {
                p.signal("CONT");
            } else {
                p.kill();
            }
            let (reason, released) = d
                .wait_for(MARGIN * 2, |e| match e {
                    Event::Released { engine, reason, .. } if *engine == id => Some(*reason),
                    _ => None,
                })
                .await;
            // Every given-up READ had been seen to end before the release.
            let ended: u64 = stats.given_up_ended.lock().unwrap().values().sum();
            assert!(
                ended - ended_before >= load(&stats.abandoned) - given_before,
                "cycle {cycle}: released with given-up READs not ended ({} given up, {} ended)",
                load(&stats.abandoned) - given_before,
                ended - ended_before
            );
            assert!(
                matches!(reason, ReleaseReason::Stalled | ReleaseReason::Unreachable),
                "cycle {cycle}: {reason:?}"
            );
            until_async("every landing slot back", MARGIN, || {
                check(load(&stats.slots_lent) == 0, load(&stats.slots_lent))
            })
            .await;
            let back_in = ended_at.elapsed();
            if !resume {
                p = PrefillProc::start(&PrefillSpec {
                    listen: Some(p.listen()),
                    ..PrefillSpec::default()
                });
            }
            assert_eq!(load(&stats.slots_retired), 0, "a slot retired");
            assert_eq!(load(&stats.corrupt), 0, "a read returned wrong bytes");
            report(&format!(
                "cycle {}/{cycles} ({}): {given} read(s) given up {} after SIGSTOP (stall {}), {held} slot(s) held while frozen, released {} and every slot back {} after the {}",
                cycle + 1,
                if resume { "SIGCONT" } else { "SIGKILL" },
                ms(failed_in),
                ms(STALL),
                ms(released - ended_at),
                ms(back_in),
                if resume { "resume" } else { "kill" },
            ));
            rows.push(held);
        }
        // The reused slots are read into again: verified, none corrupt.
        let start = load(&stats.verified);
        until_async("reads verified after the cycles", MARGIN, || {
            check(load(&stats.verified) >= start + 20, load(&stats.verified))
        })
        .await;
        assert_eq!(load(&stats.corrupt), 0);
        let ended = stats.given_up_ended.lock().unwrap().clone();
        report(&format!(
            "{cycles} freeze cycles: slots held per cycle {rows:?}, back to 0 after each; given-up READs ended {ended:?} (raw status -> count); 0 retired, 0 corrupt, 0 released under a READ"
        ));
        stop.cancel();
        reader.await.unwrap();
        d.stop().await;
        p.stop();
    })
}
