//! The runtime's handles on one registration: [`EngineRef`] to start reads
//! and report transfers, [`TransferGuard`] for one read in flight,
//! [`GivenUpRead`] for a read the runtime stopped waiting for while its
//! transfer was in progress. All are bound to the registration they came
//! from, never to whatever registration holds the engine id later: a late
//! report from an old process of a pinned id cannot touch its reloaded
//! successor.
//!
//! # Reads and writes
//!
//! The library is role-neutral: the peer is whoever's memory the runtime
//! transfers with (a prefill, when a decode pulls its KV cache; a decode,
//! when a prefill pushes into it). A push-mode WRITE is guarded exactly
//! as a READ is ([`EngineRef::begin_write`]): it is counted in the same
//! registration's transfers in flight, and the peer is never released
//! while one is. The guard types keep pull mode's names ([`WriteGuard`]
//! and [`OwnedWriteGuard`] are the same types); "read" in their docs and
//! in [`EngineRef::reads_in_flight`] means any transfer.
//!
//! # A read ends one of two ways
//!
//! - [`TransferGuard::finish`] with the status the transfer ended with
//!   (`SUCCESS`, or an error): the transfer is over, its destination
//!   buffer is the runtime's again. Dropping the guard means the same
//!   (a completion).
//! - [`TransferGuard::give_up`]: the runtime stopped waiting for a transfer
//!   still in progress (its read timeout, a cancelled request, or the
//!   service failed the engine's reads) and fails its request now. Not a
//!   completion: a read given up unanswered is evidence that the engine is
//!   hung (see [`GiveUp::TimedOut`]). And the transfer is not over: NIXL
//!   1.5.1 answers `releaseXferReq` on a READ in progress with SUCCESS,
//!   yet over TCP the bytes still land in the destination when the
//!   prefill resumes, even after the engine's remote metadata was
//!   invalidated (measured, `cli/tests/real_buffer.rs`). So the given-up
//!   read keeps counting as in flight, fencing the engine (no release
//!   under it), and the runtime keeps its destination until the transfer
//!   is seen to end ([`GivenUpRead::ended`]: it completes when a frozen
//!   prefill resumes, fails when it dies).

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use event_listener::Event;

use crate::error::ReadRefused;
use crate::give_up::GiveUp;
use crate::read_accounting::cell::BeginRefused;
use crate::read_accounting::cell::EngineCell;
use crate::registration::RegistrationId;
use crate::state::EngineState;
use crate::transport::EngineId;
use nixl_status::NixlStatus;

/// The most reads one registration may have in flight at once (the count
/// has 24 bits of the engine's atomic word); one more is refused.
pub const MAX_READS_IN_FLIGHT: u64 = crate::read_accounting::cell::MAX_READS_IN_FLIGHT;

/// A registered engine, as the decoder runtime holds it. Cheap to clone.
///
/// Keep it beside the engine's cached layout: starting a read through it
/// touches the registration's counts and nothing else (on the thread that
/// reads first, without a locked instruction; see
/// [`EngineRef::begin_read`]).
#[derive(Clone)]
pub struct EngineRef {
    pub(crate) cell: Arc<EngineCell>,
}

impl EngineRef {
    /// The engine's id.
    pub fn id(&self) -> &EngineId {
        self.cell.id()
    }

    /// Whether `other` is a reference to this very registration (not just
    /// to the same engine id: a pinned id loaded again is another
    /// registration).
    pub fn same_registration(&self, other: &EngineRef) -> bool {
        Arc::ptr_eq(&self.cell, &other.cell)
    }

    /// This registration: events about it name it ([`crate::Event`]).
    pub fn registration(&self) -> RegistrationId {
        self.cell.serial()
    }

    /// Resolves once this registration has been released (its NIXL state
    /// given back, the release call returned): whatever registration holds
    /// the engine id by then, this one is over. The service publishes its
    /// [`crate::Event::Released`] right after. Cancel safe; the future owns
    /// what it needs.
    pub fn released(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let cell = Arc::clone(&self.cell);
        async move { cell.release_done().wait().await }
    }

    /// The engine's state now.
    pub fn state(&self) -> EngineState {
        self.cell.state()
    }

    /// Reads from this engine in flight now.
    pub fn reads_in_flight(&self) -> u64 {
        self.cell.reads_in_flight()
    }

