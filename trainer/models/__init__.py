"""The model family (Llama 3, Qwen 3 dense, Qwen 3 MoE) as plain ``nn.Module``s built from a :class:`ModelConfig`.

Modules: ``config`` (the config tree, no torch), ``hf_config`` (HF config.json both ways, no torch), ``registry``
(swappable block registries), ``transformer`` (``build_model``), ``attention``/``moe``/``output_head`` (blocks),
``hf_names`` (name tables), ``hf_io`` (checkpoints, shard mapping for weight sync).

Names are importable from this package lazily, so ``import trainer.models.config`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "config",
    "MoEConfig": "config",
    "RopeScalingConfig": "config",
    "model_config_from_hf": "hf_config",
    "hf_config_dict": "hf_config",
    "ATTENTION_BLOCKS": "registry",
    "OUTPUT_HEADS": "registry",
    "MOE_EXPERTS": "registry",
    "Transformer": "transformer",
    "build_model": "transformer",
    "positions_from_segments": "transformer",
    "hf_shards": "hf_io",
    "hf_manifest": "hf_io",
    "hf_state_dict": "hf_io",
    "load_hf_checkpoint": "hf_io",
    "save_hf_checkpoint": "hf_io",
    "write_hf_checkpoint": "hf_io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer.models.{module}"), name)
