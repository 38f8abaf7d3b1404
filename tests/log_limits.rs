//! A peer that fails the same way over and over does not flood the log:
//! one line per engine, status and source per period, saying how many
//! occurrences it stands for; every occurrence is still counted and is
//! still an event. Before: a broken prefill produced 1,235
//! `transient_error` lines in 16 s.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeUcx};
use nixl_keepalive::log_limit::LOG_PERIOD;
use nixl_keepalive::{Config, Event, NixlStatus, PeerAddr};
use tokio_util::sync::CancellationToken;

/// A log sink the test reads back.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines_with(&self, needle: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_string)
            .collect()
    }
}

/// A service on the fake UCX, on the paused clock.
struct World {
    handle: nixl_keepalive::KeepaliveHandle<nixl_keepalive::fake::FakeResources>,
    task: tokio::task::JoinHandle<nixl_keepalive::Stopped<nixl_keepalive::fake::FakeResources>>,
    shutdown: CancellationToken,
    events: tokio::sync::broadcast::Receiver<Event>,
}

/// The INFO log captured for this thread (while the guard lives), a
/// service with room for every event, and a one-rank prefill at
/// `address` connected to it.
async fn captured_service(
    seed: u64,
    address: &PeerAddr,
) -> (
    Captured,
    tracing::subscriber::DefaultGuard,
    World,
    nixl_keepalive::EngineRef,
) {
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    let ucx = FakeUcx::new(FakeConfig::default());
    let shutdown = CancellationToken::new();
    let config = Config::builder()
        .event_capacity(4096)
        .seed(seed)
        .build()
        .unwrap();
    let (handle, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
    let events = handle.subscribe();
    ucx.spawn_prefill(address.clone(), 1);
    let engine = ucx.connect(&handle, address).await.expect("connects");
    let world = World {
        handle,
        task,
        shutdown,
        events,
    };
    (captured, guard, world, engine)
}

#[tokio::test(start_paused = true)]
async fn a_broken_prefill_s_1235_transient_errors_in_16_s_make_one_line_per_period() {
    let address = PeerAddr::new("10.0.0.1:5600");
    let (captured, _guard, w, engine) = captured_service(4, &address).await;
    let World {
        handle,
        task,
        shutdown,
        mut events,
    } = w;

    let errors = 1235u32;
    let span = Duration::from_secs(16);
    for _ in 0..errors {
        engine.report_transfer(NixlStatus::ERR_BACKEND);
        tokio::time::sleep(span / errors).await;
    }
    let snapshot = handle.snapshot().await.unwrap();
    let counted = snapshot.engine(engine.id()).unwrap().transient_errors;
    shutdown.cancel();
    task.await.unwrap();

    // Every one counted, every one an event.
    assert_eq!(counted, u64::from(errors));
    let mut seen = 0;
    while let Ok(e) = events.try_recv() {
        if matches!(e, Event::TransientError { .. }) {
            seen += 1;
        }
    }
    assert_eq!(seen, errors);
    // One line per period: 16 s of errors, a 10 s period: two lines, the
    // second saying how many it stands for.
    let lines = captured.lines_with("not a disconnect");
    let periods = (span.as_secs() / LOG_PERIOD.as_secs() + 1) as usize;
    assert_eq!(lines.len(), periods, "{lines:#?}");
    assert!(lines[0].contains("suppressed=0"), "{}", lines[0]);
    let told: u64 = lines[1]
        .split("suppressed=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("the count is in the line");
    assert!(told > 700, "{}", lines[1]);
}

/// A stream of stale incarnations of one engine (records of its dead
/// predecessors expiring late, each naming its own incarnation) was one
/// WARN each. Now the WARN is per engine and kind: the first, then one at
/// each power of two of distinct ones with the count; every one is still
/// counted and still an event, and the healthy engine is kept.
#[tokio::test(start_paused = true)]
async fn stale_incarnations_of_one_engine_are_one_warn_then_a_count_not_a_line_each() {
    let address = PeerAddr::new("10.0.0.2:5600");
    let (captured, _guard, w, engine) = captured_service(5, &address).await;
    let World {
        handle,
        task,
        shutdown,
        mut events,
    } = w;
    let stale = 300u64;
    for k in 0..stale {
        handle
            .member_gone(
                nixl_keepalive::Departure {
                    engine: engine.id().clone(),
                    incarnation: Some(nixl_keepalive::Incarnation(1_000_000 + k)),
                    address: address.clone(),
                },
                nixl_keepalive::GoneMode::Drain,
            )
            .unwrap();
    }
    let _ = handle.snapshot().await.unwrap();
    assert_eq!(engine.state(), nixl_keepalive::EngineState::Live, "kept");
    shutdown.cancel();
    task.await.unwrap();

    let mut conflicts = 0;
    while let Ok(e) = events.try_recv() {
        if matches!(e, Event::Conflict { .. }) {
            conflicts += 1;
        }
    }
    assert_eq!(conflicts, stale, "each distinct conflict is an event");
    let warns: Vec<String> = captured
        .lines_with("WARN")
        .into_iter()
        .filter(|l| l.contains("identity conflict"))
        .collect();
    // 1, then 2, 4, 8, 16, 32, 64, 128, 256: 9 lines for 300.
    assert_eq!(warns.len(), 9, "{warns:#?}");
    assert!(warns[8].contains("distinct=256"), "{}", warns[8]);
}
