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
    assert_eq!(config.rate_period(), MIN_PERIOD);
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

mod any_value {
    //! Whatever a caller hands the builder (or the environment), `build()`
    //! returns a configuration within the bounds or an error naming the
    //! setting; and a configuration that was built runs. Before `Config`'s
    //! fields were private, any of these values could be set around the
    //! validation: `event_capacity` 0 or `u32::MAX` panicked, 2^40 aborted,
    //! `rate_burst` 0 or `u32::MAX`, `rate_period` 0 or `Duration::MAX`,
    //! `metrics_period` or `shutdown_drain` `Duration::MAX` panicked, and
    //! `metrics_period` 0 spun the driver (the `compile_fail` example on
    //! `Config` shows that this way is closed).

    use super::*;
    use nixl_keepalive::config::{KNOBS, MAX_TIME_KNOB, MIN_READ_STALL};
    use nixl_keepalive::{ConfigErrors, StallAction};
    use proptest::prelude::*;

    fn duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::from_nanos(1)),
            Just(MIN_PERIOD - Duration::from_nanos(1)),
            Just(MIN_PERIOD),
            Just(Duration::from_secs(1)),
            Just(MAX_TIME_KNOB),
            Just(MAX_TIME_KNOB + Duration::from_nanos(1)),
            Just(Duration::MAX),
            any::<u64>().prop_map(Duration::from_nanos),
            (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
            (0u64..100_000_000_000).prop_map(Duration::from_nanos),
            // Inside the period bounds, often: what builds and runs.
            (10_000_000u64..=86_400_000_000_000).prop_map(Duration::from_nanos),
            (10_000_000u64..=10_000_000_000).prop_map(Duration::from_nanos),
            (10_000_000u64..=10_000_000_000).prop_map(Duration::from_nanos),
        ]
    }

    fn maybe_duration() -> impl Strategy<Value = Option<Duration>> {
        prop_oneof![1 => Just(None), 3 => duration().prop_map(Some)]
    }

    fn burst() -> impl Strategy<Value = u32> {
        prop_oneof![
            Just(0),
            Just(1),
            Just(MAX_RATE_BURST),
            Just(MAX_RATE_BURST + 1),
            Just(u32::MAX),
            any::<u32>(),
            1..=MAX_RATE_BURST,
            1..=MAX_RATE_BURST,
        ]
    }

    fn capacity() -> impl Strategy<Value = usize> {
        prop_oneof![
            Just(0),
            Just(1),
            Just(MAX_EVENT_CAPACITY),
            Just(MAX_EVENT_CAPACITY + 1),
            Just(u32::MAX as usize),
            Just(1usize << 40),
            Just(usize::MAX),
            0usize..4096,
            1usize..4096,
        ]
    }

    /// The builder calls, each made or not.
    #[derive(Clone, Debug)]
    struct Calls {
        interval: Option<Option<Duration>>,
        jitter: Option<Duration>,
        rate: Option<(Duration, u32)>,
        capacity: Option<usize>,
        metrics: Option<Option<Duration>>,
        drain: Option<Duration>,
        stall: Option<Option<Duration>>,
    }

    fn calls() -> impl Strategy<Value = Calls> {
        (
            proptest::option::of(maybe_duration()),
            proptest::option::of(duration()),
            proptest::option::of((duration(), burst())),
            proptest::option::of(capacity()),
            proptest::option::of(maybe_duration()),
            proptest::option::of(duration()),
            proptest::option::of(maybe_duration()),
        )
            .prop_map(
                |(interval, jitter, rate, capacity, metrics, drain, stall)| Calls {
                    interval,
                    jitter,
                    rate,
                    capacity,
                    metrics,
                    drain,
                    stall,
                },
            )
    }

    fn build(c: &Calls) -> Result<Config, ConfigErrors> {
        let mut b = Config::builder().seed(9);
        if let Some(i) = c.interval {
            b = b.heartbeat_interval(i);
        }
        if let Some(j) = c.jitter {
            b = b.jitter(j);
        }
        if let Some((p, n)) = c.rate {
            b = b.rate_limit(p, n);
        }
        if let Some(n) = c.capacity {
            b = b.event_capacity(n);
        }
        if let Some(m) = c.metrics {
            b = b.metrics_period(m);
        }
        if let Some(d) = c.drain {
            b = b.shutdown_drain(d);
        }
        if let Some(s) = c.stall {
            b = b.read_stall(s, StallAction::Fail);
        }
        b.build()
    }

    fn within_bounds(c: &Config) {
        let period = MIN_PERIOD..=MAX_TIME_KNOB;
        if let Some(i) = c.heartbeat_interval() {
            assert!(period.contains(&i), "{c:?}");
            assert!(c.jitter() < i, "{c:?}");
            assert!(c.rate_period() <= i, "{c:?}");
        }
        assert!(c.jitter() <= MAX_TIME_KNOB, "{c:?}");
        assert!(period.contains(&c.rate_period()), "{c:?}");
        assert!((1..=MAX_RATE_BURST).contains(&c.rate_burst()), "{c:?}");
        assert!(
            (1..=MAX_EVENT_CAPACITY).contains(&c.event_capacity()),
            "{c:?}"
        );
        assert!(
            c.metrics_period().is_none_or(|m| period.contains(&m)),
            "{c:?}"
        );
        assert!(c.shutdown_drain() <= MAX_TIME_KNOB, "{c:?}");
        assert!(
            c.read_stall()
                .is_none_or(|s| (MIN_READ_STALL..=MAX_TIME_KNOB).contains(&s)),
            "{c:?}"
        );
    }

    /// A short life on the paused clock: one engine, a few rounds, its
    /// death and release, the stop.
    fn run(config: Config) {
        let step = config
            .heartbeat_interval()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1));
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(async move {
                let ucx = FakeUcx::new(FakeConfig::default());
                let shutdown = CancellationToken::new();
                let (handle, task) =
                    nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
                let address = PeerAddr::new("10.0.0.9:5600");
                ucx.spawn_prefill(address.clone(), 1);
                let engine = connect(&handle, &ucx, &address).await;
                handle
                    .add_leases(engine.id(), vec!["req-1".into()], true)
                    .unwrap();
                tokio::time::sleep(step * 3).await;
                let _ = handle.snapshot().await.unwrap();
                shutdown.cancel();
                let stopped = task.await.expect("the service task did not panic");
                assert!(stopped.unreleased.is_empty());
            });
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        #[test]
        fn any_builder_input_is_refused_by_name_or_built_within_bounds_and_runs(c in calls()) {
            match build(&c) {
                Ok(config) => {
                    within_bounds(&config);
                    run(config);
                }
                Err(errors) => {
                    for e in errors.errors() {
                        prop_assert!(KNOBS.iter().any(|k| k.env == e.setting()), "{e}");
                        let text = e.to_string();
                        prop_assert!(text.contains(e.setting()) && text.contains("expected"), "{text}");
                    }
                }
            }
        }

        #[test]
        fn every_value_within_the_bounds_builds_and_runs(
            interval in prop_oneof![
                Just(None),
                Just(Some(MIN_PERIOD)),
                Just(Some(MAX_TIME_KNOB)),
                (10_000_000u64..=86_400_000_000_000).prop_map(|n| Some(Duration::from_nanos(n))),
            ],
            jitter_share in 0.0f64..1.0,
            rate_share in 0.0f64..=1.0,
            burst in prop_oneof![Just(1), Just(MAX_RATE_BURST), 1..=MAX_RATE_BURST],
            // MAX_EVENT_CAPACITY (1 s to allocate in a debug build) has its own
            // test above.
            capacity in prop_oneof![Just(1), 1usize..=4096],
            metrics in prop_oneof![Just(None), Just(Some(MIN_PERIOD)), Just(Some(MAX_TIME_KNOB))],
            drain in prop_oneof![Just(Duration::ZERO), Just(MAX_TIME_KNOB), (0u64..10_000).prop_map(Duration::from_millis)],
            stall in prop_oneof![Just(None), Just(Some(MIN_READ_STALL)), Just(Some(MAX_TIME_KNOB))],
        ) {
            let top = interval.unwrap_or(MAX_TIME_KNOB);
            let jitter = if interval.is_some() {
                top.mul_f64(jitter_share).min(top - Duration::from_nanos(1))
            } else {
                top.mul_f64(jitter_share)
            };
            let rate = top.mul_f64(rate_share).clamp(MIN_PERIOD, top);
            let config = Config::builder()
                .heartbeat_interval(interval)
                .jitter(jitter)
                .rate_limit(rate, burst)
                .event_capacity(capacity)
                .metrics_period(metrics)
                .shutdown_drain(drain)
                .read_stall(stall, StallAction::Report)
                .seed(11)
                .build();
            let config = match config {
                Ok(c) => c,
                Err(e) => return Err(TestCaseError::fail(format!("within the bounds, refused: {e}"))),
            };
            within_bounds(&config);
            run(config);
        }

        #[test]
        fn any_environment_is_refused_by_name_or_read_within_bounds(
            values in proptest::collection::vec(
                proptest::option::of(prop_oneof![
                    "[0-9]{1,25}(ns|us|ms|s|m)?",
                    Just("inf".to_string()),
                    Just("0".to_string()),
                    Just("fail".to_string()),
                    ".{0,12}",
                ]),
                KNOBS.len(),
            )
        ) {
            let lookup = |var: &str| {
                let i = KNOBS.iter().position(|k| k.env == var)?;
                values[i].clone()
            };
            match Config::from_lookup(lookup) {
                Ok(config) => within_bounds(&config),
                Err(errors) => {
                    for e in errors.errors() {
                        prop_assert!(KNOBS.iter().any(|k| k.env == e.setting()), "{e}");
                    }
                }
            }
        }
    }
}
