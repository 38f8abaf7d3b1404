"""What the real-process tiers share (python/tests_vllm, python/tests_sglang):
each tier's conftest puts this folder on ``sys.path``."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port the kernel
    hands out for port 0 is one the prefill's own sockets may take before
    vLLM's side channel binds it (NIXL's agent, made first, opens UCX
    sockets on ephemeral ports); then vLLM's listener thread dies and its
    scheduler waits for it for good (seen once in a dry CI: a prefill
    never READY)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 8192), low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 64 tried below the ephemeral range ({low})")
