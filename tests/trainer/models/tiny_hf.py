"""Tiny HF reference models, built from transformers config classes (never downloaded), all weights randomised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# name -> (HF config class name, kwargs). Dims are multiples of 8 (16-byte aligned rows for grouped_mm).
TINY_HF: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3_scaled": (
        "LlamaConfig",
        dict(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_tied": (
        "Qwen3Config",
        dict(
            vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe_tied_unnormed": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=3,
            norm_topk_prob=False, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=True,
        ),
    ),
}
HF_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
}


def make_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random HF causal LM in fp32, every weight (norms included) randomised so mistakes show."""
    import transformers

    config_cls, kwargs = TINY_HF[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[config_cls])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model


def save_hf_model(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    model = make_hf_model(name, seed)
    model.save_pretrained(str(path))
    return model
