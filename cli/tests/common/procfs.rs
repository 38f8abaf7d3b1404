//! What a process holds, from `/proc`: file descriptors, sockets, TCP
//! connections (`/proc/<pid>/fd`, and `/proc/<pid>/net/tcp{,6}`: the
//! tables of the process's own network namespace), resident memory and
//! threads (`/proc/<pid>/status`), and where the resident memory is
//! (`/proc/<pid>/smaps`).
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

/// Where a process's resident memory is, from `/proc/<pid>/smaps`: the kernel's
/// Rss of each mapping, summed by kind. Explains a resident size that does
/// not come back (what malloc keeps, what UCX or NIXL keep mapped) without
/// asking the allocator.
#[derive(Clone, Copy, Debug, Default)]
pub struct Resident {
    /// The main arena (`[heap]`, brk).
    pub heap: u64,
    /// Anonymous private mappings: malloc's other arenas and its large
    /// blocks, thread stacks, UCX's and NIXL's own pools.
    pub anon: u64,
    /// Shared memory (`/dev/shm`, memfd, SysV, anonymous shared).
    pub shared: u64,
    /// Files (libraries and their data).
    pub file: u64,
    /// Anonymous private mappings that start on a 64 MiB boundary (glibc's
    /// per-thread arenas: each a 64 MiB-aligned reservation whose used part
    /// is read-write): what of `anon` is in them.
    pub arenas: u64,
    /// How many such mappings.
    pub arena_count: u64,
}

impl Resident {
    /// Reads `/proc/<pid>/smaps` (zeros for a process that is gone).
    pub fn of(pid: u32) -> Resident {
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
        let mut r = Resident::default();
        let mut kind = 0u8; // 0 heap, 1 anon, 2 shared, 3 file, 4 none
        let mut arena = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                // A mapping's header: range perms offset dev inode [path].
                let fields: Vec<&str> = line.split_whitespace().collect();
                let shared = fields.get(1).is_some_and(|p| p.ends_with('s'));
                let path = fields.get(5).copied().unwrap_or("");
                let lo = first.split_once('-').map_or("0", |(lo, _)| lo);
                arena = u64::from_str_radix(lo, 16).is_ok_and(|a| a % (64 << 20) == 0)
                    && fields.get(1).is_some_and(|p| p.starts_with("rw"));
                kind = if path == "[heap]" {
                    0
                } else if path.starts_with("/dev/shm")
                    || path.starts_with("/memfd:")
                    || path.starts_with("/SYSV")
                    || (shared && path.is_empty())
                {
                    2
                } else if path.is_empty() || path.starts_with('[') {
                    if path.is_empty() {
                        1
                    } else {
                        4
                    }
                } else {
                    3
                };
            } else if let Some(v) = line.strip_prefix("Rss:") {
                let kb = v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0)
                    * 1024;
                match kind {
                    0 => r.heap += kb,
                    1 => {
                        r.anon += kb;
                        if arena {
                            r.arenas += kb;
                            r.arena_count += 1;
                        }
                    }
                    2 => r.shared += kb,
                    3 => r.file += kb,
                    _ => {}
                }
            }
        }
        r
    }
}

impl std::fmt::Display for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "heap {:.1} MiB, anonymous {:.1} MiB ({:.1} MiB in {} malloc arenas), shared {:.1} MiB, files {:.1} MiB",
            mib(self.heap),
            mib(self.anon),
            mib(self.arenas),
            self.arena_count,
            mib(self.shared),
            mib(self.file)
        )
    }
}
