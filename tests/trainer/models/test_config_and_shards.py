"""ModelConfig validation, HF config.json both ways, and the shard -> HF tensor mapping used by weight sync."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from common.config import ConfigError
from trainer.models.config import ModelConfig
from trainer.models.hf_config import hf_config_dict, model_config_from_hf, model_config_from_hf_dict
from trainer.models.hf_io import canonical_name, hf_manifest, hf_shards, hf_state_dict
from trainer.models.transformer import build_model

BASE = dict(family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            ffn_hidden_dim=48, qk_norm=True)  # fmt: skip
MOE = dict(BASE, family="qwen3_moe", moe=dict(num_experts=5, top_k=2, expert_ffn_hidden_dim=16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_kv_heads=3), "divisible by num_kv_heads"),
        (dict(head_dim=7), "must be even"),
        (dict(family="qwen3_moe"), "moe"),
        (dict(moe=dict(num_experts=2, top_k=1, expert_ffn_hidden_dim=4)), "moe"),
        (dict(qk_norm=False), "qk_norm"),
        (dict(family="llama3"), "qk_norm"),
        (dict(rope_scaling=dict()), "only supported for 'llama3'"),
        (dict(vocab_size=0), "greater than 0"),
        (dict(attention=""), "attention"),
        (dict(num_experts=4), "extra"),
    ],
)
def test_model_config_rejects_inconsistent_fields(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **change})


def test_moe_and_rope_subconfigs_validate():
    with pytest.raises(ValueError, match=r"top_k \(6\) must be <= moe.num_experts \(5\)"):
        ModelConfig(**{**MOE, "moe": dict(num_experts=5, top_k=6, expert_ffn_hidden_dim=16)})
    with pytest.raises(ValueError, match="high_freq_factor"):
        ModelConfig(**{**BASE, "family": "llama3", "qk_norm": False, "rope_scaling": dict(high_freq_factor=0.5)})
    cfg = ModelConfig(**MOE)
    model = build_model(cfg, device="meta")
    assert cfg.num_params == sum(p.numel() for p in model.parameters())
    block = model.layers[0]
    experts = sum(p.numel() for p in block.moe.experts.parameters())
    assert cfg.block_params() == sum(p.numel() for p in block.parameters())
    assert cfg.block_params(expert_shards=5) == cfg.block_params() - experts + experts // 5  # one EP rank's share
    unused = cfg.moe.num_experts - cfg.moe.top_k
    assert cfg.active_params == cfg.num_params - cfg.num_layers * experts * unused // cfg.moe.num_experts


def test_config_module_imports_no_torch():
    code = "import sys, trainer.models.config, trainer.models.hf_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(**MOE),
        ModelConfig(**{**BASE, "tie_embeddings": True, "rope_theta": 1e6}),
        ModelConfig(**{**BASE, "family": "llama3", "qk_norm": False, "rope_scaling": dict(factor=32.0)}),
    ],
)
def test_hf_config_round_trip(cfg, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    assert model_config_from_hf(str(tmp_path), output_head=cfg.output_head) == cfg
    assert model_config_from_hf(str(tmp_path), attention="eager").attention == "eager"


def test_legacy_llama31_config_json_is_read():
    legacy = {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    }  # fmt: skip
    cfg = model_config_from_hf_dict(legacy)
    assert cfg.head_dim == 128 and cfg.rope_theta == 500000.0 and cfg.rope_scaling.original_max_seq_len == 8192


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "not supported"),
        ({"attention_bias": True}, "biases"),
        ({"use_sliding_window": True}, "sliding"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"mlp_only_layers": [0]}, "MoE layer"),
    ],
)
def test_unsupported_hf_settings_are_rejected(change, message):
    raw = {**hf_config_dict(ModelConfig(**MOE)), **change}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf_dict(raw)


def test_unknown_override_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(ModelConfig(**BASE))))
    with pytest.raises(ConfigError, match="attn"):
        model_config_from_hf(str(tmp_path), attn="sdpa")
    with pytest.raises(ValueError, match="not found"):
        model_config_from_hf(str(tmp_path / "nowhere"))


def _split(full: torch.Tensor, dim: int, num_ranks: int):
    """FSDP-like uneven split along ``dim``: (local piece, offsets) per rank."""
    size = -(-full.shape[dim] // num_ranks)
    for start in range(0, full.shape[dim], size):
        offsets = [0] * full.ndim
        offsets[dim] = start
        yield full.narrow(dim, start, min(size, full.shape[dim] - start)), tuple(offsets)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("cfg_kw", [MOE, dict(BASE, tie_embeddings=True)])
def test_hf_shards_reassemble_to_the_hf_state_dict(cfg_kw, dim):
    cfg = ModelConfig(**cfg_kw)
    torch.manual_seed(0)
    model = build_model(cfg)
    expected = dict(hf_state_dict(model))
    rebuilt = {name: torch.full(shape, float("nan")) for name, shape, _ in hf_manifest(cfg)}
    assert set(rebuilt) == set(expected)
    for name, p in model.named_parameters():
        d = min(dim, p.ndim - 1)
        for local, offsets in _split(p.detach(), d, num_ranks=3):
            for hf_name, piece, gshape, goffs in hf_shards(cfg, name, local, tuple(p.shape), offsets):
                assert tuple(rebuilt[hf_name].shape) == gshape
                index = tuple(slice(o, o + s) for o, s in zip(goffs, piece.shape, strict=True))
                rebuilt[hf_name][index] = piece
    for name, tensor in expected.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_hf_shards_of_an_expert_shard_are_whole_experts():
    cfg = ModelConfig(**MOE)
    w1 = torch.randn(2, 16, 32)  # experts 3 and 4 of 5, as rank 1 of an FSDP split holds them
    out = list(hf_shards(cfg, "layers.1._checkpoint_wrapped_module.moe.experts.w1", w1, (5, 16, 32), (3, 0, 0)))
    assert [(n, s, o) for n, _, s, o in out] == [
        ("model.layers.1.mlp.experts.3.gate_proj.weight", (16, 32), (0, 0)),
        ("model.layers.1.mlp.experts.4.gate_proj.weight", (16, 32), (0, 0)),
    ]
    assert torch.equal(out[1][1], w1[1])
    wq = list(hf_shards(cfg, "layers.0.attention.wq.weight", torch.zeros(10, 32), (32, 32), (20, 0)))
    assert [(n, s, o) for n, _, s, o in wq] == [("model.layers.0.self_attn.q_proj.weight", (32, 32), (20, 0))]
    with pytest.raises(ValueError, match="not a parameter"):
        next(hf_shards(cfg, "layers.0.feed_forward.w1.weight", torch.zeros(1, 1), (1, 1), (0, 0)))
    assert canonical_name("_orig_mod.layers.0._checkpoint_wrapped_module.norm.weight") == "layers.0.norm.weight"
