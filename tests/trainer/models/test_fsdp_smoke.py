"""The model under FSDP2 (one gloo rank, in process): per-block sharding, token_logprobs outside forward, shards."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from trainer.models.config import ModelConfig
from trainer.models.hf_io import hf_shards, hf_state_dict
from trainer.models.transformer import build_model

CFG = ModelConfig(
    family="qwen3_moe", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    ffn_hidden_dim=48, qk_norm=True, tie_embeddings=True, output_chunk_size=5,
    moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16),
)  # fmt: skip


def _loss(model, tokens):
    hidden = model(tokens)
    logprobs, entropy = model.token_logprobs(hidden, torch.roll(tokens, -1, dims=1))
    return -logprobs.mean() - 0.01 * entropy.mean() + 0.01 * model.moe_aux_loss()


def test_fsdp2_wrapped_model_matches_plain_model(tmp_path):
    torch.manual_seed(0)
    plain = build_model(CFG)
    sharded = copy.deepcopy(plain)
    tokens = torch.randint(0, 64, (2, 9))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in sharded.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        register_fsdp_forward_method(sharded, "token_logprobs")
        loss_plain, loss_sharded = _loss(plain, tokens), _loss(sharded, tokens)
        loss_plain.backward()
        loss_sharded.backward()
        assert torch.allclose(loss_plain, loss_sharded, atol=1e-6)
        plain_grads = dict(plain.named_parameters())
        for name, p in sharded.named_parameters():
            assert torch.allclose(p.grad.full_tensor(), plain_grads[name].grad, atol=1e-6), name
        expected = dict(hf_state_dict(plain))
        seen = set()
        for name, p in sharded.named_parameters():
            local = p.to_local().detach()
            for hf_name, piece, shape, offsets in hf_shards(CFG, name, local, tuple(p.shape), (0,) * p.ndim):
                assert offsets == (0,) * len(shape) and torch.equal(piece, expected[hf_name])
                seen.add(hf_name)
        assert seen == set(expected)
    finally:
        dist.destroy_process_group()
