//! The fake UCX behaves as NIXL over UCX does, on tokio's paused clock.
#![cfg(feature = "fake")]

use std::time::Duration;

use nixl_keepalive::fake::{
    nixl_status_from_ucs, FakeConfig, FakeError, FakeHandshake, FakeOp, FakeUcx, Held,
};
use nixl_keepalive::{
    AgentName, EndpointClose, EngineId, NixlStatus, ReleaseTarget, Transport, UcsStatus,
};
use tokio::time::{advance, Instant};

mod common;

use common::addr;

const S: Duration = Duration::from_secs(1);

/// A world with one two-rank prefill at `addr(1)`, handshaken.
fn one_peer(config: FakeConfig) -> (FakeUcx, FakeHandshake) {
    let ucx = FakeUcx::new(config);
    ucx.spawn_prefill(addr(1), 2);
    let hs = ucx.handshake(&addr(1)).expect("handshake with a live peer");
    (ucx, hs)
}

fn notify_status(ucx: &FakeUcx, agent: &AgentName) -> NixlStatus {
    match ucx.notify(agent, b"HB:") {
        Ok(()) => NixlStatus::SUCCESS,
        Err(e) => {
            assert_eq!(e.operation, "genNotif");
            e.status
        }
    }
}

fn last_ucs(ucx: &FakeUcx) -> Option<UcsStatus> {
    ucx.calls().last().expect("a recorded call").ucs
}

/// The statuses of a release's NIXL calls (its endpoint reports left out).
fn release(ucx: &FakeUcx, hs: FakeHandshake) -> Vec<NixlStatus> {
    ucx.release(&hs.engine, &hs.agents, hs.resources)
        .into_iter()
        .filter(|s| !matches!(s.target, ReleaseTarget::Endpoints { .. }))
        .map(|s| s.status)
        .collect()
}

