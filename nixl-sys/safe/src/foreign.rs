//! The TCP connections of remote agents that another NIXL binding loads
//! and invalidates (NIXL's Python API: the Python package and the vLLM
//! connector): recorded at the load ([`crate::EndpointCloser::around_load`]),
//! shut down at the release ([`crate::EndpointCloser::invalidate`]).
//!
//! The gap is the one [`crate::Agent`] closes for its own loads (see
//! `sockets.rs`): the forced close leaves the socket UCX shares between
//! both directions open until the *peer's* next UCX keepalive round, so a
//! router retiring a live prefill again and again runs both processes out
//! of descriptors (measured through NIXL's Python API: 100 releases of a
//! live 2-rank prefill at UCX's default settings, decode 29 -> 229
//! descriptors and prefill 41 -> 241, back only 20 s later; never with the
//! prefill's keepalive off).
//!
//! The look at the process's descriptors around a load is process-wide,
//! and a serving process has threads of its own that open sockets (vLLM's
//! handshakes with other engines, ZeroMQ, HTTP). So a socket enters a
//! record only when:
//! - it appeared during a load made through
//!   [`crate::EndpointCloser::around_load`], and loads made that way take
//!   one process-wide lock: two such loads are never looked at together,
//!   so one engine's UCX connections never land in another's record;
//! - it was set up as UCX sets up its connections (no close-on-exec flag,
//!   TCP keepalive on; see `sockets.rs`), which the sockets of Rust's std,
//!   tokio, Python and ZeroMQ are not;
//! - it was not accepted on a listening port of the process.
//!
//! A socket that misses any of these is only left to UCX, as before. What
//! is left out on purpose: the connections a peer opens *into* this
//! process's UCX listener (`Agent`'s third step) are not touched here:
//! the other binding's listening ports and loaded agents are not known.
//! Loads made without `around_load` are not recorded (their connections
//! close at the peer's keepalive).

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use crate::sockets::{self, Look};

/// (local agent, remote agent).
type Pair = (String, String);

fn recorded() -> MutexGuard<'static, HashMap<Pair, HashSet<u64>>> {
    static RECORDED: OnceLock<Mutex<HashMap<Pair, HashSet<u64>>>> = OnceLock::new();
    RECORDED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

fn loads() -> MutexGuard<'static, ()> {
    static LOADS: Mutex<()> = Mutex::new(());
    LOADS.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// Whether this thread is inside a recorded load: a load nested in
    /// another (a callback that loads again) runs unrecorded instead of
    /// waiting on the lock its own thread holds.
    static IN_LOAD: Cell<bool> = const { Cell::new(false) };
}

/// The UCX connections one load opened: name them with
/// [`LoadedConnections::belong_to`] once the load said which agent it was.
#[must_use = "name the connections with belong_to, or they are left to UCX at the release"]
#[derive(Debug, Default)]
pub struct LoadedConnections(Vec<u64>);

impl LoadedConnections {
    /// How many connections the load opened (0 when nothing was recorded).
    pub fn opened(&self) -> usize {
        self.0.len()
    }

    /// Records them as `local`'s connections to `remote`, added to those
    /// of its earlier loads that are still open.
    pub fn belong_to(self, local: &str, remote: &str) {
        if self.0.is_empty() {
            return;
        }
        let look = Look::now();
        let mut r = recorded();
        let entry = r.entry((local.to_owned(), remote.to_owned())).or_default();
        // What an earlier load recorded and UCX closed since (the peer's
        // keepalive, an invalidation made around this module): forgotten,
        // so that a pair loaded again and again stays a few entries.
        look.retain_open(entry);
        entry.extend(self.0);
    }
}

/// Runs `load` under the process-wide load lock with a look at the
/// process's TCP sockets before and after; returns the UCX connections
/// that appeared. `record` false (or a load nested in another): only runs
/// it.
pub(crate) fn around_load<T>(record: bool, load: impl FnOnce() -> T) -> (T, LoadedConnections) {
    if !record || !sockets::shutdown_on() || IN_LOAD.with(Cell::get) {
        return (load(), LoadedConnections::default());
    }
    let _lock = loads();
    IN_LOAD.with(|c| c.set(true));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_LOAD.with(|c| c.set(false));
        }
    }
    let _reset = Reset;
    let before = Look::now();
    let out = load();
    let opened = Look::now().opened_by_ucx_since(&before);
    (out, LoadedConnections(opened))
}

