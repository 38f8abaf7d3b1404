//! Real prefill (P) and decode (D) processes on the NIXL runtime: the side
//! channel, the prefill server and the decode-side reader.
//!
//! This is what `nixl-keepalive prefill` and `nixl-keepalive decode` run,
//! and what the real-process tests drive. DRAM only, UCX over shared
//! memory or TCP: no GPU needed.
//!
//! # The side-channel protocol
//!
//! One TCP connection per handshake. D connects to P's `host:port`, sends
//! one request frame, reads one reply frame; P closes the connection.
//!
//! Every frame is a 4-byte big-endian payload length (at most
//! [`wire::MAX_FRAME`] bytes; a request at most [`wire::MAX_REQUEST`])
//! followed by the payload. Integers are big-endian; a `str16` is a `u16`
//! length and that many UTF-8 bytes; a `bytes32` a `u32` length and bytes.
//!
//! ```text
//! request  = "NKPD" version:u8(=1) kind:u8(=1 handshake)
//! reply    = "NKPD" version:u8(=1) kind:u8(=2 handshake reply)
//!            engine_id:str16          1..=256 bytes, printable
//!            incarnation:u64          random per process start
//!            block_size:u64           bytes per KV block, 1..=64 MiB
//!            blocks:u32               blocks per rank, 1..=2^20, and
//!                                     blocks * block_size <= 1 TiB,
//!                                     blocks * ranks <= 2^22
//!            ranks:u16                1..=64, then per rank, in rank order:
//!              agent:str16            the rank's NIXL agent name,
//!                                     1..=256 bytes, printable
//!              base:u64               address of block 0 in P's memory
//!              metadata:bytes32       the agent's NIXL metadata blob
//! ```
//!
//! "Printable" is the library's rule for every name from a peer
//! (`nixl_keepalive::text::check_name`): no control character (a newline in
//! an engine id once forged an `event: released` line on the decode's
//! stdout). The block bounds keep what the decoder builds from a reply
//! bounded: one descriptor per block and rank (`u32::MAX` blocks of one
//! byte once passed the parser, and loading it collected billions of
//! descriptors); [`wire::MAX_RANK_BYTES`], [`wire::MAX_BLOCKS`] and
//! [`wire::MAX_DESCRIPTORS`] say why each is what it is.
//!
//! Every rank names its own agent: a reply in which two ranks name one
//! agent is refused (NIXL keeps one metadata entry per agent name, so both
//! ranks would read one rank's memory).
//!
//! Block `b` of rank `r` lives at `base_r + b * block_size` and holds the
//! byte pattern [`pattern::fill`] derives from the engine id, `r` and `b`,
//! so D can check every byte it reads. Nothing may follow the last field.
//! A frame that breaks any rule is refused with a [`wire::WireError`]: the
//! connection is closed, the error is logged, never a panic.
//!
//! # What is counted
//!
//! - `nixl_keepalive_pd_bad_frames_total{side}`: frames that arrived whole
//!   (or announced a length over the limit) and broke the format: bad
//!   magic, version or kind, too long, truncated fields, trailing bytes,
//!   out-of-range fields, two ranks naming one agent. `side="prefill"`: a
//!   bad request reached a prefill; `side="decode"`: a bad reply reached a
//!   decoder. A connection that fails, closes early or times out is not a
//!   bad frame: see the next metric and `..._side_channel_drops_total`.
//! - `nixl_keepalive_pd_handshake_failures_total{reason}` (decode side):
//!   every handshake that did not register an engine, once, by its first
//!   cause: `connect` (nobody answered: refused, reset, connect timeout),
//!   `io` (the connection failed mid-frame), `eof` (closed before the whole
//!   reply), `timeout` (no whole reply within the handshake timeout),
//!   `bad_frame` (also counted above), `load` (NIXL refused the metadata or
//!   a dlist), `agent_mismatch` (the metadata names another agent than the
//!   reply), `stopped` (the service stopped).
//! - `nixl_keepalive_pd_side_channel_drops_total{reason}` (prefill side):
//!   connections closed unanswered: `evicted` (the oldest connection
//!   still waiting for its request, closed to make room when every slot
//!   was taken), `busy` (every slot was answering a request), `io`, `eof`
//!   (closed before a whole request), `timeout` (no whole request, or the
//!   reply not taken, within the per-connection deadline). See
//!   [`prefill::Prefill::serve`].
//!
//! The `incarnation` tells D whether the process behind an engine id is
//! the one it loaded: the same engine id with a new incarnation is a
//! prefill restarted under a pinned id, whose old metadata must be
//! invalidated before the new is loaded.
//!
//! # Notifications (over NIXL, not the side channel)
//!
//! A read belongs to a request; its id (`<decode agent>-<n>`, unique per
//! request) is leased at P from when D schedules it until its read
//! completes, with vLLM's rules ([`lease`]; the lease length is P's
//! `--lease-secs`, 30 s by default):
//!
//! - `RQ:<request>`: D schedules a request, just before posting its READ
//!   (it stands in for the router handing the request to P: in vLLM, P
//!   knows the request first). P holds its blocks until now + lease.
//! - `HB:<request>,<request>`: D's heartbeat, vLLM's lease renewal, built
//!   by the keepalive service from D's lease set: exactly the requests
//!   still pending at that engine (none: `HB:`). P sets each named live
//!   request's expiry to max(old, now + 2/3 lease); unknown ids are
//!   ignored.
//! - `RD:<request>`: sent by NIXL to P when the request's READ completes;
//!   then D removes the lease. P frees the request's blocks. An `RD:`
//!   after the lease ran out is a read of freed blocks: P logs it as an
//!   error and counts it (`late_reads` in its lease summary).

pub mod decode;
pub mod lease;
pub mod pattern;
pub mod prefill;
pub mod retry;
pub mod wire;

/// Counts and logs a frame a peer got wrong (see "What is counted"). `side` is `prefill` (a bad
/// request reached a prefill) or `decode` (a bad reply reached a decoder);
/// `peer` is who sent it, its full address (host and port: two broken
/// peers on one host are two peers, and the second is not hidden behind
/// the first). One WARN per side, peer and kind of error per period, with
/// the count it stands for; over all peers, the process's log budget
/// (`log_limit::LineBudget`) caps the lines a second, so a client that
/// reconnects in a loop (a new port each time) costs at most that.
pub(crate) fn bad_frame(side: &'static str, peer: &str, error: &wire::WireError) {
    type Key = (&'static str, String, &'static str);
    static LOG: std::sync::LazyLock<std::sync::Mutex<nixl_keepalive::log_limit::LogLimiter<Key>>> =
        std::sync::LazyLock::new(Default::default);
    metrics::counter!("nixl_keepalive_pd_bad_frames_total", "side" => side).increment(1);
    let told = LOG.lock().unwrap_or_else(|e| e.into_inner()).admit(
        (side, peer.to_string(), error.kind()),
        tokio::time::Instant::now(),
    );
    if let Some(suppressed) = told {
        let peer = nixl_keepalive::text::Escaped(peer);
        tracing::warn!(side, %peer, %error, suppressed, "bad side-channel frame refused");
    }
}