#[test]
fn ucx_statuses_map_as_nixls_ucx_backend_maps_them() {
    use NixlStatus as N;
    use UcsStatus as U;
    for (ucs, nixl) in [
        (U::OK, N::SUCCESS),
        (U::INPROGRESS, N::IN_PROG),
        (U::ERR_BUSY, N::IN_PROG),
        (U::ERR_NOT_CONNECTED, N::ERR_REMOTE_DISCONNECT),
        (U::ERR_CONNECTION_RESET, N::ERR_REMOTE_DISCONNECT),
        (U::ERR_ENDPOINT_TIMEOUT, N::ERR_REMOTE_DISCONNECT),
        (U::ERR_CANCELED, N::ERR_REMOTE_DISCONNECT),
        (U::ERR_NO_RESOURCE, N::ERR_BACKEND),
        (U::ERR_IO_ERROR, N::ERR_BACKEND),
        (U::ERR_TIMED_OUT, N::ERR_BACKEND),
        (U::ERR_UNREACHABLE, N::ERR_BACKEND),
        (U::from_raw(-70), N::ERR_BACKEND),
    ] {
        assert_eq!(nixl_status_from_ucs(ucs), nixl, "{ucs}");
    }
    let disconnects: Vec<_> = U::ALL
        .iter()
        .copied()
        .filter(|s| nixl_status_from_ucs(*s).is_remote_disconnect())
        .collect();
    assert_eq!(
        disconnects,
        [
            U::ERR_CANCELED,
            U::ERR_NOT_CONNECTED,
            U::ERR_CONNECTION_RESET,
            U::ERR_ENDPOINT_TIMEOUT
        ]
    );
    for s in U::ALL.iter().filter(|s| s.raw() < 0 && **s != U::ERR_BUSY) {
        assert!(
            !nixl_status_from_ucs(*s).is_ok(),
            "{s} is an error for NIXL"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn engines_get_reproducible_ids_and_one_agent_per_rank() {
    let ucx = FakeUcx::default();
    let a = ucx.spawn_prefill(addr(1), 2);
    let b = ucx.spawn_prefill(addr(2), 1);
    assert_eq!(a.as_str(), "prefill-0");
    assert_eq!(b.as_str(), "prefill-1");
    assert_eq!(
        ucx.agents_of(&a),
        [
            AgentName::from("prefill-0-rank0"),
            AgentName::from("prefill-0-rank1")
        ]
    );
    let pinned = ucx.spawn_prefill_with_id(addr(3), EngineId::from("p-pinned"), 1);
    assert_eq!(ucx.agents_of(&pinned), [AgentName::from("p-pinned-rank0")]);
    assert_eq!(ucx.engine_at(&addr(2)), Some(b));
    assert_eq!(ucx.engine_at(&addr(9)), None);
}

#[tokio::test(start_paused = true)]
async fn a_handshake_loads_every_agent_and_preps_one_handle_per_rank() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    assert_eq!(hs.engine.as_str(), "prefill-0");
    assert_eq!(hs.addr, addr(1));
    assert_eq!(hs.agents, ucx.agents_of(&hs.engine));
    assert_eq!(hs.resources.len(), 2);
    let held = Held {
        remote_metadata: 2,
        dlist_handles: 2,
    };
    assert_eq!(ucx.held(), held);
    assert_eq!(ucx.held_by(&hs.engine), held);
    let ops: Vec<_> = ucx.calls().iter().map(|c| (c.op, c.status)).collect();
    assert_eq!(
        ops,
        [
            (FakeOp::LoadRemoteMd, NixlStatus::SUCCESS),
            (FakeOp::LoadRemoteMd, NixlStatus::SUCCESS),
            (FakeOp::PrepXferDlist, NixlStatus::SUCCESS),
            (FakeOp::PrepXferDlist, NixlStatus::SUCCESS),
        ]
    );
    assert_eq!(release(&ucx, hs), [NixlStatus::SUCCESS; 4]);
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_live_peer_takes_notifies_and_reads_and_they_are_recorded() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    advance(3 * S).await;
    for agent in &hs.agents {
        ucx.notify(agent, b"HB:req-1,req-2").unwrap();
    }
    assert_eq!(ucx.read(&hs.engine), NixlStatus::SUCCESS);
    assert_eq!(
        ucx.notifications_to(&hs.engine),
        ["HB:req-1,req-2", "HB:req-1,req-2"]
    );
    let notify = ucx
        .calls()
        .into_iter()
        .find(|c| c.op == FakeOp::Notify)
        .unwrap();
    assert_eq!(notify.agent.as_ref(), Some(&hs.agents[0]));
    assert_eq!(notify.engine.as_ref(), Some(&hs.engine));
    assert_eq!(notify.ucs, Some(UcsStatus::OK));
    assert_eq!(notify.message_str(), "HB:req-1,req-2");
    assert!(notify.at.duration_since(ucx.calls()[0].at) == 3 * S);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_crash_resets_each_endpoint_at_its_next_operation_and_it_stays_failed() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.crash(&hs.engine);
    assert_eq!(ucx.endpoint_failure(&hs.agents[0]), None, "not noticed yet");
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_CONNECTION_RESET));
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(
        last_ucs(&ucx),
        None,
        "NIXL answers from the failed endpoint"
    );
    assert_eq!(
        ucx.endpoint_failure(&hs.agents[0]),
        Some(UcsStatus::ERR_CONNECTION_RESET)
    );
    assert_eq!(
        ucx.read_agent(&hs.agents[1]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_CONNECTION_RESET));
    assert_eq!(ucx.engine_at(&addr(1)), None);
    assert_eq!(
        ucx.handshake(&addr(1)).unwrap_err(),
        FakeError::NoListener(addr(1))
    );
    assert_eq!(
        ucx.held_by(&hs.engine),
        Held {
            remote_metadata: 2,
            dlist_handles: 2
        }
    );
    assert_eq!(release(&ucx, hs), [NixlStatus::SUCCESS; 4]);
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_read_on_the_wire_when_the_peer_dies_ends_with_backend() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.crash_during_read(&hs.engine);
    assert_eq!(ucx.read_agent(&hs.agents[0]), NixlStatus::ERR_BACKEND);
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_IO_ERROR));
    assert_eq!(
        ucx.read_agent(&hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(
        notify_status(&ucx, &hs.agents[1]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_CONNECTION_RESET));
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_frozen_peer_is_detected_after_the_keepalive_interval_when_opted_in() {
    let (ucx, hs) = one_peer({
        let mut config = FakeConfig::default();
        config.frozen_peers_detected = true;
        config
    });
    ucx.freeze(&hs.engine);
    advance(19 * S).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(ucx.read(&hs.engine), NixlStatus::IN_PROG);
    assert!(matches!(
        ucx.handshake(&addr(1)),
        Err(FakeError::Unresponsive { .. })
    ));
    advance(S).await;
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_ENDPOINT_TIMEOUT));
    assert_eq!(
        ucx.endpoint_failure(&hs.agents[1]),
        Some(UcsStatus::ERR_ENDPOINT_TIMEOUT)
    );
    ucx.thaw(&hs.engine);
    assert_eq!(
        notify_status(&ucx, &hs.agents[1]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_frozen_peer_is_never_detected_with_keepalive_inf() {
    let (ucx, hs) = one_peer(FakeConfig::with_keepalive(None));
    ucx.freeze(&hs.engine);
    advance(Duration::from_secs(24 * 3600)).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(ucx.read(&hs.engine), NixlStatus::IN_PROG);
    assert_eq!(ucx.endpoint_failure(&hs.agents[0]), None);
    ucx.thaw(&hs.engine);
    assert_eq!(ucx.read(&hs.engine), NixlStatus::SUCCESS);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_frozen_peer_is_never_detected_when_configured_as_measured_on_shm_and_tcp() {
    let config = {
        let mut config = FakeConfig::default();
        config.keepalive_interval = Some(2 * S);
        config.frozen_peers_detected = false;
        config
    };
    let (ucx, hs) = one_peer(config);
    ucx.freeze(&hs.engine);
    advance(60 * S).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_thaw_before_detection_leaves_nothing_noticed() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.freeze(&hs.engine);
    advance(19 * S).await;
    ucx.thaw(&hs.engine);
    advance(60 * S).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(ucx.read(&hs.engine), NixlStatus::SUCCESS);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_partition_is_detected_after_the_keepalive_interval_and_stays_detected_after_heal() {
    let (ucx, hs) = one_peer(FakeConfig::with_keepalive(Some(2 * S)));
    ucx.partition(&hs.engine);
    advance(S).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(ucx.read_agent(&hs.agents[0]), NixlStatus::IN_PROG);
    advance(S).await;
    // No operation ran at the deadline: the heal still finds it detected.
    ucx.heal(&hs.engine);
    advance(S).await;
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(
        ucx.endpoint_failure(&hs.agents[1]),
        Some(UcsStatus::ERR_ENDPOINT_TIMEOUT)
    );
    // The peer itself is fine: a new handshake would work after a release.
    release(&ucx, hs);
    let again = ucx.handshake(&addr(1)).unwrap();
    assert_eq!(ucx.read(&again.engine), NixlStatus::SUCCESS);
    release(&ucx, again);
}

#[tokio::test(start_paused = true)]
async fn a_heal_before_detection_leaves_nothing_noticed() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.partition(&hs.engine);
    advance(19 * S).await;
    ucx.heal(&hs.engine);
    advance(60 * S).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_partition_is_never_detected_with_keepalive_inf() {
    let (ucx, hs) = one_peer(FakeConfig::with_keepalive(None));
    ucx.partition(&hs.engine);
    advance(Duration::from_secs(24 * 3600)).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(ucx.read(&hs.engine), NixlStatus::IN_PROG);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_flap_shorter_than_the_keepalive_interval_is_never_detected() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.flap(&hs.engine, 10 * S);
    let mut reads = Vec::new();
    for _ in 0..8 {
        reads.push(ucx.read_agent(&hs.agents[0]));
        advance(10 * S).await;
    }
    use NixlStatus as N;
    assert_eq!(
        reads,
        [
            N::IN_PROG,
            N::SUCCESS,
            N::IN_PROG,
            N::SUCCESS,
            N::IN_PROG,
            N::SUCCESS,
            N::IN_PROG,
            N::SUCCESS
        ]
    );
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_flap_as_long_as_the_keepalive_interval_is_detected_in_its_first_silent_window() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.flap(&hs.engine, 30 * S);
    advance(19 * S).await;
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    advance(S).await;
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    advance(15 * S).await; // a reachable window: still failed
    ucx.heal(&hs.engine);
    assert_eq!(
        notify_status(&ucx, &hs.agents[1]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_loaded_in_a_reachable_window_is_detected_in_the_next_silent_one() {
    let ucx = FakeUcx::default();
    let engine = ucx.spawn_prefill(addr(1), 1);
    ucx.flap(&engine, 30 * S);
    advance(40 * S).await; // reachable window [30 s, 60 s)
    let hs = ucx.handshake(&addr(1)).unwrap();
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    advance(39 * S).await; // 79 s: silent since 60 s
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    advance(S).await; // 80 s
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_restart_with_a_new_id_resets_the_old_endpoints_and_serves_a_new_handshake() {
    let (ucx, old) = one_peer(FakeConfig::default());
    let new = ucx.restart(&addr(1));
    assert_ne!(new, old.engine);
    assert_eq!(ucx.engine_at(&addr(1)), Some(new.clone()));
    assert_eq!(
        notify_status(&ucx, &old.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_CONNECTION_RESET));
    let hs = ucx.handshake(&addr(1)).unwrap();
    assert_eq!(hs.engine, new);
    assert!(hs.agents.iter().all(|a| !old.agents.contains(a)));
    assert_eq!(ucx.read(&new), NixlStatus::SUCCESS);
    assert_eq!(
        ucx.held_by(&old.engine),
        Held {
            remote_metadata: 2,
            dlist_handles: 2
        }
    );
    assert_eq!(release(&ucx, old), [NixlStatus::SUCCESS; 4]);
    assert_eq!(
        ucx.read(&new),
        NixlStatus::SUCCESS,
        "the new engine is untouched"
    );
    release(&ucx, hs);
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_restart_with_the_same_id_cannot_be_loaded_before_the_old_metadata_is_invalidated() {
    let (ucx, old) = one_peer(FakeConfig::default());
    let same = ucx.restart_with_same_id(&addr(1));
    assert_eq!(same, old.engine);
    assert_eq!(ucx.agents_of(&same), old.agents);
    let err = ucx.handshake(&addr(1)).unwrap_err();
    assert_eq!(
        err,
        FakeError::Load {
            agent: old.agents[0].clone(),
            status: NixlStatus::ERR_NOT_ALLOWED
        }
    );
    assert_eq!(
        ucx.held(),
        Held {
            remote_metadata: 2,
            dlist_handles: 2
        },
        "nothing more loaded"
    );
    // The old metadata still points at the dead process.
    assert_eq!(
        notify_status(&ucx, &old.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    release(&ucx, old);
    let hs = ucx.handshake(&addr(1)).unwrap();
    assert_eq!(hs.engine, same);
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    release(&ucx, hs);
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn transient_errors_are_used_up_and_never_fail_the_endpoint() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.inject(&hs.engine, UcsStatus::ERR_NO_RESOURCE, 2);
    ucx.inject(&hs.engine, UcsStatus::ERR_BUSY, 2);
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::ERR_BACKEND);
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_NO_RESOURCE));
    assert_eq!(ucx.read_agent(&hs.agents[1]), NixlStatus::ERR_BACKEND);
    // BUSY: a notify reports SUCCESS, a read is still in progress.
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::ERR_BUSY));
    assert_eq!(ucx.read_agent(&hs.agents[0]), NixlStatus::IN_PROG);
    assert_eq!(notify_status(&ucx, &hs.agents[0]), NixlStatus::SUCCESS);
    assert_eq!(last_ucs(&ucx), Some(UcsStatus::OK));
    assert_eq!(ucx.endpoint_failure(&hs.agents[0]), None);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn an_injected_disconnect_fails_the_endpoint() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.inject(&hs.engine, UcsStatus::ERR_NOT_CONNECTED, 1);
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert_eq!(
        ucx.endpoint_failure(&hs.agents[0]),
        Some(UcsStatus::ERR_NOT_CONNECTED)
    );
    assert_eq!(
        notify_status(&ucx, &hs.agents[1]),
        NixlStatus::SUCCESS,
        "one endpoint only"
    );
    release(&ucx, hs);
}

/// The endpoint steps of a release, per agent.
fn endpoint_closes(steps: &[nixl_keepalive::ReleaseStep]) -> Vec<EndpointClose> {
    steps
        .iter()
        .filter_map(|s| match &s.target {
            ReleaseTarget::Endpoints { close, .. } => Some(*close),
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_release_closes_every_endpoint_live_or_dead_by_default() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.crash(&hs.engine);
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    let steps = ucx.release(&hs.engine, &hs.agents, hs.resources);
    assert_eq!(
        endpoint_closes(&steps),
        [EndpointClose::Closed { endpoints: 1 }; 2]
    );
    assert!(steps.iter().all(|s| s.endpoints_left_open() == 0));
}

#[tokio::test(start_paused = true)]
async fn nixls_own_close_mode_leaves_a_live_peers_endpoint_open_and_closes_a_failed_one() {
    let config = {
        let mut config = FakeConfig::default();
        config.nixl_flush_close = true;
        config
    };
    let (ucx, hs) = one_peer(config);
    // Rank 0's endpoint fails (UCX noticed), rank 1's peer is still live.
    ucx.inject(&hs.engine, UcsStatus::ERR_CONNECTION_RESET, 1);
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    let steps = ucx.release(&hs.engine, &hs.agents, hs.resources);
    assert_eq!(
        endpoint_closes(&steps),
        [
            EndpointClose::Closed { endpoints: 1 },
            EndpointClose::LeftOpen {
                closed: 0,
                left_open: 1
            }
        ]
    );
    assert_eq!(
        steps.iter().map(|s| s.endpoints_left_open()).sum::<u32>(),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_double_release_answers_not_found_and_never_panics() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    let copy = hs.resources.clone();
    let steps = ucx.release(&hs.engine, &hs.agents, hs.resources);
    assert_eq!(
        steps.iter().map(|s| s.target.clone()).collect::<Vec<_>>(),
        [
            ReleaseTarget::DlistHandle(0),
            ReleaseTarget::DlistHandle(1),
            ReleaseTarget::RemoteMetadata(hs.agents[0].clone()),
            ReleaseTarget::Endpoints {
                agent: hs.agents[0].clone(),
                close: EndpointClose::Closed { endpoints: 1 },
            },
            ReleaseTarget::RemoteMetadata(hs.agents[1].clone()),
            ReleaseTarget::Endpoints {
                agent: hs.agents[1].clone(),
                close: EndpointClose::Closed { endpoints: 1 },
            },
        ]
    );
    let again = ucx.release(&hs.engine, &hs.agents, copy);
    assert!(
        again.iter().all(|s| s.status == NixlStatus::ERR_NOT_FOUND),
        "{again:?}"
    );
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn calls_to_invalidated_metadata_answer_not_found() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    let (engine, agents) = (hs.engine.clone(), hs.agents.clone());
    release(&ucx, hs);
    assert_eq!(ucx.read(&engine), NixlStatus::ERR_NOT_FOUND);
    assert_eq!(notify_status(&ucx, &agents[0]), NixlStatus::ERR_NOT_FOUND);
    assert_eq!(
        notify_status(&ucx, &AgentName::from("nobody")),
        NixlStatus::ERR_NOT_FOUND
    );
    assert_eq!(
        ucx.read(&EngineId::from("nobody")),
        NixlStatus::ERR_NOT_FOUND
    );
    assert_eq!(ucx.notifications_to(&engine), ["HB:"]);
}

#[tokio::test(start_paused = true)]
async fn nixl_may_drop_metadata_itself_after_a_read_sees_a_disconnect() {
    let config = {
        let mut config = FakeConfig::default();
        config.drop_metadata_on_disconnect = true;
        config
    };
    let (ucx, hs) = one_peer(config);
    ucx.crash(&hs.engine);
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    assert!(
        ucx.is_loaded(&hs.agents[0]),
        "a notify never drops metadata"
    );
    assert_eq!(ucx.read(&hs.engine), NixlStatus::ERR_REMOTE_DISCONNECT);
    assert!(!ucx.is_loaded(&hs.agents[0]));
    assert_eq!(
        notify_status(&ucx, &hs.agents[0]),
        NixlStatus::ERR_NOT_FOUND
    );
    use NixlStatus as N;
    assert_eq!(
        release(&ucx, hs),
        [N::SUCCESS, N::SUCCESS, N::ERR_NOT_FOUND, N::ERR_NOT_FOUND]
    );
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn resources_dropped_without_release_count_as_leaked() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    release(&ucx, hs);
    ucx.assert_nothing_leaked();
    let again = ucx.handshake(&addr(1)).unwrap();
    let engine = again.engine.clone();
    drop(again);
    assert_eq!(
        ucx.held_by(&engine),
        Held {
            remote_metadata: 2,
            dlist_handles: 2
        }
    );
    let leak = std::panic::catch_unwind(|| ucx.assert_nothing_leaked()).unwrap_err();
    let text = leak.downcast_ref::<String>().unwrap();
    assert!(text.contains("prefill-0-rank1"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn a_gated_notify_blocks_its_thread_until_the_gate_opens() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    let gate = ucx.block_notify(&hs.engine);
    let (u, agent) = (ucx.clone(), hs.agents[0].clone());
    let call = tokio::task::spawn_blocking(move || u.notify(&agent, b"HB:req-1"));
    assert!(
        gate.wait_for_waiting(1, Duration::from_secs(10)),
        "the notify reached the gate"
    );
    advance(5 * S).await;
    assert!(!call.is_finished());
    assert!(
        ucx.notifications_to(&hs.engine).is_empty(),
        "recorded when it completes"
    );
    gate.open();
    assert!(call.await.unwrap().is_ok());
    let done = ucx
        .calls()
        .into_iter()
        .rfind(|c| c.op == FakeOp::Notify)
        .unwrap();
    assert_eq!(done.at.duration_since(ucx.calls()[0].at), 5 * S);
    assert_eq!(gate.waiting(), 0);
    assert!(
        ucx.notify(&hs.agents[1], b"HB:").is_ok(),
        "an open gate lets calls pass"
    );
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_gate_releases_blocked_callers() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    let gate = ucx.block_notify(&hs.engine);
    let calls: Vec<_> = hs
        .agents
        .iter()
        .map(|agent| {
            let (u, agent) = (ucx.clone(), agent.clone());
            tokio::task::spawn_blocking(move || u.notify(&agent, b"HB:"))
        })
        .collect();
    assert!(gate.wait_for_waiting(2, Duration::from_secs(10)));
    drop(gate);
    for call in calls {
        assert!(call.await.unwrap().is_ok());
    }
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_blocked_notify_reports_the_status_of_the_moment_it_is_let_go() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    let gate = ucx.block_notify(&hs.engine);
    let (u, agent) = (ucx.clone(), hs.agents[0].clone());
    let call = tokio::task::spawn_blocking(move || u.notify(&agent, b"HB:"));
    assert!(gate.wait_for_waiting(1, Duration::from_secs(10)));
    ucx.crash(&hs.engine);
    gate.open();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(err.status, NixlStatus::ERR_REMOTE_DISCONNECT);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn a_notify_on_a_blocking_thread_follows_the_paused_clock() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    let start = Instant::now();
    ucx.partition(&hs.engine);
    advance(20 * S).await;
    let (u, agent) = (ucx.clone(), hs.agents[0].clone());
    let err = tokio::task::spawn_blocking(move || u.notify(&agent, b"HB:"))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.status, NixlStatus::ERR_REMOTE_DISCONNECT);
    let call = ucx.calls().pop().unwrap();
    assert_eq!(call.ucs, Some(UcsStatus::ERR_ENDPOINT_TIMEOUT));
    assert_eq!(call.at.duration_since(start), 20 * S);
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn block_notify_for_sleeps_in_real_time_and_can_be_lifted() {
    let (ucx, hs) = one_peer(FakeConfig::default());
    ucx.block_notify_for(&hs.engine, Duration::from_millis(30));
    let (u, agent) = (ucx.clone(), hs.agents[0].clone());
    let took = tokio::task::spawn_blocking(move || {
        let t = std::time::Instant::now();
        u.notify(&agent, b"HB:").unwrap();
        t.elapsed()
    })
    .await
    .unwrap();
    assert!(took >= Duration::from_millis(30), "{took:?}");
    ucx.unblock_notify(&hs.engine);
    let t = std::time::Instant::now();
    ucx.notify(&hs.agents[0], b"HB:").unwrap();
    assert!(t.elapsed() < Duration::from_millis(30));
    release(&ucx, hs);
}

#[tokio::test(start_paused = true)]
async fn recording_can_be_turned_off() {
    let config = {
        let mut config = FakeConfig::default();
        config.record_calls = false;
        config
    };
    let (ucx, hs) = one_peer(config);
    ucx.notify(&hs.agents[0], b"HB:").unwrap();
    assert!(ucx.calls().is_empty());
    release(&ucx, hs);
    ucx.assert_nothing_leaked();
}
