"""The Python API's rules, over a recording stand-in for ``nixl_agent``
(no NIXL needed; these always run). The stand-in behaves as NIXL 1.5.1's
Python API was measured to: every call succeeds until told otherwise, and
a failure is raised as NIXL's exception class of that status (matched by
name, as the binding matches the real classes).

The service runs on the wall clock here (it is the real binding); each
test waits for the state it asserts with a deadline, never a fixed sleep
that decides the outcome.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
import threading

import pytest

import nixl_keepalive as nk
from conftest import EventLog, wait_for


class nixlRemoteDisconnectError(Exception):
    """Named as NIXL's class: the binding classifies by class name."""


class nixlNotFoundError(Exception):
    pass


class nixlBackendError(Exception):
    pass


class H:
    """A prepped dlist handle as NIXL's Python API makes one (an object
    whose ``_handle`` is an int), labelled for the assertions: equal to its
    label."""

    _next = 0x1000

    def __init__(self, label: str) -> None:
        H._next += 1
        self._handle = H._next
        self.label = label

    def __eq__(self, other):
        if isinstance(other, H):
            return self.label == other.label
        return self.label == other

    def __hash__(self):
        return hash(self.label)

    def __repr__(self):
        return f"H({self.label!r})"


class RecordingAgent:
    """What the service calls on a ``nixl_agent``, recorded with when."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = []  # (what, arg, time)
        self.fail = {}  # agent name -> exception class raised by send_notif
        self.name = "recording-agent"

    def _record(self, what, arg):
        with self.lock:
            self.calls.append((what, arg, time.monotonic()))

    def send_notif(self, agent, msg):
        self._record("send_notif", (agent, bytes(msg)))
        exc = self.fail.get(agent)
        if exc is not None:
            raise exc("injected")

    def release_dlist_handle(self, handle):
        self._record("release_dlist_handle", handle)

    def remove_remote_agent(self, agent):
        self._record("remove_remote_agent", agent)

    def of(self, what):
        with self.lock:
            return [c for c in self.calls if c[0] == what]

    def heartbeats_to(self, agent):
        return [c[1][1] for c in self.of("send_notif") if c[1][0] == agent]


FAST = dict(interval="50ms", env=False, seed=1)


@pytest.fixture
def agent():
    return RecordingAgent()


@pytest.fixture
def ka(agent):
    k = nk.Keepalive(agent, **FAST)
    yield k
    k.close()


def connect(ka, engine="e1", address="10.0.0.1:1", agents=("e1-rank0",), handles=("dl-0",), incarnation=1):
    with ka.handshake(address) as h:
        got = h.ready_to_load(engine, list(agents), incarnation=incarnation)
        assert got is None, "a new engine must be loaded"
        return h.register([H(x) if isinstance(x, str) else x for x in handles])


# -- configuration ---------------------------------------------------------------


def test_a_bad_keyword_value_names_keyword_variable_value_and_what_is_accepted(agent):
    with pytest.raises(nk.ConfigError) as e:
        nk.Keepalive(agent, interval="1ns", env=False)
    text = str(e.value)
    assert "interval='1ns'" in text and "NIXL_KEEPALIVE_INTERVAL" in text, text
    assert "must be from 10ms to 86400s" in text and "UCX time" in text, text
    assert isinstance(e.value, ValueError) and isinstance(e.value, nk.KeepaliveError)
    assert e.value.errors[0]["variable"] == "NIXL_KEEPALIVE_INTERVAL"
    assert e.value.errors[0]["source"] == "keyword"


def test_every_bad_value_from_keywords_and_environment_is_listed_at_once(monkeypatch):
    monkeypatch.setenv("NIXL_KEEPALIVE_RATE_BURST", "zero")
    monkeypatch.setenv("NIXL_KEEPALIVE_READ_STALL_ACTION", "explode")
    with pytest.raises(nk.ConfigError) as e:
        nk.Config(event_capacity=0, jitter="10h")
    text = str(e.value)
    assert text.startswith("4 configuration values are not accepted"), text
    for needle in ('NIXL_KEEPALIVE_RATE_BURST="zero"', "environment:", "explode", "`fail` or `report`",
                   "keyword argument event_capacity=0", "keyword argument jitter='10h'"):
        assert needle in text, (needle, text)
    assert {x["variable"] for x in e.value.errors} == {
        "NIXL_KEEPALIVE_RATE_BURST", "NIXL_KEEPALIVE_READ_STALL_ACTION",
        "NIXL_KEEPALIVE_EVENT_CAPACITY", "NIXL_KEEPALIVE_JITTER"}


def test_keywords_override_the_environment_and_derive_like_rust(monkeypatch):
    monkeypatch.setenv("NIXL_KEEPALIVE_INTERVAL", "2s")
    assert nk.Config().as_dict()["interval"] == 2.0
    c = nk.Config(interval=0.25).as_dict()
    assert (c["interval"], c["jitter"], c["rate_period"]) == (0.25, 0.025, 0.25)
    assert nk.Config(interval=float("inf")).as_dict()["interval"] is None
    import datetime
    assert nk.Config(shutdown_drain=datetime.timedelta(milliseconds=1500)).as_dict()["shutdown_drain"] == 1.5
    assert nk.Config(env=False).as_dict()["interval"] == 5.0


def test_unknown_keywords_and_wrong_types_are_type_errors(agent):
    with pytest.raises(TypeError, match="unknown configuration keyword .intervall.; accepted: interval"):
        nk.Config(intervall="1s")
    with pytest.raises(TypeError, match="rate_burst .*whole number"):
        nk.Config(rate_burst=True)
    with pytest.raises(TypeError, match="either a Config or keyword"):
        nk.Keepalive(agent, nk.Config(), interval="1s")
    with pytest.raises(TypeError, match="no send_notif"):
        nk.Keepalive(object(), env=False)


# -- statuses ----------------------------------------------------------------------


def test_nixl_exceptions_are_classified_by_class_and_check_xfer_states_err_is_refused():
    assert nk.classify_exception(nixlRemoteDisconnectError("x")) == nk.REMOTE_DISCONNECT == -10
    assert nk.classify_exception(nixlNotFoundError) == nk.NOT_FOUND == -4
    assert nk.classify_exception(nixlBackendError("x")) == -3
    assert nk.classify_exception(RuntimeError("x")) is None
    assert nk.status_name(-10) == "NIXL_ERR_REMOTE_DISCONNECT"


def test_a_read_reports_a_raw_status_and_refuses_a_collapsed_one(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    with engine.read() as r:
        with pytest.raises(ValueError, match="in progress"):
            r.finish("PROC")
        assert r.open, "PROC: the transfer still runs, the read stays open"
        r.finish(nixlRemoteDisconnectError("from transfer()"))
        assert not r.open
    e = log.wait("unreachable", 5, engine="e1")
    assert (e["status"], e["status_name"], e["source"]) == (-10, "NIXL_ERR_REMOTE_DISCONNECT", "transfer")
    log.wait("released", 5, engine="e1", reason="unreachable")


# -- the rules ---------------------------------------------------------------------


def test_a_heartbeat_remote_disconnect_releases_the_engine_through_the_agent(ka, agent):
    log = EventLog(ka)
    connect(ka, agents=("e1-rank0", "e1-rank1"), handles=("dl-0", "dl-1"))
    wait_for("a heartbeat", lambda: agent.heartbeats_to("e1-rank1"), 5)
    agent.fail["e1-rank1"] = nixlRemoteDisconnectError
    e = log.wait("unreachable", 5, engine="e1")
    assert (e["status"], e["source"]) == (-10, "heartbeat")
    released = log.wait("released", 5, engine="e1")
    assert released["reason"] == "unreachable" and released["failed_steps"] == 0
    assert [c[1] for c in agent.of("release_dlist_handle")] == ["dl-0", "dl-1"]
    assert [c[1] for c in agent.of("remove_remote_agent")] == ["e1-rank0", "e1-rank1"]
    assert ka.engine("e1") is None


def test_other_errors_are_counted_never_a_release(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    agent.fail["e1-rank0"] = nixlBackendError
    e = log.wait("transient_error", 5, engine="e1")
    assert (e["status"], e["source"]) == (-3, "heartbeat")
    wait_for("three failed heartbeats", lambda: len(agent.heartbeats_to("e1-rank0")) >= 4, 5)
    assert engine.state == "live" and not agent.of("release_dlist_handle")


@pytest.mark.parametrize("begin", ["read", "write"])
def test_no_release_while_a_read_or_a_push_write_is_in_flight(ka, agent, begin):
    log = EventLog(ka)
    engine = connect(ka)
    read = getattr(engine, begin)()
    agent.fail["e1-rank0"] = nixlRemoteDisconnectError
    log.wait("unreachable", 5, engine="e1")
    with pytest.raises(nk.ReadRefused) as refused:
        getattr(engine, begin)()
    assert (refused.value.engine, refused.value.state) == ("e1", "unreachable")
    assert read.failed, "an unreachable engine's reads are failed"
    # Six heartbeat intervals with the read still open: nothing may be
    # released (an absence needs a window; the release below shows the
    # service was not idle).
    seen = len(agent.calls)
    time.sleep(0.3)
    assert not agent.of("release_dlist_handle"), agent.calls[seen:]
    closed_at = time.monotonic()
    read.close()
    log.wait("released", 5, engine="e1")
    assert all(c[2] >= closed_at for c in agent.of("release_dlist_handle"))


def test_leases_ride_on_heartbeats_until_removed(ka, agent):
    engine = connect(ka)
    ka.add_leases(engine, ["req-1", "req-2"], renew_now=True)
    wait_for("HB with both leases", lambda: any(m in (b"HB:req-1,req-2", b"HB:req-2,req-1")
                                                for m in agent.heartbeats_to("e1-rank0")), 5)
    assert sorted(ka.snapshot()["engines"][0]["leases"]) == ["req-1", "req-2"]
    ka.remove_leases("e1", ["req-1", "req-2"])
    mark = len(agent.heartbeats_to("e1-rank0"))
    wait_for("an empty HB after removal", lambda: b"HB:" in agent.heartbeats_to("e1-rank0")[mark:], 5)


def test_peer_gone_fail_fails_reads_at_once_and_releases_when_they_end(ka, agent):
    log = EventLog(ka)
    engine = connect(ka, address="10.0.0.9:9")
    read = engine.read()
    ka.peer_gone(address="10.0.0.9:9", mode="fail")
    log.wait("retiring", 5, engine="e1", fail_reads=True)
    wait_for("the read failed", lambda: read.failed, 5)
    assert log.find("reads_failed", engine="e1")["count"] == 1
    assert not agent.of("release_dlist_handle")
    read.finish("DONE")
    assert log.wait("released", 5, engine="e1")["reason"] == "peer_gone"
    with pytest.raises(ValueError, match="drain.*fail"):
        ka.peer_gone("e1", mode="later")
    with pytest.raises(TypeError, match="exactly one"):
        ka.peer_gone()


def _post(addr, path, body, token=None):
    """POSTs JSON to the control server; its status and JSON answer (an
    error status is an answer too)."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_router_event_to_control_addr_releases_by_engine_id_and_by_address(agent):
    ka = nk.Keepalive(agent, control="127.0.0.1:0", control_token="s3cret", **FAST)
    try:
        log = EventLog(ka)
        host, port = ka.control_addr.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, ka.control_addr
        connect(ka, engine="e1", address="10.0.0.1:1", agents=("e1-rank0",))
        connect(ka, engine="e2", address="10.0.0.2:2", agents=("e2-rank0",), handles=("dl-2",))
        by_id = {"event_type": "peer_gone", "nodes": {"engine_ids": ["e1", "nobody"]}}
        by_address = {"event_type": "peer_gone", "nodes": {"addresses": ["10.0.0.2:2"]}, "mode": "fail"}
        status, answer = _post(ka.control_addr, "/fault_tolerance/event", by_id)
        assert status == 401, answer
        assert ka.engine("e1").state == "live"
        status, answer = _post(ka.control_addr, "/fault_tolerance/event", by_id, token="s3cret")
        assert status == 200, answer
        assert [n["outcome"] for n in answer["nodes"]] == ["releasing", "unknown"], answer
        assert log.wait("released", 5, engine="e1")["reason"] == "peer_gone"
        status, answer = _post(ka.control_addr, "/fault_tolerance/event", by_address, token="s3cret")
        assert status == 200, answer
        assert answer["nodes"] == [{"address": "10.0.0.2:2", "outcome": "releasing", "engine_ids": ["e2"]}]
        assert log.wait("released", 5, engine="e2")["reason"] == "peer_gone"
        assert "dl-2" in [c[1] for c in agent.of("release_dlist_handle")]
        # Again: a broadcast is idempotent, and says so.
        status, answer = _post(ka.control_addr, "/fault_tolerance/event", by_id, token="s3cret")
        assert [n["outcome"] for n in answer["nodes"]] == ["released", "unknown"], answer
        status, answer = _post(ka.control_addr, "/fault_tolerance/event", {"event_type": "reboot"}, token="s3cret")
        assert status == 400 and "peer_gone" in answer["error"], answer
    finally:
        ka.close()
    # close() stopped the server: its port is closed.
    import socket

    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_bad_control_settings_raise_at_construction_before_anything_runs(agent):
    for control, token, needle in [
        ("nowhere", None, "not an address to listen on"),
        ("0.0.0.0:0", None, "not a loopback address"),
        ({"addr": "127.0.0.1:0", "tokn": "x"}, None, "unknown key(s) tokn; accepted: addr, token, token_file"),
        ({"token": "x"}, None, 'no "addr"'),
        ("127.0.0.1:0", "two words", "visible ASCII"),
        ({"addr": "127.0.0.1:0", "token_file": "/nonexistent/token"}, None, "/nonexistent/token"),
        (None, "s3cret", "without control"),
    ]:
        with pytest.raises(nk.ConfigError) as e:
            nk.Keepalive(agent, control=control, control_token=token, **FAST)
        assert needle in str(e.value), (control, str(e.value))
    assert not agent.calls, "nothing ran"
    with pytest.raises(TypeError, match="host:port"):
        nk.Keepalive(agent, control=9091, **FAST)
    with nk.Keepalive(agent, control={"addr": "localhost:0"}, **FAST) as ka:
        assert ka.control_addr.startswith("127.0.0.1:"), ka.control_addr
    with nk.Keepalive(agent, **FAST) as ka:
        assert ka.control_addr is None


