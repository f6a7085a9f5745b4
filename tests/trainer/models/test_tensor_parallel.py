"""Tensor parallel as production runs it (2 gloo ranks, spawned): ``parallelize_model`` with the model's
``tensor_parallel_plan``, then ``sync_tensor_parallel_partial_grads``, gives the single-process results and gradients;
the plan refuses what it cannot split. FSDP x TP steps: ``tests/trainer/test_fsdp_parity.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.net import free_port
from trainer.critic import Critic
from trainer.models.config import ModelConfig
from trainer.models.transformer import build_model

CFG_KW = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=48,
              qk_norm=True, output_chunk_size=7)  # fmt: skip
MOE = dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16)


def _worker(rank: int, port: int, lora: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from trainer.config import TrainerConfig
        from trainer.models.config import LoRAConfig
        from trainer.models.hf_io import hf_shards, hf_state_dict
        from trainer.models.lora import adapter_state_dict, is_adapter
        from trainer.parallelize import build_mesh, parallelize_model, sync_tensor_parallel_partial_grads

        adapters = LoRAConfig(rank=4, alpha=8.0) if lora else None  # every projection: column and row splits
        cfg = ModelConfig(family="qwen3", **CFG_KW, lora=adapters)
        trainer_cfg = TrainerConfig(num_ranks=2, parallelism={"tensor_parallel_degree": 2, "fsdp": False})
        torch.manual_seed(0)
        plain = build_model(cfg)
        with torch.no_grad():  # B != 0, so the adapters take part in the forward and in A's gradient
            for name, p in plain.named_parameters():
                if is_adapter(name):
                    p.normal_(std=0.2)
        mesh = build_mesh(trainer_cfg, "cpu")
        model = parallelize_model(copy.deepcopy(plain), mesh, trainer_cfg)
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        # Only some positions feed the head: the last block's trimmed path runs under TP too.
        keep = torch.tensor([0, 3, 4, 8, 9, 17])
        targets = torch.roll(tokens, -1, dims=1).reshape(-1)[keep]
        results = []
        for m in (plain, model):
            lp, ent = m.token_logprobs(m(tokens, output_positions=keep), targets)
            (lp.mean() + ent.mean()).backward()
            results.append(lp.detach())
        sync_tensor_parallel_partial_grads(model, mesh)
        assert (results[0] - results[1]).abs().max() < 1e-5
        full = dict(hf_state_dict(plain))
        plain_params = dict(plain.named_parameters())
        for name, p in model.named_parameters():
            if not p.requires_grad:  # a frozen LoRA base
                assert p.grad is None and plain_params[name].grad is None, name
                continue
            if hasattr(p, "placements"):  # the optimizer steps on local shards: no partial sums may be left
                assert p.grad.placements == p.placements, (name, p.grad.placements, p.placements)
            # Replicated parameters (the q/k norms among them) must hold the whole gradient on every rank.
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert (grad - plain_params[name].grad).abs().max() < 1e-5, name
            if hasattr(p, "to_local") and not is_adapter(name):
                _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                for hf_name, piece, _, offs in hf_shards(cfg, name, p.to_local(), tuple(p.shape), tuple(offsets)):
                    index = tuple(slice(o, o + s) for o, s in zip(offs, piece.shape))
                    assert torch.equal(full[hf_name][index], piece), hf_name
        if lora:  # a push sends every rank's pieces at their offsets, under PEFT names
            peft_full = dict(adapter_state_dict(plain, cfg))
            for name, p in model.named_parameters():
                if is_adapter(name) and hasattr(p, "to_local"):
                    _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    for peft_name, piece, _, offs in hf_shards(cfg, name, p.to_local(), tuple(p.shape), offsets):
                        index = tuple(slice(o, o + s) for o, s in zip(offs, piece.shape))
                        assert torch.equal(peft_full[peft_name][index], piece), peft_name
    finally:
        dist.destroy_process_group()


def _run(rank: int, port: int, lora: bool, queue) -> None:
    try:
        _worker(rank, port, lora)
        queue.put((rank, "ok"))
    except BaseException as e:  # process boundary: report to the parent
        queue.put((rank, repr(e)))
        raise


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tensor_parallel_matches_single_process(lora: bool):
    """Also with LoRA adapters on every projection (split along with their weights): same log-probs, the same
    adapter gradients with the parameters' own placements, and pushed pieces that are slices of the PEFT tensors."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_run, args=(free_port(), lora, queue), nprocs=2, start_method="spawn", join=True)
    assert sorted(queue.get(timeout=5) for _ in range(2)) == [(0, "ok"), (1, "ok")]


def test_plan_splits_dense_blocks_and_refuses_moe_and_uneven_heads():
    dense = build_model(ModelConfig(family="qwen3", **CFG_KW))
    plan = dense.tensor_parallel_plan(2)
    assert set(plan) == {f"attention.{w}" for w in ("wq", "wk", "wv", "wo")} | {
        f"feed_forward.{w}" for w in ("w1", "w2", "w3")
    }
    assert Critic(dense, CFG_KW["dim"]).tensor_parallel_plan(2).keys() == plan.keys()
    with pytest.raises(ValueError, match="must divide num_heads and num_kv_heads"):
        dense.tensor_parallel_plan(4)  # 2 kv heads
    moe = build_model(ModelConfig(family="qwen3_moe", **CFG_KW, moe=MOE))
    with pytest.raises(ValueError, match="dense blocks only"):
        moe.tensor_parallel_plan(2)
