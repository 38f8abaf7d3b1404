"""The vLLM tier's fixtures: vLLM (0.33 or 0.34) with NIXL's Python API (or a loud
skip; a failure under ``CI=true`` / ``NIXL_KEEPALIVE_REQUIRE_REAL=1``),
real vLLM prefill workers as processes (``vllm_peer.py``), and the decode
(ours) in this process. Waits poll with deadlines, never sleep-then-assert.

``nixl_keepalive`` is imported before any ``nixl_agent`` of this process
(its releases then close a live prefill's endpoints).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests_common"))

from ports import free_port  # noqa: E402  (shared with the SGLang tier)
from processes import SignalledProcess  # noqa: E402

import warm_start  # noqa: E402

#: What a deadline adds to the bound under test on a loaded 2-core machine.
MARGIN = 10.0
#: How long a prefill process may take to start (vLLM imports in ~15 s here).
START_WITHIN = 180.0


#: The marker of the scenarios CI runs on every tested vLLM release: the
#: ones that go through a different hook or code path of vLLM each (the
#: version checks and the connector factory, the scheduler side, the
#: worker's tables and handshake, one kill, one freeze series, the router,
#: one replacement, the push connector's writes and a killed decode). The
#: rest (a second restart, idle kills, the read timeout, the push restarts
#: and freezes) exercise the service's rules through the same hooks: CI
#: runs them on the current release only (.ci/run, `-m every_release` on
#: the older one; docs/vllm.md, "What CI runs on which release"): 41 of
#: the 49.
EVERY_RELEASE = "every_release"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{EVERY_RELEASE}: run on every tested vLLM release in CI (the rest on the current one only)",
    )


def pytest_terminal_summary(terminalreporter) -> None:
    line = warm_start.summary()
    if line is not None:
        terminalreporter.write_line(line)


def pytest_sessionfinish(session) -> None:
    warm_start.pool().close()


def real_required() -> bool:
    return os.environ.get("NIXL_KEEPALIVE_REQUIRE_REAL") == "1" or os.environ.get("CI") == "true"


def _missing() -> Optional[str]:
    try:
        import nixl_keepalive  # noqa: F401 - first, before any nixl_agent
    except ImportError as e:
        return f"nixl_keepalive is not installed in this interpreter ({e})"
    try:
        import importlib.metadata as m

        version = m.version("vllm")
    except Exception:  # noqa: BLE001
        return "vLLM is not installed (bash scripts/install-vllm.sh)"
    from nixl_keepalive.vllm_hooks import TESTED_VLLM, tested

    if not tested(version):
        return f"vLLM {version} is installed; this tier is for {', '.join(s + '.x' for s in TESTED_VLLM)}"
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        return f"NIXL's Python API (nixl==1.5.1, nixl-cu13) is not importable: {e}"
    return None


MISSING = _missing()


@pytest.fixture(scope="session")
def vllm_ready():
    """vLLM set up in this process: environment, CPU block sizes, the
    distributed state of a world of one."""
    if MISSING is not None:
        if real_required():
            pytest.fail(f"real runtime required (NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true): {MISSING}")
        sys.stderr.write(f"\nSKIPPED (real vLLM test): {MISSING}\n")
        pytest.skip(MISSING)
    import vllm_env

    vllm_env.setup_environment()
    import nixl_keepalive  # noqa: F401

    vllm_env.patch_cpu_block_sizes()
    vllm_env.init_distributed(vllm_env.vllm_config(vllm_env.KEEPALIVE_CONNECTOR, "dist-init"))
    # The first peers' imports start now, in the environment they will run
    # in: this process's once its own imports have set what they set
    # (torch's and NIXL's).
    warm_start.pool().fill()
    return vllm_env


class Prefill(SignalledProcess):
    """A real vLLM prefill worker process (``vllm_peer.py``)."""

    role = "prefill"

    def __init__(self, engine_id: str, port: int, connector: str = "vllm", blocks: int = 64) -> None:
        self.engine_id = engine_id
        self.port = port
        self.lines: List[str] = []
        self.heartbeats: List[tuple] = []  # (monotonic, ids)
        self._lock = threading.Lock()
        self.proc = warm_start.pool().popen(
            [str(HERE / "vllm_peer.py"), "--port", str(port), "--engine-id", engine_id,
             "--connector", connector, "--blocks", str(blocks)],
            env=warm_start.peer_env(),
        )
        self.info: Dict = {}
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_WITHIN
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                pytest.fail(f"prefill {engine_id} exited ({self.proc.returncode}) before READY: {self.lines[-5:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"prefill {engine_id} not READY within {START_WITHIN} s: {self.lines[-5:]}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._lock:
                self.lines.append(line)
                if line.startswith("HB "):
                    self.heartbeats.append((time.monotonic(), line[3:]))
            if line.startswith("READY "):
                self.info = json.loads(line[6:])
                self._ready.set()

    @property
    def seed(self) -> int:
        return int(self.info["seed"])

    @property
    def agent(self) -> str:
        return str(self.info["agent"])

    def heartbeats_since(self, t: float) -> List[tuple]:
        with self._lock:
            return [h for h in self.heartbeats if h[0] >= t]


@pytest.fixture
def prefills():
    """Starts prefills (``start(engine_id, port=None)``); kills what is left."""
    started: List[Prefill] = []

    def start(engine_id: str, port: Optional[int] = None, connector: str = "vllm") -> Prefill:
        p = Prefill(engine_id, port or free_port(), connector)
        started.append(p)
        return p

    yield start
    for p in started:
        try:
            p.proc.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.kill()


@pytest.fixture
def decode(vllm_ready):
    """Makes decode workers (``make(**kw)``); shuts them down at the end."""
    from decode import Decode

    made: List[Decode] = []

    def make(**kw) -> Decode:
        d = Decode(engine_id=f"decode-{len(made)}-{os.getpid()}", **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.shutdown()
