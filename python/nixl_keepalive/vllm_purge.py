"""What the pull connector's worker adapts of vLLM's purge of a remote
engine (``_cleanup_remote_engine``): an engine the service holds is
handed to the service (``peer_gone``, released once its reads end) and
dropped from vLLM's own tables without a second NIXL call; an engine the
service released is dropped from vLLM's tables on vLLM's thread, each
step. A mixin of both connectors' workers
(:class:`nixl_keepalive.vllm.KeepaliveNixlConnectorWorker`, and
:class:`nixl_keepalive.vllm_push.KeepaliveNixlPushConnectorWorker` for
its decodes), before vLLM's worker in their bases; it needs no vLLM to
import.
"""

from __future__ import annotations

import nixl_keepalive

#: How long vLLM's cleanup of an engine with no read in flight waits for
#: the service's release (it takes milliseconds; the bound is for a stuck
#: agent call, after which the release continues in the service).
_RELEASE_WAIT = 5.0


class PurgeHooks:
    """vLLM's engine purge, through the service (both connectors)."""

    def _ka_forget_tables(self, engine_id: str, log_eviction: bool = False) -> None:
        """Drops ``engine_id`` from vLLM's own tables (remote agents, dlist
        handles, engine-id maps, topology, clock offset, TTL stamps) with
        vLLM's own bookkeeping, and no NIXL call: the service released (or
        will release) its NIXL state."""
        self.dst_xfer_side_handles.pop(engine_id, None)
        with self._handshake_lock:
            self._remote_agents[engine_id] = {}
        super(PurgeHooks, self)._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        self._ka_forgot(engine_id)

    def _ka_dropped(self, engine_id: str, forgotten: bool) -> None:
        """An engine the service released has left the worker
        (``forgotten``: vLLM's tables held it, and dropped it)."""
        if forgotten:
            self._ka_log.info("%s: %s %s released by the keepalive; dropped from vLLM's tables",
                              self._ka_module, self._ka_peer, engine_id)

    def _ka_process_releases(self) -> None:
        """On vLLM's thread, each step: the service's events logged, and
        every registration it released dropped from vLLM's tables."""
        if getattr(self, "_ka", None) is None:
            return
        self._ka_log_events()
        with self._handshake_lock, self._ka_lock:
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
                self._ka_log.warning("%s: %s %s's release did not return within %.1f s",
                                     self._ka_module, self._ka_peer, eid, _RELEASE_WAIT)
            forgotten = eid in self._remote_agents
            if forgotten:
                self._ka_forget_tables(eid)
            self._ka_dropped(eid, forgotten)

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        engine = None
        if self._ka_on():
            with self._ka_lock:
                engine = self._ka_engines.pop(engine_id, None)
        if engine is None:
            return super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)
        # vLLM retires it (TTL; in pull mode also replaced, invalid,
        # re-registered): the service owns its NIXL state and releases it
        # once its transfers end.
        if engine.state != "released":
            try:
                self._ka.peer_gone(engine, mode="drain")
            except nixl_keepalive.KeepaliveError as e:
                self._ka_log.debug("peer_gone(%s): %s", engine_id, e)
        self._ka_forget_tables(engine_id, log_eviction=log_eviction)
        # vLLM's cleanup is synchronous: its NIXL state is gone when the
        # call returns. With no transfer of the engine in flight the
        # service's release is immediate (milliseconds: its thread calls
        # the agent, taking the GIL this wait gives up; no vLLM lock is held
        # here), so it is awaited, bounded (state "released" comes before
        # the release call has returned; wait_released waits for the call).
        # With transfers in flight it stays the service's: released once
        # they end, never under them.
        if engine.reads_in_flight == 0:
            if not engine.wait_released(_RELEASE_WAIT):
                self._ka_log.warning(
                    "%s: %s %s not released within %.1f s of vLLM's cleanup (state %s); the keepalive "
                    "releases it once it can", self._ka_module, self._ka_peer, engine_id, _RELEASE_WAIT,
                    engine.state)
