//! etcd as the membership plane, with the `etcd-client` crate: the
//! decoder's watch ([`EtcdSource`]) and the prefill's lease-backed
//! registration ([`EtcdRegistration`]).
//!
//! The watch: connect, list the prefix in pages ([`SourceEvent::Listed`]
//! at the first page's revision and cluster id), watch the prefix from
//! that revision + 1, and pass on every event of every watch response, in
//! order (the events of one transaction share a revision). A watch
//! cancelled for a compacted start revision, a broken stream, a failed
//! connection or an unanswered keep-alive (etcd frozen) is an outage:
//! reported once, retried with a back-off that doubles up to
//! [`EtcdOptions::max_backoff`], each retry logged, and ended by a new list
//! of the prefix. So is a list that cannot complete, reported as such (not
//! as "unreachable"). Nothing here ever retires an engine on an error.
//!
//! # Large prefixes
//!
//! etcd-client's gRPC channel refuses responses over 4 MiB by default, so
//! one `get` of a large prefix fails whatever the retries. The list is
//! read in pages of [`EtcdOptions::page_size`] keys, every page at the
//! revision of the first (one consistent view), and the client accepts
//! responses up to [`EtcdOptions::max_message`] (16 MiB by default: more
//! than any one value etcd accepts by default, 1.5 MiB). A page over that
//! is read again with half as many keys; only a single key whose value is
//! over it makes the list fail, reported as `listing ... cannot complete`.
//! Watch responses get the same limit, and etcd is asked to split large
//! ones (watch fragments, etcd 3.4+).
//!
//! # The store epoch
//!
//! An etcd restarted with an empty data directory and the same flags keeps
//! its cluster id, and its revision can pass the last one a decoder saw
//! (other applications' keys): neither tells the new store from the old.
//! So before each list the source makes sure the store holds an epoch,
//! a random number under [`EtcdOptions::store_epoch_key`] (created only
//! where absent, in one transaction: two decoders at once agree on the
//! first one written), and reads it at the list's own revision. A wiped
//! store lost it with everything else: the list names another epoch, or
//! none, and the reconciler takes it as a store reset (a grace period,
//! never a mass release). The key is outside the prefix's records (and
//! skipped if a prefix happens to cover it); it has no lease.
//!
//! # Claiming a key
//!
//! A prefill writes its key only where the key is free or already its
//! own (the same engine id, address and incarnation), in one transaction.
//! A key held by another process (two prefills started with one
//! `--engine-id`) is not overwritten: the registration says so once per
//! owner ([`RegistrationEvent::Contested`], one WARN naming the owner),
//! watches the key, and claims it as soon as it is free (the owner
//! stopped, or its lease expired).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

pub use etcd_client;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KvClient, PutOptions, Txn,
    TxnOp, WatchOptions, WatchStream,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Member, MembershipSource, SourceEvent};

/// Where etcd is and how to talk to it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// Client URLs, such as `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// The key prefix (see the key schema in the module docs).
    pub prefix: String,
    /// Connect timeout, and the per-request timeout of `get` (per page),
    /// `put` and lease calls.
    pub timeout: Duration,
    /// HTTP/2 keep-alive of the connection: a silent etcd (frozen, or a
    /// dead link) is an outage after `keep_alive + timeout`. At least 5 s:
    /// etcd answers pings more frequent than its
    /// `--grpc-keepalive-min-time` (5 s by default) with a GOAWAY.
    pub keep_alive: Duration,
    /// First pause between reconnection attempts; doubles per failure.
    pub min_backoff: Duration,
    /// Longest pause between reconnection attempts.
    pub max_backoff: Duration,
    /// Keys per page when listing the prefix (at least 1).
    pub page_size: i64,
    /// The largest response accepted from etcd, in bytes (a page of the
    /// list, or a watch response).
    pub max_message: usize,
}

/// Keys per page of a list, by default.
pub const DEFAULT_PAGE_SIZE: i64 = 1000;
/// The largest response accepted from etcd, by default: 16 MiB (etcd's
/// own limit on one value is 1.5 MiB by default).
pub const DEFAULT_MAX_MESSAGE: usize = 16 << 20;

