"""Push mode, real: real vLLM push decodes (vLLM's own NixlPushConnector,
as processes) and our push prefill (KeepaliveNixlPushConnector) in this
process, over NIXL 1.5.1 on DRAM; every byte a decode received is checked
against the prefill's pattern.

Every wait polls with a deadline: the bound under test plus ``MARGIN`` for
a loaded 2-core machine, never a sleep followed by an assert.
"""

from __future__ import annotations

import signal
import time
from typing import Dict, List

import pytest

from conftest import MARGIN, free_port

FAST = {"interval": "500ms"}

_seq = iter(range(1, 1 << 30))


@pytest.fixture
def push_decodes(vllm_ready):
    """Starts push decodes (``start(engine_id, port=None)``); kills what is left."""
    from push import PushDecode

    started: List[PushDecode] = []

    def start(engine_id: str, port=None) -> PushDecode:
        d = PushDecode(engine_id, port or free_port())
        started.append(d)
        return d

    yield start
    for d in started:
        try:
            d.proc.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        d.kill()


@pytest.fixture
def push_prefill(vllm_ready):
    """Makes our push prefill (``make(**kw)``); shuts it down at the end."""
    from push import PushPrefill

    made: List[PushPrefill] = []

    def make(**kw) -> PushPrefill:
        p = PushPrefill(engine_id=f"P-push-{len(made)}-{next(_seq)}", port=free_port(), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.shutdown()


def crashed_bound(p) -> float:
    return p.ka.snapshot()["detection_bound_ms"]["crashed"] / 1000


def push(p, d, blocks: Dict[str, List[int]], local_from: int = 0, results: bool = True) -> Dict[str, List[int]]:
    """Requests registered by decode ``d`` (its blocks from ``local_from``)
    and finished at prefill ``p`` (``blocks``: the prefill's block ids per
    request). Returns each request's decode blocks."""
    local_of = {}
    nxt = local_from
    for req, remote in blocks.items():
        local_of[req] = list(range(nxt, nxt + len(remote)))
        nxt += len(remote)
        d.register(req, local_of[req], p, remote)
    # The decode's PUSH_REGs reach the prefill's writer first (else it
    # self-polls until they do; either order is vLLM's).
    p.step(blocks, results=results)
    return local_of


def wait_written(p, d, reqs, within: float) -> None:
    """Every request received at the decode, every byte right, and its
    WRITEs reported done at the prefill."""
    got = p.poll("writes received at the decode", lambda: all(d.outcome(r) for r in reqs), within)
    assert got
    for r in reqs:
        o = d.outcome(r)
        assert o["ok"] and not o["bad"], o
    p.poll("writes reported done at the prefill", lambda: all(r in p.sent for r in reqs), within)


@pytest.mark.every_release
def test_writes_verified_and_heartbeats_reach_an_idle_decode(push_prefill, push_decodes):
    p = push_prefill(keepalive=FAST)
    d = push_decodes("D-idle-hb")
    push(p, d, {"w-1": [1, 2, 3]})
    wait_written(p, d, ["w-1"], 60)
    engine = p.engines()[d.engine_id]
    assert engine["state"] == "live" and engine["agents"] == [d.agent], engine
    assert p.worker.writes_in_flight() == 0
    # Idle now: nothing of vLLM's goes to it; the service heartbeats it.
    t = time.monotonic()
    p.poll("an HB: at the idle decode", lambda: d.heartbeats_since(t), 0.5 + MARGIN)


@pytest.mark.every_release
def test_decode_killed_with_writes_in_flight_released_once_they_end(push_prefill, push_decodes):
    p = push_prefill(keepalive=FAST)
    d = push_decodes("D-kill-writes")
    push(p, d, {"first": [0, 1]})
    wait_written(p, d, ["first"], 60)
    engine = p.ka.engine(d.engine_id)
    bound = crashed_bound(p)
    open_at_release = []
    engine.on_released(lambda e: open_at_release.append(
        sum(1 for w in list(p.worker._ka_writes.values()) if w.engine.id == e.id)))
    # Four requests' WRITEs posted by vLLM's writer thread; nothing polls
    # them (no get_transfer_results) until the decode is dead and marked.
    reqs = {f"kill-{i}": [8 + 4 * i + j for j in range(4)] for i in range(4)}
    push(p, d, reqs, local_from=10, results=False)
    deadline = time.monotonic() + 60
    while p.worker.writes_in_flight() < len(reqs):
        assert time.monotonic() < deadline, f"{p.worker.writes_in_flight()} WRITEs posted of {len(reqs)}"
        time.sleep(0.005)
    killed = d.kill()
    # Dead and marked by the heartbeat's REMOTE_DISCONNECT, never released
    # with its four WRITEs' guards open (they end only when vLLM polls).
    deadline = killed + bound + MARGIN
    while (state := p.ka.engine(d.engine_id).state if p.ka.engine(d.engine_id) else "gone") == "live":
        assert time.monotonic() < deadline, "the killed decode was not marked within the bound"
        time.sleep(0.01)
    assert state != "released" and state != "gone", state
    assert p.ka.engine(d.engine_id).reads_in_flight == len(reqs)
    marked = time.monotonic()
    p.poll("killed decode released once its WRITEs ended, vLLM's tables purged",
           lambda: p.released(d.engine_id), MARGIN)
    took = time.monotonic() - killed
    assert open_at_release == [0], open_at_release
    assert p.worker.writes_in_flight() == 0
    assert d.engine_id in p.worker.released_decodes
    print(f"MEASURED push: decode SIGKILLed with 4 WRITEs open -> marked {marked - killed:.2f} s, released and "
          f"purged {took:.2f} s after the kill (WRITEs polled from {marked - killed:.2f} s; bound {bound:.2f} s)")


def test_idle_decode_killed_released_within_interval_and_bound(push_prefill, push_decodes):
    p = push_prefill(keepalive=FAST)
    d = push_decodes("D-idle-kill")
    push(p, d, {"idle-1": [5]})
    wait_written(p, d, ["idle-1"], 60)
    bound = crashed_bound(p)
    t = time.monotonic()
    p.poll("an HB: at the idle decode", lambda: d.heartbeats_since(t), 0.5 + MARGIN)
    killed = d.kill()
    p.poll("idle killed decode released and purged", lambda: p.released(d.engine_id), 0.5 + bound + MARGIN)
    took = time.monotonic() - killed
    assert took <= 0.5 + bound + MARGIN
    print(f"MEASURED push: idle decode SIGKILLed -> released and purged in {took:.2f} s "
          f"(interval 0.5 s + bound {bound:.2f} s)")


def test_decode_restarted_with_a_new_engine_id(push_prefill, push_decodes):
    p = push_prefill(keepalive=FAST)
    d1 = push_decodes("D-old-id")
    port = d1.port
    push(p, d1, {"old-1": [2]})
    wait_written(p, d1, ["old-1"], 60)
    d1.kill()
    d2 = push_decodes("D-new-id", port=port)
    # The new decode declares the address the old one held: the old one is
    # heartbeated, found gone, released; the new one registered.
    push(p, d2, {"new-1": [2, 3]})
    wait_written(p, d2, ["new-1"], 60 + crashed_bound(p))
    p.poll("the old decode released and purged", lambda: p.released(d1.engine_id), crashed_bound(p) + MARGIN)
    assert p.engines()[d2.engine_id]["state"] == "live"
    assert set(p.worker._remote_agents) == {d2.engine_id}


def test_decode_restarted_with_the_same_engine_id(push_prefill, push_decodes):
    p = push_prefill(keepalive=FAST)
    d1 = push_decodes("D-pinned")
    port = d1.port
    push(p, d1, {"pin-0": [4]})
    wait_written(p, d1, ["pin-0"], 60)
    old_agent = d1.agent
    released_at: List[float] = []
    p.ka.engine("D-pinned").on_released(lambda e: released_at.append(time.monotonic()))
    killed = d1.kill()
    d2 = push_decodes("D-pinned", port=port)
    assert d2.agent != old_agent
    # vLLM keeps the engine id's tables (it would write into the dead
    # decode's keys): the service finds it gone and releases it, and the
    # next registration handshakes with the new incarnation.
    p.poll("the dead incarnation released and purged", lambda: p.released("D-pinned"),
           crashed_bound(p) + MARGIN + 0.5)
    took = released_at[0] - killed
    assert took <= 0.5 + crashed_bound(p) + MARGIN
    push(p, d2, {"pin-1": [6, 7]})
    wait_written(p, d2, ["pin-1"], 60)
    engine = p.engines()["D-pinned"]
    assert engine["agents"] == [d2.agent], engine
    assert list(p.worker._remote_agents["D-pinned"].values()) == [d2.agent]
    print(f"MEASURED push: decode restarted with the same engine id -> old incarnation released {took:.2f} s "
          "after the kill; the new one registered and written to")


@pytest.mark.parametrize("then", ["resumed", "killed"])
def test_sigstopped_decode_with_writes_open_stalled_never_released_under_a_write(push_prefill, push_decodes, then):
    read_stall = 3.0
    p = push_prefill(keepalive={"interval": "500ms", "read_stall": f"{read_stall}s"})
    d = push_decodes("D-stopped")
    push(p, d, {"pre": [1]})
    wait_written(p, d, ["pre"], 60)
    engine = p.ka.engine(d.engine_id)
    released_with: List[int] = []
    engine.on_released(lambda e: released_with.append(
        sum(1 for w in list(p.worker._ka_writes.values()) if w.engine.id == e.id)))
    reqs = {f"stop-{i}": [20 + 2 * i, 21 + 2 * i] for i in range(2)}
    # The decode registers its blocks (PUSH_REG) while it runs; it is
    # stopped once the prefill holds the registrations, before the WRITEs.
    for i, (req, remote) in enumerate(reqs.items()):
        d.register(req, [30 + 2 * i, 31 + 2 * i], p, remote)
    p.poll("the decode's registrations at the prefill",
           lambda: set(reqs) <= set(p.worker._pending_d_registrations), 60)
    stopped = d.signal(signal.SIGSTOP)
    try:
        p.step(reqs)
        # Stepped as vLLM steps, for the stall bound and then some: the
        # WRITEs stay open (the decode makes no progress), the decode is
        # judged (stalled) and never released while one is open.
        seen_states = set()
        until = time.monotonic() + 1.25 * read_stall + MARGIN
        while time.monotonic() < until:
            p.step()
            e = p.ka.engine(d.engine_id)
            state = e.state if e is not None else "gone"
            seen_states.add(state)
            if p.worker.writes_in_flight():
                assert state != "released" and state != "gone", (state, p.worker.writes_in_flight())
            if state == "stalled" and p.worker.writes_in_flight():
                break
            time.sleep(0.01)
        open_writes = p.worker.writes_in_flight()
        assert open_writes, f"the WRITEs to the stopped decode ended ({seen_states}); nothing was in flight"
        assert p.ka.engine(d.engine_id).state == "stalled", seen_states
        stalled = time.monotonic() - stopped
        assert not released_with
        assert not any(r in p.sent for r in reqs)
    finally:
        ended = d.kill() if then == "killed" else d.signal(signal.SIGCONT)
    # Resumed or killed while frozen: the WRITEs end, and only then is the
    # stalled decode released.
    p.poll(f"the {then} decode's WRITEs ended and the stalled decode released",
           lambda: p.worker.writes_in_flight() == 0 and p.released(d.engine_id), MARGIN + 5)
    took = time.monotonic() - ended
    assert released_with == [0], released_with
    print(f"MEASURED push: SIGSTOP with {open_writes} WRITEs open -> stalled {stalled:.2f} s after the stop "
          f"(read_stall {read_stall:.1f} s), never released under a WRITE; {then}: released {took:.2f} s "
          "after, once they ended")