    /// Starts a read from this engine. Hold the guard for as long as the
    /// transfer may touch the engine's memory (until it is DONE, failed, or
    /// released); the service will not release the engine before.
    ///
    /// The guard borrows this `EngineRef` (the hot path every read pays).
    /// The first thread to read from a registration owns it: its begins
    /// and ends are a few ordinary loads and stores, no locked instruction
    /// (the service makes them visible with `membarrier` when it marks the
    /// engine); any other thread's are one atomic read-modify-write each.
    /// A guard may still end on another thread (a task that moved): it is
    /// counted once either way. For a read that outlives the reference,
    /// use [`EngineRef::begin_read_owned`] (or [`TransferGuard::into_owned`]),
    /// as with tokio's `Semaphore::acquire` and `acquire_owned`.
    ///
    /// Fails at once, without waiting, when the engine is unreachable,
    /// replaced, retiring or released: a decoder must not post a transfer
    /// to it.
    ///
    /// Also refused, with `state` [`EngineState::Live`], when
    /// [`MAX_READS_IN_FLIGHT`] reads from this registration are in flight
    /// already (a runtime that leaks guards).
    #[inline]
    pub fn begin_read(&self) -> Result<ReadGuard<'_>, ReadRefused> {
        match self.cell.begin_read() {
            Ok(begun) => Ok(TransferGuard {
                cell: &self.cell,
                begun,
            }),
            Err(refused) => Err(self.refused(refused)),
        }
    }

    /// Starts a write to this engine (push mode: the peer is a decode and
    /// this process writes its KV cache into the decode's memory). The
    /// same guard and the same rules as [`EngineRef::begin_read`]: hold it
    /// until the WRITE is DONE, failed or released; the service does not
    /// release the engine (its remote metadata, the keys to its memory)
    /// before. A write given up in progress ([`TransferGuard::give_up`]) is
    /// not provably over either: UCX may still be reading the local source
    /// buffer, which is reusable only when the [`GivenUpRead`] says
    /// [`Destination::Reusable`].
    #[inline]
    pub fn begin_write(&self) -> Result<WriteGuard<'_>, ReadRefused> {
        self.begin_read()
    }

    /// Starts a write like [`EngineRef::begin_write`], with a guard that
    /// owns a reference to the registration (see
    /// [`EngineRef::begin_read_owned`]).
    pub fn begin_write_owned(&self) -> Result<OwnedWriteGuard, ReadRefused> {
        self.begin_read_owned()
    }

    /// Starts a read like [`EngineRef::begin_read`], with a guard that owns
    /// a reference to the registration (`'static`, `Send`): two more atomic
    /// operations per read (the `Arc`'s), for reads whose guard outlives
    /// the reference.
    pub fn begin_read_owned(&self) -> Result<OwnedReadGuard, ReadRefused> {
        self.begin_read().map(TransferGuard::into_owned)
    }

    /// Accounts for a transfer from this engine that is already running
    /// without a guard (posted by code that bypassed the runtime's own
    /// guard, found later by the runtime), with an owned guard to end as
    /// any read's. Unlike [`EngineRef::begin_read`] it is granted on a
    /// marked engine too (unreachable, stalled, replaced, retiring): the
    /// transfer runs whether or not it is counted, and counted it holds the
    /// release until it ends, as the rule says. Refused only when the
    /// engine is already released (state [`EngineState::Released`]: the
    /// transfer ran on released state; end it at once and treat its
    /// destination as unsafe) or when [`MAX_READS_IN_FLIGHT`] are in flight.
    /// Never use it to start a transfer.
    pub fn adopt_posted_read(&self) -> Result<OwnedReadGuard, ReadRefused> {
        match self.cell.begin_posted() {
            Ok(begun) => Ok(TransferGuard {
                cell: &self.cell,
                begun,
            }
            .into_owned()),
            Err(refused) => Err(self.refused(refused)),
        }
    }

    #[cold]
    fn refused(&self, refused: BeginRefused) -> ReadRefused {
        ReadRefused {
            engine: self.id().clone(),
            state: match refused {
                BeginRefused::State(state) => state,
                BeginRefused::Full => EngineState::Live,
            },
        }
    }

    /// Reports how a transfer from this registration ended, for transfers
    /// not tracked with a [`TransferGuard`] (use [`TransferGuard::finish`]
    /// otherwise). Successes are not sent anywhere.
    pub fn report_transfer(&self, status: NixlStatus) {
        self.cell.report(status);
    }

    /// Whether the service has failed this registration's reads.
    pub fn reads_failed(&self) -> bool {
        self.cell.reads_failed().is_set()
    }
}

