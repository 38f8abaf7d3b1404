//! The configuration's bounds are what the service can honour: a service
//! configured at every edge starts, schedules heartbeats, beats, releases
//! and stops (on tokio's paused clock, through the fake UCX). Before the
//! bounds, `NIXL_KEEPALIVE_INTERVAL=100000000s` passed validation and then
//! panicked tokio-util's `DelayQueue` at the first registration.

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::config::{MAX_EVENT_CAPACITY, MAX_RATE_BURST, MAX_TIME_KNOB, MIN_PERIOD};
use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::{Config, EngineRef, Event, KeepaliveHandle, PeerAddr};
use tokio_util::sync::CancellationToken;

type Handle = KeepaliveHandle<FakeResources>;

/// What a decoder runtime does: handshake (guarded), load, register. The
/// one place this file calls the registration API.
async fn connect(handle: &Handle, ucx: &FakeUcx, address: &PeerAddr) -> EngineRef {
    ucx.connect(handle, address).await.expect("connects")
}

/// Runs a service with `config`, one engine that heartbeats `beats` times
/// (advancing the paused clock by `step` each time), then kills the engine
/// and waits for its release, then stops.
async fn exercise(config: Config, step: Duration, beats: usize) {
    let ucx = FakeUcx::new(FakeConfig::default());
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
    let mut events = handle.subscribe();
    let address = PeerAddr::new("10.0.0.1:5600");
    let p = ucx.spawn_prefill(address.clone(), 1);
    let engine = connect(&handle, &ucx, &address).await;
    for _ in 0..beats {
        tokio::time::sleep(step).await;
    }
    ucx.crash(&p);
    let released = tokio::time::timeout(step * 4, async {
        loop {
            match events.recv().await {
                Ok(Event::Released { engine: e, .. }) if e == *engine.id() => return,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("events closed: {e}"),
            }
        }
    })
    .await;
    assert!(released.is_ok(), "the dead engine was not released");
    shutdown.cancel();
    let stopped = task.await.expect("the service task did not panic");
    assert!(stopped.unreleased.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_service_at_the_longest_bounds_runs_and_releases() {
    let config = Config::builder()
        .heartbeat_interval(Some(MAX_TIME_KNOB))
        .jitter(MAX_TIME_KNOB - Duration::from_nanos(1))
        .rate_limit(MAX_TIME_KNOB, MAX_RATE_BURST)
        .metrics_period(Some(MAX_TIME_KNOB))
        .shutdown_drain(MAX_TIME_KNOB)
        .seed(1)
        .build()
        .expect("the edges are accepted");
    // Heartbeats up to two days apart: three of them.
    exercise(config, MAX_TIME_KNOB * 2, 3).await;
}

#[tokio::test(start_paused = true)]
async fn a_service_at_the_shortest_bounds_runs_and_releases() {
    let config = Config::builder()
        .heartbeat_interval(Some(MIN_PERIOD))
        .metrics_period(Some(MIN_PERIOD))
        .event_capacity(1)
        .seed(2)
        .build()
        .expect("the edges are accepted");
    assert_eq!(config.rate_period, MIN_PERIOD);
    exercise(config, MIN_PERIOD, 100).await;
}

#[tokio::test(start_paused = true)]
async fn a_service_with_the_largest_event_buffer_starts_and_stops() {
    let config = Config::builder()
        .event_capacity(MAX_EVENT_CAPACITY)
        .seed(3)
        .build()
        .expect("the edge is accepted");
    exercise(config, Duration::from_secs(5), 2).await;
}
