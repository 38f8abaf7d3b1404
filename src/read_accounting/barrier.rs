//! The asymmetric fence behind a registration's owner thread (see
//! [`super::cell`]): the thread that reads most pays nothing but ordinary
//! stores, and the rare side (a mark, before the core looks for reads in
//! flight) pays a `membarrier` system call that makes every thread of the
//! process pass a full fence.
//!
//! Why: a begin must publish "one more read" and then look at the state,
//! and a mark must publish the state and then look at the count. On x86
//! and Arm a store can be passed by a later load, so one of the two sides
//! needs a full fence. A locked instruction on every begin and end costs
//! about 10 ns each on the Intel VMs this project is lent (two of them
//! were the whole cost of a read); `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`
//! costs about 2 us per mark and nothing per read. The same split is
//! folly's `asymmetricLightBarrier`/`asymmetricHeavyBarrier` and liburcu's
//! membarrier flavour. rustix wraps the system call without `unsafe` here.
//!
//! Where the kernel refuses it (older than 4.14, or a seccomp profile that
//! blocks it) no thread ever owns a registration and every read takes the
//! atomic word, as before: correct everywhere, fast where allowed.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// A thread's token. Never reused: a registration owned by a thread that
/// has exited is owned by nobody alive, and its reads take the atomic word.
pub(crate) type ThreadToken = u32;

/// No thread owns the registration yet.
pub(crate) const NO_OWNER: ThreadToken = 0;

/// The token of a thread that may own nothing: tokens ran out (after
/// 4 * 10^9 threads), or its thread-local storage is gone.
pub(crate) const NOT_AN_OWNER: ThreadToken = ThreadToken::MAX;

static NEXT_TOKEN: AtomicU32 = AtomicU32::new(1);

thread_local! {
    static TOKEN: Cell<ThreadToken> = const { Cell::new(NO_OWNER) };
}

/// This thread's token, given at its first call.
#[inline]
pub(crate) fn this_thread() -> ThreadToken {
    TOKEN
        .try_with(|token| match token.get() {
            NO_OWNER => {
                let given = NEXT_TOKEN
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
                        (next < NOT_AN_OWNER).then_some(next + 1)
                    })
                    .unwrap_or(NOT_AN_OWNER);
                token.set(given);
                given
            }
            given => given,
        })
        .unwrap_or(NOT_AN_OWNER)
}

/// Whether the heavy barrier works in this process: registered once (the
/// kernel asks for it before the first use), then tried once.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| match register() {
        Ok(()) => {
            tracing::debug!("membarrier registered: reads count on their owner thread without a locked instruction");
            true
        }
        Err(e) => {
            tracing::info!(error = %e, "membarrier is not available: every read counts with an atomic read-modify-write (correct, slower)");
            false
        }
    })
}

/// Makes every thread of the process pass a full fence before it returns:
/// a store an owner made before that point is visible to the caller's
/// later loads, and an owner's load after it sees the caller's earlier
/// stores. Called only once [`available`] said yes (an owner exists).
pub(crate) fn heavy() {
    if let Err(e) = fence() {
        // Registered and tried at start: the kernel documents no failure
        // left. Should one happen, a full fence here and a yield, so the
        // owner's store buffer (drained in nanoseconds) has emptied.
        tracing::error!(error = %e, "membarrier failed after it had worked");
        std::sync::atomic::fence(Ordering::SeqCst);
        std::thread::yield_now();
    }
}

#[cfg(target_os = "linux")]
fn register() -> std::io::Result<()> {
    use rustix::thread::{membarrier, MembarrierCommand};
    membarrier(MembarrierCommand::RegisterPrivateExpedited)?;
    membarrier(MembarrierCommand::PrivateExpedited)?;
    Ok(())
}

#[cfg(target_os = "linux")]
fn fence() -> std::io::Result<()> {
    use rustix::thread::{membarrier, MembarrierCommand};
    Ok(membarrier(MembarrierCommand::PrivateExpedited)?)
}

#[cfg(not(target_os = "linux"))]
fn register() -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

#[cfg(not(target_os = "linux"))]
fn fence() -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_get_distinct_tokens_that_stay_theirs() {
        let here = this_thread();
        assert_eq!(here, this_thread());
        let there = std::thread::spawn(this_thread).join().unwrap();
        assert_ne!(here, there);
        assert!(![NO_OWNER, NOT_AN_OWNER].contains(&here));
    }

    /// The owner path is what the read benchmarks measure and what the
    /// cell's owner tests exercise: without the barrier they would test the
    /// atomic word twice. Loud where it is missing; a failure in CI.
    #[test]
    fn this_machine_has_the_barrier() {
        if !available() {
            eprintln!("SKIPPED: membarrier(PRIVATE_EXPEDITED) is refused here: the owner-thread read path is not tested");
            assert!(
                std::env::var_os("CI").is_none(),
                "CI machines must allow membarrier"
            );
            return;
        }
        heavy();
    }
}
