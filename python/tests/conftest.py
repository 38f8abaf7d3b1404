"""Shared by the Python tests: the real NIXL Python API (or a loud skip),
real ``nixl-keepalive prefill`` processes, the vLLM-shaped example worker,
waiting for state with deadlines, and measurement lines that show in CI
logs (``MEASURED ...``, also appended to
``target/tmp/python-measurements.log``).

Real tests need two things: NIXL's Python API (``nixl_cu12``, installed by
``scripts/install-python.sh``) and the prefill binary
(``target/debug/nixl-keepalive``, built by ``cargo test``; override with
``NIXL_KEEPALIVE_BIN``). Without either they print ``SKIPPED`` with the
reason and skip; with ``NIXL_KEEPALIVE_REQUIRE_REAL=1`` or ``CI=true`` they
fail instead.

UCX is pinned to loopback (``UCX_NET_DEVICES=lo``, unless set already) for
this process and every process it starts, as in the Rust real tests: UCX
otherwise reaches a prefill over every interface it finds, and reads over
an address that vanishes hang. ``nixl_keepalive`` is imported here, before
any test makes a ``nixl_agent``: that is what lets its releases close a
live prefill's endpoints (``nixl_keepalive.endpoint_close_mode()``).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, TypeVar

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

try:  # First, before any nixl_agent of this process (see the docstring).
    import nixl_keepalive  # noqa: F401
except ImportError:  # test_api.py says what is missing
    pass

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "python" / "examples"
sys.path.insert(0, str(EXAMPLES))

T = TypeVar("T")


def real_required() -> bool:
    """Whether a missing runtime fails the real tests instead of skipping
    them."""
    return os.environ.get("NIXL_KEEPALIVE_REQUIRE_REAL") == "1" or os.environ.get("CI") == "true"


def skip_or_fail(reason: str) -> None:
    """Skips loudly, or fails when the real runtime is required."""
    if real_required():
        pytest.fail(f"real runtime required (NIXL_KEEPALIVE_REQUIRE_REAL=1 or CI=true): {reason}")
    sys.stderr.write(f"\nSKIPPED (real NIXL test): {reason}\n")
    sys.stderr.flush()
    pytest.skip(reason)


_MEASURED: List[str] = []


def report(line: str) -> None:
    """A measurement: listed at the end of the run (passing tests too) and
    appended to the measurements log."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    text = f"MEASURED {test}: {line}"
    _MEASURED.append(text)
    log = REPO / "target" / "tmp"
    try:
        log.mkdir(parents=True, exist_ok=True)
        with open(log / "python-measurements.log", "a") as f:
            f.write(text + "\n")
    except OSError:
        pass


def pytest_terminal_summary(terminalreporter) -> None:
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


#: What a real test's deadline adds to the bound under test: scheduling
#: on a loaded 2-core machine, never the bound itself (the Rust tests'
#: ``common::wait::MARGIN``).
MARGIN = 10.0

#: How long an idle thread of the package's tokio blocking pool lives
#: (tokio's default): threads a burst of calls started are gone after it.
BLOCKING_KEEP_ALIVE = 10.0


def wait_for(what: str, check: Callable[[], Optional[T]], within: float, seen: Callable[[], object] = lambda: None) -> T:
    """Polls ``check`` until it returns something other than None, False or
    an empty collection (a list of what is awaited that is still empty is
    "not yet", never an answer), for at most ``within`` seconds; on timeout
    fails with what was seen. Real tests wait for what they assert with
    this (or ``EventLog.wait``), never sleep and then assert."""
    deadline = time.monotonic() + within
    while True:
        got = check()
        empty = isinstance(got, (list, tuple, dict, set, str, bytes)) and len(got) == 0
        if got is not None and got is not False and not empty:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within:.1f} s; saw: {seen()!r}")
        time.sleep(0.002)


class EventLog:
    """Every event of a keepalive, collected by a thread, searchable."""

    def __init__(self, keepalive) -> None:
        self.events: List[dict] = []
        self._lock = threading.Lock()
        self._src = keepalive.events()
        self._thread = threading.Thread(target=self._run, daemon=True, name="event-log")
        self._thread.start()

    def _run(self) -> None:
        for e in self._src:
            e["at"] = time.monotonic()
            with self._lock:
                self.events.append(e)

    def all(self) -> List[dict]:
        with self._lock:
            return list(self.events)

    def find(self, kind: str, **fields) -> Optional[dict]:
        for e in self.all():
            if e["kind"] == kind and all(e.get(k) == v for k, v in fields.items()):
                return e
        return None

    def wait(self, kind: str, within: float, **fields) -> dict:
        return wait_for(
            f"event {kind} {fields}", lambda: self.find(kind, **fields), within,
            seen=lambda: [(e["kind"], e.get("engine")) for e in self.all()],
        )


