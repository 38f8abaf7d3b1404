"""Releases of a live prefill, one after another: the router says the
engine is gone (``peer_gone``, by engine id and by address, drain and
fail in turn), the service releases it through the decoder's own
``nixl_agent``, and the vLLM-shaped worker handshakes with the same live
process again, loads it, registers it under its own id and reads a block
from every rank (UCX connects a rank's endpoint at its first use).

Used in-process by ``test_real_releases.py`` (the decode is the pytest
process) and run as a child decode by it (``python live_releases.py
--address HOST:PORT --cycles N [--agent-first]``) to measure NIXL's own
close mode, or a package imported too late, from outside. The child's
protocol on stdout/stdin::

    READY pid=<pid> mode=<endpoint close mode> reason=<json>   (after one warm-up cycle)
    <- any line on stdin: run the cycles
    DONE <json: releases, left_open per event, the snapshot's endpoints>
    <- stdin closed: shut the worker down and exit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "examples"))

#: The bound for anything one cycle waits for: a release follows its mark
#: within milliseconds, a handshake and a read take a few; the rest is room
#: for a loaded 2-core machine.
PATIENCE = 30.0


class Releases:
    """The ``released`` events of a keepalive, collected by a thread."""

    def __init__(self, keepalive) -> None:
        self.events: List[dict] = []
        self._cv = threading.Condition()
        self._src = keepalive.events()
        threading.Thread(target=self._run, daemon=True, name="released-events").start()

    def _run(self) -> None:
        for e in self._src:
            if e["kind"] == "released":
                e["at"] = time.monotonic()
                with self._cv:
                    self.events.append(e)
                    self._cv.notify_all()

    def of(self, engine: str) -> List[dict]:
        with self._cv:
            return [e for e in self.events if e["engine"] == engine]

    def wait(self, engine: str, n: int, within: float = PATIENCE) -> dict:
        """The ``n``-th release of ``engine`` (1-based)."""
        deadline = time.monotonic() + within
        with self._cv:
            while True:
                mine = [e for e in self.events if e["engine"] == engine]
                if len(mine) >= n:
                    return mine[n - 1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"release #{n} of {engine}: not within {within:.0f} s; released events seen: {mine}"
                    )
                self._cv.wait(left)


def read_every_rank(worker, engine, ranks: int, cycle: int) -> None:
    for rank in range(ranks):
        o = worker.read_block(engine.id, rank, (cycle + rank) % 8)
        assert o.result == "verified", o


def release_and_reload(worker, releases: Releases, address: str, engine, cycle: int, ranks: int):
    """One cycle; returns the new registration and the release event."""
    ways = [
        dict(engine=engine.id, mode="drain"),
        dict(address=address, mode="fail"),
        dict(engine=engine.id, mode="fail"),
        dict(address=address, mode="drain"),
    ]
    way = ways[cycle % len(ways)]
    n = len(releases.of(engine.id)) + 1
    if "engine" in way:
        worker.keepalive.peer_gone(way["engine"], mode=way["mode"])
    else:
        worker.keepalive.peer_gone(address=way["address"], mode=way["mode"])
    released = releases.wait(engine.id, n)
    assert released["reason"] == "peer_gone" and released["failed_steps"] == 0, released
    again = worker.add_remote_agent(address)
    assert again.id == engine.id and again.is_live, again
    read_every_rank(worker, again, ranks, cycle)
    return again, released


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--cycles", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--agent-first",
        action="store_true",
        help="make a nixl_agent (UCX backend) before importing nixl_keepalive: too late for it",
    )
    args = ap.parse_args(argv)
    if args.agent_first:
        from nixl_cu12 import nixl_agent, nixl_agent_config  # type: ignore

        early = nixl_agent(f"early-{os.getpid()}", nixl_agent_config(enable_prog_thread=False))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import nixl_keepalive
        from vllm_decode import NixlConnectorWorker

        worker = NixlConnectorWorker(interval="inf")
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    releases = Releases(worker.keepalive)
    engine = worker.add_remote_agent(args.address)
    read_every_rank(worker, engine, args.ranks, 0)
    engine, _ = release_and_reload(worker, releases, args.address, engine, 0, args.ranks)
    mode = nixl_keepalive.endpoint_close_mode()
    print(f"READY pid={os.getpid()} mode={mode['mode']} reason={json.dumps(mode['reason'])}", flush=True)
    sys.stdin.readline()
    for i in range(1, args.cycles + 1):
        engine, _ = release_and_reload(worker, releases, args.address, engine, i, args.ranks)
    events = releases.of(engine.id)
    summary: Dict[str, object] = {
        "releases": len(events),
        "left_open": [e["endpoints_left_open"] for e in events],
        "endpoints": worker.keepalive.snapshot()["endpoints"],
        "warnings": warned,
    }
    print("DONE " + json.dumps(summary), flush=True)
    sys.stdin.read()
    worker.shutdown()
    if args.agent_first:
        del early
    return 0


if __name__ == "__main__":
    sys.exit(main())
