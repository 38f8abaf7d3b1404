//! Read accounting: how many reads of each registration are in flight and
//! how many completed, counted on the hot path of every read without a
//! lock. Shared-memory concurrency, not rules: the owner's thread counts
//! with plain stores, every other thread with one atomic word, and a mark
//! makes every thread pass a full fence (`barrier`, a membarrier) before
//! the count is trusted. The core ([`crate::core`]) reads these counts to
//! decide; the proof that they are right is written beside them
//! (`cell`'s module docs).

mod barrier;
pub(crate) mod cell;
