"""The decode side of the tier: a real vLLM connector worker (ours,
``KeepaliveNixlConnector``) in this process, driven through vLLM's
worker-level connector API: ``start_load_kv(NixlConnectorMetadata)`` as
vLLM's model runner calls it, ``get_transfer_results()`` once per step."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import vllm_env

_ids = itertools.count(1)


@dataclass
class Outcome:
    req_id: str
    ok: bool  # finished_recving and not failed_recving
    at: float


class Decode:
    """One decode worker (its own NIXL agent and keepalive)."""

    def __init__(self, engine_id: str = "decode", blocks: int = 64, keepalive: Optional[Dict[str, Any]] = None,
                 failure_policy: str = "fail", extra: Optional[Dict[str, Any]] = None,
                 connector: Tuple[str, Optional[str]] = vllm_env.KEEPALIVE_CONNECTOR) -> None:
        from vllm.config import set_current_vllm_config

        conf_extra = dict(extra or {})
        conf_extra["keepalive"] = dict(keepalive or {})
        # A decode's role as vLLM recommends it (kv_both is deprecated).
        self.config = vllm_env.vllm_config(connector, engine_id, conf_extra, kv_role="kv_consumer",
                                           failure_policy=failure_policy)
        self._scope = set_current_vllm_config
        self.connector, self.caches = vllm_env.make_worker_connector(self.config, blocks)
        self.worker = self.connector.connector_worker
        self.blocks = blocks
        self.free: List[int] = list(range(blocks))
        self.outcomes: Dict[str, Outcome] = {}
        self.local_of: Dict[str, List[int]] = {}
        # What KeepaliveNixlConnectorScheduler does for vLLM's scheduler
        # (tested with vLLM's real Scheduler in test_vllm_given_up.py): a
        # failed request's blocks are withheld, announced to the worker,
        # and freed when it reports the request in finished_sending.
        self.withheld: Set[str] = set()
        self._announce: Set[str] = set()

    @property
    def ka(self) -> Any:
        return self.worker.keepalive()

    def step(self, reqs: Optional[Dict[str, Tuple[List[int], List[int], str, str]]] = None, host: str = "127.0.0.1",
             port: int = 0, heartbeat: Optional[Dict[str, Tuple[set, str, int]]] = None) -> None:
        """One engine step: new reads (and vLLM's heartbeat package) handed
        to the worker, then its transfer results collected."""
        meta = vllm_env.recv_metadata(reqs or {}, host, port, heartbeat)
        if self._announce:
            meta.ka_free_when_over = self._announce
            self._announce = set()
        with self._scope(self.config):
            self.worker.start_load_kv(meta)
            results = self.worker.get_transfer_results()
        failed = set(results.failed_recving or ())
        for req_id in results.finished_recving or ():
            self.outcomes[req_id] = Outcome(req_id, req_id not in failed, time.monotonic())
            if req_id in failed:
                # Failed (vLLM's "fail" policy finishes it now): its
                # blocks wait for the worker's word.
                self.withheld.add(req_id)
                self._announce.add(req_id)
                continue
            # The scheduler frees a finished request's blocks.
            self.free.extend(self.local_of.pop(req_id, []))
        for req_id in results.finished_sending or ():
            if req_id in self.withheld:
                self.withheld.discard(req_id)
                self.free.extend(self.local_of.pop(req_id, []))

    def read(self, engine_id: str, port: int, remote_blocks: List[int], host: str = "127.0.0.1") -> Tuple[str, List[int]]:
        """Starts one request reading these remote blocks into free local
        ones; returns (request id, local blocks)."""
        local = [self.free.pop(0) for _ in remote_blocks]
        req_id = f"req-{next(_ids)}"
        self.local_of[req_id] = local
        self.step({req_id: (local, remote_blocks, engine_id, f"remote-{req_id}")}, host, port)
        return req_id, local

    def wait(self, req_ids: List[str], within: float, what: str = "requests ended") -> Dict[str, Outcome]:
        import pytest

        deadline = time.monotonic() + within
        while True:
            if all(r in self.outcomes for r in req_ids):
                return {r: self.outcomes[r] for r in req_ids}
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: {[r for r in req_ids if r not in self.outcomes]} not within {within:.1f} s; "
                            f"held: {self.worker.held_requests()}; snapshot: {self.ka.snapshot() if self.ka else None}")
            self.step()
            time.sleep(0.005)

    def poll(self, what: str, check, within: float) -> Any:
        import pytest

        deadline = time.monotonic() + within
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {within:.1f} s; snapshot: {self.ka.snapshot() if self.ka else None}; "
                            f"tables: {self.tables()}")
            self.step()
            time.sleep(0.005)

    def tables(self, engine_id: Optional[str] = None) -> Dict[str, Any]:
        """vLLM's own per-engine tables (every one ``_cleanup_remote_engine``
        clears), for ``engine_id`` or all."""
        w = self.worker
        # Per-engine tables of vLLM 0.33 and 0.34 (0.34 replaced
        # dst_uses_region_group_mapping with _dst_pairs): those this vLLM has.
        names = {name: getattr(w, name) for name in (
            "_remote_agents", "dst_xfer_side_handles", "kv_caches_base_addr", "dst_num_blocks",
            "dst_region_num_blocks", "dst_region_group_ids", "dst_uses_region_group_mapping", "_dst_pairs",
            "dst_region_mem_types", "tp_mappings", "draft_tp_mappings", "_engine_clock_offset",
            "_engine_last_active",
        ) if isinstance(getattr(w, name, None), dict)}
        out = {}
        for name, table in names.items():
            keys = [k for k in table if (engine_id is None or k == engine_id) and k != w.engine_id]
            if keys:
                out[name] = keys
        by_addr = [a for a, e in w._engine_by_address.items() if engine_id is None or e == engine_id]
        if by_addr:
            out["_engine_by_address"] = by_addr
        if w.transfer_topo is not None and engine_id is not None:
            try:
                w.transfer_topo.get_engine_info(engine_id)
                out["transfer_topo"] = [engine_id]
            except Exception:  # noqa: BLE001 - not registered there
                pass
        return out

    def engines(self) -> Dict[str, Dict[str, Any]]:
        """The service's engines by id (its snapshot)."""
        return {e["engine"]: e for e in (self.ka.snapshot().get("engines", []) if self.ka else [])}

    def shutdown(self) -> None:
        with self._scope(self.config):
            self.connector.shutdown()
