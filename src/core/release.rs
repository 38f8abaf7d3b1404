//! Marking and releasing: a marked registration refuses new reads, loses
//! its heartbeats, and is released (one transport call) once no read is in
//! flight and no handshake at its address holds it back; never before.
//! Shutdown marks everything and stops waiting at the drain deadline.

use std::time::Instant;

use super::peer::Mark;
use super::timers::Timer;
use super::{Action, Answer, Call, Core, Count, Panicked};
use crate::error::ClaimRefused;
use crate::event::{Event, ReleaseReason, WaitedFor};
use crate::read_accounting::cell::EngineCell;
use crate::registration::{Registration, RegistrationId};
use crate::state::EngineState;
use crate::transport::{EngineId, ReleaseStep, Transfers};
use nixl_agent::NixlStatus;
use std::sync::Arc;

/// Where a shutdown stands (its deadline is [`Timer::Drain`]).
struct Stopping {
    /// Past this, reads still in flight (and releases still running) are no
    /// longer waited for.
    deadline: Instant,
    /// The deadline has been served by [`Core::handle_timeout`].
    expired: bool,
}

/// What the release rule keeps besides the registrations' marks: the
/// releases handed to the transport and not back, what the transport's
/// release does to transfers still running, and the shutdown. Its own so
/// that whether the service may stop is decided in one place, from counts
/// nothing else writes.
#[derive(Default)]
pub(super) struct Releases {
    /// Releases handed to the transport whose result has not come back.
    in_flight: usize,
    /// The transport's release ends the transfers still running to the
    /// engine ([`crate::Transport::release_ends_transfers`]).
    ends_transfers: bool,
    stopping: Option<Stopping>,
}

impl Releases {
    /// Sets whether the transport's release ends the transfers still
    /// running to an engine.
    pub(super) fn set_ends_transfers(&mut self, ends: bool) {
        self.ends_transfers = ends;
    }

    /// Whether a release that came back `clean` ended the transfers still
    /// running to its engine: only a clean one, of a transport whose
    /// release ends them.
    pub(super) fn transfers_ended(&self, clean: bool) -> bool {
        clean && self.ends_transfers
    }

    /// A release was handed to the transport.
    pub(super) fn started(&mut self) {
        self.in_flight += 1;
    }

    /// A release came back from the transport.
    pub(super) fn finished(&mut self) {
        self.in_flight -= 1;
    }

    /// Releases handed to the transport and not back.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Begins a shutdown that waits until `deadline`; false (and the first
    /// deadline kept) if one has begun already.
    pub(super) fn stop(&mut self, deadline: Instant) -> bool {
        if self.stopping.is_some() {
            return false;
        }
        self.stopping = Some(Stopping {
            deadline,
            expired: false,
        });
        true
    }

    /// Whether a shutdown has begun.
    pub(super) fn is_stopping(&self) -> bool {
        self.stopping.is_some()
    }

    /// The drain deadline was served: nothing is waited for any more.
    pub(super) fn deadline_passed(&mut self) {
        if let Some(stopping) = self.stopping.as_mut() {
            stopping.expired = true;
        }
    }

    /// Whether a shutdown has begun and nothing is left to wait for at
    /// `now`: the deadline has passed, or no release is running and
    /// `nothing_registered`.
    pub(super) fn is_stopped(&self, now: Instant, nothing_registered: bool) -> bool {
        match &self.stopping {
            None => false,
            Some(s) => {
                s.expired || now >= s.deadline || (self.in_flight == 0 && nothing_registered)
            }
        }
    }
}

impl<R> Core<R> {
    /// The release of `peer` came back: the runtime's handles of it learn
    /// (through the driver), and its given-up reads what their destination
    /// buffers may become.
    pub(super) fn release_finished(&mut self, cell: Arc<EngineCell>, clean: bool) {
        self.actions.push_back(Action::ReleaseFinished {
            cell,
            transfers_ended: self.releases.transfers_ended(clean),
        });
    }

