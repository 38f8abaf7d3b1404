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
from nixl_keepalive import vllm_hooks
from nixl_keepalive.vllm_handshake import LoadHooks
from nixl_keepalive.vllm_knobs import _KNOBS, keepalive_knobs
from nixl_keepalive.vllm_purge import PurgeHooks
from nixl_keepalive.vllm_service import _TESTED_TEXT, ServiceHooks, _needs_vllm, check_vllm_version

logger = logging.getLogger("nixl_keepalive.vllm_push")

__all__ = [
    "KeepaliveNixlPushConnector",
    "KeepaliveNixlPushConnectorWorker",
    "check_push_hooks",
]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
except ImportError as _e:  # vLLM missing, or a layout this module does not know
    raise _needs_vllm("nixl_keepalive.vllm_push", "push-mode NIXL connector",
                      "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker", _e) from _e


def check_push_hooks(version: Optional[str] = None) -> str:
    """:func:`nixl_keepalive.vllm.check_vllm_version` plus the push worker's
    own hooks (``vllm_hooks``, kind ``push_worker``): raises
    ``RuntimeError`` naming each one missing or reshaped. Returns the
    version."""
    found = check_vllm_version(version)
    wrong = vllm_hooks.problems("push_worker", NixlPushConnectorWorker)
    if wrong:
        raise RuntimeError(
            f"nixl_keepalive.vllm_push cannot run on vLLM {found}: its push-mode NIXL worker lacks what the "
            f"keepalive relies on: {'; '.join(wrong)}. Tested on vLLM {_TESTED_TEXT}; use one of those, or "
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


class KeepaliveNixlPushConnectorWorker(LoadHooks, PurgeHooks, ServiceHooks, NixlPushConnectorWorker):
    """vLLM's push-mode NIXL connector worker with the keepalive service
    embedded on the prefill side (see the module docs). Built from the
    pull worker's mixins where the two modes do the same: the service made
    inside vLLM's constructor, its events and its stop
    (:mod:`nixl_keepalive.vllm_service`), a decode's metadata loaded and
    registered (:class:`nixl_keepalive.vllm_handshake.LoadHooks`), its
    purge (:mod:`nixl_keepalive.vllm_purge`); here are what push mode does
    its own way: the declared handshake, the WRITEs, the registrations a
    released decode leaves, the stop of the writer thread."""

    _ka_vllm_worker = NixlPushConnectorWorker
    _ka_hooks_kind = "push_worker instance"
    _ka_module = "nixl_keepalive.vllm_push"
    _ka_log = logger
    _ka_peer = "decode"

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_push_hooks()
        config_knobs, own = keepalive_knobs(vllm_config.kv_transfer_config)
        if own["read_timeout"] is not None:
            raise ValueError(
                "keepalive knob read_timeout is not accepted in push mode (a push prefill posts no READs; its "
                "WRITEs are bounded by read_stall, the service's stall bound); accepted here: "
                + ", ".join(k for k in _KNOBS if k != "read_timeout")
            )
        # Refuse bad knobs before anything is made.
        ka_config = nixl_keepalive.Config(**config_knobs)
        self._ka_config = ka_config
        self._ka_writes: Dict[Any, _Write] = {}
        self._ka_released: List[str] = []
        self._ka_outlived: Dict[str, float] = {}
        #: WRITEs refused before NIXL was called (decode not live, or not
        #: the service's): their requests failed.
        self.refused_writes = 0
        #: Decode registrations that declared the address of a live decode.
        self.declared_conflicts = 0
        #: Of those, the ones that waited for the live decode's fate.
        self.declared_waits = 0
        # _ka_lock (vllm_service) also guards _ka_writes and the counters
        # above between the writer thread, the handshake executor and
        # vLLM's main thread.
        self._ka_construct(vllm_config, engine_id, kv_cache_config, ka_config, own)
        if self._ka is not None:
            logger.info("nixl_keepalive.vllm_push: keepalive on (push prefill; %r)", self._ka.config)

    # -- helpers -----------------------------------------------------------

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

    def _ka_handshake(self, host: str, port: int, args: tuple) -> Tuple[Dict[Tuple[int, int], str], float]:
        ka = self._ka
        address = _peer_address(host, port)
        names, offset, collected = self._ka_collect(args)
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
        failed, remaining = self._ka_poll_guarded(transfers, self._ka_writes)
        done: Set[str] = set()
        for req_id, left in remaining.items():
            if left:
                transfers[req_id] = left
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

    def _ka_dropped(self, engine_id: str, forgotten: bool) -> None:
        """A decode the service released left vLLM's tables: its
        registrations still unmatched go to the writer's eviction inbox
        (the writer owns that table)."""
        evicted = 0
        for rid, reg in list(self._pending_d_registrations.items()):
            if isinstance(reg, dict) and reg.get("decode_engine_id") == engine_id:
                self._evict_finished_inbox.put(rid)
                evicted += 1
        if evicted:
            self._push_writer_wake.set()
        with self._ka_lock:
            self._ka_released.append(engine_id)
        logger.info("nixl_keepalive.vllm_push: decode %s released by the keepalive; dropped from vLLM's "
                    "tables (%d unmatched registration(s) evicted)", engine_id, evicted)

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
                    if isinstance(status, int) and status == nixl_keepalive.IN_PROG:
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
        self._ka_close_service(ka)
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

