//! The side channel's frames: encoding, and decoding that refuses anything
//! off the format with a typed error (see the [module docs](super)).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest payload accepted (a reply with its metadata blobs).
pub const MAX_FRAME: u32 = 16 << 20;
/// The largest request payload accepted.
pub const MAX_REQUEST: u32 = 64;
use nixl_keepalive::text::{check_name, Escaped};
/// The largest engine id and agent name, and the most ranks a reply may
/// list: the library's bounds, the same for every source.
pub use nixl_keepalive::text::{MAX_AGENT_NAME, MAX_ENGINE_ID, MAX_RANKS};
/// The largest block size.
pub const MAX_BLOCK_SIZE: u64 = 64 << 20;
/// The most KV memory one rank may describe (`blocks * block_size`): 1 TiB,
/// above any accelerator's memory today (a GB300 has 288 GB).
pub const MAX_RANK_BYTES: u64 = 1 << 40;
/// The most blocks one rank may list. The decoder builds one descriptor
/// per block (24 bytes each) when it loads the reply: 2^20 blocks are 24
/// MiB of descriptors per rank.
pub const MAX_BLOCKS: u32 = 1 << 20;
/// The most blocks a whole reply may list over all its ranks (`blocks *
/// ranks`): 96 MiB of descriptors at most, whatever the peer says.
pub const MAX_DESCRIPTORS: u64 = 1 << 22;

const MAGIC: &[u8; 4] = b"NKPD";
const VERSION: u8 = 1;
const KIND_HANDSHAKE: u8 = 1;
const KIND_REPLY: u8 = 2;

/// A frame that was refused. Nothing was loaded or changed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed or closed mid-frame.
    #[error("side channel I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer did not send a whole frame in time.
    #[error("no complete frame within {0:?}")]
    Timeout(Duration),
    /// The length prefix exceeds what this frame kind may carry.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// The announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The payload does not start with `NKPD`.
    #[error("bad magic (not a nixl-keepalive side channel)")]
    BadMagic,
    /// A protocol version this build does not speak.
    #[error("unsupported protocol version {0}")]
    Version(u8),
    /// A frame kind that does not belong here.
    #[error("unexpected frame kind {0}")]
    Kind(u8),
    /// The payload ended inside a field.
    #[error("payload truncated in {0}")]
    Truncated(&'static str),
    /// Bytes follow the last field.
    #[error("{0} trailing bytes after the last field")]
    Trailing(usize),
    /// A field is out of its range or not UTF-8.
    #[error("bad {field}: {reason}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl WireError {
    /// What kind of error, in one word: the key its log lines are limited
    /// by (with the peer).
    pub fn kind(&self) -> &'static str {
        match self {
            WireError::Io(_) => "io",
            WireError::Timeout(_) => "timeout",
            WireError::TooLong { .. } => "too_long",
            WireError::BadMagic => "bad_magic",
            WireError::Version(_) => "version",
            WireError::Kind(_) => "kind",
            WireError::Truncated(_) => "truncated",
            WireError::Trailing(_) => "trailing",
            WireError::Field { field, .. } => field,
        }
    }
}

/// One rank of a prefill engine, as the reply describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank's NIXL agent name.
    pub agent: String,
    /// Address of block 0 in the prefill's memory.
    pub base: u64,
    /// The agent's NIXL metadata.
    pub metadata: Vec<u8>,
}

/// What a prefill answers to a handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandshakeReply {
    /// The engine id.
    pub engine: String,
    /// Random per process start (see the module docs).
    pub incarnation: u64,
    /// Bytes per block.
    pub block_size: u64,
    /// Blocks per rank.
    pub blocks: u32,
    /// The ranks, in rank order.
    pub ranks: Vec<RankInfo>,
}

/// The request payload.
pub fn encode_request() -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.push(VERSION);
    v.push(KIND_HANDSHAKE);
    v
}

/// Checks a request payload.
pub fn decode_request(payload: &[u8]) -> Result<(), WireError> {
    let mut r = Reader(payload);
    header(&mut r, KIND_HANDSHAKE)?;
    r.end()
}

