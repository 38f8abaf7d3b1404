"""What a process holds, from ``/proc``: file descriptors, sockets, TCP
connections (``/proc/<pid>/net/tcp{,6}``, the tables of the process's own
network namespace) and memory mappings. The Python twin of
``cli/tests/common/procfs.rs``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Set, Tuple

ESTABLISHED = "01"


@dataclass(frozen=True)
class Held:
    """One process's holdings at one moment."""

    fds: int
    sockets: int
    #: ESTABLISHED TCP connections.
    established: int
    #: Of those, the ones whose other end is not in this process (UCX
    #: connects each worker to itself too, lazily: those are left out).
    established_out: int
    #: ``/proc/<pid>/maps`` lines: a peer's shared memory kept mapped shows here.
    maps: int


def _socket_inodes(pid: int) -> Set[str]:
    out = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            out.add(link[len("socket:[") : -1])
    return out


def connections(pid: int) -> List[Tuple[str, str]]:
    """The ESTABLISHED TCP connections of ``pid`` as (local, remote) in
    ``/proc/net/tcp`` notation."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            # Column 9 is the inode.
            if len(cols) > 9 and cols[3] == ESTABLISHED and cols[9] in inodes:
                out.append((cols[1], cols[2]))
    return out


def between(a: int, b: int) -> int:
    """ESTABLISHED TCP connections between processes ``a`` and ``b``, each
    counted once."""
    theirs = set(connections(b))
    return sum(1 for local, remote in connections(a) if (remote, local) in theirs)


def held(pid: int) -> Held:
    """What ``pid`` holds now (zeros for a process that is gone)."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = 0
    established = connections(pid)
    own = set(established)
    out = sum(1 for local, remote in established if (remote, local) not in own)
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:
        maps = 0
    return Held(fds, len(_socket_inodes(pid)), len(established), out, maps)
