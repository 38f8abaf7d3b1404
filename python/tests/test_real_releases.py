"""A release leaves nothing behind, in a Python decoder: a live prefill
released again and again through the decoder's own ``nixl_agent`` (NIXL's
Python API, ``nixl_cu12`` 1.5.1), counted from ``/proc`` on both sides: the
decode (this pytest process) and the prefill (a real ``nixl-keepalive
prefill`` child).

NIXL 1.5.1's ``remove_remote_agent`` closes a live peer's UCX endpoint in
UCX's flush mode, which keeps it and its TCP connection until the agent is
destroyed: one connection per rank on each side, per release. The package
installs nixl-sys's endpoint-close shim at import and forces the closes of
its own releases (``nixl_keepalive.endpoint_close_mode()``). The first test
asserts both processes stay flat; the second runs the same cycles in a
child decode with NIXL's own close mode (``NIXL_SYS_EP_CLOSE=nixl``), with
the package imported after the first ``nixl_agent`` (too late), and with
NIXL loading its UCX plugin with ``RTLD_DEEPBIND``, and asserts that the
mode says so and why, and that the counting sees the leak there: the first
test can fail.

The prefill runs UCX keepalive every 500 ms: UCX shares one TCP connection
between both directions, and after the decode has closed its endpoint the
prefill's keepalive round would close the rest (with UCX's default, 20 s).
The last test runs both sides at UCX's defaults instead: the connections
recorded at each load (``load_remote_agent``) are shut down at the
release, so both processes are flat as soon as the last release returned,
and with that shutdown off (``NIXL_SYS_SHUT_SOCKETS=0``) the counting sees
the leak. ``NIXL_KEEPALIVE_PY_RELEASES`` changes the 60 releases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import nixl_keepalive as nk
from conftest import report, wait_for
from live_releases import Releases, read_every_rank, release_and_reload
from procfs import Held, between, held

RANKS = 2
PREFILL_ENV = {"UCX_KEEPALIVE_INTERVAL": "500ms"}
PREFILL_KEEPALIVE = 0.5

#: How long lingering connections may take to close after the last
#: release: the prefill's keepalive closes them at its next rounds (20
#: intervals here).
SETTLE = 12.0

#: Descriptors a process may hold above its baseline at one look without a
#: leak: UCX's lazy connection from a worker to itself (two descriptors per
#: worker), a side-channel probe in progress. A leak is one per release and
#: rank: 120 here.
TRANSIENT_FDS = 6

#: Connections to other processes beside the registration's at one look.
TRANSIENT_CONNECTIONS = 2

#: Mappings a process may gain without a leak (a new thread's stack and
#: arena); a peer's shared memory kept mapped would be one per release.
TRANSIENT_MAPS = 16

#: The TCP connections UCX keeps for one live registration: per rank, one
#: from the decode and one the prefill opens back, each when first needed.
PER_REGISTRATION = 2 * RANKS

#: Releases the child decodes make in the comparison (each leaks one
#: connection per rank there).
CHILD_RELEASES = 10


def releases_wanted() -> int:
    return int(os.environ.get("NIXL_KEEPALIVE_PY_RELEASES", "60"))


def is_flat(base: Held, now: Held) -> bool:
    return (
        now.maps <= base.maps + TRANSIENT_MAPS
        and now.fds <= base.fds + TRANSIENT_FDS
        and now.sockets <= base.sockets + TRANSIENT_FDS
        and now.established_out <= max(base.established_out, PER_REGISTRATION) + TRANSIENT_CONNECTIONS
    )


def assert_flat(who: str, base: Held, now: Held, releases: int) -> None:
    assert now.fds <= base.fds + TRANSIENT_FDS, f"{who}: descriptors after {releases} releases: {base} -> {now}"
    assert now.sockets <= base.sockets + TRANSIENT_FDS, f"{who}: sockets after {releases} releases: {base} -> {now}"
    assert now.established_out <= max(base.established_out, PER_REGISTRATION) + TRANSIENT_CONNECTIONS, (
        f"{who}: ESTABLISHED to other processes after {releases} releases: {base} -> {now}"
    )
    assert now.maps <= base.maps + TRANSIENT_MAPS, f"{who}: mappings after {releases} releases: {base} -> {now}"


def settle_flat(
    decode: int, prefill: int, between0: int, d0: Held, p0: Held, within: float = SETTLE
) -> Tuple[float, int, Held, Held]:
    """Waits (at most ``within``) until both are back where they were, or
    one registration's worth; returns how long it took and what was seen
    last. The caller asserts on it."""
    t = time.monotonic()
    while True:
        n, d1, p1 = between(decode, prefill), held(decode), held(prefill)
        if (n <= max(between0, PER_REGISTRATION) and is_flat(d0, d1) and is_flat(p0, p1)) or (
            time.monotonic() - t >= within
        ):
            return time.monotonic() - t, n, d1, p1
        time.sleep(0.02)


def test_sixty_releases_of_a_live_prefill_leave_both_processes_flat(prefills, make_worker):
    me = os.getpid()
    p = prefills(ranks=RANKS, env=PREFILL_ENV)
    # Heartbeats off: the router is the only thing that releases here.
    w = make_worker(interval="inf")
    releases = Releases(w.keepalive)
    engine = w.add_remote_agent(p.address)
    read_every_rank(w, engine, RANKS, 0)
    # One warm-up release and reload; then the baseline, once what it left
    # has closed (a few prefill keepalive rounds).
    engine, _ = release_and_reload(w, releases, p.address, engine, 0, RANKS)
    time.sleep(4 * PREFILL_KEEPALIVE)
    between0, d0, p0 = between(me, p.pid), held(me), held(p.pid)
    assert between0 >= 1, "no connection seen between the decode and the prefill"

    n = releases_wanted()
    started = time.monotonic()
    slowest = 0.0
    for i in range(1, n + 1):
        t = time.monotonic()
        engine, _ = release_and_reload(w, releases, p.address, engine, i, RANKS)
        slowest = max(slowest, time.monotonic() - t)
    took = time.monotonic() - started
    lingering = between(me, p.pid)
    settled, left, d1, p1 = settle_flat(me, p.pid, between0, d0, p0)
    report(
        f"{n} router releases of a live {RANKS}-rank prefill (+1 warm-up) through the Python agent in "
        f"{took:.1f} s (slowest release + reload + {RANKS} reads {slowest * 1000:.0f} ms): connections between "
        f"them {between0} -> {lingering} right after -> {left} after {settled:.2f} s; decode fds {d0.fds} -> "
        f"{d1.fds}, sockets {d0.sockets} -> {d1.sockets}, ESTABLISHED to others {d0.established_out} -> "
        f"{d1.established_out}, maps {d0.maps} -> {d1.maps}; prefill fds {p0.fds} -> {p1.fds}, sockets "
        f"{p0.sockets} -> {p1.sockets}, ESTABLISHED to others {p0.established_out} -> {p1.established_out}, "
        f"maps {p0.maps} -> {p1.maps}"
    )
    assert left <= max(between0, PER_REGISTRATION), (
        f"{left} connections between decode and prefill {SETTLE} s after {n} releases, {between0} before "
        f"(one registration keeps at most {PER_REGISTRATION})"
    )
    assert_flat("decode", d0, d1, n)
    assert_flat("prefill", p0, p1, n)

    # What each release closed, as the Rust transport reports it.
    events = releases.of(engine.id)
    assert len(events) == n + 1 and all(e["endpoints_left_open"] == 0 for e in events), events
    closing = w.keepalive.snapshot()["endpoints"]
    assert closing["mode"] == "force", closing
    assert (closing["closed"], closing["left_open"], closing["not_observed"], closing["none_closed"]) == (
        RANKS * (n + 1), 0, 0, 0
    ), closing
    # UCX's own view of the decode's agent: its loopback endpoint and the
    # current registration's, nothing of the released ones.
    assert closing["ucx_endpoints"] is not None and closing["ucx_endpoints"] <= 1 + RANKS, closing
    report(
        f"endpoints closed by the releases: {closing['closed']}, left open 0; UCX endpoints in the decode's "
        f"agent after the last reload: {closing['ucx_endpoints']}"
    )
    # Released once more and not reloaded: UCX holds the loopback endpoint
    # alone.
    w.keepalive.peer_gone(engine.id, mode="fail")
    releases.wait(engine.id, n + 2)
    wait_for("UCX's view of the decode's agent down to its loopback endpoint",
             lambda: w.keepalive.snapshot()["endpoints"]["ucx_endpoints"] == 1, SETTLE,
             seen=lambda: w.keepalive.snapshot()["endpoints"])


class ChildDecode:
    """``live_releases.py`` as a child decode (see its docstring)."""

    def __init__(self, address: str, env: Dict[str, str], args: List[str], cycles: int = CHILD_RELEASES) -> None:
        script = Path(__file__).with_name("live_releases.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--address", address, "--cycles", str(cycles),
             "--ranks", str(RANKS), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(os.environ, **env),
        )
        self.pid = self.proc.pid

    def line(self, prefix: str, within: float = 60.0) -> str:
        deadline = time.monotonic() + within
        seen = []
        while time.monotonic() < deadline:
            raw = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not raw:
                break
            text = raw.decode(errors="replace").rstrip("\n")
            if text.startswith(prefix):
                return text
            seen.append(text)
        self.proc.kill()
        err = self.proc.stderr.read().decode(errors="replace")[-3000:]  # type: ignore[union-attr]
        pytest.fail(f"child decode never printed {prefix!r}; stdout {seen[-20:]}; stderr {err}")

    def go(self) -> None:
        self.proc.stdin.write(b"go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize(
    "case,env,args,mode,why",
    [
        pytest.param("nixl_close_mode", {"NIXL_SYS_EP_CLOSE": "nixl"}, [], "nixl",
                     "NIXL_SYS_EP_CLOSE=nixl", id="nixl_close_mode"),
        pytest.param("imported_after_the_first_agent", {}, ["--agent-first"], "unavailable",
                     "import nixl_keepalive before the process makes its first nixl_agent",
                     id="imported_after_the_first_agent"),
        pytest.param("plugin_loaded_with_deepbind", {"NIXL_UCX_DEEPBIND": "1"}, [], "unavailable",
                     "RTLD_DEEPBIND", id="plugin_loaded_with_deepbind"),
    ],
)
def test_without_the_forced_close_every_release_of_a_live_prefill_keeps_a_connection_per_rank(
    prefills, nixl_api, case, env, args, mode, why
):
    p = prefills(ranks=RANKS, env=PREFILL_ENV)
    child = ChildDecode(p.address, env, args)
    try:
        ready = child.line("READY ")
        assert ready.split(" ", 3)[2] == f"mode={mode}", ready
        time.sleep(4 * PREFILL_KEEPALIVE)
        between0, d0, p0 = between(child.pid, p.pid), held(child.pid), held(p.pid)
        child.go()
        done = json.loads(child.line("DONE ")[len("DONE "):])
        time.sleep(4 * PREFILL_KEEPALIVE)
        between1, d1, p1 = between(child.pid, p.pid), held(child.pid), held(p.pid)
    finally:
        child.close()
    report(
        f"{case}: {CHILD_RELEASES} releases of a live {RANKS}-rank prefill: connections between them "
        f"{between0} -> {between1}; decode fds {d0.fds} -> {d1.fds}, ESTABLISHED to others "
        f"{d0.established_out} -> {d1.established_out}; prefill fds {p0.fds} -> {p1.fds}; endpoints "
        f"{done['endpoints']}"
    )
    # At least one connection and one descriptor per release stays on each
    # side (measured: one per rank): what the first test would see.
    assert between1 - between0 >= CHILD_RELEASES, (between0, between1)
    assert d1.fds - d0.fds >= CHILD_RELEASES and p1.fds - p0.fds >= CHILD_RELEASES, (d0, d1, p0, p1)
    # Reported honestly: nothing was observed closed, the reason is given.
    closing = done["endpoints"]
    assert closing["mode"] == mode and why in closing["reason"], closing
    assert (closing["closed"], closing["not_observed"]) == (0, RANKS * (CHILD_RELEASES + 1)), closing
    # UCX's own view of the child's agent holds every released endpoint.
    assert closing["ucx_endpoints"] >= 1 + RANKS * CHILD_RELEASES, closing
    if mode == "unavailable":
        assert any("cannot close a live prefill's UCX endpoints" in w for w in done["warnings"]), done


#: UCX's default settings on both sides. The interface list is named
#: because conftest pins this process to loopback: ``all`` is UCX's default.
UCX_DEFAULTS = {"UCX_NET_DEVICES": "all"}

#: Live releases in the default-settings run (the count an operator's
#: router loop reached when this was found).
DEFAULT_RELEASES = 100

#: The longest the leftovers of the releases may take to go once the last
#: one returned: a bound for the wait, far under the prefill's UCX
#: keepalive round (20 s by default), which is what closed them before
#: the shutdown. The time it took is reported (measured: at once).
AT_ONCE = 5.0


@pytest.mark.parametrize("shutdown", ["on", "off"])
def test_releases_of_a_live_prefill_at_ucx_defaults_close_its_connections_at_once(prefills, nixl_api, shutdown):
    """Both processes at UCX's default settings (the prefill's keepalive
    round every 20 s), a child decode releasing and reloading the live
    prefill through NIXL's Python API: with the socket shutdown (the
    default), both are flat as soon as the last release returned; with it
    off (``NIXL_SYS_SHUT_SOCKETS=0``), each release leaves one connection
    and one descriptor per rank on each side (what the first case would
    see without the shutdown)."""
    p = prefills(ranks=RANKS, env=UCX_DEFAULTS)
    env = dict(UCX_DEFAULTS, **({"NIXL_SYS_SHUT_SOCKETS": "0"} if shutdown == "off" else {}))
    n = DEFAULT_RELEASES if shutdown == "on" else CHILD_RELEASES
    child = ChildDecode(p.address, env, [], cycles=n)
    try:
        ready = child.line("READY ")
        assert ready.split(" ", 3)[2] == "mode=force", ready
        # After the warm-up release and reload: one registration's worth
        # (with the shutdown off, plus what the warm-up left).
        between0, d0, p0 = between(child.pid, p.pid), held(child.pid), held(p.pid)
        started = time.monotonic()
        child.go()
        done = json.loads(child.line("DONE ")[len("DONE "):])
        took = time.monotonic() - started
        lingering, d_after, p_after = between(child.pid, p.pid), held(child.pid), held(p.pid)
        settled, left, d1, p1 = settle_flat(child.pid, p.pid, between0, d0, p0, within=AT_ONCE)
    finally:
        child.close()
    closing = done["endpoints"]
    report(
        f"shutdown {shutdown}: {n} releases of a live {RANKS}-rank prefill at UCX's default settings in "
        f"{took:.1f} s: right after the last, connections between them {between0} -> {lingering}, decode fds "
        f"{d0.fds} -> {d_after.fds}, prefill fds {p0.fds} -> {p_after.fds}; {settled:.2f} s later: connections "
        f"{left}, decode fds {d1.fds}, prefill fds {p1.fds}; connections shut by the releases "
        f"{closing['connections_shut']}"
    )
    assert done["releases"] == n + 1, done
    if shutdown == "on":
        assert left <= max(between0, PER_REGISTRATION), (
            f"{left} connections between decode and prefill {AT_ONCE} s after {n} releases, {between0} before"
        )
        assert_flat("decode", d0, d1, n)
        assert_flat("prefill", p0, p1, n)
        # By count, the shutdown ran: one connection per rank per release
        # (the warm-up's included), each recorded at its load.
        assert closing["connections_shut"] >= RANKS * n, closing
    else:
        assert closing["connections_shut"] == 0, closing
        assert left - between0 >= n, (between0, left)
        assert d1.fds - d0.fds >= n and p1.fds - p0.fds >= n, (d0, d1, p0, p1)
