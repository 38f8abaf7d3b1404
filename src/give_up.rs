//! Why the runtime stopped waiting for a read: a leaf both the read
//! guards (`engine`) and the core's stall rules (`core`) name, so neither
//! depends on the other for it.

/// Why the runtime stopped waiting for a read whose transfer was still in
/// progress. See [`crate::TransferGuard::give_up`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GiveUp {
    /// The runtime's read timeout passed: its own verdict that the engine
    /// is hung. When no read of the engine completed while this one was in
    /// flight, and the decoder's reads from other engines still complete
    /// (or no other engine has reads to compare with), the service treats
    /// the engine as stalled at once, as if the read-stall bound had
    /// passed: the read timeout is then the bound (keep it far above a
    /// read's time). Nothing is marked when the read-stall check is off
    /// (`NIXL_KEEPALIVE_READ_STALL=inf`).
    TimedOut,
    /// Given up for the runtime's own reasons: the request was aborted,
    /// the decoder is stopping, or the service failed the engine's reads.
    /// Not evidence about the engine, and not a completion either: the
    /// engine's stall clock keeps running as if the read were in flight.
    Cancelled,
}

impl GiveUp {
    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            GiveUp::TimedOut => "timed_out",
            GiveUp::Cancelled => "cancelled",
        }
    }
}
