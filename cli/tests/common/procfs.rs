//! What a process holds, from `/proc`: file descriptors, sockets, TCP
//! connections (`/proc/<pid>/fd`, and `/proc/<pid>/net/tcp{,6}`: the
//! tables of the process's own network namespace), resident memory and
//! threads (`/proc/<pid>/status`).
#![allow(dead_code)]

use std::collections::HashSet;

/// One process's holdings at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Open file descriptors.
    pub fds: usize,
    /// Of which sockets.
    pub sockets: usize,
    /// Of which ESTABLISHED TCP connections.
    pub established: usize,
    /// Of those, the ones whose other end is not in this process (UCX
    /// connects each worker to itself too, lazily: those are left out).
    pub established_out: usize,
    /// Resident memory, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Threads.
    pub threads: u64,
    /// Memory mappings (`/proc/<pid>/maps` lines): a peer's shared memory
    /// that stayed mapped would show here.
    pub maps: usize,
}

fn socket_inodes(pid: u32) -> HashSet<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    l.to_string_lossy()
                        .strip_prefix("socket:[")
                        .map(|i| i.trim_end_matches(']').to_string())
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One TCP socket of a process, from `/proc/<pid>/net/tcp{,6}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpSocket {
    /// Local address, `/proc/net/tcp` notation (`0100007F:9C40`).
    pub local: String,
    /// Remote address, same notation.
    pub remote: String,
    /// The kernel's state code (`01` ESTABLISHED, `0A` LISTEN, ...).
    pub state: String,
}

impl TcpSocket {
    /// The local IPv4 address as dotted text, if it is one.
    pub fn local_ipv4(&self) -> Option<String> {
        ipv4_of(&self.local)
    }

    /// The remote IPv4 address as dotted text, if it is one.
    pub fn remote_ipv4(&self) -> Option<String> {
        ipv4_of(&self.remote)
    }

    /// Whether this is a listening socket.
    pub fn is_listening(&self) -> bool {
        self.state == "0A"
    }
}

/// `0100007F:9C40` -> `127.0.0.1` (the kernel prints IPv4 in host order).
fn ipv4_of(addr: &str) -> Option<String> {
    let hex = addr.split(':').next()?;
    if hex.len() != 8 {
        return None;
    }
    let n = u32::from_str_radix(hex, 16).ok()?;
    Some(std::net::Ipv4Addr::from(n.swap_bytes()).to_string())
}

/// Every TCP socket `pid` has open, in its own network namespace.
pub fn tcp_sockets(pid: u32) -> Vec<TcpSocket> {
    let inodes = socket_inodes(pid);
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // Column 9 is the inode.
            if cols.len() > 9 && inodes.contains(cols[9]) {
                out.push(TcpSocket {
                    local: cols[1].to_string(),
                    remote: cols[2].to_string(),
                    state: cols[3].to_string(),
                });
            }
        }
    }
    out
}

/// The ESTABLISHED TCP connections of `pid` as (local, remote) in
/// `/proc/net/tcp` notation.
pub fn connections(pid: u32) -> Vec<(String, String)> {
    tcp_sockets(pid)
        .into_iter()
        .filter(|s| s.state == "01")
        .map(|s| (s.local, s.remote))
        .collect()
}

/// ESTABLISHED TCP connections between processes `a` and `b`, each
/// counted once.
pub fn between(a: u32, b: u32) -> usize {
    let theirs: HashSet<(String, String)> = connections(b).into_iter().collect();
    connections(a)
        .into_iter()
        .filter(|(local, remote)| theirs.contains(&(remote.clone(), local.clone())))
        .count()
}

/// What `pid` holds now (zeros for a process that is gone).
pub fn held(pid: u32) -> Held {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.flatten().count())
        .unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let established = connections(pid);
    let own: HashSet<&(String, String)> = established.iter().collect();
    let established_out = established
        .iter()
        .filter(|(local, remote)| !own.contains(&(remote.clone(), local.clone())))
        .count();
    Held {
        fds,
        sockets: socket_inodes(pid).len(),
        established: established.len(),
        established_out,
        rss_kib: field("VmRSS:"),
        threads: field("Threads:"),
        maps: std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map(|m| m.lines().count())
            .unwrap_or(0),
    }
}