impl EtcdOptions {
    /// Defaults for `endpoints` under `prefix`: 2 s timeouts, 10 s
    /// keep-alive, back-off from 100 ms to 2 s, pages of 1,000 keys,
    /// responses up to 16 MiB.
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>) -> Self {
        EtcdOptions {
            endpoints,
            prefix: prefix.into(),
            timeout: Duration::from_secs(2),
            keep_alive: Duration::from_secs(10),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            page_size: DEFAULT_PAGE_SIZE,
            max_message: DEFAULT_MAX_MESSAGE,
        }
    }

    /// The key that holds the store's epoch (see the module docs): the
    /// prefix without its trailing `/`, then `.store-epoch`
    /// (`/nixl-keepalive/prefill.store-epoch` for the default prefix).
    pub fn store_epoch_key(&self) -> String {
        format!("{}.store-epoch", self.prefix.trim_end_matches('/'))
    }

    async fn connect(&self) -> Result<Client, etcd_client::Error> {
        let options = ConnectOptions::new()
            .with_connect_timeout(self.timeout)
            .with_keep_alive(self.keep_alive, self.timeout)
            .with_keep_alive_while_idle(true);
        Client::connect(&self.endpoints, Some(options)).await
    }
}

/// Doubling back-off with a cap (`backon`'s exponential back-off, no
/// jitter, no limit on attempts), and the failures of the outage so far:
/// warnings back off too, one at failures 1, 2, 4, 8, ... of an outage,
/// the others at debug level.
struct Backoff {
    builder: ExponentialBuilder,
    pauses: <ExponentialBuilder as BackoffBuilder>::Backoff,
    max: Duration,
    failures: u32,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Self {
        let builder = ExponentialBuilder::new()
            .with_min_delay(min)
            .with_max_delay(max)
            .with_factor(2.0)
            .without_max_times();
        Backoff {
            builder,
            pauses: builder.build(),
            max,
            failures: 0,
        }
    }

    fn reset(&mut self) {
        self.pauses = self.builder.build();
        self.failures = 0;
    }

    fn step(&mut self) -> Duration {
        self.failures += 1;
        // Never `None` (no limit on attempts or total delay); the cap if
        // it were.
        self.pauses.next().unwrap_or(self.max)
    }
}

/// The decoder's watch of the prefix (a task feeding a channel, so
/// [`MembershipSource::next`] is cancel safe).
pub struct EtcdSource {
    rx: mpsc::UnboundedReceiver<SourceEvent>,
    prefix: String,
    restarts: Arc<AtomicU64>,
}

impl MembershipSource for EtcdSource {
    async fn next(&mut self) -> Option<SourceEvent> {
        self.rx.recv().await
    }

    fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl EtcdSource {
    /// Starts watching (in a task that runs until `shutdown`).
    pub fn spawn(options: EtcdOptions, shutdown: CancellationToken) -> EtcdSource {
        let (tx, rx) = mpsc::unbounded_channel();
        let prefix = options.prefix.clone();
        let restarts = Arc::new(AtomicU64::new(0));
        tokio::spawn(watch_loop(options, tx, restarts.clone(), shutdown));
        EtcdSource {
            rx,
            prefix,
            restarts,
        }
    }

    /// How many times the watch was started again, from the revision after
    /// a large response, to give back the stream's decode buffer
    /// ([`WATCH_RESTART_BYTES`]).
    pub fn watch_restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
}

/// A watch response whose events carry at least this many bytes (keys and
/// values) makes the source start its watch again, on the same connection,
/// from the revision after the response's last event (after the last
/// fragment of a fragmented revision). The gRPC stream
/// (tonic's `Streaming`) keeps a decode buffer as large as the largest
/// message it decoded, for the stream's life: 591 KiB after a prefix
/// delete of 10,000 members, most of what the membership held once they
/// had all left (`membership_scale`, docs/benchmarks.md). A new stream
/// starts small. Never after a fragment (`with_fragment`): the revision it
/// belongs to continues in the next message.
pub const WATCH_RESTART_BYTES: usize = 64 << 10;

/// What one event weighs towards [`WATCH_RESTART_BYTES`] beside its key
/// and value: the protobuf framing and the other fields of the `KeyValue`.
const EVENT_OVERHEAD: usize = 32;

/// Why a watch round ended.
enum RoundEnd {
    /// Stop: shut down, or nobody listens any more.
    Stop,
    /// etcd could not be reached, or broke the watch: report an outage (if
    /// not already) and retry.
    Unreachable(String),
    /// etcd answered, but the prefix could not be listed whole: an outage
    /// too (nothing is known), retried, and said as what it is.
    ListIncomplete(String),
    /// The start revision was compacted: list again at once.
    Compacted(i64),
}

async fn watch_loop(
    options: EtcdOptions,
    tx: mpsc::UnboundedSender<SourceEvent>,
    restarts: Arc<AtomicU64>,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(options.min_backoff, options.max_backoff);
    let mut in_outage = false;
    loop {
        let end = tokio::select! {
            _ = shutdown.cancelled() => return,
            end = watch_round(&options, &tx, &restarts, &mut backoff, &mut in_outage) => end,
        };
        let (error, what) = match end {
            RoundEnd::Stop => return,
            RoundEnd::Compacted(rev) => {
                tracing::warn!(
                    compact_revision = rev,
                    "etcd watch fell behind a compaction: listing the prefix again"
                );
                continue;
            }
            RoundEnd::Unreachable(error) => (error, "etcd unreachable"),
            RoundEnd::ListIncomplete(error) => (error, "etcd prefix cannot be listed"),
        };
        if !in_outage {
            in_outage = true;
            if tx
                .send(SourceEvent::Outage {
                    error: error.clone(),
                })
                .is_err()
            {
                return;
            }
        }
        let pause = backoff.step();
        if backoff.failures.is_power_of_two() {
            tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "{what}: engines kept, retrying");
        } else {
            tracing::debug!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "{what}: engines kept, retrying");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// The whole prefix, read in pages at one revision.
struct Listing {
    revision: i64,
    cluster_id: u64,
    epoch: Option<u64>,
    entries: Vec<(String, Vec<u8>)>,
}

/// Writes a store epoch where the store has none (only if the key was
/// never created: of two decoders at once, the first write stands). A
/// refusal (no write permission, say) is reported and the list goes on
/// without an epoch: the revision and cluster id are the evidence left.
async fn ensure_epoch(kv: &mut KvClient, options: &EtcdOptions) {
    let key = options.store_epoch_key();
    let epoch: u64 = rand::random();
    let txn = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.as_str(), epoch.to_string(), None)]);
    match tokio::time::timeout(options.timeout, kv.txn(txn)).await {
        Ok(Ok(r)) if r.succeeded() => {
            tracing::info!(key = %key, epoch, "etcd: the store had no epoch (new or wiped): wrote one")
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(key = %key, error = %e, "etcd: cannot write the store epoch: a store wiped and restarted with the same flags is then seen only if its revision went back")
        }
        Err(_) => tracing::warn!(key = %key, "etcd: writing the store epoch timed out"),
    }
}

/// Why the store epoch could not be read at a list's revision.
enum EpochRead {
    /// The revision was compacted meanwhile: list again.
    Compacted,
    /// etcd failed: an outage.
    Failed(RoundEnd),
}

/// The store epoch at `revision` (`None`: absent, or not a number).
async fn read_epoch(
    kv: &mut KvClient,
    options: &EtcdOptions,
    revision: i64,
) -> Result<Option<u64>, EpochRead> {
    let key = options.store_epoch_key();
    let get = kv.get(
        key.as_str(),
        Some(GetOptions::new().with_revision(revision)),
    );
    match tokio::time::timeout(options.timeout, get).await {
        Err(_) => Err(EpochRead::Failed(RoundEnd::Unreachable(format!(
            "reading the store epoch timed out after {:?}",
            options.timeout
        )))),
        Ok(Err(e)) if compacted(&e) => Err(EpochRead::Compacted),
        Ok(Err(e)) => Err(EpochRead::Failed(RoundEnd::Unreachable(format!(
            "reading the store epoch: {e}"
        )))),
        Ok(Ok(r)) => Ok(r
            .kvs()
            .first()
            .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse().ok())),
    }
}

/// The end of the key range of `prefix` (etcd's rule: the prefix with its
/// last byte below 0xff increased, trailing 0xff bytes dropped; every key
/// from the prefix on when there is none).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A gRPC error: etcd-client's wrapper of tonic's status.
fn grpc(e: &etcd_client::Error) -> Option<(tonic::Code, &str)> {
    match e {
        etcd_client::Error::GRpcStatus(s) => Some((s.code(), s.message())),
        _ => None,
    }
}

/// tonic refused a response over the client's limit.
fn too_large(e: &etcd_client::Error) -> bool {
    grpc(e).is_some_and(|(code, m)| {
        code == tonic::Code::OutOfRange && m.contains("message length too large")
    })
}

