"""The frozen KL reference lives in the checkpoint: a resumed run restores it exactly without the warm-start export,
and checkpoints written before it was saved still load (with the reference rebuilt, and a warning). A trainer that
restores as it starts (``setup(resume=True)``, the driver's way) reads nothing of the base checkpoint's weights."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from spawn_helpers import end_rank, full_weights
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



def _worker(rank: int, world: int, port: int, root: Path, init_path: Path, resume: bool = False):
    """A rank set up on ``init_path``: (the worker, what its setup restored)."""
    from trainer.worker import TrainerWorker

    cfg = TrainerConfig(
        num_ranks=world, optimizer=dict(lr=3e-3), micro_batch_tokens=64,
        checkpoint=dict(dir=str(root / "ckpt"), num_keep=1), schedule=dict(kind="cosine", num_total_steps=10),
    )  # fmt: skip
    worker = TrainerWorker(rank, cfg, MODEL, ALGO, init_path=str(init_path))
    return worker, worker.setup("127.0.0.1", port, resume=resume)



def _resume_flow(rank: int, world: int, ports: tuple[int, int], root: Path, at_setup: bool) -> dict:
    """The driver's flow on one rank: warm start, the reference becomes the warm policy, export, RL steps with a
    checkpoint; then the export is deleted and a fresh trainer built from the base checkpoint resumes (``at_setup``:
    as it starts; else by a load after its setup)."""
    import trainer.initial_weights

    torch.set_num_threads(1)
    warm = root / "warm_start_model"
    out: dict = {}
    first, _ = _worker(rank, world, ports[0], root, root / "base")
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

    with mock.patch.object(trainer.initial_weights, "load_hf_checkpoint",
                           wraps=trainer.initial_weights.load_hf_checkpoint) as hf_loads:  # fmt: skip
        resumed, out["state"] = _worker(rank, world, ports[1], root, root / "base", resume=at_setup)
    out["hf_loads"] = hf_loads.call_count
    try:
        if not at_setup:
            out["base_reference"] = full_weights(resumed.state.reference)
            out["state"] = resumed.load_checkpoint()
        out["loaded_reference"] = full_weights(resumed.state.reference)
        out["got"] = [resumed.train_step(_batch(step)) for step in (2, 3)]
        out["got_policy"] = full_weights(resumed.state.policy)
        out["got_reference"] = full_weights(resumed.state.reference)
    finally:
        resumed.shutdown()
    return out


def _spawned_rank(rank: int, world: int, ports: tuple[int, int], root: str, at_setup: bool) -> None:
    torch.save(_resume_flow(rank, world, ports, Path(root), at_setup), Path(root) / f"rank{rank}.pt")
    end_rank()


@pytest.mark.parametrize("world, at_setup", [(1, False), (2, True), pytest.param(2, False, marks=pytest.mark.slow)])
def test_kl_run_resumes_bit_exactly_without_the_warm_start_export(tmp_path, world: int, at_setup: bool) -> None:
    from trainer.models.hf_io import save_hf_checkpoint
    from trainer.models.transformer import build_model

    torch.manual_seed(7)
    save_hf_checkpoint(build_model(MODEL), str(tmp_path / "base"))
    ports = (free_port(), free_port())
    if world == 1:
        results = [_resume_flow(0, 1, ports, tmp_path, at_setup)]
    else:  # two FSDP ranks: the reference is saved and loaded as shards
        mp.start_processes(_spawned_rank, args=(world, ports, str(tmp_path), at_setup), nprocs=world,
                           start_method="spawn")  # fmt: skip
        results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert not (tmp_path / "warm_start_model").exists()
    for out in results:
        warm = out["warm_reference"]
        if at_setup:  # the checkpoint holds policy and reference: nothing of the base checkpoint is read for them
            assert out["hf_loads"] == 0
        else:  # built from the base checkpoint (policy and reference), then loaded over
            assert out["hf_loads"] == 2
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



def test_a_lora_run_restored_at_start_reads_its_base_and_resumes_bit_exactly(tmp_path) -> None:
    """A LoRA checkpoint holds the adapters alone: a trainer restoring it as it starts still reads the frozen base from
    ``init_path`` (once: its reference is the base with adapters off) and continues exactly as the run it resumes."""
    import trainer.initial_weights
    from trainer.models.config import LoRAConfig
    from trainer.models.hf_io import save_hf_checkpoint
    from trainer.models.transformer import build_model
    from trainer.worker import TrainerWorker

    lora_model = MODEL.model_copy(update={"lora": LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))})
    torch.manual_seed(7)
    save_hf_checkpoint(build_model(MODEL), str(tmp_path / "base"))
    cfg = TrainerConfig(optimizer=dict(lr=3e-3), micro_batch_tokens=64, checkpoint=dict(dir=str(tmp_path / "ckpt")))
    torch.set_num_threads(1)

    first = TrainerWorker(0, cfg, lora_model, ALGO, init_path=str(tmp_path / "base"))
    first.setup("127.0.0.1", free_port())
    try:
        for step in range(2):
            first.train_step(_batch(step))
        first.save_checkpoint(data_cursor={"next": 2})
        expected = [first.train_step(_batch(step)) for step in (2, 3)]
        expected_policy = full_weights(first.state.policy)
    finally:
        first.shutdown()

    resumed = TrainerWorker(0, cfg, lora_model, ALGO, init_path=str(tmp_path / "base"))
    with mock.patch.object(trainer.initial_weights, "load_hf_checkpoint",
                           wraps=trainer.initial_weights.load_hf_checkpoint) as hf_loads:  # fmt: skip
        state = resumed.setup("127.0.0.1", free_port(), resume=True)
    try:
        assert hf_loads.call_count == 1
        assert state == {"step": 2, "policy_version": 2, "data_cursor": {"next": 2}}
        got = [resumed.train_step(_batch(step)) for step in (2, 3)]
        for a, b in zip(expected, got, strict=True):
            assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
        for name, tensor in full_weights(resumed.state.policy).items():
            assert torch.equal(tensor, expected_policy[name]), name
    finally:
        resumed.shutdown()
