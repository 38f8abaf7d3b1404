"""What the control endpoint of ``Keepalive(control=...)`` shows an
operator, over the real package and a recording stand-in for the agent (no
NIXL needed; these always run): its ``GET /v1/snapshot`` is
``Keepalive.snapshot()`` key for key (one rendering, the library's), and
its ``GET /metrics`` serves the service's metrics.

The service runs on the wall clock; each test waits for the state it
asserts with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request

import nixl_keepalive as nk
from conftest import EventLog, wait_for
from test_api import RecordingAgent, connect

#: Heartbeats off: nothing changes in the table between two looks but the
#: time, so two snapshots taken one after the other differ only in their
#: times.
STILL = dict(interval="inf", env=False, seed=1)

#: What the package adds to the library's snapshot (not served over HTTP).
PACKAGE_KEYS = {"endpoints", "heartbeat_delivery"}

#: A Rust ``Duration`` as its ``Debug`` prints it (``12.5ms``, ``3µs``).
DURATION = re.compile(r"\d+(?:\.\d+)?(?:ns|µs|ms|s)")


def _get(addr: str, path: str):
    """GETs ``path``; its status, content type and body."""
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as answer:
        return answer.status, answer.headers.get("Content-Type"), answer.read().decode()


def _differences(a, b, slack_ms: int, at: str = "") -> list:
    """Where ``a`` and ``b`` differ: keys anywhere, values anywhere but a
    time, which may differ by ``slack_ms`` (a number under an ``_ms`` key,
    or the durations in a ``why`` sentence)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{at}: keys {sorted(set(a) ^ set(b))} on one side only"] if set(a) != set(b) else []
        for k in set(a) & set(b):
            if k.endswith("_ms") and isinstance(a[k], int) and isinstance(b[k], int):
                if abs(a[k] - b[k]) > slack_ms:
                    out.append(f"{at}.{k}: {a[k]} vs {b[k]}, more than {slack_ms} ms apart")
            elif k == "why" and isinstance(a[k], str) and isinstance(b[k], str):
                if DURATION.sub("<t>", a[k]) != DURATION.sub("<t>", b[k]):
                    out.append(f"{at}.why: {a[k]!r} vs {b[k]!r}")
            else:
                out += _differences(a[k], b[k], slack_ms, f"{at}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{at}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, slack_ms, f"{at}[{i}]")]
    return [] if (a == b and type(a) is type(b)) else [f"{at}: {a!r} vs {b!r}"]


def _stalled_with_a_given_up_read(ka):
    """An engine (incarnation 1) whose read was given up as timed out,
    holding 3 blocks: stalled, fenced until the transfer ends."""
    log = EventLog(ka)
    engine = connect(ka)
    given = engine.read().give_up(nk.GiveUp.TIMED_OUT, 3)
    log.wait("stalled", 5, engine="e1")
    return given


def test_the_control_endpoint_s_snapshot_is_keepalive_snapshot_key_for_key_given_up_included():
    with nk.Keepalive(RecordingAgent(), control="127.0.0.1:0", **STILL) as ka:
        given = _stalled_with_a_given_up_read(ka)
        started = time.monotonic()
        ours = ka.snapshot()
        status, kind, body = _get(ka.control_addr, "/v1/snapshot")
        slack_ms = math.ceil((time.monotonic() - started) * 1000) + 1
        assert status == 200 and kind == "application/json", (status, kind)
        served = json.loads(body)
        assert set(ours) - set(served) == PACKAGE_KEYS and not set(served) - set(ours), (sorted(ours), sorted(served))
        differences = _differences({k: v for k, v in ours.items() if k not in PACKAGE_KEYS}, served, slack_ms)
        assert not differences, differences
        # What the router must see of a stalled engine: the blocks held.
        (e,) = served["engines"]
        assert (e["state"], e["incarnation"], [g["blocks"] for g in e["given_up"]]) == ("stalled", "1", [3]), e
        assert "given-up transfer" in e["why"] and isinstance(e["given_up"][0]["held_for_ms"], int), e
        assert given.ended("DONE") == "reusable"


def test_the_snapshot_s_keys_are_the_ones_the_stubs_declare():
    import ast
    from pathlib import Path

    tree = ast.parse((Path(nk.__file__).parent / "_native.pyi").read_text())
    declared = {
        node.name: {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    with nk.Keepalive(RecordingAgent(), **STILL) as ka:
        given = _stalled_with_a_given_up_read(ka)
        snap = ka.snapshot()
        (e,) = snap["engines"]
        assert set(snap) == declared["Snapshot"], set(snap) ^ declared["Snapshot"]
        assert set(e) == declared["EngineSnapshot"], set(e) ^ declared["EngineSnapshot"]
        assert set(e["given_up"][0]) == declared["GivenUpSnapshot"]
        assert set(snap["transport"]) == declared["TransportSnapshot"]
        assert set(snap["detection_bound_ms"]) == declared["DetectionBound"]
        given.ended("DONE")


def _gauge(text: str, name: str):
    """The value of unlabelled metric ``name`` in Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_metrics_are_served_on_the_control_endpoint_with_the_given_up_gauges():
    with nk.Keepalive(RecordingAgent(), control="127.0.0.1:0", **STILL) as ka:
        given = _stalled_with_a_given_up_read(ka)
        status, kind, text = _get(ka.control_addr, "/metrics")
        assert status == 200 and kind.startswith("text/plain"), (status, kind)
        # The recorder is the process's: another service of this process
        # may have set the gauges last, so wait for this one's.
        wait_for("the given-up gauges of this service",
                 lambda: _gauge(_get(ka.control_addr, "/metrics")[2], "nixl_keepalive_given_up_blocks") == 3
                 and _gauge(_get(ka.control_addr, "/metrics")[2], "nixl_keepalive_given_up_transfers") == 1,
                 5, seen=lambda: _get(ka.control_addr, "/metrics")[2])
        text = _get(ka.control_addr, "/metrics")[2]
        assert re.search(r'^nixl_keepalive_reads_given_up_total\{[^}]*why="timed_out"[^}]*\} [1-9]', text, re.M), text
        assert re.search(r'^nixl_keepalive_read_stalls_total\{[^}]*\} [1-9]', text, re.M), text
        # The transfer ended: the blocks are back.
        assert given.ended("DONE") == "reusable"
        wait_for("the given-up gauges back to 0",
                 lambda: _gauge(_get(ka.control_addr, "/metrics")[2], "nixl_keepalive_given_up_blocks") == 0,
                 5, seen=lambda: _get(ka.control_addr, "/metrics")[2])
