//! 10,000 prefills in a real etcd: how long the decode's membership (the
//! etcd source, the reconciler and the driver) takes to list them and to
//! apply a prefix delete of all of them, and how much memory it holds per
//! member. Baselines in the same run: one unpaged `get` of the prefix with
//! the raw client (its limit raised: unpaged, the default 4 MiB refuses
//! larger prefixes), a raw watch of the same delete, and the raw records
//! kept in a `HashMap<key, value>`. Memory is the heap each gives back
//! when dropped (the system allocator counted by `stats_alloc`): what the
//! membership holds with its members (its connection to etcd included),
//! and what the map holds; and what the membership still holds once every
//! member left, against what it held with them. Prints the ratios and
//! PASS/MISS; never asserts on time.
//!
//! Needs the `etcd` binary (`bash scripts/install-etcd.sh`); without it,
//! prints SKIPPED (fails with NIXL_KEEPALIVE_REQUIRE_REAL=1).
//! `cargo bench -p nixl-keepalive-cli --features etcd --bench membership_scale`
//! (`-- --quick`: 2,000 members).

use std::alloc::System;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_keepalive::membership::etcd::etcd_client::{
    Client, DeleteOptions, EventType, GetOptions, Txn, TxnOp, WatchOptions,
};
use nixl_keepalive::membership::etcd::{EtcdOptions, EtcdSource};
use nixl_keepalive::membership::{self, Member, MembershipConfig, MembershipUpdate};
use nixl_keepalive::{
    AgentName, Config, EngineId, ReleaseStep, Transfers, Transport, TransportError,
};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tokio_util::sync::CancellationToken;

#[path = "../tests/common/etcd.rs"]
#[allow(dead_code)]
mod etcd;

/// For `etcd.rs`: a name unique in this process.
fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

#[global_allocator]
static HEAP: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes allocated and not freed since `region` began.
fn held(region: &Region<'_, System>) -> isize {
    let c = region.change();
    c.bytes_allocated as isize - c.bytes_deallocated as isize + c.bytes_reallocated
}

/// A transport that does nothing: no engine is ever registered here.
struct Noop;

impl Transport for Noop {
    type Resources = ();
    fn notify(&self, _: &AgentName, _: &[u8]) -> Result<(), TransportError> {
        Ok(())
    }
    fn release_with(&self, _: &EngineId, _: &[AgentName], _: (), _: Transfers) -> Vec<ReleaseStep> {
        Vec::new()
    }
}

const PREFIX: &str = "/bench/prefill/";

/// A realistic record: a UUID-like engine id, a `host:port`, 2 ranks.
fn records(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let id = format!(
                "{:08x}-1d68-4442-9ef0-{:012x}",
                i * 2654435761 % (1 << 32),
                i
            );
            let m = Member::new(
                id.as_str(),
                format!("10.{}.{}.{}:17001", i >> 16, (i >> 8) & 255, i & 255),
                2,
            );
            (format!("{PREFIX}{id}"), m.to_json())
        })
        .collect()
}

async fn put_all(client: &mut Client, records: &[(String, String)]) {
    for chunk in records.chunks(100) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|(k, v)| TxnOp::put(k.as_str(), v.as_str(), None))
            .collect();
        client.txn(Txn::new().and_then(ops)).await.expect("txn");
    }
}

async fn delete_all(client: &mut Client) -> i64 {
    client
        .delete(PREFIX, Some(DeleteOptions::new().with_prefix()))
        .await
        .expect("delete the prefix")
        .deleted()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "MISS"
    }
}

