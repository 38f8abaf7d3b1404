"""The project's real prefill, from Python: its side-channel handshake and
its KV byte pattern, so a Python decoder (the example, the tests) can
connect to ``nixl-keepalive prefill`` and check every byte it reads.

The protocol is documented in ``cli/src/pd/mod.rs``: one TCP connection
per handshake; the decoder sends one request frame, reads one reply frame.
A frame is a 4-byte big-endian payload length followed by the payload;
integers are big-endian, a ``str16`` a ``u16`` length and UTF-8 bytes, a
``bytes32`` a ``u32`` length and bytes::

    request = "NKPD" version:u8(=1) kind:u8(=1)
    reply   = "NKPD" version:u8(=1) kind:u8(=2)
              engine_id:str16 incarnation:u64 block_size:u64 blocks:u32
              ranks:u16, then per rank: agent:str16 base:u64 metadata:bytes32

Block ``b`` of rank ``r`` lives at ``base_r + b * block_size`` and holds
the pattern :func:`fill` derives from the engine id, ``r`` and ``b``
(``cli/src/pd/pattern.rs``).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

MAGIC = b"NKPD"
VERSION = 1
KIND_HANDSHAKE = 1
KIND_REPLY = 2
#: The largest reply payload accepted (a reply with its metadata blobs).
MAX_FRAME = 16 << 20
#: The largest engine id, and the most ranks a reply may list.
MAX_ENGINE_ID = 256
MAX_RANKS = 64
#: The largest block size.
MAX_BLOCK_SIZE = 64 << 20


class WireError(ValueError):
    """A reply that breaks the protocol: nothing was loaded."""


@dataclass(frozen=True)
class Rank:
    """One rank of a prefill engine: its NIXL agent, where block 0 is, and
    the agent's metadata."""

    agent: str
    base: int
    metadata: bytes


@dataclass(frozen=True)
class Reply:
    """What a prefill answers to a handshake."""

    engine_id: str
    incarnation: int
    block_size: int
    blocks: int
    ranks: List[Rank]

    @property
    def agents(self) -> List[str]:
        """The agent names, in rank order."""
        return [r.agent for r in self.ranks]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise WireError(f"payload truncated in {what}")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, what))[0]

    def str16(self, what: str) -> str:
        n = self.unpack(">H", what)
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"bad {what}: not UTF-8") from e


def encode_request() -> bytes:
    """The request payload."""
    return MAGIC + bytes([VERSION, KIND_HANDSHAKE])


def decode_reply(payload: bytes) -> Reply:
    """Decodes and validates a reply payload (the Rust decoder's rules)."""
    r = _Reader(payload)
    if r.take(4, "magic") != MAGIC:
        raise WireError("bad magic (not a nixl-keepalive side channel)")
    version = r.unpack(">B", "version")
    if version != VERSION:
        raise WireError(f"unsupported protocol version {version}")
    kind = r.unpack(">B", "kind")
    if kind != KIND_REPLY:
        raise WireError(f"unexpected frame kind {kind}")
    engine = r.str16("engine_id")
    if not 1 <= len(engine.encode()) <= MAX_ENGINE_ID:
        raise WireError(f"bad engine_id: {len(engine.encode())} bytes, expected 1..={MAX_ENGINE_ID}")
    incarnation = r.unpack(">Q", "incarnation")
    block_size = r.unpack(">Q", "block_size")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise WireError(f"bad block_size: {block_size}, expected 1..={MAX_BLOCK_SIZE}")
    blocks = r.unpack(">I", "blocks")
    if blocks == 0:
        raise WireError("bad blocks: 0, expected 1 or more")
    n = r.unpack(">H", "ranks")
    if not 1 <= n <= MAX_RANKS:
        raise WireError(f"bad ranks: {n}, expected 1..={MAX_RANKS}")
    span = block_size * blocks
    ranks: List[Rank] = []
    for _ in range(n):
        agent = r.str16("agent")
        if not agent or "\0" in agent:
            raise WireError("bad agent: empty or contains NUL")
        base = r.unpack(">Q", "base")
        if base + span >= 1 << 64:
            raise WireError("bad base: base + blocks * block_size overflows")
        length = r.unpack(">I", "metadata")
        metadata = r.take(length, "metadata")
        if not metadata:
            raise WireError("bad metadata: empty")
        for i, prev in enumerate(ranks):
            if prev.agent == agent:
                raise WireError(
                    f"bad agent: ranks {i} and {len(ranks)} both name agent {agent!r}; "
                    "each rank must have its own agent"
                )
        ranks.append(Rank(agent, base, metadata))
    if r.pos != len(payload):
        raise WireError(f"{len(payload) - r.pos} trailing bytes after the last field")
    return Reply(engine, incarnation, block_size, blocks, ranks)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("side channel closed before the whole reply")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def fetch(address: str, timeout: float = 2.0) -> Reply:
    """Asks the prefill at ``address`` (``host:port``) for its engine id,
    layout and metadata. Raises ``OSError`` (nobody answered, the
    connection failed) or :class:`WireError` (a bad reply)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.settimeout(timeout)
        request = encode_request()
        sock.sendall(struct.pack(">I", len(request)) + request)
        (length,) = struct.unpack(">I", _read_exact(sock, 4))
        if length > MAX_FRAME:
            raise WireError(f"frame of {length} bytes exceeds the limit of {MAX_FRAME}")
        return decode_reply(_read_exact(sock, length))


# -- the byte pattern (cli/src/pd/pattern.rs) ---------------------------------

_M64 = (1 << 64) - 1


def seed(engine: str) -> int:
    """The pattern seed of an engine id (FNV-1a, 64-bit)."""
    h = 0xCBF29CE484222325
    for b in engine.encode():
        h ^= b
        h = (h * 0x100000001B3) & _M64
    return h


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def block_bytes(engine_seed: int, rank: int, block: int, length: int) -> np.ndarray:
    """The ``length`` bytes of block ``block`` of rank ``rank``."""
    key = (
        engine_seed
        ^ ((rank * 0xD6E8FEB86659FD93) & _M64)
        ^ ((block * 0xA0761D6478BD642F) & _M64)
    )
    words = (length + 7) // 8
    with np.errstate(over="ignore"):
        idx = np.arange(words, dtype=np.uint64) + np.uint64(key)
    return _splitmix64(idx).astype("<u8").view(np.uint8)[:length]


def first_mismatch(buf: np.ndarray, engine_seed: int, rank: int, block: int) -> Optional[int]:
    """The offset of the first byte of ``buf`` that differs from the
    block's pattern, or ``None`` when every byte matches."""
    want = block_bytes(engine_seed, rank, block, len(buf))
    diff = np.flatnonzero(np.asarray(buf, dtype=np.uint8) != want)
    return int(diff[0]) if diff.size else None
