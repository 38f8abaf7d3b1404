//! The TCP connections UCX opens to a remote agent, and closing the ones a
//! release leaves behind.
//!
//! # Why the forced close is not enough
//!
//! UCX's TCP transport (UCX 1.23, `uct/tcp`) connects a UCP endpoint to a
//! peer's worker with one socket that both directions share: the decode's
//! endpoint opens it (`connect` to the peer's UCX listening port) and the
//! peer's endpoint for the decode, made when the decode's wireup arrives,
//! sends back over it. Destroying a transport endpoint that sends and
//! receives on such a socket (`uct_tcp_ep_destroy`, which the forced close
//! reaches) does not close the socket: it removes the endpoint's send side,
//! tells the peer with an in-band `CONN_FIN` and keeps the socket in the
//! worker's connection table to receive whatever the peer still sends. The
//! socket goes only when the peer closes its end, and the peer closes it
//! only when its own endpoint for the decode fails: at its next UCX
//! keepalive round (`UCX_KEEPALIVE_INTERVAL` in the *peer's* environment,
//! 20 s by default; never with keepalive off). Neither close mode changes
//! this (the transport destroy is the same), nor does progressing the
//! worker: the table waits for the peer. Measured (NIXL 1.5.1, loopback,
//! 2-rank prefill with keepalive off): 100 releases left 190 ESTABLISHED
//! connections between the two and the decode's descriptors at 215, 10 s on.
//!
//! # What this module does
//!
//! Loading a remote agent's metadata makes UCX create the endpoint, and its
//! TCP transport calls `connect` there, on the loading thread. The sockets
//! that appear during the load are recorded for that agent (by socket
//! inode, which the kernel never reuses while the process lives; sockets
//! accepted on a listening port of this process are left out: those are
//! peers connecting in, not this load). When the agent is released, after
//! the forced close, those of the recorded sockets still open are shut
//! down (`shutdown(SHUT_RDWR)`, never `close`: the descriptor stays UCX's).
//! UCX then reads end-of-file on its next progress, fails the
//! receive-only endpoint and closes the descriptor itself; the peer reads
//! end-of-file too, fails its endpoint for the decode at once and closes
//! its end (and any connection it had opened back), whatever its keepalive
//! period.
//!
//! What it cannot see: a socket UCX opens for that agent after the load
//! (a reconnect) is not recorded, and goes at the peer's keepalive as
//! before; a socket another thread of the process opens during the load is
//! recorded too, and is shut down at that agent's release if still open.
//! No socket is ever shut down that did not appear during the load of the
//! agent being released.

use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;

/// The variable that turns the socket shutdown at release off:
/// `NIXL_SYS_SHUT_SOCKETS=0` (on otherwise). An operator's way back to
/// UCX's own behaviour (connections closed at the peer's keepalive round)
/// should the shutdown ever misbehave; it also stops the looks at
/// `/proc/self/fd` around each load.
pub(crate) const SHUT_SOCKETS_ENV: &str = "NIXL_SYS_SHUT_SOCKETS";

/// Whether the sockets of loads are recorded and shut at release (read
/// once): on unless `NIXL_SYS_SHUT_SOCKETS=0`.
pub(crate) fn shutdown_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(SHUT_SOCKETS_ENV).map_or(true, |v| v != "0"))
}

/// What an invalidation does to the TCP connections UCX keeps for the
/// remote agent ([`crate::Agent::invalidate_remote_metadata_with`]).
///
/// Only the caller knows whether a transfer with the agent may still be
/// running at the peer: a READ given up at a frozen peer is still on the
/// peer's side, and when the peer resumes its UCX sends the data. Measured
/// with NIXL 1.5.1 over TCP: a connection shut down under that send made
/// UCX in the *peer* abort the whole process (`ucp_request.inl: Fatal:
/// unexpected error: Endpoint timeout`). So shutting down is the caller's
/// explicit word that nothing is in flight, and the default keeps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Connections {
    /// Leave them to UCX: they close at the peer's next keepalive round
    /// (20 s by default; never with the peer's keepalive off). Every
    /// connection the peer opened to this process that is open now is
    /// spared by later releases too (the peer's late send may use it).
    Keep,
    /// Every transfer with the agent ended on this side: shut them down at
    /// once (see the module's documentation).
    Shut,
}

use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::RawFd;

/// One TCP socket of this process: its descriptor and its inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Socket {
    fd: RawFd,
    inode: u64,
}

