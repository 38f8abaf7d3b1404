"""Issue 43 on vLLM's real ``Scheduler`` and KV cache manager, with our
scheduler-side connector (``KeepaliveNixlConnectorScheduler``) built by
vLLM's factory: a request whose READ was given up fails at once, and its
blocks stay allocated until the workers say the READ is over.

The scheduler is vLLM's own, made with vLLM's own test helpers from the
release's sdist (``tests/v1/kv_connector/unit/utils.py``, imported, not
copied); the workers' outputs are what our worker reports (its side is
tested on real processes in ``test_vllm_real.py``). Each test runs
vLLM's own ``NixlConnector`` the same way first: that one frees the
blocks at the failure, which is what these tests would catch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Every scenario here runs on every tested release in CI (conftest.EVERY_RELEASE).
pytestmark = pytest.mark.every_release


OURS = ("KeepaliveNixlConnector", "nixl_keepalive.vllm")
VLLMS = ("NixlConnector", None)


def _utils():
    sdist = Path(sys.prefix) / "vllm-sdist"
    if not (sdist / "tests" / "v1" / "kv_connector" / "unit" / "utils.py").exists():
        pytest.fail(f"vLLM's sdist tests are not at {sdist} (bash scripts/install-vllm.sh unpacks them)")
    if str(sdist) not in sys.path:
        sys.path.insert(0, str(sdist))
    from tests.v1.kv_connector.unit import utils

    return utils


def _scheduler(u, connector):
    name, module = connector
    # vLLM's default load-failure policy ("fail"); the connector set on the
    # config the helper makes (its keywords differ between releases).
    config = u.create_vllm_config()
    config.kv_transfer_config.kv_connector = name
    config.kv_transfer_config.kv_connector_module_path = module
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"
    return u.create_scheduler(config, num_blocks=64)


def _loading(u, sched):
    """One request scheduled to load its KV from a remote prefill."""
    from vllm.v1.request import RequestStatus

    req = u.create_request(num_tokens=4 * sched.block_size, do_remote_prefill=True)
    sched.add_request(req)
    out = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return req, out


def _fail(u, sched, out, req):
    """The worker gave the READ up: the request reported failed."""
    rid = req.request_id
    output = u.create_model_runner_output([], finished_recving={rid})
    output.kv_connector_output.failed_recving = {rid}
    sched.update_from_output(out, output)


@pytest.mark.parametrize("aborted_first", [False, True])
def test_a_failed_load_fails_now_and_keeps_its_blocks_until_the_workers_say_over(vllm_ready, aborted_first):
    from vllm.v1.request import RequestStatus

    from nixl_keepalive.vllm import KeepaliveNixlConnectorScheduler

    u = _utils()
    # vLLM's own connector: the blocks go back at the failure (what the
    # assertions below would catch).
    sched = _scheduler(u, VLLMS)
    pool = sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    req, out = _loading(u, sched)
    assert pool.get_num_free_blocks() < free0
    _fail(u, sched, out, req)
    assert pool.get_num_free_blocks() == free0, "vLLM's own frees at once"

    sched = _scheduler(u, OURS)
    assert isinstance(sched.connector.connector_scheduler, KeepaliveNixlConnectorScheduler)
    pool = sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    req, out = _loading(u, sched)
    rid = req.request_id
    held = free0 - pool.get_num_free_blocks()
    assert held > 0
    if aborted_first:
        # The client gave up while the READ ran.
        sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    _fail(u, sched, out, req)
    assert req.is_finished(), req.status
    if not aborted_first:
        assert req.status == RequestStatus.FINISHED_ERROR, "failed at once (policy fail)"
    assert pool.get_num_free_blocks() == free0 - held, "blocks freed under a READ that may still run"
    # Announced to the workers; steps go by while the READ still runs.
    out = sched.schedule()
    assert rid in getattr(out.kv_connector_metadata, "ka_free_when_over", set())
    for _ in range(3):
        sched.update_from_output(out, u.create_model_runner_output([]))
        out = sched.schedule()
        assert pool.get_num_free_blocks() == free0 - held
    assert sched.connector.connector_scheduler.withheld_requests() == {rid}
    # Every worker says over: the blocks come back, the request is gone.
    sched.update_from_output(out, u.create_model_runner_output([], finished_sending={rid}))
    assert pool.get_num_free_blocks() == free0
    assert rid not in sched.requests
    assert not sched.connector.connector_scheduler.withheld_requests()
    u.assert_scheduler_empty(sched)


def test_a_load_that_completes_is_freed_as_vllm_frees_it(vllm_ready):
    from vllm.v1.request import RequestStatus

    u = _utils()
    sched = _scheduler(u, OURS)
    req, out = _loading(u, sched)
    sched.update_from_output(out, u.create_model_runner_output([], finished_recving={req.request_id}))
    out = sched.schedule()
    assert req.status == RequestStatus.RUNNING
    assert not getattr(out.kv_connector_metadata, "ka_free_when_over", None)
    assert not sched.connector.connector_scheduler.withheld_requests()
