"""``--resume`` with a recipe whose model is not the one the run's checkpoints hold fails before Ray starts, with a
message that names the tensor and the way out, and leaves the run's resolved recipe as it was (fast: no actors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.run import run
from recipe import load_recipe
from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
from trainer.models.hf_config import model_config_from_hf
from trainer.models.transformer import build_model


def _recipe(tmp_path: Path, model: str, hidden_size: int):
    return load_recipe("recipes/grpo_tiny.toml", {
        "model.path": str(tmp_path / model), "model.create_tiny.hidden_size": hidden_size,
        "run.output_dir": str(tmp_path / "out"), "run.num_steps": 4,
    })  # fmt: skip


def _checkpointed_run(tmp_path: Path) -> Path:
    """A run directory as a killed run of the 128-wide model leaves it: its resolved recipe and a step-2 checkpoint."""
    from driver.run import ensure_model
    from recipe import write_resolved

    started = _recipe(tmp_path, "model", 128)
    ensure_model(started)
    out = tmp_path / "out"
    write_resolved(started, out)
    policy = build_model(model_config_from_hf(started.model.path))
    CheckpointManager(out / "checkpoints").save({"policy": Checkpointable(policy)}, TrainProgress(2, 2, {}))
    return out


def test_a_resume_with_another_model_fails_before_ray_and_keeps_the_runs_recipe(tmp_path, capsys):
    out = _checkpointed_run(tmp_path)
    resolved = (out / "recipe.resolved.toml").read_text()
    assert run(_recipe(tmp_path, "other", 64), resume="required") == 2
    err = capsys.readouterr().err
    assert "--resume: checkpoint" in err and "tok_embeddings.weight has shape (448, 128), the model (448, 64)" in err
    assert f"--recipe {out / 'recipe.resolved.toml'} --resume" in err and "without --resume" in err
    assert (out / "recipe.resolved.toml").read_text() == resolved


@pytest.mark.parametrize("lora", [False, True])
def test_the_checkpoint_of_the_same_model_passes_the_check(tmp_path, lora):
    from driver.run import _check_resumable

    out = _checkpointed_run(tmp_path)
    recipe = _recipe(tmp_path, "model", 128)
    cfg = model_config_from_hf(recipe.model.path)
    _check_resumable(recipe, cfg, out)  # what the run's trainer saved: accepted (adapter-only checkpoints pass the
    # same function in tests/trainer/test_export.py)
    if lora:  # a LoRA run checkpoints its adapters alone: a full-model checkpoint is not one of its checkpoints
        recipe = load_recipe("recipes/grpo_tiny_lora.toml", {"model.path": recipe.model.path,
                                                             "run.output_dir": str(out)})  # fmt: skip
        cfg = model_config_from_hf(recipe.model.path, lora=recipe.model.lora)
        with pytest.raises(ValueError, match="holds tensors this model has not .*written for another model"):
            _check_resumable(recipe, cfg, out)


def test_a_fresh_start_moves_the_earlier_runs_checkpoints_and_models_aside(tmp_path):
    from driver.run import _resolve_resume

    out = tmp_path / "out"
    earlier = {"checkpoints/step_00000002/COMPLETE", "warm_start_model/config.json", "hf/step_25/config.json",
               "final_model/config.json"}  # fmt: skip
    for name in earlier:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    assert _resolve_resume(out, out / "checkpoints", "auto")  # a checkpoint to continue from: nothing moves
    assert all((out / name).exists() for name in earlier)
    assert not _resolve_resume(out, out / "checkpoints", None)
    assert not any((out / name.split("/")[0]).exists() for name in earlier)
    for name in earlier:  # each kept whole under <name>.previous-<time>
        top, rest = name.split("/", 1)
        assert len(list(out.glob(f"{top}.previous-*/{rest}"))) == 1, name
    with pytest.raises(ValueError, match="no complete checkpoint"):
        _resolve_resume(out, out / "checkpoints", "required")
    (out / "final_model").mkdir()
    (out / "final_model" / "config.json").write_text("x")
    assert not _resolve_resume(out, out / "checkpoints", None, [str(out / "final_model")])  # the recipe's model
    assert (out / "final_model" / "config.json").exists()
