//! Leases that follow the reads, on real processes: a `nixl-keepalive
//! prefill` with 2 s leases (vLLM's rules, `--lease-secs 2`) and the decode
//! side in the test process reading for three leases. No block may be read
//! after its lease expired at the prefill; the leases of completed
//! requests are removed, not renewed forever.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{config, report, serial, DecodeSide, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::{EngineId, Event};
use nixl_keepalive_cli::pd::decode::DecodeOptions;
use nixl_keepalive_cli::pd::prefill::agent_name;

/// Renewals extend to 2/3 of it (2 s): four heartbeat intervals.
const LEASE: Duration = Duration::from_secs(3);

/// The `key=value` of the prefill's last "lease summary" log line.
fn summary(log: &str, key: &str) -> u64 {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("lease summary"))
        .unwrap_or_else(|| panic!("no lease summary in the prefill log:\n{log}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key} in {line}: {e}"))
}

/// Whether the prefill logged the expiry of `request`.
fn expired(log: &str, request: &str) -> bool {
    log.lines()
        .any(|l| l.contains("lease expired") && l.contains(&format!("request={request}")))
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn over_three_leases_no_block_is_read_after_its_lease_expired_and_completed_requests_are_not_renewed(
) {
    let rt = real_runtime();
    let _serial = serial();
    // The reader loop's logs (its handshake failures), shown on failure.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("info")
        .try_init();
    common::block_on(async move {
        let mut p = PrefillProc::start(&PrefillSpec {
            ranks: Some(2),
            args: vec!["--lease-secs".into(), LEASE.as_secs().to_string()],
            ..Default::default()
        });
        let engine = EngineId::from(p.engine.as_str());
        let rank0 = agent_name(&engine, 0);
        let options = DecodeOptions {
            reads_in_flight: 2,
            ..DecodeOptions::default()
        };
        let mut d = DecodeSide::start(rt, config(Duration::from_millis(500)), options);
        let handle = d.decoder.handle().clone();
        let reading = tokio_util::sync::CancellationToken::new();
        let reader = d.decoder.spawn(p.addr.clone(), reading.clone());
        d.wait_for(Duration::from_secs(20), |e| match e {
            Event::Registered { engine: id, .. } if *id == engine => Some(()),
            _ => None,
        })
        .await;
        // Two controls, scheduled at the prefill like any request:
        // "held" stays leased at the decode (the heartbeats must keep it
        // alive past its lease); "orphan" is never leased (it must expire,
        // and a completion sent after that must be caught as a late read).
        // The controls' own notifications come from an agent of their own
        // (with NIXL's progress thread), so they never share the decode
        // agent with the service's heartbeats and the reads.
        let cfg = nixl_agent::AgentConfig {
            progress_thread: nixl_agent::ProgressThread::Polling {
                delay: Duration::from_millis(1),
            },
            ..Default::default()
        };
        let agent = nixl_agent::Agent::new(rt, &common::unique("planter"), &cfg).expect("agent");
        let reply = nixl_keepalive_cli::pd::decode::fetch(&p.addr, Duration::from_secs(5))
            .await
            .expect("handshake");
        assert_eq!(
            agent
                .load_remote_metadata(&reply.ranks[0].metadata)
                .expect("load"),
            rank0
        );
        let tag = d.transport.agent().name().to_string();
        let held = format!("{tag}-held");
        let orphan = format!("{tag}-orphan");
        for id in [&held, &orphan] {
            agent
                .gen_notif(&rank0, format!("RQ:{id}").as_bytes())
                .expect("RQ");
        }
        handle
            .add_leases(&engine, vec![held.clone()], true)
            .expect("a valid request id");

        let started = Instant::now();
        let mut max_pending = 0usize;
        let mut seen = HashSet::new();
        let mut late_sent = false;
        while started.elapsed() < LEASE * 3 {
            let snap = handle.snapshot().await.expect("service running");
            if let Some(e) = snap.engine(&engine) {
                let pending: Vec<_> = e.leases.iter().filter(|l| **l != held).collect();
                max_pending = max_pending.max(pending.len());
                seen.extend(pending.into_iter().cloned());
                assert!(e.leases.contains(&held), "the held lease went missing");
            }
            if !late_sent && expired(&p.log_text(), &orphan) {
                // A completion of a request whose lease ran out.
                agent
                    .gen_notif(&rank0, format!("RD:{orphan}").as_bytes())
                    .expect("RD");
                late_sent = true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            late_sent,
            "the orphan request's lease never expired at the prefill"
        );
        assert!(!expired(&p.log_text(), &held), "a request renewed by heartbeats expired within 3 leases; heartbeats the prefill saw:\n{}",
            p.log_text().lines().filter(|l| l.contains("heartbeat") || l.contains("expired")).collect::<Vec<_>>().join("\n"));
        reading.cancel();
        reader.await.expect("reader");
        // Reads ended: the only lease left is the held control; once it is
        // removed the heartbeats name nothing and it expires at the prefill.
        let snap = handle.snapshot().await.unwrap();
        let left = snap
            .engine(&engine)
            .map(|e| e.leases.clone())
            .unwrap_or_default();
        assert_eq!(
            left,
            vec![held.clone()],
            "leases of ended requests left behind"
        );
        handle
            .remove_leases(&engine, vec![held.clone()])
            .expect("the service is running");
        let removed = Instant::now();
        while !expired(&p.log_text(), &held) {
            assert!(
                removed.elapsed() < LEASE * 3,
                "a removed lease is still renewed {:?} after its removal",
                removed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let expired_after = removed.elapsed();
        let stats = d.decoder.stats();
        let verified = stats.verified.load(std::sync::atomic::Ordering::Relaxed);
        let corrupt = stats.corrupt.load(std::sync::atomic::Ordering::Relaxed);
        let failed = stats.failed.load(std::sync::atomic::Ordering::Relaxed);
        let abandoned = stats.abandoned.load(std::sync::atomic::Ordering::Relaxed);
        d.stop().await;
        let (status, log) = p.stop();
        assert!(status.success(), "prefill exited with {status}");
        assert_eq!(corrupt, 0);
        assert_eq!(
            (failed, abandoned),
            (0, 0),
            "reads failed on a healthy prefill"
        );
        assert!(verified > 20, "too few reads to judge: {verified}");
        assert!(
            max_pending <= 2,
            "{max_pending} leases pending with 2 reads in flight"
        );
        assert!(
            seen.len() as u64 > 10,
            "request ids are not fresh per request: {} distinct seen",
            seen.len()
        );
        let late = summary(&log, "late_reads");
        let completed = summary(&log, "completed");
        let unknown = summary(&log, "unknown_reads");
        let expiries = summary(&log, "expired");
        assert_eq!(
            late, 1,
            "reads completed after their lease expired (1 is the control):\n{log}"
        );
        assert_eq!(unknown, 0, "reads of requests never scheduled:\n{log}");
        assert_eq!(
            completed, verified,
            "every verified read completed its request in time"
        );
        assert_eq!(expiries, 2, "only the two controls may expire:\n{log}");
        report(&format!(
            "lease {LEASE:?}, heartbeat 500ms, reads for {:?}: {verified} requests read and completed in time, 0 late reads (control caught: 1), at most {max_pending} leases pending, {} distinct request ids sampled; a removed lease expired {:?} after removal",
            LEASE * 3,
            seen.len(),
            expired_after
        ));
    })
}

/// Freezes (SIGSTOP, then SIGCONT) of the prefill while `decode` reads
/// from it, shorter and longer than its lease and than `decode`'s read
/// timeout: running this long, then frozen that long.
const FREEZES: &[(Duration, Duration)] = &[
    (Duration::from_secs(2), Duration::from_millis(800)),
    (Duration::from_secs(2), Duration::from_secs(4)),
    (Duration::from_secs(2), Duration::from_secs(8)),
];

/// `decode`'s read timeout here: shorter than what a renewal leaves of a
/// lease (2/3 of 3 s, less one 550 ms heartbeat gap: 1.45 s). A read stuck
/// behind a frozen prefill is then given up, and its `RD:` dropped, before
/// its lease can run out. (`decode`'s default, 5 s, against the prefill's
/// default 30 s lease: 20 s - 5.5 s.)
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The request ids in the prefill's "read completed after its lease
/// expired" lines.
fn late_requests(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("after its lease expired"))
        .filter_map(|l| {
            let start = l.find("request=\"")? + "request=\"".len();
            let end = l[start..].find('"')?;
            Some(l[start..start + end].to_string())
        })
        .collect()
}

#[test]
#[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
fn with_the_prefill_frozen_again_and_again_no_read_given_up_or_done_after_a_freeze_completes_late()
{
    let rt = real_runtime();
    let _serial = serial();
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("info")
        .try_init();
    common::block_on(async move {
        let mut p = PrefillProc::start(&PrefillSpec {
            ranks: Some(2),
            args: vec!["--lease-secs".into(), LEASE.as_secs().to_string()],
            ..Default::default()
        });
        let engine = EngineId::from(p.engine.as_str());
        let options = DecodeOptions {
            read_timeout: READ_TIMEOUT,
            ..DecodeOptions::default()
        };
        let mut d = DecodeSide::start(rt, config(Duration::from_millis(500)), options);
        let reading = tokio_util::sync::CancellationToken::new();
        let reader = d.decoder.spawn(p.addr.clone(), reading.clone());
        d.wait_for(Duration::from_secs(20), |e| match e {
            Event::Registered { engine: id, .. } if *id == engine => Some(()),
            _ => None,
        })
        .await;
        // Per freeze: when it began (the SIGSTOP sent) and ended.
        let mut freezes = Vec::new();
        let mut running_since = Instant::now();
        for (run, freeze) in FREEZES {
            tokio::time::sleep(*run).await;
            p.signal("STOP");
            let stopped = Instant::now();
            tokio::time::sleep(*freeze).await;
            p.signal("CONT");
            freezes.push((running_since, stopped));
            running_since = Instant::now();
        }
        // Read again after the last freeze (the reader registers it anew).
        tokio::time::sleep(Duration::from_secs(3)).await;
        reading.cancel();
        reader.await.expect("reader");
        let events = d.drain();
        let stalled = events
            .iter()
            .filter(|e| matches!(e, Event::Stalled { .. }))
            .count();
        let stats = d.decoder.stats();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let (verified, abandoned, corrupt, retired) = (
            load(&stats.verified),
            load(&stats.abandoned),
            load(&stats.corrupt),
            load(&stats.slots_retired),
        );
        let given_up = stats.given_up_requests.lock().unwrap().clone();
        let completions = stats.completions.lock().unwrap().clone();
        d.stop().await;
        let (status, log) = p.stop();
        assert!(status.success(), "prefill exited with {status}");
        assert_eq!(corrupt, 0);
        let late = summary(&log, "late_reads");
        let late_ids = late_requests(&log);
        assert_eq!(late_ids.len() as u64, late, "{log}");
        // No read `decode` gave up completes at the prefill: its `RD:` was
        // dropped with the request (NIXL sends a READ's notification only
        // once its data moved and the request was not released).
        let of_given_up: Vec<&String> =
            late_ids.iter().filter(|id| given_up.contains(id)).collect();
        assert!(
            of_given_up.is_empty(),
            "given-up reads completed at the prefill after their lease: {of_given_up:?}"
        );
        // And no other read either: an `RD:` handed to the prefill before it
        // froze is handled, after it resumes, before its expired requests
        // are swept (as vLLM's prefill does), so it is in time.
        assert!(
            late_ids.is_empty(),
            "late completions at the prefill: {late_ids:?} (decode saw these done at {:?}; freezes {freezes:?})",
            late_ids
                .iter()
                .map(|id| completions.iter().find(|(r, _)| r == id).map(|(_, at)| *at))
                .collect::<Vec<_>>()
        );
        let delivered_before_freeze = 0;
        report(&format!(
            "lease {LEASE:?}, read timeout {READ_TIMEOUT:?}, freezes {FREEZES:?}: {verified} reads verified, {abandoned} given up, {stalled} stall(s), {retired} landing slot(s) retired; late completions at the prefill: {late} ({} of given-up reads; {delivered_before_freeze} handed to it before it froze)",
            of_given_up.len()
        ));
    })
}
