"""What the binding costs, and what a busy GIL does to heartbeats.

Run after building the package with its benchmark hooks (they are not in
the package users install)::

    .venv/bin/maturin build --release --features bench --manifest-path python/Cargo.toml --out target/python-bench
    .venv/bin/python -m pip install --no-deps --force-reinstall target/python-bench/nixl_keepalive-*.whl
    .venv/bin/python python/bench/bench_keepalive.py [--quick]

Three measurements, each with its baseline in the same run and process,
the ratio printed, and PASS/MISS against its target (nothing asserts):

1. ``read_guard``: one read begun and finished with SUCCESS
   (``with engine.read() as r: r.finish(0)``) from Python, against the same
   ``begin_read`` + ``finish`` from Rust on the same engine. Target: at most
   1 us per read from Python (a KV block read takes tens of us or more).
2. ``heartbeat``: process CPU per heartbeat of the service over a Python
   agent whose ``send_notif`` does nothing (the GIL taken, the call made),
   against the service over a Rust no-op transport; 200 engines every
   50 ms. Target: at most 20 us of CPU per heartbeat from Python.
3. ``busy_gil``: heartbeat lateness (each engine's gap between two
   heartbeats, as the agent sees them, minus the interval) for 50 engines
   at 100 ms, while the interpreter is idle and while a thread holds the GIL
   for 100 ms at a time (a C call that does not release it, as a model
   step's may), with a moment free between holds. Target: p99 lateness
   under a busy GIL at most one hold (100 ms) over the idle p99, and no
   heartbeat lost.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import nixl_keepalive as nk
from nixl_keepalive import _native

if not hasattr(_native, "bench_read_guards"):
    sys.exit(
        "bench_keepalive.py: this nixl_keepalive was built without its benchmark hooks; "
        "build it with `maturin build --release --features bench` (see this file's docstring)"
    )

QUICK = "--quick" in sys.argv


class NoopAgent:
    """A nixl_agent whose calls do nothing (optionally record when)."""

    def __init__(self, record: bool = False) -> None:
        self.sent = 0
        self.record = record
        self.times = defaultdict(list)

    def send_notif(self, agent, msg):
        self.sent += 1
        if self.record:
            self.times[agent].append(time.monotonic())

    def release_dlist_handle(self, handle):
        pass

    def remove_remote_agent(self, agent):
        pass


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def bench_read_guard() -> None:
    n = 50_000 if QUICK else 300_000
    ka = nk.Keepalive(NoopAgent(), interval="inf", env=False)
    engine = ka.register("bench-read", "bench:1", ["bench-read-rank0"], [])
    # Warm both paths.
    _native.bench_read_guards(engine, 10_000)
    for _ in range(10_000):
        with engine.read() as r:
            r.finish(0)
    rust = min(_native.bench_read_guards(engine, n) for _ in range(3)) / n
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            with engine.read() as r:
                r.finish(0)
        best = min(best, (time.perf_counter() - t) / n)
    ka.close()
    print(
        f"read_guard: Python {best * 1e9:.0f} ns/read, Rust {rust * 1e9:.1f} ns/read (same engine, same run): "
        f"{best / rust:.1f}x; target <= 1000 ns: {verdict(best <= 1e-6)}"
    )


def bench_heartbeat() -> None:
    engines, interval, seconds = 200, 0.05, (2.0 if QUICK else 5.0)
    t = time.process_time()
    rust_sent = _native.bench_service_heartbeats(engines, interval, seconds)
    rust_cpu = (time.process_time() - t) / max(rust_sent, 1)

    agent = NoopAgent()
    ka = nk.Keepalive(agent, interval=interval, jitter=0, rate_period=interval, metrics_period="inf", env=False)
    for i in range(engines):
        ka.register(f"bench-py-{i}", f"bench-py:{i}", [f"bench-py-{i}-rank0"], [])
    time.sleep(0.2)
    start_sent = agent.sent
    t = time.process_time()
    time.sleep(seconds)
    py_cpu_total = time.process_time() - t
    py_sent = agent.sent - start_sent
    ka.close()
    py_cpu = py_cpu_total / max(py_sent, 1)
    print(
        f"heartbeat: Python agent {py_cpu * 1e6:.1f} us CPU/heartbeat ({py_sent} sent), "
        f"Rust no-op transport {rust_cpu * 1e6:.1f} us ({rust_sent} sent; {engines} engines every "
        f"{interval * 1000:.0f} ms, {seconds:.0f} s each): {py_cpu / rust_cpu:.1f}x; "
        f"target <= 20 us: {verdict(py_cpu <= 20e-6)}"
    )


def lateness(times: dict, interval: float, since: float, until: float) -> list:
    late = []
    for ts in times.values():
        ts = [t for t in ts if since <= t <= until]
        late += [(b - a) - interval for a, b in zip(ts, ts[1:])]
    return sorted(late)


def pct(xs: list, p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def bench_busy_gil() -> None:
    engines, interval, seconds, hold = 50, 0.1, (3.0 if QUICK else 6.0), 0.1
    agent = NoopAgent(record=True)
    ka = nk.Keepalive(agent, interval=interval, jitter=0, rate_period=interval, metrics_period="inf", env=False)
    for i in range(engines):
        ka.register(f"gil-{i}", f"gil:{i}", [f"gil-{i}-rank0"], [])
    time.sleep(0.5)
    quiet_from = time.monotonic()
    time.sleep(seconds)
    quiet_to = time.monotonic()
    stats_quiet = ka.transport_stats()

    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL
    stop = threading.Event()
    holds = [0]
    threads_max = [0]

    def model_step() -> None:
        while not stop.is_set():
            libc.usleep(int(hold * 1e6))  # 100 ms with the GIL held
            holds[0] += 1
            time.sleep(0.001)  # the GIL is free for a moment

    def count_threads() -> None:
        while not stop.is_set():
            threads_max[0] = max(threads_max[0], len(os.listdir("/proc/self/task")))
            time.sleep(0.05)

    busy_from = time.monotonic()
    workers = [threading.Thread(target=model_step), threading.Thread(target=count_threads)]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    busy_to = time.monotonic()
    stats = ka.transport_stats()
    left = ka.close()
    quiet = lateness(agent.times, interval, quiet_from, quiet_to)
    busy = lateness(agent.times, interval, busy_from + 0.2, busy_to)
    expected = engines * (busy_to - busy_from - 0.2) / interval
    got = sum(len([t for t in ts if busy_from + 0.2 <= t <= busy_to]) for ts in agent.times.values())
    ms = lambda x: f"{x * 1000:.1f}"  # noqa: E731
    print(
        f"busy_gil: {engines} engines every {ms(interval)} ms; idle GIL lateness p50/p99/max "
        f"{ms(pct(quiet, .5))}/{ms(pct(quiet, .99))}/{ms(quiet[-1])} ms; a thread holding the GIL "
        f"{ms(hold)} ms at a time ({holds[0]} holds): p50/p99/max {ms(pct(busy, .5))}/{ms(pct(busy, .99))}/"
        f"{ms(busy[-1])} ms; heartbeats {got:.0f} of {expected:.0f} due; GIL waits: longest "
        f"{stats['gil_wait_max'] * 1000:.1f} ms, {stats['gil_waits_over_10ms'] - stats_quiet['gil_waits_over_10ms']} "
        f"over 10 ms; process threads at most {threads_max[0]}; unreleased at close {len(left['unreleased'])}; "
        f"target p99 <= idle p99 + {ms(hold)} ms: {verdict(pct(busy, .99) <= pct(quiet, .99) + hold)}"
    )


if __name__ == "__main__":
    print(f"nixl_keepalive {nk.__version__} benchmarks ({'quick' if QUICK else 'full'}), {os.cpu_count()} cores")
    bench_read_guard()
    bench_heartbeat()
    bench_busy_gil()
