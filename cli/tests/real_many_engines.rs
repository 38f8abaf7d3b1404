//! Many real engines in one process (`prefill --engines N`, issue 32): one
//! decode side (service + NixlTransport + reader, in the test process)
//! holding every engine of two such processes, one of them SIGKILLed.
//! Prints what it measured (`MEASURED ...`). Without the NIXL runtime it
//! prints `SKIPPED` and passes, unless NIXL_KEEPALIVE_REQUIRE_REAL=1.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::procfs::held;
use common::wait::{check, until_async, MARGIN};
use common::{config, ms, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::{EngineId, EngineState, Event, ReleaseReason};
use nixl_keepalive_cli::pd::decode::{Connected, DecodeOptions, Found, ReadOutcome};

/// Engines per process: tens, not a thousand (the scale is the
/// benchmark's); enough that a release storm of one process is many
/// releases at once.
const ENGINES: u16 = 12;

fn connected(h: Found) -> Connected {
    match h {
        Found::New(c) => c,
        Found::Unchanged => panic!("expected a new engine"),
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_killed_process_of_twelve_engines_has_each_released_once_and_its_descriptors_come_back() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let spec = PrefillSpec {
            engines: Some(ENGINES),
            listen: Some("127.0.0.1:0".into()),
            ..Default::default()
        };
        let mut doomed = PrefillProc::start(&spec);
        let healthy = PrefillProc::start(&spec);
        assert_eq!(doomed.hosted.len(), usize::from(ENGINES));
        let ids = |p: &PrefillProc| -> BTreeSet<String> {
            p.hosted.iter().map(|e| e.engine.clone()).collect()
        };
        assert_eq!(ids(&doomed).len(), usize::from(ENGINES), "distinct ids");
        assert!(ids(&doomed).is_disjoint(&ids(&healthy)));

        let interval = Duration::from_millis(500);
        let mut d = DecodeSide::start(rt, config(interval), DecodeOptions::default());
        let me = std::process::id();
        let load = |hosted: Vec<common::HostedEngine>| {
            let decoder = d.decoder.clone();
            async move {
                let mut out = Vec::new();
                for e in hosted {
                    let c = connected(decoder.connect(&e.addr, None).await.expect("handshake"));
                    assert_eq!(decoder.read(&c, 0, 1).await, ReadOutcome::Verified);
                    out.push(c);
                }
                out
            }
        };
        let kept = load(healthy.hosted.clone()).await;
        let before = held(me);
        let lost = load(doomed.hosted.clone()).await;
        let loaded = held(me);
        assert!(
            loaded.fds > before.fds,
            "loading {ENGINES} engines opened no descriptor: {before:?} -> {loaded:?}"
        );

        let killed = doomed.kill();
        // Every engine of the killed process is found by its own
        // heartbeat (one gap), then released at once: no read in flight.
        let gap = interval + interval / 10;
        let doomed_ids: BTreeSet<EngineId> = lost.iter().map(|c| c.engine.id().clone()).collect();
        let mut released: BTreeMap<EngineId, (ReleaseReason, Instant)> = BTreeMap::new();
        while released.len() < lost.len() {
            let ((engine, reason), at) = d
                .wait_for(gap * 2 + MARGIN, |e| match e {
                    Event::Released { engine, reason, .. } => Some((engine.clone(), *reason)),
                    _ => None,
                })
                .await;
            assert!(
                doomed_ids.contains(&engine),
                "{engine}, of the live process, was released"
            );
            assert!(
                released.insert(engine.clone(), (reason, at)).is_none(),
                "{engine} released twice"
            );
        }
        for (engine, (reason, _)) in &released {
            assert_eq!(*reason, ReleaseReason::Unreachable, "{engine}");
        }
        for c in &lost {
            assert_eq!(c.engine.state(), EngineState::Released);
            assert!(c.remote.dlists.is_released(), "dlist handles released");
        }
        // Two more heartbeat gaps: no second release, none of the live
        // process's engines, which still read.
        tokio::time::sleep(gap * 2).await;
        for e in d.drain() {
            if let Event::Released { engine, .. } = e {
                panic!("{engine} released after the twelve (again, or a live one)");
            }
        }
        for c in &kept {
            assert_eq!(c.engine.state(), EngineState::Live);
            assert_eq!(d.decoder.read(c, 0, 2).await, ReadOutcome::Verified);
        }
        // The killed engines' descriptors come back (their UCX endpoints'
        // sockets and whatever else the loads opened).
        let back = until_async("the decode's descriptors back", MARGIN, || {
            let now = held(me);
            check(now.fds <= before.fds, now).map(|()| now)
        })
        .await;
        let first = released.values().map(|(_, at)| *at).min().expect("some");
        let last = released.values().map(|(_, at)| *at).max().expect("some");
        report(&format!(
            "{ENGINES} engines in one SIGKILLed process, heartbeat {interval:?}: kill->first release {}, kill->last {}; decode fds {} with the live process's {ENGINES}, {} with all {}, {} after",
            ms(first - killed),
            ms(last - killed),
            before.fds,
            loaded.fds,
            2 * ENGINES,
            back.fds
        ));
        drop((lost, kept));
        d.stop().await;
    })
}