impl fmt::Debug for EngineRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineRef")
            .field("engine", self.id())
            .field("state", &self.state())
            .field("reads_in_flight", &self.reads_in_flight())
            .finish()
    }
}

/// One transfer in flight (a pull-mode READ or a push-mode WRITE: the
/// service counts both alike, hence the one type and its two names,
/// [`ReadGuard`] and [`WriteGuard`]), borrowing its [`EngineRef`] (see
/// [`EngineRef::begin_read`]). Dropping it ends the read as a completion.
///
/// Report how the transfer ended with [`TransferGuard::finish`]: a
/// REMOTE_DISCONNECT result is how production learns of most dead peers.
/// A transfer the runtime stops waiting for while it is in progress ends
/// with [`TransferGuard::give_up`] instead.
#[must_use = "dropping the guard ends the read at once, as a completion"]
pub struct TransferGuard<'a> {
    cell: &'a Arc<EngineCell>,
    /// What the cell's `begin_read` returned (the engine's completed count
    /// when the read began, and which count the read is in), or
    /// [`GIVEN_UP`] once given up or handed to an owned guard (the drop
    /// then has nothing left to do).
    begun: u64,
}

/// One read in flight, like [`TransferGuard`], owning a reference to its
/// registration: for reads whose guard moves to another task or thread
/// ([`EngineRef::begin_read_owned`]). Dropping it ends the read as a
/// completion.
#[must_use = "dropping the guard ends the read at once, as a completion"]
pub struct OwnedTransferGuard {
    cell: Arc<EngineCell>,
    /// As in [`TransferGuard`].
    begun: u64,
}

/// One pull-mode read in flight: the name the pull-mode runtimes know
/// it by (see [`TransferGuard`]).
pub type ReadGuard<'a> = TransferGuard<'a>;

/// One push-mode write in flight: the same guard as a read's (see the
/// module docs, "Reads and writes").
pub type WriteGuard<'a> = TransferGuard<'a>;

/// One pull-mode read in flight, owning a reference to its registration
/// (see [`OwnedTransferGuard`]).
pub type OwnedReadGuard = OwnedTransferGuard;

/// One push-mode write in flight, owning a reference to its registration:
/// the same guard as [`OwnedTransferGuard`].
pub type OwnedWriteGuard = OwnedTransferGuard;

/// Not a begin's value (those are a 36-bit completed count, with at most
/// the top bit set for the owner's path): marks a guard whose read is no
/// longer its to end.
const GIVEN_UP: u64 = u64::MAX;

impl TransferGuard<'_> {
    /// The same read, with a guard that owns a reference to the
    /// registration (one more atomic operation now and one at its end).
    pub fn into_owned(mut self) -> OwnedTransferGuard {
        OwnedTransferGuard {
            cell: Arc::clone(self.cell),
            begun: std::mem::replace(&mut self.begun, GIVEN_UP),
        }
    }
}

