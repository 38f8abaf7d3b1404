//! A registration's fate: what a NIXL status means for it (one judgement,
//! [`classify`], whatever call returned the status), its mark, and its
//! release. A marked registration refuses new reads, loses its
//! heartbeats, and is released (one transport call) once no read is in
//! flight and no handshake at its address holds it back; never before.
//! Shutdown marks everything and stops waiting at the drain deadline.

use std::time::{Duration, Instant};

use super::TicketId;
use crate::event::{ReleaseReason, WaitedFor};
use crate::state::EngineState;
use crate::transport::{ReleaseStep, Transfers};
use nixl_status::NixlStatus;

/// What a status means for the engine it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// REMOTE_DISCONNECT: UCX has failed the endpoint. Deterministic: the
    /// engine is marked unreachable and its reads in flight are failed.
    Disconnect,
    /// NOT_FOUND: NIXL holds no metadata for the agent any more (it was
    /// invalidated, or dropped by NIXL after a REMOTE_DISCONNECT, or
    /// loaded over and invalidated by someone else). For a live engine it
    /// is never transient: nothing to it can succeed until it is released
    /// and loaded again (NIXL logs "remote agent ... was invalidated or
    /// re-registered").
    MetadataGone,
    /// Any other error: counted and logged, never a release.
    Transient,
}

/// Judges `status`: `None` for success (or still in progress), where
/// there is nothing to do.
pub(super) fn classify(status: NixlStatus) -> Option<Verdict> {
    if status.is_remote_disconnect() {
        Some(Verdict::Disconnect)
    } else if status == NixlStatus::ERR_NOT_FOUND {
        Some(Verdict::MetadataGone)
    } else if status.is_ok() {
        None
    } else {
        Some(Verdict::Transient)
    }
}

/// The status a heartbeat round stands for, from its failed agents'
/// `statuses`: a REMOTE_DISCONNECT among them first (the one that marks),
/// else the first failure, else SUCCESS.
pub(super) fn round_status(mut statuses: impl Iterator<Item = NixlStatus> + Clone) -> NixlStatus {
    let first = statuses.clone().next();
    statuses
        .find(|s| s.is_remote_disconnect())
        .or(first)
        .unwrap_or(NixlStatus::SUCCESS)
}

/// Whether a release step failed: a NIXL `NOT_FOUND` counts as released
/// (NIXL had dropped it already), any other error is a failure.
pub(super) fn step_failed(step: &ReleaseStep) -> bool {
    if step.status == NixlStatus::ERR_NOT_FOUND {
        tracing::debug!(target = ?step.target, "already dropped by NIXL: counts as released");
        return false;
    }
    !step.status.is_ok()
}

/// Why a registration was marked, and what its release has waited for.
struct Mark {
    reason: ReleaseReason,
    at: Instant,
    reads_at_mark: u64,
    held_by_handshake: bool,
    /// The handshakes open at the registration's address when it was
    /// marked: only these hold its release back. One begun after the mark
    /// cannot (it finds the engine marked already), so a loop of
    /// handshakes at a dead prefill's address delays its release by one
    /// handshake's length at most, never for as long as the loop runs.
    handshakes_before: Vec<TicketId>,
}

/// The state a mark for `reason` puts a registration in.
pub(super) fn marked_state(reason: ReleaseReason) -> EngineState {
    match reason {
        ReleaseReason::Unreachable | ReleaseReason::MetadataLost => EngineState::Unreachable,
        ReleaseReason::Replaced | ReleaseReason::Reregistered => EngineState::Replaced,
        ReleaseReason::PeerGone | ReleaseReason::Shutdown => EngineState::Retiring,
        ReleaseReason::Stalled => EngineState::Stalled,
    }
}

/// Whether a mark for `reason` fails the reads in flight: UCX has failed
/// the endpoint, the peer is hung, or NIXL holds no metadata for it, so
/// no read in flight will complete.
pub(super) fn fails_reads(reason: ReleaseReason) -> bool {
    matches!(
        reason,
        ReleaseReason::Unreachable | ReleaseReason::Stalled | ReleaseReason::MetadataLost
    )
}

/// A registration's part of the release rule, kept in its record: its
/// mark (why, since when, what its release waited for), the resources the
/// release hands the transport, whether every transfer ended here, and
/// the errors that were not a release. Its fields are this rule's alone.
pub(super) struct Fate<R> {
    /// Boxed: only a marked registration has one, and most never are.
    mark: Option<Box<Mark>>,
    /// `None` once handed to the transport.
    resources: Option<R>,
    /// Whether every transfer of the registration ended here with
    /// `SUCCESS`: a read given up, or one that ended with an error, may
    /// still be running at the peer, and its release must then leave the
    /// connections to UCX ([`Transfers`]).
    transfers: Transfers,
    transient_errors: u64,
}

/// What a released registration's mark says, for its event and counts.
pub(super) struct Served {
    pub(super) reason: ReleaseReason,
    pub(super) since_mark: Duration,
    pub(super) waited_for: WaitedFor,
}

