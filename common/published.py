"""Architecture fields of published checkpoints' ``config.json`` (no weights, no hub): the shapes real-size runs,
benchmarks and hardware-recipe checks build random-initialised models from.

``trainer.models.hf_config.model_config_from_hf_dict(PUBLISHED_CONFIGS[name], source=name)`` gives the trainer's
``ModelConfig``, ``tools.make_tiny_model.make_published_model`` writes a random model directory (a recipe's
``[model.create_published]``); the published parameter count of each is in :data:`PUBLISHED_PARAMS` (what
``ModelConfig.num_params`` must come close to).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PUBLISHED_CONFIGS", "PUBLISHED_PARAMS", "published_fields"]

_QWEN3_COMMON: Mapping[str, Any] = {
    "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "vocab_size": 151936, "max_position_embeddings": 40960, "head_dim": 128,
}  # fmt: skip

PUBLISHED_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "Qwen3-0.6B": {
        **_QWEN3_COMMON, "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 3072, "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        **_QWEN3_COMMON, "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288, "tie_word_embeddings": False,
    },
    "Qwen3-30B-A3B": {
        **_QWEN3_COMMON, "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    },
}  # fmt: skip
"""Model name (the HF repository's) -> the architecture fields of its published ``config.json``."""

PUBLISHED_PARAMS: Mapping[str, float] = {"Qwen3-0.6B": 0.6e9, "Qwen3-8B": 8.2e9, "Qwen3-30B-A3B": 30.5e9}
"""Model name -> parameter count as published (rounded)."""


def published_fields(
    architecture: str, num_layers: int | None = None, num_experts: int | None = None, vocab_size: int | None = None
) -> dict[str, Any]:
    """The ``config.json`` fields of ``architecture`` with ``num_layers`` blocks, (mixture-of-experts only)
    ``num_experts`` experts and ``vocab_size`` vocabulary rows instead of the published counts, when given; the blocks
    keep their real shapes. Raises ``ValueError`` naming what is wrong: an unknown architecture, experts for a dense
    one, fewer experts than its top-k, or a larger vocabulary than published."""
    if architecture not in PUBLISHED_CONFIGS:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {sorted(PUBLISHED_CONFIGS)}")
    fields = dict(PUBLISHED_CONFIGS[architecture])
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        if vocab_size > fields["vocab_size"]:
            raise ValueError(f"vocab_size = {vocab_size} exceeds {architecture}'s {fields['vocab_size']}")
        fields["vocab_size"] = vocab_size
    if num_experts is not None:
        top_k = fields.get("num_experts_per_tok")
        if top_k is None:
            raise ValueError(f"{architecture} has no experts: num_experts does not apply")
        if num_experts < top_k:
            raise ValueError(f"num_experts = {num_experts} is below {architecture}'s top-k ({top_k})")
        fields["num_experts"] = num_experts
    return fields
