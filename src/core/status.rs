//! The one place a NIXL status is acted on, whatever call returned it
//! (a heartbeat's `genNotif`, a transfer the runtime reports): judged by
//! [`super::classify`], then a mark, a count or nothing.

use std::time::Instant;

use super::{classify, Core, Count, Verdict};
use crate::event::{Event, ReleaseReason, Source};
use crate::registration::RegistrationId;
use crate::transport::AgentName;
use nixl_agent::NixlStatus;

impl<R> Core<R> {
    /// A status from `source` for registration `serial` (and `agent`, for
    /// a heartbeat). The one place a status is acted on.
    pub(super) fn on_status(
        &mut self,
        now: Instant,
        serial: RegistrationId,
        source: Source,
        agent: Option<&AgentName>,
        status: NixlStatus,
    ) {
        let verdict = classify(status);
        if verdict == Verdict::Fine {
            return;
        }
        self.count(Count::StatusError { source, status });
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        let engine = peer.id().clone();
        match verdict {
            Verdict::Fine => {}
            Verdict::Disconnect => {
                if peer.is_live() {
                    tracing::warn!(%engine, ?agent, %source, %status, raw = status.raw(), "REMOTE_DISCONNECT: engine unreachable");
                    self.emit(Event::Unreachable {
                        engine,
                        registration: serial,
                        status,
                        source,
                    });
                    self.mark(now, serial, ReleaseReason::Unreachable);
                }
            }
            Verdict::MetadataGone => {
                if peer.is_live() {
                    tracing::warn!(%engine, ?agent, %source, %status, raw = status.raw(), "NOT_FOUND for the engine's own agent: NIXL no longer holds its metadata; released and connected again");
                    self.mark(now, serial, ReleaseReason::MetadataLost);
                }
            }
            Verdict::Transient => {
                peer.transient_errors += 1;
                // One line per engine, status and source per period, with
                // the count it stands for; every one is counted and is an
                // event.
                let key = (serial, status.raw(), source);
                if let Some(suppressed) = self.transient_log.admit(key, now) {
                    tracing::info!(%engine, ?agent, %source, %status, raw = status.raw(), suppressed, total = peer.transient_errors, "an error that is not a disconnect: counted, engine kept");
                }
                self.emit(Event::TransientError {
                    engine,
                    registration: serial,
                    status,
                    source,
                });
            }
        }
    }
}
