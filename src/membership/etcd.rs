//! etcd as the membership plane, with the `etcd-client` crate: the
//! decoder's watch ([`EtcdSource`]) and the prefill's lease-backed
//! registration ([`EtcdRegistration`]).
//!
//! The watch: connect, `get` the prefix ([`SourceEvent::Listed`] at the
//! response's revision), watch the prefix from that revision + 1. A watch
//! cancelled for a compacted start revision, a broken stream, a failed
//! connection or an unanswered keep-alive (etcd frozen) is an outage:
//! reported once, retried with a back-off that doubles up to
//! [`EtcdOptions::max_backoff`], each retry logged, and ended by a new list
//! of the prefix. Nothing here ever retires an engine on an error.

use std::time::Duration;

pub use etcd_client;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
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
    /// Connect timeout, and the per-request timeout of `get`, `put` and
    /// lease calls.
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
}

impl EtcdOptions {
    /// Defaults for `endpoints` under `prefix`: 2 s timeouts, 10 s
    /// keep-alive, back-off from 100 ms to 2 s.
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>) -> Self {
        EtcdOptions {
            endpoints,
            prefix: prefix.into(),
            timeout: Duration::from_secs(2),
            keep_alive: Duration::from_secs(10),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
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

/// Doubling back-off with a cap. Warnings back off too: one at failures
/// 1, 2, 4, 8, ... of an outage, the others at debug level.
struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            next: min,
            min,
            max,
            failures: 0,
        }
    }

    fn reset(&mut self) {
        self.next = self.min;
        self.failures = 0;
    }

    fn step(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        self.failures += 1;
        d
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
    /// A failure: report an outage (if not already) and retry.
    Failed(String),
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
        match end {
            RoundEnd::Stop => return,
            RoundEnd::Compacted(rev) => {
                tracing::warn!(
                    compact_revision = rev,
                    "etcd watch fell behind a compaction: listing the prefix again"
                );
            }
            RoundEnd::Failed(error) => {
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
                    tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "etcd unreachable: engines kept, retrying");
                } else {
                    tracing::debug!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "etcd unreachable: engines kept, retrying");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
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
    let mut client = match options.connect().await {
        Ok(c) => c,
        Err(e) => return RoundEnd::Failed(format!("connect to {:?}: {e}", options.endpoints)),
    };
    let listed = tokio::time::timeout(
        options.timeout,
        client.get(
            options.prefix.as_str(),
            Some(GetOptions::new().with_prefix()),
        ),
    )
    .await;
    let listed = match listed {
        Err(_) => return RoundEnd::Failed("listing the prefix timed out".into()),
        Ok(Err(e)) => return RoundEnd::Failed(format!("listing the prefix: {e}")),
        Ok(Ok(r)) => r,
    };
    let Some(revision) = listed.header().map(|h| h.revision()) else {
        return RoundEnd::Failed("list response without a header".into());
    };
    let entries = listed
        .kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
            )
        })
        .collect();
    let watch = client
        .watch(
            options.prefix.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1)
                    .with_progress_notify(),
            ),
        )
        .await;
    let mut stream = match watch {
        Ok(s) => s,
        Err(e) => return RoundEnd::Failed(format!("starting the watch: {e}")),
    };
    // Listed only once the watch is in place: nothing between the two is
    // lost, since the watch starts at the list's revision + 1.
    if tx.send(SourceEvent::Listed { revision, entries }).is_err() {
        return RoundEnd::Stop;
    }
    *in_outage = false;
    backoff.reset();
    loop {
        let message = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return RoundEnd::Failed("etcd closed the watch".into()),
            Err(e) => return RoundEnd::Failed(format!("watch: {e}")),
        };
        if message.canceled() {
            if message.compact_revision() > 0 {
                return RoundEnd::Compacted(message.compact_revision());
            }
            return RoundEnd::Failed(format!("watch cancelled: {}", message.cancel_reason()));
        }
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
    /// The lease had expired (the process was frozen, or etcd was away
    /// longer than the TTL): a new one is taken and the key written again.
    LeaseLost {
        /// The lease that expired.
        lease: i64,
    },
    /// etcd could not be reached; retrying.
    Unreachable {
        /// What failed.
        error: String,
    },
}

