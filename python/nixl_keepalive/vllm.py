"""The keepalive service inside vLLM's pull-mode NIXL connector (vLLM 0.33
and 0.34).

Enable it on the decode with one flag (a prefill may run it too; its work
is on the decode side)::

    --kv-transfer-config '{"kv_connector": "KeepaliveNixlConnector",
                           "kv_connector_module_path": "nixl_keepalive.vllm",
                           "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"keepalive": {"interval": "1s"}}}'

or, under the name launchers write (``"kv_connector": "NixlConnector"``),
with ``NIXL_KEEPALIVE_VLLM=1`` in the environment (the plugin in
``nixl_keepalive_plugins``).

:class:`KeepaliveNixlConnector` is vLLM's ``NixlConnector`` (the pull
connector, ``NixlPullConnector``) with its worker replaced by
:class:`KeepaliveNixlConnectorWorker`, which embeds
:class:`nixl_keepalive.Keepalive` where vLLM's decode worker owns its NIXL
agent:

- the agent is made with NIXL's ``NIXL_THREAD_SYNC_RW`` mode (vLLM leaves
  NONE; the service calls the agent from its own threads);
- every remote engine vLLM loads goes through the service's handshake
  protocol (claimed before its metadata is loaded, registered with its
  prepped dlist handles after);
- every READ runs under a read guard with its request's lease, and ends
  with the transfer's raw status (``REMOTE_DISCONNECT`` marks the engine);
  reads that time out (``read_timeout``) or that the service failed
  (stalled or gone engine) are given up: their requests are reported
  failed at once (vLLM's ``kv_load_failure_policy`` ``fail``, its default;
  with ``recompute`` they are reported once the transfer is over, as vLLM
  would reuse their blocks at the retry), while their READs are kept and
  polled to their end (they complete when a frozen prefill resumes, fail
  when it dies) and the engine is not released before; the scheduler side
  (:class:`KeepaliveNixlConnectorScheduler`) keeps a failed request's
  blocks allocated until every worker says its READs are over
  (``docs/design/given-up-transfers.md``);
- an engine the service released is dropped from vLLM's own tables on
  vLLM's thread (each step), without calling NIXL a second time; an engine
  vLLM retires itself (TTL, replaced, invalid, re-registered) is handed to
  the service (``peer_gone``), which releases it once its reads end;
- vLLM's own ``HB:`` lease renewals become the service's leases: the
  service heartbeats every known prefill, idle or busy;
- ``shutdown`` stops the service (draining reads, releasing every engine)
  before vLLM destroys the agent.

Knobs: ``kv_connector_extra_config["keepalive"]`` holds
:class:`nixl_keepalive.Config` keywords (``interval``, ``read_stall``, ...;
the ``NIXL_KEEPALIVE_*`` variables are read under them) and this module's
own ``read_timeout`` (UCX time or seconds; default none, as in vLLM). See
docs/vllm.md.

Tested on vLLM 0.33.x and 0.34.x; on another release every private name
of vLLM's it relies on (:mod:`nixl_keepalive.vllm_hooks`) is checked when
the connector is built: one missing refuses, all present run with a
WARNING.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import nixl_keepalive
from nixl_keepalive import Keepalive, parse_agent_name

from nixl_keepalive import vllm_hooks
from nixl_keepalive.vllm_hooks import TESTED_VLLM

SUPPORTED_VLLM = TESTED_VLLM
"""The older name of :data:`nixl_keepalive.vllm_hooks.TESTED_VLLM`."""

_TESTED_TEXT = ", ".join(f"{s}.x" for s in TESTED_VLLM)


def _vllm_version() -> Optional[str]:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


_untested_warned: Set[str] = set()


def check_vllm_version(version: Optional[str] = None) -> str:
    """Checks the installed vLLM's NIXL connector for every hook this
    module relies on (:mod:`nixl_keepalive.vllm_hooks`): raises
    ``RuntimeError`` naming each one missing or reshaped, with the version
    found and the tested ones. On a version outside the tested series
    (``version``, default the installed one) with every hook in place it
    logs one WARNING naming it. Returns the version."""
    found = _vllm_version() if version is None else version
    if found is None:
        raise RuntimeError(
            f"nixl_keepalive.vllm needs vLLM (tested: {_TESTED_TEXT}); vLLM is not installed"
        )
    wrong = (vllm_hooks.problems("worker", NixlPullConnectorWorker)
             + vllm_hooks.problems("base_worker", _base_worker)
             + vllm_hooks.problems("connector", NixlBaseConnector)
             + vllm_hooks.problems("scheduler", NixlPullConnectorScheduler))
    if wrong:
        raise RuntimeError(
            f"nixl_keepalive.vllm cannot run on vLLM {found}: its NIXL connector lacks what the keepalive "
            f"relies on: {'; '.join(wrong)}. Tested on vLLM {_TESTED_TEXT}; use one of those, or vLLM's own "
            "NixlConnector without the keepalive."
        )
    if not vllm_hooks.tested(found) and found not in _untested_warned:
        _untested_warned.add(found)
        logger.warning(
            "nixl_keepalive.vllm: vLLM %s is not a tested release (tested: %s). Every hook the keepalive "
            "uses is present with the parameters it expects (%d checked), so it runs; what they do may "
            "have changed, which only the tier's tests on that release can tell.",
            found, _TESTED_TEXT, len(vllm_hooks.HOOKS))
    return found


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
        NixlPullConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
except ImportError as _e:  # vLLM missing, or a layout this module does not know
    _found = _vllm_version()
    raise ImportError(
        f"nixl_keepalive.vllm needs vLLM's pull-mode NIXL connector (tested: {_TESTED_TEXT}; "
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl); "
        f"{'vLLM is not installed' if _found is None else 'found vLLM ' + _found}: {_e}"
    ) from _e

logger = logging.getLogger("nixl_keepalive.vllm")

__all__ = [
    "SUPPORTED_VLLM",
    "KeepaliveNixlConnector",
    "KeepaliveNixlConnectorWorker",
    "check_vllm_version",
    "keepalive_knobs",
    "parse_agent_name",
]

from nixl_keepalive.vllm_knobs import (  # noqa: F401 - the connectors' names since before the split
    _CONFIG_KNOBS,
    _KNOBS,
    control_addr_of_rank,
    keepalive_knobs,
)

_is_nixl_agent = nixl_keepalive._is_nixl_agent


# The agent vLLM makes: its config with the RW thread-sync mode. vLLM's
# worker builds `nixl_agent_config(...)` from base_worker's globals; while
# our worker's constructor runs (under this lock) that name returns the
# same config with `sync_mode` set. Nothing of vLLM's is edited.
_agent_config_lock = threading.Lock()


def _rw_sync_mode() -> Any:
    try:
        from nixl._api import nixl_thread_sync_t  # type: ignore
    except ImportError:  # pragma: no cover - vLLM imports the same module
        return None
    return nixl_thread_sync_t.NIXL_THREAD_SYNC_RW


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (``True`` when its
    signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class _RwAgentConfig:
    """Stands for base_worker's ``nixl_agent_config`` during our
    constructor: the same class, with ``sync_mode`` RW unless set."""

    def __init__(self, real: Any, sync_mode: Any) -> None:
        self._real = real
        # A stand-in that takes no sync_mode (vLLM 0.34's unit tests patch
        # nixl_agent_config with one) is called as vLLM calls it; the
        # service then sees the mode it was made with.
        self._sync_mode = sync_mode if _takes(real, "sync_mode") else None
        self.made: List[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_mode is not None and kwargs.get("sync_mode") is None:
            kwargs["sync_mode"] = self._sync_mode
        conf = self._real(*args, **kwargs)
        self.made.append(conf)
        return conf


class _WorkerAgent:
    """The agent a test double stands for, as the service sees it: each
    call goes to the worker's ``nixl_wrapper`` of the moment (vLLM's unit
    tests wrap it in a spy after the worker is built). Only for agents that
    are not NIXL's ``nixl_agent``."""

    __slots__ = ("_worker", "__weakref__")

    def __init__(self, worker: Any) -> None:
        import weakref

        self._worker = weakref.ref(worker)

    def _agent(self) -> Any:
        worker = self._worker()
        if worker is None:
            raise RuntimeError("the vLLM worker of this agent is gone")
        return worker.nixl_wrapper

    def send_notif(self, agent_name: Any, notif_msg: Any) -> Any:
        return self._agent().send_notif(agent_name, notif_msg=notif_msg)

    def release_dlist_handle(self, handle: Any) -> Any:
        return self._agent().release_dlist_handle(handle)

    def remove_remote_agent(self, agent_name: Any) -> Any:
        return self._agent().remove_remote_agent(agent_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent(), name)