/// What both guards do, written once: `$cell` reaches the
/// `Arc<EngineCell>` from `self`.
macro_rules! read_guard {
    ($guard:ty, $name:literal, |$this:ident| $cell:expr) => {
        impl $guard {
            fn cell(&self) -> &Arc<EngineCell> {
                let $this = self;
                $cell
            }

            /// The engine this read is from.
            pub fn engine(&self) -> &EngineId {
                self.cell().id()
            }

            /// Whether the service has failed this engine's reads (the peer
            /// is unreachable, or it was declared gone in `fail` mode). The
            /// transfer should be abandoned and its request failed or
            /// recomputed.
            pub fn is_failed(&self) -> bool {
                self.cell().reads_failed().is_set()
            }

            /// Resolves when the service fails this engine's reads. Cancel
            /// safe; the future owns what it needs (it may outlive the
            /// guard).
            pub fn failed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
                let cell = Arc::clone(self.cell());
                async move { cell.reads_failed().wait().await }
            }

            /// Ends the read, reporting the raw NIXL status the transfer
            /// ended with (`SUCCESS`, or the error
            /// `getXferStatus`/`postXferReq` returned). An error reaches the
            /// service before the read is counted as ended, so a
            /// REMOTE_DISCONNECT marks the engine before it can be released.
            #[inline]
            pub fn finish(self, status: NixlStatus) {
                self.cell().report(status);
                drop(self);
            }

            /// Gives the read up: the runtime stopped waiting for a transfer
            /// still in progress (its read timeout, a cancelled request, the
            /// service failed the engine's reads) and fails its request now.
            /// Not a completion: see [`GiveUp`] for what the service makes
            /// of it.
            ///
            /// The transfer is not over: it may still write the read's
            /// destination and touch the engine's memory, so it still counts
            /// as in flight (the engine is not released under it). Keep the
            /// returned [`GivenUpRead`] with the destination, keep polling
            /// the transfer (do not release NIXL's request: that does not
            /// end it, see the module docs), and say when it ends with
            /// [`GivenUpRead::ended`]: the destination is then reusable.
            pub fn give_up(self, why: GiveUp) -> GivenUpRead {
                self.give_up_holding(why, 0)
            }

            /// [`Self::give_up`], saying how many destination blocks the
            /// transfer holds (in the runtime's own unit: KV blocks, pages,
            /// slots), for the snapshot and the
            /// `nixl_keepalive_given_up_blocks` gauge.
            pub fn give_up_holding(mut self, why: GiveUp, blocks: u64) -> GivenUpRead {
                let begun = std::mem::replace(&mut self.begun, GIVEN_UP);
                let token = self.cell().give_up(why, begun, blocks);
                GivenUpRead {
                    cell: Arc::clone(self.cell()),
                    why,
                    begun,
                    token,
                    watch: AtomicU8::new(WATCHED),
                    changed: Event::new(),
                }
            }
        }

        impl Drop for $guard {
            #[inline]
            fn drop(&mut self) {
                if self.begun != GIVEN_UP {
                    self.cell().end_read(self.begun);
                }
            }
        }

        impl fmt::Debug for $guard {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct($name)
                    .field("engine", self.engine())
                    .finish()
            }
        }
    };
}

read_guard!(TransferGuard<'_>, "TransferGuard", |this| this.cell);
read_guard!(OwnedTransferGuard, "OwnedTransferGuard", |this| &this.cell);

/// What may become of the destination buffer of a given-up read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Destination {
    /// The transfer is over: it was seen to end ([`GivenUpRead::ended`]),
    /// or it was abandoned and the engine's release, with a transport whose
    /// release ends every transfer still running to it
    /// ([`crate::Transport::release_ends_transfers`]), came back. No byte
    /// can land any more; the buffer is the runtime's again.
    Reusable,
    /// The transfer was abandoned ([`GivenUpRead::abandon`]: nobody watches
    /// it end) and the engine was released, but the transport cannot prove
    /// that the release ended it: never reuse the buffer, and keep it
    /// allocated (and its memory mapped) for as long as the agent lives.
    /// What the NIXL 1.5.1 transport answers: measured over TCP, a READ
    /// given up with `releaseXferReq` wrote its destination when the
    /// prefill resumed, even after the release had invalidated the
    /// engine's remote metadata (`cli/tests/real_buffer.rs`). A watched
    /// transfer never ends here.
    Retire,
}

/// A given-up transfer still watched: it counts as in flight.
const WATCHED: u8 = 0;
/// Seen to end ([`GivenUpRead::ended`]).
const OVER: u8 = 1;
/// No longer watched ([`GivenUpRead::abandon`], or dropped).
const ABANDONED: u8 = 2;

