"""What the pull connector's worker adapts of vLLM's heartbeats
(``_send_heartbeats``): vLLM's own ``HB:`` lease renewals become the
service's leases (a request's reads and vLLM's heartbeat lists each hold
a lease reason), and the service heartbeats every known prefill, idle or
busy; an engine the service does not hold gets vLLM's own ``HB:``. A mixin
of :class:`nixl_keepalive.vllm.KeepaliveNixlConnectorWorker`; it needs no
vLLM to import.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import nixl_keepalive

# The connector's one logger: every line of the pull connector, from any
# of its modules, under the name operators filter on.
logger = logging.getLogger("nixl_keepalive.vllm")


class HeartbeatHooks:
    """vLLM's heartbeats, as the service's leases."""

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

    def _ka_forgot(self, engine_id: str) -> None:
        # The engine left vLLM's tables: its leases go with it.
        for key in [k for k in self._ka_leases if k[0] == engine_id]:
            self._ka_leases.pop(key, None)
            self._ka_hb_seen.pop(key, None)

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
