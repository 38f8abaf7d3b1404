//! The read path: one request under its guard and lease, posted, polled,
//! checked and reported ([`super::Decoder::read`], [`super::Decoder::write`]),
//! and a given-up read's landing slot watched until it may be reused.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use nixl_agent::{NixlStatus, XferState};
use nixl_keepalive::LeaseError;
use nixl_keepalive::{Destination, GiveUp, GivenUpRead};

use super::connect::Connected;
use super::remote::RemoteEngine;
use super::stats::count;
use super::transfer::{Direction, ReadOutcome, Target};
use super::Decoder;

impl Decoder {
    /// One request: a read of `block` of `rank`, as vLLM's decode does it.
    /// Under a read guard (refused at once when the engine is not live),
    /// the request gets a fresh id, which is leased (the service's
    /// heartbeats name it) from now until its read has ended; the read is
    /// posted and polled on a blocking thread (`RQ:` before it, `RD:` on
    /// completion, see the [protocol](crate::pd)), its outcome counted, its
    /// status reported to the service, and then the lease is removed. No
    /// lease outlives its read, so heartbeats name exactly the requests
    /// still pending.
    ///
    /// A read given up in progress (timed out, or failed by the service)
    /// ends its guard with [`nixl_keepalive::TransferGuard::give_up`]: not a
    /// completion, and for a time-out the service's evidence of a hung
    /// prefill. Its landing slot stays lent until the service says the
    /// transfer is over ([`Destination::Reusable`]), else for good.
    ///
    /// Every count is made before the guard ends: whoever sees the engine
    /// released (the last guard's end releases it) sees the read counted.
    pub async fn read(&self, connected: &Connected, rank: u16, block: u32) -> ReadOutcome {
        let at = Target { rank, block };
        self.transfer(connected, Direction::Read, at).await
    }

    /// Writes block `block` of rank `rank` of a push-mode decode (see the
    /// module docs): as [`Decoder::read`], with a write guard
    /// ([`EngineRef::begin_write_owned`](nixl_keepalive::EngineRef::begin_write_owned)), the request leased at the
    /// decode and renewed by this process's keepalive until the write
    /// ends. [`ReadOutcome::Written`] when NIXL said DONE; the decode
    /// checks the bytes.
    pub async fn write(&self, connected: &Connected, rank: u16, block: u32) -> ReadOutcome {
        let at = Target { rank, block };
        self.transfer(connected, Direction::Write, at).await
    }

    pub(super) async fn transfer(
        &self,
        connected: &Connected,
        direction: Direction,
        at: Target,
    ) -> ReadOutcome {
        let begun = match direction {
            Direction::Read => connected.engine.begin_read_owned(),
            Direction::Write => connected.engine.begin_write_owned(),
        };
        let guard = match begun {
            Ok(g) => g,
            Err(_) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return ReadOutcome::Released;
            }
        };
        let request = self.next_request_id();
        let engine = connected.remote.engine.clone();
        match self
            .handle
            .add_leases(&engine, vec![request.clone()], false)
        {
            Ok(()) => {}
            // Stopping: nothing renews leases any more, and the read's
            // engine is released or handed back.
            Err(LeaseError::Stopped(_)) => {
                tracing::debug!("lease not added: the service has stopped")
            }
            // Our own ids (`<decode agent>-<n>`) are always valid.
            Err(e) => tracing::error!(error = %e, "lease not added"),
        }
        let remote = connected.remote.clone();
        let agent = self.transport.agent().clone();
        let timeout = self.options.read_timeout;
        let stats = self.stats.clone();
        let id = request.clone();
        let who = engine.clone();
        let (outcome, given_up) = tokio::task::spawn_blocking(move || {
            let outcome =
                remote.transfer_block(&agent, direction, &id, at, timeout, &|| guard.is_failed());
            count(&stats, &who, &id, at.rank, at.block, outcome);
            let given_up = match outcome {
                ReadOutcome::TimedOut { .. } => Some(guard.give_up_holding(GiveUp::TimedOut, 1)),
                ReadOutcome::Abandoned { .. } => Some(guard.give_up_holding(GiveUp::Cancelled, 1)),
                _ => {
                    match outcome.status() {
                        Some(status) => guard.finish(status),
                        None => drop(guard),
                    }
                    None
                }
            };
            (outcome, given_up)
        })
        .await
        .expect("reads do not panic");
        // A stopped service renews nothing: there is nothing to remove.
        let _ = self.handle.remove_leases(&engine, vec![request]);
        if let (Some(given_up), Some(slot)) = (given_up, outcome.lent_slot()) {
            self.reclaim_when_over(connected.remote.clone(), slot, given_up);
        }
        outcome
    }

    /// Watches a given-up read's transfer to its end (in a task: its
    /// request polled every few milliseconds, as `getXferStatus` must be
    /// for UCX to progress it): it completes when a frozen prefill resumes
    /// and fails when it dies. Then the service hears of its end (the
    /// engine is no longer fenced by it), its request is released and its
    /// landing slot handed back. A slot whose request is missing (never
    /// kept) is abandoned and retired unless the release proves it over.
    fn reclaim_when_over(&self, remote: Arc<RemoteEngine>, slot: usize, given_up: GivenUpRead) {
        let stats = self.stats.clone();
        stats.slots_lent.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let destination = match remote.take_running(slot) {
                Some(mut req) => {
                    let mut pause = Duration::from_millis(1);
                    let status = loop {
                        match req.status() {
                            Ok(XferState::InProgress) => {}
                            Ok(_) => break NixlStatus::SUCCESS,
                            Err(e) => break e.status,
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(20));
                    };
                    *stats
                        .given_up_ended
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(status.raw())
                        .or_default() += 1;
                    metrics::counter!("nixl_keepalive_pd_given_up_ended_total", "status" => status.name())
                        .increment(1);
                    tracing::info!(engine = %remote.engine, slot, %status, "a given-up READ ended: its landing slot is free again");
                    let destination = given_up.ended(status);
                    drop(req);
                    destination
                }
                None => {
                    given_up.abandon();
                    given_up.destination().await
                }
            };
            stats.slots_lent.fetch_sub(1, Ordering::Relaxed);
            match destination {
                Destination::Reusable => {
                    remote.return_slot(slot);
                    stats.slots_returned.fetch_add(1, Ordering::Relaxed);
                }
                // `Retire`, and any verdict this build does not know: the
                // safe answer is never to reuse the slot.
                _ => {
                    stats.slots_retired.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(engine = %remote.engine, slot, "landing slot retired: the given-up READ was abandoned and may still write it; never reused");
                }
            }
        });
    }
}