def test_the_snapshot_is_plain_dicts(ka, agent):
    connect(ka)
    wait_for("a heartbeat back", lambda: ka.snapshot()["engines"][0]["last_heartbeat"], 5)
    snap = ka.snapshot()
    e = snap["engines"][0]
    assert (e["engine"], e["address"], e["agents"], e["state"], e["reads_in_flight"]) == (
        "e1", "10.0.0.1:1", ["e1-rank0"], "live", 0)
    assert e["last_heartbeat"]["status_name"] == "NIXL_SUCCESS" and isinstance(e["why"], str)
    assert snap["detection_bound_ms"]["crashed"] is not None
    assert asyncio.run(ka.snapshot_async())["engines"][0]["engine"] == "e1"


# -- identities ------------------------------------------------------------------------


def test_the_same_incarnation_is_not_loaded_twice_and_a_new_one_goes_after_the_old_release(ka, agent):
    log = EventLog(ka)
    first = connect(ka, incarnation=7)
    with ka.handshake("10.0.0.1:1") as h:
        again = h.ready_to_load("e1", ["e1-rank0"], incarnation=7)
        assert again is not None and again.id == "e1" and again.incarnation == 7
        assert h.ended
    with ka.handshake("10.0.0.1:1") as h:
        assert h.ready_to_load("e1", ["e1-rank0"], incarnation=8) is None
        # The old registration was released before we may load.
        assert first.state == "released"
        assert [c[1] for c in agent.of("remove_remote_agent")] == ["e1-rank0"]
        second = h.register([H("dl-new")])
    assert log.wait("released", 5, engine="e1")["reason"] == "reregistered"
    assert second.incarnation == 8 and second.is_live