    /// Marks a live registration: no new reads, no more heartbeats;
    /// released as soon as it is idle. The first mark stands.
    pub(super) fn mark(&mut self, now: Instant, serial: RegistrationId, reason: ReleaseReason) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        if !peer.is_live() {
            return;
        }
        let handshakes_before = self.directory.open_at(&peer.address);
        let peer = self.peers.get_mut(&serial).expect("checked");
        let state = match reason {
            ReleaseReason::Unreachable | ReleaseReason::MetadataLost => EngineState::Unreachable,
            ReleaseReason::Replaced | ReleaseReason::Reregistered => EngineState::Replaced,
            ReleaseReason::PeerGone | ReleaseReason::Shutdown => EngineState::Retiring,
            ReleaseReason::Stalled => EngineState::Stalled,
        };
        let reads = peer.cell.mark(state).unwrap_or(0);
        peer.mark = Some(Box::new(Mark {
            reason,
            at: now,
            reads_at_mark: reads,
            held_by_handshake: false,
            handshakes_before,
        }));
        peer.leases.clear();
        tracing::info!(engine = %peer.id(), registration = %serial, state = state.as_str(), reads_in_flight = reads, "engine marked for release");
        self.unschedule_heartbeat(serial);
        if matches!(
            reason,
            ReleaseReason::Unreachable | ReleaseReason::Stalled | ReleaseReason::MetadataLost
        ) {
            // UCX has failed the endpoint, the peer is hung, or NIXL holds
            // no metadata for it: no read in flight will complete.
            self.fail_reads(serial);
        }
        self.try_release(now, serial);
    }

    pub(super) fn fail_reads(&mut self, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        let cell = peer.cell.clone();
        let count = cell.reads_in_flight();
        let engine = peer.id().clone();
        self.actions.push_back(Action::FailReads { cell });
        if count > 0 {
            tracing::warn!(%engine, count, "reads in flight failed");
            self.emit(Event::ReadsFailed {
                engine,
                registration: serial,
                count,
            });
        }
    }

    /// A read of the registration was given up, or ended with an error:
    /// its transfer may still be running at the peer, so the release will
    /// leave the engine's connections to UCX ([`Transfers`]). Kept for the
    /// registration's life: the core cannot see when the peer's side of a
    /// given-up transfer ends.
    pub(super) fn transfer_may_be_running(&mut self, serial: RegistrationId) {
        if let Some(peer) = self.peers.get_mut(&serial) {
            peer.transfers = Transfers::MayBeRunning;
        }
    }

    /// Releases a marked registration if no read is in flight and no
    /// handshake holds it back. Decided here; the transport is called by
    /// the driver after.
    pub(super) fn try_release(&mut self, now: Instant, serial: RegistrationId) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        if peer.mark.is_none() || peer.is_releasing() {
            return;
        }
        // A handshake that was pending when the engine was marked may yet
        // decide the engine at this address is new, so the old one waits;
        // not for a handshake begun after the mark (a loop of them would
        // hold a dead prefill's memory for as long as it runs), not when
        // somebody is waiting to load this very engine id again (they wait
        // for this release), and not once the service is stopping
        // (nothing new will register).
        let mark = peer.mark.as_ref().expect("checked");
        let held = !self.releases.is_stopping()
            && mark
                .handshakes_before
                .iter()
                .any(|&t| self.directory.is_open(t))
            && !self.reload_wanted(peer.id());
        if held {
            let address = peer.address.clone();
            let peer = self.peers.get_mut(&serial).expect("checked");
            peer.mark.as_mut().expect("checked").held_by_handshake = true;
            self.directory.hold(&address, serial);
            return;
        }
        if peer.cell.try_release().is_err() {
            return; // the last read to end wakes us
        }
        let peer = self.peers.get_mut(&serial).expect("checked");
        let engine = peer.id().clone();
        let waited = now.saturating_duration_since(peer.mark.as_ref().expect("checked").at);
        tracing::debug!(%engine, ?waited, "releasing");
        let resources = peer.resources.take().expect("checked above");
        let agents = peer.agents.clone();
        let transfers = peer.transfers;
        peer.rate.forget(); // its limiter key forgotten
        self.releases.started();
        self.calls.push(Call::Release {
            serial,
            engine,
            agents,
            resources,
            transfers,
        });
    }

    pub(super) fn release_done(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        steps: Result<Vec<ReleaseStep>, Panicked>,
    ) {
        let Some(peer) = self.peers.remove(&serial) else {
            return;
        };
        self.releases.finished();
        let engine = peer.id().clone();
        let mark = peer.mark.expect("released registrations are marked");
        let mut endpoints_left_open = 0u32;
        let (failed_steps, panicked) = match steps {
            Ok(steps) => {
                let mut failed = 0;
                for step in &steps {
                    endpoints_left_open += step.endpoints_left_open();
                    if step.status == NixlStatus::ERR_NOT_FOUND {
                        tracing::debug!(%engine, target = ?step.target, "already dropped by NIXL: counts as released");
                    } else if !step.status.is_ok() {
                        failed += 1;
                        self.count(Count::ReleaseStepFailed(step.status));
                        tracing::error!(%engine, target = ?step.target, status = %step.status, raw = step.status.raw(), "release step failed");
                    }
                }
                (failed, false)
            }
            Err(p) => {
                self.count(Count::TransportPanicked("release"));
                tracing::error!(%engine, message = %p.message, "the transport panicked while releasing: its resources are consumed, not retried");
                self.emit(Event::TransportPanicked {
                    engine: engine.clone(),
                    registration: serial,
                    call: "release",
                    message: p.message,
                });
                (0, true)
            }
        };
        self.release_finished(peer.cell.clone(), failed_steps == 0 && !panicked);
        let since_mark = now.saturating_duration_since(mark.at);
        self.count(Count::Released {
            reason: mark.reason,
            since_mark,
        });
        tracing::info!(%engine, registration = %serial, reason = mark.reason.as_str(), after = ?since_mark, failed_steps, panicked, "engine released");
        // Gone from the directory before the event: whoever sees it finds
        // the successor, if any, never the released registration.
        self.actions.push_back(Action::Forget {
            engine: engine.clone(),
            serial,
        });
        self.emit(Event::Released {
            engine: engine.clone(),
            registration: serial,
            reason: mark.reason,
            waited_for: WaitedFor {
                duration: since_mark,
                reads_in_flight_at_mark: mark.reads_at_mark,
                handshake: mark.held_by_handshake,
            },
            failed_steps,
            panicked,
            endpoints_left_open,
        });
        self.forget_registration(now, serial, &engine, &peer.address, &peer.agents);
    }

    /// The service is stopping: every live registration is marked (each
    /// idle one is released now), what waits is refused, and nothing is
    /// activated any more. [`Core::into_unreleased`] hands back the rest.
    pub(super) fn shutdown(&mut self, now: Instant) {
        let deadline = now + self.config.shutdown_drain;
        if !self.releases.stop(deadline) {
            return;
        }
        self.timers.set(Timer::Drain, deadline);
        tracing::info!(drain = ?self.config.shutdown_drain, "stopping: marking every engine; each is released as its reads end");
        // Claims waiting for an engine id are refused; granted loads may
        // still register (the service then releases them like the rest).
        for ticket in self.directory.take_waiting() {
            if let Some((_, request)) = self.directory.take_waiting_claim(ticket) {
                self.actions.push_back(Action::Answer {
                    request,
                    answer: Answer::ClaimRefused(ClaimRefused::Stopped(
                        crate::error::ServiceStopped,
                    )),
                });
            }
        }
        let mut serials: Vec<RegistrationId> = self.peers.keys().copied().collect();
        serials.sort_unstable();
        for serial in serials {
            self.mark(now, serial, ReleaseReason::Shutdown);
            // Marked earlier and held by a handshake: not any more.
            self.try_release(now, serial);
        }
        self.directory.clear_holds();
    }

    /// What a shutdown could not release: registrations still held, each
    /// once, resources and all; and the engines whose release was handed
    /// to the transport but had not come back.
    pub(crate) fn into_unreleased(self) -> (Vec<Registration<R>>, Vec<EngineId>) {
        let mut unreleased = Vec::new();
        let mut unfinished = Vec::new();
        for p in self.peers.into_values() {
            let engine = p.cell.id().clone();
            match p.resources {
                Some(resources) => unreleased.push(Registration {
                    engine,
                    incarnation: p.incarnation,
                    address: p.address,
                    agents: p.agents.to_vec(),
                    resources,
                }),
                None => unfinished.push(engine),
            }
        }
        unreleased.sort_by(|a, b| a.engine.cmp(&b.engine));
        unfinished.sort();
        (unreleased, unfinished)
    }
}