/// A read given up while its transfer was in progress
/// ([`TransferGuard::give_up`]): the runtime's token for the read's destination
/// buffer, and the fence on the engine while the transfer may still run.
///
/// The request is failed at once, but the transfer is not over, so until
/// it is the engine is not released (its memory may still be read) and
/// the destination is not reused (its bytes may still land). The runtime
/// keeps polling the transfer (NIXL's `getXferStatus`) and calls
/// [`GivenUpRead::ended`] with the status it ended with: it completes
/// when a frozen prefill resumes and fails when it dies (measured on
/// NIXL 1.5.1, `cli/tests/real_buffer.rs`). The destination is then
/// reusable, and a marked engine is released once its last transfer
/// ends. This is the design in `docs/design/given-up-transfers.md`: it
/// needs no proof from the transport that a transfer is over.
///
/// A runtime that cannot watch the transfer any more (it released NIXL's
/// request, or it is stopping) calls [`GivenUpRead::abandon`] (dropping
/// the token does the same): the engine may then be released under the
/// transfer, and the destination is decided when that release comes back
/// (see [`Destination`]). Engines still held when the service stops
/// never decide: retire their buffers.
#[must_use = "dropping a given-up read abandons its transfer: call `ended` when it ends, or its buffer may have to be retired"]
pub struct GivenUpRead {
    cell: Arc<EngineCell>,
    why: GiveUp,
    /// What the read's begin returned: its end is counted with it.
    begun: u64,
    /// The give-up, as the core knows it.
    token: u64,
    /// [`WATCHED`], [`OVER`] or [`ABANDONED`]; changes once.
    watch: AtomicU8,
    /// Wakes [`GivenUpRead::destination`] when `watch` changes.
    changed: Event,
}

impl GivenUpRead {
    /// The engine the read was from.
    pub fn engine(&self) -> &EngineId {
        self.cell.id()
    }

    /// Why it was given up.
    pub fn why(&self) -> GiveUp {
        self.why
    }

    /// The transfer ended, with this raw NIXL status (what
    /// `getXferStatus` said once it stopped saying in progress, or the
    /// error it returned): no byte can land any more, and the destination
    /// is reusable. An error reaches the service as any read's does (a
    /// REMOTE_DISCONNECT marks the engine) before the read stops counting.
    /// Only the first call (or `abandon`) counts; a later call still says
    /// [`Destination::Reusable`]: the transfer is over.
    pub fn ended(&self, status: NixlStatus) -> Destination {
        if self.settle(OVER) {
            self.cell.report(status);
            self.cell
                .end_given_up(self.begun, self.token, true, status.is_ok());
        }
        Destination::Reusable
    }

    /// Stops watching the transfer without seeing it end (the runtime
    /// released NIXL's request, or is stopping): it stops counting as in
    /// flight, so the engine may be released under it, and the destination
    /// is decided when that release comes back ([`Destination`]). Does
    /// nothing after [`GivenUpRead::ended`].
    pub fn abandon(&self) {
        if self.settle(ABANDONED) {
            self.cell.end_given_up(self.begun, self.token, false, false);
        }
    }

    /// Moves a watched read to `to`; false when it was settled already.
    fn settle(&self, to: u8) -> bool {
        let moved = self
            .watch
            .compare_exchange(WATCHED, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if moved {
            self.changed.notify(usize::MAX);
        }
        moved
    }

    /// Whether the transfer is still watched (neither `ended` nor
    /// `abandon` was called).
    pub fn is_watched(&self) -> bool {
        self.watch.load(Ordering::Acquire) == WATCHED
    }

    /// What may become of the destination buffer: [`Destination::Reusable`]
    /// once the transfer ended; for an abandoned transfer, the answer once
    /// the engine's release has come back; `None` before.
    pub fn try_destination(&self) -> Option<Destination> {
        match self.watch.load(Ordering::Acquire) {
            OVER => Some(Destination::Reusable),
            ABANDONED => self.cell.release_done().is_set().then(|| self.decided()),
            _ => None,
        }
    }

    /// Resolves with what may become of the destination buffer: when
    /// [`GivenUpRead::ended`] is called, or, after
    /// [`GivenUpRead::abandon`], when the engine's release has come back.
    /// Cancel safe.
    pub async fn destination(&self) -> Destination {
        loop {
            // Registered before the look: a change in between is not missed.
            let listener = self.changed.listen();
            match self.watch.load(Ordering::Acquire) {
                OVER => return Destination::Reusable,
                ABANDONED => {
                    self.cell.release_done().wait().await;
                    return self.decided();
                }
                _ => listener.await,
            }
        }
    }

    fn decided(&self) -> Destination {
        if self.cell.transfers_ended() {
            Destination::Reusable
        } else {
            Destination::Retire
        }
    }
}

impl Drop for GivenUpRead {
    fn drop(&mut self) {
        self.abandon();
    }
}

impl fmt::Debug for GivenUpRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GivenUpRead")
            .field("engine", self.engine())
            .field("why", &self.why)
            .field("watched", &self.is_watched())
            .field("destination", &self.try_destination())
            .finish()
    }
}
