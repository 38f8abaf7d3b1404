"""A vLLM-shaped decode worker with the keepalive embedded.

The decode side of vLLM's NixlConnector (``NixlConnectorWorker``), reduced
to what matters here and to DRAM: one ``nixl_agent`` of its own (vLLM's
``self.nixl_wrapper``), the side-channel handshake with a prefill (here the
project's ``nixl-keepalive prefill``, see ``nixl_keepalive.pd``), remote
metadata loaded with ``add_remote_agent``, remote blocks prepped with
``prep_xfer_dlist``, reads with ``make_prepped_xfer`` / ``transfer`` and
polled in ``get_finished`` (vLLM's ``_pop_done_transfers``), every byte
checked against the prefill's pattern.

The keepalive goes exactly where vLLM's NixlConnector would take it; each
place is marked ``# KEEPALIVE``:

1. ``__init__``: ``Keepalive(self.nixl_wrapper)`` next to the agent.
2. ``add_remote_agent`` (vLLM: ``_nixl_handshake`` + ``add_remote_agent``):
   the handshake protocol around the side channel and the load, then
   ``register`` with the prepped remote dlist handles (the service releases
   them and the remote metadata when the prefill is gone).
3. ``read_blocks`` (vLLM: ``_read_blocks``): ``engine.read()`` before the
   transfer is made (refused at once on a dead or replaced prefill), and
   the request's lease added (the heartbeat renews it).
4. ``get_finished`` (vLLM: ``_pop_done_transfers``): the raw transfer
   status (``xfer_status``, not ``check_xfer_state``'s ``"ERR"``) ends the
   read; a read that timed out, or that the service failed, is *given up*
   (``give_up(GiveUp.TIMED_OUT)`` / ``GiveUp.CANCELLED``): a timed-out read
   is the runtime's own evidence that the prefill is hung, so a frozen
   prefill is stalled with every default. Its request fails now, but the
   transfer may still write the slot: the handle is kept (not released:
   that does not end it) and polled, and when it ends (the prefill resumed
   or died) ``given.ended(status)`` frees the slot; the engine is not
   released before. On completion the lease is removed.
5. ``shutdown``: ``keepalive.close()`` drains and releases.
6. ``main``: this worker handshakes on the thread that polls its given-up
   reads, so it polls them to their end before it handshakes with the
   engine again. A handshake with the same engine id waits for the older
   registration's release, which waits for exactly those reads: waiting
   there would be waiting for itself (``ready_to_load`` gives up after its
   ``timeout`` with ``ReleaseHeld``, naming what holds the release).

Run it against a prefill::

    cargo build -p nixl-keepalive-cli
    ./target/debug/nixl-keepalive prefill --listen 127.0.0.1:17001 &
    .venv/bin/python python/examples/vllm_decode.py 127.0.0.1:17001
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

# KEEPALIVE 0: imported before the first nixl_agent is made, so that its
# releases close a live prefill's UCX endpoints (endpoint_close_mode()).
import nixl_keepalive
from nixl_keepalive import Keepalive, RegistrationRefused, pd, xfer_status

try:  # NIXL's Python API: the `nixl` meta package, or the CUDA 12 wheel.
    from nixl._api import nixl_agent  # type: ignore
except ImportError:  # pragma: no cover - depends on what is installed
    from nixl_cu12 import nixl_agent  # type: ignore


@dataclass
class RemoteEngine:
    """What the worker keeps per prefill engine (vLLM: ``_remote_agents``,
    ``dst_xfer_side_handles``, ``kv_caches_base_addr``)."""

    engine: nixl_keepalive.Engine
    reply: pd.Reply
    dlists: List[object]
    seed: int


@dataclass
class Transfer:
    """A read in flight (vLLM: ``_recving_transfers``)."""

    request_id: str
    remote: RemoteEngine
    read: nixl_keepalive.Read
    handle: object
    slot: int
    rank: int
    block: int
    started: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    """How a request's read ended."""

    request_id: str
    engine_id: str
    result: str  # verified, corrupt, failed, abandoned, timed_out
    status: Optional[int] = None
    detail: str = ""


