"""What the pull connector's worker adapts of vLLM's purge of a remote
engine (``_cleanup_remote_engine``): an engine the service holds is
handed to the service (``peer_gone``, released once its reads end) and
dropped from vLLM's own tables without a second NIXL call; an engine the
service released is dropped from vLLM's tables on vLLM's thread, each
step. A mixin of :class:`nixl_keepalive.vllm.KeepaliveNixlConnectorWorker`
(before vLLM's worker in its bases); it needs no vLLM to import.
"""

from __future__ import annotations

import logging

import nixl_keepalive

# The connector's one logger: every line of the pull connector, from any
# of its modules, under the name operators filter on.
logger = logging.getLogger("nixl_keepalive.vllm")

#: How long vLLM's cleanup of an engine with no read in flight waits for
#: the service's release (it takes milliseconds; the bound is for a stuck
#: agent call, after which the release continues in the service).
_RELEASE_WAIT = 5.0


class PurgeHooks:
    """vLLM's engine purge, through the service."""

    def _ka_forget_tables(self, engine_id: str, log_eviction: bool = False) -> None:
        """Drops ``engine_id`` from vLLM's own tables (remote agents, dlist
        handles, engine-id maps, topology, clock offset, TTL stamps) with
        vLLM's own bookkeeping, and no NIXL call: the service released (or
        will release) its NIXL state."""
        self.dst_xfer_side_handles.pop(engine_id, None)
        with self._handshake_lock:
            self._remote_agents[engine_id] = {}
        super(PurgeHooks, self)._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        for key in [k for k in self._ka_leases if k[0] == engine_id]:
            self._ka_leases.pop(key, None)
            self._ka_hb_seen.pop(key, None)

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