/// etcd compacted the revision the pages are read at.
fn compacted(e: &etcd_client::Error) -> bool {
    grpc(e).is_some_and(|(code, m)| code == tonic::Code::OutOfRange && m.contains("compacted"))
}

/// Lists the prefix: pages of `options.page_size` keys at the first page's
/// revision; a page over the message limit is read again with half as many
/// keys; a compaction of that revision while paging starts the list again.
async fn list_prefix(kv: &mut KvClient, options: &EtcdOptions) -> Result<Listing, RoundEnd> {
    let prefix = options.prefix.as_bytes();
    let end = prefix_end(prefix);
    let page_size = options.page_size.max(1);
    let epoch_key = options.store_epoch_key();
    ensure_epoch(kv, options).await;
    'list: loop {
        let mut from = prefix.to_vec();
        let mut last_read: Option<String> = None;
        let mut at: Option<(i64, u64)> = None;
        let mut limit = page_size;
        let mut entries = Vec::new();
        loop {
            let mut get = GetOptions::new().with_range(end.clone()).with_limit(limit);
            if let Some((revision, _)) = at {
                get = get.with_revision(revision);
            }
            let page = match tokio::time::timeout(options.timeout, kv.get(from.clone(), Some(get)))
                .await
            {
                Err(_) => {
                    return Err(RoundEnd::Unreachable(format!(
                        "listing the prefix timed out after {:?}",
                        options.timeout
                    )))
                }
                Ok(Err(e)) if too_large(&e) => {
                    if limit == 1 {
                        let which = match &last_read {
                            Some(k) => format!("the key after {}", crate::text::Escaped(k)),
                            None => "its first key".to_string(),
                        };
                        return Err(RoundEnd::ListIncomplete(format!(
                            "listing {:?} cannot complete: the value of {which} is over the client's {} byte message limit ({e})",
                            options.prefix, options.max_message
                        )));
                    }
                    limit = (limit / 2).max(1);
                    continue;
                }
                Ok(Err(e)) if at.is_some() && compacted(&e) => continue 'list,
                Ok(Err(e)) => {
                    return Err(RoundEnd::Unreachable(format!("listing the prefix: {e}")))
                }
                Ok(Ok(page)) => page,
            };
            let (revision, cluster_id) = match (at, page.header()) {
                (Some(at), _) => at,
                (None, Some(h)) => (h.revision(), h.cluster_id()),
                (None, None) => {
                    return Err(RoundEnd::Unreachable(
                        "list response without a header".into(),
                    ))
                }
            };
            at = Some((revision, cluster_id));
            for kv in page
                .kvs()
                .iter()
                .filter(|kv| kv.key() != epoch_key.as_bytes())
            {
                entries.push((
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                ));
            }
            let last = page.kvs().last().map(|kv| kv.key().to_vec());
            match last {
                Some(mut key) if page.more() => {
                    last_read = Some(String::from_utf8_lossy(&key).into_owned());
                    // The next page starts just after the last key.
                    key.push(0);
                    from = key;
                    limit = (limit * 2).min(page_size);
                }
                _ => {
                    // At the list's revision: the epoch of the very store
                    // these pages came from.
                    let epoch = match read_epoch(kv, options, revision).await {
                        Ok(epoch) => epoch,
                        Err(EpochRead::Compacted) => continue 'list,
                        Err(EpochRead::Failed(end)) => return Err(end),
                    };
                    return Ok(Listing {
                        revision,
                        cluster_id,
                        epoch,
                        entries,
                    });
                }
            }
        }
    }
}

