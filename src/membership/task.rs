//! The driver: a source's events through the reconciler into the
//! service's handle, with the refusal log, resolved addresses and the
//! metrics.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::driver::handle::KeepaliveHandle;
use crate::event::{Event, ReleaseReason};
use crate::registration::GoneMode;
use crate::text::Escaped;
use crate::transport::{EngineId, PeerAddr};

use super::reconciler::{Decision, MembershipSource, Reconciler, RetireWhy, SourceEvent};
use super::refusals;
use super::schema::{Member, SchemaError};

/// What the driver tells the decoder runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MembershipUpdate {
    /// A prefill engine joined: handshake with it.
    Joined(Member),
    /// A prefill engine left; `peer_gone` has been sent for it.
    Left {
        /// The engine as its key last said.
        member: Member,
        /// Why.
        why: RetireWhy,
    },
    /// A record broke the schema: counted, the key unchanged. Reported at
    /// a bounded rate (a burst of [`REFUSALS_BURST`](super::REFUSALS_BURST), then one per
    /// [`REFUSALS_PERIOD`](super::REFUSALS_PERIOD)); the others are only counted.
    BadValue {
        /// The key (print it with [`Escaped`]: it may hold anything).
        key: String,
        /// What was wrong.
        error: SchemaError,
        /// Refused records since the previous `BadValue` that were
        /// counted but not reported.
        unreported: u64,
    },
    /// The membership plane is unavailable (unreachable, or its prefix
    /// cannot be listed): nothing is retired until it is back. Sent once
    /// per outage.
    Outage {
        /// What failed first.
        error: String,
    },
    /// The watch is back and the prefix was reconciled.
    Restored {
        /// How long the outage lasted.
        outage: Duration,
    },
    /// The store was reset (see the module docs): the engines it lacks are
    /// kept for `grace`, and retired only if still missing then.
    StoreReset {
        /// Engines awaited.
        awaited: usize,
        /// How long they may take to register again.
        grace: Duration,
    },
    /// An engine retired by membership was released by the service.
    Released {
        /// The engine.
        engine: EngineId,
        /// From seeing its key's deletion (or replacement) to the release.
        after: Duration,
        /// The release's reason (`peer_gone`, or another input that was
        /// faster, such as `unreachable`).
        reason: ReleaseReason,
    },
}

/// How the driver retires engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MembershipConfig {
    /// What a removal does to reads in flight (default: drain).
    pub gone_mode: GoneMode,
    /// After a store reset, how long the engines the new store lacks may
    /// take to register again before they are retired. Set it to the
    /// prefills' lease TTL (default 10 s, the prefill's default
    /// `--etcd-ttl` and Dynamo's lease).
    pub reset_grace: Duration,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            gone_mode: GoneMode::Drain,
            reset_grace: Duration::from_secs(10),
        }
    }
}

/// Metric names (Prometheus).
mod metric {
    /// Gauge: 1 while the watch is up (listed and watching), else 0.
    pub(crate) const WATCH_UP: &str = "nixl_keepalive_membership_watch_up";
    /// Counter: outages of the membership plane.
    pub(crate) const OUTAGES: &str = "nixl_keepalive_membership_outages_total";
    /// Counter: full lists of the prefix (start, compaction, outage end).
    pub(crate) const LISTS: &str = "nixl_keepalive_membership_lists_total";
    /// Gauge: engines the membership plane lists now.
    pub(crate) const MEMBERS: &str = "nixl_keepalive_membership_members";
    /// Counter `{why}`: engines retired (deleted, replaced,
    /// missing_from_list, missing_after_reset).
    pub(crate) const RETIRED: &str = "nixl_keepalive_membership_retired_total";
    /// Counter: engines announced.
    pub(crate) const JOINED: &str = "nixl_keepalive_membership_joined_total";
    /// Counter `{reason}`: records refused (see [`super::SchemaError::reason`]).
    pub(crate) const BAD_VALUES: &str = "nixl_keepalive_membership_bad_values_total";
    /// Counter: store resets (another store epoch or cluster id, or the
    /// revision went back).
    pub(crate) const STORE_RESETS: &str = "nixl_keepalive_membership_store_resets_total";
    /// Gauge: engines kept after a store reset, awaiting their new record.
    pub(crate) const AWAITED: &str = "nixl_keepalive_membership_awaited";
    /// Histogram: from seeing a removal to the engine's release, seconds.
    pub(crate) const DELETION_TO_RELEASE: &str =
        "nixl_keepalive_membership_deletion_to_release_seconds";
}

