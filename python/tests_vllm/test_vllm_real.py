"""Real scenarios: real vLLM 0.33 prefill workers (vLLM's own NixlConnector,
as processes) and our connector's decode worker, over NIXL 1.5.1 on DRAM.

Every wait polls with a deadline: the bound under test plus ``MARGIN``
for a loaded 2-core machine, never a sleep followed by an assert.
"""

from __future__ import annotations

import time
from typing import Any, Dict

import pytest

from conftest import MARGIN

FAST = {"interval": "500ms"}


def crashed_bound(d) -> float:
    """The service's own bound on detecting a crashed prefill (snapshot)."""
    return d.ka.snapshot()["detection_bound_ms"]["crashed"] / 1000


def verify(d, seed: int, local, remote) -> None:
    import vllm_env

    bad = [(lb, rb) for lb, rb in zip(local, remote) if not vllm_env.block_matches(d.caches, lb, seed, rb)]
    assert not bad, f"blocks read wrong (local, remote): {bad}"


def released(d, engine_id: str):
    """The engine is gone from the service and from vLLM's tables."""
    return engine_id not in d.engines() and not d.tables(engine_id)


@pytest.mark.every_release
def test_reads_verified_and_heartbeats_reach_an_idle_prefill(prefills, decode):
    p = prefills("P-idle-hb")
    d = decode(keepalive=FAST)
    req, local = d.read(p.engine_id, p.port, [1, 2, 3])
    assert d.wait([req], 60)[req].ok
    verify(d, p.seed, local, [1, 2, 3])
    assert d.engines()[p.engine_id]["state"] == "live"
    # Idle now: vLLM would send it nothing; the service heartbeats it.
    t = time.monotonic()
    d.poll("an HB: at the idle prefill", lambda: p.heartbeats_since(t), 0.5 + MARGIN)


@pytest.mark.every_release
def test_killed_under_reads_released_within_bound_tables_consistent(prefills, decode):
    p = prefills("P-kill-reads")
    d = decode(keepalive=FAST)
    first, local = d.read(p.engine_id, p.port, [0, 1])
    assert d.wait([first], 60)[first].ok
    verify(d, p.seed, local, [0, 1])
    bound = crashed_bound(d)
    # Four requests posted in one step, the prefill killed right after.
    reqs = {}
    for i in range(4):
        remote = [8 + 4 * i + j for j in range(4)]
        local = [d.free.pop(0) for _ in remote]
        rid = f"kill-{i}"
        d.local_of[rid] = local
        reqs[rid] = (local, remote, p.engine_id, f"remote-{rid}")
    d.step(reqs, port=p.port)
    killed = p.kill()
    outcomes = d.wait(list(reqs), bound + MARGIN, "reads of a killed prefill ended")
    for rid, o in outcomes.items():
        if o.ok:  # completed before the kill: the bytes are the prefill's
            verify(d, p.seed, reqs[rid][0], reqs[rid][1])
    d.poll("killed prefill released, vLLM's tables purged", lambda: released(d, p.engine_id), bound + MARGIN)
    took = time.monotonic() - killed
    assert took <= bound + MARGIN
    assert not d.worker.held_requests()
    assert not d.worker._remote_agents.get(p.engine_id)
    print(f"MEASURED kill under reads -> released and purged in {took:.2f} s (bound {bound:.2f} s)")


def test_idle_prefill_killed_released_within_interval_and_bound(prefills, decode):
    p = prefills("P-idle-kill")
    d = decode(keepalive=FAST)
    req, _ = d.read(p.engine_id, p.port, [5])
    assert d.wait([req], 60)[req].ok
    bound = crashed_bound(d)
    t = time.monotonic()
    d.poll("an HB: at the idle prefill", lambda: p.heartbeats_since(t), 0.5 + MARGIN)
    killed = p.kill()
    d.poll("idle killed prefill released and purged", lambda: released(d, p.engine_id), 0.5 + bound + MARGIN)
    print(f"MEASURED idle kill -> released and purged in {time.monotonic() - killed:.2f} s (bound {bound:.2f} s)")


@pytest.mark.every_release
def test_restarted_with_a_new_engine_id(prefills, decode):
    port = None
    p1 = prefills("P-old-id")
    port = p1.port
    d = decode(keepalive=FAST)
    req, _ = d.read(p1.engine_id, port, [2])
    assert d.wait([req], 60)[req].ok
    p1.kill()
    p2 = prefills("P-new-id", port=port)
    req2, local = d.read(p2.engine_id, port, [2, 3])
    assert d.wait([req2], 60)[req2].ok
    verify(d, p2.seed, local, [2, 3])
    d.poll("the old engine released and purged", lambda: released(d, p1.engine_id), crashed_bound(d) + MARGIN)
    assert d.engines()[p2.engine_id]["state"] == "live"
    assert d.worker._engine_by_address[("127.0.0.1", port)] == p2.engine_id
    assert set(d.worker._remote_agents) == {p2.engine_id}


