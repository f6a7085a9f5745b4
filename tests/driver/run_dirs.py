"""Helpers of the driver's run-directory tests: a tiny recipe, a run directory as a killed run leaves it, a listing."""

from __future__ import annotations

import shutil
from pathlib import Path

from common.run_dir import LOCK
from driver.preflight import ensure_model
from recipe import load_recipe, write_resolved
from rollout.tasks import build_dataset
from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
from trainer.config import OptimizerConfig
from trainer.models.hf_config import model_config_from_hf
from trainer.models.transformer import build_model
from trainer.optim import build_optimizer


def tiny_recipe(tmp_path: Path, model: str, hidden_size: int, base: str = "recipes/grpo_tiny.toml"):
    return load_recipe(base, {
        "model.path": str(tmp_path / model), "model.create_tiny.hidden_size": hidden_size,
        "run.output_dir": str(tmp_path / "out"), "run.num_steps": 4,
    })  # fmt: skip


def checkpointed_run(tmp_path: Path, base: str = "recipes/grpo_tiny.toml") -> Path:
    """A run directory as a killed run of the 128-wide model leaves it: its resolved recipe and a step-2 checkpoint
    written as the trainer writes it (a LoRA run: adapters and their optimizer state only)."""
    started = tiny_recipe(tmp_path, "model", 128, base)
    ensure_model(started)
    out = tmp_path / "out"
    write_resolved(started, out)
    if started.lora_base == out / "warm_start_model":  # the base its warm start trained (the model, here)
        shutil.copytree(started.model.path, out / "warm_start_model")
    policy = build_model(model_config_from_hf(started.model.path, lora=started.model.lora))
    lora = started.model.lora is not None
    part = Checkpointable(policy, build_optimizer(policy, OptimizerConfig()), trainable_only=lora)
    cursor = build_dataset(started.task).state_dict()  # the task's own cursor, as the driver saves it
    CheckpointManager(out / "checkpoints").save({"policy": part}, TrainProgress(2, 2, cursor))
    (out / LOCK).touch()  # the lock file a run leaves (it holds nothing of the run's)
    return out


def listing(out: Path) -> list[Path]:
    """What the run directory holds, but the lock a run takes on it (``common.run_dir.LOCK``: kept, it holds nothing
    of the run's)."""
    return sorted(p.relative_to(out) for p in out.rglob("*") if p.name != LOCK)
