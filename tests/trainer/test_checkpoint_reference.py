"""The frozen KL reference lives in the checkpoint: a resumed run restores it exactly without the warm-start export,
and checkpoints written before it was saved still load (with the reference rebuilt, and a warning)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from spawn_helpers import full_weights
from torch import nn
from trainer_batches import random_batch

from common.net import free_port
from rollout.types import RolloutBatch
from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
from trainer.config import TrainerConfig
from trainer.metrics import is_timing
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig, KLConfig

MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, output_chunk_size=16,
)  # fmt: skip
ALGO = GRPOConfig(group_size=4, kl=KLConfig(coef=0.1))


def _part(seed: int, frozen: bool = False) -> Checkpointable:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    if frozen:
        return Checkpointable(model.requires_grad_(False))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return Checkpointable(model, opt)


def test_frozen_part_round_trips_and_old_checkpoints_still_load(tmp_path, caplog) -> None:
    manager = CheckpointManager(tmp_path)
    saved = {"policy": _part(0), "reference": _part(1, frozen=True)}
    manager.save(saved, TrainProgress(1, 1, {}))
    loaded = {"policy": _part(2), "reference": _part(3, frozen=True)}
    manager.load(loaded)
    for name in saved:
        assert torch.equal(loaded[name].model.weight, saved[name].model.weight), name
    policy_only = _part(5)  # a run without KL resumes from a checkpoint that holds a reference
    manager.load({"policy": policy_only})
    assert torch.equal(policy_only.model.weight, saved["policy"].model.weight)

    manager.save({"policy": saved["policy"]}, TrainProgress(2, 2, {}))  # a run from before the reference was saved
    rebuilt = _part(3, frozen=True)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        manager.load({"policy": _part(2), "reference": rebuilt}, missing_ok=("reference",))
    assert "holds no 'reference'" in caplog.text
    assert torch.equal(rebuilt.model.weight, _part(3, frozen=True).model.weight)  # untouched
    with pytest.raises(ValueError, match=r"holds no \['critic'\]"):
        manager.load({"policy": _part(2), "critic": _part(4)})


def _batch(step: int) -> RolloutBatch:
    return random_batch(50 + step, prompt_len=(2, 8), completion_len=(1, 14), logprob=(-4.0, -3.0), policy_version=step)



def _worker(rank: int, world: int, port: int, root: Path, init_path: Path):
    from trainer.worker import TrainerWorker

    cfg = TrainerConfig(
        num_ranks=world, optimizer=dict(lr=3e-3), micro_batch_tokens=64,
        checkpoint=dict(dir=str(root / "ckpt"), num_keep=1), schedule=dict(kind="cosine", num_total_steps=10),
    )  # fmt: skip
    worker = TrainerWorker(rank, cfg, MODEL, ALGO, init_path=str(init_path))
    worker.setup("127.0.0.1", port)
    return worker



def _resume_flow(rank: int, world: int, ports: tuple[int, int], root: Path) -> dict:
    """The driver's flow on one rank: warm start, the reference becomes the warm policy, export, RL steps with a
    checkpoint; then the export is deleted and a fresh trainer built from the base checkpoint resumes."""
    torch.set_num_threads(1)
    warm = root / "warm_start_model"
    out: dict = {}
    first = _worker(rank, world, ports[0], root, root / "base")
    try:
        for step in range(3):
            first.sft_step(_batch(10 + step).samples, lr=1e-2)
        first.finish_warm_start()
        first.export_hf(str(warm), None)
        for step in range(2):
            first.train_step(_batch(step))
        first.save_checkpoint(data_cursor={"next": 2})
        out["warm_reference"] = full_weights(first.state.reference)
        out["expected"] = [first.train_step(_batch(step)) for step in (2, 3)]
        out["expected_policy"] = full_weights(first.state.policy)
        out["expected_reference"] = full_weights(first.state.reference)
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(warm)  # resume falls back to the base checkpoint for init_path, as the driver does
    finally:
        first.shutdown()

    resumed = _worker(rank, world, ports[1], root, root / "base")
    try:
        out["base_reference"] = full_weights(resumed.state.reference)
        out["state"] = resumed.load_checkpoint()
        out["loaded_reference"] = full_weights(resumed.state.reference)
        out["got"] = [resumed.train_step(_batch(step)) for step in (2, 3)]
        out["got_policy"] = full_weights(resumed.state.policy)
        out["got_reference"] = full_weights(resumed.state.reference)
    finally:
        resumed.shutdown()
    return out


def _spawned_rank(rank: int, world: int, ports: tuple[int, int], root: str) -> None:
    torch.save(_resume_flow(rank, world, ports, Path(root)), Path(root) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kl_run_resumes_bit_exactly_without_the_warm_start_export(tmp_path, world: int) -> None:
    from trainer.models.hf_io import save_hf_checkpoint
    from trainer.models.transformer import build_model

    torch.manual_seed(7)
    save_hf_checkpoint(build_model(MODEL), str(tmp_path / "base"))
    ports = (free_port(), free_port())
    if world == 1:
        results = [_resume_flow(0, 1, ports, tmp_path)]
    else:  # two FSDP ranks: the reference is saved and loaded as shards
        mp.start_processes(_spawned_rank, args=(world, ports, str(tmp_path)), nprocs=world, start_method="spawn")
        results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert not (tmp_path / "warm_start_model").exists()
    for out in results:
        warm = out["warm_reference"]
        assert any(not torch.equal(out["base_reference"][n], warm[n]) for n in warm)  # what a rebuild would give
        assert out["state"]["step"] == 2 and out["state"]["data_cursor"] == {"next": 2}
        for name, tensor in out["loaded_reference"].items():
            assert torch.equal(tensor, warm[name]), name
        for a, b in zip(out["expected"], out["got"], strict=True):
            assert a["kl"] > 0
            assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
        for key in ("policy", "reference"):
            for name, tensor in out[f"got_{key}"].items():
                assert torch.equal(tensor, out[f"expected_{key}"][name]), (key, name)
