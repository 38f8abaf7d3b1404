//! How a [`super::Decoder`] reads ([`DecodeOptions`]): what the `decode`
//! command's flags (and the tests) set, with the defaults they start from.

use std::time::Duration;

use super::transfer::Direction;
use crate::pd::prefill::Memory;

/// How a [`Decoder`](super::Decoder) reads.
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    /// Reads in flight per prefill (also the landing slots per engine).
    pub reads_in_flight: usize,
    /// A read still in progress after this is abandoned.
    pub read_timeout: Duration,
    /// Side-channel connect and reply timeout.
    pub handshake_timeout: Duration,
    /// First pause after a failed handshake; it doubles with each failure
    /// in a row, up to `retry_max` ([`crate::pd::retry`]).
    pub retry: Duration,
    /// The longest pause between handshake attempts.
    pub retry_max: Duration,
    /// At most one WARN per this long about a prefill that keeps failing
    /// for one reason (each reason has its own; each line says how many
    /// failures it stands for).
    pub warn_every: Duration,
    /// How often a connected address is asked again who is there (a new
    /// engine id or incarnation there is a replacement).
    pub probe_interval: Duration,
    /// Pause between rounds of reads (`reads_in_flight` reads each).
    pub read_pause: Duration,
    /// Where the landing slots are, and where the prefills' KV caches are
    /// taken to be (see [`RemoteEngine::load_in`](super::RemoteEngine::load_in)).
    pub memory: Memory,
    /// Which way [`Decoder::spawn`](super::Decoder::spawn)'s transfers go: pull mode's reads, or
    /// push mode's writes (`prefill --push`).
    pub direction: Direction,
    /// Whether each read's bytes are checked (see
    /// [`RemoteEngine::unchecked`](super::RemoteEngine::unchecked)).
    pub check: bool,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            reads_in_flight: 2,
            read_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(2),
            retry: Duration::from_millis(250),
            retry_max: Duration::from_secs(4),
            warn_every: Duration::from_secs(30),
            probe_interval: Duration::from_secs(2),
            read_pause: Duration::from_millis(20),
            memory: Memory::Dram,
            direction: Direction::Read,
            check: true,
        }
    }
}