/// The inode of descriptor `fd` if it is a socket.
pub(crate) fn socket_inode(fd: RawFd) -> Option<u64> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is writable storage for one `stat`, which fstat fills on
    // success; `fd` may be closed meanwhile, then it fails (EBADF) and
    // nothing is read.
    let rc = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: initialised by the successful fstat.
    let st = unsafe { st.assume_init() };
    (st.st_mode & libc::S_IFMT == libc::S_IFSOCK).then_some(st.st_ino)
}

/// An `int` socket option of `fd`.
fn int_option(fd: RawFd, level: libc::c_int, name: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for getsockopt to write an int (`len`
    // says the buffer is one `c_int`).
    let rc = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(v)
}

/// Which end of a socket [`address`] reads.
#[derive(Clone, Copy)]
enum End {
    Local,
    Peer,
}

/// `fd`'s local or peer address (IPv4 or IPv6).
fn address(fd: RawFd, end: End) -> Option<(IpAddr, u16)> {
    let mut ss = MaybeUninit::<libc::sockaddr_storage>::zeroed();
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `ss` is writable storage of `len` bytes, a `sockaddr_storage`,
    // large enough for any address family; the call writes at most `len`.
    let rc = unsafe {
        match end {
            End::Local => libc::getsockname(fd, ss.as_mut_ptr().cast(), &mut len),
            End::Peer => libc::getpeername(fd, ss.as_mut_ptr().cast(), &mut len),
        }
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: zeroed, then (partly) written by the call; all-zero bytes are
    // a valid `sockaddr_storage` (plain integers).
    let ss = unsafe { ss.assume_init() };
    match libc::c_int::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in, which fits in
            // the (larger, at least as aligned) initialised storage.
            let sin =
                unsafe { &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some((IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6, which fits in
            // the (larger, at least as aligned) initialised storage.
            let sin6 =
                unsafe { &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some((IpAddr::V6(ip), u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

/// One connected TCP socket of a [`Look`].
#[derive(Clone, Copy, Debug)]
struct Stream {
    socket: Socket,
    local: Option<(IpAddr, u16)>,
    peer: Option<(IpAddr, u16)>,
}

/// Whether `fd` was set up the way UCX 1.23's TCP transport sets up its
/// connections, and the sockets of the libraries that share a serving
/// process with it are not: no close-on-exec flag (UCX's
/// `ucs_socket_create` calls `socket` without `SOCK_CLOEXEC` and never sets
/// `FD_CLOEXEC`; Rust's std, tokio, Python's `socket` module and ZeroMQ
/// all set it) and `SO_KEEPALIVE` on (the transport turns TCP keepalive on
/// for each connection unless `UCX_TCP_KEEPIDLE=inf`). Measured here on a
/// decode's UCX connections (both, together with `TCP_NODELAY`).
/// Either missing leaves the socket out: the fail-safe way, since what is
/// not recorded is only left to UCX.
fn made_like_ucx(fd: RawFd) -> bool {
    // SAFETY: F_GETFD takes no pointer; a closed `fd` fails with EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags >= 0
        && flags & libc::FD_CLOEXEC == 0
        && int_option(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE) == Some(1)
}

/// This process's TCP sockets at one look: the stream sockets of the IP
/// families, split into listening ones (their local ports) and the rest.
#[derive(Debug, Default)]
pub(crate) struct Look {
    streams: Vec<Stream>,
    listening_ports: HashSet<u16>,
}

impl Look {
    /// Reads `/proc/self/fd`. An unreadable table gives an empty look: then
    /// nothing is recorded, and nothing is shut down.
    pub(crate) fn now() -> Look {
        let mut look = Look::default();
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return look;
        };
        for entry in dir.flatten() {
            let Some(fd) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<RawFd>().ok())
            else {
                continue;
            };
            let Some(inode) = socket_inode(fd) else {
                continue;
            };
            let family = int_option(fd, libc::SOL_SOCKET, libc::SO_DOMAIN);
            if !matches!(family, Some(libc::AF_INET | libc::AF_INET6)) {
                continue;
            }
            if int_option(fd, libc::SOL_SOCKET, libc::SO_TYPE) != Some(libc::SOCK_STREAM) {
                continue;
            }
            let port = address(fd, End::Local).map(|(_, port)| port);
            if int_option(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN) == Some(1) {
                look.listening_ports.extend(port);
                continue;
            }
            look.streams.push(Stream {
                socket: Socket { fd, inode },
                local: address(fd, End::Local),
                peer: address(fd, End::Peer),
            });
        }
        look
    }

    /// The sockets in `self` that `before` did not have and that were not
    /// accepted on a port this process listens on: the ones this process
    /// opened in between.
    pub(crate) fn opened_since(&self, before: &Look) -> Vec<(u64, Option<IpAddr>)> {
        self.new_since(before)
            .into_iter()
            .map(|s| (s.socket.inode, s.peer.map(|(ip, _)| ip)))
            .collect()
    }

    /// Of [`Look::opened_since`], those set up as UCX sets up its
    /// connections ([`made_like_ucx`], asked of these sockets only, while
    /// their descriptors still hold them), by inode: the record a look
    /// around another binding's load keeps, where other threads of the
    /// process open sockets of their own meanwhile.
    pub(crate) fn opened_by_ucx_since(&self, before: &Look) -> Vec<u64> {
        self.new_since(before)
            .into_iter()
            .filter(|s| {
                socket_inode(s.socket.fd) == Some(s.socket.inode) && made_like_ucx(s.socket.fd)
            })
            .map(|s| s.socket.inode)
            .collect()
    }

    /// The streams in `self` that `before` did not have and that were not
    /// accepted on a port this process listens on.
    fn new_since(&self, before: &Look) -> Vec<&Stream> {
        let old = before.inodes();
        self.streams
            .iter()
            .filter(|s| !old.contains(&s.socket.inode) && !self.accepted(s, before))
            .collect()
    }

    /// Those of `inodes` open in this look.
    pub(crate) fn retain_open(&self, inodes: &mut HashSet<u64>) {
        let open = self.inodes();
        inodes.retain(|i| open.contains(i));
    }

    /// The ports this process began to listen on since `before`.
    pub(crate) fn listening_since(&self, before: &Look) -> HashSet<u16> {
        self.listening_ports
            .difference(&before.listening_ports)
            .copied()
            .collect()
    }

    /// The connections accepted on one of `ports` from one of `peers`,
    /// except those whose other end is a socket of this process (UCX's
    /// connection from a worker to itself).
    pub(crate) fn accepted_from(&self, ports: &HashSet<u16>, peers: &HashSet<IpAddr>) -> Vec<u64> {
        self.accepted_where(ports, |ip| peers.contains(&ip))
    }

    /// The connections accepted on one of `ports` from any host, except
    /// UCX's connection from a worker to itself.
    pub(crate) fn accepted_on(&self, ports: &HashSet<u16>) -> Vec<u64> {
        self.accepted_where(ports, |_| true)
    }

    fn accepted_where(&self, ports: &HashSet<u16>, host: impl Fn(IpAddr) -> bool) -> Vec<u64> {
        let own: HashSet<(IpAddr, u16)> = self.streams.iter().filter_map(|s| s.local).collect();
        self.streams
            .iter()
            .filter(|s| {
                s.local.is_some_and(|(_, port)| ports.contains(&port))
                    && s.peer
                        .is_some_and(|peer| host(peer.0) && !own.contains(&peer))
            })
            .map(|s| s.socket.inode)
            .collect()
    }

    fn inodes(&self) -> HashSet<u64> {
        self.streams.iter().map(|s| s.socket.inode).collect()
    }

    /// Whether `s` was accepted on a port this process listens on (in this
    /// look or in `other`).
    fn accepted(&self, s: &Stream, other: &Look) -> bool {
        s.local.is_some_and(|(_, p)| {
            self.listening_ports.contains(&p) || other.listening_ports.contains(&p)
        })
    }

    /// Those of `inodes` still open in this look.
    fn open(&self, inodes: &HashSet<u64>) -> Vec<Socket> {
        self.streams
            .iter()
            .map(|s| s.socket)
            .filter(|s| inodes.contains(&s.inode))
            .collect()
    }
}

/// Shuts down (both directions) every one of `inodes` still open in
/// `look`; returns how many. The descriptor is checked to still hold the same socket right
/// before, so a descriptor UCX closed and something else reused is left
/// alone.
pub(crate) fn shut_down(look: &Look, inodes: &HashSet<u64>) -> u32 {
    let mut shut = 0;
    for s in look.open(inodes) {
        if socket_inode(s.fd) != Some(s.inode) {
            continue;
        }
        // SAFETY: shutdown takes no pointers and only changes the
        // connection's state; the descriptor stays open and UCX's, which
        // closes it when it reads the end of the connection. The check
        // just above makes `fd` that socket (a close and reuse by another
        // thread in between is not excluded: that would shut down another
        // socket, never touch memory).
        if unsafe { libc::shutdown(s.fd, libc::SHUT_RDWR) } == 0 {
            shut += 1;
        }
    }
    shut
}

/// How many of `inodes` are open in `look`.
pub(crate) fn open_count(look: &Look, inodes: &HashSet<u64>) -> u32 {
    look.open(inodes).len() as u32
}

/// What was recorded of one remote agent's connections.
#[derive(Debug, Default)]
pub(crate) struct AgentSockets {
    /// The sockets opened while its metadata was loaded.
    pub(crate) inodes: HashSet<u64>,
    /// Their peers' addresses: the hosts its UCX listens on.
    pub(crate) peers: HashSet<IpAddr>,
}

/// The sockets recorded per remote agent name.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    by_agent: HashMap<Vec<u8>, AgentSockets>,
    /// Connections accepted from the hosts of an agent released with its
    /// connections kept ([`Connections::Keep`]), open at that release: a
    /// later release never shuts them down (the kept agent's peer may
    /// still send over one of them). Pruned to those still open at each
    /// release.
    spared: HashSet<u64>,
}

impl Recorded {
    /// Records `opened` as `agent`'s (added to what it had).
    pub(crate) fn record(&mut self, agent: &[u8], opened: Vec<(u64, Option<IpAddr>)>) {
        if opened.is_empty() {
            return;
        }
        let entry = self.by_agent.entry(agent.to_vec()).or_default();
        for (inode, peer) in opened {
            entry.inodes.insert(inode);
            entry.peers.extend(peer);
        }
    }

    /// Forgets `agent`'s sockets and returns them.
    pub(crate) fn take(&mut self, agent: &[u8]) -> AgentSockets {
        self.by_agent.remove(agent).unwrap_or_default()
    }

    /// Spares `accepted` from later releases, and forgets the spared
    /// connections `look` no longer shows open.
    pub(crate) fn spare(&mut self, look: &Look, accepted: Vec<u64>) {
        let open = look.inodes();
        self.spared.retain(|inode| open.contains(inode));
        self.spared.extend(accepted);
    }

    /// The connections no release may shut down.
    pub(crate) fn spared(&self) -> &HashSet<u64> {
        &self.spared
    }

    /// Whether an agent still recorded has its UCX on one of `hosts`.
    pub(crate) fn shares_a_host(&self, hosts: &HashSet<IpAddr>) -> bool {
        self.by_agent.values().any(|a| !a.peers.is_disjoint(hosts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_connection_opened_between_two_looks_is_found_and_the_accepted_end_is_not() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let before = Look::now();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let after = Look::now();
        let opened = after.opened_since(&before);
        let inode = socket_inode(std::os::fd::AsRawFd::as_raw_fd(&client)).unwrap();
        let accepted = socket_inode(std::os::fd::AsRawFd::as_raw_fd(&_server)).unwrap();
        // Other tests of this binary may open sockets meanwhile: only these
        // two are judged.
        let opened: Vec<u64> = opened.into_iter().map(|(i, _)| i).collect();
        assert!(opened.contains(&inode), "the connecting end");
        assert!(!opened.contains(&accepted), "not the accepted end");
        let loopback: HashSet<IpAddr> = [IpAddr::V4(Ipv4Addr::LOCALHOST)].into();
        let port = listener.local_addr().unwrap().port();
        // Our listener was there before the first look; another test's may
        // appear between the two and is not judged.
        assert!(
            !after.listening_since(&before).contains(&port),
            "listening before"
        );
        // The accepted end's peer is this process's own socket (as UCX's
        // connection to itself): not counted as a peer's.
        assert!(!after
            .accepted_from(&HashSet::from([port]), &loopback)
            .contains(&accepted));
    }

    #[test]
    fn shutting_a_recorded_socket_down_ends_the_connection_for_both_ends_and_keeps_its_descriptor()
    {
        use std::io::Read;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let before = Look::now();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let inode = socket_inode(std::os::fd::AsRawFd::as_raw_fd(&client)).unwrap();
        assert!(Look::now()
            .opened_since(&before)
            .iter()
            .any(|(i, _)| *i == inode));
        // Only this test's socket: others of this binary may be open.
        let recorded: HashSet<u64> = [inode].into();
        assert_eq!(shut_down(&Look::now(), &recorded), 1);
        let mut buf = [0u8; 1];
        assert_eq!(
            server.read(&mut buf).unwrap(),
            0,
            "the peer reads end-of-file"
        );
        assert_eq!(
            open_count(&Look::now(), &recorded),
            1,
            "the descriptor stays its owner's to close"
        );
        drop(client);
        assert_eq!(open_count(&Look::now(), &recorded), 0);
        assert_eq!(
            shut_down(&Look::now(), &recorded),
            0,
            "nothing left to shut down"
        );
    }
}
