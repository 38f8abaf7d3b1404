//! The reader of one prefill address ([`super::Decoder::spawn`]): connect
//! (retrying, backing off a conflicting claimant), rounds of transfers, a
//! probe every `probe_interval`, and a new handshake after a release.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_keepalive::{EngineState, PeerAddr};
use tokio_util::sync::CancellationToken;

use super::connect::{Connected, Found};
use super::handshake::{fetch, HandshakeError};
use super::remote::RemoteEngine;
use super::transfer::{Direction, Target};
use super::Decoder;

/// The pause before asking an address again whose prefill conflicts with
/// an engine already registered (the same engine id elsewhere, another
/// engine's agent names).
const CONFLICT_PAUSE: Duration = Duration::from_secs(10);

/// The blocks one round transfers with, one per transfer in flight: random
/// for reads; for writes, consecutive from a random start, never one
/// block twice in a round (two writes of different requests into one
/// block at once would each make the other's bytes look corrupt), so a
/// round writes at most every block once.
fn round_targets(remote: &RemoteEngine, in_flight: usize, direction: Direction) -> Vec<Target> {
    let (ranks, blocks) = (remote.ranks().max(1), remote.blocks.max(1));
    let total = u64::from(ranks) * u64::from(blocks);
    let n = in_flight.max(1);
    match direction {
        Direction::Read => (0..n)
            .map(|_| Target {
                rank: rand::random_range(0..ranks),
                block: rand::random_range(0..blocks),
            })
            .collect(),
        Direction::Write => {
            let start = rand::random_range(0..total);
            (0..(n as u64).min(total))
                .map(|i| {
                    let index = (start + i) % total;
                    Target {
                        rank: (index / u64::from(blocks)) as u16,
                        block: (index % u64::from(blocks)) as u32,
                    }
                })
                .collect()
        }
    }
}

impl Decoder {
    /// Runs the reader for one prefill address until `shutdown`: handshake
    /// (retrying while nobody answers), rounds of random reads, a probe
    /// handshake every `probe_interval`, and after the engine is marked,
    /// waits for its release before handshaking again.
    pub fn spawn(
        self: &Arc<Self>,
        address: PeerAddr,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move { me.reader_loop(address, shutdown).await })
    }

    /// Waits out a conflicting claimant's back-off at `address`, at most
    /// `pause`, asking the address (the side-channel reply only, nothing
    /// loaded) every retry step: it ends as soon as another claimant (a
    /// new engine id or incarnation) or nobody answers there, so an
    /// honest prefill that starts where a conflicting one was is
    /// handshaken at once, not after the other's back-off.
    async fn until_another_claimant(
        &self,
        address: &PeerAddr,
        claimant: &crate::pd::retry::Claimant,
        pause: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + pause;
        loop {
            let step = self
                .options
                .retry
                .mul_f64(0.5 + rand::random::<f64>() / 2.0)
                .max(Duration::from_millis(1));
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return;
            }
            tokio::time::sleep_until((now + step).min(deadline)).await;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            match fetch(address, self.options.handshake_timeout).await {
                Ok(reply) if Some((reply.engine.clone(), reply.incarnation)) == *claimant => {}
                _ => return,
            }
        }
    }

    async fn reader_loop(self: Arc<Self>, address: PeerAddr, shutdown: CancellationToken) {
        let mut current: Option<Connected> = None;
        let mut last_probe: Option<Instant> = None;
        let o = &self.options;
        let mut retry = crate::pd::retry::Retry::new(o.retry, o.retry_max);
        while !shutdown.is_cancelled() {
            if let Some(c) = &current {
                if c.engine.state() != EngineState::Live {
                    // Waits for this very registration's release (a
                    // pinned id's successor is another registration), at
                    // most a minute: a release the transport never
                    // returns must not stop the reader for good.
                    let c = current.take().expect("checked");
                    tokio::select! {
                        _ = c.engine.released() => {}
                        _ = tokio::time::sleep(Duration::from_secs(60)) => {}
                        _ = shutdown.cancelled() => {}
                    }
                    last_probe = None;
                }
            }
            let probe_due = last_probe.is_none_or(|t| t.elapsed() >= self.options.probe_interval);
            if current.is_none() || probe_due {
                last_probe = Some(Instant::now());
                match self.connect_by(&address, current.as_ref()).await {
                    (Ok(h), _) => {
                        let failures = retry.succeeded();
                        // The next failure is told at once.
                        self.handshake_log
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .forget(|(a, _)| *a == address);
                        if failures > 0 {
                            tracing::info!(%address, failures, "handshake succeeded after failures");
                        }
                        if let Found::New(c) = h {
                            current = Some(c);
                        }
                    }
                    (Err(e), claimant) => {
                        let now = tokio::time::Instant::now();
                        // Earned by whoever answered: a new engine id or
                        // incarnation here starts fresh.
                        let mut after = retry.failed_by(claimant.clone());
                        let conflicted = matches!(e, HandshakeError::Conflict(_));
                        if let HandshakeError::Conflict(conflict) = &e {
                            // The service logged the conflict once, with
                            // both sides; the same claimant conflicting
                            // again does not heal in milliseconds: back off
                            // further (woken early if another claimant
                            // answers here).
                            if after.in_a_row > 1 {
                                after.pause = after.pause.max(CONFLICT_PAUSE);
                            }
                            tracing::debug!(%address, %conflict, next_try_in = ?after.pause, "handshake refused: identity conflict");
                        } else if let Some(suppressed) = self
                            .handshake_log
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .admit((address.clone(), e.reason()), now)
                        {
                            tracing::warn!(
                                %address,
                                error = %e,
                                reason = e.reason(),
                                in_a_row = after.in_a_row,
                                suppressed,
                                next_try_in = ?after.pause,
                                "handshake failed; retrying with back-off"
                            );
                        }
                        if current.is_none() {
                            let wait = async {
                                if conflicted {
                                    self.until_another_claimant(&address, &claimant, after.pause)
                                        .await
                                } else {
                                    tokio::time::sleep(after.pause).await
                                }
                            };
                            tokio::select! {
                                _ = shutdown.cancelled() => break,
                                _ = wait => {}
                            }
                            continue;
                        }
                    }
                }
            }
            let Some(c) = current.clone() else { continue };
            let mut reads = tokio::task::JoinSet::new();
            let direction = self.options.direction;
            for at in round_targets(&c.remote, self.options.reads_in_flight, direction) {
                let me = self.clone();
                let c = c.clone();
                reads.spawn(async move { me.transfer(&c, direction, at).await });
            }
            while reads.join_next().await.is_some() {}
            // The pause ends early when this registration is released (by
            // membership, the router or the service): the reader then
            // handshakes for whoever is at the address. Without that, a
            // reader kept running by another record naming the address
            // slept out its whole pause (issue 47, item 1).
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(self.options.read_pause) => {}
                _ = c.engine.released() => {}
            }
        }
    }
}