/// One connection: list, then watch until something breaks.
async fn watch_round(
    options: &EtcdOptions,
    tx: &mpsc::UnboundedSender<SourceEvent>,
    restarts: &AtomicU64,
    backoff: &mut Backoff,
    in_outage: &mut bool,
) -> RoundEnd {
    let client = match options.connect().await {
        Ok(c) => c,
        Err(e) => return RoundEnd::Unreachable(format!("connect to {:?}: {e}", options.endpoints)),
    };
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(options.max_message);
    let listing = match list_prefix(&mut kv, options).await {
        Ok(l) => l,
        Err(end) => return end,
    };
    let mut stream = match start_watch(&client, options, listing.revision + 1).await {
        Ok(s) => s,
        Err(end) => return end,
    };
    // Listed only once the watch is in place: nothing between the two is
    // lost, since the watch starts at the list's revision + 1.
    let listed = SourceEvent::Listed {
        revision: listing.revision,
        cluster_id: listing.cluster_id,
        epoch: listing.epoch,
        entries: listing.entries,
    };
    let epoch_key = options.store_epoch_key();
    if tx.send(listed).is_err() {
        return RoundEnd::Stop;
    }
    *in_outage = false;
    backoff.reset();
    let mut largest = 0;
    loop {
        let message = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return RoundEnd::Unreachable("etcd closed the watch".into()),
            Err(e) => return RoundEnd::Unreachable(format!("watch: {e}")),
        };
        if message.canceled() {
            if message.compact_revision() > 0 {
                return RoundEnd::Compacted(message.compact_revision());
            }
            return RoundEnd::Unreachable(format!("watch cancelled: {}", message.cancel_reason()));
        }
        let weight: usize = message
            .events()
            .iter()
            .filter_map(|e| e.kv())
            .map(|kv| kv.key().len() + kv.value().len() + EVENT_OVERHEAD)
            .sum();
        let last = message
            .events()
            .iter()
            .filter_map(|e| e.kv())
            .map(|kv| kv.mod_revision())
            .max();
        // The largest message since the stream started: the last fragment
        // of a fragmented revision may be small, its first ones were not.
        largest = largest.max(weight);
        let restart = match last {
            Some(last) if largest >= WATCH_RESTART_BYTES && !message.0.fragment => Some(last + 1),
            _ => None,
        };
        // Every event, in order, whatever its revision: one transaction's
        // events share theirs.
        for event in message.events() {
            let Some(kv) = event.kv() else { continue };
            if kv.key() == epoch_key.as_bytes() {
                continue;
            }
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let revision = kv.mod_revision();
            let e = match event.event_type() {
                EventType::Put => SourceEvent::Put {
                    key,
                    value: kv.value().to_vec(),
                    revision,
                },
                EventType::Delete => SourceEvent::Deleted { key, revision },
            };
            if tx.send(e).is_err() {
                return RoundEnd::Stop;
            }
        }
        if let Some(from) = restart {
            drop(message);
            drop(stream);
            stream = match start_watch(&client, options, from).await {
                Ok(s) => s,
                Err(end) => return end,
            };
            largest = 0;
            restarts.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                bytes = largest,
                from_revision = from,
                "etcd watch started again after a large response (gives back its decode buffer)"
            );
        }
    }
}

/// Starts the prefix's watch at revision `from`.
async fn start_watch(
    client: &Client,
    options: &EtcdOptions,
    from: i64,
) -> Result<WatchStream, RoundEnd> {
    client
        .watch_client()
        .max_decoding_message_size(options.max_message)
        .watch(
            options.prefix.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(from)
                    .with_progress_notify()
                    .with_fragment(),
            ),
        )
        .await
        .map_err(|e| RoundEnd::Unreachable(format!("starting the watch: {e}")))
}

/// What a prefill's registration reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistrationEvent {
    /// The key was written under a fresh lease.
    Registered {
        /// The key.
        key: String,
        /// The lease, as etcd numbers it.
        lease: i64,
    },
    /// The lease is gone (etcd answered `lease not found`, or a keep-alive
    /// reply with no time left): it expired while the process was frozen
    /// or etcd was away for longer than the TTL, was revoked, or etcd lost
    /// its data. Sent once per lease; a new lease is granted and the key
    /// written again (with back-off).
    LeaseLost {
        /// The lease that is gone.
        lease: i64,
    },
    /// etcd could not be reached; retrying.
    Unreachable {
        /// What failed.
        error: String,
    },
    /// The key is held by another process (two prefills started with one
    /// engine id): not overwritten. Sent once per owner; the registration
    /// watches the key and claims it when it is free.
    Contested {
        /// The key.
        key: String,
        /// Who holds it, as its record says (escaped).
        owner: String,
    },
}