async fn run(etcd: &etcd::EtcdServer, n: usize) {
    let url = etcd.url();
    let mut client = Client::connect([url.clone()], None).await.expect("etcd");
    let all = records(n);
    let bytes: usize = all.iter().map(|(k, v)| k.len() + v.len()).sum();
    put_all(&mut client, &all).await;
    drop(all);
    // Baseline: one unpaged get, and the raw records kept in a map.
    let mut kv = client.kv_client().max_decoding_message_size(256 << 20);
    let started = Instant::now();
    let got = kv
        .get(PREFIX, Some(GetOptions::new().with_prefix()))
        .await
        .expect("get");
    let raw_list = started.elapsed();
    let raw: HashMap<Vec<u8>, Vec<u8>> = got
        .kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.value().to_vec()))
        .collect();
    drop(got);
    assert_eq!(raw.len(), n);
    let region = Region::new(HEAP);
    drop(raw);
    let raw_bytes = -held(&region) as f64 / n as f64;

    // Baseline: a raw watch of a prefix delete of every key.
    let mut watch = client
        .watch_client()
        .max_decoding_message_size(256 << 20)
        .watch(PREFIX, Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch");
    watch.message().await.expect("created");
    let started = Instant::now();
    assert_eq!(delete_all(&mut client).await as usize, n);
    let mut seen = 0;
    while seen < n {
        let m = watch.message().await.expect("watch").expect("open");
        seen += m
            .events()
            .iter()
            .filter(|e| e.event_type() == EventType::Delete)
            .count();
    }
    let raw_watch = started.elapsed();
    // What a raw watch stream keeps once it decoded that one response (the
    // heap it gives back when dropped), against a fresh stream's: the
    // check of what the membership keeps once every member left (below).
    let region = Region::new(HEAP);
    drop(watch);
    let raw_watch_kept = -held(&region);
    let mut fresh = client
        .watch_client()
        .max_decoding_message_size(256 << 20)
        .watch(PREFIX, Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch");
    fresh.message().await.expect("created");
    let region = Region::new(HEAP);
    drop(fresh);
    let fresh_watch_kept = -held(&region);
    put_all(&mut client, &records(n)).await;

    // Ours: the service (no engine registered), the etcd source and the
    // membership driver; the updates are read and dropped as they come.
    let shutdown = CancellationToken::new();
    let (handle, _service) =
        nixl_keepalive::spawn(Arc::new(Noop), Config::default(), shutdown.clone());
    let (mut membership, our_list) = start_membership(&url, &handle, n).await;
    let started = Instant::now();
    assert_eq!(delete_all(&mut client).await as usize, n);
    let mut left = 0;
    while left < n {
        if let MembershipUpdate::Left { .. } = membership.updates.recv().await.expect("driver") {
            left += 1;
        }
    }
    let our_watch = started.elapsed();
    // What the membership still holds once every member left (issue 30,
    // item 10d: its tables kept room for all of them), measured as the
    // heap it gives back when it stops, against an empty membership's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_left_bytes = given_back_at_stop(membership).await;
    let empty = start_membership(&url, &handle, 0).await.0;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let empty_bytes = given_back_at_stop(empty).await;

    // Memory: what the membership holds with n members, measured as the
    // heap it gives back when it stops (so one-off allocations elsewhere in
    // the process do not count).
    put_all(&mut client, &records(n)).await;
    let (membership, _) = start_membership(&url, &handle, n).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ours_bytes = given_back_at_stop(membership).await as f64 / n as f64;
    shutdown.cancel();

    let list_ratio = our_list.as_secs_f64() / raw_list.as_secs_f64();
    let watch_ratio = our_watch.as_secs_f64() / raw_watch.as_secs_f64();
    let mem_ratio = ours_bytes / raw_bytes;
    println!(
        "membership_scale: {n} members, {:.2} MiB of records",
        bytes as f64 / (1 << 20) as f64
    );
    println!(
        "  list:   {} (paged, parsed, reconciled, {n} Joined)   baseline one raw get {}   ratio {list_ratio:.2}x   target <= 1 s: {}",
        ms(our_list),
        ms(raw_list),
        verdict(our_list <= Duration::from_secs(1))
    );
    println!(
        "  watch:  {} (a prefix delete of {n}, one revision: {n} Left)   baseline raw watch {}   ratio {watch_ratio:.2}x   target <= 1 s: {}",
        ms(our_watch),
        ms(raw_watch),
        verdict(our_watch <= Duration::from_secs(1))
    );
    println!(
        "  memory: {ours_bytes:.0} B/member held by the membership   baseline raw records in a HashMap {raw_bytes:.0} B/member   ratio {mem_ratio:.2}x   target <= 1 KiB: {}",
        verdict(ours_bytes <= 1024.0)
    );
    let with_n = ours_bytes * n as f64;
    println!(
        "  after:  {:.0} KiB held by the membership once all {n} left (an empty one: {:.0} KiB)   baseline what it holds with {n} members {:.0} KiB   ratio {:.3}x   target <= 0.1x: {}",
        after_left_bytes as f64 / 1024.0,
        empty_bytes as f64 / 1024.0,
        with_n / 1024.0,
        after_left_bytes as f64 / with_n,
        verdict((after_left_bytes as f64) <= 0.1 * with_n)
    );
    println!(
        "          a raw watch stream that decoded the delete's one response gives back {:.0} KiB when dropped (a fresh one: {:.0} KiB): {:.0} KiB kept for the largest message it decoded",
        raw_watch_kept as f64 / 1024.0,
        fresh_watch_kept as f64 / 1024.0,
        (raw_watch_kept - fresh_watch_kept) as f64 / 1024.0
    );
}

/// Stops `membership`; the heap that gave back (bytes).
async fn given_back_at_stop(membership: Membership) -> isize {
    let region = Region::new(HEAP);
    membership.stop().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    -held(&region)
}

/// A running etcd source and membership driver.
struct Membership {
    updates: tokio::sync::mpsc::UnboundedReceiver<MembershipUpdate>,
    stop: CancellationToken,
    driver: tokio::task::JoinHandle<()>,
}

impl Membership {
    /// Stops the source and the driver, and waits for the driver.
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.driver.await;
        drop(self.updates);
    }
}

/// Starts a source and a driver on the prefix and waits for its `n`
/// members to be announced; how long that took.
async fn start_membership(
    url: &str,
    handle: &nixl_keepalive::KeepaliveHandle<()>,
    n: usize,
) -> (Membership, Duration) {
    let stop = CancellationToken::new();
    let started = Instant::now();
    let source = EtcdSource::spawn(
        EtcdOptions::new(vec![url.to_string()], PREFIX),
        stop.clone(),
    );
    let (mut updates, driver) = membership::spawn(
        source,
        handle.clone(),
        MembershipConfig::default(),
        stop.clone(),
    );
    let mut joined = 0;
    while joined < n {
        if let MembershipUpdate::Joined(_) = updates.recv().await.expect("driver") {
            joined += 1;
        }
    }
    let took = started.elapsed();
    (
        Membership {
            updates,
            stop,
            driver,
        },
        took,
    )
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var_os("BENCH_QUICK").is_some_and(|v| v != "0");
    let Some(etcd) = etcd::EtcdServer::start_or_skip() else {
        return;
    };
    let n = if quick { 2_000 } else { 10_000 };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(run(&etcd, n));
}
