"""A real vLLM prefill worker on DRAM, as a process of its own.

    python vllm_peer.py --port PORT --engine-id ID [--connector vllm|keepalive] [--blocks N]

It builds vLLM 0.33's pull-mode NIXL connector (vLLM's own NixlConnector
by default, or ours) of role WORKER with CPU KV caches filled with a
pattern (``vllm_env.block_pattern`` of a seed it picks), and of role
SCHEDULER for the side channel (vLLM's handshake listener on PORT), then
progresses the worker (``get_finished``) until killed. It prints one JSON
line ``READY {...}`` (engine id, agent name, seed, port, pid), then
``HB <ids>`` for each lease heartbeat it receives (the HB: notifications
vLLM's worker consumes) and ``RD <id>`` for each read-completion
notification, flushed at once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_env  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--connector", choices=("vllm", "keepalive"), default="vllm")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.port)
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    vllm_env.setup_environment()
    if args.connector == "keepalive":
        import nixl_keepalive  # noqa: F401 - before the first nixl_agent
    vllm_env.patch_cpu_block_sizes()
    from vllm.config import set_current_vllm_config

    connector = vllm_env.KEEPALIVE_CONNECTOR if args.connector == "keepalive" else vllm_env.VLLM_CONNECTOR
    config = vllm_env.vllm_config(connector, args.engine_id)
    vllm_env.init_distributed(config)
    seed = args.seed if args.seed is not None else random.randrange(1, 1 << 30)
    worker_conn, caches = vllm_env.make_worker_connector(config, args.blocks)
    vllm_env.fill(caches, seed)
    scheduler_conn = vllm_env.make_scheduler_connector(config, args.blocks)
    with set_current_vllm_config(config):
        scheduler_conn.set_xfer_handshake_metadata_pp_aware({(0, 0): worker_conn.get_handshake_metadata()})
    worker = worker_conn.connector_worker
    agent = worker.nixl_wrapper
    real_get = agent.get_new_notifs

    def get_new_notifs(*a, **k):  # what vLLM's worker consumes, printed
        got = real_get(*a, **k)
        for notifs in got.values():
            for n in notifs:
                text = n.decode(errors="replace")
                print(("HB " + text[3:]) if text.startswith("HB:") else ("RD " + text), flush=True)
        return got

    agent.get_new_notifs = get_new_notifs
    print("READY " + json.dumps({"engine_id": args.engine_id, "agent": agent.name, "seed": seed,
                                 "port": args.port, "pid": os.getpid(), "blocks": args.blocks}), flush=True)
    while True:
        worker.get_finished()
        time.sleep(0.005)


if __name__ == "__main__":
    sys.exit(main())