@pytest.fixture(scope="session")
def nixl_api():
    """NIXL's Python API, or a loud skip."""
    try:
        import nixl_cu12  # noqa: F401
        from nixl_cu12 import _bindings
    except ImportError as e:
        skip_or_fail(f"NIXL's Python API (nixl_cu12) cannot be imported: {e}; run scripts/install-python.sh")
    return _bindings


def prefill_binary() -> Path:
    return Path(os.environ.get("NIXL_KEEPALIVE_BIN", REPO / "target" / "debug" / "nixl-keepalive"))


@pytest.fixture(scope="session")
def prefill_bin(nixl_api) -> Path:
    """The `nixl-keepalive` binary, or a loud skip."""
    path = prefill_binary()
    if not path.is_file():
        skip_or_fail(f"{path} is missing: run `cargo build -p nixl-keepalive-cli` (scripts/test.sh does)")
    return path


_PORT_TURN = [0]


def listen_outside_ephemeral() -> str:
    """A loopback address on a free port outside the kernel's ephemeral
    range: a prefill restarted on its port must find it free, and a port in
    that range can be taken meanwhile as the local port of any outgoing
    connection (seen under load: a killed prefill's port "already in use"
    when its successor started)."""
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first, span = 10_000, max(low - 10_000, 1000)
    seed = (os.getpid() * 2_654_435_761) ^ time.monotonic_ns()
    for _ in range(1000):
        _PORT_TURN[0] += 1
        port = first + (seed + _PORT_TURN[0] * 7919) % span
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"127.0.0.1:{port}"
    raise RuntimeError(f"no free loopback port between {first} and {first + span}")


class Prefill:
    """A real `nixl-keepalive prefill` process (on a port of
    ``listen_outside_ephemeral`` unless ``listen`` names one)."""

    def __init__(self, binary: Path, listen: str = "127.0.0.1:0", engine_id: Optional[str] = None,
                 ranks: int = 1, blocks: int = 8, block_size: int = 64 << 10, args: List[str] = (),
                 env: Optional[Dict[str, str]] = None) -> None:
        if listen.endswith(":0") and listen.startswith("127.0.0.1"):
            listen = listen_outside_ephemeral()
        log_dir = REPO / "target" / "tmp"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"py-prefill-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = [str(binary), "prefill", "--listen", listen, "--blocks", str(blocks),
               "--block-size", str(block_size), "--ranks", str(ranks), *args]
        if engine_id:
            cmd += ["--engine-id", engine_id]
        env = dict(os.environ, RUST_LOG="info", **(env or {}))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self.lines: List[str] = []
        ready = threading.Event()
        self.ready_line = ""

        def drain() -> None:
            # Reads stdout for the process's life: UCX logs there too.
            for raw in self.proc.stdout:  # type: ignore[union-attr]
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append(line)
                if line.startswith("PREFILL READY"):
                    self.ready_line = line
                    ready.set()

        self._drain = threading.Thread(target=drain, daemon=True, name="prefill-stdout")
        self._drain.start()
        if not ready.wait(30):
            self.kill()
            pytest.fail(f"prefill never got ready; stdout {self.lines}; log {self.log_text()[-2000:]}")
        fields = dict(w.split("=", 1) for w in self.ready_line.split()[2:])
        self.engine_id = fields["engine"]
        self.address = fields["listen"]
        self.pid = int(fields["pid"])
        self.incarnation = int(fields["incarnation"])
        self.gone = False

    def kill(self) -> float:
        """SIGKILL and reap; returns when the signal was sent."""
        at = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self.gone = True
        self._log.close()
        return at

    def signal(self, sig: int) -> float:
        """Sends ``sig``; for SIGSTOP, returns once the process is stopped
        (its state in /proc is ``T``): kill() returns before the stop takes
        effect, and a read posted in between is served by a prefill that
        still runs. Returns when it was sent."""
        at = time.monotonic()
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            stat = f"/proc/{self.proc.pid}/stat"
            wait_for(f"prefill {self.proc.pid} stopped",
                     lambda: open(stat).read().rsplit(")", 1)[1].split()[0] in ("T", "t"),
                     MARGIN, seen=lambda: open(stat).read())
        return at

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if not self.gone:
            self.kill()
        self._drain.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            self.log_path.unlink()
        except OSError:
            pass


@pytest.fixture
def prefills(prefill_bin):
    """Starts prefills; kills every one at the end of the test."""
    started: List[Prefill] = []

    def start(**kw) -> Prefill:
        p = Prefill(prefill_bin, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture
def make_worker(nixl_api):
    """Makes vLLM-shaped decode workers (python/examples/vllm_decode.py);
    shuts each down at the end of the test."""
    from vllm_decode import NixlConnectorWorker

    made = []

    def make(**kw):
        w = NixlConnectorWorker(**kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()
    # The agents go here, inside this test's teardown, not whenever pytest
    # drops the fixtures: a failure in an agent's destruction (UCX tearing
    # down its endpoints) is reported against the test that made it.
    made.clear()
    gc.collect()


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))