def test_an_agent_held_by_another_engine_is_refused_before_anything_is_loaded(ka, agent):
    connect(ka, engine="e1", agents=("shared-agent",))
    with ka.handshake("10.0.0.2:2") as h:
        with pytest.raises(nk.IdentityConflict) as e:
            h.ready_to_load("e2", ["shared-agent"], incarnation=1)
    assert (e.value.conflict, e.value.agent, e.value.holder) == ("agent_in_use", "shared-agent", "e1")
    assert not agent.of("remove_remote_agent")


def test_a_declared_address_of_a_live_engine_is_refused_and_a_gone_holder_makes_way():
    # Heartbeats every hour: only the one the declaration asks for goes out.
    agent = RecordingAgent()
    ka = nk.Keepalive(agent, interval="3600s", env=False, seed=1)
    try:
        log = EventLog(ka)
        first = connect(ka, engine="e1", address="10.0.0.1:1")
        with ka.handshake("10.0.0.1:1", declared=True) as h:
            with pytest.raises(nk.IdentityConflict) as e:
                h.ready_to_load("e2", ["e2-rank0"])
        assert (e.value.conflict, e.value.engine, e.value.holder) == ("address_in_use", "e2", "e1")
        wait_for("the holder heartbeated at once", lambda: agent.heartbeats_to("e1-rank0"), 5)
        assert first.is_live and not agent.of("remove_remote_agent")
        assert log.wait("conflict", 5, engine="e2")["conflict"] == "address_in_use"
        # Its next answer is a disconnect: the next declaration releases it.
        agent.fail["e1-rank0"] = nixlRemoteDisconnectError
        with ka.handshake("10.0.0.1:1", declared=True) as h:
            with pytest.raises(nk.IdentityConflict):
                h.ready_to_load("e2", ["e2-rank0"])
        assert log.wait("released", 5, engine="e1")["reason"] == "unreachable"
        with ka.handshake("10.0.0.1:1", declared=True) as h:
            assert h.ready_to_load("e2", ["e2-rank0"]) is None
            second = h.register([H("dl-e2")])
        assert second.is_live and log.find("replaced") is None
    finally:
        ka.close()


def test_an_engine_id_live_at_another_address_is_refused_and_kept(ka, agent):
    log = EventLog(ka)
    first = connect(ka, engine="e1", address="10.0.0.1:1")
    with ka.handshake("10.0.0.7:7") as h:
        with pytest.raises(nk.IdentityConflict) as e:
            h.ready_to_load("e1", ["e1-rank0"], incarnation=2)
    assert e.value.conflict == "engine_elsewhere"
    c = log.wait("conflict", 5, engine="e1")
    assert c["conflict"] == "engine_elsewhere" and "10.0.0.7:7" in c["detail"], c
    assert first.is_live and not agent.of("remove_remote_agent")


