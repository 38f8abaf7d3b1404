"""What the pull connector's worker adapts of vLLM's handshake
(``_nixl_handshake``, ``add_remote_agent``,
``_track_remote_engine_replacement``): every remote engine vLLM loads goes
through the service's handshake protocol, claimed before its metadata is
loaded and registered with its prepped dlist handles after; a load that
fails half-way is given back; an engine loaded outside it is registered
as loaded. :class:`LoadHooks` (the metadata collected, loaded,
registered, given back) is a mixin of both connectors' workers,
:class:`HandshakeHooks` (vLLM's pull handshake) of
:class:`nixl_keepalive.vllm.KeepaliveNixlConnectorWorker`; it needs no
vLLM to import.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import nixl_keepalive
from nixl_keepalive import parse_agent_name

_is_nixl_agent = nixl_keepalive._is_nixl_agent


class LoadHooks:
    """What both connectors do with a remote engine's metadata: collected
    while vLLM's handshake runs (``add_remote_agent`` records it), loaded
    once the service's handshake lets it, registered with its dlist
    handles; a load that fails half-way given back."""

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
        args = (host, port, remote_tp_size, expected_engine_id, remote_dcp_size, remote_pp_size, notif_agents_only)
        if not self._ka_on() or notif_agents_only:
            # Notification-only agents (no memory of the remote is mapped),
            # or the service off: vLLM's own.
            return super()._nixl_handshake(*args)
        return self._ka_handshake(host, port, args)

    def _ka_handshake(self, host: str, port: int, args: tuple) -> Tuple[Dict[Tuple[int, int], str], float]:
        """The service's handshake around vLLM's (``args``: vLLM's
        ``_nixl_handshake`` arguments), as each mode runs it."""
        raise NotImplementedError

    def _ka_collect(self, args: tuple) -> Tuple[Dict[Tuple[int, int], str], float, List[tuple]]:
        """vLLM's side channel and checks (its ``_nixl_handshake``), with
        ``add_remote_agent`` only recording what to load: returns vLLM's
        answer and what it would have loaded, one tuple a rank."""
        collected: List[tuple] = []
        self._ka_local.collect = collected
        try:
            names, offset = super()._nixl_handshake(*args)
        finally:
            self._ka_local.collect = None
        return names, offset, collected

    def _ka_load_and_register(self, h: Any, engine_id: str, agents: List[str], collected: List[tuple]) -> None:
        """Loads each rank's metadata (with its endpoints named, see
        :func:`nixl_keepalive.load_remote_agent`) and registers the engine
        with its dlist handles; a refused registration leaves nothing
        loaded in vLLM's tables."""
        loaded_ranks: List[int] = []
        try:
            for meta, rank, tp_size, dcp_size, name in collected:
                got = nixl_keepalive.load_remote_agent(
                    self.nixl_wrapper,
                    lambda: super(LoadHooks, self).add_remote_agent(meta, rank, tp_size, dcp_size))
                got = got.decode() if isinstance(got, bytes) else got
                loaded_ranks.append(rank)
                if got != name:
                    raise RuntimeError(
                        f"NIXL loaded agent {got!r} from the metadata of {self._ka_peer} {engine_id} rank {rank}, "
                        f"whose metadata names {name!r}"
                    )
            handles = [self.dst_xfer_side_handles[engine_id][c[1]] for c in collected]
        except BaseException:
            self._ka_undo_load(engine_id, agents, loaded_ranks)
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
        with self._ka_lock:
            self._ka_engines[engine_id] = engine

    def _ka_undo_load(self, engine_id: str, agents: List[str], loaded_ranks: List[int]) -> None:
        """A load that failed half-way: what it loaded given back (dlist
        handles released, agents unloaded with their endpoints closed),
        vLLM's tables of the engine dropped."""
        peer = self._ka_peer
        for handle in self.dst_xfer_side_handles.pop(engine_id, {}).values():
            try:
                self.nixl_wrapper.release_dlist_handle(handle)
            except Exception:  # noqa: BLE001
                self._ka_log.warning("release_dlist_handle failed undoing %s %s's load", peer, engine_id,
                                     exc_info=True)
        for name in agents[: len(loaded_ranks)]:
            try:
                if _is_nixl_agent(self.nixl_wrapper):
                    nixl_keepalive.remove_remote_agent(self.nixl_wrapper, name)
                else:
                    self.nixl_wrapper.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                self._ka_log.warning("unloading agent %s of %s %s failed", name, peer, engine_id, exc_info=True)
        with self._handshake_lock:
            self._remote_agents.setdefault(engine_id, {})
        self._ka_forget_tables(engine_id)


class HandshakeHooks(LoadHooks):
    """vLLM's pull-mode handshake, through the service's protocol."""

    def _ka_handshake(self, host: str, port: int, args: tuple) -> Tuple[Dict[Tuple[int, int], str], float]:
        address = f"{host}:{port}"
        with self._ka.handshake(address) as h:
            names, offset, collected = self._ka_collect(args)
            if not collected:
                return names, offset  # nothing reached add_remote_agent (a test's mock)
            engine_id = collected[0][0].engine_id
            agents = [c[4] for c in collected]
            self._ka_guard_untracked()  # ready_to_load may replace the engine last at this address
            # vLLM handshakes on its handshake thread, never the one whose
            # step ends the transfers an older registration waits for: no
            # limit on the wait (see ReleaseHeld).
            current = h.ready_to_load(engine_id, agents, timeout=None)
            if current is not None:
                # This incarnation is registered: vLLM's tables must hold it.
                with self._ka_lock:
                    self._ka_engines[engine_id] = current
                return names, offset
            self._ka_load_and_register(h, engine_id, agents, collected)
        return names, offset

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
            self._ka_log.warning("nixl_keepalive.vllm: engine %s stays vLLM's own (not registered: %s)", engine_id, e)
            return
        with self._ka_lock:
            self._ka_engines[engine_id] = engine
