"""vLLM's own clean-up of a pull peer beside ours, on one engine in one step
(issue 58, item 4).

vLLM 0.33 and 0.34 release some pull peers themselves at the end of each
poll: ``_cleanup_remote_engines`` (the last call of
``get_transfer_results``) releases an engine that another engine replaced
at its address (``_track_remote_engine_replacement``, recorded when a
handshake completes) or whose agent ``check_remote_metadata`` finds gone.
Ours purges, at the start of each poll (``_ka_process_releases``), every
engine the service released; and an engine vLLM retires comes to the
service through our ``_cleanup_remote_engine``.

Here a prefill is killed and a new one with a new engine id starts at its
port; the decode reads from the new one. The service releases the old
engine at that handshake (the new engine replaces it), and vLLM's clean-up
wants it too. When the handshake completes decides who purges vLLM's
tables, so the test holds the handshake's last step and lets it finish at
one of two points of a single ``get_transfer_results`` call:

- ``ours_first``: before our ``_ka_process_releases``: ours purges the old
  engine, then vLLM's ``_cleanup_remote_engines`` runs in the same call and
  finds nothing left to release;
- ``vllm_first``: after ours, before vLLM's ``_cleanup_remote_engines``:
  vLLM's pass releases the old engine through our ``_cleanup_remote_engine``
  (which makes no NIXL call of its own: the service has or will have
  released it); ours runs at the next call and finds nothing.

Either way the test counts, on vLLM's real code path: both clean-ups ran in
that call; vLLM's purge of the engine's tables (the base
``_cleanup_remote_engine``) ran exactly once; the service released the
engine once; no dlist handle or agent went through vLLM's NIXL calls twice
(none of the old engine's at all: the service released them); no warning
or error was logged; and every table is left holding only the new engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, List

import pytest

from conftest import MARGIN
from test_vllm_real import verify

pytestmark = pytest.mark.every_release


class _Records(logging.Handler):
    """Every record at WARNING or above of vLLM's and our loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _purge_class(worker: Any) -> type:
    """The vLLM class whose ``_cleanup_remote_engine`` our purge calls
    (``super(PurgeHooks, self)``): vLLM's own purge of an engine's tables."""
    from nixl_keepalive.vllm_purge import PurgeHooks

    mro = type(worker).__mro__
    for cls in mro[mro.index(PurgeHooks) + 1:]:
        if "_cleanup_remote_engine" in cls.__dict__:
            return cls
    raise AssertionError("no vLLM class defines _cleanup_remote_engine")


def _show(trail: List[tuple]) -> str:
    """The trail with runs of one entry collapsed (``ours x12``)."""
    out: List[str] = []
    last, n = None, 0
    for t in trail + [None]:
        if t == last:
            n += 1
            continue
        if last is not None:
            out.append(" ".join(last) + (f" x{n}" if n > 1 else ""))
        last, n = t, 1
    return ", ".join(out)


def _wait_until(what: str, check, within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within:.1f} s")
        time.sleep(0.005)