impl<R> Fate<R> {
    pub(super) fn new(resources: R) -> Self {
        Fate {
            mark: None,
            resources: Some(resources),
            transfers: Transfers::Ended,
            transient_errors: 0,
        }
    }

    /// Not marked.
    pub(super) fn is_live(&self) -> bool {
        self.mark.is_none()
    }

    /// Handed to the transport (or being).
    pub(super) fn is_releasing(&self) -> bool {
        self.resources.is_none()
    }

    /// Why it was marked, if it was.
    pub(super) fn reason(&self) -> Option<ReleaseReason> {
        self.mark.as_ref().map(|m| m.reason)
    }

    /// Errors that were not a release, so far.
    pub(super) fn transient_errors(&self) -> u64 {
        self.transient_errors
    }

    /// One more error that is not a release; the total.
    pub(super) fn transient_error(&mut self) -> u64 {
        self.transient_errors += 1;
        self.transient_errors
    }

    /// A read was given up or ended with an error: its transfer may still
    /// be running at the peer, for the registration's life (the core
    /// cannot see when the peer's side of it ends).
    pub(super) fn transfer_may_be_running(&mut self) {
        self.transfers = Transfers::MayBeRunning;
    }

    /// The first mark, at `now`, for `reason`, with `reads` in flight and
    /// the handshakes open at its address.
    pub(super) fn mark(
        &mut self,
        now: Instant,
        reason: ReleaseReason,
        reads: u64,
        handshakes_before: Vec<TicketId>,
    ) {
        debug_assert!(self.mark.is_none(), "the first mark stands");
        self.mark = Some(Box::new(Mark {
            reason,
            at: now,
            reads_at_mark: reads,
            held_by_handshake: false,
            handshakes_before,
        }));
    }

    /// Whether a handshake holds the marked registration's release back,
    /// noted for the `Released` event when one does. A handshake that was
    /// pending at the mark (`is_open` says which still are) may yet decide
    /// the engine at this address is new, so the old one waits; not for a
    /// handshake begun after the mark (a loop of them would hold a dead
    /// prefill's memory for as long as it runs), not when somebody waits to
    /// load this very engine id again (`reload_wanted`: they wait for this
    /// release), and not once the service is `stopping` (nothing new will
    /// register).
    pub(super) fn held_by_handshake(
        &mut self,
        stopping: bool,
        reload_wanted: bool,
        is_open: impl Fn(TicketId) -> bool,
    ) -> bool {
        let Some(mark) = self.mark.as_mut() else {
            return false;
        };
        let held =
            !stopping && !reload_wanted && mark.handshakes_before.iter().any(|&t| is_open(t));
        mark.held_by_handshake |= held;
        held
    }

    /// Hands the resources over for the release call: with what is known
    /// of the transfers, and how long since the mark.
    pub(super) fn hand_over(&mut self, now: Instant) -> (R, Transfers, Duration) {
        let mark = self
            .mark
            .as_ref()
            .expect("released registrations are marked");
        let waited = now.saturating_duration_since(mark.at);
        let resources = self.resources.take().expect("handed over once");
        (resources, self.transfers, waited)
    }

    /// What the mark of a registration whose release came back at `now`
    /// says.
    pub(super) fn served(self, now: Instant) -> Served {
        let mark = self.mark.expect("released registrations are marked");
        let since_mark = now.saturating_duration_since(mark.at);
        Served {
            reason: mark.reason,
            since_mark,
            waited_for: WaitedFor {
                duration: since_mark,
                reads_in_flight_at_mark: mark.reads_at_mark,
                handshake: mark.held_by_handshake,
            },
        }
    }

    /// The resources, if never handed to the transport.
    pub(super) fn into_resources(self) -> Option<R> {
        self.resources
    }
}

/// Where a shutdown stands (its deadline is the core's drain timer).
struct Stopping {
    /// Past this, reads still in flight (and releases still running) are no
    /// longer waited for.
    deadline: Instant,
    /// The deadline has been served by the core's timeout.
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

#[cfg(test)]
mod tests {
    use super::{classify, Releases, Verdict};
    use nixl_status::NixlStatus;
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

    #[test]
    fn only_remote_disconnect_is_a_disconnect_and_not_found_means_the_metadata_is_gone() {
        for raw in -20..=2 {
            let status = NixlStatus::from_raw(raw);
            let verdict = classify(status);
            if raw == NixlStatus::ERR_REMOTE_DISCONNECT.raw() {
                assert_eq!(verdict, Some(Verdict::Disconnect));
            } else if raw == NixlStatus::ERR_NOT_FOUND.raw() {
                assert_eq!(verdict, Some(Verdict::MetadataGone));
            } else if status.is_ok() {
                assert_eq!(verdict, None, "{status}");
            } else {
                assert_eq!(verdict, Some(Verdict::Transient), "{status}");
            }
        }
    }
}
