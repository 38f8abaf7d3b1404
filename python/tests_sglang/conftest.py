"""The SGLang tier's fixtures: SGLang 0.5.23 with NIXL's Python API (or a
loud skip; a failure under ``CI=true`` / ``NIXL_KEEPALIVE_REQUIRE_REAL=1``),
and its prefill and decode ranks as real processes (``peer.py``), each
driven by one JSON command per line. This process imports neither SGLang
nor NIXL. Waits poll with deadlines inside the peers, never sleep-then-assert.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests_common"))

from ports import free_port  # noqa: E402,F401  (below the ephemeral range; the tests import it from here)

#: How long a rank may take to start (SGLang imports in 12-14 s here, idle).
START_WITHIN = 240.0


def real_required() -> bool:
    return os.environ.get("NIXL_KEEPALIVE_REQUIRE_REAL") == "1" or os.environ.get("CI") == "true"


def _missing() -> Optional[str]:
    import importlib.metadata as m
    import importlib.util

    for dist, why in (("sglang", "bash scripts/install-sglang.sh"), ("nixl", "nixl==1.5.1 with nixl-cu13"),
                      ("nixl-keepalive", "the package's wheel (scripts/test-sglang.sh builds it)")):
        try:
            version = m.version(dist)
        except m.PackageNotFoundError:
            return f"{dist} is not installed in this interpreter ({why})"
        if dist == "sglang" and version != "0.5.23":
            return f"SGLang {version} is installed; this tier is for 0.5.23"
    if importlib.util.find_spec("nixl_keepalive.sglang") is None:
        return "nixl_keepalive.sglang is missing from the installed package"
    return None


MISSING = _missing()


class Peer:
    """A real SGLang rank process (``peer.py prefill|decode``)."""

    def __init__(self, role: str, log_dir: Path, **start: Any) -> None:
        self.role = role
        self.log = log_dir / f"{role}-{time.monotonic_ns()}.log"
        env = dict(os.environ)
        env["SGLANG_TIER_MODEL"] = str(self.log.with_suffix(".model"))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "peer.py"), role], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, text=True, env=env, cwd=HERE,
            )
        self.info: Dict[str, Any] = {}
        self.send("start", **start)

    def started(self) -> "Peer":
        """Waits for the reply to ``start`` (SGLang's imports, its manager)."""
        if not self.info:
            self.info = self.reply("start", START_WITHIN)
        return self

    def call(self, cmd: str, **args: Any) -> Dict[str, Any]:
        """Sends one command and returns its reply; fails the test, with the
        rank's log tail, on an error, an exit or no reply within 60 s more
        than the command's own ``within``."""
        self.started()
        self.send(cmd, **args)
        return self.reply(cmd, float(args.get("within", 0)) + 60.0)

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, cmd: str, timeout: float) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.kill()
                pytest.fail(f"{self.role} gave no reply to {cmd} within {timeout} s:\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"{self.role} exited ({self.proc.wait()}) during {cmd}:\n{self.tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            pytest.fail(f"{self.role} {cmd} failed: {reply.get('error')}\n{self.tail()}")
        return reply

    @property
    def agent(self) -> str:
        return str(self.info["agent"])

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill (one clock for
        every process of this machine)."""
        at = time.monotonic()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        return at


def _require_sglang() -> None:
    if MISSING is not None:
        if real_required():
            pytest.fail(f"real runtime required (NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true): {MISSING}")
        sys.stderr.write(f"\nSKIPPED (real SGLang test): {MISSING}\n")
        pytest.skip(MISSING)


@pytest.fixture
def sglang_process():
    """Runs a Python snippet in a fresh process of this interpreter (SGLang's
    and NIXL's), with ``env`` over this environment (a ``None`` value
    removes the variable); returns the finished ``CompletedProcess``."""
    _require_sglang()

    def run(code: str, env: Dict[str, Optional[str]]) -> subprocess.CompletedProcess:
        full = dict(os.environ)
        for k, v in env.items():
            if v is None:
                full.pop(k, None)
            else:
                full[k] = v
        return subprocess.run([sys.executable, "-c", code], env=full, cwd=HERE, capture_output=True, text=True,
                              timeout=START_WITHIN)

    return run


@pytest.fixture
def ranks():
    """Starts SGLang ranks (``start(role, **start)``); kills what is left."""
    _require_sglang()
    started: List[Peer] = []
    log_dir = Path(os.environ.get("SGLANG_TIER_LOGS") or tempfile.mkdtemp(prefix="sglang-tier-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def start(role: str, **args: Any) -> Peer:
        """Spawns a rank and sends it ``start``; ``.started()`` waits for it
        (two ranks start side by side)."""
        p = Peer(role, log_dir, **args)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
