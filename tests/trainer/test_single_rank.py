"""A single float32 rank runs the plain module (FSDP there only copies parameters in and out): same updates as the
FSDP layout, checkpoints load across the two layouts, and the weight push sees whole tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from trainer_batches import random_batch

from trainer.checkpoint import CheckpointManager, TrainProgress
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig

MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, tie_embeddings=True, output_chunk_size=16,
)  # fmt: skip
ALGO = GRPOConfig(group_size=4)


pytestmark = pytest.mark.usefixtures("single_rank_group")


def _engine(**overrides):
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state

    cfg = TrainerConfig(**{"optimizer": {"lr": 1e-3}, "micro_batch_tokens": 10_000, **overrides})
    return build_train_state(cfg, MODEL, ALGO, torch.device("cpu"), build_mesh(cfg, "cpu"))


def _params(state) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in state.policy.named_parameters()
    }


def test_fsdp_applies_only_where_it_shards_or_casts():
    from trainer.parallelize import build_mesh, uses_fsdp

    plain = TrainerConfig()
    mesh = build_mesh(plain, "cpu")
    assert not uses_fsdp(mesh, plain)
    assert uses_fsdp(mesh, TrainerConfig(mixed_precision={"param_dtype": "bfloat16"}))
    assert uses_fsdp(mesh, TrainerConfig(mixed_precision={"reduce_dtype": "bfloat16"}))
    assert not uses_fsdp(mesh, TrainerConfig(parallelism={"fsdp": False}))


def test_single_rank_engine_is_plain_and_pushes_whole_tensors():
    from trainer.parallelize import local_shards

    state = _engine()
    assert not isinstance(state.policy, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in state.policy.parameters())
    shards = list(local_shards(state.policy))
    assert {name for name, *_ in shards} == {n for n, _ in state.policy.named_parameters()}
    for name, local, shape, offsets in shards:
        assert tuple(local.shape) == shape and set(offsets) == {0}, name


def test_fsdp_checkpoint_loads_into_plain_engine_and_updates_match(tmp_path, monkeypatch):
    from trainer.step import rl_step

    with monkeypatch.context() as m:  # the layout a one-rank run had before FSDP was skipped there
        m.setattr("trainer.parallelize.uses_fsdp", lambda mesh, cfg: True)
        sharded = _engine()
    assert isinstance(sharded.policy, FSDPModule)
    plain = _engine()
    first = random_batch(0, num_groups=3, group_size=4)
    metrics = [rl_step(state, first) for state in (sharded, plain)]
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-6)
    for name, p in _params(plain).items():
        torch.testing.assert_close(p, _params(sharded)[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")

    manager = CheckpointManager(tmp_path)
    manager.save(sharded.checkpointables(), TrainProgress(1, 1, {}))
    resumed = _engine(seed=1)  # different init: everything must come from the checkpoint
    manager.load(resumed.checkpointables())
    assert all(torch.equal(p, _params(sharded)[n]) for n, p in _params(resumed).items())
    second = random_batch(1, num_groups=3, group_size=4)
    after = [rl_step(state, second) for state in (sharded, resumed)]
    for key in ("loss", "grad_norm"):
        assert after[0][key] == pytest.approx(after[1][key], rel=1e-6, abs=1e-7), key
    for name, p in _params(resumed).items():
        torch.testing.assert_close(p, _params(sharded)[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


_CHECKPOINT_THREADS = """
import os, sys
import torch
import torch.distributed as dist
from common.net import free_port
from trainer_batches import random_batch
from trainer.checkpoint import CheckpointManager, TrainProgress
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.parallelize import build_mesh
from trainer.rl.config import GRPOConfig
from trainer.state import build_train_state
from trainer.step import rl_step

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
model = ModelConfig(family="qwen3", vocab_size=448, dim=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                    ffn_hidden_dim=256, qk_norm=True)
cfg = TrainerConfig(optimizer={"lr": 1e-3}, micro_batch_tokens=4096)
state = build_train_state(cfg, model, GRPOConfig(group_size=4), torch.device("cpu"), build_mesh(cfg, "cpu"))
batch = random_batch(0, num_groups=8, group_size=4, vocab_size=448)
rl_step(state, batch)  # the process's OpenMP team exists from here
threads = len(os.listdir("/proc/self/task"))
manager = CheckpointManager(sys.argv[1])
manager.save(state.checkpointables(), TrainProgress(1, 1, {}))
manager.load(state.checkpointables())
rl_step(state, batch)
print("THREADS", threads, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_single_rank_checkpoint_starts_no_second_openmp_team(tmp_path):
    """Saving and loading on one rank moves nothing through gloo: gloo copying the save plan on its own thread started
    a second OpenMP team, after which libgomp counted more threads than cores, stopped spinning between parallel
    regions, and every later step of a 2-thread trainer ran ~1.8x slower."""
    here = Path(__file__).parent
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])])}
    out = subprocess.run([sys.executable, "-c", _CHECKPOINT_THREADS, str(tmp_path / "ckpt")], env=env, text=True,
                         capture_output=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(int, out.stdout.split("THREADS")[1].split())
    assert after == before, f"{after - before} thread(s) more after a checkpoint save and load"
