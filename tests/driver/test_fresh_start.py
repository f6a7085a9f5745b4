"""A fresh start in a run directory an earlier run used: that run's outputs move aside whole into
``previous-<time>/``, its record and adapters are pointed at where they went so it can still be resumed, and no
resume is offered for one that cannot resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.run_dir import earlier_runs_kept, set_aside_earlier_run
from driver.run import run
from recipe import load_recipe, write_resolved
from tests.driver.run_dirs import checkpointed_run, tiny_recipe
from trainer.checkpoint_dirs import latest_checkpoint


def test_adapters_moved_aside_name_their_moved_base_not_the_new_runs_warm_start(tmp_path):
    """A fresh start in a LoRA run's directory left the earlier run's adapters naming <run>/warm_start_model, which the
    new run then rewrote: PEFT put them over another model (max logit difference 6.5), without a word."""

    from driver.resume import point_moved_adapters_at_their_base

    out, elsewhere = tmp_path / "out", tmp_path / "models" / "base"
    configs = {"final_model/adapter": out / "warm_start_model", "hf/step_25/adapter": out / "warm_start_model",
               "hf/step_50/adapter": elsewhere}  # fmt: skip
    for where, base in configs.items():
        (out / where).mkdir(parents=True)
        (out / where / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "r": 8}))
    (out / "warm_start_model").mkdir()
    (out / "warm_start_model" / "config.json").write_text("{}")
    moved = set_aside_earlier_run(out, out / "checkpoints")
    (aside,) = {p.parent for p in moved.values()}
    edited = point_moved_adapters_at_their_base(moved)
    assert sorted(p.relative_to(aside).parts[:2] for p in edited) == [("final_model", "adapter"), ("hf", "step_25")]
    for where, base in configs.items():
        data = json.loads((aside / where / "adapter_config.json").read_text())
        expected = aside / "warm_start_model" if base != elsewhere else elsewhere
        assert data == {"base_model_name_or_path": str(expected), "r": 8}, where


def test_a_fresh_start_moves_the_earlier_runs_outputs_aside_whole(tmp_path):
    out = tmp_path / "out"
    earlier = ["recipe.resolved.toml", "metrics.jsonl", "curves.png", "tensorboard/events.out.tfevents.1",
               "tensorboard/sft/events.out.tfevents.2", "checkpoints/step_00000002/COMPLETE",
               "warm_start_model/config.json", "hf/step_25/config.json", "final_model/config.json"]  # fmt: skip
    for name in earlier:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    (out / "notes.txt").write_text("the user's")  # not a run output: stays
    moved = set_aside_earlier_run(out, out / "checkpoints")
    (aside,) = {p.parent for p in moved.values()}
    assert aside.name.startswith("previous-")
    for name in earlier:  # the same layout under previous-<time>/: a moved checkpoint finds its run's recipe
        assert not (out / name).exists() and (aside / name).read_text() == name, name
    assert (out / "notes.txt").exists()
    assert set_aside_earlier_run(out, out / "checkpoints") == {}  # nothing left to move


def test_a_fresh_start_keeps_the_recipes_model_and_moves_outside_checkpoints_beside_themselves(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "elsewhere" / "ckpts"
    for path in (out / "final_model" / "config.json", out / "hf" / "step_1" / "config.json", ckpt / "step_1" / "x"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    moved = set_aside_earlier_run(out, ckpt, keep=[str(out / "final_model")])  # a recipe that starts from it
    assert (out / "final_model" / "config.json").exists() and not (out / "hf").exists()
    assert moved[ckpt].name.startswith("ckpts.previous-") and moved[ckpt].parent == ckpt.parent
    assert (moved[ckpt] / "step_1" / "x").exists() and not any(ckpt.iterdir())  # its lock would have stayed
    assert earlier_runs_kept(out, ckpt) == (1, 2)  # hf/step_1/config.json and the checkpoint moved beside its dir


def test_a_fresh_start_leaves_the_earlier_run_resumable_where_it_moved(tmp_path, no_ray, caplog):
    """The moved ``recipe.resolved.toml`` names the run's new directory and checkpoints (nothing else changes), and
    the driver says how to continue that run: ``--recipe`` it with ``--resume``."""
    out = checkpointed_run(tmp_path)
    record = (out / "recipe.resolved.toml").read_text()
    with pytest.raises(AssertionError, match="Ray was started"):  # the fresh start got past its checks and moves
        run(tiny_recipe(tmp_path, "model", 128))
    (aside,) = out.glob("previous-*")
    moved = aside / "recipe.resolved.toml"
    assert f"--recipe {moved} --resume" in caplog.text
    size = sum(f.stat().st_size for f in aside.rglob("*") if f.is_file())  # nothing prunes them: the driver says
    assert f"{out} now keeps 1 earlier run(s) in previous-*/ ({size / 1e6:.1f} MB" in caplog.text
    earlier = load_recipe(moved)
    assert earlier.run.resolved_output_dir == aside
    assert earlier.trainer.checkpoint.dir == str(aside / "checkpoints")
    assert latest_checkpoint(Path(earlier.trainer.checkpoint.dir)) == aside / "checkpoints" / "step_00000002"
    unchanged = load_recipe(out / "recipe.resolved.toml", {  # the new run's record, pointed back: the same settings
        "run.output_dir": str(aside), "trainer.checkpoint.dir": str(aside / "checkpoints")})  # fmt: skip
    assert earlier == unchanged
    assert f'output_dir = "{out}"' in record and earlier != load_recipe(out / "recipe.resolved.toml")
    live = sorted(p.relative_to(out) for p in out.rglob("*") if aside not in p.parents and p != aside)
    with pytest.raises(AssertionError, match="Ray was started"):  # the resume's checks pass on the moved run
        run(earlier, resume="required")
    assert sorted(p.relative_to(out) for p in out.rglob("*") if aside not in p.parents and p != aside) == live


def test_the_moved_record_keeps_its_own_checkpoint_directory(tmp_path, no_ray, caplog):
    """An earlier run that checkpointed outside its run directory: its checkpoints stay where they are (the new
    recipe's directory is another), and its moved record still names them."""
    out = checkpointed_run(tmp_path)
    outside = tmp_path / "kept" / "ckpts"
    outside.parent.mkdir()
    (out / "checkpoints").rename(outside)
    write_resolved(load_recipe(out / "recipe.resolved.toml", {"trainer.checkpoint.dir": str(outside)}), out)
    with pytest.raises(AssertionError, match="Ray was started"):
        run(tiny_recipe(tmp_path, "model", 128))  # its checkpoints default to out/checkpoints
    (aside,) = out.glob("previous-*")
    earlier = load_recipe(aside / "recipe.resolved.toml")
    assert earlier.trainer.checkpoint.dir == str(outside) and latest_checkpoint(outside) is not None
    assert f"--recipe {aside / 'recipe.resolved.toml'} --resume" in caplog.text


@pytest.mark.parametrize("case", ["no checkpoint", "retired setting", "not text"])
def test_no_resume_is_offered_for_an_earlier_run_that_cannot_resume(tmp_path, no_ray, caplog, case):
    """No checkpoint: the record is pointed at its new place, nothing to resume. A setting this code no longer has:
    pointed there too (two keys set, the rest as written), but this code cannot resume it. Not TOML: moved as it is."""
    out = checkpointed_run(tmp_path)
    record = out / "recipe.resolved.toml"
    if case == "no checkpoint":
        for step in (out / "checkpoints").iterdir():
            (step / "COMPLETE").unlink()
    elif case == "retired setting":
        record.write_text(record.read_text() + "\n[run.retired_table]\nsetting = 1\n")
    else:
        record.write_bytes(b"\xff\xfe not a recipe")
    before = record.read_bytes()
    with pytest.raises(AssertionError, match="Ray was started"):
        run(tiny_recipe(tmp_path, "model", 128))
    (aside,) = out.glob("previous-*")
    moved = (aside / "recipe.resolved.toml").read_bytes()
    assert "--resume" not in caplog.text
    if case == "not text":
        assert moved == before and "cannot be resumed with this code" in caplog.text
    else:
        assert f'output_dir = "{aside}"'.encode() in moved
        assert (b"retired_table" in moved) == (case == "retired setting")  # the rest as written
        assert ("cannot be resumed with this code" in caplog.text) == (case == "retired setting")
