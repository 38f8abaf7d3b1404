//! Push mode on the real runtime: `nixl-keepalive decode --push` children
//! (their blocks written by the test, each write's bytes checked there),
//! and the prefill side in the test process: the keepalive service over a
//! `NixlTransport`, and the initiator writing (`Direction::Write`, NIXL
//! WRITEs with `WR:` notifications). Here the prefill holds the decode's
//! metadata and the keys to its memory, and it is the prefill's keepalive
//! that must release a dead decode. Each test prints what it measured
//! (`MEASURED ...`). Without the NIXL runtime each prints `SKIPPED` and
//! passes, unless NIXL_KEEPALIVE_REQUIRE_REAL=1.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::procfs::held;
use common::wait::MARGIN;
use common::{config, ms, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::{EngineId, EngineState, Event, NixlStatus, ReleaseReason};
use nixl_keepalive_cli::pd::decode::ReadOutcome;
use nixl_keepalive_cli::pd::decode::{Connected, DecodeOptions, Decoder, Direction, Found};

fn connected(h: Found) -> Connected {
    match h {
        Found::New(c) => c,
        Found::Unchanged => panic!("expected a new engine"),
    }
}

/// The prefill side: the initiator writing, with 32 local slots (taken
/// oldest first) for [`keep_writing`]'s four writers.
fn writing() -> DecodeOptions {
    DecodeOptions {
        direction: Direction::Write,
        reads_in_flight: 32,
        ..DecodeOptions::default()
    }
}

/// A push-mode decode with two ranks of eight blocks.
fn decode_spec() -> PrefillSpec {
    PrefillSpec {
        push: true,
        ranks: Some(2),
        ..Default::default()
    }
}

/// Writes into `c` from `writers` tasks, one block each in turn, until a
/// write ends otherwise than written (or `until` is set: then the last
/// outcome is `Written`); how many each wrote, and the outcome that
/// stopped it.
fn keep_writing(
    decoder: &Arc<Decoder>,
    c: &Connected,
    writers: u32,
    until: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(u64, ReadOutcome)>> {
    (0..writers)
        .map(|w| {
            let (decoder, c, until) = (decoder.clone(), c.clone(), until.clone());
            tokio::spawn(async move {
                let mut written = 0;
                loop {
                    if until.load(Ordering::Relaxed) {
                        return (written, ReadOutcome::Written);
                    }
                    let block = (w + written as u32 * writers) % c.remote.blocks;
                    match decoder.write(&c, (w % 2) as u16, block).await {
                        ReadOutcome::Written => written += 1,
                        other => return (written, other),
                    }
                }
            })
        })
        .collect()
}

/// What a push-mode decode counted of the writes into it.
#[derive(Debug, PartialEq, Eq)]
struct Checked {
    verified: u64,
    corrupt: u64,
    /// Reserved again by a newer write before the check: not checked.
    overwritten: u64,
}

/// The decode's `writes:` line at its stop (none late, none malformed).
fn stop_and_count(d: &mut PrefillProc) -> Checked {
    d.signal("TERM");
    let line = d.wait_line("writes: ", MARGIN);
    let line = if line.ends_with("at=stop") {
        line
    } else {
        d.wait_line("writes: ", MARGIN)
    };
    let field = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {line:?}"))
    };
    assert_eq!(field("late="), 0, "{line}");
    assert_eq!(field("malformed="), 0, "{line}");
    Checked {
        verified: field("verified="),
        corrupt: field("corrupt="),
        overwritten: field("overwritten="),
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn writes_into_a_live_decode_land_byte_for_byte_and_the_prefills_heartbeats_renew_their_leases() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        // 64 blocks a rank: each writer comes back to a block after 16
        // writes, mostly after the decode checked it.
        let mut d = PrefillProc::start(&PrefillSpec {
            blocks: Some(64),
            ..decode_spec()
        });
        let p = DecodeSide::start(rt, config(Duration::from_millis(100)), writing());
        let c = connected(p.decoder.connect(&d.addr, None).await.expect("handshake"));
        let mut written = 0;
        for round in 0..4 {
            for rank in 0..2 {
                for block in 0..8 {
                    assert_eq!(
                        p.decoder.write(&c, rank, block).await,
                        ReadOutcome::Written,
                        "round {round}, rank {rank}, block {block}"
                    );
                    written += 1;
                }
            }
        }
        // Writes kept in flight for a while: the keepalive's heartbeats
        // (every 100 ms) name the requests still pending, and the decode
        // extends their leases.
        let until = Arc::new(AtomicBool::new(false));
        let writers = keep_writing(&p.decoder, &c, 4, &until);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        until.store(true, Ordering::Relaxed);
        for w in writers {
            let (n, last) = w.await.expect("writer");
            assert_eq!(last, ReadOutcome::Written);
            written += n;
        }
        let checked = stop_and_count(&mut d);
        assert_eq!(checked.corrupt, 0, "{checked:?}");
        assert_eq!(
            checked.verified + checked.overwritten,
            written,
            "every write's WR: handled at the decode: {checked:?}"
        );
        assert!(
            checked.verified >= 64,
            "the sequential writes (at least) checked: {checked:?}"
        );
        let Checked {
            verified,
            overwritten,
            ..
        } = checked;
        let log = d.log_text();
        let summary = log
            .lines()
            .find(|l| l.contains("lease summary"))
            .unwrap_or_else(|| panic!("no lease summary in the decode's log"));
        let extended: u64 = summary
            .split_whitespace()
            .find_map(|w| w.strip_prefix("extended="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no extended= in {summary:?}"));
        assert!(
            extended > 0,
            "no heartbeat of the prefill named a pending write: {summary}"
        );
        report(&format!(
            "{written} WRITEs into a live decode, {verified} verified there ({overwritten} reserved again before their check), none corrupt or late; {extended} lease extensions by the prefill's HB:"
        ));
        p.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_decode_sigkilled_under_writes_is_released_at_the_prefill_within_one_heartbeat_gap() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let mut d = PrefillProc::start(&decode_spec());
        let interval = Duration::from_millis(500);
        let mut p = DecodeSide::start(rt, config(interval), writing());
        let c = connected(p.decoder.connect(&d.addr, None).await.expect("handshake"));
        assert_eq!(p.decoder.write(&c, 1, 3).await, ReadOutcome::Written);
        let engine = EngineId::from(d.engine.as_str());
        let never = Arc::new(AtomicBool::new(false));
        let writers = keep_writing(&p.decoder, &c, 4, &never);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let killed = d.kill();
        // Detected by a write (or the next heartbeat), released once the
        // last write guard ended: at most one heartbeat gap.
        let gap = interval + interval / 10;
        let ((reason, waited_for), released) = p
            .wait_for(gap + MARGIN, |e| match e {
                Event::Released {
                    engine: id,
                    reason,
                    waited_for,
                    ..
                } if *id == engine => Some((*reason, waited_for.reads_in_flight_at_mark)),
                _ => None,
            })
            .await;
        assert_eq!(reason, ReleaseReason::Unreachable);
        assert_eq!(c.engine.state(), EngineState::Released);
        assert!(c.remote.dlists.is_released(), "dlist handles released");
        let mut total = 0;
        for w in writers {
            let (n, stopped) = w.await.expect("writer");
            total += n;
            // Failed by NIXL, refused once the engine was marked, or in
            // progress when the service failed its transfers (then given
            // up: its slot stays lent).
            assert!(
                matches!(
                    stopped,
                    ReadOutcome::Failed(_) | ReadOutcome::Released | ReadOutcome::Abandoned { .. }
                ),
                "a write into a dead decode: {stopped:?}"
            );
        }
        // The prefill can no longer reach it: its metadata is gone.
        let agent = p.transport.agent();
        for name in &c.remote.agents {
            let e = agent.gen_notif(name.as_str(), b"HB:").unwrap_err();
            assert_eq!(
                e.status,
                NixlStatus::ERR_NOT_FOUND,
                "genNotif after release: {e}"
            );
        }
        let took = released - killed;
        assert!(
            took <= gap + MARGIN,
            "kill -> release {} past one heartbeat gap ({})",
            ms(took),
            ms(gap)
        );
        report(&format!(
            "SIGKILL of a decode under {total} WRITEs (4 writers): kill->release {} (bound: one gap, {}), {waited_for} write(s) in flight at the mark",
            ms(took),
            ms(gap)
        ));
        p.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_decode_restarted_with_a_new_id_and_with_the_same_id_is_released_and_loaded_again() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let id = common::unique("pinned-decode");
        let mut d1 = PrefillProc::start(&decode_spec());
        let mut p = DecodeSide::start(rt, common::handshake_only_config(), writing());
        let c1 = connected(p.decoder.connect(&d1.addr, None).await.expect("handshake"));
        assert_eq!(p.decoder.write(&c1, 0, 1).await, ReadOutcome::Written);
        let old = EngineId::from(d1.engine.as_str());
        // A new engine id at the same port: replaced.
        d1.kill();
        let mut d2 = PrefillProc::start(&PrefillSpec {
            listen: Some(d1.listen()),
            engine_id: Some(id.clone()),
            ..decode_spec()
        });
        let c2 = connected(
            p.decoder
                .connect(&d2.addr, Some(&c1))
                .await
                .expect("handshake with the new decode"),
        );
        let (reason, _) = p
            .wait_for(MARGIN, |e| match e {
                Event::Released { engine, reason, .. } if *engine == old => Some(*reason),
                _ => None,
            })
            .await;
        assert_eq!(reason, ReleaseReason::Replaced);
        let e = p
            .transport
            .agent()
            .gen_notif(c1.remote.agents[0].as_str(), b"HB:")
            .unwrap_err();
        assert_eq!(
            e.status,
            NixlStatus::ERR_NOT_FOUND,
            "old metadata invalidated"
        );
        assert_eq!(p.decoder.write(&c2, 1, 7).await, ReadOutcome::Written);
        // The same id again, a new incarnation: released before the new
        // one is loaded.
        d2.kill();
        let mut d3 = PrefillProc::start(&PrefillSpec {
            listen: Some(d2.listen()),
            engine_id: Some(id.clone()),
            ..decode_spec()
        });
        p.drain();
        let from = p.seen.len();
        let c3 = connected(
            p.decoder
                .connect(&d3.addr, Some(&c2))
                .await
                .expect("handshake with the restarted decode"),
        );
        assert_ne!(c2.remote.incarnation, c3.remote.incarnation);
        let engine = EngineId::from(id.as_str());
        p.wait_for(MARGIN, |e| {
            matches!(e, Event::Registered { engine: e_id, .. } if *e_id == engine).then_some(())
        })
        .await;
        let events = &p.seen[from..];
        let released_at = events
            .iter()
            .position(|e| matches!(e, Event::Released { engine: e_id, reason: ReleaseReason::Reregistered, .. } if *e_id == engine))
            .unwrap_or_else(|| panic!("old incarnation not released before the new one registered: {events:?}"));
        assert!(released_at < events.len() - 1, "{events:?}");
        assert!(c2.remote.dlists.is_released());
        for rank in 0..2 {
            for block in 0..8 {
                assert_eq!(
                    p.decoder.write(&c3, rank, block).await,
                    ReadOutcome::Written
                );
            }
        }
        let checked = stop_and_count(&mut d3);
        assert_eq!(
            checked,
            Checked {
                verified: 16,
                corrupt: 0,
                overwritten: 0
            },
            "the restarted decode checked every write"
        );
        report("decode restarted with a new id (replaced) and with the same id (re-registered): each old registration released, its metadata gone, the new one written and verified");
        p.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_decode_sigstopped_with_writes_in_flight_is_fenced_and_released_once_they_ended() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        // Big blocks: writes are on the wire when the stop lands.
        let d = PrefillProc::start(&PrefillSpec {
            block_size: Some(4 << 20),
            ..decode_spec()
        });
        let options = DecodeOptions {
            read_timeout: Duration::from_secs(2),
            ..writing()
        };
        let mut p = DecodeSide::start(rt, config(Duration::from_millis(500)), options);
        let c = connected(p.decoder.connect(&d.addr, None).await.expect("handshake"));
        let engine = EngineId::from(d.engine.as_str());
        let never = Arc::new(AtomicBool::new(false));
        let writers = keep_writing(&p.decoder, &c, 4, &never);
        tokio::time::sleep(Duration::from_millis(300)).await;
        d.signal("STOP");
        let stopped = Instant::now();
        let in_flight = c.engine.reads_in_flight();
        // The writes are given up (the runtime's timeout) and the stall is
        // judged; their transfers fence the decode: not released while it
        // stays stopped.
        p.wait_for(Duration::from_secs(20) + MARGIN, |e| match e {
            Event::Stalled { engine: id, .. } if *id == engine => Some(()),
            _ => None,
        })
        .await;
        let mut given_up = 0;
        for w in writers {
            let (_, outcome) = w.await.expect("writer");
            if outcome.lent_slot().is_some() {
                given_up += 1;
            }
        }
        assert!(given_up >= 1, "no write was in flight at the stop");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let fenced = p.drain();
        assert!(
            !fenced
                .iter()
                .any(|e| matches!(e, Event::Released { engine: id, .. } if *id == engine)),
            "released while stopped, under its given-up writes: {fenced:?}"
        );
        assert!(
            c.engine.reads_in_flight() >= 1,
            "the given-up writes still count"
        );
        // Resumed: the writes end, the decode is released.
        d.signal("CONT");
        let resumed = Instant::now();
        let ((reason, at_mark), released) = p
            .wait_for(MARGIN, |e| match e {
                Event::Released {
                    engine: id,
                    reason,
                    waited_for,
                    ..
                } if *id == engine => Some((*reason, waited_for.reads_in_flight_at_mark)),
                _ => None,
            })
            .await;
        assert_eq!(reason, ReleaseReason::Stalled);
        assert_eq!(
            c.engine.reads_in_flight(),
            0,
            "released with no write in flight"
        );
        let e = p
            .transport
            .agent()
            .gen_notif(c.remote.agents[0].as_str(), b"HB:")
            .unwrap_err();
        assert_eq!(e.status, NixlStatus::ERR_NOT_FOUND, "metadata gone");
        report(&format!(
            "SIGSTOP of a decode with {in_flight} WRITE(s) in flight: {given_up} given up (2 s timeout) and stalled, fenced while stopped ({} watched), released {} after SIGCONT ({at_mark} in flight at the mark), never before the writes ended",
            ms(resumed - stopped),
            ms(released - resumed)
        ));
        p.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_prefills_descriptors_and_endpoints_stay_flat_over_a_hundred_decode_restarts() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let cycles = 100;
        let mut d = PrefillProc::start(&decode_spec());
        let mut p = DecodeSide::start(rt, config(Duration::from_secs(60)), writing());
        let mut c = connected(p.decoder.connect(&d.addr, None).await.expect("handshake"));
        let me = std::process::id();
        let endpoints = |p: &DecodeSide| p.transport.ucx_endpoints().map(|e| e.endpoints.len());
        let mut samples = Vec::new();
        let started = Instant::now();
        for cycle in 1..=cycles {
            assert_eq!(
                p.decoder.write(&c, 0, cycle % 8).await,
                ReadOutcome::Written
            );
            let old = EngineId::from(d.engine.as_str());
            d.kill();
            d = PrefillProc::start(&PrefillSpec {
                listen: Some(d.listen()),
                ..decode_spec()
            });
            let next = connected(
                p.decoder
                    .connect(&d.addr, Some(&c))
                    .await
                    .unwrap_or_else(|e| panic!("cycle {cycle}: handshake: {e}")),
            );
            p.wait_for(MARGIN, |e| {
                matches!(e, Event::Released { engine, .. } if *engine == old).then_some(())
            })
            .await;
            p.drain();
            c = next;
            if cycle == 10 || cycle == cycles {
                samples.push((cycle, held(me).fds, endpoints(&p)));
            }
        }
        let (_, fds_10, ep_10) = samples[0];
        let (_, fds_end, ep_end) = samples[1];
        assert!(
            fds_end <= fds_10 + 2,
            "descriptors grew over the restarts: {samples:?}"
        );
        assert_eq!(
            ep_end, ep_10,
            "UCX endpoints grew over the restarts: {samples:?}"
        );
        report(&format!(
            "{cycles} decode SIGKILL + restart cycles in {}: the prefill's descriptors {fds_10} at cycle 10, {fds_end} at {cycles}; UCX endpoints {ep_10:?} -> {ep_end:?} (one loaded decode at a time)",
            ms(started.elapsed())
        ));
        p.stop().await;
    })
}
