"""A pytest plugin that runs vLLM 0.33's own NixlConnector unit tests with
our connector in its place (``pytest -p vllm_unit_plugin``, this directory
on ``PYTHONPATH``; scripts/test-vllm.sh does it).

The substitution, in full (the sdist's files are not edited): before any
test module is imported, the names vLLM's tests and vLLM's connector
factory resolve are pointed at ours:

- ``vllm.distributed.kv_transfer.kv_connector.v1.nixl.NixlConnector`` and
  ``...nixl.connector.NixlConnector`` (what ``kv_connector="NixlConnector"``
  loads, and what the tests import) -> :class:`KeepaliveNixlConnector`;
- ``...nixl.NixlConnectorWorker`` and ``...nixl.worker.NixlConnectorWorker``
  (what the tests instantiate and subclass: their ``FakeNixlConnectorWorker``
  becomes a subclass of ours) -> :class:`KeepaliveNixlConnectorWorker`.

vLLM's tests patch ``base_worker.NixlWrapper`` with their fake agent; our
worker then runs the keepalive service over that fake (it duck-types the
three calls the service makes). ``nixl_keepalive`` is imported first.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nixl_keepalive  # noqa: E402,F401 - before any nixl_agent

from nixl_keepalive.vllm import KeepaliveNixlConnector, KeepaliveNixlConnectorWorker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import nixl as _nixl  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as _connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as _worker  # noqa: E402

SUBSTITUTED = {
    "nixl.NixlConnector": (_nixl, "NixlConnector", KeepaliveNixlConnector),
    "nixl.connector.NixlConnector": (_connector, "NixlConnector", KeepaliveNixlConnector),
    "nixl.NixlConnectorWorker": (_nixl, "NixlConnectorWorker", KeepaliveNixlConnectorWorker),
    "nixl.worker.NixlConnectorWorker": (_worker, "NixlConnectorWorker", KeepaliveNixlConnectorWorker),
}

for _module, _name, _ours in SUBSTITUTED.values():
    setattr(_module, _name, _ours)


def pytest_report_header(config):
    return ["nixl_keepalive: vLLM's NixlConnector / NixlConnectorWorker resolve to "
            "KeepaliveNixlConnector / KeepaliveNixlConnectorWorker (tests_vllm/vllm_unit_plugin.py)"]


def pytest_runtest_setup(item):
    # Each test sees the substitution (a test may have restored a name).
    for module, name, ours in SUBSTITUTED.values():
        setattr(module, name, ours)