def test_restarted_with_the_same_engine_id(prefills, decode):
    p1 = prefills("P-pinned")
    port = p1.port
    d = decode(keepalive=FAST)
    req, _ = d.read(p1.engine_id, port, [4])
    assert d.wait([req], 60)[req].ok
    old_agent = p1.agent
    p1.kill()
    p2 = prefills("P-pinned", port=port)
    assert p2.agent != old_agent

    def read_new():
        rid, local = d.read(p2.engine_id, port, [6, 7])
        o = d.wait([rid], 60)[rid]
        if not o.ok:
            d.free.extend(local)
            return None
        verify(d, p2.seed, local, [6, 7])
        return rid

    d.poll("a read from the restarted prefill (same engine id) verified", read_new, crashed_bound(d) + 2 * MARGIN)
    engine = d.engines()[p2.engine_id]
    assert engine["agents"] == [p2.agent], engine
    assert list(d.worker._remote_agents[p2.engine_id].values()) == [p2.agent]


def _freeze_cycle(d: Any, p: Any, read_stall: float, cycle: int, resume: bool) -> Dict[str, Any]:
    """One SIGSTOP of ``p`` with two reads in flight: the requests fail
    within the stall bound, their blocks stay allocated while the prefill
    is frozen, and once it resumes (``resume``) or is killed the READs
    end, the blocks come back and the engine is released (never under a
    READ). Returns what it measured."""
    import signal

    baseline = len(d.free)
    stopped = p.signal(signal.SIGSTOP)
    reqs = {}
    for i in range(2):
        remote = [20 + 2 * i, 21 + 2 * i]
        local = [d.free.pop(0) for _ in remote]
        rid = f"stopped-{cycle}-{i}"
        d.local_of[rid] = local
        reqs[rid] = (local, remote, p.engine_id, f"remote-{rid}")
    d.step(reqs, port=p.port)
    bound = 1.25 * read_stall + MARGIN
    d.wait(list(reqs), bound, "the requests of a frozen prefill failed")
    failed_in = max(d.outcomes[r].at for r in reqs) - stopped
    assert not any(d.outcomes[r].ok for r in reqs), {r: d.outcomes[r] for r in reqs}
    # Failed, but their blocks are held while the READs may still run.
    blocks = {b for rid in reqs for b in reqs[rid][0]}
    held = d.worker.held_requests()
    assert set(reqs) <= set(held), held
    assert not blocks & set(d.free)
    for _ in range(20):
        d.step()
        time.sleep(0.01)
    assert not blocks & set(d.free), "blocks freed while the prefill is frozen"
    assert not released(d, p.engine_id), "released under its given-up READs"
    held_blocks = d.worker.held_blocks()
    ended = p.signal(signal.SIGCONT) if resume else p.kill()
    d.poll("the given-up READs ended and the blocks came back", lambda: len(d.free) == baseline, MARGIN + 30)
    back_in = time.monotonic() - ended
    d.poll("the engine released once its READs ended", lambda: released(d, p.engine_id), MARGIN)
    assert not d.worker.held_requests()
    return {"failed_in": failed_in, "back_in": back_in, "held_blocks": held_blocks, "blocks": sorted(blocks)}


