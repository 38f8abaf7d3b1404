//! The known byte pattern of a prefill's "KV cache", so a decoder can check
//! every byte it reads.
//!
//! Each block's bytes are a function of the engine id, the rank and the
//! block index: two engines (and two blocks) almost never share bytes, so a
//! read from the wrong engine, rank or block is caught.
//!
//! In push mode the bytes go the other way: a prefill writes block `b` of
//! rank `r` of a decode with the pattern of [`write_seed`] (the decode's
//! engine id and the request), and the decode checks them when the
//! write's `WR:` notification arrives: a write that landed in the wrong
//! block, a stale write of another request, or a write that never landed
//! is caught.

/// The pattern seed of an engine id (FNV-1a, 64-bit).
pub fn seed(engine: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in engine.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The pattern seed of one push-mode write: the receiving engine's id and
/// the request, so that each request's bytes differ from every other's
/// in the same block.
pub fn write_seed(engine: &str, request: &str) -> u64 {
    seed(engine) ^ splitmix64(seed(request))
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn word(seed: u64, rank: u16, block: u32, index: usize) -> [u8; 8] {
    let key = seed
        ^ u64::from(rank).wrapping_mul(0xd6e8_feb8_6659_fd93)
        ^ u64::from(block).wrapping_mul(0xa076_1d64_78bd_642f);
    splitmix64(key.wrapping_add(index as u64)).to_le_bytes()
}

/// Fills `buf` with block `block` of rank `rank`.
pub fn fill(buf: &mut [u8], seed: u64, rank: u16, block: u32) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = word(seed, rank, block, i);
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The offset of the first byte of `buf` that differs from block `block`
/// of rank `rank`, or `None` when every byte matches.
pub fn first_mismatch(buf: &[u8], seed: u64, rank: u16, block: u32) -> Option<usize> {
    for (i, chunk) in buf.chunks(8).enumerate() {
        let w = word(seed, rank, block, i);
        if let Some(j) = chunk.iter().zip(w.iter()).position(|(a, b)| a != b) {
            return Some(i * 8 + j);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_requests_write_different_bytes_into_one_block() {
        let mut a = vec![0u8; 256];
        fill(&mut a, write_seed("d", "p-rank0-1"), 0, 3);
        assert_eq!(first_mismatch(&a, write_seed("d", "p-rank0-1"), 0, 3), None);
        assert_eq!(
            first_mismatch(&a, write_seed("d", "p-rank0-2"), 0, 3),
            Some(0)
        );
        assert_eq!(
            first_mismatch(&a, write_seed("e", "p-rank0-1"), 0, 3),
            Some(0)
        );
        assert_eq!(first_mismatch(&a, seed("d"), 0, 3), Some(0));
    }

    #[test]
    fn a_filled_block_checks_and_other_blocks_do_not() {
        let s = seed("engine-a");
        let mut buf = vec![0u8; 1001];
        fill(&mut buf, s, 1, 7);
        assert_eq!(first_mismatch(&buf, s, 1, 7), None);
        assert!(first_mismatch(&buf, s, 1, 8).is_some());
        assert!(first_mismatch(&buf, s, 0, 7).is_some());
        assert!(first_mismatch(&buf, seed("engine-b"), 1, 7).is_some());
        buf[1000] ^= 1;
        assert_eq!(first_mismatch(&buf, s, 1, 7), Some(1000));
    }
}