class NixlConnectorWorker:
    """The decode side of a NIXL KV connector, with the keepalive."""

    def __init__(
        self,
        block_size: int = 64 << 10,
        slots: int = 8,
        read_timeout: float = 5.0,
        progress_interval: float = 0.005,
        **keepalive_config: object,
    ) -> None:
        self.engine_id = str(uuid.uuid4())
        # vLLM makes its agent with NIXL's progress thread; that thread
        # busy-polls a core (NIXL's Python API sets no delay), so here the
        # worker progresses the agent itself every few ms. The keepalive
        # calls the agent from its own threads: RW locking is required
        # (nixl_keepalive.agent_config sets it).
        conf = nixl_keepalive.agent_config(enable_prog_thread=False)
        self.nixl_wrapper = nixl_agent(f"decode-{self.engine_id}", conf)
        # KEEPALIVE 1: next to the agent (NIXL_KEEPALIVE_* or keywords),
        # told how the agent was made (it refuses sync mode NONE) and who
        # progresses it (this worker's loop: "caller").
        self.keepalive = Keepalive(self.nixl_wrapper, agent_config=conf, progress="caller", **keepalive_config)

        self.block_size = block_size
        self.read_timeout = read_timeout
        # The local KV cache: `slots` landing blocks, registered once.
        self._kv = np.zeros(slots * block_size, dtype=np.uint8)
        base = self._kv.ctypes.data
        self._kv_reg = self.nixl_wrapper.register_memory([(base, self._kv.nbytes, 0, "")], "DRAM")
        self._local_dlist = self.nixl_wrapper.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(base + i * block_size, block_size, 0) for i in range(slots)], "DRAM"
        )
        self._free_slots = list(range(slots))
        # Slots of given-up reads, with their kept handles: a late transfer
        # may still write them. Back in the free list once the handle says
        # the transfer ended; `retired_slots` would hold any whose transfer
        # was abandoned unwatched and released as "retire" (none here).
        self._given_up: Dict[int, Tuple[Any, nixl_keepalive.GivenUpRead]] = {}
        self.retired_slots: List[int] = []
        self._remote: Dict[str, RemoteEngine] = {}  # engine id -> engine
        self._by_address: Dict[str, str] = {}  # address -> engine id
        self._recving: Dict[str, Transfer] = {}
        self._requests = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._progress = threading.Thread(
            target=self._progress_loop, args=(progress_interval,), name="nixl-progress", daemon=True
        )
        self._progress.start()

    # -- the handshake --------------------------------------------------------

    def add_remote_agent(self, address: str, timeout: float = 2.0) -> nixl_keepalive.Engine:
        """Handshakes with the prefill at ``address``, loads its metadata
        and preps its blocks (vLLM: ``_nixl_handshake`` then
        ``add_remote_agent``). Returns the registered engine; the same
        engine when that exact process is already loaded."""
        # KEEPALIVE 2: the protocol around the side channel and the load.
        with self.keepalive.handshake(address) as h:
            reply = pd.fetch(address, timeout)
            if reply.block_size != self.block_size:
                raise ValueError(f"{address}: block size {reply.block_size}, expected {self.block_size}")
            engine = h.ready_to_load(reply.engine_id, reply.agents, incarnation=reply.incarnation)
            if engine is None:  # load now: nothing of this engine id is held any more
                engine, dlists = self._load(h, reply)
                remote = RemoteEngine(engine, reply, dlists, pd.seed(engine.id))
            else:  # this very process is loaded already
                remote = self._remote[engine.id]
        self._forget_released()
        with self._lock:
            self._remote[engine.id] = remote
            self._by_address[address] = engine.id
        return engine

    def _load(self, h: nixl_keepalive.Handshake, reply: pd.Reply) -> Tuple[nixl_keepalive.Engine, List[object]]:
        loaded: List[str] = []
        dlists: List[object] = []
        try:
            for rank in reply.ranks:
                # Through the package: the UCX endpoints NIXL creates here
                # are named after the agent, so their failure (the prefill
                # killed) sends this engine a heartbeat at once.
                name = nixl_keepalive.load_remote_agent(
                    self.nixl_wrapper, lambda: self.nixl_wrapper.add_remote_agent(rank.metadata))
                name = name.decode() if isinstance(name, bytes) else name
                if name != rank.agent:
                    # Not the agent we claimed: unload it only if the
                    # service says the name is ours (else NIXL kept one
                    # entry for this load and another engine's).
                    try:
                        h.claim_agent(name)
                        loaded.append(name)
                    except nixl_keepalive.IdentityConflict:
                        pass
                    raise ValueError(f"metadata names agent {name!r}, the reply said {rank.agent!r}")
                loaded.append(name)
            for rank in reply.ranks:
                blocks = [(rank.base + b * reply.block_size, reply.block_size, 0) for b in range(reply.blocks)]
                dlists.append(self.nixl_wrapper.prep_xfer_dlist(rank.agent, blocks, "DRAM"))
        except Exception:
            for d in dlists:
                self.nixl_wrapper.release_dlist_handle(d)
            for name in loaded:
                # As the service's releases do: a live prefill's endpoints
                # and connections closed at once (NIXL 1.5.1's own
                # remove_remote_agent keeps them until the agent dies).
                nixl_keepalive.remove_remote_agent(self.nixl_wrapper, name)
            raise
        try:
            engine = h.register(dlists)
        except RegistrationRefused as refused:
            # Loaded but not taken: give it back (never an agent another
            # engine holds: the registration leaves those out).
            if refused.registration is not None:
                self.keepalive.give_back(refused.registration)
            raise
        return engine, dlists

    def _forget_released(self) -> None:
        with self._lock:
            for eid in [e for e, r in self._remote.items() if r.engine.state == "released"]:
                del self._remote[eid]

    def engine_at(self, address: str) -> Optional[RemoteEngine]:
        """The engine this worker read from last at ``address``."""
        with self._lock:
            eid = self._by_address.get(address)
            return self._remote.get(eid) if eid else None

    # -- reads ------------------------------------------------------------------

    def read_blocks(self, engine_id: str, rank: int, block: int) -> str:
        """Starts the read of one block for a new request (vLLM:
        ``_read_blocks``). Raises ``ReadRefused`` when the engine is no
        longer live (the request fails or is recomputed; reconnect)."""
        remote = self._remote[engine_id]
        request_id = f"{self.nixl_wrapper.name}-{next(self._requests)}"
        # KEEPALIVE 3: the read guard before the transfer exists; the
        # request's lease renewed by every heartbeat until it completes.
        read = remote.engine.read()
        self.keepalive.add_leases(remote.engine, [request_id])
        with self._lock:
            self._reclaim_slots()
            if not self._free_slots:
                read.close()
                self.keepalive.remove_leases(remote.engine, [request_id])
                raise RuntimeError(
                    f"no free KV slot ({len(self._recving)} reading, {len(self._given_up)} given up and "
                    f"waiting for their release, {len(self.retired_slots)} retired)"
                )
            slot = self._free_slots.pop()
        try:
            handle = self.nixl_wrapper.make_prepped_xfer(
                "READ", self._local_dlist, [slot], remote.dlists[rank], [block],
                f"RD:{request_id}".encode(),
            )
            # The request reaches the prefill before its READ (its lease
            # starts there).
            self.nixl_wrapper.send_notif(remote.reply.ranks[rank].agent, f"RQ:{request_id}".encode())
            self.nixl_wrapper.transfer(handle)
        except Exception as e:  # NIXL raised: the read ends with that status
            if nixl_keepalive.classify_exception(e) is not None:
                read.finish(e)  # its raw status: REMOTE_DISCONNECT marks the engine
            else:
                read.close()
            self.keepalive.remove_leases(remote.engine, [request_id])
            with self._lock:
                self._free_slots.append(slot)
            raise
        with self._lock:
            self._recving[request_id] = Transfer(request_id, remote, read, handle, slot, rank, block)
        return request_id

    def get_finished(self) -> List[Outcome]:
        """Polls every read in flight (vLLM: ``get_finished`` ->
        ``_pop_done_transfers``); returns the requests that ended."""
        done: List[Outcome] = []
        with self._lock:
            self._reclaim_slots()
            transfers = list(self._recving.values())
        for t in transfers:
            status = xfer_status(self.nixl_wrapper, t.handle)
            if status == 1 and not t.read.failed and time.monotonic() - t.started < self.read_timeout:
                continue  # in progress
            # KEEPALIVE 4: the raw status ends the read; a read that timed
            # out, or that the service failed (dead, stalled, gone), is
            # given up as such, never counted as a completion; its slot
            # waits for the release's verdict; the lease goes.
            given: Optional[nixl_keepalive.GivenUpRead] = None
            if status == 1:
                result = "abandoned" if t.read.failed else "timed_out"
                why = nixl_keepalive.GiveUp.CANCELLED if t.read.failed else nixl_keepalive.GiveUp.TIMED_OUT
                # The handle is kept and polled to its end (reclaim_slots).
                given = t.read.give_up(why, 1)
                outcome = Outcome(t.request_id, t.remote.engine.id, result, None, "")
            else:
                t.read.finish(status)
                self.nixl_wrapper.release_xfer_handle(t.handle)
                if status == 0:
                    off = self._verify(t)
                    outcome = Outcome(
                        t.request_id, t.remote.engine.id, "verified" if off is None else "corrupt",
                        status, "" if off is None else f"first wrong byte at {off}",
                    )
                else:
                    outcome = Outcome(t.request_id, t.remote.engine.id, "failed", status,
                                      nixl_keepalive.status_name(status))
            self.keepalive.remove_leases(t.remote.engine, [t.request_id])
            with self._lock:
                del self._recving[t.request_id]
                if given is None:
                    self._free_slots.append(t.slot)
                else:
                    self._given_up[t.slot] = (t.handle, given)
            done.append(outcome)
        return done

    def reclaim_slots(self) -> None:
        """Polls the given-up reads' kept handles: a transfer that ended
        (the prefill resumed or died) is told to the service
        (``given.ended``: its engine may be released now) and its slot goes
        back to the free list. ``read_blocks`` does it before it takes a
        slot, ``get_finished`` each call; vLLM: each step."""
        with self._lock:
            self._reclaim_slots()

    def _reclaim_slots(self) -> None:
        """(With the lock held.)"""
        for slot, (handle, given) in list(self._given_up.items()):
            status = xfer_status(self.nixl_wrapper, handle)
            if status == 1:
                continue  # still running: it may still write the slot
            del self._given_up[slot]
            verdict = given.ended(status)
            try:
                self.nixl_wrapper.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - the transfer is over either way
                pass
            if verdict == nixl_keepalive.Destination.REUSABLE:
                self._free_slots.append(slot)
            else:
                self.retired_slots.append(slot)

    def held_slots(self, engine_id: Optional[str] = None) -> int:
        """Slots held by given-up reads still running (of ``engine_id``
        only, when given)."""
        with self._lock:
            return sum(1 for _, g in self._given_up.values() if engine_id is None or g.engine == engine_id)

    def _verify(self, t: Transfer) -> Optional[int]:
        start = t.slot * self.block_size
        buf = self._kv[start : start + self.block_size]
        return pd.first_mismatch(buf, t.remote.seed, t.rank, t.block)

    def read_block(self, engine_id: str, rank: int, block: int, timeout: float = 10.0) -> Outcome:
        """One request, start to end: ``read_blocks`` then ``get_finished``
        until it has ended."""
        request_id = self.read_blocks(engine_id, rank, block)
        deadline = time.monotonic() + timeout
        while True:
            for o in self.get_finished():
                if o.request_id == request_id:
                    return o
            if time.monotonic() > deadline:
                raise TimeoutError(f"read {request_id} did not end within {timeout} s")
            time.sleep(0.0005)

    def reads_in_flight(self) -> int:
        with self._lock:
            return len(self._recving)

    # -- the rest ----------------------------------------------------------------

    def _progress_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.nixl_wrapper.get_new_notifs()
            except Exception:  # noqa: BLE001 - progress is best effort
                pass

    def shutdown(self) -> dict:
        """Stops reading and the keepalive (KEEPALIVE 5: drains the reads
        in flight, releases every engine)."""
        for t in list(self._recving.values()):
            try:
                self.nixl_wrapper.release_xfer_handle(t.handle)
            except Exception:  # noqa: BLE001
                pass
            # Stopping is the runtime's own reason: not a completion.
            self._given_up[t.slot] = t.read.give_up(nixl_keepalive.GiveUp.CANCELLED)
        self._recving.clear()
        left = self.keepalive.close()
        for registration in left["unreleased"]:
            self.keepalive.give_back(registration)
        self._stop.set()
        self._progress.join()
        # KEEPALIVE 6: progress the agent once more before it can be
        # dropped. A release's endpoint closes finish in UCX's next
        # progress, and a READ cancelled in flight can leave its copy
        # queued on UCX's cross-memory-attach transport (CMA) until
        # progressed; destroying the agent with one still queued aborts the
        # process in UCX 1.23 (`arbiter.c:36 Assertion
        # 'ucs_arbiter_group_is_empty(group)'`, seen once in these tests).
        # get_new_notifs progresses the UCX workers until they are idle;
        # the notifications it returns at shutdown are dropped.
        self.nixl_wrapper.get_new_notifs()
        self.nixl_wrapper.release_dlist_handle(self._local_dlist)
        self.nixl_wrapper.deregister_memory(self._kv_reg)
        return left