@pytest.mark.every_release
def test_sigstopped_with_reads_in_flight_fail_at_once_blocks_back_on_resume_or_kill(prefills, decode):
    """Issue 43: a frozen prefill costs no request a hang and the decode no
    KV block for good. Cycles (``NIXL_KEEPALIVE_FREEZE_CYCLES``, 20 by
    default) of a prefill SIGSTOPped with reads in flight, then resumed or
    (every fourth) SIGKILLed and started again at the same port: every
    request fails within the stall bound, the blocks return to their
    baseline after each cycle, the bytes of later reads into the same
    blocks are verified, and no engine is released under a READ."""
    import os

    cycles = int(os.environ.get("NIXL_KEEPALIVE_FREEZE_CYCLES", "20"))
    p = prefills("P-frozen")
    d = decode(keepalive={"read_stall": "2s"})
    baseline = len(d.free)
    rows = []
    for cycle in range(cycles):
        req, _ = d.read(p.engine_id, p.port, [1])
        assert d.wait([req], 60)[req].ok, f"cycle {cycle}: a read before the freeze"
        read_stall = float(d.ka.config.as_dict()["read_stall"])
        resume = cycle % 4 != 3
        row = _freeze_cycle(d, p, read_stall, cycle, resume)
        assert len(d.free) == baseline, (cycle, len(d.free), baseline)
        if not resume:
            port = p.port
            p = prefills(f"P-frozen-{cycle}", port=port)
        # The blocks the given-up READs held, reused at once: a fresh read
        # into them lands byte for byte (no late byte of the old READs).
        local = row["blocks"]
        for b in local:
            d.free.remove(b)
        remote = list(range(30, 30 + len(local)))
        rid = f"reuse-{cycle}"
        d.local_of[rid] = list(local)
        d.step({rid: (local, remote, p.engine_id, f"remote-{rid}")}, port=p.port)
        assert d.wait([rid], 60)[rid].ok, f"cycle {cycle}: the read into the reused blocks"
        verify(d, p.seed, local, remote)
        assert len(d.free) == baseline
        rows.append(row)
        print(f"MEASURED freeze cycle {cycle + 1}/{cycles} ({'SIGCONT' if resume else 'SIGKILL'}): requests failed "
              f"{row['failed_in']:.2f} s after SIGSTOP (read_stall {read_stall:.0f} s), {row['held_blocks']} "
              f"block(s) held while frozen, back {row['back_in']:.2f} s after the "
              f"{'resume' if resume else 'kill'}; free blocks {len(d.free)}/{baseline}")
    worst = max(r["failed_in"] for r in rows)
    print(f"MEASURED {cycles} freeze cycles: requests failed within {worst:.2f} s of SIGSTOP (bound "
          f"{1.25 * 2 + MARGIN:.1f} s), held blocks per cycle {[r['held_blocks'] for r in rows]}, returned to "
          f"baseline after each, 0 released under a READ")


def test_read_timeout_gives_up_as_timed_out(prefills, decode):
    """A read given up as timed_out on a stopped prefill (no other read of
    it completing): its request fails at once, the service judges the
    engine stalled at once (README "Hung peers"), not at its stall check
    (read_stall is 60 s here), and the engine is released, and the blocks
    freed, once the READ ended (here: the prefill resumed)."""
    import signal

    import nixl_keepalive

    p = prefills("P-timeout")
    d = decode(keepalive={"read_timeout": "2s", "read_stall": "60s"})
    req, _ = d.read(p.engine_id, p.port, [1])
    assert d.wait([req], 60)[req].ok
    baseline = len(d.free)
    events = d.ka.events()
    stopped = p.signal(signal.SIGSTOP)
    resumed = False
    try:
        rid, local = d.read(p.engine_id, p.port, [9, 10])
        d.wait([rid], 2 + MARGIN, "the timed-out read's request failed")
        given_up = time.monotonic()
        assert not d.outcomes[rid].ok
        assert d.worker.held_requests()[rid]["why"] == [nixl_keepalive.GiveUp.TIMED_OUT]
        assert not set(local) & set(d.free), "blocks freed under a running READ"
        # Its lease is dropped at the give-up (the prefill may free those blocks).
        engine = d.engines().get(p.engine_id)
        assert engine is None or f"remote-{rid}" not in engine["leases"], engine
        # Judged at once: stalled, fenced by the given-up READ.
        d.poll("the engine stalled after the give-up",
               lambda: (d.engines().get(p.engine_id) or {}).get("state") == "stalled", MARGIN)
        took = time.monotonic() - given_up
        assert took < 1.25 * 60, took
        snap = d.engines()[p.engine_id]
        assert snap["given_up"] and snap["given_up"][0]["blocks"] == 2, snap
        seen = []
        while (e := events.get_nowait()) is not None:
            seen.append(e)
        stalled = [e for e in seen if e.get("kind") == "stalled" and e.get("engine") == p.engine_id]
        assert stalled and stalled[0]["given_up"] >= 1, seen
        assert not released(d, p.engine_id)
        p.signal(signal.SIGCONT)
        resumed = True
        d.poll("released once the READ ended", lambda: released(d, p.engine_id), MARGIN)
        d.poll("the blocks back", lambda: len(d.free) == baseline, MARGIN)
        print(f"MEASURED read_timeout 2s -> request failed {given_up - stopped:.2f} s after SIGSTOP; "
              f"stalled {took:.2f} s after the give-up (read_stall 60 s); released and blocks back after SIGCONT")
    finally:
        if not resumed:
            p.signal(signal.SIGCONT)
