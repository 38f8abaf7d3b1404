//! Real processes, killed for real: `nixl-keepalive prefill` children and a
//! decode side (service + NixlTransport + reader) in the test process.
//! Each test prints what it measured (`MEASURED ...` on stderr and in
//! `<target tmp>/real-measurements.log`). Without the NIXL runtime each
//! prints `SKIPPED` and passes, unless NIXL_KEEPALIVE_REQUIRE_REAL=1.

mod common;

use std::time::{Duration, Instant};

use common::wait::{check, until_async, MARGIN};
use common::{config, ms, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::{EngineId, EngineState, Event, NixlStatus, ReleaseReason};
use nixl_keepalive_cli::pd::decode::{DecodeOptions, Found, ReadOutcome};

fn connected(h: Found) -> nixl_keepalive_cli::pd::decode::Connected {
    match h {
        Found::New(c) => c,
        Found::Unchanged => panic!("expected a new engine"),
    }
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_sigkilled_idle_prefill_is_detected_by_heartbeat_and_released() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let mut p = PrefillProc::start(&PrefillSpec {
            ranks: Some(2),
            ..Default::default()
        });
        let interval = Duration::from_millis(500);
        let mut d = DecodeSide::start(rt, config(interval), DecodeOptions::default());
        let c = connected(d.decoder.connect(&p.addr, None).await.expect("handshake"));
        assert_eq!(d.decoder.read(&c, 1, 3).await, ReadOutcome::Verified);
        let engine = EngineId::from(p.engine.as_str());
        // One heartbeat gap: the first heartbeat goes out within one
        // interval of the registration, the next within interval + jitter.
        let gap = interval + interval / 10;
        let handle = d.decoder.handle().clone();
        let deadline = Instant::now() + gap * 2 + MARGIN;
        let hb = loop {
            let snapshot = handle.snapshot().await.unwrap();
            let hb = snapshot
                .engine(&engine)
                .and_then(|e| e.last_heartbeat.clone());
            match hb {
                Some(hb) => break hb,
                None => assert!(
                    Instant::now() < deadline,
                    "no heartbeat went out within two heartbeat gaps: {snapshot:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(hb.status, NixlStatus::SUCCESS);

        let killed = p.kill();
        // A killed peer's endpoint is failed at once: the next heartbeat,
        // at most one gap away, says REMOTE_DISCONNECT.
        let (status, detected) = d
            .wait_for(gap + MARGIN, |e| match e {
                Event::Unreachable {
                    engine: id,
                    status,
                    source,
                    ..
                } if *id == engine => {
                    assert_eq!(
                        *source,
                        nixl_keepalive::Source::Heartbeat,
                        "no reads ran: the heartbeat must detect it"
                    );
                    Some(*status)
                }
                _ => None,
            })
            .await;
        assert_eq!(status.raw(), -10, "raw NIXL_ERR_REMOTE_DISCONNECT");
        // No read in flight: released as soon as it is marked.
        let ((reason, failed), released) = d
            .wait_for(MARGIN, |e| match e {
                Event::Released {
                    engine: id,
                    reason,
                    failed_steps,
                    ..
                } if *id == engine => Some((*reason, *failed_steps)),
                _ => None,
            })
            .await;
        assert_eq!(reason, ReleaseReason::Unreachable);
        assert_eq!(failed, 0, "every release step SUCCESS or NOT_FOUND");
        assert_eq!(c.engine.state(), EngineState::Released);
        assert!(c.remote.dlists.is_released(), "dlist handles released");
        // NIXL itself confirms the metadata is gone.
        let agent = d.transport.agent();
        for name in &c.remote.agents {
            let e = agent.gen_notif(name.as_str(), b"HB:").unwrap_err();
            assert_eq!(
                e.status,
                NixlStatus::ERR_NOT_FOUND,
                "genNotif after release: {e}"
            );
            let e = agent.invalidate_remote_metadata(name.as_str()).unwrap_err();
            assert_eq!(
                e.status,
                NixlStatus::ERR_NOT_FOUND,
                "second invalidate: {e}"
            );
        }
        report(&format!(
        "SIGKILL idle P, heartbeat {interval:?}: kill->detect {} (REMOTE_DISCONNECT via heartbeat), detect->release {}, kill->release {}",
        ms(detected - killed),
        ms(released - detected),
        ms(released - killed)
    ));
        d.stop().await;
    })
}

/// Issue 45: with heartbeats off, only the endpoint event can find a
/// killed idle prefill: UCX fails its endpoints when their TCP lanes read
/// the dead process's FIN, the service sends that engine a heartbeat, and
/// its REMOTE_DISCONNECT releases it. A live prefill beside it is never
/// touched.
#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_sigkilled_idle_prefill_is_released_by_its_endpoint_event_with_heartbeats_off() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let spec = PrefillSpec {
            ranks: Some(2),
            ..Default::default()
        };
        let mut victim = PrefillProc::start(&spec);
        let healthy = PrefillProc::start(&spec);
        let cfg = config(Duration::from_secs(1))
            .to_builder()
            .heartbeat_interval(None)
            .build()
            .unwrap();
        let mut d = DecodeSide::start(rt, cfg, DecodeOptions::default());
        let c = connected(
            d.decoder
                .connect(&victim.addr, None)
                .await
                .expect("handshake"),
        );
        let h = connected(
            d.decoder
                .connect(&healthy.addr, None)
                .await
                .expect("handshake"),
        );
        assert_eq!(d.decoder.read(&c, 1, 3).await, ReadOutcome::Verified);
        assert_eq!(d.decoder.read(&h, 1, 3).await, ReadOutcome::Verified);
        assert_eq!(
            nixl_agent::failures::mode(),
            nixl_agent::failures::EndpointWatchMode::Watching
        );
        let before = nixl_agent::failures::counts();
        assert!(
            before.watched >= 4,
            "the loads' endpoints are watched: {before:?}"
        );
        let engine = EngineId::from(victim.engine.as_str());

        let killed = victim.kill();
        let (status, detected) = d
            .wait_for(Duration::from_secs(20), |e| match e {
                Event::Unreachable {
                    engine: id, status, ..
                } if *id == engine => Some(*status),
                _ => None,
            })
            .await;
        assert_eq!(status, NixlStatus::ERR_REMOTE_DISCONNECT);
        let (_, released) = d
            .wait_for(MARGIN, |e| match e {
                Event::Released { engine: id, .. } if *id == engine => Some(()),
                _ => None,
            })
            .await;
        let after = nixl_agent::failures::counts();
        assert!(
            after.failures > before.failures,
            "UCX ran the wrapped error handler: {before:?} -> {after:?}"
        );
        // The healthy one: still live, still served, a while later.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(h.engine.state(), EngineState::Live);
        assert_eq!(d.decoder.read(&h, 1, 3).await, ReadOutcome::Verified);
        let seen = d.drain();
        assert!(
            !seen.iter().any(|e| matches!(e, Event::Released { .. })),
            "nothing else released: {seen:?}"
        );
        report(&format!(
            "SIGKILL idle P, heartbeats off, endpoint events on: kill->detect {}, kill->release {}; handler runs {} -> {}",
            ms(detected - killed),
            ms(released - killed),
            before.failures,
            after.failures
        ));
        drop(healthy);
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_sigkilled_prefill_with_reads_in_flight_fails_them_promptly_and_is_released_after_the_last_guard(
) {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        // Big blocks, several reads at once, no pause: reads are on the wire
        // when the kill lands.
        let mut p = PrefillProc::start(&PrefillSpec {
            blocks: Some(8),
            block_size: Some(4 << 20),
            ..Default::default()
        });
        let options = DecodeOptions {
            reads_in_flight: 4,
            read_pause: Duration::ZERO,
            read_timeout: Duration::from_secs(5),
            ..DecodeOptions::default()
        };
        let mut d = DecodeSide::start(rt, config(Duration::from_secs(1)), options);
        let c = connected(d.decoder.connect(&p.addr, None).await.expect("handshake"));
        let engine = EngineId::from(p.engine.as_str());
        // A read of our own that stays in flight across the kill.
        let held = c.engine.begin_read().expect("live");
        // Reader traffic on the same engine.
        let stop_reads = tokio_util::sync::CancellationToken::new();
        let reads = {
            let decoder = d.decoder.clone();
            let c = c.clone();
            let stop = stop_reads.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                while !stop.is_cancelled() {
                    let mut set = tokio::task::JoinSet::new();
                    for i in 0..4u32 {
                        let decoder = decoder.clone();
                        let c = c.clone();
                        set.spawn(async move {
                            let t = Instant::now();
                            let o = decoder.read(&c, 0, i * 2).await;
                            (o, t.elapsed(), t)
                        });
                    }
                    while let Some(r) = set.join_next().await {
                        outcomes.push(r.unwrap());
                    }
                }
                outcomes
            })
        };
        // Kill once reads verifiably work, with more on the wire.
        let decoder = d.decoder.clone();
        let verified = || verified_reads(&decoder);
        until_async("4 reads verified", MARGIN, || {
            check(verified() >= 4, verified())
        })
        .await;
        let killed = p.kill();
        // The reads on the wire, or the next heartbeat (1 s), find it.
        let (source, detected) = d
            .wait_for(Duration::from_secs(1) + MARGIN, |e| match e {
                Event::Unreachable {
                    engine: id, source, ..
                } if *id == engine => Some(*source),
                _ => None,
            })
            .await;
        // Reads in flight end promptly (the service fails them; a read
        // times out after 5 s at worst): only our held guard remains.
        until_async(
            "the reads in flight ended, ours aside (else a hang)",
            Duration::from_secs(5) + MARGIN,
            || check(c.engine.reads_in_flight() <= 1, c.engine.reads_in_flight()),
        )
        .await;
        let reads_ended = Instant::now();
        stop_reads.cancel();
        let outcomes = reads.await.unwrap();
        assert!(held.is_failed(), "the service failed the reads in flight");
        // Not released while our guard lives.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(c.engine.state(), EngineState::Unreachable);
        assert!(
            !c.remote.dlists.is_released(),
            "released under a read in flight"
        );
        let dropped = Instant::now();
        drop(held);
        let (waited, released) = d
            .wait_for(MARGIN, |e| match e {
                Event::Released {
                    engine: id,
                    waited_for,
                    ..
                } if *id == engine => Some(*waited_for),
                _ => None,
            })
            .await;
        assert!(waited.reads_in_flight_at_mark >= 1);
        assert!(c.remote.dlists.is_released());
        let verified = outcomes
            .iter()
            .filter(|(o, _, _)| *o == ReadOutcome::Verified)
            .count();
        // A SIGKILLed process's memory stays readable until the kernel has
        // torn it down: count the reads that still verified.
        let verified_after_kill = outcomes
            .iter()
            .filter(|(o, _, start)| *o == ReadOutcome::Verified && *start >= killed)
            .count();
        let after_kill: Vec<_> = outcomes
            .iter()
            .filter(|(o, _, _)| *o != ReadOutcome::Verified)
            .collect();
        let slowest = after_kill
            .iter()
            .map(|(_, t, _)| *t)
            .max()
            .unwrap_or_default();
        let mut kinds: Vec<String> = after_kill
            .iter()
            .map(|(o, _, _)| format!("{o:?}"))
            .collect();
        kinds.sort();
        kinds.dedup();
        assert!(verified > 0, "reads worked before the kill");
        assert!(slowest < Duration::from_secs(6), "a read took {slowest:?}");
        report(&format!(
        "SIGKILL P under reads: detected via {source} after {}; reader's reads all ended {} after the kill (slowest failed read {}; outcomes {kinds:?}; {verified} verified, {verified_after_kill} of them posted after the kill signal); reads in flight at mark {}; last guard drop->release {}; detect->release {} (held on purpose)",
        ms(detected - killed),
        ms(reads_ended - killed),
        ms(slowest),
        waited.reads_in_flight_at_mark,
        ms(released - dropped),
        ms(released - detected),
    ));
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_prefill_restarted_with_a_new_id_on_the_same_port_replaces_the_old_engine() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let mut p1 = PrefillProc::start(&PrefillSpec::default());
        // Heartbeats slow enough that the handshake, not the heartbeat, finds
        // the change.
        let mut d = DecodeSide::start(
            rt,
            common::handshake_only_config(),
            DecodeOptions::default(),
        );
        let c1 = connected(d.decoder.connect(&p1.addr, None).await.expect("handshake"));
        assert_eq!(d.decoder.read(&c1, 0, 1).await, ReadOutcome::Verified);
        let old = EngineId::from(p1.engine.as_str());
        p1.kill();
        let p2 = PrefillProc::start(&PrefillSpec {
            listen: Some(p1.listen()),
            ..Default::default()
        });
        assert_ne!(p1.engine, p2.engine);
        let new = EngineId::from(p2.engine.as_str());
        let started = Instant::now();
        let c2 = connected(
            d.decoder
                .connect(&p2.addr, Some(&c1))
                .await
                .expect("handshake with the new engine"),
        );
        let handshaken = Instant::now();
        // Published at the registration, before `connect` returned; the old
        // engine has no read in flight: released at once.
        let ((), replaced) = d
            .wait_for(MARGIN, |e| match e {
                Event::Replaced { old: o, new: n, .. } if *o == old && *n == new => Some(()),
                _ => None,
            })
            .await;
        let (reason, released) = d
            .wait_for(MARGIN, |e| match e {
                Event::Released { engine, reason, .. } if *engine == old => Some(*reason),
                _ => None,
            })
            .await;
        assert_eq!(reason, ReleaseReason::Replaced);
        assert!(c1.remote.dlists.is_released());
        let e = d
            .transport
            .agent()
            .gen_notif(c1.remote.agents[0].as_str(), b"HB:")
            .unwrap_err();
        assert_eq!(
            e.status,
            NixlStatus::ERR_NOT_FOUND,
            "old metadata invalidated"
        );
        for block in 0..8 {
            assert_eq!(
                d.decoder.read(&c2, 0, block).await,
                ReadOutcome::Verified,
                "block {block} from the new engine"
            );
        }
        report(&format!(
        "P restarted with a new id: handshake {}, handshake->replaced {}, replaced(detection)->release {}",
        ms(handshaken - started),
        ms(replaced.saturating_duration_since(handshaken)),
        ms(released.saturating_duration_since(replaced))
    ));
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_prefill_restarted_with_the_same_id_is_invalidated_before_it_is_loaded_again() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let id = common::unique("pinned");
        let spec = PrefillSpec {
            engine_id: Some(id.clone()),
            ranks: Some(2),
            ..Default::default()
        };
        let mut p1 = PrefillProc::start(&spec);
        let mut d = DecodeSide::start(
            rt,
            common::handshake_only_config(),
            DecodeOptions::default(),
        );
        let c1 = connected(d.decoder.connect(&p1.addr, None).await.expect("handshake"));
        assert_eq!(d.decoder.read(&c1, 1, 2).await, ReadOutcome::Verified);
        p1.kill();
        let p2 = PrefillProc::start(&PrefillSpec {
            listen: Some(p1.listen()),
            ..spec.clone()
        });
        assert_eq!(p2.engine, id);
        // The first registration's events are taken: what follows is the
        // restart's.
        d.drain();
        let from = d.seen.len();
        let started = Instant::now();
        let c2 = connected(
            d.decoder
                .connect(&p2.addr, Some(&c1))
                .await
                .expect("handshake with the restarted engine"),
        );
        let done = Instant::now();
        assert_ne!(c1.remote.incarnation, c2.remote.incarnation);
        let engine = EngineId::from(id.as_str());
        // The library publishes `Registered` before `register` answers (so
        // it is there when `connect` returns); waited for all the same,
        // with every event on the way kept in order.
        d.wait_for(MARGIN, |e| {
            matches!(e, Event::Registered { engine: e_id, .. } if *e_id == engine).then_some(())
        })
        .await;
        let events = &d.seen[from..];
        let registered_at = events.len() - 1;
        let released_at = events
            .iter()
            .position(|e| matches!(e, Event::Released { engine: e_id, reason: ReleaseReason::Reregistered, .. } if *e_id == engine))
            .unwrap_or_else(|| panic!("old registration not released before the new one registered: {events:?}"));
        assert!(
            released_at < registered_at,
            "old released before the new registered: {events:?}"
        );
        assert!(c1.remote.dlists.is_released());
        assert_eq!(c2.engine.state(), EngineState::Live);
        for block in 0..8 {
            for rank in 0..2 {
                assert_eq!(
                    d.decoder.read(&c2, rank, block).await,
                    ReadOutcome::Verified
                );
            }
        }
        report(&format!(
        "P restarted with the same id: prepare_reload + invalidate + load + register took {} (old released before the new was loaded)",
        ms(done - started)
    ));
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn the_reader_loop_re_handshakes_after_a_release_when_a_prefill_listens_again() {
    let rt = real_runtime();
    let _serial = serial();
    common::block_on(async move {
        let mut p1 = PrefillProc::start(&PrefillSpec::default());
        let options = DecodeOptions {
            read_pause: Duration::from_millis(5),
            probe_interval: Duration::from_millis(500),
            ..DecodeOptions::default()
        };
        let mut d = DecodeSide::start(rt, config(Duration::from_millis(500)), options);
        let stop_reader = d.shutdown.child_token();
        let reader = d.decoder.spawn(p1.addr.clone(), stop_reader.clone());
        let first = EngineId::from(p1.engine.as_str());
        d.wait_for(MARGIN, |e| {
            matches!(e, Event::Registered { engine, .. } if *engine == first).then_some(())
        })
        .await;
        let killed = p1.kill();
        // Found by the reads in flight or the next heartbeat (one gap).
        let (_, released) = d
            .wait_for(Duration::from_millis(550) + MARGIN, |e| {
                matches!(e, Event::Released { engine, .. } if *engine == first).then_some(())
            })
            .await;
        let p2 = PrefillProc::start(&PrefillSpec {
            listen: Some(p1.listen()),
            ..Default::default()
        });
        let listening = Instant::now();
        let second = EngineId::from(p2.engine.as_str());
        // The reader tries again within one retry pause (at most 4 s) and
        // one handshake.
        let options = DecodeOptions::default();
        let (_, registered) = d
            .wait_for(
                options.retry_max + options.handshake_timeout + MARGIN,
                |e| {
                    matches!(e, Event::Registered { engine, .. } if *engine == second).then_some(())
                },
            )
            .await;
        let decoder = d.decoder.clone();
        let verified = || verified_reads(&decoder);
        let at_registration = verified();
        until_async("reads from the new engine", MARGIN, || {
            check(verified() > at_registration, verified())
        })
        .await;
        assert_eq!(
            d.decoder
                .stats()
                .corrupt
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        report(&format!(
            "reader loop: kill->release {}, new P listening->registered {}",
            ms(released - killed),
            ms(registered - listening)
        ));
        stop_reader.cancel();
        reader.await.unwrap();
        d.stop().await;
    })
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn a_prefill_refuses_bad_side_channel_input_and_keeps_answering() {
    let _rt = real_runtime();
    let _serial = serial();
    let p = PrefillProc::start(&PrefillSpec {
        env: vec![(
            "RUST_LOG".into(),
            "info,nixl_keepalive_cli::pd::prefill=debug".into(),
        )],
        ..Default::default()
    });
    common::block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let garbage: [&[u8]; 4] = [
            b"GET / HTTP/1.1\r\n\r\n",                      // huge length prefix
            &[0, 0, 0, 6, b'N', b'K', b'P', b'D', 9, 1],    // bad version
            &[0, 0, 0, 3, 1, 2],                            // truncated, then EOF
            &[0, 0, 0, 7, b'N', b'K', b'P', b'D', 1, 1, 0], // trailing byte
        ];
        for bytes in garbage {
            let mut s = tokio::net::TcpStream::connect(p.addr.as_str())
                .await
                .unwrap();
            s.write_all(bytes).await.unwrap();
            let _ = s.shutdown().await;
            let mut rest = Vec::new();
            let n = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
                .await
                .expect("the prefill closes a bad connection")
                .unwrap_or(0);
            assert_eq!(n, 0, "no reply to a bad request");
        }
        let reply = nixl_keepalive_cli::pd::decode::fetch(&p.addr, Duration::from_secs(5))
            .await
            .expect("still answers a good handshake");
        assert_eq!(reply.engine, p.engine);
    });
    let log = std::fs::read_to_string(&p.log).unwrap();
    // The truncated frame ends in EOF: a connection closed early, counted
    // as a drop, not as a bad frame (see "What is counted" in pd).
    assert_eq!(
        log.matches("bad side-channel frame refused").count(),
        3,
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("closed unanswered") && l.contains("reason=\"eof\"")),
        "{log}"
    );
}

/// Reads the decoder verified so far.
fn verified_reads(decoder: &nixl_keepalive_cli::pd::decode::Decoder) -> u64 {
    decoder
        .stats()
        .verified
        .load(std::sync::atomic::Ordering::Relaxed)
}
