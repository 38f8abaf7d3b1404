"""A pytest plugin that runs vLLM's own NixlConnector unit tests with our
connector in its place (``pytest -p vllm_unit_plugin``, this directory on
``PYTHONPATH``; scripts/test-vllm.sh does it), and shows, by count, that
our code ran.

The substitution, in full (the sdist's files are not edited): before any
test module is imported, every name vLLM's tests and vLLM's connector
factory resolve to the pull connector or its worker points at ours:

- ``nixl.NixlConnector``, ``nixl.connector.NixlConnector`` and
  ``nixl.connector.NixlPullConnector`` -> :class:`KeepaliveNixlConnector`;
  the factory's ``NixlConnector`` and ``NixlPullConnector`` entries load it
  too (the plugin vLLM users turn on with ``NIXL_KEEPALIVE_VLLM=1``);
- ``nixl.NixlConnectorWorker``, ``nixl.worker.NixlConnectorWorker`` and
  ``nixl.pull_worker.NixlPullConnectorWorker`` (what the tests instantiate
  and subclass: their ``FakeNixlConnectorWorker`` becomes a subclass of
  ours) -> :class:`KeepaliveNixlConnectorWorker`.

vLLM's tests patch ``base_worker.NixlWrapper`` with their fake agent; our
worker then runs the keepalive service over that fake.

What each test used is counted and printed at the end:

- ``service on``: it built a worker of ours whose service ran;
- ``service off``: it built a worker of ours whose service refused the
  agent (a test double it cannot run over; vLLM's behaviour, said loudly);
- ``no __init__``: it used a worker of ours built with ``object.__new__``
  (vLLM's tests do that to call one method on a bare object): our methods
  ran, with no service (there is none to give such an object: its tables
  are whatever the test set by hand), so they fall back to vLLM's code;
- ``vLLM's worker``: it built vLLM's own worker, not ours (a hole in the
  substitution): the run fails;
- ``no worker``: it built none (scheduler, metadata, factory tests).

The run also fails when fewer tests than :data:`MIN_SERVICE_ON` (for the
vLLM version under test) had the service on, and, under CI, when a test
was skipped that docs/vllm.md does not list (section "Skips").
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, Set

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import nixl_keepalive  # noqa: E402,F401 - before any nixl_agent

import nixl_keepalive_plugins  # noqa: E402
from nixl_keepalive.vllm import KeepaliveNixlConnector, KeepaliveNixlConnectorWorker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import nixl as _nixl  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as _connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker as _pull_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as _worker  # noqa: E402

VLLM_VERSION = importlib.metadata.version("vllm")

#: The tests that must have run with the service on, per vLLM release:
#: measured (docs/vllm.md, "vLLM's own unit tests"), so that a change that
#: quietly turns the service off in vLLM's tests fails the run.
MIN_SERVICE_ON: Dict[str, int] = {"0.33.0": 139, "0.34.0": 141}

SUBSTITUTED = {
    "nixl.NixlConnector": (_nixl, "NixlConnector", KeepaliveNixlConnector),
    "nixl.connector.NixlConnector": (_connector, "NixlConnector", KeepaliveNixlConnector),
    "nixl.connector.NixlPullConnector": (_connector, "NixlPullConnector", KeepaliveNixlConnector),
    "nixl.NixlConnectorWorker": (_nixl, "NixlConnectorWorker", KeepaliveNixlConnectorWorker),
    "nixl.worker.NixlConnectorWorker": (_worker, "NixlConnectorWorker", KeepaliveNixlConnectorWorker),
    "nixl.pull_worker.NixlPullConnectorWorker": (_pull_worker, "NixlPullConnectorWorker",
                                                 KeepaliveNixlConnectorWorker),
}


def _substitute() -> None:
    for module, name, ours in SUBSTITUTED.values():
        if hasattr(module, name):
            setattr(module, name, ours)


_substitute()
# The factory, by the names launchers write: what NIXL_KEEPALIVE_VLLM=1 does.
os.environ[nixl_keepalive_plugins.VLLM_SWITCH] = "1"
nixl_keepalive_plugins.vllm()

# -- counting ----------------------------------------------------------------

_used: Set[str] = set()
_per_test: Dict[str, str] = {}
_skipped: Dict[str, str] = {}

_base_init = _base_worker.NixlBaseConnectorWorker.__init__
_our_init = KeepaliveNixlConnectorWorker.__init__
_our_on = KeepaliveNixlConnectorWorker._ka_on


def _counting_base_init(self, *args, **kwargs):
    if not isinstance(self, KeepaliveNixlConnectorWorker):
        _used.add("vLLM's worker")
    return _base_init(self, *args, **kwargs)


def _counting_our_init(self, *args, **kwargs):
    try:
        return _our_init(self, *args, **kwargs)
    finally:
        _used.add("service on" if getattr(self, "_ka", None) is not None else "service off")


def _counting_on(self):
    if "_ka" not in vars(self):
        _used.add("no __init__")
    return _our_on(self)


_base_worker.NixlBaseConnectorWorker.__init__ = _counting_base_init
KeepaliveNixlConnectorWorker.__init__ = _counting_our_init
KeepaliveNixlConnectorWorker._ka_on = _counting_on

#: The order a test is classified in: the first kind it used.
_ORDER = ("vLLM's worker", "service on", "service off", "no __init__")


def pytest_report_header(config):
    return [f"nixl_keepalive: vLLM {VLLM_VERSION}: vLLM's pull NixlConnector / its worker resolve to "
            "KeepaliveNixlConnector / KeepaliveNixlConnectorWorker (tests_vllm/vllm_unit_plugin.py); "
            "each test's use of them is counted"]


def pytest_runtest_setup(item):
    # Each test sees the substitution (a test may have restored a name).
    _substitute()
    _used.clear()


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.skipped):
        kind = next((k for k in _ORDER if k in _used), "no worker")
        _per_test[report.nodeid] = kind
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _skipped[report.nodeid] = reason
            _per_test[report.nodeid] = "skipped"


def _allowed_skips() -> Set[str]:
    """The test ids docs/vllm.md lists in its "Skips" table (first column,
    in backticks)."""
    doc = HERE.parent.parent / "docs" / "vllm.md"
    text = doc.read_text() if doc.exists() else ""
    m = re.search(r"^#+ Skips\b.*?(?=^#)", text, re.S | re.M)
    return set(re.findall(r"^\| `([^`]+)`", m.group(0), re.M)) if m else set()


def _problems() -> list:
    """What fails the run, as sentences."""
    counts = Counter(_per_test.values())
    problems = []
    vllm_own = sorted(t for t, k in _per_test.items() if k == "vLLM's worker")
    if vllm_own:
        problems.append(f"{len(vllm_own)} test(s) built vLLM's own worker, not ours: {vllm_own[:5]}")
    floor = MIN_SERVICE_ON.get(VLLM_VERSION)
    if floor is None:
        problems.append(f"no recorded floor of service-on tests for vLLM {VLLM_VERSION} (MIN_SERVICE_ON)")
    elif counts.get("service on", 0) < floor:
        problems.append(f"{counts.get('service on', 0)} test(s) ran with the service on; "
                        f"recorded for vLLM {VLLM_VERSION}: at least {floor}")
    unlisted = sorted(set(_skipped) - _allowed_skips())
    if unlisted and os.environ.get("CI") == "true":
        problems.append(f"{len(unlisted)} skip(s) not listed in docs/vllm.md (Skips): {unlisted[:5]}")
    return problems


def pytest_sessionfinish(session, exitstatus):
    # Runs before the terminal summary; the exit status carries the checks.
    if _per_test and _problems() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = Counter(_per_test.values())
    tr = terminalreporter
    tr.section("nixl_keepalive: which worker vLLM's tests used")
    for kind in _ORDER + ("no worker", "skipped"):
        tr.write_line(f"{kind:>14}: {counts.get(kind, 0)}")
    tr.write_line(f"{'total':>14}: {len(_per_test)}")
    for nodeid, reason in sorted(_skipped.items()):
        tr.write_line(f"SKIPPED {nodeid}: {reason}")
    for p in _problems():
        tr.write_line(f"FAILED (nixl_keepalive count): {p}", red=True)
