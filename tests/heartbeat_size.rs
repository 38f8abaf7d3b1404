//! `HB:` notifications stay small whatever the number of pending
//! requests, and a request id cannot be split into two on the other side.
//!
//! Before: one `HB:` carried every pending id (10,000 pending requests made
//! one notification of about 400 KB), and an id holding a comma reached the
//! prefill as two ids.

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeOp, FakeUcx};
use nixl_keepalive::lease::{heartbeat_messages, MAX_HEARTBEAT_BYTES};
use nixl_keepalive::lease::{LeaseError, RequestIdError, MAX_REQUEST_ID};
use nixl_keepalive::NameError;
use nixl_keepalive::{Config, EngineRef, KeepaliveHandle, PeerAddr};
use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

type Handle = KeepaliveHandle<nixl_keepalive::fake::FakeResources>;

async fn connect(handle: &Handle, ucx: &FakeUcx, address: &PeerAddr) -> EngineRef {
    ucx.connect(handle, address).await.expect("connects")
}

/// The ids an `HB:` names, as vLLM's prefill (and ours, `cli/src/pd`)
/// reads them: after `HB:`, split at `,`, empty pieces skipped.
fn named(message: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(message).expect("UTF-8");
    let ids = text.strip_prefix("HB:").expect("starts with HB:");
    ids.split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn ten_thousand_pending_requests_go_out_in_notifications_of_at_most_8_kib_naming_each_id_once(
) {
    let ucx = FakeUcx::new(FakeConfig::default());
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(5)))
        .seed(1)
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
    let address = PeerAddr::new("10.0.0.1:5600");
    ucx.spawn_prefill(address.clone(), 2);
    let engine = connect(&handle, &ucx, &address).await;
    let ids: Vec<String> = (0..10_000)
        .map(|i| format!("cmpl-8c1e6a52-4f0b-4d4e-9a57-{i:012}-0"))
        .collect();
    handle
        .add_leases(engine.id(), ids.clone(), false)
        .expect("valid ids");
    // A burst of renewal requests: the rate cap (burst 2) counts rounds,
    // however many notifications a round takes.
    for _ in 0..5 {
        handle
            .renew_leases(engine.id())
            .expect("the service is running");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let notifies: Vec<_> = ucx
        .calls()
        .into_iter()
        .filter(|c| c.op == FakeOp::Notify && c.message.starts_with(b"HB:"))
        .collect();
    let agents = ucx.agents_of(engine.id());
    assert_eq!(agents.len(), 2);
    let per_round = heartbeat_messages(&ids).len();
    assert!(per_round > 1, "10,000 ids fit in one notification?");
    // Two rounds (the burst), each to both agents; none of the first,
    // idle ones (the engine had no leases until now) is counted here as
    // they name nothing.
    let with_ids: Vec<_> = notifies.iter().filter(|c| c.message.len() > 3).collect();
    assert_eq!(
        with_ids.len(),
        2 * 2 * per_round,
        "rounds x agents x notifications per round"
    );
    for agent in &agents {
        let to_agent: Vec<_> = with_ids
            .iter()
            .filter(|c| c.agent.as_ref() == Some(agent))
            .collect();
        for round in to_agent.chunks(per_round) {
            let mut seen = Vec::new();
            for c in round {
                assert!(
                    c.message.len() <= MAX_HEARTBEAT_BYTES,
                    "a notification of {} bytes",
                    c.message.len()
                );
                seen.extend(named(&c.message));
            }
            // Every id exactly once per round, in order: the prefill
            // extends exactly what one unbounded HB: would have.
            assert_eq!(seen, ids);
        }
    }
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_request_id_with_a_comma_or_a_control_character_is_refused_and_nothing_is_added() {
    let ucx = FakeUcx::new(FakeConfig::default());
    let shutdown = CancellationToken::new();
    let config = Config::builder().seed(2).build().unwrap();
    let (handle, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config, shutdown.clone());
    let address = PeerAddr::new("10.0.0.2:5600");
    ucx.spawn_prefill(address.clone(), 1);
    let engine = connect(&handle, &ucx, &address).await;
    let id = engine.id();
    let e = handle
        .add_leases(id, vec!["ok-1".into(), "req-1,req-2".into()], true)
        .unwrap_err();
    assert!(
        matches!(
            e,
            LeaseError::RequestId(RequestIdError::Separator { at: 5, .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("req-1,req-2"), "{e}");
    let e = handle
        .add_leases(id, vec!["a\nHB:victim".into()], true)
        .unwrap_err();
    assert!(
        matches!(
            e,
            LeaseError::RequestId(RequestIdError::Name(NameError::Control { .. }))
        ),
        "{e}"
    );
    assert!(e.to_string().contains("a\\nHB:victim"), "{e}");
    let e = handle
        .add_leases(id, vec!["r".repeat(MAX_REQUEST_ID + 1)], true)
        .unwrap_err();
    assert!(
        matches!(
            e,
            LeaseError::RequestId(RequestIdError::Name(NameError::TooLong { .. }))
        ),
        "{e}"
    );
    handle
        .add_leases(id, vec!["r".repeat(MAX_REQUEST_ID)], false)
        .expect("the longest id is accepted");
    let snapshot = handle.snapshot().await.unwrap();
    let leases = &snapshot.engine(id).unwrap().leases;
    assert_eq!(
        leases,
        &vec!["r".repeat(MAX_REQUEST_ID)],
        "nothing refused was added"
    );
    shutdown.cancel();
    task.await.unwrap();
}

/// A request id as `add_leases` accepts it: 1 to MAX_REQUEST_ID bytes of
/// printable text without a comma (lengths up to the bound, drawn cheaply).
fn request_id() -> impl Strategy<Value = String> {
    (1..=MAX_REQUEST_ID, any::<u64>()).prop_map(|(len, seed)| {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-_:. ";
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                CHARS[(x % CHARS.len() as u64) as usize] as char
            })
            .collect()
    })
}

proptest! {
    #[test]
    fn split_notifications_are_bounded_valid_and_name_every_id_once_in_order(
        ids in proptest::collection::vec(request_id(), 0..400)
    ) {
        let messages = heartbeat_messages(&ids);
        prop_assert!(!messages.is_empty());
        let mut seen = Vec::new();
        for m in &messages {
            prop_assert!(m.len() <= MAX_HEARTBEAT_BYTES);
            prop_assert!(m.starts_with(b"HB:"));
            seen.extend(named(m));
        }
        let expected: Vec<String> = ids.iter().filter(|s| !s.is_empty()).cloned().collect();
        prop_assert_eq!(&seen, &expected);
        // No more notifications than the bytes need: every one but the
        // last could not take the next id.
        let total: usize = ids.iter().map(|s| s.len() + 1).sum();
        prop_assert!(messages.len() <= 1 + total / (MAX_HEARTBEAT_BYTES - 4 - MAX_REQUEST_ID));
        if ids.is_empty() {
            prop_assert_eq!(messages, vec![b"HB:".to_vec()]);
        }
    }
}
