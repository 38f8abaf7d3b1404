//! The decode side: handshakes with prefills over the side channel, loads
//! their metadata into the decode agent, registers them with the keepalive
//! service, and reads random blocks, checking every byte.
//!
//! Layers, lowest first (tests use each):
//! - [`fetch`]: one side-channel handshake, no NIXL;
//! - [`RemoteEngine::load`]: `loadRemoteMD` per rank, remote dlists
//!   prepped (one descriptor per block), local landing slots registered;
//!   [`RemoteEngine::read_block`]: one READ, polled to its end, bytes
//!   checked;
//! - landing slots: a READ given up in progress keeps its slot (see
//!   [`ReadOutcome::lent_slot`]): NIXL 1.5.1 may still write it (measured,
//!   `cli/tests/real_buffer.rs`). The [`Decoder`] keeps the READ's request
//!   and watches it to its end (it completes when a frozen prefill resumes,
//!   fails when it dies), tells the service ([`nixl_keepalive::GivenUpRead::ended`]: the
//!   engine is not released before) and hands the slot back;
//! - [`Decoder`]: the above with the service, through the library's
//!   handshake protocol (`handshake`, `ready_to_load`, `register`),
//!   read guards reporting each transfer's status; [`Decoder::spawn`] runs
//!   the whole loop for one prefill address, re-handshaking after a
//!   release once something listens again.
//!
//! One file per concern: `handshake.rs` (the side channel's reply, no
//! NIXL), `remote.rs` (one loaded engine and one transfer on it),
//! `transfer.rs` (the words they share: direction, target, outcome),
//! `connect.rs` (one engine's start-up: the reply, the library's protocol,
//! the load, in one function), `reads.rs` (one request under its guard and
//! lease), `reader.rs` (the loop of one prefill address), `options.rs`
//! and `stats.rs` (what the `decode` command sets and prints). This file
//! holds the [`Decoder`] they are methods of.
//!
//! # Push mode
//!
//! The same initiator writes instead of reading ([`Direction::Write`]:
//! `prefill --push`, the keepalive embedded in the prefill for every
//! decode it writes to). The peer is then a push-mode decode
//! (`decode --push`, [`super::prefill::Role::Sink`]): the handshake, the
//! loads, the registration, the leases and the guards are the same; a
//! write fills its local slot with the request's bytes
//! ([`super::pattern::write_seed`] of the decode's engine id and the request),
//! WRITEs it into the decode's block with the completion notification
//! `WR:<request>:<rank>:<block>`, and the decode checks the bytes. The
//! guard ([`nixl_keepalive::EngineRef::begin_write_owned`]) holds the release off while
//! the write is in flight, as a read's does.

mod connect;
mod handshake;
mod options;
mod reader;
mod reads;
mod remote;
mod stats;
mod transfer;

pub use connect::{claim_of, Connected, Found};
pub use handshake::{fetch, HandshakeError};
pub use options::DecodeOptions;
pub use remote::RemoteEngine;
pub use stats::{ReadStats, COMPLETIONS_KEPT, GIVEN_UP_KEPT};
pub use transfer::{Direction, ReadOutcome, Target};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nixl_keepalive::log_limit::LogLimiter;
use nixl_keepalive::transport::nixl::{NixlTransport, RemoteDlists};
use nixl_keepalive::KeepaliveHandle;
use nixl_keepalive::PeerAddr;

/// The decode side: the service's handle, the transport, and readers.
pub struct Decoder {
    handle: KeepaliveHandle<RemoteDlists>,
    transport: Arc<NixlTransport>,
    options: DecodeOptions,
    stats: Arc<ReadStats>,
    /// Request ids are `<decode agent>-<n>`: unique per request, and per
    /// decoder across decoders (agent names are unique).
    next_request: AtomicU64,
    /// Registrations this decoder loaded, until released.
    loaded: Mutex<Vec<Connected>>,
    /// Handshake-failure WARNs, one per prefill address and reason per
    /// `warn_every`, shared by every reader: a reader started again for
    /// the same address (a record flapped in etcd) does not start a fresh
    /// budget, and one reader's flood does not hide another's first line.
    handshake_log: Mutex<LogLimiter<(PeerAddr, &'static str)>>,
}

impl Decoder {
    /// A decoder over a running service and its transport.
    pub fn new(
        handle: KeepaliveHandle<RemoteDlists>,
        transport: Arc<NixlTransport>,
        options: DecodeOptions,
    ) -> Arc<Decoder> {
        Arc::new(Decoder {
            handle,
            transport,
            stats: Arc::default(),
            next_request: AtomicU64::new(0),
            handshake_log: Mutex::new(LogLimiter::new(
                options.warn_every,
                nixl_keepalive::log_limit::LOG_KEYS * 16,
            )),
            loaded: Mutex::default(),
            options,
        })
    }

    /// Which way [`Decoder::spawn`]'s transfers go.
    pub fn direction(&self) -> Direction {
        self.options.direction
    }

    /// A fresh request id, never used before by this decoder.
    pub fn next_request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.transport.agent().name())
    }

    /// The service's handle.
    pub fn handle(&self) -> &KeepaliveHandle<RemoteDlists> {
        &self.handle
    }

    /// Read outcomes so far.
    pub fn stats(&self) -> &ReadStats {
        &self.stats
    }
}
