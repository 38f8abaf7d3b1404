"""A child process the real-process tests stop, resume and kill for real
(python/tests_vllm's prefill and push decode); on ``sys.path`` as
``ports`` is."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest


class SignalledProcess:
    """Signals for a test's child process. The class that takes it sets
    ``proc`` (its ``subprocess.Popen``), ``engine_id``, and ``role`` (how a
    failure names it: "prefill", "decode")."""

    proc: subprocess.Popen
    engine_id: str
    role = "process"

    def signal(self, sig: int) -> float:
        """Sends ``sig``; returns the monotonic time it was sent. A
        SIGSTOP returns once every thread is stopped (state T), so nothing
        the test posts after this call is served by the process."""
        os.kill(self.proc.pid, sig)
        at = time.monotonic()
        if sig == signal.SIGSTOP:
            deadline = at + 10
            while not self._all_threads_stopped():
                if time.monotonic() > deadline:
                    pytest.fail(f"{self.role} {self.engine_id} (pid {self.proc.pid}) not stopped 10 s after SIGSTOP")
                time.sleep(0.001)
        return at

    def _all_threads_stopped(self) -> bool:
        task = f"/proc/{self.proc.pid}/task"
        try:
            states = []
            for tid in os.listdir(task):
                with open(f"{task}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            return False
        return bool(states) and all(st in ("T", "t") for st in states)

    def kill(self) -> float:
        """SIGKILL and reap; the time of the kill (now, if it was gone)."""
        if self.proc.poll() is None:
            at = self.signal(signal.SIGKILL)
            self.proc.wait(30)
            return at
        return time.monotonic()