@dataclass
class _Tracked:
    """A READ vLLM posted, under its read guard."""

    read: Any
    engine: Any
    req_id: str
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Held:
    """A request with given-up READs still running (its blocks stay
    allocated until every one ended)."""

    given_up: List[Any]
    engine_id: str
    blocks: int = 0
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Fenced:
    """A given-up READ's handle, kept (not released: that does not end the
    transfer) and polled to its end."""

    given_up: Any
    req_id: str


#: How long vLLM's cleanup of an engine with no read in flight waits for
#: the service's release (it takes milliseconds; the bound is for a stuck
#: agent call, after which the release continues in the service).
_RELEASE_WAIT = 5.0

_SUCCESS = nixl_keepalive.SUCCESS
_IN_PROG = getattr(nixl_keepalive, "IN_PROG", 1)
_BACKEND = -3  # nixl_status_t NIXL_ERR_BACKEND, for a test double's "ERR"


class KeepaliveNixlConnectorWorker(NixlPullConnectorWorker):
    """vLLM's pull-mode NIXL connector worker with the keepalive service
    embedded (see the module docs)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_vllm_version()
        config_knobs, own = keepalive_knobs(vllm_config.kv_transfer_config)
        # Refuse bad knobs before anything is made.
        ka_config = nixl_keepalive.Config(**config_knobs)
        self._ka: Optional[Keepalive] = None
        self._ka_read_timeout: Optional[float] = own["read_timeout"]
        self._ka_control = own["control_addr"]
        self._ka_control_token_file = own["control_token_file"]
        self._ka_engines: Dict[str, Any] = {}
        self._ka_reads: Dict[Any, _Tracked] = {}
        # Guards _ka_reads against the handshake thread's
        # _ka_guard_untracked (vLLM's main thread polls the reads).
        self._ka_reads_lock = threading.RLock()
        # Handles whose read guard ended (given up, failed, completed) but
        # that vLLM retains until release_xfer_handle succeeds: never
        # guarded again.
        self._ka_ended: Set[Any] = set()
        self._ka_held: Dict[str, _Held] = {}
        # Given-up READs polled to their end, by handle.
        self._ka_fenced: Dict[Any, _Fenced] = {}
        # Requests whose blocks the scheduler keeps until this worker says
        # their given-up READs are over (in finished_sending).
        self._ka_over_wanted: Set[str] = set()
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        # With "recompute" vLLM frees a failed request's blocks at its retry
        # (no connector call): such requests are reported once their READs
        # are over instead.
        self._ka_report_at_once = policy != "recompute"
        # Engines read from without a registration in the service (vLLM's
        # own), each said once; READs found unguarded after their engine's
        # release (should stay 0).
        self._ka_own_engines: Set[str] = set()
        self._ka_unguarded = 0
        self._ka_leases: Dict[Tuple[str, str], Set[str]] = {}
        self._ka_hb_seen: Dict[Tuple[str, str], float] = {}
        self._ka_local = threading.local()
        self._ka_failures: Dict[int, BaseException] = {}
        self._ka_events = None
        self._ka_closed: Optional[dict] = None
        kv_lease = vllm_config.kv_transfer_config.get_from_extra_config("kv_lease_duration", 30)
        # A heartbeat-only lease (a request waiting in vLLM's scheduler) is
        # dropped when two of vLLM's heartbeat packages went by without it.
        self._ka_hb_stale = 2.0 * max(1, int(kv_lease) // 6) + 1.0

        real_config = _base_worker.nixl_agent_config
        rw_config = _RwAgentConfig(real_config, _rw_sync_mode()) if real_config is not None else None
        with _agent_config_lock:
            if rw_config is not None:
                _base_worker.nixl_agent_config = rw_config
            try:
                super().__init__(vllm_config, engine_id, kv_cache_config)
            finally:
                _base_worker.nixl_agent_config = real_config
        missing = vllm_hooks.problems("worker instance", self)
        if missing:
            self._ka_undo_construction()
            raise RuntimeError(
                f"nixl_keepalive.vllm cannot run on vLLM {_vllm_version()}: its NIXL worker lacks what the "
                f"keepalive relies on: {'; '.join(missing)} (tested on vLLM {_TESTED_TEXT})"
            )

        agent = self.nixl_wrapper
        # The config the agent was made with (the last one vLLM built):
        # the service checks its sync mode and progress thread.
        agent_conf = rw_config.made[-1] if rw_config is not None and rw_config.made else None
        # NIXL's own agent is handed to the service as is (it calls the
        # native agent). A test double (vLLM's unit tests' fake, which they
        # may swap for a spy after construction) is reached through the
        # worker: the service then calls whatever `nixl_wrapper` is.
        service_agent = agent if _is_nixl_agent(agent) else _WorkerAgent(self)
        control = None
        if self._ka_control is not None:
            # One port per rank: a router reaches every rank of the decode.
            control = {"addr": control_addr_of_rank(self._ka_control, int(getattr(self, "tp_rank", 0) or 0))}
            if self._ka_control_token_file is not None:
                control["token_file"] = self._ka_control_token_file
        try:
            self._ka = Keepalive(service_agent, ka_config, agent_config=agent_conf, control=control)
        except Exception as e:
            if _is_nixl_agent(agent) or control is not None:
                self._ka_undo_construction()
                raise
            # A test double of vLLM's own unit tests, which the service
            # cannot run over: vLLM's behaviour, said loudly.
            logger.warning(
                "nixl_keepalive.vllm: the keepalive is OFF for this worker: its agent %r is not "
                "NIXL's nixl_agent and the service refused it (%s: %s)",
                type(agent).__name__, type(e).__name__, e,
            )
            self._ka = None
        if self._ka is not None:
            self._ka_events = self._ka.events()
            logger.info("nixl_keepalive.vllm: keepalive on (%r, read_timeout=%s)", self._ka.config,
                        self._ka_read_timeout)
            if self._ka.control_addr is not None:
                logger.info("nixl_keepalive.vllm: rank %s serves the router's control endpoint on %s "
                            "(POST /fault_tolerance/event, POST /v1/peer_gone, GET /v1/snapshot)",
                            getattr(self, "tp_rank", 0), self._ka.control_addr)

    # -- helpers -----------------------------------------------------------

    def _ka_undo_construction(self) -> None:
        """A construction refused after vLLM's own ran: what vLLM made (its
        agent, its threads) given back before the refusal propagates."""
        self._ka = None
        try:
            NixlPullConnectorWorker.shutdown(self)
        except Exception:  # noqa: BLE001 - the refusal being raised says what matters
            logger.debug("vLLM's shutdown after the refused construction failed", exc_info=True)

    def _ka_on(self) -> bool:
        ka = getattr(self, "_ka", None)
        return ka is not None and getattr(self, "_ka_closed", None) is None

    def keepalive(self) -> Optional[Keepalive]:
        """The service (``None`` when off)."""
        return getattr(self, "_ka", None)

    def held_requests(self) -> Dict[str, Dict[str, Any]]:
        """Requests whose blocks are held because a read of theirs was given
        up and may still run: per request id, its engine, the reasons, the
        destinations so far (``None``: the READ is still running), its
        blocks, and since when (``time.monotonic()``)."""
        out = {}
        for req_id, h in getattr(self, "_ka_held", {}).items():
            out[req_id] = {
                "engine": h.engine_id,
                "why": [g.why for g in h.given_up],
                "destinations": [g.try_destination() for g in h.given_up],
                "blocks": h.blocks,
                "since": h.since,
            }
        return out

    def held_blocks(self) -> int:
        """The KV blocks held by given-up READs still running."""
        return sum(h.blocks for h in getattr(self, "_ka_held", {}).values())

    def _ka_raw_status(self, handle: Any) -> Any:
        """The transfer's raw status (an int), or the exception asking for
        it raised; for a test double, its check_xfer_state mapped."""
        agent = self.nixl_wrapper
        if _is_nixl_agent(agent):
            try:
                return nixl_keepalive.xfer_status(agent, handle)
            except Exception as e:  # noqa: BLE001 - the status of the call
                return e
        try:
            state = agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001
            return e
        return {"DONE": _SUCCESS, "PROC": _IN_PROG}.get(state, _BACKEND)

    def _ka_add_lease(self, engine: Any, remote_req: str, reason: str) -> None:
        key = (engine.id, remote_req)
        reasons = self._ka_leases.setdefault(key, set())
        if not reasons:
            try:
                self._ka.add_leases(engine, [remote_req])
            except nixl_keepalive.KeepaliveError as e:
                logger.debug("lease %s on %s not added: %s", remote_req, engine.id, e)
        reasons.add(reason)

    def _ka_drop_lease(self, engine_id: str, remote_req: str, reason: str) -> None:
        key = (engine_id, remote_req)
        reasons = self._ka_leases.get(key)
        if reasons is None:
            return
        reasons.discard(reason)
        if not reasons:
            del self._ka_leases[key]
            self._ka_hb_seen.pop(key, None)
            engine = self._ka_engines.get(engine_id)
            if engine is not None and self._ka_on():
                try:
                    self._ka.remove_leases(engine, [remote_req])
                except nixl_keepalive.KeepaliveError:
                    pass

    def _ka_forget_tables(self, engine_id: str, log_eviction: bool = False) -> None:
        """Drops ``engine_id`` from vLLM's own tables (remote agents, dlist
        handles, engine-id maps, topology, clock offset, TTL stamps) with
        vLLM's own bookkeeping, and no NIXL call: the service released (or
        will release) its NIXL state."""
        self.dst_xfer_side_handles.pop(engine_id, None)
        with self._handshake_lock:
            self._remote_agents[engine_id] = {}
        NixlPullConnectorWorker._cleanup_remote_engine(self, engine_id, log_eviction=log_eviction)
        for key in [k for k in self._ka_leases if k[0] == engine_id]:
            self._ka_leases.pop(key, None)
            self._ka_hb_seen.pop(key, None)

    def _ka_guard_untracked(self) -> None:
        """Every transfer vLLM holds in flight (``_recving_transfers``) from
        an engine the service holds runs under a read guard, so the service
        never releases an engine under a READ vLLM still polls. Those posted
        by our ``_read_blocks`` have one already; this covers any other
        (a subclass's own posting, vLLM's unit tests' injected handles).
        Called before anything that may release an engine (a registration
        that replaces one) and each step."""
        if not self._ka_on():
            return
        with self._ka_reads_lock:
            if self._ka_ended:
                present = {h for hs in list(self._recving_transfers.values()) for h in list(hs)}
                self._ka_ended &= present
            for req_id, handles in list(self._recving_transfers.items()):
                remote = getattr(self._recving_metadata.get(req_id), "remote", None)
                engine = self._ka_engines.get(remote.engine_id) if remote is not None else None
                if engine is None:
                    continue
                for handle in list(handles):
                    if handle in self._ka_reads or handle in self._ka_ended:
                        continue
                    try:
                        # Already posted: adopted even on a marked engine,
                        # whose release then waits for it as for any read.
                        read = engine.adopt_posted_read()
                    except nixl_keepalive.ReadRefused as refused:
                        # Released before this pass saw the READ (it was
                        # posted after the last pass, by code that bypassed
                        # our _read_blocks): nothing can hold that release
                        # any more. Said loudly; vLLM polls it as it does.
                        self._ka_ended.add(handle)
                        self._ka_unguarded += 1
                        logger.error(
                            "nixl_keepalive.vllm: request %s's READ from engine %s was posted without a read guard "
                            "and found after the engine was %s: its transfer ran on released state (posted by "
                            "code other than this connector's _read_blocks)", req_id, engine.id, refused.state)
                        continue
                    self._ka_reads[handle] = _Tracked(read, engine, req_id)

    def _ka_process_releases(self) -> None:
        """On vLLM's thread, each step: the service's events logged, and
        every registration it released dropped from vLLM's tables."""
        if getattr(self, "_ka", None) is None:
            return
        events = self._ka_events
        while events is not None:
            try:
                e = events.get_nowait()
            except nixl_keepalive.ServiceStopped:
                break
            if e is None:
                break
            kind = e.get("kind")
            level = logging.INFO if kind in ("registered", "released", "replaced", "retiring") else logging.WARNING
            logger.log(level, "nixl_keepalive: %s", e)
        with self._handshake_lock:
            pending = set(self._handshake_futures)
            released = [
                (eid, eng) for eid, eng in self._ka_engines.items() if eng.state == "released" and eid not in pending
            ]
            for eid, _ in released:
                del self._ka_engines[eid]
        for eid, eng in released:
            # "released" is set as the release call starts: vLLM's tables go
            # once the agent's NIXL state is gone (milliseconds).
            if not eng.wait_released(_RELEASE_WAIT):
                logger.warning("nixl_keepalive.vllm: engine %s's release did not return within %.1f s",
                               eid, _RELEASE_WAIT)
            if eid in self._remote_agents:
                self._ka_forget_tables(eid)
                logger.info("nixl_keepalive.vllm: engine %s released by the keepalive; dropped from vLLM's tables", eid)

    # -- the agent's remote engines ------------------------------------------

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, remote_tp_size: int = 1,
                         remote_dcp_size: int = 1) -> str:
        collecting = getattr(getattr(self, "_ka_local", None), "collect", None)
        if collecting is not None:
            name = parse_agent_name(nixl_agent_meta.agent_metadata)
            if name is not None:
                # Inside our handshake: the load waits for the claim.
                collecting.append((nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size, name))
                return name
        return super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    def _nixl_handshake(self, host: str, port: int, remote_tp_size: int, expected_engine_id: str,
                        remote_dcp_size: int = 1, remote_pp_size: int = 1,
                        notif_agents_only: bool = False) -> Tuple[Dict[Tuple[int, int], str], float]:
        if not self._ka_on() or notif_agents_only:
            return super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id, remote_dcp_size,
                                           remote_pp_size, notif_agents_only)
        address = f"{host}:{port}"
        with self._ka.handshake(address) as h:
            collected: List[tuple] = []
            self._ka_local.collect = collected
            try:
                # vLLM's side channel and checks; add_remote_agent only
                # records what to load.
                names, offset = super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id,
                                                       remote_dcp_size, remote_pp_size, notif_agents_only)
            finally:
                self._ka_local.collect = None
            if not collected:
                return names, offset  # nothing reached add_remote_agent (a test's mock)
            engine_id = collected[0][0].engine_id
            agents = [c[4] for c in collected]
            self._ka_guard_untracked()  # ready_to_load may replace the engine last at this address
            current = h.ready_to_load(engine_id, agents)
            if current is not None:
                # This incarnation is registered: vLLM's tables must hold it.
                with self._handshake_lock:
                    self._ka_engines[engine_id] = current
                return names, offset
            loaded_ranks: List[int] = []
            try:
                for meta, rank, tp_size, dcp_size, name in collected:
                    got = nixl_keepalive.load_remote_agent(
                        self.nixl_wrapper,
                        lambda: NixlPullConnectorWorker.add_remote_agent(self, meta, rank, tp_size, dcp_size))
                    got = got.decode() if isinstance(got, bytes) else got
                    loaded_ranks.append(rank)
                    if got != name:
                        raise RuntimeError(
                            f"NIXL loaded agent {got!r} from the metadata of engine {engine_id} rank {rank}, "
                            f"whose metadata names {name!r}"
                        )
                handles = [self.dst_xfer_side_handles[engine_id][c[1]] for c in collected]
            except BaseException:
                self._ka_undo_load(h, engine_id, agents, loaded_ranks)
                raise
            try:
                engine = h.register(handles)
            except nixl_keepalive.RegistrationRefused as refused:
                if refused.registration is not None:
                    self._ka.give_back(refused.registration)
                if engine_id in self.dst_xfer_side_handles or engine_id in self.kv_caches_base_addr:
                    self.dst_xfer_side_handles.pop(engine_id, None)
                    with self._handshake_lock:
                        self._remote_agents.setdefault(engine_id, {})
                    self._ka_forget_tables(engine_id)
                raise
            with self._handshake_lock:
                self._ka_engines[engine_id] = engine
        return names, offset

    def _ka_undo_load(self, h: Any, engine_id: str, agents: List[str], loaded_ranks: List[int]) -> None:
        """A load that failed half-way: what it loaded given back (dlist
        handles released, agents unloaded with their endpoints closed),
        vLLM's tables of the engine dropped."""
        for handle in self.dst_xfer_side_handles.pop(engine_id, {}).values():
            try:
                self.nixl_wrapper.release_dlist_handle(handle)
            except Exception:  # noqa: BLE001
                logger.warning("release_dlist_handle failed undoing engine %s's load", engine_id, exc_info=True)
        for name in agents[: len(loaded_ranks)]:
            try:
                if _is_nixl_agent(self.nixl_wrapper):
                    nixl_keepalive.remove_remote_agent(self.nixl_wrapper, name)
                else:
                    self.nixl_wrapper.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                logger.warning("unloading agent %s of engine %s failed", name, engine_id, exc_info=True)
        with self._handshake_lock:
            self._remote_agents.setdefault(engine_id, {})
        self._ka_forget_tables(engine_id)

    def _track_remote_engine_replacement(self, engine_id: str, host: str, port: int) -> None:
        super()._track_remote_engine_replacement(engine_id, host, port)
        if not self._ka_on() or engine_id in self._ka_engines:
            return
        # This registration may replace the engine last at this address:
        # its reads in flight must all be the service's first.
        self._ka_guard_untracked()
        # Loaded without our handshake (a subclass's own _nixl_handshake):
        # registered now, as loaded.
        agents = list(self._remote_agents.get(engine_id, {}).values())
        handles = list(self.dst_xfer_side_handles.get(engine_id, {}).values())
        if not agents or not handles:
            return
        try:
            engine = self._ka.register(engine_id, f"{host}:{port}", agents, handles)
        except (nixl_keepalive.RegistrationRefused, nixl_keepalive.KeepaliveError, ValueError) as e:
            logger.warning("nixl_keepalive.vllm: engine %s stays vLLM's own (not registered: %s)", engine_id, e)
            return
        self._ka_engines[engine_id] = engine

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        engine = getattr(self, "_ka_engines", {}).pop(engine_id, None) if self._ka_on() else None
        if engine is None:
            return super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        # vLLM retires it (TTL, replaced, invalid, re-registered): the
        # service owns its NIXL state and releases it once its reads end.
        if engine.state != "released":
            try:
                self._ka.peer_gone(engine, mode="drain")
            except nixl_keepalive.KeepaliveError as e:
                logger.debug("peer_gone(%s): %s", engine_id, e)
        self._ka_forget_tables(engine_id, log_eviction=log_eviction)
        # vLLM's cleanup is synchronous: its NIXL state is gone when the
        # call returns. With no read of the engine in flight the service's
        # release is immediate (milliseconds: its thread calls the agent,
        # taking the GIL this wait gives up; no vLLM lock is held here), so
        # it is awaited, bounded (state "released" comes before the release
        # call has returned; wait_released waits for the call). With reads
        # in flight it stays the service's: released once they end, never
        # under them.
        if engine.reads_in_flight == 0:
            if not engine.wait_released(_RELEASE_WAIT):
                logger.warning(
                    "nixl_keepalive.vllm: engine %s not released within %.1f s of vLLM's cleanup (state %s); "
                    "the keepalive releases it once it can", engine_id, _RELEASE_WAIT, engine.state)

    # -- heartbeats ------------------------------------------------------------

    def _send_heartbeats(self, metadata: Any) -> None:
        if not self._ka_on():
            return super()._send_heartbeats(metadata)
        now = time.monotonic()
        snapshot = getattr(metadata, "heartbeat_by_engine", None) or {}
        for engine_id, hb_info in snapshot.items():
            if self._ensure_handshake(engine_id, hb_info.host, hb_info.port, hb_info.tp_size,
                                      hb_info.dcp_size, hb_info.pp_size,
                                      self._hb_handshake_notif_only and hb_info.pp_size > 1) is not None:
                continue  # handshake still pending
            self._engine_last_active[engine_id] = time.perf_counter()
            engine = self._ka_engines.get(engine_id)
            if engine is None:
                # Not the service's (loaded outside it): vLLM's own HB.
                msg = ("HB:" + ",".join(hb_info.req_ids)).encode()
                for agent_name in self._remote_agents.get(engine_id, {}).values():
                    try:
                        self.nixl_wrapper.send_notif(agent_name, notif_msg=msg)
                    except Exception:  # noqa: BLE001 - vLLM logs these at debug too
                        logger.debug("heartbeat to %s failed", engine_id, exc_info=True)
                continue
            listed = set(hb_info.req_ids)
            for req in listed:
                self._ka_hb_seen[(engine_id, req)] = now
                self._ka_add_lease(engine, req, "hb")
            for key in [k for k in self._ka_hb_seen if k[0] == engine_id and k[1] not in listed]:
                self._ka_drop_lease(engine_id, key[1], "hb")
        # Waiting requests vLLM stopped listing (finished, aborted).
        stale = [k for k, seen in self._ka_hb_seen.items()
                 if k[0] not in snapshot and now - seen > self._ka_hb_stale]
        for engine_id, req in stale:
            self._ka_drop_lease(engine_id, req, "hb")

    # -- reads -----------------------------------------------------------------

    def _log_failure(self, failure_type: str, req_id: Optional[str], msg: str = "",
                     error: Optional[BaseException] = None, meta: Any = None, **extra_context: Any) -> None:
        if error is not None and getattr(self, "_ka_failures", None) is not None:
            self._ka_failures[threading.get_ident()] = error
        return super()._log_failure(failure_type, req_id, msg, error, meta, **extra_context)

    def start_load_kv(self, metadata: Any) -> None:
        wanted = getattr(metadata, "ka_free_when_over", None)
        if wanted and hasattr(self, "_ka_over_wanted"):  # built without our __init__ in vLLM's unit tests
            self._ka_over_wanted |= set(wanted)
        self._ka_guard_untracked()
        self._ka_process_releases()
        return super().start_load_kv(metadata)

    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, remote_request_id: str,
                     local_xfer_side_handle: Any, local_dram_handle: Any, remote_xfer_side_handle: Any,
                     expected_consumers: int, awaiting_kvs: bool) -> bool:
        args = dict(read_spec=read_spec, dst_engine_id=dst_engine_id, request_id=request_id,
                    remote_request_id=remote_request_id, local_xfer_side_handle=local_xfer_side_handle,
                    local_dram_handle=local_dram_handle, remote_xfer_side_handle=remote_xfer_side_handle,
                    expected_consumers=expected_consumers, awaiting_kvs=awaiting_kvs)
        engine = self._ka_engines.get(dst_engine_id) if self._ka_on() else None
        notify_only = not any(len(group) > 0 for group in read_spec.local_block_ids)
        if engine is None and self._ka_on() and not notify_only:
            # Not in this worker's table: the service may still hold a
            # registration of it (then the READ is guarded, or refused on a
            # marked engine); otherwise it is vLLM's own engine (loaded
            # outside the service, or refused by it), released by vLLM's
            # own rules, which wait for its READs.
            engine = self._ka.engine(dst_engine_id)
            if engine is None and dst_engine_id not in self._ka_own_engines:
                self._ka_own_engines.add(dst_engine_id)
                logger.warning(
                    "nixl_keepalive.vllm: READs from engine %s are vLLM's own: the keepalive holds no "
                    "registration of it (it was loaded outside the service's handshake or refused by it), so "
                    "they carry no read guard and vLLM's own cleanup releases it", dst_engine_id)
        if engine is None or notify_only:
            return super()._read_blocks(**args)
        try:
            read = engine.read()
        except nixl_keepalive.ReadRefused as refused:
            # The engine is dead, stalled, replaced or gone: fail the
            # request now (vLLM's load-failure policy decides), no READ.
            self._log_failure("transfer_refused_by_keepalive", request_id,
                              msg=f"engine {dst_engine_id} is {refused.state}", dst_engine_id=dst_engine_id)
            self.xfer_stats.record_failed_transfer()
            self._handle_failed_transfer(request_id, None, self._recv_failures, record_failed_transfer=False)
            return False
        self._ka_add_lease(engine, remote_request_id, "read:" + request_id)
        # Under the lock: the handshake thread's _ka_guard_untracked must
        # not see this handle posted before its guard is recorded.
        with self._ka_reads_lock:
            before = list(self._recving_transfers.get(request_id, ()))
            self._ka_failures.pop(threading.get_ident(), None)
            try:
                ok = super()._read_blocks(**args)
            except BaseException:
                read.close()
                raise
            new = [h for h in self._recving_transfers.get(request_id, ()) if not any(h is b for b in before)]
            error = self._ka_failures.pop(threading.get_ident(), None)
            if not new:
                # No transfer was left posted: the read ends with what NIXL
                # raised (REMOTE_DISCONNECT marks the engine).
                nixl_keepalive._end_transfer_guard(read, error)
                if not ok:
                    self._ka_drop_lease(dst_engine_id, remote_request_id, "read:" + request_id)
                return ok
            self._ka_reads[new[0]] = _Tracked(read, engine, request_id)
            for extra in new[1:]:  # a split DRAM/device read: one guard each
                try:
                    self._ka_reads[extra] = _Tracked(engine.read(), engine, request_id)
                except nixl_keepalive.ReadRefused:
                    pass  # polled as vLLM does
            return ok

    def _pop_done_transfers(self, transfers: Dict[str, List[Any]]) -> Tuple[Set[str], Set[str]]:
        if not self._ka_on() and not getattr(self, "_ka_reads", None):
            return super()._pop_done_transfers(transfers)
        with self._ka_reads_lock:
            return self._ka_pop_done_transfers(transfers)

    def _ka_pop_done_transfers(self, transfers: Dict[str, List[Any]]) -> Tuple[Set[str], Set[str]]:
        done: Set[str] = set()
        failed: Set[str] = set()
        now = time.monotonic()
        untracked: Dict[str, List[Any]] = {}
        tracked_left: Dict[str, List[Any]] = {}
        for req_id, handles in list(transfers.items()):
            left: List[Any] = []
            for handle in handles:
                t = self._ka_reads.get(handle)
                if t is None:
                    untracked.setdefault(req_id, []).append(handle)
                    continue
                status = self._ka_raw_status(handle)
                if isinstance(status, int) and status == _IN_PROG:
                    why = None
                    if t.read.failed:
                        why = nixl_keepalive.GiveUp.CANCELLED
                    elif self._ka_read_timeout is not None and now - t.started >= self._ka_read_timeout:
                        why = nixl_keepalive.GiveUp.TIMED_OUT
                    if why is None:
                        left.append(handle)
                        continue
                    self._log_failure("transfer_given_up", req_id,
                                      msg=f"read given up ({why}) after {now - t.started:.1f} s; the request "
                                          "fails, its blocks are held until the READ ends",
                                      dst_engine_id=t.engine.id)
                    del self._ka_reads[handle]
                    meta = self._recving_metadata.get(req_id)
                    blocks = sum(len(g) for g in meta.local_block_ids) if meta is not None else 0
                    # Kept, not released: releasing does not end a READ in
                    # progress (its bytes still land when the prefill
                    # resumes), it only hides its end. Polled to its end.
                    given_up = t.read.give_up(why, blocks)
                    self._ka_fenced[handle] = _Fenced(given_up, req_id)
                    self._ka_drop_read_leases(req_id)  # P may free them: we will not read them
                    self.xfer_stats.record_failed_transfer()
                    held = self._ka_held.get(req_id)
                    if held is None:
                        self._ka_held[req_id] = _Held([given_up], t.engine.id, blocks)
                    else:
                        held.given_up.append(given_up)
                        held.blocks = max(held.blocks, blocks)
                    failed.add(req_id)
                    continue
                del self._ka_reads[handle]
                if isinstance(status, int) and status == _SUCCESS:
                    t.read.finish(_SUCCESS)
                    try:
                        res = self.nixl_wrapper.get_xfer_telemetry(handle)
                        self.xfer_stats.record_transfer(res)
                        self.nixl_wrapper.release_xfer_handle(handle)
                    except Exception as e:  # noqa: BLE001 - as vLLM handles it
                        self._log_failure("transfer_exception", req_id, error=e)
                        if not self._handle_failed_transfer(req_id, handle, failed):
                            left.append(handle)
                            self._ka_ended.add(handle)
                    continue
                # Failed: the raw status, never check_xfer_state's "ERR"; an
                # exception that is not NIXL's ends the read without one.
                nixl_keepalive._end_transfer_guard(t.read, status)
                name = nixl_keepalive.status_name(status) if isinstance(status, int) else type(status).__name__
                self._log_failure("transfer_failed", req_id, xfer_state=name,
                                  error=status if isinstance(status, BaseException) else None)
                if not self._handle_failed_transfer(req_id, handle, failed):
                    left.append(handle)
                    self._ka_ended.add(handle)
            if left:
                tracked_left[req_id] = left
        if untracked:
            u_done, u_failed = super()._pop_done_transfers(untracked)
            failed |= u_failed
        self._ka_poll_fenced()
        for req_id in list(transfers):
            remaining = tracked_left.get(req_id, []) + untracked.get(req_id, [])
            if remaining:
                transfers[req_id] = remaining
                continue
            if req_id in self._ka_held and not self._ka_report_at_once:
                # "recompute": vLLM would hand the blocks to the retry at
                # once: reported when the READs are over.
                transfers[req_id] = []
                failed.add(req_id)
                continue
            if req_id in self._ka_held:
                failed.add(req_id)
            done.add(req_id)
            del transfers[req_id]
        return done, failed

    def _ka_poll_fenced(self) -> None:
        """Polls the given-up READs: one that stopped being in progress
        ended (the prefill resumed or died): the service hears it (the
        engine may be released now), its handle is released, and a request
        whose READs all ended has its blocks back."""
        for handle, f in list(getattr(self, "_ka_fenced", {}).items()):
            status = self._ka_raw_status(handle)
            if isinstance(status, int) and status == _IN_PROG:
                continue
            del self._ka_fenced[handle]
            f.given_up.ended(status if not isinstance(status, BaseException) else _BACKEND)
            try:
                self.nixl_wrapper.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an ended transfer's handle; logged
                logger.warning("release_xfer_handle of an ended given-up READ failed", exc_info=True)
            if not any(o.req_id == f.req_id for o in self._ka_fenced.values()):
                held = self._ka_held.pop(f.req_id, None)
                if held is not None:
                    logger.info("nixl_keepalive.vllm: request %s's given-up READs from engine %s ended after "
                                "%.1f s: its %d block(s) are free again", f.req_id, held.engine_id,
                                time.monotonic() - held.since, held.blocks)
                if not self._ka_report_at_once:
                    # Held back from the scheduler until now ("recompute").
                    transfers = self._recving_transfers
                    if f.req_id in transfers and not transfers[f.req_id]:
                        del transfers[f.req_id]
                        self._recv_failures.add(f.req_id)

    def _ka_over(self, results: Any) -> Any:
        """Adds to ``finished_sending`` every request the scheduler keeps
        the blocks of (``ka_free_when_over``) whose given-up READs on this
        worker are over: the scheduler frees its blocks once every worker
        said so."""
        over = {r for r in getattr(self, "_ka_over_wanted", ()) if r not in self._ka_held}
        if over:
            self._ka_over_wanted -= over
            sending = set(results.finished_sending or ())
            sending |= over
            results.finished_sending = sending
        return results

    def _ka_drop_read_leases(self, req_id: str) -> None:
        for key in [k for k, r in self._ka_leases.items() if ("read:" + req_id) in r]:
            self._ka_drop_lease(key[0], key[1], "read:" + req_id)

    def get_transfer_results(self) -> Any:
        if not self._ka_on():
            return super().get_transfer_results()
        self._ka_guard_untracked()
        self._ka_process_releases()
        results = super().get_transfer_results()
        for req_id in set(results.finished_recving or ()) | set(getattr(results, "failed_recving", ()) or ()):
            self._ka_drop_read_leases(req_id)
        return self._ka_over(results)

    # -- stopping --------------------------------------------------------------

    def shutdown(self) -> None:
        ka = getattr(self, "_ka", None)
        if ka is None or getattr(self, "_ka_closed", None) is not None or not hasattr(
                self, "_handshake_initiation_executor"):
            return super().shutdown()
        self._handshake_initiation_executor.shutdown(wait=False)
        # The reads in flight are abandoned: given up as cancelled (not
        # completions), their handles released (NIXL tries to cancel).
        for req_id, handles in self._recving_transfers.items():
            for handle in handles:
                t = self._ka_reads.pop(handle, None)
                try:
                    self.nixl_wrapper.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001
                    logger.warning("release_xfer_handle failed at shutdown", exc_info=True)
                if t is not None:
                    t.read.give_up(nixl_keepalive.GiveUp.CANCELLED).abandon()
        self._recving_transfers.clear()
        for t in self._ka_reads.values():
            t.read.give_up(nixl_keepalive.GiveUp.CANCELLED).abandon()
        self._ka_reads.clear()
        # Given-up READs still running: no longer watched (the release
        # decides their blocks; vLLM frees the KV cache with the process).
        for handle, f in self._ka_fenced.items():
            f.given_up.abandon()
            try:
                self.nixl_wrapper.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001
                logger.warning("release_xfer_handle failed at shutdown", exc_info=True)
        self._ka_fenced.clear()
        # The service first: it drains and releases every engine it holds,
        # while the agent is whole.
        left = ka.close()
        self._ka_closed = left
        for registration in left.get("unreleased", []):
            try:
                ka.give_back(registration)
            except Exception:  # noqa: BLE001
                logger.warning("give_back at shutdown failed", exc_info=True)
        try:
            # A release's endpoint closes finish in UCX's next progress.
            self.nixl_wrapper.get_new_notifs()
        except Exception:  # noqa: BLE001
            pass
        for eid in list(self._ka_engines):
            self._ka_engines.pop(eid, None)
            if eid in self._remote_agents:
                self._ka_forget_tables(eid)
        # vLLM's own: local handles, engines not the service's, memory.
        super().shutdown()