def test_a_refused_registration_comes_back_whole_and_give_back_spares_the_holders_agent(ka, agent):
    connect(ka, engine="e1", agents=("shared-agent",))
    with pytest.raises(nk.RegistrationRefused) as e:
        ka.register("e2", "10.0.0.2:2", ["own-agent", "shared-agent"], [H("dl-e2")])
    refused = e.value
    assert (refused.reason, refused.conflict, refused.agent, refused.holder) == (
        "conflict", "agent_in_use", "shared-agent", "e1")
    reg = refused.registration
    assert reg["dlist_handles"] == ["dl-e2"] and reg["agents"] == ["own-agent"]
    assert reg["kept_agents"] == ["shared-agent"]
    steps = ka.give_back(reg)
    assert [(s["target"], s["status_name"]) for s in steps] == [
        ("dlist_handle", "NIXL_SUCCESS"), ("remote_metadata", "NIXL_SUCCESS"), ("endpoints", "NIXL_SUCCESS")]
    # What the invalidation did to UCX endpoints: a recording agent closes
    # none (not observed before any real agent loaded NIXL's UCX plugin).
    assert steps[2]["agent"] == "own-agent" and steps[2]["close"] in ("none_closed", "not_observed"), steps
    assert [c[1] for c in agent.of("remove_remote_agent")] == ["own-agent"]
    assert ka.give_back(reg) == [], "given back once"


def test_the_async_handshake_and_async_events(ka, agent):
    async def main():
        events = ka.events()
        async with ka.handshake("10.0.0.3:3") as h:
            assert await h.ready_to_load("e3", [b"e3-rank0"], incarnation=1) is None
            engine = await h.register([H("dl-e3")])
        assert engine.agents == ["e3-rank0"]
        first = await asyncio.wait_for(events.__anext__(), 5)
        assert (first["kind"], first["engine"]) == ("registered", "e3")
        ka.peer_gone(engine)
        kinds = []
        async for e in events:
            kinds.append(e["kind"])
            if e["kind"] == "released":
                break
        assert kinds[-1] == "released" and "retiring" in kinds
        return await ka.aclose()

    left = asyncio.run(main())
    assert left == {"unreleased": [], "releases_unfinished": []}


def test_a_handshake_used_out_of_order_says_what_to_do(ka):
    with ka.handshake("10.0.0.4:4") as h:
        with pytest.raises(RuntimeError, match="call ready_to_load first"):
            h.register([H("x")])
        h.ready_to_load("e4", ["e4-rank0"])
        with pytest.raises(RuntimeError, match="already called"):
            h.ready_to_load("e4", ["e4-rank0"])
    with pytest.raises(RuntimeError, match="ended"):
        h.register([H("x")])


# -- stopping -----------------------------------------------------------------------


def test_close_drains_then_hands_back_what_still_has_reads(agent):
    ka = nk.Keepalive(agent, interval="50ms", shutdown_drain="200ms", env=False)
    connect(ka, engine="idle", address="10.0.0.5:5", agents=("idle-0",), handles=("dl-idle",))
    busy = connect(ka, engine="busy", address="10.0.0.6:6", agents=("busy-0",), handles=("dl-busy",))
    read = busy.read()
    events = ka.events()
    left = ka.close()
    assert [r["engine"] for r in left["unreleased"]] == ["busy"]
    assert left["unreleased"][0]["dlist_handles"] == ["dl-busy"]
    assert [c[1] for c in agent.of("release_dlist_handle")] == ["dl-idle"]
    assert ka.closed and ka.close() is left
    kinds = [e["kind"] for e in events]  # ends: the service has stopped
    assert "released" in kinds
    with pytest.raises(nk.ReadRefused):
        busy.read()
    read.close()
    ka.give_back(left["unreleased"][0])
    assert [c[1] for c in agent.of("release_dlist_handle")] == ["dl-idle", "dl-busy"]
    with pytest.raises(nk.ServiceStopped):
        ka.snapshot()


def test_calls_on_a_closed_service_raise_service_stopped_leases_included(agent):
    ka = nk.Keepalive(agent, interval="50ms", env=False)
    engine = connect(ka)
    ka.close()
    for call in (lambda: ka.add_leases(engine, ["r1"]), lambda: ka.remove_leases(engine, ["r1"]),
                 lambda: ka.renew_leases(engine), ka.snapshot):
        with pytest.raises(nk.ServiceStopped):
            call()


def test_a_status_out_of_range_is_refused_saying_why(ka):
    engine = connect(ka)
    for status in (-10**30, 2**31, -2**31 - 1):
        with pytest.raises(ValueError, match="out of range: a raw nixl_status_t is a 32-bit int"):
            engine.report_transfer(status)
    engine.report_transfer(-2**31)  # the edge itself is a status


def test_give_back_refuses_a_dict_that_is_not_a_registration(ka):
    with pytest.raises(ValueError, match="has no agents or dlist_handles: give back the registration"):
        ka.give_back({"engine": "x"})
    with pytest.raises(ValueError, match="has no dlist_handles"):
        ka.give_back({"engine": "x", "agents": ["x-0"]})


