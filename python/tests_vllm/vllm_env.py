"""vLLM's worker-level connector API, set up the way vLLM's own connector
unit tests drive it (a ``VllmConfig``, a connector of role WORKER,
``register_kv_caches`` on CPU tensors), for real prefill and decode
workers on DRAM. Written for this project against vLLM 0.33's public
classes; nothing here is vLLM's code.

Each block of a prefill's KV cache holds a pattern derived from the
prefill's seed and the block id (:func:`block_pattern`), so a decode can
check every byte it read.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

BLOCK_SIZE = 16  # tokens per block (the CPU backend wants a multiple of 16)
NUM_LAYERS = 2
NUM_KV_HEADS = 12  # OPT-125m
HEAD_SIZE = 64

KEEPALIVE_CONNECTOR = ("KeepaliveNixlConnector", "nixl_keepalive.vllm")
VLLM_CONNECTOR = ("NixlConnector", None)


def setup_environment(hub_cache: Optional[str] = None) -> None:
    """The process environment the tier's vLLM runs in: the CPU platform,
    the hub offline with the config this project wrote, UCX on loopback."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # No GPU is visible (there is none): vLLM 0.34's CPU platform refuses to
    # start on x86 without Triton ("vLLM on x86 CPUs requires Triton
    # (triton-cpu)"), and its Triton check counts the CUDA wheel's Triton
    # as usable only when no CUDA device is visible (its distributed-start
    # case). No Triton kernel runs in the tier (no model is executed).
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if hub_cache:
        os.environ["HF_HUB_CACHE"] = hub_cache
    from tiny_model import write_hf_cache  # noqa: E402 - beside this file

    write_hf_cache(Path(os.environ.get("HF_HUB_CACHE", os.path.expanduser("~/.cache/huggingface/hub"))))


def patch_cpu_block_sizes() -> None:
    """The CPU attention backend declares kernel block sizes that are
    multiples of 32; the tier uses 16-token blocks (as vLLM's unit-test
    conftest does, this widens the declaration; the kernels never run)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(  # type: ignore[method-assign]
        lambda kv_cache_spec=None: [MultipleOf(16)]
    )


def vllm_config(connector: Tuple[str, Optional[str]], engine_id: str, extra: Optional[Dict[str, Any]] = None,
                kv_role: str = "kv_both", failure_policy: str = "fail") -> Any:
    """A ``VllmConfig`` for one worker with this connector."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0)
    scheduler = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048,
                                is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.kv_cache_layout = "LBHNC"
    name, module = connector
    kv = KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role=kv_role,
                          kv_buffer_device="cpu", engine_id=engine_id,
                          kv_connector_extra_config=extra or {}, kv_load_failure_policy=failure_policy)
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                      kv_transfer_config=kv, device_config=DeviceConfig("cpu"))


def kv_cache_config(num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    layers = [f"layer{i}" for i in range(NUM_LAYERS)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def kv_caches(config: Any, num_blocks: int) -> Dict[str, Any]:
    """One dense CPU allocation, viewed per layer as vLLM's model runner
    views it (``create_kv_cache_views``, layout LBHNC): ``[B, H, N, C]``."""
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    spec = config.kv_cache_groups[0].kv_cache_spec
    layers = list(config.kv_cache_groups[0].layer_names)
    raw = torch.zeros(spec.page_size_bytes * num_blocks * len(layers), dtype=torch.int8)
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, num_blocks, len(layers), KVCacheLayout.LBHNC)
    tensor = KVCacheTensor(size=raw.numel(), layers=layers, layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBHNC, tensor)
    caches = dict(zip(layers, views))
    caches["__raw__"] = raw  # kept alive with the views; not a layer
    return caches


def block_pattern(seed: int, block: int) -> int:
    """The byte every byte of ``block`` holds at a prefill with ``seed``
    (never 0: a decode's blocks start zeroed)."""
    return ((seed * 131 + block * 29) % 251) + 1


def _block_bytes(cache: Any, block: int) -> Any:
    import torch

    return cache[block].contiguous().view(torch.uint8) if cache.dim() > 1 else cache


def layers(caches: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in caches.items() if k != "__raw__"}


def fill(caches: Dict[str, Any], seed: int) -> None:
    import torch

    for cache in layers(caches).values():
        for b in range(cache.shape[0]):
            cache[b].view(torch.uint8).fill_(block_pattern(seed, b)) if cache[b].is_contiguous() else \
                cache[b].copy_(torch.full_like(cache[b].view(torch.uint8), block_pattern(seed, b)).view(cache.dtype))


def block_matches(caches: Dict[str, Any], block: int, seed: int, remote_block: int) -> bool:
    """Whether local ``block`` holds what the prefill with ``seed`` has in
    ``remote_block``, in every layer."""
    want = block_pattern(seed, remote_block)
    return all(bool((_block_bytes(c, block) == want).all()) for c in layers(caches).values())


def block_is_zero(caches: Dict[str, Any], block: int) -> bool:
    return all(bool((_block_bytes(c, block) == 0).all()) for c in layers(caches).values())


_dist_ready = False


def init_distributed(config: Any) -> None:
    """vLLM's distributed state for a world of one (gloo), once per process."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized

    fd, path = tempfile.mkstemp(prefix="vllm-dist-")
    os.close(fd)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{path}", local_rank=0,
                                     backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    _dist_ready = True


def make_worker_connector(config: Any, num_blocks: int) -> Tuple[Any, Dict[str, Any]]:
    """The connector of role WORKER for ``config``, its KV caches registered."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    kvc = kv_cache_config(num_blocks)
    # vLLM's CPU worker pins its process to the last core of each NUMA node
    # (a core kept for KV transfer); every peer of this tier would share
    # that one core. The tier's processes keep the cores they had.
    cores = os.sched_getaffinity(0)
    try:
        with set_current_vllm_config(config):
            connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kvc)
            caches = kv_caches(kvc, num_blocks)
            connector.register_kv_caches(layers(caches))
    finally:
        os.sched_setaffinity(0, cores)
    return connector, caches


def make_scheduler_connector(config: Any, num_blocks: int) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with set_current_vllm_config(config):
        return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config(num_blocks))


def recv_metadata(reqs: Dict[str, Tuple[list, list, str, str]], host: str, port: int,
                  heartbeat: Optional[Dict[str, Tuple[set, str, int]]] = None) -> Any:
    """A ``NixlConnectorMetadata`` asking the worker to read, per local
    request id, (local block ids, remote block ids, remote engine id,
    remote request id) from the prefill at host:port."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo

    meta = NixlConnectorMetadata()
    for req_id, (local, remote, engine_id, remote_req) in reqs.items():
        meta.add_new_req_to_recv(
            request_id=req_id,
            local_block_ids=(list(local),),
            kv_transfer_params={
                "remote_block_ids": (list(remote),),
                "remote_engine_id": engine_id,
                "remote_request_id": remote_req,
                "remote_host": host,
                "remote_port": port,
                "tp_size": 1,
            },
            awaiting_kvs=True,
        )
    for engine_id, (ids, h, p) in (heartbeat or {}).items():
        meta.heartbeat_by_engine[engine_id] = HeartbeatInfo(req_ids=set(ids), host=h, port=p, tp_size=1)
    return meta
