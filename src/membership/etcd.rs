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

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

pub use etcd_client;
use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, KvClient, PutOptions, WatchOptions,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Member, MembershipSource, SourceEvent};

/// Where etcd is and how to talk to it.
#[derive(Clone, Debug)]
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
}

impl MembershipSource for EtcdSource {
    async fn next(&mut self) -> Option<SourceEvent> {
        self.rx.recv().await
    }
}

impl EtcdSource {
    /// Starts watching (in a task that runs until `shutdown`).
    pub fn spawn(options: EtcdOptions, shutdown: CancellationToken) -> EtcdSource {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(watch_loop(options, tx, shutdown));
        EtcdSource { rx }
    }
}

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
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(options.min_backoff, options.max_backoff);
    let mut in_outage = false;
    loop {
        let end = tokio::select! {
            _ = shutdown.cancelled() => return,
            end = watch_round(&options, &tx, &mut backoff, &mut in_outage) => end,
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
    entries: Vec<(String, Vec<u8>)>,
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
            for kv in page.kvs() {
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
                    return Ok(Listing {
                        revision,
                        cluster_id,
                        entries,
                    })
                }
            }
        }
    }
}

/// One connection: list, then watch until something breaks.
async fn watch_round(
    options: &EtcdOptions,
    tx: &mpsc::UnboundedSender<SourceEvent>,
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
    let watch = client
        .watch_client()
        .max_decoding_message_size(options.max_message)
        .watch(
            options.prefix.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(listing.revision + 1)
                    .with_progress_notify()
                    .with_fragment(),
            ),
        )
        .await;
    let mut stream = match watch {
        Ok(s) => s,
        Err(e) => return RoundEnd::Unreachable(format!("starting the watch: {e}")),
    };
    // Listed only once the watch is in place: nothing between the two is
    // lost, since the watch starts at the list's revision + 1.
    let listed = SourceEvent::Listed {
        revision: listing.revision,
        cluster_id: listing.cluster_id,
        entries: listing.entries,
    };
    if tx.send(listed).is_err() {
        return RoundEnd::Stop;
    }
    *in_outage = false;
    backoff.reset();
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
        // Every event, in order, whatever its revision: one transaction's
        // events share theirs.
        for event in message.events() {
            let Some(kv) = event.kv() else { continue };
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
    }
}

/// What a prefill's registration reports.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// Bounded by the options' timeout.
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
    /// Anything else: reconnect and retry the same lease.
    Failed(String),
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
    loop {
        if stop.is_cancelled() {
            break;
        }
        let lapse = tokio::select! {
            _ = stop.cancelled() => break,
            lapse = keep_registered(&options, &member, &key, ttl_secs, period, &mut client, &mut lease, &mut backoff, &events) => lapse,
        };
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
    // Graceful stop: the key goes first, then the lease.
    let cleanup = async {
        let mut c = match client {
            Some(c) => c,
            None => options.connect().await.map_err(|e| e.to_string())?,
        };
        c.delete(key.as_str(), None)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(l) = lease {
            let _ = c.lease_revoke(l).await;
        }
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
            let put = c.put(
                key,
                member.to_json(),
                Some(PutOptions::new().with_lease(id)),
            );
            match tokio::time::timeout(timeout, put).await {
                Err(_) => return Lapse::Failed("put timed out".into()),
                Ok(Err(e)) if lease_gone(&e) => return Lapse::LeaseLost(id),
                Ok(Err(e)) => return failed("put", e),
                Ok(Ok(_)) => {}
            }
            *lease = Some(id);
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