/// Starts the driver: reads `source`, retires engines through `handle`
/// in `config.gone_mode`, and sends [`MembershipUpdate`]s to the returned
/// receiver until `shutdown` or the source ends. Updates are sent whether
/// or not anyone reads them (an unbounded channel: one per change).
pub fn spawn<S: MembershipSource, R: Send + 'static>(
    source: S,
    handle: KeepaliveHandle<R>,
    config: MembershipConfig,
    shutdown: CancellationToken,
) -> (
    mpsc::UnboundedReceiver<MembershipUpdate>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    // Subscribed before the first removal can be applied, so no release
    // is missed.
    let events = handle.subscribe();
    let task = tokio::spawn(drive(source, handle, events, config, tx, shutdown));
    (rx, task)
}

async fn drive<S: MembershipSource, R: Send + 'static>(
    mut source: S,
    handle: KeepaliveHandle<R>,
    mut events: broadcast::Receiver<Event>,
    config: MembershipConfig,
    updates: mpsc::UnboundedSender<MembershipUpdate>,
    shutdown: CancellationToken,
) {
    let mut reconciler = Reconciler::with_prefix(source.prefix());
    // Engines retired by membership, waiting for their release.
    let mut pending: HashMap<EngineId, Instant> = HashMap::new();
    let mut outage_since: Option<Instant> = None;
    // When the grace period after a store reset ends.
    let mut grace_until: Option<Instant> = None;
    let mut refusals = refusals::RefusalLog::new(Instant::now());
    let mut resolved = Resolved::default();
    metrics::gauge!(metric::WATCH_UP).set(0.0);
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = source.next() => match e {
                Some(e) => e,
                None => break,
            },
            _ = sleep_until_some(grace_until) => {
                grace_until = None;
                let actions = reconciler.end_reset_grace();
                tracing::info!(retired = actions.len(), "membership: store reset's grace period over");
                for action in actions {
                    carry_out(action, &handle, &config, &mut pending, &mut refusals, &mut resolved, &updates).await;
                }
                set_member_gauges(&reconciler);
                continue;
            }
            e = events.recv() => {
                match e {
                    Ok(Event::Released { engine, reason, .. }) => {
                        let seen = pending.remove(&engine);
                        crate::shrink::after_removal(&mut pending);
                        if let Some(seen) = seen {
                            let after = seen.elapsed();
                            metrics::histogram!(metric::DELETION_TO_RELEASE).record(after.as_secs_f64());
                            let _ = updates.send(MembershipUpdate::Released { engine, after, reason });
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "membership: service events missed; deletion-to-release times may be lost");
                        // Forget entries whose engine is gone already.
                        pending.retain(|e, _| handle.engine(e).is_some());
                        crate::shrink::after_removal(&mut pending);
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
                continue;
            }
        };
        let listed = matches!(event, SourceEvent::Listed { .. });
        match &event {
            SourceEvent::Outage { error } => {
                // The grace period waits for the store: it starts again
                // with the next list.
                grace_until = None;
                if outage_since.is_none() {
                    outage_since = Some(Instant::now());
                    metrics::gauge!(metric::WATCH_UP).set(0.0);
                    metrics::counter!(metric::OUTAGES).increment(1);
                    tracing::warn!(%error, "membership plane unavailable: keeping every engine until it is back");
                    let _ = updates.send(MembershipUpdate::Outage {
                        error: error.clone(),
                    });
                }
                continue;
            }
            SourceEvent::Listed { .. } => {
                metrics::counter!(metric::LISTS).increment(1);
                metrics::gauge!(metric::WATCH_UP).set(1.0);
                if let Some(since) = outage_since.take() {
                    let outage = since.elapsed();
                    tracing::info!(
                        outage_ms = outage.as_millis() as u64,
                        "membership plane back: reconciling"
                    );
                    let _ = updates.send(MembershipUpdate::Restored { outage });
                }
            }
            _ => {}
        }
        for action in reconciler.apply(event) {
            carry_out(
                action,
                &handle,
                &config,
                &mut pending,
                &mut refusals,
                &mut resolved,
                &updates,
            )
            .await;
        }
        if listed {
            grace_until = reset_grace_deadline(&reconciler, &config);
        }
        set_member_gauges(&reconciler);
    }
    metrics::gauge!(metric::WATCH_UP).set(0.0);
}

/// The addresses of announced records, resolved when they were announced
/// ([`PeerAddr::resolve`], as the runtime resolves them to handshake):
/// a record's departure names the address its engine was registered at,
/// even if the name no longer resolves (a pod and its DNS entry go away
/// together).
#[derive(Default)]
struct Resolved(HashMap<(String, String), PeerAddr>);