/// A prefill's key, kept under a lease: written at start, its lease kept
/// alive every TTL/3, written again under a new lease when the old one is
/// found expired, deleted by [`EtcdRegistration::stop`].
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
    loop {
        if stop.is_cancelled() {
            break;
        }
        let result = tokio::select! {
            _ = stop.cancelled() => break,
            r = keep_registered(&options, &member, &key, ttl_secs, period, &mut client, &mut lease, &events) => r,
        };
        // Only errors come back: the keep-alive runs until one.
        let error = match result {
            Ok(()) => {
                backoff.reset();
                last_error = None;
                continue;
            }
            Err(e) => e,
        };
        client = None;
        if last_error.as_deref() != Some(&error) {
            let _ = events.send(RegistrationEvent::Unreachable {
                error: error.clone(),
            });
            last_error = Some(error.clone());
        }
        let pause = backoff.step();
        if backoff.failures.is_power_of_two() {
            tracing::warn!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "etcd registration: retrying");
        } else {
            tracing::debug!(%error, retry_in_ms = pause.as_millis() as u64, failures = backoff.failures, "etcd registration: retrying");
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

/// Writes the key if needed and keeps its lease alive; returns on the
/// first error.
#[allow(clippy::too_many_arguments)]
async fn keep_registered(
    options: &EtcdOptions,
    member: &Member,
    key: &str,
    ttl_secs: i64,
    period: Duration,
    client: &mut Option<Client>,
    lease: &mut Option<i64>,
    events: &mpsc::UnboundedSender<RegistrationEvent>,
) -> Result<(), String> {
    let timeout = options.timeout;
    if client.is_none() {
        *client = Some(
            options
                .connect()
                .await
                .map_err(|e| format!("connect to {:?}: {e}", options.endpoints))?,
        );
    }
    let c = client.as_mut().expect("set above");
    let id = match *lease {
        Some(id) => id,
        None => {
            let granted = tokio::time::timeout(timeout, c.lease_grant(ttl_secs, None))
                .await
                .map_err(|_| "lease grant timed out".to_string())
                .and_then(|r| r.map_err(|e| format!("lease grant: {e}")))?;
            let id = granted.id();
            tokio::time::timeout(
                timeout,
                c.put(
                    key,
                    member.to_json(),
                    Some(PutOptions::new().with_lease(id)),
                ),
            )
            .await
            .map_err(|_| "put timed out".to_string())
            .and_then(|r| r.map_err(|e| format!("put: {e}")))?;
            *lease = Some(id);
            tracing::info!(%key, lease = id, ttl_secs, "etcd: registered");
            let _ = events.send(RegistrationEvent::Registered {
                key: key.to_string(),
                lease: id,
            });
            id
        }
    };
    let (mut keeper, mut stream) = tokio::time::timeout(timeout, c.lease_keep_alive(id))
        .await
        .map_err(|_| "lease keep-alive timed out".to_string())?
        .map_err(|e| format!("lease keep-alive: {e}"))?;
    loop {
        keeper
            .keep_alive()
            .await
            .map_err(|e| format!("lease keep-alive: {e}"))?;
        let reply = tokio::time::timeout(timeout, stream.message())
            .await
            .map_err(|_| "lease keep-alive reply timed out".to_string())?
            .map_err(|e| format!("lease keep-alive: {e}"))?;
        match reply {
            None => return Err("etcd closed the keep-alive stream".into()),
            Some(r) if r.ttl() <= 0 => {
                // Expired while we were away (frozen, or etcd was down for
                // longer than the TTL): register again under a new lease.
                tracing::warn!(%key, lease = id, "etcd: lease expired; registering again");
                let _ = events.send(RegistrationEvent::LeaseLost { lease: id });
                *lease = None;
                return Ok(());
            }
            Some(_) => {}
        }
        tokio::time::sleep(period).await;
    }
}