def test_a_non_nixl_exception_is_a_transport_panic_and_the_engine_is_kept(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    agent.fail["e1-rank0"] = KeyError
    e = log.wait("transport_panicked", 5, engine="e1")
    assert e["call"] == "genNotif" and "KeyError" in e["message"], e
    assert engine.state == "live"


def test_events_get_times_out_and_polls(ka):
    events = ka.events()
    t = time.monotonic()
    assert events.get(timeout=0.05) is None
    assert time.monotonic() - t >= 0.04
    assert events.get_nowait() is None


def test_remove_remote_agent_keeps_nixls_status_and_says_what_became_of_the_endpoints(agent):
    out = nk.remove_remote_agent(agent, "gone-agent")
    assert (out["status"], out["status_name"]) == (0, "NIXL_SUCCESS"), out
    assert out["close"] in ("none_closed", "not_observed"), out  # a recording agent closes nothing
    assert [c[1] for c in agent.of("remove_remote_agent")] == ["gone-agent"]

    def not_loaded(name):
        raise nixlNotFoundError(name)

    agent.remove_remote_agent = not_loaded
    out = nk.remove_remote_agent(agent, "never-loaded")
    assert (out["status"], out["close"]) == (-4, None), out

    def broken(name):
        raise KeyError(name)

    agent.remove_remote_agent = broken
    with pytest.raises(KeyError):
        nk.remove_remote_agent(agent, "x")
    assert nk.endpoint_close_mode()["mode"] in ("force", "pending"), nk.endpoint_close_mode()


def test_a_bad_endpoint_close_setting_is_refused_by_keepalive_naming_what_is_accepted():
    # The setting is read when the package is imported: a fresh interpreter.
    code = textwrap.dedent(
        """
        import nixl_keepalive as nk

        class Agent:
            def send_notif(self, a, m): pass
            def release_dlist_handle(self, h): pass
            def remove_remote_agent(self, a): pass

        print(nk.endpoint_close_mode()["mode"])
        try:
            nk.Keepalive(Agent(), env=False)
        except nk.ConfigError as e:
            print("refused:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, NIXL_SYS_EP_CLOSE="forced"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "unavailable", out.stdout
    assert lines[1].startswith("refused: NIXL_SYS_EP_CLOSE=\"forced\"") and "`force`" in lines[1] \
        and "`nixl`" in lines[1], out.stdout


# -- the rules an embedder cannot get wrong ---------------------------------------------


@pytest.mark.parametrize(
    "status, error, says",
    [
        ("ERR", ValueError, "collapsed"),
        (RuntimeError("not NIXL's"), ValueError, "not a NIXL error"),
        (True, TypeError, "bool"),
        (object(), TypeError, "raw nixl_status_t"),
    ],
)
def test_a_refused_finish_ends_the_read_and_says_so(ka, agent, status, error, says):
    log = EventLog(ka)
    engine = connect(ka)
    r = engine.read()
    with pytest.raises(error, match=says) as refused:
        r.finish(status)
    assert "the read has been ended" in str(refused.value)
    assert not r.open and engine.reads_in_flight == 0
    # Ended, it holds nothing: a dead peer is released at once.
    agent.fail["e1-rank0"] = nixlRemoteDisconnectError
    log.wait("released", 5, engine="e1", reason="unreachable")


def test_a_read_given_up_as_timed_out_stalls_the_engine_and_fences_it_until_the_transfer_ends(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    r = engine.read()
    given = r.give_up(nk.GiveUp.TIMED_OUT, 3)
    assert not r.open and (given.engine, given.why, given.watched) == ("e1", "timed_out", True)
    assert given.try_destination() is None, "the transfer may still run"
    stalled = log.wait("stalled", 5, engine="e1")
    assert stalled["given_up"] >= 1
    # Fenced: still counted, in the snapshot, never released under it.
    time.sleep(0.3)
    assert not log.find("released", engine="e1") and engine.reads_in_flight == 1
    snap = ka.snapshot()["engines"][0]
    assert [g["blocks"] for g in snap["given_up"]] == [3] and "given-up transfer" in snap["why"], snap
    with pytest.raises(ValueError, match="still in progress"):
        given.ended("PROC")
    assert given.watched
    # The transfer ended (the prefill resumed): the buffer is yours, the
    # engine goes.
    assert given.ended("DONE") == nk.Destination.REUSABLE == "reusable"
    assert given.ended(0) == "reusable", "a second end changes nothing"
    assert not given.watched and given.try_destination() == "reusable"
    log.wait("released", 5, engine="e1")
    with pytest.raises(ValueError, match="already ended"):
        r.give_up("cancelled")


def test_an_abandoned_given_up_read_lets_the_release_go_and_its_buffer_is_retired(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    given = engine.read().give_up(nk.GiveUp.TIMED_OUT)
    log.wait("stalled", 5, engine="e1")
    given.abandon()
    given.abandon()
    log.wait("released", 5, engine="e1")
    # NIXL 1.5.1 cannot prove an unwatched transfer over: never reuse it.
    assert given.wait_destination(5) == nk.Destination.RETIRE == "retire"
    assert given.try_destination() == "retire"


def test_a_given_up_read_dropped_unsaid_is_abandoned(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    engine.read().give_up(nk.GiveUp.TIMED_OUT)
    log.wait("released", 5, engine="e1")
    assert engine.reads_in_flight == 0


def test_give_up_names_what_is_accepted(ka):
    r = connect(ka).read()
    with pytest.raises(ValueError, match="TIMED_OUT"):
        r.give_up("late")
    with pytest.raises(TypeError, match="GiveUp"):
        r.give_up(3)
    assert r.open, "a refused give_up leaves the read as it was"
    given = r.give_up(nk.GiveUp.CANCELLED)
    assert given.why == "cancelled"


def test_a_cancelled_read_is_not_a_completion_and_its_destination_is_awaitable(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    given = engine.read().give_up("cancelled")
    ka.peer_gone(engine, mode="fail")
    given.abandon()
    log.wait("released", 5, engine="e1")

    async def main():
        return await asyncio.wait_for(given.destination(), 5)

    assert asyncio.run(main()) == "retire"


def test_released_is_a_wait_an_awaitable_and_a_callback(ka, agent):
    log = EventLog(ka)
    engine = connect(ka)
    assert engine.wait_released(0.05) is False
    called = []
    engine.on_released(lambda e: called.append((e.id, e.state)))
    with pytest.raises(TypeError, match="callable"):
        engine.on_released("not callable")
    agent.fail["e1-rank0"] = nixlRemoteDisconnectError
    assert engine.wait_released(5) is True
    log.wait("released", 5, engine="e1")
    wait_for("the callback", lambda: called, 5)
    assert called == [("e1", "released")]

    async def main():
        await asyncio.wait_for(engine.released(), 5)

    asyncio.run(main())
    late = []
    engine.on_released(late.append)
    wait_for("a callback registered after the release, called at once", lambda: late, 5)


def test_leases_are_a_sequence_of_ids_never_a_lone_string(ka, agent):
    engine = connect(ka)
    for bad in ("req-1", b"req-1"):
        with pytest.raises(TypeError, match="wrap a single one in a list"):
            ka.add_leases(engine, bad)
        with pytest.raises(TypeError, match="wrap a single one in a list"):
            ka.remove_leases(engine, bad)
    with pytest.raises(TypeError, match=r"requests\[1\] must be a request id"):
        ka.add_leases(engine, ["req-1", 7])
    assert ka.snapshot()["engines"][0]["leases"] == [], "a refused call adds none"
    ka.add_leases(engine, ("req-1",))
    assert ka.snapshot()["engines"][0]["leases"] == ["req-1"]


def test_addresses_are_validated_and_canonicalised_by_the_rust_rule(ka, agent):
    for bad, says in [
        ("not-an-address", "is not host:port"),
        ("010.0.0.1:5600", "standard IPv4"),
        ("10.0.0.1:+80", "is not host:port"),
    ]:
        with pytest.raises(ValueError, match=says):
            ka.handshake(bad).__enter__()
        with pytest.raises(ValueError, match=says):
            ka.register("x", bad, ["x-0"], [H("dl-x")])
        with pytest.raises(ValueError, match=says):
            ka.peer_gone(address=bad)
    assert nk.canonical_address("localhost:05601") == "127.0.0.1:5601"
    assert nk.canonical_address("[0:0::1]:80") == "[::1]:80"
    engine = connect(ka, address="localhost:5601")
    assert engine.address == "127.0.0.1:5601"
    # The same engine at an alias of its address is the same peer, not a
    # conflict: this exact incarnation is already registered.
    with ka.handshake("127.0.0.1:5601") as h:
        again = h.ready_to_load("e1", ["e1-rank0"], incarnation=1)
    assert again is not None and again.id == "e1"
    log = EventLog(ka)
    ka.peer_gone(address="LOCALHOST:5601")
    log.wait("released", 5, engine="e1")


def test_every_bad_argument_is_refused_at_the_call_naming_it(ka, agent):
    with pytest.raises(TypeError, match=r"dlist_handles\[0\] must be a prepped dlist handle"):
        ka.register("e9", "10.0.0.9:9", ["e9-0"], [object()])
    with pytest.raises(TypeError, match="agents must be a sequence of agent names"):
        ka.register("e9", "10.0.0.9:9", "abc", [H("dl")])
    with pytest.raises(ValueError, match="incarnation=-1 is not accepted"):
        ka.register("e9", "10.0.0.9:9", ["e9-0"], [H("dl")], incarnation=-1)
    with ka.handshake("10.0.0.9:9") as h:
        with pytest.raises(TypeError, match="agents must be a sequence"):
            h.ready_to_load("e9", "abc")
        with pytest.raises(TypeError, match=r"agents\[0\] must be an agent name"):
            h.ready_to_load("e9", [5])
    with pytest.raises(nk.ConfigError, match="seed=-1 is not accepted"):
        nk.Config(seed=-1, env=False)
    with pytest.raises(nk.ConfigError, match="seed=True"):
        nk.Config(seed=True, env=False)
    with pytest.raises(TypeError, match="must be a nixl_keepalive.Config"):
        nk.Keepalive(RecordingAgent(), {"interval": "1s"})
    assert not agent.of("release_dlist_handle"), "nothing reached the agent"


def test_the_gpu_mapping_knob_is_a_switch_on_by_default(monkeypatch):
    monkeypatch.delenv("NIXL_KEEPALIVE_GPU_UNMAP", raising=False)
    assert nk.Config().as_dict()["gpu_unmap"] is True
    assert nk.Config(gpu_unmap=False, env=False).as_dict()["gpu_unmap"] is False
    assert nk.Config(gpu_unmap="off", env=False).as_dict()["gpu_unmap"] is False
    monkeypatch.setenv("NIXL_KEEPALIVE_GPU_UNMAP", "off")
    assert nk.Config().as_dict()["gpu_unmap"] is False
    monkeypatch.setenv("NIXL_KEEPALIVE_GPU_UNMAP", "maybe")
    with pytest.raises(nk.ConfigError, match=r"NIXL_KEEPALIVE_GPU_UNMAP.*`on` or `off`"):
        nk.Config()
    assert "gpu_unmap" in [k["keyword"] for k in nk.knobs()], "a knob of vLLM's and SGLang's too"


#: What a keyword of each kind of the knob table takes, as its TypeError
#: says when given a bool.
_KIND_TAKES = {
    "time": "a time",
    "count": "a whole number",
    "word": "a string",
}


def test_every_knob_takes_the_values_of_its_table_kind():
    # The kinds are the Rust knob table's (KnobKind): a knob added there is
    # read in Python as its table says, never by its name.
    kinds = {k["keyword"]: k["kind"] for k in nk.knobs()}
    assert set(kinds.values()) <= set(_KIND_TAKES) | {"switch"}, kinds
    assert kinds["rate_burst"] == "count" and kinds["interval"] == "time", kinds
    for keyword, kind in kinds.items():
        if kind == "switch":
            nk.Config(env=False, **{keyword: False})
            continue
        with pytest.raises(TypeError, match=f"{keyword} .* takes {_KIND_TAKES[kind]}"):
            nk.Config(env=False, **{keyword: True})
        if kind == "count":
            assert nk.Config(env=False, **{keyword: 1}).as_dict()[keyword] == 1
        if kind == "time":
            with pytest.raises(TypeError, match="takes a time"):
                nk.Config(env=False, **{keyword: object()})


def test_a_misspelt_variable_is_reported_with_the_knob_it_resembles(monkeypatch):
    monkeypatch.setenv("NIXL_KEEPALIVE_INTERVALL", "1s")
    with pytest.warns(RuntimeWarning, match="NIXL_KEEPALIVE_INTERVALL.*did you mean NIXL_KEEPALIVE_INTERVAL"):
        k = nk.Keepalive(RecordingAgent(), **FAST)
    k.close()


def test_one_keepalive_per_agent(agent):
    first = nk.Keepalive(agent, **FAST)
    try:
        with pytest.raises(nk.KeepaliveError, match="already has a running Keepalive"):
            nk.Keepalive(agent, **FAST)
    finally:
        first.close()
    second = nk.Keepalive(agent, **FAST)  # the first one is closed
    second.close()


class _AgentConfig:
    """Shaped as NIXL's ``nixl_agent_config`` (the fields Keepalive reads)."""

    def __init__(self, sync_mode=None, enable_listen=False, enable_pthread=True):
        self.sync_mode = sync_mode
        self.enable_listen = enable_listen
        self.enable_pthread = enable_pthread


class _Mode:
    def __init__(self, name):
        self.name = name


def test_an_agent_in_sync_mode_none_or_without_progress_is_refused_with_the_fix():
    with pytest.raises(nk.ConfigError, match="NIXL_THREAD_SYNC_NONE.*NIXL_THREAD_SYNC_RW"):
        nk.Keepalive(RecordingAgent(), agent_config=_AgentConfig(), **FAST)
    with pytest.raises(nk.ConfigError, match="NIXL_THREAD_SYNC_NONE"):
        nk.Keepalive(RecordingAgent(), agent_config=_AgentConfig(_Mode("NIXL_THREAD_SYNC_NONE")), **FAST)
    rw = _Mode("NIXL_THREAD_SYNC_RW")
    with pytest.raises(nk.ConfigError, match='progress="caller"'):
        nk.Keepalive(RecordingAgent(), agent_config=_AgentConfig(rw, enable_pthread=False), **FAST)
    with pytest.raises(ValueError, match="progress='sometimes' is not accepted"):
        nk.Keepalive(RecordingAgent(), progress="sometimes", **FAST)
    with nk.Keepalive(RecordingAgent(), agent_config=_AgentConfig(rw, enable_pthread=False), progress="caller", **FAST) as k:
        assert k.snapshot()["heartbeat_delivery"] == "caller"
    # The listener thread makes NIXL default to STRICT: safe.
    with nk.Keepalive(RecordingAgent(), agent_config=_AgentConfig(enable_listen=True), **FAST) as k:
        assert k.snapshot()["heartbeat_delivery"] == "progress_thread"
    with nk.Keepalive(RecordingAgent(), **FAST) as k:
        assert k.snapshot()["heartbeat_delivery"] == "unknown"


def test_every_status_has_a_constant():
    assert (nk.IN_PROG, nk.SUCCESS, nk.NOT_FOUND, nk.REMOTE_DISCONNECT, nk.CANCELED) == (1, 0, -4, -10, -11)
    for name in ("NOT_POSTED", "INVALID_PARAM", "BACKEND", "MISMATCH", "NOT_ALLOWED", "REPOST_ACTIVE",
                 "UNKNOWN", "NOT_SUPPORTED", "NO_TELEMETRY"):
        value = getattr(nk, name)
        assert nk.status_name(value) == f"NIXL_ERR_{name}", name
    assert nk.status_name(nk.IN_PROG) == "NIXL_IN_PROG"


def _stub_event_kinds():
    """Each event TypedDict of the stubs: kind -> the keys it declares
    (its own and its bases')."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(nk.__file__).parent / "_native.pyi").read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}

    def keys(name):
        c = classes[name]
        own = {s.target.id: s.annotation for s in c.body if isinstance(s, ast.AnnAssign)}
        for base in c.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own = {**keys(base.id), **own}
        return own

    kinds = {}
    for name in classes:
        ann = keys(name).get("kind") if name in classes else None
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Literal":
            kinds[ann.slice.value] = set(keys(name))
    return kinds


def test_the_events_are_typed_in_the_stubs_with_every_key_they_carry(ka, agent):
    """Every event the service sent here has a TypedDict in the stubs with
    its kind, declaring every key it carries (the stubs typed them as
    plain dicts before)."""
    kinds = _stub_event_kinds()
    log = EventLog(ka)
    engine = connect(ka)
    agent.fail["e1-rank0"] = nixlBackendError
    log.wait("transient_error", 5, engine="e1")
    r = engine.read()
    r.give_up(nk.GiveUp.TIMED_OUT)
    log.wait("released", 5, engine="e1")
    seen = log.all()
    assert {e["kind"] for e in seen} >= {"registered", "transient_error", "stalled", "released"}
    for e in seen:
        assert e["kind"] in kinds, f"no TypedDict for {e['kind']!r} in _native.pyi"
        undeclared = set(e) - kinds[e["kind"]] - {"at"}
        assert not undeclared, f"{e['kind']}: keys not in the stubs: {undeclared}"


def test_an_event_s_line_is_the_library_s_one_line(ka, agent):
    """What the connectors log: the event's line as the library renders
    it (``nixl-keepalive decode`` prints it after ``event: ``), beside its
    dict; never the dict's repr."""
    events = ka.events()
    connect(ka, engine="e1", address="10.0.0.1:1", agents=("e1-rank0",))
    got = wait_for("the registered event", events.get_line_nowait, 5)
    event, line = got
    assert event["kind"] == "registered", got
    assert line.startswith("registered engine=e1 "), line
    assert "{" not in line and "\n" not in line, line
    assert events.get_line_nowait() is None


def test_an_event_s_dict_is_its_line_and_its_json_field_by_field(ka, agent):
    """One walk of an event's fields (the library's ``Event::each_field``)
    makes its dict, its line (``nixl-keepalive decode``) and its JSON: for
    one event of every kind, the dict is the JSON with ``event`` named
    ``kind`` (a conflict's own ``kind`` under ``conflict``), key for key,
    value for value and in the same order, the line names the same keys,
    and the stubs declare exactly those keys."""
    import json
    import re

    events = ka.events()
    rendered = []
    stop = threading.Event()

    def collect():
        while True:
            got = events._rendered_nowait()
            if got is not None:
                rendered.append(got)
            elif stop.is_set():
                return
            else:
                time.sleep(0.002)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()

    def kinds():
        return {d["kind"] for d, _, _ in rendered}

    # registered, transient_error, transport_panicked, stalled, released
    e1 = connect(ka, engine="e1", address="10.0.0.1:1", agents=("e1-rank0",))
    agent.fail["e1-rank0"] = nixlBackendError
    wait_for("a transient error", lambda: "transient_error" in kinds(), 5, seen=kinds)
    agent.fail["e1-rank0"] = KeyError
    wait_for("a transport panic", lambda: "transport_panicked" in kinds(), 5, seen=kinds)
    del agent.fail["e1-rank0"]
    given = e1.read().give_up(nk.GiveUp.TIMED_OUT)
    wait_for("a stall", lambda: "stalled" in kinds(), 5, seen=kinds)
    given.ended("DONE")
    # retiring, reads_failed
    e2 = connect(ka, engine="e2", address="10.0.0.2:2", agents=("e2-rank0",))
    read = e2.read()
    ka.peer_gone(address="10.0.0.2:2", mode="fail")
    wait_for("the read failed", lambda: read.failed, 5)
    read.finish("DONE")
    # unreachable
    connect(ka, engine="e3", address="10.0.0.3:3", agents=("e3-rank0",))
    agent.fail["e3-rank0"] = nixlRemoteDisconnectError
    # conflict
    connect(ka, engine="e4", address="10.0.0.4:4", agents=("e4-rank0",))
    with ka.handshake("10.0.0.7:7") as h:
        with pytest.raises(nk.IdentityConflict):
            h.ready_to_load("e4", ["e4-rank0"], incarnation=2)
    # replaced
    connect(ka, engine="e5", address="10.0.0.5:5", agents=("e5-rank0",))
    connect(ka, engine="e6", address="10.0.0.5:5", agents=("e6-rank0",))
    every = {"registered", "unreachable", "replaced", "retiring", "stalled", "reads_failed",
             "transient_error", "released", "conflict", "transport_panicked"}
    wait_for("an event of every kind", lambda: kinds() >= every, 5, seen=kinds)
    stop.set()
    collector.join(5)

    stubs = _stub_event_kinds()
    for d, line, text in list(rendered):
        j = json.loads(text)
        expected = {"kind": j["event"]}
        for key, value in j.items():
            if key != "event":
                expected["conflict" if key == "kind" else key] = value
        assert list(d.items()) == list(expected.items()), (d, text)
        named = {f"{k}_name" for k in j if f"{k}_name" in j}
        assert line.split(" ", 1)[0] == d["kind"], line
        assert re.findall(r" (\w+)=", line) == [k for k in j if k != "event" and k not in named], (line, text)
        assert set(d) == stubs[d["kind"]] - {"at"}, f"{d['kind']}: the stubs declare {stubs[d['kind']]}"
    stalled = next(d for d, _, _ in rendered if d["kind"] == "stalled")
    assert isinstance(stalled["stalled_ms"], int) and stalled["reads"] == 1, stalled
    released = next(d for d, _, _ in rendered if d["kind"] == "released")
    assert isinstance(released["waited_ms"], int) and isinstance(released["handshake"], bool), released
    replaced = next(d for d, _, _ in rendered if d["kind"] == "replaced")
    assert (replaced["old"], replaced["new"], replaced["address"]) == ("e5", "e6", "10.0.0.5:5"), replaced
    conflict = next(d for d, _, _ in rendered if d["kind"] == "conflict")
    assert (conflict["conflict"], conflict["engine"]) == ("engine_elsewhere", "e4"), conflict


@pytest.mark.parametrize(
    "text,seconds",
    [("250ms", 0.25), ("5s", 5.0), ("2", 2.0), ("1m", 60.0), ("1.5e3us", 0.0015), ("inf", None)],
)
def test_parse_ucx_time_reads_what_the_services_time_knobs_read(text, seconds):
    assert nk.parse_ucx_time(text) == seconds


@pytest.mark.parametrize("text", ["auto", " 5s", "5 s", "10sec", "2h", "-1s", "+1s", "soon", "", "infinity"])
def test_parse_ucx_time_refuses_what_the_service_refuses_naming_the_syntax(text):
    with pytest.raises(ValueError, match="a number with unit s, ms, us, ns or m") as e:
        nk.parse_ucx_time(text)
    assert text in str(e.value), str(e.value)


def test_one_test_says_what_a_nixl_agent_is_for_the_package_and_the_connectors():
    """A class ``nixl_agent`` from a NIXL distribution's ``_api`` module (or
    a subclass) is one; a stand-in is not, whatever its name or attributes."""
    from unittest import mock

    def made(module: str, name: str = "nixl_agent") -> type:
        return type(name, (), {"__module__": module, "agent": None})

    real = made("nixl_cu12._api")
    assert nk._is_nixl_agent(real())
    assert nk._is_nixl_agent(made("nixl._api")())
    assert nk._is_nixl_agent(type("Mine", (real,), {})()), "a subclass"
    assert not nk._is_nixl_agent(made("test_doubles")()), "a stand-in named nixl_agent"
    assert not nk._is_nixl_agent(made("nixl_cu12._api", "FakeNixlWrapper")())
    assert not nk._is_nixl_agent(mock.MagicMock())
    assert nk._is_nixl_agent(mock.MagicMock(spec=real)), "as isinstance sees a spec'd mock"


def test_the_vllm_connectors_knobs_are_read_without_vllm():
    """``nixl_keepalive.vllm_knobs`` needs no vLLM: a launcher can check a
    connector's knobs before it starts vLLM, with the connectors' texts."""
    from nixl_keepalive import vllm_knobs

    class Kv:
        kv_connector_extra_config = {"keepalive": {"interval": "1s", "read_timeout": "250ms",
                                                   "control_addr": "127.0.0.1:9100"}}

    config, own = vllm_knobs.keepalive_knobs(Kv)
    assert config == {"interval": "1s"}
    assert own == {"read_timeout": 0.25, "control_addr": ("127.0.0.1", 9100), "control_token_file": None}
    assert vllm_knobs.control_addr_of_rank(own["control_addr"], 2) == "127.0.0.1:9102"
    Kv.kv_connector_extra_config = {"keepalive": {"read_timout": "10s"}}
    with pytest.raises(ValueError, match="did you mean 'read_timeout'"):
        vllm_knobs.keepalive_knobs(Kv)
    Kv.kv_connector_extra_config = {"keepalive": {"read_timeout": " 5s"}}
    with pytest.raises(ValueError, match="read_timeout=' 5s'.*a number with unit"):
        vllm_knobs.keepalive_knobs(Kv)
    out = subprocess.run(
        [sys.executable, "-c", "import sys, nixl_keepalive.vllm_knobs; print('vllm' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "False", out


def test_a_handshake_waiting_for_a_release_only_its_own_thread_can_allow_raises_release_held(ka, agent):
    # Issue 58: this thread gave a read up and is the one that would see it
    # end; its re-handshake of the stalled engine waits for the release,
    # which waits for that read. The wait ends, naming what holds it.
    log = EventLog(ka)
    engine = connect(ka)
    given = engine.read().give_up(nk.GiveUp.TIMED_OUT, 3)
    log.wait("stalled", 5, engine="e1")
    with ka.handshake("10.0.0.1:1") as h:
        started = time.monotonic()
        with pytest.raises(nk.ReleaseHeld, match="1 read\\(s\\) in flight, 1 of them given up") as held:
            h.ready_to_load("e1", ["e1-rank0"], incarnation=1, timeout=0.2)
        assert time.monotonic() - started < 5
        assert h.ended, "nothing may be loaded under it"
    e = held.value
    assert isinstance(e, nk.KeepaliveError)
    assert (e.engine, e.state, e.reads_in_flight, e.given_up, e.given_up_blocks) == ("e1", "stalled", 1, 1, 3)
    assert e.waited >= 0.2 and "given-up transfer" in e.why, e.why
    assert engine.state == "stalled" and not agent.of("remove_remote_agent")
    # Once this thread ends the read, the release goes and the engine
    # loads again.
    given.ended("DONE")
    log.wait("released", 5, engine="e1")
    with ka.handshake("10.0.0.1:1") as h:
        assert h.ready_to_load("e1", ["e1-rank0"], incarnation=1, timeout=None) is None
    with ka.handshake("10.0.0.1:1") as h:
        with pytest.raises(ValueError, match="timeout=-1"):
            h.ready_to_load("e1", ["e1-rank0"], timeout=-1)
