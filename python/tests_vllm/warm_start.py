"""vLLM processes started ahead of the test that needs them.

A vLLM prefill (``vllm_peer.py``) or push decode (``vllm_push_decode.py``)
spends most of its start-up importing torch and vLLM (8.7 s of CPU with the
bytecode the tier's install compiles, 22.9 s without it; measured on a
2-core machine), and the tier starts dozens of them. A warm process is a
fresh ``python warm_start.py`` started while the previous test runs: it
does those imports, says ``WARM``, and waits on stdin for the one line that
names the script it becomes (its argv and environment), then runs that
script as ``__main__`` in the same process. So each peer is still a process
of its own, exec'd fresh, with nothing of another test in it, and killed
for real; only the time of its imports moved.

What could differ from a cold start is the environment the imports saw, so
a warm process is used only where that cannot matter, and started cold
otherwise (:meth:`WarmPool.popen`):

- the imports here are vLLM's and torch's only: nothing of NIXL, UCX or
  ``nixl_keepalive`` is imported or loaded before the claim (checked in the
  child: ``sys.modules`` and ``/proc/self/maps``; a child that finds one
  refuses to be warm), so the tests' ``UCX_*``, ``NIXL_*`` and
  ``VLLM_NIXL_*`` settings are all read after it;
- every variable the imports read through ``os.environ`` is recorded; a
  claim whose environment differs from the warm process's in a recorded
  variable, or in any variable outside those three families (C code such
  as torch's may read others with ``getenv``), gets a cold start.

    python warm_start.py      (started by WarmPool, not by hand)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Set

#: Modules the tier's vLLM processes import before they build anything:
#: the bulk of their start-up (measured with ``python -X importtime
#: vllm_peer.py``: the CPU attention backend and the model config pull in
#: torch, torch._dynamo and most of vLLM). A name a release lacks is
#: skipped.
PRELOAD = (
    "torch",
    "vllm",
    "vllm.config",
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.models.config",
    "vllm.v1.executor",
    "vllm.distributed",
)

#: Variable families read only after the claim: no library that reads them
#: is loaded by the imports above (checked in the child).
LATE_PREFIXES = ("UCX_", "NIXL_", "VLLM_NIXL_")

#: Left out of every peer's environment, warm or cold: the test process's
#: own name for the test running (pytest's; vLLM's and torch's imports look
#: at it, and a peer is not a test) and its side-channel port (each peer
#: script sets its own from ``--port`` before anything reads it).
NOT_INHERITED = ("PYTEST_CURRENT_TEST", "VLLM_NIXL_SIDE_CHANNEL_PORT")


def peer_env() -> Dict[str, str]:
    """The environment a peer process gets: this process's, less
    :data:`NOT_INHERITED`."""
    return {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}


#: What must not be in the process before the claim.
_EARLY_MODULES = ("nixl", "nixl_keepalive")
_EARLY_LIBRARIES = ("libucp", "libucs", "libuct", "libnixl")


def _child() -> int:
    """The warm process: imports, checks, says WARM, becomes the claimed script."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    read: Set[str] = set()
    environ_type = type(os.environ)
    real_getitem = environ_type.__getitem__

    def recording_getitem(self, key):  # get/in/[] all come here
        read.add(key.decode(errors="replace") if isinstance(key, bytes) else str(key))
        return real_getitem(self, key)

    environ_type.__getitem__ = recording_getitem
    import importlib

    skipped = []
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                skipped.append(name)
    finally:
        environ_type.__getitem__ = real_getitem
    early = sorted(m for m in sys.modules if m.split(".")[0] in _EARLY_MODULES)
    with open("/proc/self/maps") as f:
        maps = f.read()
    early += sorted({lib for lib in _EARLY_LIBRARIES if lib in maps})
    if early:
        print("WARM-REFUSED " + json.dumps({"loaded": early}), flush=True)
        return 3
    print("WARM " + json.dumps({"read": sorted(read), "skipped": skipped}), flush=True)
    claim = json.loads(sys.stdin.readline() or "null")
    if claim is None:  # the pool closed it unclaimed
        return 0
    os.environ.clear()
    os.environ.update(claim["env"])
    script = claim["argv"][0]
    sys.argv = list(claim["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import runpy

    runpy.run_path(script, run_name="__main__")
    return 0


class _Warm:
    def __init__(self, env: Dict[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class WarmPool:
    """Keeps ``size`` warm processes started; :meth:`popen` hands one out
    (or starts the script cold where a warm one may not serve) and starts
    the next. Counts what it did: ``warm`` and ``cold`` starts, and why
    each cold one was cold."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._pool: List[_Warm] = []
        self._lock = threading.Lock()
        self.warm = 0
        self.cold: List[str] = []

    def fill(self) -> None:
        """Starts warm processes up to the pool's size (they import while
        the caller goes on)."""
        with self._lock:
            self._fill()

    def _fill(self) -> None:
        while len(self._pool) < self.size:
            self._pool.append(_Warm(peer_env()))

    def popen(self, argv: List[str], env: Dict[str, str], stdin: bool = False) -> subprocess.Popen:
        """A started process running ``python argv[0] argv[1:]`` with ``env``;
        stdout piped (text), stderr dropped, stdin piped when asked (a warm
        process's stdin is always a pipe: it is how it was claimed)."""
        with self._lock:
            warm = self._pool.pop(0) if self._pool else None
            self._fill()
        reason = self._unusable(warm, env)
        if reason is None:
            assert warm is not None and warm.proc.stdin is not None
            warm.proc.stdin.write(json.dumps({"argv": argv, "env": env}) + "\n")
            warm.proc.stdin.flush()
            self.warm += 1
            return warm.proc
        if warm is not None:
            warm.close()
        self.cold.append(reason)
        sys.stderr.write(f"\nwarm_start: cold start of {os.path.basename(argv[0])}: {reason}\n")
        return subprocess.Popen(
            [sys.executable] + argv, stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env,
        )

    def _unusable(self, warm: Optional[_Warm], env: Dict[str, str]) -> Optional[str]:
        """Why ``warm`` may not become a process with ``env`` (None: it may).
        Blocks until it has done its imports."""
        if warm is None:
            return "warm starts are off (TIER_WARM_START=0)" if self.size == 0 else \
                "no warm process (the pool is empty)"
        assert warm.proc.stdout is not None
        line = warm.proc.stdout.readline().rstrip("\n")
        if not line.startswith("WARM "):
            return f"the warm process said {line!r} (exit {warm.proc.poll()})"
        read = set(json.loads(line[5:])["read"])
        differ = {k for k in set(warm.env) | set(env) if warm.env.get(k) != env.get(k)}
        seen = sorted(differ & read)
        if seen:
            return f"its imports read {seen}, which differ now"
        early = sorted(k for k in differ if not k.startswith(LATE_PREFIXES))
        if early:
            return f"{early} differ now, outside {'/'.join(LATE_PREFIXES)} (C code may read them at import)"
        return None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, []
        for warm in pool:
            warm.close()


_POOL: Optional[WarmPool] = None


def enabled() -> bool:
    """Warm starts are on unless ``TIER_WARM_START=0`` (every peer cold, as
    before: to compare, or to rule them out)."""
    return os.environ.get("TIER_WARM_START", "1") != "0"


def pool() -> WarmPool:
    """The session's pool (size 2: a restart starts its second peer right
    after the first), made at the first start; size 0 when turned off."""
    global _POOL
    if _POOL is None:
        _POOL = WarmPool(2 if enabled() else 0)
    return _POOL


def summary() -> Optional[str]:
    """One line for the end of the run: how many peers started warm and
    cold, and why the cold ones were; None when no peer was started."""
    if _POOL is None or (_POOL.warm == 0 and not _POOL.cold):
        return None
    reasons: Dict[str, int] = {}
    for r in _POOL.cold:
        reasons[r] = reasons.get(r, 0) + 1
    why = "; ".join(f"{n} x {r}" for r, n in sorted(reasons.items()))
    return f"warm_start: {_POOL.warm} vLLM peer processes started warm, {len(_POOL.cold)} cold" + (
        f" ({why})" if why else "")


if __name__ == "__main__":
    sys.exit(_child())
