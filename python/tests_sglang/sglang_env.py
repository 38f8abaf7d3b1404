"""SGLang 0.5.23's disaggregation managers on this CPU machine, as the
SGLang tier runs them: no model weights, no GPU, KV and aux buffers in DRAM.

SGLang's ``ServerArgs`` reads a Hugging Face ``config.json``: a local
directory with the tiny model's config (``python/tests_vllm/tiny_model.py``:
OPT-125m's published shape) stands for the model. :func:`publish` installs
the process's config as SGLang's scheduler does (one role per process);
:func:`kv_args` describes the DRAM buffers a manager registers with NIXL.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests_vllm"))
import tiny_model  # noqa: E402

#: KV geometry: LAYERS layers of K and V, SLOTS pages of ITEM bytes each
#: (page size 1; a rank may take bigger pages), and one aux buffer of
#: AUX_ITEM bytes per slot.
LAYERS, SLOTS, ITEM, AUX_ITEM = 2, 32, 512, 64


def model_dir(root: Path) -> Path:
    """A directory SGLang takes as ``model_path``: the tiny model's config."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(tiny_model.OPT_125M, indent=2, sort_keys=True) + "\n")
    return root


def publish(mode: str, model: Path, bootstrap_port: int) -> Any:
    """SGLang's process-wide config for a ``prefill`` or ``decode`` rank 0
    (TP 1, PP 1) with the NIXL transfer backend; returns the ServerArgs."""
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=str(model), disaggregation_mode=mode, disaggregation_transfer_backend="nixl",
                    disaggregation_bootstrap_port=bootstrap_port, device="cpu", skip_tokenizer_init=True)
    rc.publish(sa, role="test", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
    # One process, no torch.distributed groups: PP 1 needs no pipeline group.
    rc.get_parallel().override_permanently(pp_group=None)
    return sa


def buffers(item: int = ITEM) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """Zeroed KV buffers (K and V of each layer, pages of ``item`` bytes)
    and the aux buffer."""
    kv = [np.zeros(SLOTS * item, dtype=np.uint8) for _ in range(2 * LAYERS)]
    aux = [np.zeros(SLOTS * AUX_ITEM, dtype=np.uint8)]
    return kv, aux


def kv_args(kv: List[np.ndarray], aux: List[np.ndarray]) -> Any:
    """SGLang's KVArgs for these DRAM buffers, with the fields its
    scheduler sets (sglang/srt/disaggregation/prefill.py, decode.py)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = 0, 0, 0, None
    a.kv_cache_dtype_str, a.kv_layout = "float16", None
    a.prefill_start_layer, a.prefill_end_layer = 0, None
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [kv[0].nbytes // SLOTS] * len(kv)
    a.kv_data_mem_kinds = ["DRAM"] * len(kv)
    a.num_draft_entries = 0
    a.kv_layer_ids = list(range(LAYERS)) * 2
    a.kv_head_num, a.total_kv_head_num, a.page_size = 1, 1, 1
    a.aux_data_ptrs = [b.ctypes.data for b in aux]
    a.aux_data_lens = [b.nbytes for b in aux]
    a.aux_item_lens = [AUX_ITEM]
    a.ib_device, a.gpu_id = None, 0
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts = [], [], []
    a.state_conv_shard_groups, a.is_hybrid_mla_backend, a.swa_kv_cache_layout = [], False, None
    a.mla_compression_ratios, a.kv_buf_groups, a.hidden_kv_layers, a.draft_kv_layers = None, 1, LAYERS, 0
    return a


def page_bytes(room: int, buffer: int, page: int, length: int) -> np.ndarray:
    """The bytes a prefill puts in one page for a room: a function of the
    room, the buffer and the page, so a page written to the wrong place or
    for the wrong room does not match."""
    x = (np.arange(length, dtype=np.uint64) * np.uint64(2654435761)
         + np.uint64(room * 1_000_003 + buffer * 7919 + page * 104_729))
    return (x ^ (x >> np.uint64(13))).astype(np.uint8)
