"""A pytest plugin that runs vLLM's own push-connector unit tests
(``tests/v1/kv_connector/unit/test_nixl_push_connector.py`` of the sdist)
with our push connector in its place (``pytest -p vllm_push_unit_plugin``,
this directory on ``PYTHONPATH``; scripts/test-vllm.sh does it), and shows,
by count, that our code ran.

The substitution, in full (the sdist's files are not edited): before any
test module is imported, every name vLLM's tests and vLLM's connector
factory resolve to the push connector or its worker points at ours:

- ``nixl.NixlPushConnector`` and ``nixl.connector.NixlPushConnector`` ->
  :class:`KeepaliveNixlPushConnector`; the factory's ``NixlPushConnector``
  entry loads it too (the plugin vLLM users turn on with
  ``NIXL_KEEPALIVE_VLLM=1``);
- ``nixl.NixlPushConnectorWorker`` and
  ``nixl.push_worker.NixlPushConnectorWorker`` (what the tests instantiate
  and subclass: their ``_StubWriterWorker`` becomes a subclass of ours) ->
  :class:`KeepaliveNixlPushConnectorWorker`.

vLLM's push tests build their workers with ``object.__new__`` (no NIXL
agent, no ``__init__``) and drive one method at a time. Every method our
worker defines, or takes from the mixins it shares with the pull worker,
is wrapped to count, per test, which of them ran and on what:

- ``service on``: on a worker of ours whose service ran;
- ``service off``: on a worker of ours whose service refused the agent;
- ``no __init__``: on a worker of ours built with ``object.__new__``: our
  method ran, found no service (there is none to give such an object) and
  took vLLM's path, which is what the test then checks;
- ``vLLM's worker``: the test built vLLM's own push worker, not ours (a
  hole in the substitution): the run fails;
- ``no worker``: none of ours ran (scheduler, metadata, helper tests).

The run fails when fewer tests than :data:`MIN_OURS_RAN` (for the vLLM
version under test) ran a method of ours.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, Set

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import nixl_keepalive  # noqa: E402,F401 - before any nixl_agent

import nixl_keepalive_plugins  # noqa: E402
from nixl_keepalive.vllm_push import (  # noqa: E402
    KeepaliveNixlPushConnector,
    KeepaliveNixlPushConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import nixl as _nixl  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as _connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker as _push_worker  # noqa: E402

VLLM_VERSION = importlib.metadata.version("vllm")

#: The tests that must have run a method of our push worker, per vLLM
#: release: measured (docs/vllm.md, "vLLM's own unit tests"), so that a
#: change that quietly takes ours out of vLLM's tests fails the run.
MIN_OURS_RAN: Dict[str, int] = {"0.34.0": 25, "0.33.0": 27}

_VLLM_PUSH_WORKER = _push_worker.NixlPushConnectorWorker

SUBSTITUTED = {
    "nixl.NixlPushConnector": (_nixl, "NixlPushConnector", KeepaliveNixlPushConnector),
    "nixl.connector.NixlPushConnector": (_connector, "NixlPushConnector", KeepaliveNixlPushConnector),
    "nixl.NixlPushConnectorWorker": (_nixl, "NixlPushConnectorWorker", KeepaliveNixlPushConnectorWorker),
    "nixl.push_worker.NixlPushConnectorWorker": (_push_worker, "NixlPushConnectorWorker",
                                                 KeepaliveNixlPushConnectorWorker),
}


def _substitute() -> None:
    for module, name, ours in SUBSTITUTED.values():
        if hasattr(module, name):
            setattr(module, name, ours)


_substitute()
# The factory, by vLLM's own name: what NIXL_KEEPALIVE_VLLM=1 does.
os.environ[nixl_keepalive_plugins.VLLM_SWITCH] = "1"
nixl_keepalive_plugins.vllm()

# -- counting ----------------------------------------------------------------

_used: Set[str] = set()
_methods: Counter = Counter()
_per_test: Dict[str, str] = {}
_skipped: Dict[str, str] = {}

_vllm_init = _VLLM_PUSH_WORKER.__init__


def _counting_vllm_init(self, *args, **kwargs):
    if not isinstance(self, KeepaliveNixlPushConnectorWorker):
        _used.add("vLLM's worker")
    return _vllm_init(self, *args, **kwargs)


_VLLM_PUSH_WORKER.__init__ = _counting_vllm_init


def _kind(self) -> str:
    if "_ka" not in vars(self):
        return "no __init__"
    return "service on" if vars(self).get("_ka") is not None else "service off"


def _counted(name: str, fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        # The mixins are the pull worker's too: only our push worker counts.
        if isinstance(self, KeepaliveNixlPushConnectorWorker):
            _used.add(_kind(self))
            _methods[name] += 1
        return fn(self, *args, **kwargs)

    return wrapper


#: Our classes in the push worker's bases: the worker and the mixins it
#: shares with the pull worker (nixl_keepalive.vllm_service, ...), each
#: method counted where it is defined.
_OURS = [c for c in KeepaliveNixlPushConnectorWorker.__mro__ if c.__module__.startswith("nixl_keepalive.")]

# Not counted: ``shutdown``, which vLLM's ``__del__`` calls whenever the
# garbage collector takes an earlier test's worker (it would count a test
# that never used ours), nor the constructor's own steps.
for _cls in _OURS:
    for _name, _fn in list(vars(_cls).items()):
        if callable(_fn) and not isinstance(_fn, (staticmethod, classmethod, type)) and _name not in (
                "__init__", "shutdown", "_ka_construct", "_ka_undo_construction"):
            setattr(_cls, _name, _counted(_name, _fn))

_our_init = KeepaliveNixlPushConnectorWorker.__init__


def _counting_our_init(self, *args, **kwargs):
    try:
        return _our_init(self, *args, **kwargs)
    finally:
        _used.add(_kind(self))


KeepaliveNixlPushConnectorWorker.__init__ = _counting_our_init

#: The order a test is classified in: the first kind it used.
_ORDER = ("vLLM's worker", "service on", "service off", "no __init__")


def pytest_report_header(config):
    return [f"nixl_keepalive: vLLM {VLLM_VERSION}: vLLM's NixlPushConnector / its worker resolve to "
            "KeepaliveNixlPushConnector / KeepaliveNixlPushConnectorWorker (tests_vllm/vllm_push_unit_plugin.py); "
            "each test's use of them is counted"]


def pytest_runtest_setup(item):
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


def _ours_ran() -> int:
    counts = Counter(_per_test.values())
    return sum(counts.get(k, 0) for k in ("service on", "service off", "no __init__"))


def _problems() -> list:
    problems = []
    vllm_own = sorted(t for t, k in _per_test.items() if k == "vLLM's worker")
    if vllm_own:
        problems.append(f"{len(vllm_own)} test(s) built vLLM's own push worker, not ours: {vllm_own[:5]}")
    floor = MIN_OURS_RAN.get(VLLM_VERSION)
    if floor is None:
        problems.append(f"no recorded floor of tests that ran our push worker for vLLM {VLLM_VERSION} "
                        "(MIN_OURS_RAN)")
    elif _ours_ran() < floor:
        problems.append(f"{_ours_ran()} test(s) ran a method of our push worker; recorded for vLLM {VLLM_VERSION}: "
                        f"at least {floor}")
    if _skipped and os.environ.get("CI") == "true":
        problems.append(f"{len(_skipped)} skip(s) in vLLM's push-connector tests: {sorted(_skipped)[:5]}")
    return problems


def pytest_sessionfinish(session, exitstatus):
    if _per_test and _problems() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = Counter(_per_test.values())
    tr = terminalreporter
    tr.section("nixl_keepalive: which push worker vLLM's tests used")
    for kind in _ORDER + ("no worker", "skipped"):
        tr.write_line(f"{kind:>14}: {counts.get(kind, 0)}")
    tr.write_line(f"{'ours ran':>14}: {_ours_ran()}")
    tr.write_line(f"{'total':>14}: {len(_per_test)}")
    tr.write_line("our methods called: " + ", ".join(f"{n} {c}" for n, c in sorted(_methods.items())))
    for nodeid, reason in sorted(_skipped.items()):
        tr.write_line(f"SKIPPED {nodeid}: {reason}")
    for p in _problems():
        tr.write_line(f"FAILED (nixl_keepalive count): {p}", red=True)