def main(argv: List[str]) -> int:
    if len(argv) < 2:
        print("usage: vllm_decode.py HOST:PORT [seconds]", file=sys.stderr)
        return 2
    address, seconds = argv[1], float(argv[2]) if len(argv) > 2 else 10.0
    worker = NixlConnectorWorker(interval="500ms")
    events = worker.keepalive.events()
    end = time.monotonic() + seconds
    counts: Dict[str, int] = {}
    engine: Optional[nixl_keepalive.Engine] = None
    last_id: Optional[str] = None  # the engine read from last, live or not
    waiting = False
    while time.monotonic() < end:
        while (e := events.get_nowait()) is not None:
            print("event:", e, flush=True)
        try:
            if engine is None or not engine.is_live:
                # KEEPALIVE 7: the given-up reads of the engine read from
                # last are polled to their end (the prefill resumed or
                # died) before its handshake: that engine's release waits
                # for them, and only this thread ends them.
                worker.reclaim_slots()
                held = worker.held_slots(last_id)
                if held:
                    if not waiting:
                        print(f"waiting for {held} given-up read(s) of {last_id} to end before handshaking again",
                              flush=True)
                    waiting = True
                    time.sleep(0.005)
                    continue
                waiting = False
                engine = worker.add_remote_agent(address)
                last_id = engine.id
                print(f"connected to {engine.id} at {address}", flush=True)
            o = worker.read_block(engine.id, 0, int(np.random.randint(engine_blocks(worker, engine))))
            counts[o.result] = counts.get(o.result, 0) + 1
        except (OSError, nixl_keepalive.KeepaliveError, pd.WireError) as e:
            print(f"not reading: {type(e).__name__}: {e}", flush=True)
            engine = None
            time.sleep(0.25)
    print("reads:", counts, flush=True)
    print("stopped:", worker.shutdown(), flush=True)
    return 0


def engine_blocks(worker: NixlConnectorWorker, engine: nixl_keepalive.Engine) -> int:
    return worker._remote[engine.id].reply.blocks


if __name__ == "__main__":
    sys.exit(main(sys.argv))
