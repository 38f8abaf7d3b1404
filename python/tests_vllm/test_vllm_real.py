"""Real scenarios: real vLLM 0.33 prefill workers (vLLM's own NixlConnector,
as processes) and our connector's decode worker, over NIXL 1.5.1 on DRAM.

Every wait polls with a deadline: the bound under test plus ``MARGIN``
for a loaded 2-core machine, never a sleep followed by an assert.
"""

from __future__ import annotations

import time

import pytest

from conftest import MARGIN

FAST = {"interval": "500ms"}


def crashed_bound(d) -> float:
    """The service's own bound on detecting a crashed prefill (snapshot)."""
    return float(d.ka.snapshot()["detection_bound"]["crashed"])


def verify(d, seed: int, local, remote) -> None:
    import vllm_env

    bad = [(lb, rb) for lb, rb in zip(local, remote) if not vllm_env.block_matches(d.caches, lb, seed, rb)]
    assert not bad, f"blocks read wrong (local, remote): {bad}"


def released(d, engine_id: str):
    """The engine is gone from the service and from vLLM's tables."""
    return engine_id not in d.engines() and not d.tables(engine_id)


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


def test_sigstopped_with_reads_in_flight_stalled_released_blocks_held(prefills, decode):
    import signal

    import nixl_keepalive
    import vllm_env

    p = prefills("P-stopped")
    d = decode()  # every default
    req, _ = d.read(p.engine_id, p.port, [1])
    assert d.wait([req], 60)[req].ok
    read_stall = float(d.ka.config.as_dict()["read_stall"])
    stopped = p.signal(signal.SIGSTOP)
    reqs = {}
    for i in range(2):
        remote = [20 + 2 * i, 21 + 2 * i]
        local = [d.free.pop(0) for _ in remote]
        rid = f"stopped-{i}"
        d.local_of[rid] = local
        reqs[rid] = (local, remote, p.engine_id, f"remote-{rid}")
    d.step(reqs, port=p.port)
    d.poll("the stopped prefill stalled and released", lambda: released(d, p.engine_id),
           1.25 * read_stall + MARGIN + 5)
    took = time.monotonic() - stopped
    held = d.worker.held_requests()
    # Not reported to the scheduler: their blocks are still theirs.
    assert set(reqs) <= set(held), held
    assert not set(reqs) & set(d.outcomes)
    for rid in reqs:
        assert held[rid]["destinations"] == [nixl_keepalive.Destination.RETIRE], held[rid]
        assert held[rid]["why"] == [nixl_keepalive.GiveUp.CANCELLED] or held[rid]["why"] == [
            nixl_keepalive.GiveUp.TIMED_OUT], held[rid]
    blocks = {b for rid in reqs for b in reqs[rid][0]}
    assert not blocks & set(d.free)
    p.signal(signal.SIGCONT)
    # Resumed: the held requests stay held (their transfers may still
    # write); checked over 50 steps.
    for _ in range(50):
        d.step()
    assert set(reqs) <= set(d.worker.held_requests())
    assert not set(reqs) & set(d.outcomes)
    print(f"MEASURED SIGSTOP with reads in flight -> stalled and released in {took:.2f} s "
          f"(read_stall {read_stall:.1f} s); 2 requests held, destinations RETIRE")
    del vllm_env


def test_read_timeout_gives_up_as_timed_out(prefills, decode):
    """A read given up as timed_out on a stopped prefill (no other read of
    it completing): the service judges the engine at once (README "Hung
    peers"): stalled and released right after the give-up, not at its
    stall check (read_stall is 60 s here, so 1.25 x read_stall is 75 s)."""
    import signal

    import nixl_keepalive

    p = prefills("P-timeout")
    d = decode(keepalive={"read_timeout": "2s", "read_stall": "60s"})
    req, _ = d.read(p.engine_id, p.port, [1])
    assert d.wait([req], 60)[req].ok
    events = d.ka.events()
    stopped = p.signal(signal.SIGSTOP)
    try:
        rid, local = d.read(p.engine_id, p.port, [9, 10])
        d.poll("the timed-out read given up", lambda: rid in d.worker.held_requests() or rid in d.outcomes,
               2 + MARGIN)
        given_up = time.monotonic()
        assert rid not in d.outcomes, f"the READ ended ({d.outcomes[rid]}) on a stopped prefill"
        assert d.worker.held_requests()[rid]["why"] == [nixl_keepalive.GiveUp.TIMED_OUT]
        # Its lease is dropped at the give-up (the prefill may free those blocks).
        engine = d.engines().get(p.engine_id)
        assert engine is None or f"remote-{rid}" not in engine["leases"], engine
        # Judged at once: stalled, then released and purged from vLLM's tables.
        d.poll("the engine stalled and released after the give-up", lambda: released(d, p.engine_id), MARGIN)
        took = time.monotonic() - given_up
        assert took < 1.25 * 60, took
        seen = []
        while (e := events.get_nowait()) is not None:
            seen.append(e)
        stalled = [e for e in seen if e.get("kind") == "stalled" and e.get("engine") == p.engine_id]
        assert stalled and stalled[0]["given_up"] >= 1, seen
        assert any(e.get("kind") == "released" and e.get("engine") == p.engine_id for e in seen), seen
        # The given-up read's destination: retire (NIXL 1.5.1), the request held.
        d.poll("the given-up read's destination decided: retire",
               lambda: d.worker.held_requests()[rid]["destinations"] == [nixl_keepalive.Destination.RETIRE], MARGIN)
        assert rid not in d.outcomes
        print(f"MEASURED read_timeout 2s -> given up {given_up - stopped:.2f} s after SIGSTOP; "
              f"stalled and released {took:.2f} s after the give-up (read_stall 60 s)")
    finally:
        p.signal(signal.SIGCONT)
