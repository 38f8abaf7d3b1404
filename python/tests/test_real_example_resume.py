"""The example decode (``python/examples/vllm_decode.py``) run as a user
runs it, as its own process, against a real ``nixl-keepalive prefill``
that is frozen until the example says ``stalled``, then resumed and
stopped at once (issue 58, item 6). The example must release the prefill
once it is stopped and exit when its run ends: it once hung for good in
its re-handshake, waiting for the stalled registration's release, which
waited for the given-up READ that only that same waiting thread polled.

Without the runtime it prints ``SKIPPED`` and skips; with
``NIXL_KEEPALIVE_REQUIRE_REAL=1`` or ``CI=true`` it fails instead.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

from conftest import EXAMPLES, MARGIN, report, wait_for

#: The example's run, in seconds: long enough for the freeze (the stall
#: comes about 3 s after the stop) and what follows, short for CI.
RUN = 15.0


class Example:
    """``vllm_decode.py ADDRESS RUN`` as a process, its lines timestamped."""

    def __init__(self, address: str, seconds: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(EXAMPLES / "vllm_decode.py"), address, str(seconds)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        )
        self.lines: List[Tuple[float, str]] = []
        self._lock = threading.Lock()
        self._drain = threading.Thread(target=self._read, daemon=True, name="example-stdout")
        self._drain.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            with self._lock:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def find(self, start: str, *words: str) -> Optional[Tuple[float, str]]:
        with self._lock:
            for at, line in self.lines:
                if line.startswith(start) and all(w in line for w in words):
                    return at, line
        return None

    def event(self, kind: str, engine: str) -> Optional[Tuple[float, dict]]:
        """The first ``event: {...}`` line of this kind and engine."""
        with self._lock:
            lines = list(self.lines)
        for at, line in lines:
            if line.startswith("event: "):
                e = ast.literal_eval(line[len("event: "):])
                if e.get("kind") == kind and e.get("engine") == engine:
                    return at, e
        return None

    def text(self) -> str:
        with self._lock:
            return "\n".join(line for _, line in self.lines[:12] + self.lines[-6:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._drain.join(5)


def test_the_example_resumed_right_after_its_stall_then_stopped_releases_the_prefill_and_exits_on_time(
        prefills, nixl_api):
    p = prefills(ranks=1)
    ex = Example(p.address, RUN)
    try:
        wait_for("the example connected", lambda: ex.find("connected to", p.engine_id), MARGIN + 10,
                 seen=ex.text)
        # Reading, then frozen (the issue froze it 6 s in; what matters is
        # that reads run when it stops).
        stopped = p.signal(signal.SIGSTOP)
        stalled_at, _ = wait_for("the example printed stalled", lambda: ex.event("stalled", p.engine_id),
                                 MARGIN + 10, seen=ex.text)
        # Resumed at once, then stopped: its given-up READ ends (SUCCESS on
        # the resume, or failed by the death), and the stalled registration
        # may go.
        p.proc.send_signal(signal.SIGCONT)
        terminated = p.signal(signal.SIGTERM)
        released_at, released = wait_for("the example released the prefill",
                                          lambda: ex.event("released", p.engine_id), MARGIN, seen=ex.text)
        # And its run ends on time: its loop never waited for itself.
        deadline = ex.started + RUN + MARGIN + 10
        wait_for("the example exited", lambda: ex.proc.poll() is not None, max(deadline - time.monotonic(), 0),
                 seen=ex.text)
        exited = time.monotonic()
        assert ex.proc.returncode == 0, ex.text()
        assert ex.find("reads:") and ex.find("stopped:"), ex.text()
        report(f"SIGSTOP -> stalled {(stalled_at - stopped):.2f} s; SIGCONT+SIGTERM -> released "
               f"{(released_at - terminated) * 1000:.0f} ms (reason {released.get('reason')}); exited "
               f"{exited - ex.started:.1f} s after start (run {RUN:.0f} s)")
    finally:
        ex.stop()