impl Resolved {
    async fn announce(&mut self, member: &Member) {
        let address = match PeerAddr::resolve(&member.address).await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(address = %Escaped(&member.address), error = %e, "membership: a record's address does not resolve to one address; compared as written");
                member.peer_addr()
            }
        };
        if self.0.len() >= MAX_RESOLVED {
            self.0.clear();
        }
        self.0
            .insert((member.engine_id.clone(), member.address.clone()), address);
    }

    fn departed(&mut self, member: &Member) -> PeerAddr {
        let address = self
            .0
            .remove(&(member.engine_id.clone(), member.address.clone()))
            .unwrap_or_else(|| member.peer_addr());
        crate::shrink::after_removal(&mut self.0);
        address
    }
}

/// The most resolved addresses remembered (a hostile plane writing
/// endless records cannot grow it without bound).
const MAX_RESOLVED: usize = 1 << 16;

/// One action of the reconciler, carried out.
async fn carry_out<R: Send + 'static>(
    action: Decision,
    handle: &KeepaliveHandle<R>,
    config: &MembershipConfig,
    pending: &mut HashMap<EngineId, Instant>,
    refusals: &mut refusals::RefusalLog,
    resolved: &mut Resolved,
    updates: &mpsc::UnboundedSender<MembershipUpdate>,
) {
    match action {
        Decision::Announce(member) => {
            resolved.announce(&member).await;
            metrics::counter!(metric::JOINED).increment(1);
            tracing::info!(engine = %member.engine_id, address = %member.address, ranks = member.ranks, "membership: engine joined");
            let _ = updates.send(MembershipUpdate::Joined(member));
        }
        Decision::Retire { member, why } => {
            let engine = member.engine();
            metrics::counter!(metric::RETIRED, "why" => why.as_str()).increment(1);
            tracing::info!(%engine, address = %Escaped(&member.address), why = why.as_str(), "membership: record gone: the service retires its engine if it is that registration's own");
            if handle.engine(&engine).is_some() {
                pending.entry(engine.clone()).or_insert_with(Instant::now);
            }
            let address = resolved.departed(&member);
            if handle
                .member_gone(member.departure(address), config.gone_mode)
                .is_err()
            {
                // A stopped service released or handed back every engine:
                // nothing is left to retire (the loop ends when the
                // service's events close).
                tracing::debug!(%engine, "membership: the service has stopped; nothing to retire");
            }
            let _ = updates.send(MembershipUpdate::Left { member, why });
        }
        Decision::BadValue { key, error } => refused(key, error, refusals, updates),
        Decision::StoreReset { awaited } => {
            metrics::counter!(metric::STORE_RESETS).increment(1);
            tracing::warn!(
                awaited,
                grace_ms = config.reset_grace.as_millis() as u64,
                "membership plane was reset (another store epoch or cluster id, or its revision went back): the engines it lacks are kept for the grace period, none retired now"
            );
            let _ = updates.send(MembershipUpdate::StoreReset {
                awaited,
                grace: config.reset_grace,
            });
        }
    }
}

// Store resets: the grace period.

/// After a list: engines still awaited get (again) a whole grace period.
fn reset_grace_deadline(reconciler: &Reconciler, config: &MembershipConfig) -> Option<Instant> {
    (!reconciler.awaited().is_empty()).then(|| Instant::now() + config.reset_grace)
}

/// Sleeps until `deadline`; never resolves without one.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn set_member_gauges(reconciler: &Reconciler) {
    metrics::gauge!(metric::MEMBERS).set(reconciler.members().len() as f64);
    metrics::gauge!(metric::AWAITED).set(reconciler.awaited().len() as f64);
}

// Refused records.

/// A refused record: counted by reason; logged and reported at a bounded
/// rate, its key escaped and cut.
fn refused(
    key: String,
    error: SchemaError,
    refusals: &mut refusals::RefusalLog,
    updates: &mpsc::UnboundedSender<MembershipUpdate>,
) {
    metrics::counter!(metric::BAD_VALUES, "reason" => error.reason()).increment(1);
    if let Some(unreported) = refusals.refused(&key, &error.to_string(), Instant::now()) {
        tracing::warn!(key = %Escaped(&key), %error, reason = error.reason(), unreported, "membership: record refused; the key is treated as unchanged");
        let _ = updates.send(MembershipUpdate::BadValue {
            key,
            error,
            unreported,
        });
    }
}