/// After `local` unloaded `remote`: forgets its recorded connections and,
/// with `shut`, shuts down those still open. Returns how many were shut
/// down, and how many of those UCX had not closed yet when it returned
/// (it closes them at its next progress of the worker, which NIXL's
/// progress thread or the next call makes).
pub(crate) fn released(local: &str, remote: &str, shut: bool) -> (u32, u32) {
    let inodes = recorded()
        .remove(&(local.to_owned(), remote.to_owned()))
        .unwrap_or_default();
    if !shut || inodes.is_empty() {
        return (0, 0);
    }
    let n = sockets::shut_down(&Look::now(), &inodes);
    if n == 0 {
        return (0, 0);
    }
    (n, sockets::open_count(&Look::now(), &inodes))
}

/// How many connections are recorded now, over every pair (for tests).
#[cfg(test)]
fn recorded_count() -> usize {
    recorded().values().map(HashSet::len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::Mutex;

    /// The record is process-wide: the tests that read or change it run
    /// one at a time, or one's release would move the other's count.
    static RECORD: Mutex<()> = Mutex::new(());

    fn record_alone() -> std::sync::MutexGuard<'static, ()> {
        RECORD.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connected socket made as UCX makes its own: `socket` without
    /// close-on-exec, keepalive on.
    fn ucx_like_connect(to: std::net::SocketAddr) -> OwnedFd {
        let std::net::SocketAddr::V4(v4) = to else {
            panic!("IPv4 only here")
        };
        // SAFETY: plain socket(2); the result is checked.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by nothing else.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        // SAFETY: `one` is a valid int of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_KEEPALIVE,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: `sin` is a valid sockaddr_in of the length passed.
        let rc = unsafe {
            libc::connect(
                fd,
                (&sin as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        owned
    }

    #[test]
    fn a_load_records_the_connections_made_like_ucx_and_the_release_shuts_only_those() {
        let _alone = record_alone();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        // Inside the load: one connection made as UCX makes them, one
        // made as the rest of a serving process makes its own (std: close
        // on exec), as another thread would during the load.
        let ((ucx, other), loaded) = around_load(true, || {
            let ucx = ucx_like_connect(to);
            let other = TcpStream::connect(to).unwrap();
            (ucx, other)
        });
        let (mut ucx_peer, _) = listener.accept().unwrap();
        let (mut other_peer, _) = listener.accept().unwrap();
        let ucx_inode = sockets::socket_inode(ucx.as_raw_fd()).unwrap();
        let other_inode = sockets::socket_inode(other.as_raw_fd()).unwrap();
        // (Other tests of this binary open sockets too: only these two are
        // judged.)
        assert!(loaded.0.contains(&ucx_inode), "the UCX-made connection");
        assert!(!loaded.0.contains(&other_inode), "not the other");
        loaded.belong_to("local-a", "remote-a");

        // Another pair's release touches nothing of this one.
        assert_eq!(released("local-a", "remote-b", true), (0, 0));
        assert_eq!(released("local-a", "remote-a", true).0, 1);
        let mut buf = [0u8; 1];
        assert_eq!(
            ucx_peer.read(&mut buf).unwrap(),
            0,
            "the peer reads end-of-file"
        );
        other_peer
            .set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .unwrap();
        assert!(
            other_peer.read(&mut buf).is_err(),
            "the other connection is untouched (the read times out)"
        );
        drop(other);
        // Released once: nothing is left to shut down.
        assert_eq!(released("local-a", "remote-a", true), (0, 0));
    }

    #[test]
    fn a_release_that_keeps_the_connections_forgets_them_and_a_nested_load_is_not_recorded() {
        let _alone = record_alone();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        let (fd, loaded) = around_load(true, || ucx_like_connect(to));
        let (mut peer, _) = listener.accept().unwrap();
        loaded.belong_to("local-k", "remote-k");
        assert_eq!(released("local-k", "remote-k", false), (0, 0));
        assert_eq!(released("local-k", "remote-k", true), (0, 0), "forgotten");
        peer.set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .unwrap();
        let mut buf = [0u8; 1];
        assert!(peer.read(&mut buf).is_err(), "still connected");
        drop(fd);

        // A load inside a load: the inner one records nothing (no
        // deadlock on the lock its thread holds); the outer one sees it.
        let ((inner, outer_fd), outer) = around_load(true, || {
            let (fd, inner) = around_load(true, || ucx_like_connect(to));
            (inner, fd)
        });
        let _ = listener.accept().unwrap();
        assert_eq!(inner.opened(), 0);
        assert_eq!(outer.opened(), 1);
        drop(outer);
        drop(outer_fd);
        let before = recorded_count();
        let ((), off) = around_load(false, || drop(ucx_like_connect(to)));
        assert_eq!(off.opened(), 0, "not recorded when told not to");
        assert_eq!(recorded_count(), before);
    }
}
