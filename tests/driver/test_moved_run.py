"""A run directory moved or copied elsewhere (to branch an experiment) and continued through its own record
(``--recipe <copy>/recipe.resolved.toml --resume``): the copy is the run continued, never the original."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import rl_align
from recipe import load_recipe, write_resolved
from tests.driver.run_dirs import checkpointed_run, listing


def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_as_it_was(tmp_path, no_ray, caplog):
    """Read as written, the copy's record named the original's directory: its --resume trained the original, pruned
    its checkpoints and rewrote its record, and the copy was never touched."""
    out = checkpointed_run(tmp_path)
    (out / "final_model" / "adapter").mkdir(parents=True)  # a LoRA export's adapter names the run's warm start
    (out / "final_model" / "adapter" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(out / "warm_start_model")}))  # fmt: skip
    branch = tmp_path / "branch"
    shutil.copytree(out, branch)
    adapter_config = (branch / "final_model" / "adapter" / "adapter_config.json").read_text()
    assert rl_align.main(["--recipe", str(branch / "recipe.resolved.toml"), "--check"]) == 0
    assert (branch / "final_model" / "adapter" / "adapter_config.json").read_text() == adapter_config, "--check wrote"
    before = {p: (out / p).read_bytes() for p in listing(out) if (out / p).is_file()}
    caplog.set_level(logging.INFO, logger="rl_align")
    caplog.clear()  # the set-up's own recipe warnings
    with pytest.raises(AssertionError, match="Ray was started"):  # the resume's checks passed, on the copy
        rl_align.main(["--recipe", str(branch / "recipe.resolved.toml"), "--resume", "--trainer.optimizer.lr", "1e-4"])
    assert f"was written for the run at {out}: this run is {branch}" in caplog.text
    # The settings changed are the flag's; the paths that follow the copy are none, and the record's own warnings
    # (a 4-step run in a 10-step warmup) are said once, of this run.
    assert "trainer.optimizer.lr: 0.0005 -> 0.0001;" in caplog.text and "run.output_dir:" not in caplog.text
    assert caplog.text.count("only warms up") == 1
    assert {p: (out / p).read_bytes() for p in listing(out) if (out / p).is_file()} == before
    adapter = json.loads((branch / "final_model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(branch / "warm_start_model")


def test_a_moved_run_resumes_where_it_is(tmp_path, no_ray, capsys):
    out = checkpointed_run(tmp_path)
    moved = out.rename(tmp_path / "moved")
    with pytest.raises(AssertionError, match="Ray was started"):  # not "no complete checkpoint under <old place>"
        rl_align.main(["--recipe", str(moved / "recipe.resolved.toml"), "--resume"])
    assert not out.exists(), "nothing is created at the run's old place"


def test_a_copy_whose_record_names_checkpoints_outside_it_is_refused_before_anything_starts(tmp_path, no_ray, capsys):
    out = checkpointed_run(tmp_path)
    outside = tmp_path / "kept"
    (out / "checkpoints").rename(outside)
    write_resolved(load_recipe(out / "recipe.resolved.toml", {"trainer.checkpoint.dir": str(outside)}), out)
    branch = tmp_path / "branch"
    shutil.copytree(out, branch)
    assert rl_align.main(["--recipe", str(branch / "recipe.resolved.toml"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"names that run's checkpoint directory {outside}" in err and "--trainer.checkpoint.dir" in err
    with pytest.raises(AssertionError, match="Ray was started"):  # its own, given: the copy goes on from there
        rl_align.main(["--recipe", str(branch / "recipe.resolved.toml"), "--resume", "auto",
                       "--trainer.checkpoint.dir", str(tmp_path / "branch_ckpts")])  # fmt: skip


def test_a_record_in_the_copy_ray_uploaded_with_a_job_keeps_the_runs_own_place(tmp_path, monkeypatch):
    """A job's working directory is Ray's temporary copy: a record read there (its run directory uploaded with the
    code) still names the run's own place, where the outputs outlive the job."""
    import driver.resume
    from driver.resume import record_in_its_directory

    out = checkpointed_run(tmp_path)
    job_copy = tmp_path / "_ray_pkg_1"
    shutil.copytree(out, job_copy / "runs" / "x")
    monkeypatch.setattr(driver.resume, "ray_job_working_dir", lambda: job_copy)
    record = job_copy / "runs" / "x" / "recipe.resolved.toml"
    recipe = load_recipe(record)
    assert record_in_its_directory(record, recipe, {}) == (recipe, None)