/// A prefill's key, kept under a lease: written at start, its lease kept
/// alive every TTL/3, written again under a new lease whenever the old one
/// is found gone, deleted by [`EtcdRegistration::stop`].
///
/// etcd never brings an expired lease back: after a freeze or an etcd
/// outage longer than the TTL, or an etcd restarted with an empty data
/// directory, `LeaseKeepAlive` answers `lease not found` for ever. So that
/// answer (and a reply with no time left, and a put refused for its lease)
/// is not retried: the registration takes a new lease and writes the key
/// again, with the same back-off as a failure.
pub struct EtcdRegistration {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl EtcdRegistration {
    /// Registers `member` as `<prefix><engine id>` with a lease of `ttl`
    /// (whole seconds, at least 1), keeping it alive until
    /// [`EtcdRegistration::stop`]. Each change is sent on `events`.
    pub fn start(
        options: EtcdOptions,
        member: Member,
        ttl: Duration,
        events: mpsc::UnboundedSender<RegistrationEvent>,
    ) -> EtcdRegistration {
        let stop = CancellationToken::new();
        let task = tokio::spawn(register_loop(options, member, ttl, events, stop.clone()));
        EtcdRegistration { stop, task }
    }

    /// The key `member` registers under.
    pub fn key(prefix: &str, member: &Member) -> String {
        format!("{prefix}{}", member.engine_id)
    }

    /// Stops the keep-alive, then deletes the key and revokes the lease,
    /// so decoders retire the engine before its side channel closes.
    /// Only a key this registration holds (under its lease) is deleted: a
    /// contested key stays its owner's. Bounded by the options' timeout.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Why keeping the registration stopped.
#[derive(Debug)]
enum Lapse {
    /// The lease is gone: register again under a new one.
    LeaseLost(i64),
    /// Another process holds the key: wait for it to be free, then claim
    /// it under a new lease.
    Contested {
        /// Who holds it, as its record says (escaped).
        owner: String,
        /// The store's revision when the key was found held: the wait
        /// watches the key from the next one.
        revision: i64,
    },
    /// Anything else: reconnect and retry the same lease.
    Failed(String),
}

/// Writes `member` under `key` with `lease`, only where the key is free
/// or holds this very process's record (a put of ours whose answer was
/// lost): never over another process's record (two prefills started with
/// one engine id). One transaction each, so of two claimants at once
/// exactly one wins.
async fn claim(
    c: &mut Client,
    key: &str,
    member: &Member,
    lease: i64,
    timeout: Duration,
) -> Result<(), Lapse> {
    let put = || {
        TxnOp::put(
            key,
            member.to_json(),
            Some(PutOptions::new().with_lease(lease)),
        )
    };
    let free = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([put()])
        .or_else([TxnOp::get(key, None)]);
    let r = match tokio::time::timeout(timeout, c.txn(free)).await {
        Err(_) => return Err(Lapse::Failed("claiming the key timed out".into())),
        Ok(Err(e)) if lease_gone(&e) => return Err(Lapse::LeaseLost(lease)),
        Ok(Err(e)) => return Err(Lapse::Failed(format!("claiming the key: {e}"))),
        Ok(Ok(r)) => r,
    };
    if r.succeeded() {
        return Ok(());
    }
    let revision = r.header().map_or(0, |h| h.revision());
    let held = r.op_responses().into_iter().find_map(|op| match op {
        etcd_client::TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.mod_revision())),
        _ => None,
    });
    let Some((value, mod_revision)) = held else {
        // Deleted between the compare and the read: free now.
        return Err(Lapse::Failed("the key changed while it was claimed".into()));
    };
    match Member::from_json(&value) {
        Ok(owner) if owner == *member => {
            // Our own record under an older lease of ours: take it over,
            // unless it changed since it was read.
            let mine = Txn::new()
                .when([Compare::mod_revision(key, CompareOp::Equal, mod_revision)])
                .and_then([put()]);
            match tokio::time::timeout(timeout, c.txn(mine)).await {
                Ok(Ok(r)) if r.succeeded() => Ok(()),
                Ok(Err(e)) if lease_gone(&e) => Err(Lapse::LeaseLost(lease)),
                _ => Err(Lapse::Failed("the key changed while it was claimed".into())),
            }
        }
        Ok(owner) => Err(Lapse::Contested {
            owner: format!(
                "engine {} at {} incarnation {}",
                crate::text::Escaped(&owner.engine_id),
                crate::text::Escaped(&owner.address),
                owner
                    .incarnation
                    .map_or_else(|| "unknown".to_string(), |i| format!("{i:#018x}"))
            ),
            revision,
        }),
        Err(e) => Err(Lapse::Contested {
            owner: format!("a record that is not a member ({e})"),
            revision,
        }),
    }
}

