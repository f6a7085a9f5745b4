"""``trainer.compile`` under FSDP2: two sharded ranks with the compiled elementwise ops follow one eager rank (same
losses and weights within float32 noise), and checkpoints and weight-push shards are those of the eager model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import end_rank
from trainer_batches import random_batch

from common.net import free_port

NUM_STEPS = 2


def _worker(rank: int, world: int, compile: bool, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    # Compile in this process: inductor's pool of compile workers, still winding down when the process exits, once
    # aborted a rank at exit ("terminate called without an active exception") after the test's work was done.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.fsdp import FSDPModule

    from trainer.config import TrainerConfig
    from trainer.models.config import ModelConfig
    from trainer.parallelize import build_mesh, local_shards
    from trainer.rl.config import GRPOConfig, KLConfig
    from trainer.state import build_train_state
    from trainer.step import rl_step

    model_cfg = ModelConfig(
        family="llama3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=64, tie_embeddings=True, output_chunk_size=16,
    )  # fmt: skip
    cfg = TrainerConfig(num_ranks=world, micro_batch_tokens=96, optimizer={"lr": 3e-3}, compile=compile)
    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.05))
    state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    assert isinstance(state.policy, FSDPModule) == (world > 1)
    metrics = [rl_step(state, random_batch(10 + s, num_groups=4, completion_len=(1, 24))) for s in range(NUM_STEPS)]
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in state.policy.named_parameters()
    }
    shard_names = sorted(name for name, *_ in local_shards(state.policy))
    torch.save({"metrics": metrics, "weights": weights, "shards": shard_names}, os.path.join(out_dir, f"{rank}.pt"))
    end_rank()


def _run(world: int, compile: bool, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True)
    mp.start_processes(_worker, args=(world, compile, free_port(), str(out_dir)), nprocs=world, start_method="spawn")
    return torch.load(out_dir / "0.pt", weights_only=False)


def test_compiled_fsdp_ranks_match_one_eager_rank(tmp_path) -> None:
    eager = _run(1, False, tmp_path / "eager")
    fused = _run(2, True, tmp_path / "compiled")
    assert fused["shards"] == eager["shards"]
    for m1, m2 in zip(eager["metrics"], fused["metrics"], strict=True):
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    for name, w in eager["weights"].items():
        torch.testing.assert_close(fused["weights"][name], w, rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
