//! Cluster membership: which prefill engines exist, as a membership plane
//! (etcd) says, turned into the service's inputs.
//!
//! A prefill engine registers itself under a key of a prefix, attached to a
//! lease it keeps alive (NVIDIA Dynamo does the same for its workers). The
//! decoder watches the prefix:
//!
//! - a key that appears: the engine is announced
//!   ([`MembershipUpdate::Joined`]); the runtime handshakes with it (the
//!   handshake stays the runtime's: this module never loads metadata);
//! - a key deleted, or its lease expired (etcd deletes the key): the engine
//!   is retired with [`KeepaliveHandle::peer_gone`](crate::KeepaliveHandle::peer_gone) in the configured
//!   [`GoneMode`](crate::GoneMode) (drain by default), and the time from seeing the
//!   deletion to the release lands in a histogram;
//! - a key whose value names a new engine id at the same address (or a new
//!   key at an address another engine held): the old engine is retired, it
//!   was replaced;
//! - after a compaction, an outage or a reconnection, the prefix is listed
//!   again and reconciled: engines missing from the list are retired, new
//!   ones announced, so no removal is lost;
//! - **the membership plane being unreachable or slow is never a removal**:
//!   every engine is kept (its heartbeats go on: they are the service's,
//!   not this module's), the outage is reported (an update, the
//!   `nixl_keepalive_membership_watch_up` gauge, warnings that back off
//!   with the retries), and the prefix is reconciled when the watch is back.
//!
//! # Key schema
//!
//! One key per engine: `<prefix><engine id>` (default prefix
//! [`DEFAULT_PREFIX`], `/nixl-keepalive/prefill/`), attached to the
//! engine's lease, whose value is a JSON object ([`Member`]):
//!
//! ```json
//! {"engine_id": "8c1e...-uuid", "address": "10.0.0.7:17001", "ranks": 2}
//! ```
//!
//! - `engine_id`: the engine id its handshake reports, 1 to 256 bytes of
//!   printable text (no control characters: no NUL, ESC or newline);
//! - `address`: its side-channel address, `host:port`, at most
//!   [`MAX_ADDRESS`] bytes: a DNS name, an IPv4 address or a bracketed
//!   IPv6 address, then a port from 1 to 65535;
//! - `ranks`: its ranks (NIXL agents), 1 to 64.
//!
//! Only the record under an engine's own key speaks for it: a
//! well-formed record under any other key (a copy of a live prefill's
//! record, whatever it names) is refused as
//! [`SchemaError::NotCanonical`], never a member, so its removal retires
//! nothing (see `docs/design/membership-resets.md`).
//!
//! A value is at most [`MAX_RECORD`] bytes (checked before it is parsed)
//! and a key at most [`MAX_KEY`]. Unknown fields are ignored (room to
//! grow). A record that breaks these rules is refused: counted by reason
//! (`nixl_keepalive_membership_bad_values_total{reason}`), logged at a
//! bounded rate with its key escaped and cut (see [`SchemaError::reason`]),
//! and the key is treated as unchanged: never a panic, never a removal.
//!
//! # Revisions
//!
//! etcd gives every event of one transaction the same revision: a prefix
//! delete of 10 keys, a 5-put transaction, or the revocation of a lease
//! that held several keys arrive as several events with one revision (as
//! measured on etcd 3.4). Every event is applied, in order, whatever its
//! revision; the revision is kept only to resume the watch.
//!
//! # A store reset
//!
//! An etcd restarted with a wiped data directory (or restored from an old
//! snapshot) lost its data, which is no evidence that any engine died. Its
//! first list is a **store reset** when anything says it is another store:
//! its cluster id changed, its revision is below the last one seen, or
//! its store epoch (a value the source keeps in the store itself, see
//! [`SourceEvent::Listed`]) changed, appeared or vanished. The epoch is
//! what tells an etcd restarted empty with the same flags, which keeps its
//! cluster id, and whose revision other writers may have taken past the
//! last one seen. So it is handled as an
//! outage followed by a grace period of [`MembershipConfig::reset_grace`]
//! (set it to the prefills' lease TTL: a prefill whose lease is gone
//! registers again within about a third of it): the engines the new store
//! lists are kept or announced, the ones it lacks are kept and awaited,
//! and only those still missing when the grace period ends are retired
//! ([`RetireWhy::MissingAfterReset`]). The grace period starts again with
//! every list of the prefix while engines are still awaited (an outage
//! during it gives them no chance to register).
//!
//! # Parts
//!
//! - [`MembershipSource`]: where changes come from; [`memory`] (in-memory,
//!   for tests on tokio's paused clock) and, with the `etcd` feature,
//!   `etcd` (a watch on etcd with the `etcd-client` crate, and the prefill
//!   side's lease-backed registration).
//! - [`Reconciler`]: a synchronous state machine from source events to
//!   [`Decision`]s; no clock, no I/O.
//! - [`spawn`]: the membership task; it applies the actions to a
//!   [`KeepaliveHandle`](crate::KeepaliveHandle) and tells the runtime through
//!   [`MembershipUpdate`]s.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod memory;
mod reconciler;
mod refusals;
mod schema;
mod task;

pub use reconciler::{Decision, MembershipSource, Reconciler, RetireWhy, SourceEvent};
pub use refusals::{REFUSALS_BURST, REFUSALS_PERIOD};
pub use schema::{Member, SchemaError, DEFAULT_PREFIX, MAX_KEY, MAX_RECORD};
pub use task::{spawn, MembershipConfig, MembershipUpdate};

pub use crate::text::{MAX_ADDRESS, MAX_ENGINE_ID, MAX_RANKS};
