"""A real vLLM push-mode decode worker on DRAM, as a process of its own.

    python vllm_push_decode.py --port PORT --engine-id ID [--blocks N]

It builds vLLM's own ``NixlPushConnector`` (no keepalive: the decode side
of push mode needs none) of role WORKER with zeroed CPU KV caches, and of
role SCHEDULER for the side channel (vLLM's handshake listener on PORT,
where the prefill loads this decode's metadata before writing). It reads
one JSON command per line on stdin::

    {"req": "r1", "local": [3, 4], "p_engine": "P", "p_host": "127.0.0.1",
     "p_port": 5600, "seed": 17, "remote": [1, 2]}

and hands vLLM's worker what vLLM's push scheduler would: the request to
receive (``reqs_to_recv``) and its ``PUSH_REG`` registration
(``push_registrations``), which vLLM's writer thread sends to the prefill.
It steps the worker (``get_transfer_results``) until killed. It prints one
JSON line ``READY {...}`` (engine id, agent name, port, pid), then ``HB``
for each heartbeat notification vLLM's writer takes from the agent, and,
for each request vLLM reports received, ``DONE {"req": ..., "ok": ...,
"bad": [...]}`` with every byte of its blocks checked against the
prefill's pattern (``vllm_env.block_pattern`` of ``seed``), flushed at
once.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_env  # noqa: E402

PUSH_CONNECTOR = ("NixlPushConnector", None)


def add_registration(meta, cmd: dict, engine_id: str, port: int, host: str = "127.0.0.1") -> None:
    """Adds to ``meta`` what vLLM's push scheduler hands a decode worker for
    one new request (its fields as vLLM 0.33/0.34 name them)."""
    req = cmd["req"]
    meta.add_new_req_to_recv(
        request_id=req,
        local_block_ids=(list(cmd["local"]),),
        kv_transfer_params={
            "remote_block_ids": (),
            "remote_engine_id": cmd["p_engine"],
            "remote_request_id": req,
            "remote_host": cmd["p_host"],
            "remote_port": cmd["p_port"],
            "tp_size": 1,
        },
        awaiting_kvs=True,
    )
    meta.push_registrations[req] = {
        "request_id": req,
        "decode_engine_id": engine_id,
        "decode_host": host,
        "decode_port": port,
        "decode_tp_size": 1,
        "local_block_ids": (list(cmd["local"]),),
        "remote_engine_id": cmd["p_engine"],
        "remote_host": cmd["p_host"],
        "remote_port": cmd["p_port"],
        "remote_tp_size": 1,
        "remote_pp_size": 1,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--blocks", type=int, default=64)
    args = ap.parse_args()

    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.port)
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    vllm_env.setup_environment()
    vllm_env.patch_cpu_block_sizes()
    from vllm.config import set_current_vllm_config

    config = vllm_env.vllm_config(PUSH_CONNECTOR, args.engine_id, kv_role="kv_consumer")
    vllm_env.init_distributed(config)
    worker_conn, caches = vllm_env.make_worker_connector(config, args.blocks)
    scheduler_conn = vllm_env.make_scheduler_connector(config, args.blocks)
    with set_current_vllm_config(config):
        scheduler_conn.set_xfer_handshake_metadata_pp_aware({(0, 0): worker_conn.get_handshake_metadata()})
    worker = worker_conn.connector_worker
    agent = worker.nixl_wrapper
    real_get = agent.get_new_notifs

    def get_new_notifs(*a, **k):  # what vLLM's writer thread takes, heartbeats printed
        got = real_get(*a, **k)
        for notifs in got.values():
            for n in notifs:
                if bytes(n).startswith(b"HB:"):
                    print("HB", flush=True)
        return got

    agent.get_new_notifs = get_new_notifs

    commands: "queue.Queue[dict]" = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))

    threading.Thread(target=read_stdin, daemon=True).start()
    print("READY " + json.dumps({"engine_id": args.engine_id, "agent": agent.name, "port": args.port,
                                 "pid": os.getpid(), "blocks": args.blocks}), flush=True)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    pending: dict = {}
    while True:
        meta = NixlConnectorMetadata()
        while True:
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                break
            pending[cmd["req"]] = cmd
            add_registration(meta, cmd, args.engine_id, args.port)
        with set_current_vllm_config(config):
            worker.start_load_kv(meta)
            results = worker.get_transfer_results()
        failed = set(results.failed_recving or ())
        for req in set(results.finished_recving or ()) | failed:
            cmd = pending.pop(req, None)
            if cmd is None:
                continue
            bad = [] if req in failed else [
                [lb, rb] for lb, rb in zip(cmd["local"], cmd["remote"])
                if not vllm_env.block_matches(caches, lb, cmd["seed"], rb)]
            print("DONE " + json.dumps({"req": req, "ok": req not in failed, "bad": bad}), flush=True)
        time.sleep(0.005)


if __name__ == "__main__":
    sys.exit(main())
