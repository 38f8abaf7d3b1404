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

import logging
import threading
from typing import Any, Dict, Optional, Set, Tuple

import nixl_keepalive
from nixl_keepalive import parse_agent_name
from nixl_keepalive.vllm_hooks import TESTED_VLLM
from nixl_keepalive.vllm_service import _needs_vllm, check_vllm_version

SUPPORTED_VLLM = TESTED_VLLM
"""The older name of :data:`nixl_keepalive.vllm_hooks.TESTED_VLLM`."""


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
except ImportError as _e:  # vLLM missing, or a layout this module does not know
    raise _needs_vllm("nixl_keepalive.vllm", "pull-mode NIXL connector",
                      "vllm.distributed.kv_transfer.kv_connector.v1.nixl", _e) from _e

logger = logging.getLogger("nixl_keepalive.vllm")

__all__ = [
    "SUPPORTED_VLLM",
    "KeepaliveNixlConnector",
    "KeepaliveNixlConnectorWorker",
    "check_vllm_version",
    "keepalive_knobs",
    "parse_agent_name",
]

from nixl_keepalive.vllm_handshake import HandshakeHooks
from nixl_keepalive.vllm_heartbeats import HeartbeatHooks
from nixl_keepalive.vllm_knobs import (  # noqa: F401 - the connectors' names since before the split
    _CONFIG_KNOBS,
    _KNOBS,
    control_addr_of_rank,
    keepalive_knobs,
)
from nixl_keepalive.vllm_purge import PurgeHooks
from nixl_keepalive.vllm_reads import ReadHooks, _Fenced, _Held, _Tracked
from nixl_keepalive.vllm_service import ServiceHooks


class KeepaliveNixlConnectorWorker(HandshakeHooks, ReadHooks, PurgeHooks, HeartbeatHooks, ServiceHooks,
                                   NixlPullConnectorWorker):
    """vLLM's pull-mode NIXL connector worker with the keepalive service
    embedded (see the module docs). What it adapts of vLLM is in one
    module per concern, each a mixin before vLLM's worker in the bases:
    the handshake (:mod:`nixl_keepalive.vllm_handshake`), the reads
    (:mod:`nixl_keepalive.vllm_reads`), the purge of an engine
    (:mod:`nixl_keepalive.vllm_purge`), the heartbeats
    (:mod:`nixl_keepalive.vllm_heartbeats`), the knobs
    (:mod:`nixl_keepalive.vllm_knobs`), and what the push worker shares
    with it: the service made inside vLLM's constructor, its events, its
    stop (:mod:`nixl_keepalive.vllm_service`); here are its construction
    and its shutdown."""

    _ka_vllm_worker = NixlPullConnectorWorker

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        check_vllm_version()
        config_knobs, own = keepalive_knobs(vllm_config.kv_transfer_config)
        # Refuse bad knobs before anything is made.
        ka_config = nixl_keepalive.Config(**config_knobs)
        self._ka_read_timeout: Optional[float] = own["read_timeout"]
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
        kv_lease = vllm_config.kv_transfer_config.get_from_extra_config("kv_lease_duration", 30)
        # A heartbeat-only lease (a request waiting in vLLM's scheduler) is
        # dropped when two of vLLM's heartbeat packages went by without it.
        self._ka_hb_stale = 2.0 * max(1, int(kv_lease) // 6) + 1.0
        self._ka_construct(vllm_config, engine_id, kv_cache_config, ka_config, own)
        if self._ka is not None:
            logger.info("nixl_keepalive.vllm: keepalive on (%r, read_timeout=%s)", self._ka.config,
                        self._ka_read_timeout)
            gpu = nixl_keepalive.gpu_mappings()
            logger.info("nixl_keepalive.vllm: GPU mappings: %s%s", gpu["mode"],
                        f" ({gpu['reason']})" if gpu["reason"] else "")
            if self._ka.control_addr is not None:
                logger.info("nixl_keepalive.vllm: rank %s serves the router's control endpoint on %s "
                            "(POST /fault_tolerance/event, POST /v1/peer_gone, GET /v1/snapshot)",
                            getattr(self, "tp_rank", 0), self._ka.control_addr)

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
        self._ka_close_service(ka)
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
