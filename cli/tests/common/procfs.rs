//! What a process holds, from `/proc`: file descriptors, sockets, TCP
//! connections (`/proc/<pid>/fd`, `/proc/net/tcp{,6}` of the reader's
//! network namespace), resident memory and threads (`/proc/<pid>/status`).
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
    /// Resident memory, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Threads.
    pub threads: u64,
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

/// The ESTABLISHED TCP connections of `pid` as (local, remote) in
/// `/proc/net/tcp` notation.
pub fn connections(pid: u32) -> Vec<(String, String)> {
    let inodes = socket_inodes(pid);
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st 01 = ESTABLISHED; column 9 is the inode.
            if cols.len() > 9 && cols[3] == "01" && inodes.contains(cols[9]) {
                out.push((cols[1].to_string(), cols[2].to_string()));
            }
        }
    }
    out
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
    Held {
        fds,
        sockets: socket_inodes(pid).len(),
        established: connections(pid).len(),
        rss_kib: field("VmRSS:"),
        threads: field("Threads:"),
    }
}
