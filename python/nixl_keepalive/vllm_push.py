"""The keepalive service inside vLLM's push-mode NIXL connector (vLLM 0.33
and 0.34), on the prefill side.

In push mode (``NixlPushConnector``, vLLM's ``push_worker.py``) the decode
sends its block ids to the prefill in a ``PUSH_REG`` notification and the
prefill WRITEs the KV cache into the decode's memory from a writer thread
(``nixl-push-writer``). So the prefill is the side that loads every
decode's agent metadata and unpacks its remote keys: a decode that dies or
restarts leaves its memory mapped in every prefill that wrote to it. vLLM
releases such a decode only at TTL eviction (an hour by default) or at
shutdown; its replaced-peer cleanup is pull-only. Enable the keepalive on
the prefill with one flag::

    --kv-transfer-config '{"kv_connector": "KeepaliveNixlPushConnector",
                           "kv_connector_module_path": "nixl_keepalive.vllm",
                           "kv_role": "kv_producer"}'

or, under vLLM's own name (``"kv_connector": "NixlPushConnector"``, or
``"NixlConnector"`` with ``"transfer_mode": "push"`` on vLLM 0.34), with
``NIXL_KEEPALIVE_VLLM=1`` in the environment (the plugin in
``nixl_keepalive_plugins``).

:class:`KeepaliveNixlPushConnectorWorker` is vLLM's push worker with
:class:`nixl_keepalive.Keepalive` embedded where it owns its NIXL agent:

- the agent is made with NIXL's ``NIXL_THREAD_SYNC_RW`` mode (the service
  calls it from its own threads, beside vLLM's writer thread);
- every decode vLLM loads for writing (``_nixl_handshake`` of the prefill,
  on vLLM's handshake executor) goes through the service's handshake
  protocol: claimed before its metadata is loaded, registered with its
  prepped dlist handles after. The decode's address is its own word (it
  came in its ``PUSH_REG``), so the handshake is a declared one, as in
  :mod:`nixl_keepalive.sglang`: a live decode is never replaced on another
  decode's word; the holder is heartbeated and waited for (bounded);
- every WRITE vLLM posts (``_xfer_blocks``, on the writer thread) runs under
  the decode's write guard, opened before NIXL is called and ended with
  the transfer's raw status when vLLM polls it (``_pop_done_transfers``);
  ``REMOTE_DISCONNECT`` marks the decode. A WRITE to a decode that is not
  live, or that the service does not hold, is refused before NIXL is called
  and its request fails as a failed WRITE submission does in vLLM (its
  blocks go back at lease expiry);
- a decode the service released (dead, replaced, retired) is dropped from
  vLLM's tables on vLLM's main thread each step, without calling NIXL a
  second time, and the registrations it sent that are still unmatched are
  handed to the writer's own eviction inbox; a decode vLLM retires itself
  (TTL) is handed to the service (``peer_gone``), which releases it once
  its writes end;
- the service heartbeats every decode it holds, idle or busy (``HB:``
  notifications, which vLLM's push decode reads and ignores: no request of
  the prefill's is named in them);
- ``shutdown`` stops the writer thread, then the service, before vLLM
  destroys the agent.

The decode side needs nothing: vLLM's push decode drains every NIXL
notification on its writer thread (``get_new_notifs``) and its main thread
ignores ``HB:`` ids it does not hold, so the prefill's heartbeats do not
pile up. A decode may run this class too: it then behaves as vLLM's (the
decode loads its prefills' agents notification-only, which the keepalive
leaves to vLLM).

Knobs: ``kv_connector_extra_config["keepalive"]`` holds
:class:`nixl_keepalive.Config` keywords (``interval``, ``read_stall``, ...;
``read_stall`` is the stall bound of WRITEs here) and ``control_addr`` /
``control_token_file``, as for the pull connector; ``read_timeout`` is a
pull-mode knob and is refused. See docs/vllm.md, "Push mode".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import nixl_keepalive
from nixl_keepalive import Keepalive, parse_agent_name
from nixl_keepalive import vllm as _pull
from nixl_keepalive import vllm_hooks

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
        NixlPushConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
        NixlPushConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )
except ImportError as _e:  # vLLM missing, or a layout this module does not know
    _found = _pull._vllm_version()
    raise ImportError(
        f"nixl_keepalive.vllm_push needs vLLM's push-mode NIXL connector (tested: {_pull._TESTED_TEXT}; "
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker); "
        f"{'vLLM is not installed' if _found is None else 'found vLLM ' + _found}: {_e}"
    ) from _e

logger = logging.getLogger("nixl_keepalive.vllm_push")

__all__ = [
    "KeepaliveNixlPushConnector",
    "KeepaliveNixlPushConnectorWorker",
    "check_push_hooks",
]


def check_push_hooks(version: Optional[str] = None) -> str:
    """:func:`nixl_keepalive.vllm.check_vllm_version` plus the push worker's
    own hooks (``vllm_hooks``, kind ``push_worker``): raises
    ``RuntimeError`` naming each one missing or reshaped. Returns the
    version."""
    found = _pull.check_vllm_version(version)
    wrong = vllm_hooks.problems("push_worker", NixlPushConnectorWorker)
    if wrong:
        raise RuntimeError(
            f"nixl_keepalive.vllm_push cannot run on vLLM {found}: its push-mode NIXL worker lacks what the "
            f"keepalive relies on: {'; '.join(wrong)}. Tested on vLLM {_pull._TESTED_TEXT}; use one of those, or "
            "vLLM's own NixlPushConnector without the keepalive."
        )
    return found


@dataclass
class _Write:
    """A WRITE vLLM posted, under its write guard."""

    guard: Any
    engine: Any
    req_id: str
    started: float = field(default_factory=time.monotonic)


# How long a registration declaring a live decode's address waits for that
# decode's fate: the service heartbeats the holder at once (under its rate
# cap); a decode that is gone answers REMOTE_DISCONNECT within a round trip
# and is released. Two rate periods, at least 1 s, at most 5 s (vLLM's
# handshake executor, which serves every handshake of this worker, waits
# this long only when a live decode holds the declared address).
_DECLARED_WAIT_MIN_S, _DECLARED_WAIT_MAX_S = 1.0, 5.0
# How long a live decode that outlived a wait is refused at once.
_DECLARED_REWAIT_S = 30.0


def _declared_wait(config: Any) -> float:
    return min(_DECLARED_WAIT_MAX_S, max(_DECLARED_WAIT_MIN_S, 2.0 * config.as_dict()["rate_period"]))


def _peer_address(host: str, port: int) -> str:
    host = str(host).strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class KeepaliveNixlPushConnectorWorker(NixlPushConnectorWorker):
    """vLLM's push-mode NIXL connector worker with the keepalive service
    embedded on the prefill side (see the module docs)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_push_hooks()
        config_knobs, own = _pull.keepalive_knobs(vllm_config.kv_transfer_config)
        if own["read_timeout"] is not None:
            raise ValueError(
                "keepalive knob read_timeout is not accepted in push mode (a push prefill posts no READs; its "
                "WRITEs are bounded by read_stall, the service's stall bound); accepted here: "
                + ", ".join(k for k in _pull._KNOBS if k != "read_timeout")
            )
        # Refuse bad knobs before anything is made.
        ka_config = nixl_keepalive.Config(**config_knobs)
        self._ka: Optional[Keepalive] = None
        self._ka_closed: Optional[dict] = None
        self._ka_config = ka_config
        self._ka_control = own["control_addr"]
        self._ka_control_token_file = own["control_token_file"]
        # The service's registrations by decode engine id (vLLM's tables
        # hold the same engines).
        self._ka_engines: Dict[str, Any] = {}
        # Guards _ka_engines, _ka_writes and the counters below between the
        # writer thread, the handshake executor and vLLM's main thread.
        self._ka_lock = threading.RLock()
        self._ka_writes: Dict[Any, _Write] = {}
        self._ka_failures: Dict[int, BaseException] = {}
        self._ka_local = threading.local()
        self._ka_events = None
        self._ka_released: List[str] = []
        self._ka_outlived: Dict[str, float] = {}
        #: WRITEs refused before NIXL was called (decode not live, or not
        #: the service's): their requests failed.
        self.refused_writes = 0
        #: Decode registrations that declared the address of a live decode.
        self.declared_conflicts = 0
        #: Of those, the ones that waited for the live decode's fate.
        self.declared_waits = 0

        real_config = _base_worker.nixl_agent_config
        rw_config = _pull._RwAgentConfig(real_config, _pull._rw_sync_mode()) if real_config is not None else None
        with _pull._agent_config_lock:
            if rw_config is not None:
                _base_worker.nixl_agent_config = rw_config
            try:
                super().__init__(vllm_config, engine_id, kv_cache_config)
            finally:
                _base_worker.nixl_agent_config = real_config
        missing = vllm_hooks.problems("push_worker instance", self)
        if missing:
            self._ka_undo_construction()
            raise RuntimeError(
                f"nixl_keepalive.vllm_push cannot run on vLLM {_pull._vllm_version()}: its push worker lacks what "
                f"the keepalive relies on: {'; '.join(missing)} (tested on vLLM {_pull._TESTED_TEXT})"
            )
        agent = self.nixl_wrapper
        agent_conf = rw_config.made[-1] if rw_config is not None and rw_config.made else None
        service_agent = agent if _pull._is_nixl_agent(agent) else _pull._WorkerAgent(self)
        control = None
        if self._ka_control is not None:
            control = {"addr": _pull.control_addr_of_rank(self._ka_control, int(getattr(self, "tp_rank", 0) or 0))}
            if self._ka_control_token_file is not None:
                control["token_file"] = self._ka_control_token_file
        try:
            self._ka = Keepalive(service_agent, ka_config, agent_config=agent_conf, control=control)
        except Exception as e:
            if _pull._is_nixl_agent(agent) or control is not None:
                self._ka_undo_construction()
                raise
            # A test double of vLLM's own unit tests, which the service
            # cannot run over: vLLM's behaviour, said loudly.
            logger.warning(
                "nixl_keepalive.vllm_push: the keepalive is OFF for this worker: its agent %r is not NIXL's "
                "nixl_agent and the service refused it (%s: %s)", type(agent).__name__, type(e).__name__, e)
            self._ka = None
        if self._ka is not None:
            self._ka_events = self._ka.events()
            logger.info("nixl_keepalive.vllm_push: keepalive on (push prefill; %r)", self._ka.config)

    # -- helpers -----------------------------------------------------------

    def _ka_undo_construction(self) -> None:
        """A construction refused after vLLM's own ran: what vLLM made (its
        agent, its threads) given back before the refusal propagates."""
        self._ka = None
        try:
            NixlPushConnectorWorker.shutdown(self)
        except Exception:  # noqa: BLE001 - the refusal being raised says what matters
            logger.debug("vLLM's shutdown after the refused construction failed", exc_info=True)

    def _ka_on(self) -> bool:
        ka = getattr(self, "_ka", None)
        return ka is not None and getattr(self, "_ka_closed", None) is None

    def keepalive(self) -> Optional[Keepalive]:
        """The service (``None`` when off)."""
        return getattr(self, "_ka", None)

    @property
    def released_decodes(self) -> List[str]:
        """The decodes' engine ids the service released and vLLM's tables
        dropped, oldest first."""
        with self._ka_lock:
            return list(self._ka_released)

    def writes_in_flight(self) -> int:
        """WRITEs posted under a guard and not yet seen ending."""
        with self._ka_lock:
            return len(self._ka_writes)

    def _ka_raw_status(self, handle: Any) -> Any:
        agent = self.nixl_wrapper
        if _pull._is_nixl_agent(agent):
            try:
                return nixl_keepalive.xfer_status(agent, handle)
            except Exception as e:  # noqa: BLE001 - the status of the call
                return e
        try:
            state = agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001
            return e
        return {"DONE": _pull._SUCCESS, "PROC": _pull._IN_PROG}.get(state, _pull._BACKEND)

    def _log_failure(self, failure_type: str, req_id: Optional[str], msg: str = "",
                     error: Optional[BaseException] = None, meta: Any = None, **extra_context: Any) -> None:
        # vLLM's _xfer_blocks catches what NIXL raised and logs it here: the
        # write guard ends with that exception (REMOTE_DISCONNECT marks).
        failures = getattr(self, "_ka_failures", None)
        if error is not None and failures is not None:
            failures[threading.get_ident()] = error
        return super()._log_failure(failure_type, req_id, msg, error, meta, **extra_context)

    # -- the decodes' handshakes (vLLM's handshake executor) ---------------

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
            # A decode loading its prefill for PUSH_REG notifications: no
            # memory of the prefill is mapped; vLLM's own.
            return super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id, remote_dcp_size,
                                           remote_pp_size, notif_agents_only)
        ka = self._ka
        address = _peer_address(host, port)
        collected: List[tuple] = []
        self._ka_local.collect = collected
        try:
            # vLLM's side channel and checks; add_remote_agent only records
            # what to load.
            names, offset = super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id,
                                                   remote_dcp_size, remote_pp_size, notif_agents_only)
        finally:
            self._ka_local.collect = None
        if not collected:
            return names, offset  # nothing reached add_remote_agent (a test's mock)
        engine_id = collected[0][0].engine_id
        agents = [c[4] for c in collected]
        for last_try in (False, True):
            holder = None
            # The address came in the decode's PUSH_REG: its own word. A
            # live decode there is not replaced on it (declared=True).
            with ka.handshake(address, declared=True) as h:
                try:
                    # On vLLM's handshake thread, which ends no transfer:
                    # no limit on the wait (see ReleaseHeld).
                    current = h.ready_to_load(engine_id, agents, timeout=None)
                except nixl_keepalive.IdentityConflict as e:
                    if e.conflict != "address_in_use" or last_try:
                        raise RuntimeError(
                            f"nixl_keepalive: decode {engine_id} at {address} refused before anything was loaded: "
                            f"{e}") from e
                    holder, wait = e.holder, _declared_wait(ka.config)
                    with self._ka_lock:
                        self.declared_conflicts += 1
                    logger.warning("nixl_keepalive.vllm_push: decode %s declares %s, where decode %s is live: "
                                   "not a replacement on its word; %s was heartbeated, waiting up to %.2f s for "
                                   "its fate", engine_id, address, holder, holder, wait)
                else:
                    if current is not None:
                        return self._ka_already_registered(engine_id, current, names, offset)
                    self._ka_load_and_register(h, engine_id, agents, collected)
                    return names, offset
            # Out of the handshake (an open one at the address would hold
            # the holder's release back).
            with self._ka_lock:
                outlived = self._ka_outlived.get(holder)
            if outlived is not None and time.monotonic() - outlived < _DECLARED_REWAIT_S:
                raise RuntimeError(
                    f"nixl_keepalive: decode {engine_id} at {address} refused: decode {holder} is live at that "
                    f"address (it outlived a wait {time.monotonic() - outlived:.1f} s ago; accepted: a decode's "
                    "own address, or one whose holder is gone)")
            with self._ka_lock:
                self.declared_waits += 1
            held = ka.engine(holder)
            if held is None or not held.wait_released(wait):
                if held is not None:
                    with self._ka_lock:
                        self._ka_outlived[holder] = time.monotonic()
                    raise RuntimeError(
                        f"nixl_keepalive: decode {engine_id} at {address} refused: decode {holder} is live at that "
                        f"address and was not found gone within {wait:.2f} s (two decodes declaring one address; "
                        "accepted: a decode's own address, or one whose holder is gone)")
        raise AssertionError("unreachable")  # pragma: no cover

    def _ka_already_registered(self, engine_id: str, current: Any, names: Any, offset: float) -> Any:
        """``ready_to_load`` said this incarnation is registered: vLLM's
        tables must hold it; when they do not (they were dropped), the
        handshake fails and is tried again once the service lets it go."""
        if engine_id in self.dst_xfer_side_handles:
            with self._ka_lock:
                self._ka_engines[engine_id] = current
            return names, offset
        raise RuntimeError(
            f"nixl_keepalive: decode {engine_id} is still registered with the keepalive ({current.state}) while "
            "vLLM's tables dropped it; a handshake with it is accepted once the keepalive released it")

    def _ka_load_and_register(self, h: Any, engine_id: str, agents: List[str], collected: List[tuple]) -> None:
        loaded_ranks: List[int] = []
        try:
            for meta, rank, tp_size, dcp_size, name in collected:
                got = nixl_keepalive.load_remote_agent(
                    self.nixl_wrapper,
                    lambda: NixlBaseConnectorWorker.add_remote_agent(self, meta, rank, tp_size, dcp_size))
                got = got.decode() if isinstance(got, bytes) else got
                loaded_ranks.append(rank)
                if got != name:
                    raise RuntimeError(f"NIXL loaded agent {got!r} from the metadata of decode {engine_id} rank "
                                       f"{rank}, whose metadata names {name!r}")
            handles = [self.dst_xfer_side_handles[engine_id][c[1]] for c in collected]
        except BaseException:
            self._ka_undo_load(engine_id, agents, loaded_ranks)
            raise
        try:
            engine = h.register(handles)
        except nixl_keepalive.RegistrationRefused as refused:
            if refused.registration is not None:
                self._ka.give_back(refused.registration)
            self.dst_xfer_side_handles.pop(engine_id, None)
            with self._handshake_lock:
                self._remote_agents.setdefault(engine_id, {})
            self._ka_forget_tables(engine_id)
            raise
        with self._ka_lock:
            self._ka_engines[engine_id] = engine

    def _ka_undo_load(self, engine_id: str, agents: List[str], loaded_ranks: List[int]) -> None:
        """A load that failed half-way: what it loaded given back, vLLM's
        tables of the decode dropped."""
        for handle in self.dst_xfer_side_handles.pop(engine_id, {}).values():
            try:
                self.nixl_wrapper.release_dlist_handle(handle)
            except Exception:  # noqa: BLE001
                logger.warning("release_dlist_handle failed undoing decode %s's load", engine_id, exc_info=True)
        for name in agents[: len(loaded_ranks)]:
            try:
                if _pull._is_nixl_agent(self.nixl_wrapper):
                    nixl_keepalive.remove_remote_agent(self.nixl_wrapper, name)
                else:
                    self.nixl_wrapper.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                logger.warning("unloading agent %s of decode %s failed", name, engine_id, exc_info=True)
        with self._handshake_lock:
            self._remote_agents.setdefault(engine_id, {})
        self._ka_forget_tables(engine_id)

    def _ka_forget_tables(self, engine_id: str, log_eviction: bool = False) -> None:
        """Drops ``engine_id`` from vLLM's own tables with vLLM's own
        bookkeeping (its base cleanup, left nothing to release), and no
        NIXL call: the service released (or will release) its NIXL state."""
        self.dst_xfer_side_handles.pop(engine_id, None)
        with self._handshake_lock:
            self._remote_agents[engine_id] = {}
        NixlBaseConnectorWorker._cleanup_remote_engine(self, engine_id, log_eviction=log_eviction)

    # -- WRITEs (vLLM's writer thread) ---------------------------------------

    def _ka_refuse_write(self, request_id: str, engine_id: str, why: str) -> None:
        """A WRITE not posted: its request fails as a failed WRITE
        submission does in vLLM (its blocks go back at lease expiry)."""
        with self._ka_lock:
            self.refused_writes += 1
        self._log_failure("transfer_refused_by_keepalive", request_id,
                          msg=f"push WRITE to decode {engine_id} refused before NIXL was called: {why}",
                          dst_engine_id=engine_id)
        self.xfer_stats.record_failed_transfer()
        with self._sending_transfers_lock:
            self._send_failures.add(request_id)

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        if not self._ka_on():
            return super()._xfer_blocks_for_req(req_id, meta)
        engine_id = meta.remote.engine_id
        with self._ka_lock:
            engine = self._ka_engines.get(engine_id)
        if engine is None or not engine.is_live:
            # Known to vLLM, not live in the service (dead, replaced,
            # stalled, released and about to leave vLLM's tables): nothing
            # is posted, and vLLM's tables are not read.
            state = "not registered with the keepalive" if engine is None else f"{engine.state}"
            return self._ka_refuse_write(req_id, engine_id, state)
        try:
            return super()._xfer_blocks_for_req(req_id, meta)
        except KeyError as e:
            # vLLM's tables of the decode went between the check and the
            # read (it was released on the main thread); nothing was posted:
            # a WRITE is posted only under a guard, which holds the release.
            return self._ka_refuse_write(req_id, engine_id, f"its tables were dropped ({e!r}): released")

    def _xfer_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, remote_request_id: str,
                     local_xfer_side_handle: Any, remote_xfer_side_handle: Any) -> Any:
        args = dict(read_spec=read_spec, dst_engine_id=dst_engine_id, request_id=request_id,
                    remote_request_id=remote_request_id, local_xfer_side_handle=local_xfer_side_handle,
                    remote_xfer_side_handle=remote_xfer_side_handle)
        if not self._ka_on() or len(read_spec.local_block_ids) == 0:
            return super()._xfer_blocks(**args)
        with self._ka_lock:
            engine = self._ka_engines.get(dst_engine_id)
        if engine is None:
            self._ka_refuse_write(request_id, dst_engine_id, "not registered with the keepalive")
            return None
        try:
            write = engine.write()
        except nixl_keepalive.ReadRefused as refused:
            self._ka_refuse_write(request_id, dst_engine_id, f"decode is {refused.state}")
            return None
        tid = threading.get_ident()
        self._ka_failures.pop(tid, None)
        try:
            handle = super()._xfer_blocks(**args)
        except BaseException:
            write.close()
            raise
        error = self._ka_failures.pop(tid, None)
        if handle is None:
            # Nothing left posted: the WRITE ends with what NIXL raised.
            nixl_keepalive._end_transfer_guard(write, error)
            return None
        with self._ka_lock:
            self._ka_writes[handle] = _Write(write, engine, request_id)
        return handle

    def _pop_done_transfers(self, transfers: Dict[str, List[Any]]) -> Tuple[Set[str], Set[str]]:
        if not getattr(self, "_ka_writes", None):
            return super()._pop_done_transfers(transfers)
        done: Set[str] = set()
        failed: Set[str] = set()
        untracked: Dict[str, List[Any]] = {}
        tracked_left: Dict[str, List[Any]] = {}
        for req_id, handles in list(transfers.items()):
            left: List[Any] = []
            for handle in handles:
                with self._ka_lock:
                    w = self._ka_writes.get(handle)
                if w is None:
                    untracked.setdefault(req_id, []).append(handle)
                    continue
                status = self._ka_raw_status(handle)
                if isinstance(status, int) and status == _pull._IN_PROG:
                    left.append(handle)
                    continue
                with self._ka_lock:
                    del self._ka_writes[handle]
                if isinstance(status, int) and status == _pull._SUCCESS:
                    w.guard.finish(_pull._SUCCESS)
                    try:
                        self.xfer_stats.record_transfer(self.nixl_wrapper.get_xfer_telemetry(handle))
                        self.nixl_wrapper.release_xfer_handle(handle)
                    except Exception as e:  # noqa: BLE001 - as vLLM handles it
                        self._log_failure("transfer_exception", req_id, error=e)
                        if not self._handle_failed_transfer(req_id, handle, failed):
                            left.append(handle)
                    continue
                # Failed: the raw status, never check_xfer_state's "ERR".
                nixl_keepalive._end_transfer_guard(w.guard, status)
                name = nixl_keepalive.status_name(status) if isinstance(status, int) else type(status).__name__
                self._log_failure("transfer_failed", req_id, xfer_state=name,
                                  error=status if isinstance(status, BaseException) else None)
                if not self._handle_failed_transfer(req_id, handle, failed):
                    left.append(handle)
            if left:
                tracked_left[req_id] = left
        if untracked:
            _, u_failed = super()._pop_done_transfers(untracked)
            failed |= u_failed
        for req_id in list(transfers):
            remaining = tracked_left.get(req_id, []) + untracked.get(req_id, [])
            if remaining:
                transfers[req_id] = remaining
            else:
                done.add(req_id)
                del transfers[req_id]
        return done, failed

    # -- releases (vLLM's main thread) -------------------------------------

    def start_load_kv(self, metadata: Any) -> None:
        self._ka_process_releases()
        return super().start_load_kv(metadata)

    def get_transfer_results(self) -> Any:
        self._ka_process_releases()
        return super().get_transfer_results()

    def _ka_process_releases(self) -> None:
        """On vLLM's main thread, each step: the service's events logged,
        every decode it released dropped from vLLM's tables, and the
        decode's unmatched registrations handed to the writer's eviction
        inbox (the writer owns that table)."""
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
        with self._handshake_lock, self._ka_lock:
            pending = set(self._handshake_futures)
            released = [(eid, eng) for eid, eng in self._ka_engines.items()
                        if eng.state == "released" and eid not in pending]
            for eid, _ in released:
                del self._ka_engines[eid]
        for eid, eng in released:
            if not eng.wait_released(_pull._RELEASE_WAIT):
                logger.warning("nixl_keepalive.vllm_push: decode %s's release did not return within %.1f s",
                               eid, _pull._RELEASE_WAIT)
            if eid in self._remote_agents:
                self._ka_forget_tables(eid)
            evicted = 0
            for rid, reg in list(self._pending_d_registrations.items()):
                if isinstance(reg, dict) and reg.get("decode_engine_id") == eid:
                    self._evict_finished_inbox.put(rid)
                    evicted += 1
            if evicted:
                self._push_writer_wake.set()
            with self._ka_lock:
                self._ka_released.append(eid)
            logger.info("nixl_keepalive.vllm_push: decode %s released by the keepalive; dropped from vLLM's "
                        "tables (%d unmatched registration(s) evicted)", eid, evicted)

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        engine = None
        if self._ka_on():
            with self._ka_lock:
                engine = self._ka_engines.pop(engine_id, None)
        if engine is None:
            return super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        # vLLM retires it (TTL): the service owns its NIXL state and
        # releases it once its writes end, never under one.
        if engine.state != "released":
            try:
                self._ka.peer_gone(engine, mode="drain")
            except nixl_keepalive.KeepaliveError as e:
                logger.debug("peer_gone(%s): %s", engine_id, e)
        self._ka_forget_tables(engine_id, log_eviction=log_eviction)
        if engine.reads_in_flight == 0 and not engine.wait_released(_pull._RELEASE_WAIT):
            logger.warning("nixl_keepalive.vllm_push: decode %s not released within %.1f s of vLLM's cleanup "
                           "(state %s); the keepalive releases it once it can", engine_id, _pull._RELEASE_WAIT,
                           engine.state)

    # -- stopping --------------------------------------------------------------

    def shutdown(self) -> None:
        ka = getattr(self, "_ka", None)
        if ka is None or getattr(self, "_ka_closed", None) is not None or not hasattr(self, "_push_writer_stop"):
            return super().shutdown()
        # The writer first: nothing is posted past this point.
        self._push_writer_stop.set()
        self._push_writer_wake.set()
        if self._push_writer_thread is not None:
            self._push_writer_thread.join(timeout=2)
            self._push_writer_thread = None
        self._handshake_initiation_executor.shutdown(wait=False)
        # The WRITEs in flight: those that ended end their guards with
        # their status; the rest are abandoned (their handles released,
        # NIXL tries to cancel), given up as cancelled.
        with self._sending_transfers_lock:
            for handles in self._sending_transfers.values():
                for handle in handles:
                    with self._ka_lock:
                        w = self._ka_writes.pop(handle, None)
                    status = self._ka_raw_status(handle) if w is not None else None
                    try:
                        self.nixl_wrapper.release_xfer_handle(handle)
                    except Exception:  # noqa: BLE001
                        logger.warning("release_xfer_handle failed at shutdown", exc_info=True)
                    if w is None:
                        continue
                    if isinstance(status, int) and status == _pull._IN_PROG:
                        w.guard.give_up(nixl_keepalive.GiveUp.CANCELLED).abandon()
                    else:
                        nixl_keepalive._end_transfer_guard(w.guard, status)
            self._sending_transfers.clear()
            self._send_failures.clear()
        with self._ka_lock:
            for w in self._ka_writes.values():
                w.guard.give_up(nixl_keepalive.GiveUp.CANCELLED).abandon()
            self._ka_writes.clear()
        # The service: it releases every decode it holds, while the agent
        # is whole.
        left = ka.close()
        self._ka_closed = left
        for registration in left.get("unreleased", []):
            try:
                ka.give_back(registration)
            except Exception:  # noqa: BLE001
                logger.warning("give_back at shutdown failed", exc_info=True)
        try:
            self.nixl_wrapper.get_new_notifs()  # endpoint closes finish in UCX's next progress
        except Exception:  # noqa: BLE001
            pass
        with self._ka_lock:
            engines = list(self._ka_engines)
            self._ka_engines.clear()
        for eid in engines:
            if eid in self._remote_agents:
                self._ka_forget_tables(eid)
        # vLLM's own: local handles, engines not the service's, memory.
        super().shutdown()


class KeepaliveNixlPushConnector(NixlPushConnector):
    """vLLM's ``NixlPushConnector`` with the keepalive service on its
    worker side (the prefill's WRITEs). Load it by configuration:
    ``{"kv_connector": "KeepaliveNixlPushConnector",
    "kv_connector_module_path": "nixl_keepalive.vllm", ...}``, or by vLLM's
    own name with ``NIXL_KEEPALIVE_VLLM=1``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_push_hooks()
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("KeepaliveNixlPushConnector (as vLLM's NixlPushConnector) does not support "
                             "decode_context_parallel_size > 1; accepted: 1")
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPushConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KeepaliveNixlPushConnectorWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"KeepaliveNixlPushConnector: unsupported KVConnectorRole {role!r} "
                             "(SCHEDULER or WORKER)")