#[cfg(test)]
mod tests {
    use super::Releases;
    use std::time::{Duration, Instant};

    #[test]
    fn releases_in_flight_are_counted_until_each_comes_back() {
        let mut releases = Releases::default();
        releases.started();
        releases.started();
        assert_eq!(releases.in_flight(), 2);
        releases.finished();
        assert_eq!(releases.in_flight(), 1);
        releases.finished();
        assert_eq!(releases.in_flight(), 0);
    }

    #[test]
    fn a_release_ends_transfers_only_when_clean_and_the_transport_says_so() {
        let mut releases = Releases::default();
        assert!(
            !releases.transfers_ended(true),
            "off until the transport says"
        );
        releases.set_ends_transfers(true);
        assert!(releases.transfers_ended(true));
        assert!(
            !releases.transfers_ended(false),
            "a failed release ends nothing"
        );
    }

    #[test]
    fn the_first_shutdown_stands_and_a_second_keeps_its_deadline() {
        let now = Instant::now();
        let mut releases = Releases::default();
        assert!(!releases.is_stopping());
        assert!(!releases.is_stopped(now, true), "not stopping: not stopped");
        assert!(releases.stop(now + Duration::from_secs(5)));
        assert!(releases.is_stopping());
        assert!(!releases.stop(now + Duration::from_secs(1)), "once only");
        releases.started();
        let later = now + Duration::from_secs(2);
        assert!(
            !releases.is_stopped(later, true),
            "the second deadline did not replace the first"
        );
        assert!(releases.is_stopped(now + Duration::from_secs(5), false));
    }

    #[test]
    fn a_shutdown_is_over_when_nothing_is_left_or_the_deadline_was_served() {
        let now = Instant::now();
        let mut releases = Releases::default();
        releases.stop(now + Duration::from_secs(5));
        releases.started();
        assert!(!releases.is_stopped(now, true), "a release is running");
        releases.finished();
        assert!(!releases.is_stopped(now, false), "a registration is left");
        assert!(releases.is_stopped(now, true));
        releases.started();
        releases.deadline_passed();
        assert!(
            releases.is_stopped(now, false),
            "past the deadline nothing waits"
        );
    }
}
