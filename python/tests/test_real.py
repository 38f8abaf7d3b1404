"""The keepalive embedded in a vLLM-shaped Python decoder
(``python/examples/vllm_decode.py``), on the real NIXL Python API
(``nixl_cu12`` 1.5.1), against real ``nixl-keepalive prefill`` processes
killed, restarted and frozen for real. Each test prints what it measured
(``MEASURED ...``). Without the runtime they print ``SKIPPED`` and skip;
with ``NIXL_KEEPALIVE_REQUIRE_REAL=1`` or ``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

import nixl_keepalive as nk
from conftest import BLOCKING_KEEP_ALIVE, MARGIN, EventLog, fd_count, report, thread_count, wait_for

HEARTBEAT = "250ms"


def assert_metadata_gone(worker, agent_name: str, nixl_api) -> None:
    """The decoder's agent no longer holds the agent's metadata: a
    notification to it is refused NOT_FOUND (a loaded, dead peer says
    REMOTE_DISCONNECT; a live one takes it)."""
    with pytest.raises(nixl_api.nixlNotFoundError):
        worker.nixl_wrapper.send_notif(agent_name, b"are you there")


def read_verified(worker, engine, rank: int = 0, block: int = 1) -> None:
    o = worker.read_block(engine.id, rank, block)
    assert o.result == "verified", o


def test_a_sigkilled_prefill_is_released_within_the_bound(prefills, make_worker, nixl_api):
    p = prefills(ranks=2)
    w = make_worker(interval=HEARTBEAT)
    log = EventLog(w.keepalive)
    engine = w.add_remote_agent(p.address)
    read_verified(w, engine, 0, 3)
    read_verified(w, engine, 1, 5)
    # A killed process's connections are reset at once (UCX fails the
    # endpoint 3-46 ms after SIGKILL, measured): the next heartbeat says
    # REMOTE_DISCONNECT. The bound is one heartbeat gap. (The snapshot's
    # detection_bound is the worst case of a silent host, not this.)
    config = w.keepalive.config.as_dict()
    bound = config["interval"] + config["jitter"]
    # The first heartbeat goes out within one interval of the registration.
    wait_for("a heartbeat answered", lambda: (w.keepalive.snapshot()["engines"][0]["last_heartbeat"] or {})
             .get("status") == 0, 2 * bound + MARGIN, seen=w.keepalive.snapshot)
    killed = p.kill()
    e = log.wait("unreachable", bound + MARGIN, engine=engine.id)
    assert (e["status"], e["status_name"], e["source"]) == (-10, "NIXL_ERR_REMOTE_DISCONNECT", "heartbeat")
    # No read in flight: released as soon as it is marked.
    released = log.wait("released", MARGIN, engine=engine.id)
    assert released["reason"] == "unreachable" and released["failed_steps"] == 0
    took = released["at"] - killed
    report(f"SIGKILL -> released {took * 1000:.0f} ms (detected {(e['at'] - killed) * 1000:.0f} ms; "
           f"one heartbeat gap {bound * 1000:.0f} ms: {took / bound:.2f}x)")
    assert engine.state == "released"
    for agent in engine.agents:
        assert_metadata_gone(w, agent, nixl_api)
    with pytest.raises(nk.ReadRefused):
        w.read_blocks(engine.id, 0, 0)


def test_without_a_cuda_transport_the_gpu_mapping_ledger_says_so_and_holds_nothing(prefills, make_worker):
    # Issue 56: on this machine UCX loads no CUDA transport; the ledger is
    # in the process (the interposer) and says there is nothing to give
    # back, and a release with reads reports no GPU mapping.
    p = prefills()
    w = make_worker()
    engine = w.add_remote_agent(p.address)
    read_verified(w, engine)
    gpu = nk.gpu_mappings()
    assert gpu["mode"] == "none", gpu
    assert "libuct_cuda" in gpu["reason"], gpu
    assert gpu["counts"]["regions"] == 0 and gpu["counts"]["maps"] == 0, gpu


def test_with_heartbeats_off_a_sigkilled_idle_prefill_is_released_by_its_endpoint_event(prefills, make_worker):
    # Issue 45: no heartbeat is due, no read runs: only UCX failing the
    # endpoint (the killed process's kernel closes its sockets) can start
    # the heartbeat that finds it. A live prefill beside it stays.
    victim, healthy = prefills(ranks=2), prefills()
    w = make_worker(interval="inf")
    assert w.keepalive.config.as_dict()["endpoint_events"] is True
    log = EventLog(w.keepalive)
    engine = w.add_remote_agent(victim.address)
    other = w.add_remote_agent(healthy.address)
    read_verified(w, engine, 0, 3)
    read_verified(w, other)
    killed = victim.kill()
    e = log.wait("unreachable", 20.0, engine=engine.id)
    assert (e["status"], e["source"]) == (-10, "heartbeat"), e
    released = log.wait("released", MARGIN, engine=engine.id)
    assert released["reason"] == "unreachable"
    time.sleep(1.0)
    assert other.state == "live"
    read_verified(w, other)
    assert log.find("released", engine=other.id) is None
    report(f"SIGKILL idle, heartbeats off, endpoint events on: unreachable {(e['at'] - killed) * 1000:.1f} ms, "
           f"released {(released['at'] - killed) * 1000:.1f} ms after the kill")


def test_a_transfers_raw_remote_disconnect_marks_the_engine_when_heartbeats_are_off(prefills, make_worker, nixl_api):
    # No heartbeats: only the reads' own raw statuses can find the death
    # (check_xfer_state would say "ERR" for every error).
    # Endpoint events off too: they would send a heartbeat at the kill.
    p = prefills()
    w = make_worker(interval="inf", endpoint_events=False)
    log = EventLog(w.keepalive)
    engine = w.add_remote_agent(p.address)
    read_verified(w, engine)
    killed = None
    statuses = {}
    refused = 0

    def reads_until_refused():
        nonlocal killed, refused
        if killed is None and sum(statuses.values()) >= 20:
            killed = p.kill()
        try:
            w.read_blocks(engine.id, 0, 1)
        except nk.ReadRefused:
            refused += 1
        except Exception as e:  # noqa: BLE001 - a NIXL call raised: reported through the read
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
        for o in w.get_finished():
            key = o.status if o.status is not None else o.result
            statuses[key] = statuses.get(key, 0) + 1
        return log.find("released", engine=engine.id) if refused else None

    # A read's own status finds it (at worst a read times out, then the
    # next one fails), and the reads end: released.
    released = wait_for("released after a transfer's REMOTE_DISCONNECT", reads_until_refused,
                        2 * w.read_timeout + MARGIN, seen=lambda: (statuses, log.all()))
    e = log.find("unreachable", engine=engine.id)
    assert (e["status"], e["source"]) == (-10, "transfer"), e
    assert released["reason"] == "unreachable"
    report(f"SIGKILL during reads, heartbeats off: unreachable (raw -10, source transfer) "
           f"{(e['at'] - killed) * 1000:.0f} ms after the kill, released {(released['at'] - e['at']) * 1000:.1f} ms "
           f"later; read outcomes by raw status: {statuses}")
    assert_metadata_gone(w, engine.agents[0], nixl_api)


def test_a_restart_with_a_new_id_at_the_same_port_replaces_and_releases_the_old(prefills, make_worker, nixl_api):
    # Heartbeats and endpoint events off: the handshake alone must find the
    # replacement (the events would find the kill first).
    w = make_worker(interval="inf", endpoint_events=False)
    log = EventLog(w.keepalive)
    p1 = prefills()
    old = w.add_remote_agent(p1.address)
    read_verified(w, old)
    p1.kill()
    p2 = prefills(listen=p1.address)
    assert p2.engine_id != p1.engine_id
    t0 = time.monotonic()
    new = w.add_remote_agent(p2.address)
    # Published at the registration; the old engine has no read in flight:
    # released at once.
    replaced = log.wait("replaced", MARGIN, old=old.id, new=new.id)
    released = log.wait("released", MARGIN, engine=old.id)
    assert released["reason"] == "replaced"
    report(f"new id at the same port: old released {(released['at'] - t0) * 1000:.1f} ms after the handshake began")
    assert replaced["address"] == p1.address
    read_verified(w, new, 0, 7)
    assert_metadata_gone(w, old.agents[0], nixl_api)


def test_a_restart_with_the_same_id_is_released_before_it_is_loaded_again(prefills, make_worker, nixl_api):
    # The handshake's path: nothing else may release the old one first.
    w = make_worker(interval="inf", endpoint_events=False)
    log = EventLog(w.keepalive)
    pinned = f"pinned-{time.monotonic_ns()}"
    p1 = prefills(engine_id=pinned, ranks=2)
    first = w.add_remote_agent(p1.address)
    read_verified(w, first, 1, 2)
    p1.kill()
    p2 = prefills(listen=p1.address, engine_id=pinned, ranks=2)
    assert p2.incarnation != p1.incarnation
    # The worker's add_remote_agent: the handshake's ready_to_load returns
    # only once the old registration is released; NIXL 1.5.1 refuses new
    # metadata under a loaded agent name (NOT_ALLOWED), so the load itself
    # succeeding proves the order.
    second = w.add_remote_agent(p2.address)
    # Both published before add_remote_agent returned; the event thread
    # hands them over soon after.
    released = log.wait("released", MARGIN, engine=pinned)
    assert released["reason"] == "reregistered"
    registered = wait_for("two registrations", lambda: [
        e for e in log.all() if e["kind"] == "registered" and e["engine"] == pinned][1:], MARGIN, seen=log.all)
    assert released["at"] <= registered[0]["at"], log.all()
    assert first.state == "released" and second.is_live and second.incarnation == p2.incarnation
    read_verified(w, second, 1, 6)
    # The same process again: nothing is loaded.
    assert w.add_remote_agent(p2.address).incarnation == p2.incarnation
    assert w.keepalive.snapshot()["engines"][0]["state"] == "live"
    assert len([e for e in log.all() if e["kind"] == "registered"]) == 2


READ_STALL = 1.0


class Frozen:
    """A worker reading from two prefills, one of them SIGSTOPped with two
    reads in flight; :meth:`drive` keeps the healthy one read meanwhile
    (the stall check needs it: a whole decoder that stopped reading is not
    a hung peer) and collects every outcome."""

    def __init__(self, prefills, w, healthy_reads: int) -> None:
        self.w = w
        self.log = EventLog(w.keepalive)
        self.frozen_p, healthy_p = prefills(), prefills()
        self.frozen = w.add_remote_agent(self.frozen_p.address)
        self.healthy = w.add_remote_agent(healthy_p.address)
        read_verified(w, self.frozen)
        self.stopped_at = self.frozen_p.signal(signal.SIGSTOP)
        self.stuck = [w.read_blocks(self.frozen.id, 0, b) for b in (2, 3)]
        self.stuck_slots = {w._recving[r].slot for r in self.stuck}
        self.outcomes = {}
        self._in_flight = 2 + healthy_reads

    def _step(self) -> None:
        if self.w.reads_in_flight() < self._in_flight:
            self.w.read_blocks(self.healthy.id, 0, 4)
        for o in self.w.get_finished():
            self.outcomes[o.request_id] = o

    def until(self, what: str, check, within: float) -> Any:
        def step():
            self._step()
            return check()

        return wait_for(what, step, within, seen=lambda: (self.log.all(), self.outcomes, self.w.held_slots()))

    def until_failed(self, within: float) -> dict:
        """The frozen prefill stalled and both its requests failed."""
        return self.until("the frozen prefill's requests failed", lambda: all(
            r in self.outcomes for r in self.stuck) and self.log.find("stalled", engine=self.frozen.id), within)

    def fenced(self, watch: float = 1.0) -> None:
        """Not released while frozen: its given-up READs may still run; their
        slots held."""
        end = time.monotonic() + watch
        while time.monotonic() < end:
            self._step()
            time.sleep(0.01)
        assert not self.log.find("released", engine=self.frozen.id), self.log.all()
        assert self.w.held_slots() >= 1 and not self.stuck_slots & set(self.w._free_slots)

    def until_released(self, within: float) -> dict:
        return self.until("the frozen prefill released", lambda: self.log.find(
            "released", engine=self.frozen.id), within)


def test_a_sigstopped_prefill_with_reads_in_flight_is_stalled_fenced_and_released_on_resume(prefills, make_worker):
    w = make_worker(interval=HEARTBEAT, read_stall=f"{READ_STALL:g}s", read_timeout=30.0)
    f = Frozen(prefills, w, healthy_reads=2)
    log, frozen, healthy, frozen_p = f.log, f.frozen, f.healthy, f.frozen_p
    stopped_at, stuck, outcomes = f.stopped_at, f.stuck, f.outcomes
    # The stall bound: 1.25 read-stall bounds plus a second of slack (the
    # frozen bound the library documents): the requests fail then.
    f.until_failed(1.25 * READ_STALL + 1.0 + MARGIN)
    stalled = log.find("stalled", engine=frozen.id)
    assert stalled and stalled["failed"] and stalled["reads"] == 2, log.all()
    assert all(outcomes[r].result == "abandoned" for r in stuck), outcomes
    failed_at = time.monotonic()
    f.fenced()
    assert any(o.result == "verified" and o.engine_id == healthy.id for o in outcomes.values())
    resumed_at = frozen_p.signal(signal.SIGCONT)
    released = f.until_released(MARGIN)
    assert released["reason"] == "stalled"
    f.until("the slots back", lambda: w.held_slots() == 0, MARGIN)
    assert not w.retired_slots and not f.stuck_slots & set(w._given_up)
    report(f"SIGSTOP with 2 reads in flight: stalled and both requests failed "
           f"{(failed_at - stopped_at) * 1000:.0f} ms after the stop, fenced while frozen; released "
           f"{(released['at'] - resumed_at) * 1000:.1f} ms after SIGCONT, slots back")
    again = w.add_remote_agent(frozen_p.address)
    assert again.is_live and again.incarnation == frozen.incarnation
    read_verified(w, again, 0, 5)


def test_the_example_stalls_a_sigstopped_prefill_with_every_default_and_frees_its_slots_on_resume(
        prefills, make_worker):
    """Every default: the worker's 5 s read timeout is shorter than the
    10 s read-stall bound, so the stall rests on the timed-out reads being
    given up as such (before, closing them counted as completions and
    restarted the stall clock: never stalled)."""
    w = make_worker()
    assert w.keepalive.config.as_dict()["read_stall"] == 10.0 and w.read_timeout == 5.0
    f = Frozen(prefills, w, healthy_reads=1)
    log, frozen, healthy, frozen_p = f.log, f.frozen, f.healthy, f.frozen_p
    stopped_at, stuck, outcomes = f.stopped_at, f.stuck, f.outcomes
    f.until_failed(w.read_timeout + 1.0 + MARGIN)
    failed_at = time.monotonic()
    # The first to time out is given up as such and stalls the engine; the
    # rest are then failed by the service (abandoned).
    results = sorted(outcomes[r].result for r in stuck)
    assert "timed_out" in results and set(results) <= {"timed_out", "abandoned"}, outcomes
    stalled = log.find("stalled", engine=frozen.id)
    assert stalled and stalled["given_up"] >= 1, log.all()
    f.fenced()
    for _ in range(4):  # the healthy prefill is read on, from the other slots
        read_verified(w, healthy, 0, 6)
    frozen_p.signal(signal.SIGCONT)
    got = f.until_released(MARGIN)
    assert got["reason"] == "stalled", got
    f.until("the slots back", lambda: w.held_slots() == 0, MARGIN)
    assert not w.retired_slots and not f.stuck_slots & set(w._given_up)
    report(f"SIGSTOP, every default: requests failed {(failed_at - stopped_at):.2f} s after the stop "
           f"(read timeout {w.read_timeout:g} s), fenced while frozen, released and slots back after SIGCONT")


def test_the_example_through_freeze_cycles_fails_at_once_and_gets_every_slot_back(prefills, make_worker):
    """Issue 43 with the example worker: cycles (``NIXL_KEEPALIVE_FREEZE_CYCLES``,
    20 by default) of a prefill SIGSTOPped with two reads in flight, then
    resumed or (every fourth) SIGKILLed and started again at its address:
    the requests fail within the stall bound, the engine is released only
    once their READs ended, every slot comes back, and reads into the
    reused slots verify."""
    cycles = int(os.environ.get("NIXL_KEEPALIVE_FREEZE_CYCLES", "20"))
    w = make_worker(interval=HEARTBEAT, read_stall=f"{READ_STALL:g}s", read_timeout=30.0)
    healthy = w.add_remote_agent(prefills().address)
    p = prefills()
    free_before = len(w._free_slots)
    held = []
    for cycle in range(cycles):
        log = EventLog(w.keepalive)
        frozen = w.add_remote_agent(p.address)
        read_verified(w, frozen)
        stopped_at = p.signal(signal.SIGSTOP)
        stuck = [w.read_blocks(frozen.id, 0, b) for b in (2, 3)]
        outcomes = {}

        def step():
            if w.reads_in_flight() < 3:
                w.read_blocks(healthy.id, 0, 4)
            for o in w.get_finished():
                outcomes[o.request_id] = o

        def until(what, check, within):
            return wait_for(what, lambda: (step(), check())[1], within,
                            seen=lambda: (cycle, log.all(), outcomes, w.held_slots()))

        until("the requests failed", lambda: all(r in outcomes for r in stuck), 1.25 * READ_STALL + 1.0 + MARGIN)
        failed_in = time.monotonic() - stopped_at
        assert all(outcomes[r].result == "abandoned" for r in stuck), (cycle, outcomes)
        held.append(w.held_slots())
        assert held[-1] >= 1 and not log.find("released", engine=frozen.id), (cycle, log.all())
        resume = cycle % 4 != 3
        if resume:
            p.signal(signal.SIGCONT)
        else:
            p.kill()
        until("released once the READs ended", lambda: log.find("released", engine=frozen.id), MARGIN)
        until("every slot back", lambda: w.held_slots() == 0
              and len(w._free_slots) + w.reads_in_flight() == free_before, MARGIN)
        if not resume:
            p = prefills(listen=p.address)
        assert not w.retired_slots
        report(f"freeze cycle {cycle + 1}/{cycles} ({'SIGCONT' if resume else 'SIGKILL'}): requests failed "
               f"{failed_in:.2f} s after SIGSTOP, {held[-1]} slot(s) held while frozen, back after the "
               f"{'resume' if resume else 'kill'}")
    # Every slot reused: reads into all of them verify.
    frozen = w.add_remote_agent(p.address)
    for _ in range(free_before):
        read_verified(w, frozen, 0, 5)
    report(f"{cycles} freeze cycles with the example worker: slots held per cycle {held}, all back after each, "
           f"0 retired, reads into the reused slots verified")


def test_a_hundred_kill_restart_cycles_leak_no_metadata_threads_or_fds(prefills, make_worker, nixl_api):
    w = make_worker(interval=HEARTBEAT)
    log = EventLog(w.keepalive)
    cycles = int(os.environ.get("NIXL_KEEPALIVE_PY_CYCLES", "100"))
    config = w.keepalive.config.as_dict()
    gap = config["interval"] + config["jitter"]  # a killed prefill is found within one
    listen = "127.0.0.1:0"
    start = time.monotonic()
    baseline = None
    for n in range(cycles):
        p = prefills(listen=listen)
        listen = p.address
        engine = w.add_remote_agent(p.address)
        read_verified(w, engine, 0, n % 8)
        p.kill()
        log.wait("released", gap + MARGIN, engine=engine.id)
        assert_metadata_gone(w, engine.agents[0], nixl_api)
        p.close()
        if n == min(9, cycles - 1):
            baseline = (thread_count(), fd_count())
    took = time.monotonic() - start
    snap = w.keepalive.snapshot()
    assert snap["engines"] == [] and snap["limiter_keys"] == 0 and snap["heartbeat_timers"] == 0, snap
    # The service's call threads come and go with the load (at most 32;
    # on a loaded machine a burst starts spares, which exit after tokio's
    # keep-alive): what must not grow is anything per cycle, so the
    # counts are compared once the spares could have gone.
    threads, fds = wait_for(
        "threads and descriptors back near the baseline",
        lambda: (lambda t, f: (t, f) if t <= baseline[0] + 8 and f <= baseline[1] + 8 else None)(
            thread_count(), fd_count()),
        BLOCKING_KEEP_ALIVE + MARGIN,
        seen=lambda: (baseline, thread_count(), fd_count()))
    report(f"{cycles} kill/restart cycles in {took:.1f} s; threads {baseline[0]} -> {threads}, "
           f"fds {baseline[1]} -> {fds}; engines left {len(snap['engines'])}")


def test_the_agents_sync_mode_is_checked_on_real_nixl_agents(nixl_api):
    """On NIXL's own classes: an agent from make_agent (RW, progress thread)
    is taken silently; one made with NIXL's defaults (sync mode NONE) is
    refused when its config is shown, and warned about when it is not
    (nixl_agent keeps no copy of its config)."""
    import warnings

    from nixl_cu12._api import nixl_agent, nixl_agent_config

    safe = nk.make_agent("sync-check-safe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nk.Keepalive(safe, interval="1s") as ka:
            assert ka.snapshot()["heartbeat_delivery"] == "progress_thread"
    default_conf = nixl_agent_config()
    plain = nixl_agent("sync-check-default", default_conf)
    with pytest.raises(nk.ConfigError, match="NIXL_THREAD_SYNC_NONE"):
        nk.Keepalive(plain, agent_config=default_conf)
    with pytest.warns(RuntimeWarning, match="cannot check this nixl_agent's thread-sync mode"):
        ka = nk.Keepalive(plain, interval="1s")
    ka.close()
    del safe, plain