/// The reply payload.
pub fn encode_reply(reply: &HandshakeReply) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.push(VERSION);
    v.push(KIND_REPLY);
    put_str(&mut v, &reply.engine);
    v.extend_from_slice(&reply.incarnation.to_be_bytes());
    v.extend_from_slice(&reply.block_size.to_be_bytes());
    v.extend_from_slice(&reply.blocks.to_be_bytes());
    v.extend_from_slice(&(reply.ranks.len() as u16).to_be_bytes());
    for rank in &reply.ranks {
        put_str(&mut v, &rank.agent);
        v.extend_from_slice(&rank.base.to_be_bytes());
        v.extend_from_slice(&(rank.metadata.len() as u32).to_be_bytes());
        v.extend_from_slice(&rank.metadata);
    }
    v
}

/// Decodes and validates a reply payload.
pub fn decode_reply(payload: &[u8]) -> Result<HandshakeReply, WireError> {
    let mut r = Reader(payload);
    header(&mut r, KIND_REPLY)?;
    let engine = r.str16("engine_id")?;
    check_name("engine id", &engine, MAX_ENGINE_ID)
        .map_err(|e| field("engine_id", e.to_string()))?;
    let incarnation = r.u64("incarnation")?;
    let block_size = r.u64("block_size")?;
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return Err(field(
            "block_size",
            format!("{block_size}, expected 1..={MAX_BLOCK_SIZE}"),
        ));
    }
    let blocks = r.u32("blocks")?;
    if blocks == 0 || blocks > MAX_BLOCKS {
        return Err(field(
            "blocks",
            format!("{blocks}, expected 1..={MAX_BLOCKS}"),
        ));
    }
    // Both factors are bounded above: no overflow.
    let span = block_size * u64::from(blocks);
    if span > MAX_RANK_BYTES {
        return Err(field(
            "blocks",
            format!(
                "{blocks} blocks of {block_size} bytes are {span} bytes per rank; expected at most {MAX_RANK_BYTES} (1 TiB)"
            ),
        ));
    }
    let n = r.u16("ranks")?;
    if n == 0 || n > MAX_RANKS {
        return Err(field("ranks", format!("{n}, expected 1..={MAX_RANKS}")));
    }
    let descriptors = u64::from(blocks) * u64::from(n);
    if descriptors > MAX_DESCRIPTORS {
        return Err(field(
            "blocks",
            format!(
                "{blocks} blocks x {n} ranks are {descriptors} descriptors; expected at most {MAX_DESCRIPTORS}"
            ),
        ));
    }
    let mut ranks = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let agent = r.str16("agent")?;
        check_name("agent name", &agent, MAX_AGENT_NAME)
            .map_err(|e| field("agent", e.to_string()))?;
        let base = r.u64("base")?;
        if base.checked_add(span).is_none() {
            return Err(field("base", "base + blocks * block_size overflows".into()));
        }
        let len = r.u32("metadata")? as usize;
        let metadata = r.take(len, "metadata")?.to_vec();
        if metadata.is_empty() {
            return Err(field("metadata", "empty".into()));
        }
        if let Some(first) = ranks.iter().position(|r: &RankInfo| r.agent == agent) {
            return Err(duplicate_agent(first, ranks.len(), &agent));
        }
        ranks.push(RankInfo {
            agent,
            base,
            metadata,
        });
    }
    r.end()?;
    Ok(HandshakeReply {
        engine,
        incarnation,
        block_size,
        blocks,
        ranks,
    })
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    payload: &[u8],
) -> Result<(), WireError> {
    w.write_all(&(payload.len() as u32).to_be_bytes()).await?;
    w.write_all(payload).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame of at most `max` bytes within `timeout`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
    timeout: Duration,
) -> Result<Vec<u8>, WireError> {
    let read = async {
        let mut len = [0u8; 4];
        r.read_exact(&mut len).await?;
        let len = u32::from_be_bytes(len);
        if len > max {
            return Err(WireError::TooLong { len, max });
        }
        let mut payload = vec![0u8; len as usize];
        r.read_exact(&mut payload).await?;
        Ok(payload)
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| WireError::Timeout(timeout))?
}