/// Waits until `key` may be free: a deletion (or any change) of it after
/// `revision`, or `at_most` (a watch that cannot start, or a change
/// missed, costs no more than that).
async fn until_changed(c: &mut Client, key: &str, revision: i64, at_most: Duration) {
    let wait = async {
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let Ok(mut stream) = c.watch(key, Some(options)).await else {
            return std::future::pending::<()>().await;
        };
        loop {
            match stream.message().await {
                Ok(Some(m)) if m.events().is_empty() && !m.canceled() => continue,
                Ok(Some(_)) => return,
                _ => return std::future::pending().await,
            }
        }
    };
    let _ = tokio::time::timeout(at_most, wait).await;
}

/// etcd says the lease does not exist: etcd-client's own check of the
/// first keep-alive reply (`lease not found`), or etcd's `requested lease
/// not found` (a put or a keep-alive on a lease that expired or was
/// revoked).
fn lease_gone(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        other => grpc(other).is_some_and(|(code, m)| {
            code == tonic::Code::NotFound && m.contains("lease not found")
        }),
    }
}

async fn register_loop(
    options: EtcdOptions,
    member: Member,
    ttl: Duration,
    events: mpsc::UnboundedSender<RegistrationEvent>,
    stop: CancellationToken,
) {
    let key = EtcdRegistration::key(&options.prefix, &member);
    let ttl_secs = ttl.as_secs().max(1) as i64;
    let period = Duration::from_millis((ttl_secs as u64 * 1000 / 3).max(100));
    let mut backoff = Backoff::new(options.min_backoff, options.max_backoff.min(period));
    let mut lease: Option<i64> = None;
    let mut client: Option<Client> = None;
    let mut last_error: Option<String> = None;
    // The last lapse was a lost lease (no keep-alive answered since).
    let mut lost_last = false;
    // Who held the key when it was last found held (said once per owner).
    let mut contested_by: Option<String> = None;
    loop {
        if stop.is_cancelled() {
            break;
        }
        let lapse = tokio::select! {
            _ = stop.cancelled() => break,
            lapse = keep_registered(&options, &member, &key, ttl_secs, period, &mut client, &mut lease, &mut backoff, &events) => lapse,
        };
        if let Lapse::Contested { owner, revision } = lapse {
            if contested_by.as_deref() != Some(owner.as_str()) {
                tracing::warn!(%key, %owner, "etcd: the key is held by another process (one engine id for two prefills?): not overwriting it; claiming it when it is free");
                let _ = events.send(RegistrationEvent::Contested {
                    key: key.clone(),
                    owner: owner.clone(),
                });
                contested_by = Some(owner);
            }
            let Some(c) = client.as_mut() else { continue };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = until_changed(c, &key, revision, period) => {}
            }
            continue;
        }
        if let Lapse::LeaseLost(_) = lapse {
            // etcd answered: an outage before this is over, so the new
            // lease is asked for at once (within the TTL the decoders'
            // grace period allows after a store reset); only leases lost
            // again and again back off.
            if !lost_last {
                backoff.reset();
            }
        }
        lost_last = matches!(lapse, Lapse::LeaseLost(_));
        let pause = backoff.step();
        match lapse {
            Lapse::LeaseLost(id) => {
                // Once per lease: `lease` is cleared here, and a new one
                // is granted before anything can be lost again.
                lease = None;
                last_error = None;
                tracing::warn!(%key, lease = id, retry_in_ms = pause.as_millis() as u64, "etcd: lease lost (expired, revoked or etcd lost its data): registering again under a new lease");
                let _ = events.send(RegistrationEvent::LeaseLost { lease: id });
            }
            // Waited for above, without a back-off.
            Lapse::Contested { .. } => {}
            Lapse::Failed(error) => {
                client = None;
                if last_error.as_deref() != Some(&error) {
                    let _ = events.send(RegistrationEvent::Unreachable {
                        error: error.clone(),
                    });
                    last_error = Some(error.clone());
                }
                if backoff.failures.is_power_of_two() {
                    tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "etcd registration: retrying");
                } else {
                    tracing::debug!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "etcd registration: retrying");
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
    // Graceful stop: the key goes first, then the lease; only the key as
    // this registration holds it (under its lease). A contested key is its
    // owner's, and a key written by another process after this one's lease
    // was lost is that process's: deleting either would retire a live
    // prefill.
    let Some(l) = lease else {
        tracing::info!(%key, "etcd registration stopped: it held no key, nothing deleted");
        return;
    };
    let cleanup = async {
        let mut c = match client {
            Some(c) => c,
            None => options.connect().await.map_err(|e| e.to_string())?,
        };
        let ours = Txn::new()
            .when([Compare::lease(key.as_str(), CompareOp::Equal, l)])
            .and_then([TxnOp::delete(key.as_str(), None)]);
        c.txn(ours).await.map_err(|e| e.to_string())?;
        let _ = c.lease_revoke(l).await;
        Ok::<(), String>(())
    };
    match tokio::time::timeout(options.timeout, cleanup).await {
        Ok(Ok(())) => tracing::info!(%key, "etcd registration deleted"),
        Ok(Err(e)) => {
            tracing::warn!(%key, error = %e, "etcd registration not deleted; its lease will expire")
        }
        Err(_) => tracing::warn!(%key, "etcd registration delete timed out; its lease will expire"),
    }
}

/// Writes the key if needed (a new lease, then the put) and keeps its lease
/// alive; returns why it stopped. The back-off is reset by each keep-alive
/// that etcd answers with time left, so a lease lost again and again backs
/// off like any failure.
#[allow(clippy::too_many_arguments)]
async fn keep_registered(
    options: &EtcdOptions,
    member: &Member,
    key: &str,
    ttl_secs: i64,
    period: Duration,
    client: &mut Option<Client>,
    lease: &mut Option<i64>,
    backoff: &mut Backoff,
    events: &mpsc::UnboundedSender<RegistrationEvent>,
) -> Lapse {
    let timeout = options.timeout;
    let failed = |what: &str, e: etcd_client::Error| Lapse::Failed(format!("{what}: {e}"));
    if client.is_none() {
        match options.connect().await {
            Ok(c) => *client = Some(c),
            Err(e) => return failed(&format!("connect to {:?}", options.endpoints), e),
        }
    }
    let c = client.as_mut().expect("set above");
    let id = match *lease {
        Some(id) => id,
        None => {
            let granted = match tokio::time::timeout(timeout, c.lease_grant(ttl_secs, None)).await {
                Err(_) => return Lapse::Failed("lease grant timed out".into()),
                Ok(Err(e)) => return failed("lease grant", e),
                Ok(Ok(g)) => g,
            };
            let id = granted.id();
            // Set before the claim: a stop that interrupts it still
            // deletes the key if the claim went through (the delete
            // compares the key's lease with this one).
            *lease = Some(id);
            if let Err(lapse) = claim(c, key, member, id, timeout).await {
                // Not ours to keep: the lease would only hold nothing (and
                // a claim whose answer was lost goes with it).
                *lease = None;
                let _ = tokio::time::timeout(timeout, c.lease_revoke(id)).await;
                return lapse;
            }
            tracing::info!(%key, lease = id, ttl_secs, "etcd: registered");
            let _ = events.send(RegistrationEvent::Registered {
                key: key.to_string(),
                lease: id,
            });
            id
        }
    };
    let (mut keeper, mut stream) = match tokio::time::timeout(timeout, c.lease_keep_alive(id)).await
    {
        Err(_) => return Lapse::Failed("lease keep-alive timed out".into()),
        Ok(Err(e)) if lease_gone(&e) => return Lapse::LeaseLost(id),
        Ok(Err(e)) => return failed("lease keep-alive", e),
        Ok(Ok(k)) => k,
    };
    // The first keep-alive was answered with time left (etcd-client checks).
    backoff.reset();
    loop {
        tokio::time::sleep(period).await;
        if let Err(e) = keeper.keep_alive().await {
            return failed("lease keep-alive", e);
        }
        let reply = match tokio::time::timeout(timeout, stream.message()).await {
            Err(_) => return Lapse::Failed("lease keep-alive reply timed out".into()),
            Ok(Err(e)) if lease_gone(&e) => return Lapse::LeaseLost(id),
            Ok(Err(e)) => return failed("lease keep-alive", e),
            Ok(Ok(r)) => r,
        };
        match reply {
            None => return Lapse::Failed("etcd closed the keep-alive stream".into()),
            // Expired while we were away (frozen, or etcd was down for
            // longer than the TTL), or revoked.
            Some(r) if r.ttl() <= 0 => return Lapse::LeaseLost(id),
            Some(_) => backoff.reset(),
        }
    }
}
