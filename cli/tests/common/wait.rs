//! Waiting for a state, the one way the real tests do it: poll what is
//! asserted until it holds, at most until a deadline derived from the
//! bound under test plus [`MARGIN`], and on the deadline panic with what
//! was last seen. A real test never sleeps and then asserts on something
//! another thread or process may still be writing.
#![allow(dead_code)]

use std::fmt::Debug;
use std::time::{Duration, Instant};

/// What a deadline adds to the bound under test: scheduling on a loaded
/// 2-core machine (a process that is not run for seconds at a time), never
/// the bound itself. A wait that needs more than this past its bound is a
/// defect, not a slow machine.
pub const MARGIN: Duration = Duration::from_secs(10);

/// How often a condition is polled.
pub const POLL: Duration = Duration::from_millis(10);

/// Polls `probe` every [`POLL`] until it returns `Ok`, at most `within`;
/// returns its value. On the deadline panics naming `what`, with the last
/// `Err` (what was seen then).
pub fn until<T, S: Debug>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Result<T, S>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(t) = attempt(what, within, deadline, &mut probe) {
            return t;
        }
        std::thread::sleep(POLL);
    }
}

/// One poll of [`until`] and [`until_async`]: the value, or `None` to poll
/// again; past the deadline, the panic that names what was seen.
fn attempt<T, S: Debug>(
    what: &str,
    within: Duration,
    deadline: Instant,
    probe: &mut impl FnMut() -> Result<T, S>,
) -> Option<T> {
    match probe() {
        Ok(t) => Some(t),
        Err(seen) if Instant::now() >= deadline => {
            panic!("{what}: not within {within:?}; last seen: {seen:#?}")
        }
        Err(_) => None,
    }
}

/// [`until`] in async code: sleeps on tokio between polls.
pub async fn until_async<T, S: Debug>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Result<T, S>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(t) = attempt(what, within, deadline, &mut probe) {
            return t;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `Ok(())` when `holds`, else `Err(seen)`: a condition for [`until`].
pub fn check<S>(holds: bool, seen: S) -> Result<(), S> {
    if holds {
        Ok(())
    } else {
        Err(seen)
    }
}