@pytest.mark.parametrize("order", ["ours_first", "vllm_first"])
def test_vllm_and_the_service_clean_one_engine_in_one_step_in_either_order(prefills, decode, monkeypatch, order):
    p1 = prefills("P-race-old")
    port = p1.port
    d = decode(keepalive={"interval": "500ms"})
    w = d.worker
    req, local = d.read(p1.engine_id, port, [1, 2])
    assert d.wait([req], 60)[req].ok
    verify(d, p1.seed, local, [1, 2])
    old = w._ka_engines[p1.engine_id]
    # The service finds the killed prefill on its own (its heartbeats meet
    # the closed connection at once): a READ guard held by the test keeps
    # the old engine from being released until the point under test.
    held = old.read()
    old_agents = list(w._remote_agents[p1.engine_id].values())
    old_handles = list(w.dst_xfer_side_handles[p1.engine_id].values())
    assert old_agents and old_handles

    trail: List[tuple] = []  # what ran, in order
    service_released = Counter()
    old.on_released(lambda e: service_released.update([e.id]))
    # NIXL releases through the agent, by whoever makes them (the service
    # calls the same agent); those made inside vLLM's purge listed apart.
    nixl_calls = Counter()
    by_vllm: List[tuple] = []
    in_purge = threading.local()
    agent = w.nixl_wrapper
    for name in ("release_dlist_handle", "remove_remote_agent"):
        real = getattr(agent, name)

        def counted(arg, _real=real, _name=name):
            nixl_calls[(_name, arg)] += 1
            if getattr(in_purge, "on", False):
                by_vllm.append((_name, arg))
            return _real(arg)

        monkeypatch.setattr(agent, name, counted)

    purge_cls = _purge_class(w)
    real_purge = purge_cls.__dict__["_cleanup_remote_engine"]

    def purge(self, engine_id, *, log_eviction=True):
        trail.append(("vllm_purge", engine_id))
        in_purge.on = True
        try:
            return real_purge(self, engine_id, log_eviction=log_eviction)
        finally:
            in_purge.on = False

    monkeypatch.setattr(purge_cls, "_cleanup_remote_engine", purge)

    # The handshake thread holds its last step (vLLM's done callback, which
    # records the replacement) until the step under test lets it go.
    go = threading.Event()
    real_handshake = w._nixl_handshake

    def held_handshake(*a, **k):
        # ours_first: held once the service registered the new engine (and
        # so released the old one); vllm_first: held before anything, so
        # the replacement reaches the service only after ours has run.
        out = real_handshake(*a, **k) if order == "ours_first" else None
        trail.append(("handshake_held",))
        if not go.wait(120):
            raise RuntimeError("the test never let the handshake finish")
        return out if order == "ours_first" else real_handshake(*a, **k)

    monkeypatch.setattr(w, "_nixl_handshake", held_handshake)

    def let_the_handshake_finish(new_id: str) -> None:
        go.set()
        _wait_until("the new engine's handshake completed in vLLM's tables",
                    lambda: w._engine_by_address.get(("127.0.0.1", port)) == new_id, 60)
        trail.append(("replacement_recorded",))
        # What vLLM's pass computes as replaced (its tables, as it reads
        # them): the old engine is due for vLLM's own release now.
        with w._handshake_lock:
            due = set(w._remote_agents) - set(w._engine_by_address.values())
        assert p1.engine_id in due, due

    new_id = "P-race-new"
    real_process = w._ka_process_releases
    real_pass = w._cleanup_remote_engines
    real_cleanup = w._cleanup_remote_engine

    def process_releases():
        if order == "ours_first" and not go.is_set() and ("handshake_held",) in trail:
            let_the_handshake_finish(new_id)
            held.close()
            assert old.wait_released(MARGIN), f"the old engine not released: {old.state}"
        trail.append(("ours",))
        return real_process()

    def vllm_pass():
        if order == "vllm_first" and not go.is_set() and ("handshake_held",) in trail:
            let_the_handshake_finish(new_id)
            trail.append(("vllm_pass",))
            out = real_pass()
            # The service's release comes after vLLM's pass retired it.
            held.close()
            return out
        trail.append(("vllm_pass",))
        return real_pass()

    def cleanup(engine_id, *, log_eviction=True):
        trail.append(("vllm_retires", engine_id))
        return real_cleanup(engine_id, log_eviction=log_eviction)

    monkeypatch.setattr(w, "_ka_process_releases", process_releases)
    monkeypatch.setattr(w, "_cleanup_remote_engines", vllm_pass)
    monkeypatch.setattr(w, "_cleanup_remote_engine", cleanup)
    records = _Records()
    for name in ("vllm", "nixl_keepalive"):
        logging.getLogger(name).addHandler(records)
    try:
        p1.kill()
        p2 = prefills(new_id, port=port)
        req2, local2 = d.read(p2.engine_id, port, [3, 4])
        outcome = d.wait([req2], 60)[req2]
        # A few more polls: whatever either side still had to do is done.
        for _ in range(5):
            d.step()
    finally:
        for name in ("vllm", "nixl_keepalive"):
            logging.getLogger(name).removeHandler(records)
        go.set()
        held.close()
    assert outcome.ok
    verify(d, p2.seed, local2, [3, 4])

    # The step under test: the call of get_transfer_results in which the
    # replacement was recorded.
    at = trail.index(("replacement_recorded",))
    shown = _show(trail[max(0, at - 6):at + 16])
    after = trail[at + 1:]
    retired_by_vllm = trail.count(("vllm_retires", p1.engine_id))
    if order == "ours_first":
        # Ours purged it first; vLLM's pass ran in the same call and left it.
        assert after[0] == ("ours",) and ("vllm_purge", p1.engine_id) in after[:after.index(("vllm_pass",))], shown
        assert retired_by_vllm == 0, shown
    else:
        # vLLM's pass retired it, through our hook; ours ran after it.
        first_pass = after.index(("vllm_pass",))
        assert after[first_pass + 1] == ("vllm_retires", p1.engine_id), shown
        assert retired_by_vllm == 1, shown
        assert ("ours",) in after[first_pass:], "our clean-up did not run after vLLM's"
    # Both clean-ups ran in that call, counted on vLLM's real code path.
    assert trail.count(("vllm_pass",)) >= 1 and trail.count(("ours",)) >= 1
    # vLLM's tables of the old engine purged exactly once.
    assert trail.count(("vllm_purge", p1.engine_id)) == 1, shown
    # The service released it once, each of its handles and agents once;
    # nothing through vLLM's purge (a second release); nothing at all twice.
    assert old.wait_released(MARGIN)
    assert service_released == Counter({p1.engine_id: 1}), service_released
    twice = {k: n for k, n in nixl_calls.items() if n > 1}
    assert not twice, f"released twice: {twice}"
    assert not by_vllm, f"NIXL state released by vLLM's purge beside the service: {by_vllm}"
    old_released = sorted(n for (_, arg), n in nixl_calls.items() if arg in old_handles or arg in old_agents)
    assert old_released == [1] * (len(old_handles) + len(old_agents)), nixl_calls
    # No error surfaced: nothing at ERROR; no warning from vLLM's NIXL
    # connector or ours but the service's events (the kill's
    # "unreachable").
    loud = [f"{r.name}: {r.getMessage()}" for r in records.records
            if r.levelno >= logging.ERROR or "kv_connector" in r.name
            or (r.name.startswith("nixl_keepalive") and not r.getMessage().startswith("nixl_keepalive: event: "))]
    assert not loud, loud
    # The tables hold the new engine only; the service too.
    assert not d.tables(p1.engine_id), d.tables(p1.engine_id)
    assert set(w._remote_agents) == {p2.engine_id}
    assert p1.engine_id not in d.engines() and d.engines()[p2.engine_id]["state"] == "live"
    assert p1.engine_id not in w._ka_engines
    print(f"MEASURED cleanup race {order}: {shown}")
