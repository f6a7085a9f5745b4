"""Tensor parallel (2 gloo ranks, spawned): the model's tensor_parallel_plan gives the single-process results."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CFG_KW = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=48,
              qk_norm=True, output_chunk_size=7)  # fmt: skip
MOE = dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, family: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from trainer.models.config import ModelConfig
        from trainer.models.hf_io import hf_shards, hf_state_dict
        from trainer.models.transformer import build_model

        cfg = ModelConfig(family=family, **CFG_KW, **({"moe": MOE} if family == "qwen3_moe" else {}))
        torch.manual_seed(0)
        plain = build_model(cfg)
        model = copy.deepcopy(plain)
        mesh = init_device_mesh("cpu", (2,))
        for block in model.layers:
            parallelize_module(block, mesh, model.tensor_parallel_plan())
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        # Only some positions feed the head: the last block's trimmed path runs under TP too.
        keep = torch.tensor([0, 3, 4, 8, 9, 17])
        targets = torch.roll(tokens, -1, dims=1).reshape(-1)[keep]
        results = []
        for m in (plain, model):
            lp, ent = m.token_logprobs(m(tokens, output_positions=keep), targets)
            (lp.mean() + ent.mean()).backward()
            results.append(lp.detach())
        assert (results[0] - results[1]).abs().max() < 1e-5
        full = dict(hf_state_dict(plain))
        plain_params = dict(plain.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert (grad - plain_params[name].grad).abs().max() < 1e-5, name
            if hasattr(p, "to_local"):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                for hf_name, piece, _, offs in hf_shards(cfg, name, p.to_local(), tuple(p.shape), tuple(offsets)):
                    index = tuple(slice(o, o + s) for o, s in zip(offs, piece.shape))
                    assert torch.equal(full[hf_name][index], piece), hf_name
        out[rank] = "ok"
    finally:
        dist.destroy_process_group()


def _run(rank: int, port: int, family: str, queue) -> None:
    out: dict = {}
    try:
        _worker(rank, port, family, out)
        queue.put((rank, "ok"))
    except BaseException as e:  # process boundary: report to the parent
        queue.put((rank, repr(e)))
        raise


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_tensor_parallel_plan_matches_single_process(family):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_run, args=(_free_port(), family, queue), nprocs=2, start_method="spawn", join=True)
    assert sorted(queue.get(timeout=5) for _ in range(2)) == [(0, "ok"), (1, "ok")]
