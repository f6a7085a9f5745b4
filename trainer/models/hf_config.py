"""HF ``config.json`` <-> :class:`ModelConfig`, both ways, without torch or transformers.

:func:`model_config_from_hf` reads a local HF checkpoint directory's ``config.json`` (stock Llama 3 / 3.1, Qwen3,
Qwen3-MoE layouts, legacy ``rope_theta``/``rope_scaling`` or transformers 5 ``rope_parameters``) and rejects settings
this model code does not implement (biases, sliding windows, dense layers inside a MoE stack, other rope types) rather
than silently ignoring them. :func:`hf_config_dict` writes the inverse, which transformers and vLLM both load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config import Config, validate_config
from trainer.models.config import Family, ModelConfig

__all__ = ["hf_config_dict", "model_config_from_hf", "model_config_from_hf_dict"]

_FAMILY_OF_MODEL_TYPE: dict[str, Family] = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_HF_NAMES: dict[Family, tuple[str, str]] = {
    "llama3": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# transformers' Qwen3MoeConfig default, used when a config.json leaves router_aux_loss_coef out.
_QWEN3_MOE_AUX_LOSS_COEF = 0.001


def model_config_from_hf(path: str, **block_overrides: Any) -> ModelConfig:
    """Build a :class:`ModelConfig` from ``<path>/config.json`` (a local HF checkpoint directory).

    ``block_overrides`` set any top-level :class:`ModelConfig` field the HF file does not decide, typically the
    block choices (``attention="eager"``, ``output_head="dense"``, ``output_chunk_size=512``, ``moe_experts="loop"``)
    or ``max_seq_len``. Raises ``ValueError`` for a missing file, an unsupported model type or an unsupported setting.
    """
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path}: not found; expected a local HF checkpoint directory with a config.json")
    return model_config_from_hf_dict(json.loads(cfg_path.read_text()), source=str(cfg_path), **block_overrides)


def model_config_from_hf_dict(raw: Mapping[str, Any], source: str = "<config.json>", **overrides: Any) -> ModelConfig:
    """Like :func:`model_config_from_hf` for an already parsed ``config.json`` mapping."""
    model_type = raw.get("model_type")
    family = _FAMILY_OF_MODEL_TYPE.get(str(model_type))
    if family is None:
        supported = sorted(_FAMILY_OF_MODEL_TYPE)
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (supported: {supported})")
    _reject_unsupported(raw, family, source)
    num_heads = int(raw["num_attention_heads"])
    data: dict[str, Any] = {
        "family": family,
        "vocab_size": int(raw["vocab_size"]),
        "dim": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": num_heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or num_heads),
        "head_dim": int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        "ffn_hidden_dim": int(raw["intermediate_size"]),
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "qk_norm": family != "llama3",
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "max_seq_len": int(raw.get("max_position_embeddings", 4096)),
    }
    data.update(_rope_fields(raw, source))
    if family == "qwen3_moe":
        data["moe"] = {
            "num_experts": int(raw.get("num_experts", raw.get("num_local_experts", 0))),
            "top_k": int(raw["num_experts_per_tok"]),
            "expert_ffn_hidden_dim": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "aux_loss_coef": float(raw.get("router_aux_loss_coef", _QWEN3_MOE_AUX_LOSS_COEF)),
        }
    # Config values (``lora=LoRAConfig(...)``) go in as their JSON form: validation runs in JSON mode.
    data.update({k: v.model_dump(mode="json") if isinstance(v, Config) else v for k, v in overrides.items()})
    return validate_config(ModelConfig, data, source=source)


def _reject_unsupported(raw: Mapping[str, Any], family: Family, source: str) -> None:
    problems = []
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={raw['hidden_act']!r} (only 'silu' is implemented)")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            problems.append(f"{key}=true (biases are not implemented)")
    if raw.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention is not implemented)")
    if family == "qwen3_moe":
        if int(raw.get("decoder_sparse_step", 1)) != 1 or raw.get("mlp_only_layers"):
            problems.append("decoder_sparse_step != 1 or mlp_only_layers set (every layer must be a MoE layer)")
        if raw.get("shared_expert_intermediate_size"):
            problems.append("shared experts are not implemented")
    if problems:
        raise ValueError(f"{source}: unsupported setting(s): " + "; ".join(problems))


def _rope_fields(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Rope theta and scaling from transformers 5 ``rope_parameters`` or legacy ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if rope_type == "default":
        return out
    if rope_type != "llama3":
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (supported: 'default', 'llama3')")
    out["rope_scaling"] = {
        "factor": float(scaling["factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]),
        "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_seq_len": int(scaling["original_max_position_embeddings"]),
    }
    return out


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` content for ``cfg``: the stock HF layout of its family, loadable by transformers and vLLM.

    ``dtype`` (``"float32"``, ``"bfloat16"``, ...) is the dtype the weights are saved in. Rope settings are written
    both as transformers 5 ``rope_parameters`` and as legacy ``rope_theta``/``rope_scaling`` for older readers.
    """
    model_type, architecture = _HF_NAMES[cfg.family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if cfg.family == "llama3":
        out["mlp_bias"] = False
    else:
        out.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers})
    if cfg.moe is not None:
        out.update(
            {
                "num_experts": cfg.moe.num_experts,
                "num_experts_per_tok": cfg.moe.top_k,
                "moe_intermediate_size": cfg.moe.expert_ffn_hidden_dim,
                "norm_topk_prob": cfg.moe.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "output_router_logits": False,
                "router_aux_loss_coef": cfg.moe.aux_loss_coef,
            }
        )
    return out