def test_checkpoints_inside_the_run_under_another_name_follow_the_copy(tmp_path):
    from driver.resume import record_in_its_directory

    out = checkpointed_run(tmp_path)
    (out / "checkpoints").rename(out / "ckpts")
    write_resolved(load_recipe(out / "recipe.resolved.toml", {"trainer.checkpoint.dir": str(out / "ckpts")}), out)
    branch = tmp_path / "branch"
    shutil.copytree(out, branch)
    recipe, moved_from = record_in_its_directory(branch / "recipe.resolved.toml",
                                                 load_recipe(branch / "recipe.resolved.toml"), {})  # fmt: skip
    assert moved_from == out and recipe.trainer.checkpoint.dir == str(branch / "ckpts")


def test_a_recipe_saved_under_the_records_name_beside_no_run_is_read_as_it_is(tmp_path):
    """``--check``'s output kept as configs/x/recipe.resolved.toml: no run to continue there, no outputs sent there."""
    from driver.resume import record_in_its_directory

    out = checkpointed_run(tmp_path)
    saved = tmp_path / "configs" / "recipe.resolved.toml"
    saved.parent.mkdir()
    shutil.copy(out / "recipe.resolved.toml", saved)
    recipe = load_recipe(saved)
    assert record_in_its_directory(saved, recipe, {}) == (recipe, None)


def test_a_record_resumed_into_another_directory_by_flag_takes_its_checkpoints_along(tmp_path, caplog):
    """``cp -a runs/a runs/b`` then ``--recipe runs/b/recipe.resolved.toml --run.output_dir runs/b --resume`` trained
    on from the original's checkpoints and wrote (and pruned) them: the flag skipped the move. Also a record resumed
    in its own place into a new directory must not train the original's checkpoints."""
    from driver.resume import record_in_its_directory

    out = checkpointed_run(tmp_path)
    branch = tmp_path / "branch"
    shutil.copytree(out, branch)
    record = branch / "recipe.resolved.toml"
    flag = {"run.output_dir": str(branch)}
    recipe, moved_from = record_in_its_directory(record, load_recipe(record, flag), flag)
    assert moved_from == out and recipe.trainer.checkpoint.dir == str(branch / "checkpoints")
    elsewhere, own = {"run.output_dir": str(tmp_path / "new")}, out / "recipe.resolved.toml"
    recipe, moved_from = record_in_its_directory(own, load_recipe(own, elsewhere), elsewhere)
    assert moved_from == out and recipe.trainer.checkpoint.dir == str(tmp_path / "new" / "checkpoints")
    assert f"none are there: the checkpoints in {out / 'checkpoints'} stay that run's (copy them there" in caplog.text
    same = {"run.output_dir": str(out)}
    kept = load_recipe(out / "recipe.resolved.toml", same)
    assert record_in_its_directory(out / "recipe.resolved.toml", kept, same) == (kept, None)
    # The record copied under another name names the original's checkpoints explicitly, as every record does.
    mine = tmp_path / "mine.toml"
    write_resolved(load_recipe(own, {"trainer.checkpoint.dir": str(out / "checkpoints")}), tmp_path / "w")
    shutil.copy(tmp_path / "w" / "recipe.resolved.toml", mine)
    recipe, _ = record_in_its_directory(mine, load_recipe(mine, elsewhere), elsewhere)
    assert recipe.trainer.checkpoint.dir == str(tmp_path / "new" / "checkpoints")
    plain = load_recipe("recipes/grpo_tiny.toml", elsewhere)  # default checkpoints follow the flag by themselves
    assert record_in_its_directory(Path("recipes/grpo_tiny.toml"), plain, elsewhere) == (plain, None)
