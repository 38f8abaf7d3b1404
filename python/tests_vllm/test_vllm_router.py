"""The router's hint reaches a vLLM decode: with
``kv_connector_extra_config["keepalive"]["control_addr"]`` each rank of our
connector serves the library's control endpoint, and a router's ``POST``
of either shape (``/fault_tolerance/event`` with engine ids or addresses,
``/v1/peer_gone``) releases the prefill it names from the decode's service
and from vLLM's tables; the event is idempotent and a no-op for unknown
engines. The same endpoint serves the rank's metrics to a scrape."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from conftest import MARGIN
from test_vllm_real import released

# Every scenario here runs on every tested release in CI (conftest.EVERY_RELEASE).
pytestmark = pytest.mark.every_release


def _post(addr: str, path: str, body: dict, token: str = None):
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_routers_post_of_either_shape_releases_the_prefill_from_a_vllm_decode(prefills, decode):
    p1 = prefills("P-router-1")
    p2 = prefills("P-router-2")
    d = decode(keepalive={"control_addr": "127.0.0.1:0"})
    addr = d.ka.control_addr
    assert addr and addr.startswith("127.0.0.1:") and not addr.endswith(":0"), addr
    for p in (p1, p2):
        req, _ = d.read(p.engine_id, p.port, [1])
        assert d.wait([req], 60)[req].ok

    status, body = _post(addr, "/fault_tolerance/event",
                         {"event_type": "peer_gone", "nodes": {"engine_ids": ["P-router-1", "never-seen"]}})
    assert status == 200, body
    outcomes = {n["engine_id"]: n["outcome"] for n in body["nodes"]}
    assert outcomes == {"P-router-1": "releasing", "never-seen": "unknown"}, body
    d.poll("P-router-1 released and gone from vLLM's tables", lambda: released(d, "P-router-1"), MARGIN)
    assert "P-router-2" in d.engines(), "the other prefill is kept"

    # The same broadcast again: idempotent.
    status, body = _post(addr, "/fault_tolerance/event",
                         {"event_type": "peer_gone", "nodes": {"engine_ids": ["P-router-1"]}})
    assert status == 200 and body["nodes"][0]["outcome"] == "released", body

    # By address, failing reads in flight.
    status, body = _post(addr, "/fault_tolerance/event",
                         {"event_type": "peer_gone", "nodes": {"addresses": [f"127.0.0.1:{p2.port}"]},
                          "mode": "fail"})
    assert status == 200 and body["nodes"][0]["outcome"] == "releasing", body
    assert body["nodes"][0]["engine_ids"] == ["P-router-2"], body
    d.poll("P-router-2 released and gone from vLLM's tables", lambda: released(d, "P-router-2"), MARGIN)

    # The CLI's shape too; an unknown engine there is a 404, as it was.
    status, body = _post(addr, "/v1/peer_gone", {"engine": "P-router-1"})
    assert status == 404, body
    status, body = _post(addr, "/fault_tolerance/event", {"event_type": "peer_back", "nodes": {"engine_ids": ["x"]}})
    assert status == 400 and "peer_gone" in json.dumps(body), body


def test_control_knobs_refused_naming_the_fix(vllm_ready):
    from nixl_keepalive import vllm as kv

    class Kv:
        kv_connector_extra_config = {"keepalive": {"control_addr": "9100"}}

    with pytest.raises(ValueError, match='expected "host:port"'):
        kv.keepalive_knobs(Kv)
    Kv.kv_connector_extra_config = {"keepalive": {"control_token_file": "/t"}}
    with pytest.raises(ValueError, match="without control_addr"):
        kv.keepalive_knobs(Kv)
    Kv.kv_connector_extra_config = {"keepalive": {"control_addr": "127.0.0.1:9100"}}
    _, own = kv.keepalive_knobs(Kv)
    assert kv.control_addr_of_rank(own["control_addr"], 0) == "127.0.0.1:9100"
    assert kv.control_addr_of_rank(own["control_addr"], 3) == "127.0.0.1:9103"
    with pytest.raises(ValueError, match="past 65535"):
        kv.control_addr_of_rank(("127.0.0.1", 65535), 1)


def test_a_control_address_that_cannot_serve_fails_the_worker(decode):
    """Off loopback without a token: refused before anything runs."""
    import nixl_keepalive

    with pytest.raises((nixl_keepalive.ConfigError, ValueError)) as e:
        decode(keepalive={"control_addr": "0.0.0.0:0"})
    assert "token" in str(e.value), e.value


def _get(addr: str, path: str):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=30) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def _metric(text: str, name: str, **labels) -> float:
    """The value of ``name`` with exactly ``labels`` in a scrape, or None."""
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-z_]+)="([^"]*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    return None


def test_a_scrape_of_a_vllm_decodes_control_endpoint_shows_the_given_up_gauges(prefills, decode):
    """Issue 58: the operator's view of a frozen prefill from outside the
    vLLM process. A READ given up as timed_out on a SIGSTOPped prefill:
    the rank's ``GET /metrics`` shows one given-up transfer holding its 2
    blocks (and the give-up counted), its ``GET /v1/snapshot`` the stalled
    engine with that transfer, as ``Keepalive.snapshot()`` does; after
    SIGCONT the READ ends, the engine is released and the gauges are 0."""
    import signal

    p = prefills("P-scrape")
    d = decode(keepalive={"read_timeout": "2s", "read_stall": "60s", "control_addr": "127.0.0.1:0"})
    addr = d.ka.control_addr
    req, _ = d.read(p.engine_id, p.port, [1])
    assert d.wait([req], 60)[req].ok
    p.signal(signal.SIGSTOP)
    resumed = False
    try:
        rid, _ = d.read(p.engine_id, p.port, [9, 10])
        d.wait([rid], 2 + MARGIN, "the timed-out read's request failed")
        assert not d.outcomes[rid].ok
        d.poll("the engine stalled after the give-up",
               lambda: (d.engines().get(p.engine_id) or {}).get("state") == "stalled", MARGIN)
        status, kind, text = _get(addr, "/metrics")
        assert status == 200 and kind.startswith("text/plain"), (status, kind)
        # One decode in this process: the gauges are its own.
        scrape = d.poll("the given-up gauges in the scrape",
                        lambda: (lambda t: t if _metric(t, "nixl_keepalive_given_up_transfers") == 1
                                 and _metric(t, "nixl_keepalive_given_up_blocks") == 2 else None)(
                                     _get(addr, "/metrics")[2]), MARGIN)
        assert _metric(scrape, "nixl_keepalive_reads_given_up_total", why="timed_out", answered="false") >= 1, scrape
        # The router's snapshot shows the held blocks, as the in-process one does.
        served = json.loads(_get(addr, "/v1/snapshot")[2])
        engine = next(e for e in served["engines"] if e["engine"] == p.engine_id)
        ours = d.engines()[p.engine_id]
        assert engine["state"] == "stalled" and [g["blocks"] for g in engine["given_up"]] == [2], engine
        assert set(engine) == set(ours) and set(served) == set(d.ka.snapshot()) - {"endpoints", "heartbeat_delivery"}, \
            (sorted(engine), sorted(ours))
        p.signal(signal.SIGCONT)
        resumed = True
        d.poll("released once the READ ended", lambda: released(d, p.engine_id), MARGIN)
        d.poll("the given-up gauges back to 0",
               lambda: _metric(_get(addr, "/metrics")[2], "nixl_keepalive_given_up_blocks") == 0, MARGIN)
        assert _metric(_get(addr, "/metrics")[2], "nixl_keepalive_releases_total", reason="stalled") >= 1
    finally:
        if not resumed:
            p.signal(signal.SIGCONT)
