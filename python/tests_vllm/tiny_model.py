"""A model config for the vLLM tier, written here (no hub, no weights).

vLLM's connector code needs a ``ModelConfig``, which reads a Hugging Face
``config.json``; the tier never loads weights. :func:`write_hf_cache`
writes one, for ``facebook/opt-125m`` (the model vLLM's own connector unit
tests name), into a Hugging Face hub cache laid out as the hub client
reads it offline (``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE``).

Run as a script: ``python tiny_model.py HF_HUB_CACHE`` prints the snapshot
directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL = "facebook/opt-125m"
REVISION = "0000000000000000000000000000000000000000"

#: OPT-125m's architecture (a public model's published shape): 12 layers,
#: 12 heads of 64, hidden 768, vocab 50272.
OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


#: OPT-350m's architecture (published shape): 24 layers, 16 heads of 64,
#: hidden 1024, FFN 4096, embeddings projected from 512, layer norm after.
#: vLLM's compatibility-hash unit tests name this model.
OPT_350M = dict(
    OPT_125M,
    ffn_dim=4096,
    hidden_size=1024,
    num_attention_heads=16,
    num_hidden_layers=24,
    word_embed_proj_dim=512,
    do_layer_norm_before=False,
)

#: Every model config written, by hub name.
MODELS = {MODEL: OPT_125M, "facebook/opt-350m": OPT_350M}


def write_hf_cache(hub_cache: Path) -> Path:
    """Writes the config.json of every model in :data:`MODELS` into
    ``hub_cache`` (a ``HF_HUB_CACHE`` directory); returns
    ``facebook/opt-125m``'s snapshot directory. Idempotent."""
    first = None
    for name, config in MODELS.items():
        snapshot = _write_one(hub_cache, name, config)
        first = first or snapshot
    return first


def _write_one(hub_cache: Path, model: str, model_config: dict) -> Path:
    repo = hub_cache / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    config = snapshot / "config.json"
    text = json.dumps(model_config, indent=2, sort_keys=True) + "\n"
    if not config.exists() or config.read_text() != text:
        config.write_text(text)
    gen = snapshot / "generation_config.json"
    if not gen.exists():
        gen.write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}) + "\n")
    return snapshot


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: tiny_model.py HF_HUB_CACHE", file=sys.stderr)
        sys.exit(2)
    print(write_hf_cache(Path(sys.argv[1])))
