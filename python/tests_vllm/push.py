"""Push mode's two sides for the tier: real vLLM push decodes as processes
(``vllm_push_decode.py``, vLLM's own ``NixlPushConnector``) and our push
prefill (``KeepaliveNixlPushConnector``) in the test process, driven
through vLLM's worker-level connector API as vLLM's model runner drives it
(``start_load_kv(NixlConnectorMetadata)``, ``get_transfer_results()`` once
per step). Waits poll with deadlines."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

import vllm_env
import warm_start
from processes import SignalledProcess

HERE = Path(__file__).resolve().parent

KEEPALIVE_PUSH = ("KeepaliveNixlPushConnector", "nixl_keepalive.vllm")
#: How long a decode process may take to start (vLLM imports in ~15 s here).
START_WITHIN = 180.0


class PushDecode(SignalledProcess):
    """A real vLLM push decode worker process (``vllm_push_decode.py``)."""

    role = "decode"

    def __init__(self, engine_id: str, port: int, blocks: int = 64) -> None:
        self.engine_id = engine_id
        self.port = port
        self.lines: List[str] = []
        self.heartbeats: List[float] = []
        self.done: Dict[str, Dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.proc = warm_start.pool().popen(
            [str(HERE / "vllm_push_decode.py"), "--port", str(port), "--engine-id", engine_id,
             "--blocks", str(blocks)],
            env=warm_start.peer_env(), stdin=True,
        )
        self.info: Dict = {}
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_WITHIN
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                pytest.fail(f"decode {engine_id} exited ({self.proc.returncode}) before READY: {self.lines[-5:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"decode {engine_id} not READY within {START_WITHIN} s: {self.lines[-5:]}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._lock:
                self.lines.append(line)
                if line == "HB":
                    self.heartbeats.append(time.monotonic())
                elif line.startswith("DONE "):
                    d = json.loads(line[5:])
                    self.done[d["req"]] = d
            if line.startswith("READY "):
                self.info = json.loads(line[6:])
                self._ready.set()

    @property
    def agent(self) -> str:
        return str(self.info["agent"])

    def register(self, req: str, local: List[int], prefill: "PushPrefill", remote: List[int]) -> None:
        """What vLLM's push scheduler does for a new request on this decode:
        its blocks registered with the prefill (``PUSH_REG``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"req": req, "local": local, "p_engine": prefill.engine_id,
                                          "p_host": "127.0.0.1", "p_port": prefill.port, "seed": prefill.seed,
                                          "remote": remote}) + "\n")
        self.proc.stdin.flush()

    def heartbeats_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for h in self.heartbeats if h >= t)

    def outcome(self, req: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            return self.done.get(req)


class PushPrefill:
    """Our push prefill worker (``KeepaliveNixlPushConnector``) in this
    process, with its side channel (a SCHEDULER connector) on ``port``."""

    def __init__(self, engine_id: str, port: int, blocks: int = 64, keepalive: Optional[Dict[str, Any]] = None,
                 seed: int = 7, connector: tuple = KEEPALIVE_PUSH, lease: float = 30.0) -> None:
        from vllm.config import set_current_vllm_config

        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        self.engine_id = engine_id
        self.port = port
        self.seed = seed
        self.lease = lease
        self._scope = set_current_vllm_config
        self.config = vllm_env.vllm_config(connector, engine_id, {"keepalive": dict(keepalive or {})},
                                           kv_role="kv_producer")
        self.connector, self.caches = vllm_env.make_worker_connector(self.config, blocks)
        vllm_env.fill(self.caches, seed)
        self.scheduler = vllm_env.make_scheduler_connector(self.config, blocks)
        with set_current_vllm_config(self.config):
            self.scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): self.connector.get_handshake_metadata()})
        self.worker = self.connector.connector_worker
        self.sent: Dict[str, float] = {}

    @property
    def ka(self) -> Any:
        return self.worker.keepalive()

    def step(self, finished: Optional[Dict[str, List[int]]] = None, results: bool = True) -> None:
        """One engine step: requests whose prefill finished (their blocks
        to push) handed to the worker, then (``results``) its transfer
        results taken, which polls the WRITEs."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

        meta = NixlConnectorMetadata()
        for req, blocks in (finished or {}).items():
            meta.push_finished_blocks[req] = (list(blocks),)
            meta.reqs_in_batch.add(req)
            meta.reqs_to_send[req] = time.perf_counter() + self.lease
        with self._scope(self.config):
            self.worker.start_load_kv(meta)
            if not results:
                return
            got = self.worker.get_transfer_results()
        for req in got.finished_sending or ():
            self.sent.setdefault(req, time.monotonic())

    def poll(self, what: str, check, within: float) -> Any:
        deadline = time.monotonic() + within
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {within:.1f} s; snapshot: {self.ka.snapshot() if self.ka else None}; "
                            f"tables: {self.tables()}; writes in flight: {self.worker.writes_in_flight()}")
            self.step()
            time.sleep(0.005)

    def tables(self, engine_id: Optional[str] = None) -> Dict[str, Any]:
        """vLLM's own per-engine tables (those ``_cleanup_remote_engine``
        clears) holding ``engine_id`` (or any remote engine)."""
        w = self.worker
        out = {}
        for name in ("_remote_agents", "dst_xfer_side_handles", "kv_caches_base_addr", "dst_num_blocks",
                     "dst_region_num_blocks", "_dst_pairs", "dst_region_mem_types", "tp_mappings",
                     "_engine_clock_offset", "_engine_last_active"):
            table = getattr(w, name, None)
            if isinstance(table, dict):
                keys = [k for k in table if (engine_id is None or k == engine_id) and k != w.engine_id]
                if keys:
                    out[name] = keys
        return out

    def engines(self) -> Dict[str, Dict[str, Any]]:
        return {e["engine"]: e for e in (self.ka.snapshot().get("engines", []) if self.ka else [])}

    def released(self, engine_id: str) -> bool:
        """The decode is gone from the service and from vLLM's tables."""
        return engine_id not in self.engines() and not self.tables(engine_id)

    def shutdown(self) -> None:
        with self._scope(self.config):
            self.connector.shutdown()
            try:
                self.scheduler.shutdown()
            except Exception:  # noqa: BLE001 - its listener is a daemon thread
                pass
