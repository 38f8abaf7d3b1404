"""No READ outside a guard: the two holes found from outside (issue 48),
each shown on real vLLM prefills and a real decode worker, each a test that
fails on the code before the fix.

1. A READ found in vLLM's ``_recving_transfers`` without a guard (posted by
   code that bypassed our ``_read_blocks``) after its engine was marked:
   it is adopted (``Engine.adopt_posted_read``) and holds the release until
   it ends. Before, the guard was refused and the loop gave up on it: the
   engine was released as soon as its guarded reads ended, under it.
2. A READ for an engine the service holds but this worker's table lacks: it
   is guarded through the service. Before, it was posted with no guard.
"""

from __future__ import annotations

import signal

import pytest

from test_vllm_real import verify

# Every scenario here runs on every tested release in CI (conftest.EVERY_RELEASE).
pytestmark = pytest.mark.every_release


def _post(d, p, rids, first_remote):
    """Posts one READ per request id, in one step; returns {rid: (local, remote)}."""
    reqs, blocks = {}, {}
    for i, rid in enumerate(rids):
        remote = [first_remote + i]
        local = [d.free.pop(0)]
        d.local_of[rid] = local
        reqs[rid] = (local, remote, p.engine_id, f"remote-{rid}")
        blocks[rid] = (local, remote)
    d.step(reqs, port=p.port)
    return blocks


def test_a_read_found_unguarded_after_the_mark_holds_the_release_until_it_ends(prefills, decode):
    p = prefills("P-adopt")
    d = decode(keepalive={"read_stall": "600s"})  # the stall rule out of the way
    req, _ = d.read(p.engine_id, p.port, [1])
    assert d.wait([req], 60)[req].ok
    w = d.worker
    engine = w._ka_engines[p.engine_id]
    p.signal(signal.SIGSTOP)
    blocks = _post(d, p, ["guarded", "bypassed"], 30)
    handles = {t.req_id: h for h, t in w._ka_reads.items()}
    assert set(handles) == {"guarded", "bypassed"}, handles
    # "bypassed" as if another code path had posted it: no guard, its
    # handle left in vLLM's table for vLLM to poll.
    w._ka_reads.pop(handles["bypassed"]).read.close()
    assert engine.reads_in_flight == 1
    d.ka.peer_gone(engine, mode="drain")  # marked; "guarded" holds the release
    w._ka_guard_untracked()  # what each step does first
    # The guarded READ's guard ends, as its transfer's would.
    w._ka_reads.pop(handles["guarded"]).read.close()
    assert not engine.wait_released(2.0), "released under the bypassed READ, which is still in flight"
    assert engine.reads_in_flight == 1
    p.signal(signal.SIGCONT)
    outcomes = d.wait(["bypassed"], 60)
    assert outcomes["bypassed"].ok
    verify(d, p.seed, *blocks["bypassed"])
    assert engine.wait_released(30), "released once the bypassed READ ended"
    assert w._ka_unguarded == 0


def test_a_read_for_an_engine_missing_from_the_workers_table_is_guarded_by_the_service(prefills, decode):
    p = prefills("P-table")
    d = decode(keepalive={"read_stall": "600s"})
    req, _ = d.read(p.engine_id, p.port, [1])
    assert d.wait([req], 60)[req].ok
    w = d.worker
    # The worker's table out of step with the service (the service still
    # holds the registration).
    engine = w._ka_engines.pop(p.engine_id)
    p.signal(signal.SIGSTOP)
    blocks = _post(d, p, ["untabled"], 40)
    assert engine.reads_in_flight == 1, "the READ runs under a guard of the service's registration"
    d.ka.peer_gone(engine, mode="drain")
    assert not engine.wait_released(2.0), "released under the READ"
    p.signal(signal.SIGCONT)
    assert d.wait(["untabled"], 60)["untabled"].ok
    verify(d, p.seed, *blocks["untabled"])
    assert engine.wait_released(30)