class KeepaliveNixlConnectorScheduler(NixlPullConnectorScheduler):
    """vLLM's pull-mode scheduler side, keeping a request's KV blocks
    allocated while a READ into them that the worker gave up may still run.

    A given-up READ fails its request at once (the worker reports it in
    ``failed_recving``), and vLLM then frees the request's blocks in the
    same step (the ``finished_recving`` of a finished request). Here that
    free is withheld for every failed load of a request that is already
    finished (failed by vLLM's ``fail`` policy, or aborted while loading):
    the request id is announced to the workers (``ka_free_when_over`` in the
    step's metadata), each reports it in ``finished_sending`` once none of
    its given-up READs into those blocks is running (at once when it had
    none), and when every worker has said so (vLLM's own aggregation of
    ``finished_sending``) the id is handed back to vLLM as
    ``finished_recving``, which frees the blocks as it would have. A failed
    load costs one step more; a READ into a frozen prefill keeps its blocks
    until the prefill resumes or dies."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Loads started (blocks allocated for a remote prefill), not ended.
        self._ka_loading: Set[str] = set()
        # Of those, the requests vLLM already finished (error or abort).
        self._ka_finished: Set[str] = set()
        # Failed loads whose free is withheld until the workers say over.
        self._ka_withheld: Set[str] = set()
        # Withheld ids not yet announced to the workers.
        self._ka_announce: Set[str] = set()

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and num_external_tokens > 0:
            self._ka_loading.add(request.request_id)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        if request.request_id in self._ka_loading:
            self._ka_finished.add(request.request_id)
        return super().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        recving = connector_output.finished_recving
        for req_id in list(recving or ()):
            if req_id not in self._ka_loading:
                continue
            if req_id in failed and req_id in self._ka_finished:
                # vLLM would free the blocks now: withheld until over.
                recving.discard(req_id)
                self._ka_withheld.add(req_id)
                self._ka_announce.add(req_id)
                continue
            self._ka_loading.discard(req_id)
            self._ka_finished.discard(req_id)
        sending = connector_output.finished_sending
        over = {r for r in (sending or ()) if r in self._ka_withheld}
        if over:
            sending.difference_update(over)
            self._ka_withheld -= over
            self._ka_loading -= over
            self._ka_finished -= over
            if connector_output.finished_recving is None:
                connector_output.finished_recving = set()
            connector_output.finished_recving.update(over)
            logger.info("nixl_keepalive.vllm: the given-up READs of %d failed request(s) are over: their "
                        "blocks are freed", len(over))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._ka_announce:
            meta.ka_free_when_over = self._ka_announce
            self._ka_announce = set()
        return meta

    def withheld_requests(self) -> Set[str]:
        """Failed requests whose blocks are kept until their given-up READs
        are over."""
        return set(self._ka_withheld)


class KeepaliveNixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull mode) with the keepalive service on
    its worker side. Load it by configuration:
    ``{"kv_connector": "KeepaliveNixlConnector",
    "kv_connector_module_path": "nixl_keepalive.vllm", ...}``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_vllm_version()
        # NixlPullConnector's own constructor, with our worker.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KeepaliveNixlConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KeepaliveNixlConnectorWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"KeepaliveNixlConnector: unsupported KVConnectorRole {role!r} (SCHEDULER or WORKER)")


def __getattr__(name: str) -> Any:
    # Push mode's connector is in nixl_keepalive.vllm_push; it is named here
    # too, so one module path ("kv_connector_module_path":
    # "nixl_keepalive.vllm") loads either mode. Imported on first use: the
    # pull connector does not pay for vLLM's push worker.
    if name in ("KeepaliveNixlPushConnector", "KeepaliveNixlPushConnectorWorker"):
        from nixl_keepalive import vllm_push

        return getattr(vllm_push, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