/// The error for two ranks naming one agent: NIXL keeps one metadata entry
/// per agent name, so both ranks' reads would go to one rank's memory
/// (wrong bytes while the engine looks live), and releasing either would
/// invalidate both.
pub fn duplicate_agent(first: usize, second: usize, agent: &str) -> WireError {
    field(
        "agent",
        format!(
            "ranks {first} and {second} both name agent {:?}; each rank must have its own agent",
            Escaped(agent)
        ),
    )
}

/// The first two ranks of `reply` that name the same agent, if any.
pub fn find_duplicate_agent(reply: &HandshakeReply) -> Option<(usize, usize)> {
    reply.ranks.iter().enumerate().find_map(|(j, b)| {
        reply.ranks[..j]
            .iter()
            .position(|a| a.agent == b.agent)
            .map(|i| (i, j))
    })
}

fn field(field: &'static str, reason: String) -> WireError {
    WireError::Field { field, reason }
}

fn put_str(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(&(s.len() as u16).to_be_bytes());
    v.extend_from_slice(s.as_bytes());
}

fn header(r: &mut Reader<'_>, kind: u8) -> Result<(), WireError> {
    if r.take(4, "magic")? != MAGIC {
        return Err(WireError::BadMagic);
    }
    let version = r.u8("version")?;
    if version != VERSION {
        return Err(WireError::Version(version));
    }
    let k = r.u8("kind")?;
    if k != kind {
        return Err(WireError::Kind(k));
    }
    Ok(())
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated(what));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(
            self.take(2, what)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }

    fn str16(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u16(what)? as usize;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| field(what, "not UTF-8".into()))
    }

    fn end(&self) -> Result<(), WireError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply() -> HandshakeReply {
        HandshakeReply {
            engine: "e-1".into(),
            incarnation: 42,
            block_size: 4096,
            blocks: 8,
            ranks: vec![RankInfo {
                agent: "e-1-rank0".into(),
                base: 0x1000,
                metadata: vec![1, 2, 3],
            }],
        }
    }

    #[test]
    fn a_reply_round_trips() {
        let r = reply();
        assert_eq!(decode_reply(&encode_reply(&r)).unwrap(), r);
        decode_request(&encode_request()).unwrap();
    }

    #[test]
    fn every_truncation_and_any_trailing_byte_is_refused() {
        let bytes = encode_reply(&reply());
        for n in 0..bytes.len() {
            assert!(
                decode_reply(&bytes[..n]).is_err(),
                "prefix of {n} bytes accepted"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(decode_reply(&long), Err(WireError::Trailing(1))));
    }

    #[test]
    fn out_of_range_fields_are_refused() {
        let mut r = reply();
        r.ranks.clear();
        assert!(matches!(
            decode_reply(&encode_reply(&r)),
            Err(WireError::Field { field: "ranks", .. })
        ));
        let mut r = reply();
        r.block_size = 0;
        assert!(decode_reply(&encode_reply(&r)).is_err());
        let mut r = reply();
        r.ranks[0].base = u64::MAX - 10;
        assert!(decode_reply(&encode_reply(&r)).is_err());
        assert!(matches!(
            decode_reply(b"XXXX\x01\x02"),
            Err(WireError::BadMagic)
        ));
        assert!(matches!(
            decode_reply(b"NKPD\x02\x02"),
            Err(WireError::Version(2))
        ));
        assert!(matches!(
            decode_request(b"NKPD\x01\x02"),
            Err(WireError::Kind(2))
        ));
    }

    #[test]
    fn two_ranks_naming_one_agent_are_refused_with_both_ranks_named() {
        let mut r = reply();
        let mut second = r.ranks[0].clone();
        second.base = 0x9000;
        r.ranks.push(RankInfo {
            agent: "e-1-rank1".into(),
            ..second.clone()
        });
        decode_reply(&encode_reply(&r)).expect("distinct agents are fine");
        // Rank 2 names rank 0's agent (not adjacent: every pair is checked).
        r.ranks.push(second);
        assert_eq!(find_duplicate_agent(&r), Some((0, 2)));
        match decode_reply(&encode_reply(&r)) {
            Err(WireError::Field {
                field: "agent",
                reason,
            }) => {
                assert!(reason.contains("ranks 0 and 2"), "{reason}");
                assert!(reason.contains("e-1-rank0"), "{reason}");
            }
            other => panic!("accepted or wrong error: {other:?}"),
        }
    }

    fn refused_field(r: &HandshakeReply) -> (&'static str, String) {
        match decode_reply(&encode_reply(r)) {
            Err(WireError::Field { field, reason }) => (field, reason),
            other => panic!("not refused as a bad field: {other:?}"),
        }
    }

    #[test]
    fn a_reply_that_would_exhaust_the_decoder_is_refused_with_its_bound() {
        // u32::MAX blocks of one byte passed the parser, and loading it
        // collected billions of descriptors.
        let mut r = reply();
        r.blocks = u32::MAX;
        r.block_size = 1;
        let (field, reason) = refused_field(&r);
        assert_eq!(field, "blocks");
        assert!(reason.contains(&MAX_BLOCKS.to_string()), "{reason}");
        // Each factor in range, the product per rank not.
        let mut r = reply();
        r.blocks = MAX_BLOCKS;
        r.block_size = MAX_BLOCK_SIZE;
        let (field, reason) = refused_field(&r);
        assert_eq!(field, "blocks");
        assert!(reason.contains("1 TiB"), "{reason}");
        // Per rank in range, over all ranks not.
        let mut r = reply();
        r.blocks = MAX_BLOCKS;
        r.block_size = 1;
        r.ranks = (0..8)
            .map(|i| RankInfo {
                agent: format!("e-1-rank{i}"),
                base: 0x1000,
                metadata: vec![1],
            })
            .collect();
        let (_, reason) = refused_field(&r);
        assert!(reason.contains("descriptors"), "{reason}");
        // At the edges: accepted.
        let mut r = reply();
        r.blocks = MAX_BLOCKS;
        r.block_size = MAX_RANK_BYTES / u64::from(MAX_BLOCKS);
        r.ranks = (0..4)
            .map(|i| RankInfo {
                agent: format!("e-1-rank{i}"),
                base: 0x1000,
                metadata: vec![1],
            })
            .collect();
        decode_reply(&encode_reply(&r)).expect("the edge is accepted");
    }

    #[test]
    fn names_with_control_characters_or_over_their_bound_are_refused_and_printed_escaped() {
        // A newline in an engine id printed a forged `event: released` line.
        let mut r = reply();
        r.engine = "e-1\nevent: released engine=victim".into();
        let (field, reason) = refused_field(&r);
        assert_eq!(field, "engine_id");
        assert!(reason.contains("e-1\\nevent"), "{reason}");
        assert!(!reason.contains('\n'), "{reason}");
        let mut r = reply();
        r.engine = "e".repeat(MAX_ENGINE_ID + 1);
        assert_eq!(refused_field(&r).0, "engine_id");
        let mut r = reply();
        r.ranks[0].agent = "rank\u{1b}[2J".into();
        let (field, reason) = refused_field(&r);
        assert_eq!(field, "agent");
        assert!(!reason.contains('\u{1b}'), "{reason}");
        let mut r = reply();
        r.ranks[0].agent = "a".repeat(MAX_AGENT_NAME + 1);
        assert_eq!(refused_field(&r).0, "agent");
        let mut r = reply();
        r.ranks[0].agent = "victim-rank0\0zz".into();
        assert_eq!(refused_field(&r).0, "agent");
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut x: u64 = 1;
        for len in 0..400usize {
            let mut buf = encode_reply(&reply());
            for _ in 0..(len % 7 + 1) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let i = (x >> 33) as usize % buf.len();
                buf[i] = (x >> 20) as u8;
            }
            buf.truncate(len % (buf.len() + 1));
            let _ = decode_reply(&buf);
            let _ = decode_request(&buf);
        }
    }
}
