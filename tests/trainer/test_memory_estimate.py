"""``trainer.memory``'s activation estimate against what autograd really keeps for backward (bytes of every saved
tensor's storage, each once) on real blocks of each family, with and without activation checkpointing; the training
state against the model's real parameters."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ActivationCheckpointConfig
from trainer.memory import (
    activation_bytes,
    adapter_params,
    block_activation_values,
    gathered_root_bytes,
    train_state_bytes,
)
from trainer.models.config import LoRAConfig, ModelConfig, MoEConfig
from trainer.models.transformer import build_model

TOKENS = 256


def _config(family: str, **overrides) -> ModelConfig:
    moe = MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_dim=96) if family == "qwen3_moe" else None
    fields = dict(
        family=family, vocab_size=128, dim=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
        ffn_hidden_dim=384, qk_norm=family != "llama3", moe=moe,
    )  # fmt: skip
    return ModelConfig(**(fields | overrides))


def _saved_block_bytes(cfg: ModelConfig, mode: str) -> int:
    """Bytes autograd saves in the blocks' forward (embedding output in, final hidden out; no output head)."""
    model = build_model(cfg)
    model.checkpoint_blocks(ActivationCheckpointConfig(mode=mode).checkpointed_blocks(cfg.num_layers))
    tokens = torch.randint(0, cfg.vocab_size, (1, TOKENS))
    segment_ids = torch.tensor([[0] * 100 + [1] * 156])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, segment_ids=segment_ids)
    return sum(storages.values())


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
def test_block_activations_are_within_a_quarter_of_what_autograd_keeps(family: str) -> None:
    cfg = _config(family)
    measured = _saved_block_bytes(cfg, "none")
    estimated = cfg.num_layers * block_activation_values(cfg) * TOKENS * 4
    assert 0.75 <= estimated / measured <= 1.25, f"estimated {estimated} vs saved {measured} bytes"


def test_checkpointed_blocks_keep_their_inputs_only() -> None:
    cfg = _config("qwen3")
    per_block, block_input = block_activation_values(cfg) * TOKENS * 4, cfg.dim * TOKENS * 4
    # What checkpointing every block takes away (the final norm and RoPE tables outside the blocks stay either way).
    freed = _saved_block_bytes(cfg, "none") - _saved_block_bytes(cfg, "full")
    assert freed == pytest.approx(cfg.num_layers * (per_block - block_input), rel=0.25)
    full = activation_bytes(cfg, TOKENS, ActivationCheckpointConfig(mode="full"), head_tokens=0)
    none = activation_bytes(cfg, TOKENS, ActivationCheckpointConfig(mode="none"), head_tokens=0)
    # The estimate adds the one block recomputed at a time in backward to the kept inputs.
    assert full == cfg.num_layers * block_input + per_block
    assert none == cfg.num_layers * per_block


def test_output_head_buffers_follow_the_head() -> None:
    chunked = _config("llama3", output_head="chunked", output_chunk_size=64)
    cached = _config("llama3", output_head="cached")
    no_head = activation_bytes(chunked, TOKENS, head_tokens=0)
    assert activation_bytes(chunked, TOKENS) - no_head == 3 * 64 * 128 * 4
    assert activation_bytes(cached, TOKENS) - no_head == 3 * TOKENS * 128 * 4
    assert activation_bytes(chunked, TOKENS, dtype="bfloat16", head_tokens=0) == no_head / 2


def test_train_state_counts_the_real_parameters() -> None:
    cfg = _config("qwen3", tie_embeddings=True)
    model = build_model(cfg)
    assert train_state_bytes(cfg, num_ranks=2) == 16 * sum(p.numel() for p in model.parameters()) / 2
    lora_cfg = cfg.model_copy(update={"lora": LoRAConfig(rank=4, alpha=8, target_modules=("q_proj", "down_proj"))})
    lora_model = build_model(lora_cfg)
    trained = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in lora_model.parameters() if not p.requires_grad)
    assert adapter_params(lora_cfg, lora_cfg.lora) == trained
    assert train_state_bytes(lora_cfg) == 4 * frozen + 16 * trained


@pytest.mark.parametrize("tied", [True, False])
def test_gathered_root_counts_the_parameters_outside_the_blocks(tied: bool) -> None:
    cfg = _config("qwen3", tie_embeddings=tied)
    model = build_model(cfg)
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    assert gathered_root_bytes(cfg) == 12 * root  # float32 parameters, gradients and the reduce-scatter input
    assert gathered_root_bytes(cfg, param_dtype="bfloat16") == (2 + 2 + 4) * root
    # The split keeps the embedding and head sharded: the final norm is all the root gathers.
    assert gathered_root_bytes(cfg, vocab_parallel=True) == 12 * model.norm.weight.numel()
    # Split over a TP group of 2, FSDP gathers this rank's half of the rows (over the data-parallel ranks).
    norm = model.norm.weight.numel()
    assert gathered_root_bytes(cfg, vocab_parallel=True, tensor_parallel_degree=2) == 12 * (norm + (root - norm) // 2)
    # A LoRA base is frozen: the root's parameters are gathered, no gradient joins them.
    lora_cfg = cfg.model_copy(update={"lora": LoRAConfig(rank=4, alpha=8, target_modules=("q_proj",))})
    assert gathered_root_bytes(lora_cfg) == 4 * root
