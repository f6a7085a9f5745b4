"""What the driver does with a run directory before Ray starts (fast: no actors): ``--resume`` with a recipe whose
model is not the one the run's checkpoints hold is refused, naming the tensor and the way out; a refused recipe
changes nothing in the directory; a fresh start moves an earlier run's outputs into ``previous-<time>/``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

import driver.session
from common.run_dir import LOCK
from driver.preflight import check_resumable, ensure_model
from driver.resume import ENTRY_POINT
from driver.run import run
from recipe import load_recipe, write_resolved
from rollout.tasks import build_dataset
from tests.driver.run_dirs import checkpointed_run, listing, tiny_recipe
from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
from trainer.config import OptimizerConfig
from trainer.models.hf_config import model_config_from_hf
from trainer.models.transformer import build_model
from trainer.optim import build_optimizer

REPO = Path(__file__).resolve().parents[2]


def test_a_resume_with_another_model_fails_before_ray_and_changes_nothing(tmp_path, capsys, no_ray):
    out = checkpointed_run(tmp_path)
    before = listing(out)
    resolved = (out / "recipe.resolved.toml").read_text()
    assert run(tiny_recipe(tmp_path, "other", 64), resume="required") == 2
    err = capsys.readouterr().err
    assert "--resume: checkpoint" in err and "tok_embeddings.weight has shape (448, 128), the model (448, 64)" in err
    assert f"--recipe {out / 'recipe.resolved.toml'} --resume" in err and "without --resume" in err
    assert listing(out) == before
    assert (out / "recipe.resolved.toml").read_text() == resolved


def test_a_refused_fresh_start_moves_nothing_aside(tmp_path, capsys, no_ray):
    out = checkpointed_run(tmp_path)
    before = listing(out)
    bad = load_recipe("recipes/grpo_tiny.toml", {"model.path": str(tmp_path / "nothing_here"),
                                                 "run.output_dir": str(out)}, check_paths=False)  # fmt: skip
    bad = bad.model_copy(update={"model": bad.model.model_copy(update={"create_tiny": None})})
    assert run(bad) == 2
    assert "error:" in capsys.readouterr().err
    assert listing(out) == before


@pytest.mark.parametrize("base", ["recipes/grpo_tiny.toml", "recipes/grpo_tiny_lora.toml"], ids=["full", "lora"])
def test_the_checkpoint_of_the_runs_own_model_passes(tmp_path, base):
    out = checkpointed_run(tmp_path, base)
    recipe = tiny_recipe(tmp_path, "model", 128, base)
    cfg = model_config_from_hf(recipe.model.path, **recipe.model.block_overrides(), lora=recipe.model.lora)
    check_resumable(CheckpointManager(out / "checkpoints").latest(), cfg, recipe, out)


def test_a_lora_recipe_refuses_a_full_models_checkpoint(tmp_path):
    out = checkpointed_run(tmp_path)
    recipe = tiny_recipe(tmp_path, "model", 128, "recipes/grpo_tiny_lora.toml")
    cfg = model_config_from_hf(recipe.model.path, lora=recipe.model.lora)
    with pytest.raises(ValueError, match="the whole model's weights and no LoRA adapters: it was written by a run "
                       "without \\[model.lora\\] .*python -m trainer.export"):
        check_resumable(CheckpointManager(out / "checkpoints").latest(), cfg, recipe, out)


def test_a_full_recipe_refuses_a_lora_checkpoint_naming_lora(tmp_path):
    out = checkpointed_run(tmp_path, "recipes/grpo_tiny_lora.toml")
    recipe = tiny_recipe(tmp_path, "model", 128)
    cfg = model_config_from_hf(recipe.model.path)
    with pytest.raises(ValueError, match="holds LoRA adapters only: it was written by a run with \\[model.lora\\]"):
        check_resumable(CheckpointManager(out / "checkpoints").latest(), cfg, recipe, out)


def test_a_lora_resume_over_another_base_or_a_missing_one_fails_before_ray(tmp_path, capsys, no_ray):
    """The LoRA demo's warm start trains the base: its adapters apply to ``warm_start_model``. Resumed with
    ``run.warm_start.parameters = "trainable"`` they were put over the random model directory (held-out accuracy
    0.46 -> 0.0) and the run went on, overwriting ``final_model``."""
    out = checkpointed_run(tmp_path, "recipes/grpo_tiny_lora.toml")
    before = listing(out)
    other = tiny_recipe(tmp_path, "model", 128, "recipes/grpo_tiny_lora.toml")
    other = load_recipe("recipes/grpo_tiny_lora.toml", {
        "model.path": other.model.path, "run.output_dir": str(out), "run.num_steps": 4,
        "run.warm_start.parameters": "trainable",
    })  # fmt: skip
    assert run(other, resume="required") == 2
    err = capsys.readouterr().err
    assert f"trained its adapters over {out / 'warm_start_model'}" in err and "run.warm_start.parameters" in err
    assert f"--recipe {out / 'recipe.resolved.toml'} --resume" in err
    assert listing(out) == before
    # Another alpha: the same adapters at another scale, a different policy (accuracy 0.638 -> 0.55 in one step).
    scaled = load_recipe("recipes/grpo_tiny_lora.toml", {
        "model.path": other.model.path, "run.output_dir": str(out), "run.num_steps": 4, "model.lora.alpha": 32.0,
    })  # fmt: skip
    assert scaled.model.lora is not None and scaled.model.lora.alpha != 64.0
    assert run(scaled, resume="required") == 2
    err = capsys.readouterr().err
    assert "trained its adapters with [model.lora] alpha = 64, and this recipe gives 32" in err, err
    assert listing(out) == before
    shutil.rmtree(out / "warm_start_model")
    assert run(tiny_recipe(tmp_path, "model", 128, "recipes/grpo_tiny_lora.toml"), resume="required") == 2
    assert "warm_start_model, which is gone" in capsys.readouterr().err
    (out / "recipe.resolved.toml").write_text("[model\n")  # a damaged record: named, not a TOML traceback
    assert run(tiny_recipe(tmp_path, "model", 128, "recipes/grpo_tiny_lora.toml"), resume="required") == 2
    assert f"{out / 'recipe.resolved.toml'} is not a TOML file" in capsys.readouterr().err


def test_a_resume_refuses_a_checkpoint_of_another_algorithm(tmp_path):
    out = checkpointed_run(tmp_path)  # GRPO: no critic
    ppo = tiny_recipe(tmp_path, "model", 128, "recipes/ppo_tiny.toml")
    cfg = model_config_from_hf(ppo.model.path)
    ckpt = CheckpointManager(out / "checkpoints").latest()
    with pytest.raises(ValueError, match="holds no critic, and algorithm 'ppo' trains one"):
        check_resumable(ckpt, cfg, ppo, out)
    critic = build_model(cfg)  # what a PPO run adds to its checkpoints (the saved names are what counts here)
    CheckpointManager(out / "checkpoints").save({"policy": Checkpointable(build_model(cfg)), "critic":
                                                 Checkpointable(critic)}, TrainProgress(3, 3, {}))  # fmt: skip
    ckpt = CheckpointManager(out / "checkpoints").latest()
    check_resumable(ckpt, cfg, ppo, out)
    with pytest.raises(ValueError, match="holds a critic, and algorithm 'grpo' has none"):
        check_resumable(ckpt, cfg, tiny_recipe(tmp_path, "model", 128), out)


def _jsonl_recipe(tmp_path: Path, data: Path, out: Path):
    return load_recipe("recipes/grpo_tiny.toml", {
        "model.path": str(tmp_path / "model"), "run.output_dir": str(out), "run.warm_start.num_steps": 0,
        "task": {"type": "jsonl", "path": str(data), "num_eval_problems": 2},
    })  # fmt: skip


def test_a_task_file_with_a_bad_row_fails_before_ray_and_moves_nothing(tmp_path, capsys, no_ray):
    # Found once Ray and the actors had started (a traceback), after the earlier run's outputs were moved aside.
    out = checkpointed_run(tmp_path)
    before = listing(out)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n' * 5 + '{"prompt": "2+2", "answer"\n')
    assert run(_jsonl_recipe(tmp_path, data, out)) == 2
    assert f"error: {data}:6: not valid JSON" in capsys.readouterr().err
    data.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')  # Latin-1, not UTF-8
    assert run(_jsonl_recipe(tmp_path, data, out)) == 2
    assert f"error: {data}:1: not UTF-8 (byte 0xe9 at column 16)" in capsys.readouterr().err
    assert listing(out) == before


def test_a_resume_on_other_problems_fails_before_ray(tmp_path, capsys, no_ray):
    out = tmp_path / "out"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(8)))
    recipe = _jsonl_recipe(tmp_path, data, out)
    ensure_model(recipe)
    write_resolved(recipe, out)
    policy = build_model(model_config_from_hf(recipe.model.path))
    part = Checkpointable(policy, build_optimizer(policy, OptimizerConfig()))
    cursor = build_dataset(recipe.task).state_dict()
    CheckpointManager(out / "checkpoints").save({"policy": part}, TrainProgress(2, 2, cursor))
    data.write_text(data.read_text().replace('"answer": "3"', '"answer": "4"'))  # one answer edited
    assert run(recipe, resume="required") == 2
    assert "prompt dataset state does not match this dataset" in capsys.readouterr().err


def test_an_output_dir_that_is_a_file_is_a_clear_error(tmp_path, capsys, no_ray):
    (tmp_path / "afile").write_text("x")
    recipe = load_recipe("recipes/grpo_tiny.toml", {"run.output_dir": str(tmp_path / "afile")})
    assert run(recipe) == 2
    assert f"error: run.output_dir '{tmp_path / 'afile'}' cannot be the run's directory" in capsys.readouterr().err


@pytest.mark.parametrize("saved", [False, True], ids=["no-checkpoint", "checkpoint"])
@pytest.mark.parametrize("death", ["actor", "workers-exhausted", "checkpoint-write"])
def test_an_actor_death_offers_a_resume_only_when_there_is_a_checkpoint(tmp_path, capsys, monkeypatch, saved, death):
    import ray

    from rollout.fleet import WorkersExhausted
    from trainer.checkpoint import CheckpointWriteError

    out = checkpointed_run(tmp_path) if saved else tmp_path / "out"

    def actor_died(*args, **kwargs):
        if death == "actor":  # Ray's account names the class after its own boilerplate
            raise ray.exceptions.RayActorError(error_msg="The actor died.\n\tclass_name: TrainerWorker\n\tpid: 7")
        if death == "checkpoint-write":  # a full disk: DCP's own error named no space
            raise ray.exceptions.RayTaskError("save_checkpoint", "", CheckpointWriteError("12.0 MB are free under x"))
        # It ended in a raw traceback without the way to continue, though a checkpoint was there.
        raise WorkersExhausted("rollout workers died 1 times (rollout.num_worker_restarts = 0)")

    monkeypatch.setattr(driver.session, "ray_session", actor_died)
    recipe = tiny_recipe(tmp_path, "model", 128)
    assert run(recipe, resume="auto" if saved else None) == 1
    err = capsys.readouterr().err
    expected = {"actor": "error: a trainer rank died and could not be replaced",
                "workers-exhausted": "could not be replaced any more: rollout workers",
                "checkpoint-write": "error: 12.0 MB are free under x"}[death]  # fmt: skip
    assert "\nerror: " in err and expected in err, err
    if saved:
        record = out.resolve() / "recipe.resolved.toml"
        command = f"{sys.executable} {ENTRY_POINT} --recipe {record} --resume"
        assert f"continue from its last checkpoint (step_00000002) with: cd {Path.cwd()} && " in err, err
        assert command in err, err
        # The record repeats the flags of the failed start: the hint says where to change one that caused it.
        assert "its flags included: change the one at fault there, or give its flag again" in err, err
    else:  # the advice was to --resume from a checkpoint that did not exist
        assert "--resume" not in err and "no checkpoint was saved" in err, err
    assert out.is_dir()


def test_adapters_the_model_cannot_take_fail_at_load_and_before_ray_naming_model_lora(tmp_path, capsys, no_ray):
    """Expert adapters on a dense model were reported as "artifacts/tiny-qwen3/config.json: invalid recipe ... (whole
    file)", blaming the model's config for the recipe's ``[model.lora]``; `--check` passed them (the run refused them),
    and under expert parallelism they were filed under ``expert_parallel_degree``."""
    from common.config import ConfigError

    base = "recipes/grpo_tiny_lora.toml"
    recipe = tiny_recipe(tmp_path, "model", 128, base)
    ensure_model(recipe)
    assert recipe.policy_config() == model_config_from_hf(recipe.model.path, lora=recipe.model.lora)
    overrides = {"model.path": recipe.model.path, "run.output_dir": str(tmp_path / "out"),
                 "model.lora.target_parameters": ["mlp.experts.down_proj"]}  # fmt: skip
    with pytest.raises(ConfigError) as refused:  # what `--check` runs
        load_recipe(base, overrides)
    expected = f"- model.lora: [model.lora] does not fit the model in {recipe.model.path}: lora.target_parameters"
    assert expected in str(refused.value) and "config.json" not in str(refused.value), refused.value
    experts = load_recipe(base, overrides, check_paths=False)  # a model created at run time: checked once it exists
    assert run(experts) == 2
    err = capsys.readouterr().err
    assert f"[model.lora] does not fit the model in {recipe.model.path}: lora.target_parameters" in err, err
    assert "config.json" not in err
    assert not (tmp_path / "out").exists(), "the refused run left the directory it created (and its locks) behind"


def test_a_second_run_in_a_held_run_directory_is_refused_before_anything_moves(tmp_path, capsys, no_ray):
    """A job submitted twice: the second fresh start moved the live run's outputs aside (the first then died in
    TensorBoard's writer); two resumes trained into one checkpoints directory and lost one run's metrics."""
    from common.run_dir import RunDirBusy, RunDirLock

    out = checkpointed_run(tmp_path)
    before = listing(out)
    with RunDirLock(out):
        for resume in (None, "required"):
            assert run(tiny_recipe(tmp_path, "model", 128), resume=resume) == 2
            err = capsys.readouterr().err
            assert f"run directory {out} is in use by another run (pid {os.getpid()} on " in err, err
        with pytest.raises(RunDirBusy), RunDirLock(out):
            pass
    assert listing(out) == before
    with RunDirLock(out):  # released with its holder
        pass


def test_a_ray_job_with_relative_output_paths_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                                    no_ray):  # fmt: skip
    """A job's working directory is Ray's copy of the uploaded one (``_ray_pkg_<hash>`` under the session directory):
    relative outputs went there, and a --resume after a code change (a new copy) started the run afresh."""
    from driver.preflight import outputs_lost_with_the_job

    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))
    relative = load_recipe(str(REPO / "recipes" / "grpo_tiny.toml"), {"model.path": str(tmp_path / "model")})
    assert run(relative) == 2
    err = capsys.readouterr().err
    assert "run.output_dir = 'runs/grpo_tiny' is relative, and this Ray job runs in Ray's copy" in err, err
    assert "--run.output_dir /shared/runs/grpo_tiny" in err and not (package / "runs").exists()
    checkpoints = load_recipe(str(REPO / "recipes" / "grpo_tiny.toml"), {
        "model.path": str(tmp_path / "model"), "run.output_dir": str(tmp_path / "out"),
        "trainer.checkpoint.dir": "ckpts"})  # fmt: skip
    assert run(checkpoints) == 2 and "trainer.checkpoint.dir = 'ckpts' is relative" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # an entrypoint that changed to its own directory first writes where it means to
    assert outputs_lost_with_the_job(relative) is None
    monkeypatch.chdir(package)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # embedded: relative paths are the run's own directory
    assert outputs_lost_with_the_job(relative) is None


def test_a_ray_jobs_resume_command_is_a_job_with_the_same_working_dir(tmp_path, monkeypatch):
    """A stopped job printed `cd <Ray's private copy of the working dir> && python rl_align.py ... --resume`: run, it
    started an embedded Ray on the head node instead of a job."""
    from driver.resume import resume_command

    record = tmp_path / "out" / "recipe.resolved.toml"
    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    assert resume_command(record).startswith(f"cd {package} && ")  # not a job: the directory the run started in
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))
    command = resume_command(record)
    assert command.startswith("ray job submit --working-dir <the directory this job was submitted with> -- python "
                              f"rl_align.py --recipe {record} --resume"), command
    assert str(package) not in command


def test_the_resume_command_works_from_the_users_own_directory(tmp_path, monkeypatch):
    """A run started from a project directory of the user's printed `cd <it> && python rl_align.py ...`: there is no
    rl_align.py there, and the PYTHONPATH that found the user's reward and environment modules was left out."""
    import shlex

    from driver.resume import resume_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/opt/my project:/work")
    words = shlex.split(resume_command(tmp_path / "out" / "recipe.resolved.toml"))
    assert words[:4] == ["cd", str(tmp_path), "&&", "PYTHONPATH=/opt/my project:/work"], words
    assert Path(words[5]).is_absolute() and Path(words[5]).is_file() and words[5].endswith("rl_align.py"), words
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in resume_command(tmp_path / "out" / "recipe.resolved.toml")


def test_sigterm_stops_a_run_as_ctrl_c_does():
    """``ray job stop`` and ``kill`` ended the driver with exit 15 and a native stack dump, no word on resuming."""
    import signal
    import threading

    from driver.run import _sigterm_stops_the_run

    before, received = signal.getsignal(signal.SIGTERM), threading.Event()
    with pytest.raises(KeyboardInterrupt), _sigterm_stops_the_run(received):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in this thread first
    assert signal.getsignal(signal.SIGTERM) is before and received.is_set()  # a wait in Ray re-raises it as Ctrl-C


def test_a_tokenizer_elsewhere_than_the_model_fails_before_ray_when_exports_could_not_copy_it(tmp_path, capsys, no_ray):
    """Exports take the tokenizer of ``[model] path``: with it only under ``rollout.tokenizer_path`` the final export
    failed after all the training."""
    from common.tokenizer_dir import TOKENIZER_FILES

    started = tiny_recipe(tmp_path, "model", 128)
    ensure_model(started)
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (Path(started.model.path) / name).is_file():
            shutil.move(Path(started.model.path) / name, tokenizer / name)
    elsewhere = load_recipe("recipes/grpo_tiny.toml", {
        "model.path": started.model.path, "run.output_dir": str(tmp_path / "out"), "run.num_steps": 4,
        "rollout.tokenizer_path": str(tokenizer),
    })  # fmt: skip
    assert run(elsewhere) == 2
    assert f"the model directory {started.model.path} has no tokenizer files" in capsys.readouterr().err


def test_a_checkpoint_directory_another_run_holds_is_refused_before_anything_moves(tmp_path, capsys, no_ray):
    """Two runs given one outside trainer.checkpoint.dir: the second's fresh start moved the live run's checkpoints
    aside, each pruned the other's checkpoints, and a --resume took the other run's newest for its own."""
    from common.run_dir import RunDirLock

    shared = tmp_path / "shared_ckpt"
    (shared / "step_00000038").mkdir(parents=True)
    (shared / "step_00000038" / "COMPLETE").write_text("")
    recipe = load_recipe("recipes/grpo_tiny.toml", {
        "model.path": str(tmp_path / "model"), "run.output_dir": str(tmp_path / "B"),
        "trainer.checkpoint.dir": str(shared),
    })  # fmt: skip
    with RunDirLock(shared, what="checkpoint directory", field="trainer.checkpoint.dir"):  # run A, running
        for resume in (None, "auto"):
            assert run(recipe, resume=resume) == 2
            err = capsys.readouterr().err
            assert f"checkpoint directory {shared} is in use by another run (pid {os.getpid()} on " in err, err
            assert "give this run another trainer.checkpoint.dir" in err
    assert sorted(p.name for p in shared.iterdir()) == [LOCK, "step_00000038"]
    assert not list(tmp_path.glob("shared_ckpt.previous-*"))


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_before_ray(tmp_path, capsys, no_ray):
    # It was found at the first checkpoint, after the warm start and 50 steps, as a 60-line traceback.
    (tmp_path / "afile").write_text("")
    for ckpt in (tmp_path / "afile" / "ckpt", tmp_path / "out" / "checkpoints"):
        if ckpt.parent.name == "out":
            ckpt.parent.mkdir(exist_ok=True)
            ckpt.write_text("not a directory")
        recipe = load_recipe("recipes/grpo_tiny.toml", {
            "model.path": str(tmp_path / "model"), "run.output_dir": str(tmp_path / "out"),
            "trainer.checkpoint.dir": str(ckpt),
        })  # fmt: skip
        assert run(recipe) == 2
        err = capsys.readouterr().err
        assert f"error: trainer.checkpoint.dir '{ckpt}' cannot hold checkpoints: " in err, err


def test_a_resume_past_run_num_steps_is_refused_before_ray(tmp_path, capsys, no_ray):
    # It trained nothing, logged the step-2 policy's evaluation as step 0's and replaced the final model, exit 0.
    out = checkpointed_run(tmp_path)  # a step-2 checkpoint
    before = listing(out)
    recipe = load_recipe("recipes/grpo_tiny.toml", {
        "model.path": str(tmp_path / "model"), "model.create_tiny.hidden_size": 128,
        "run.output_dir": str(out), "run.num_steps": 1,
    })  # fmt: skip
    assert run(recipe, resume="required") == 2
    err = capsys.readouterr().err
    assert "the newest checkpoint, " in err and "is at step 2, past run.num_steps = 1: there is nothing to train" in err
    assert listing(out) == before


def test_a_resume_finds_the_evaluation_of_its_checkpoint_s_policy_on_record():
    # A resume at step 8 evaluated the step-7 policy again (500 problems) though the run's in-run evaluation of step 7
    # was on record, and put two points at one step in TensorBoard.
    from driver.run import evaluations_on_record

    records = [
        {"step": 0, "phase": "sft", "loss": 1.0}, {"step": -1, "phase": "eval", "eval/accuracy": 0.4},
        {"step": 6, "phase": "rl", "reward/mean": 0.5}, {"step": 7, "phase": "rl", "eval/accuracy": 0.6},
    ]  # fmt: skip
    found = evaluations_on_record(records)
    assert sorted(found) == [-1, 7] and found[7]["eval/accuracy"] == 0.6


def test_a_checkpoint_directory_holding_the_run_or_inside_another_run_s_is_refused(tmp_path, capsys, no_ray):
    from common.run_dir import RunDirLock

    def recipe(out: Path, ckpt: Path):
        return load_recipe("recipes/grpo_tiny.toml", {
            "model.path": str(tmp_path / "model"), "run.output_dir": str(out), "trainer.checkpoint.dir": str(ckpt),
        })  # fmt: skip

    # Its parent: the fresh start moved every run under it (the live one included) into <parent>.previous-*.
    for ckpt in (tmp_path / "runs", tmp_path / "runs" / "a"):
        assert run(recipe(tmp_path / "runs" / "a", ckpt)) == 2
        assert "holds run.output_dir" in capsys.readouterr().err
    # Run B's own checkpoints, named by run A: only B's run directory was locked, so A moved B's live checkpoints.
    b = tmp_path / "runs" / "b"
    (b / "checkpoints").mkdir(parents=True)
    with RunDirLock(b), RunDirLock(b / "checkpoints", what="checkpoint directory", field="trainer.checkpoint.dir"):
        assert run(recipe(tmp_path / "runs" / "a", b / "checkpoints")) == 2
        assert f"checkpoint directory {b / 'checkpoints'} is in use by another run" in capsys.readouterr().err


def test_a_refused_run_lets_its_checkpoint_directory_go(tmp_path, capsys, no_ray):
    out = checkpointed_run(tmp_path)  # a step-2 checkpoint
    refused = load_recipe("recipes/grpo_tiny.toml", {
        "model.path": str(tmp_path / "model"), "model.create_tiny.hidden_size": 128, "run.output_dir": str(out),
        "run.num_steps": 1,
    })  # fmt: skip
    assert run(refused, resume="required") == 2  # past run.num_steps
    capsys.readouterr()
    with pytest.raises(AssertionError, match="Ray was started"):  # the checks pass: nothing still holds the directory
        run(tiny_recipe(tmp_path, "model", 128), resume="required")


def test_a_resume_whose_engines_would_start_ahead_of_its_checkpoint_is_refused_before_ray(tmp_path, capsys, no_ray):
    """The checkpoint is at version 2; the model directory the engines serve records 40 (an export a run before
    versions continued from their model's was started from): the engines would refuse every push up to 40 and generate
    with their own weights meanwhile."""
    from weight_sync.sink import write_policy_version

    out = checkpointed_run(tmp_path)
    write_policy_version(str(tmp_path / "model"), 40)
    before = listing(out)
    assert run(tiny_recipe(tmp_path, "model", 128), resume="required") == 2
    err = capsys.readouterr().err
    expected = f"the rollout engines would start from {tmp_path / 'model'} at policy version 40, ahead of the trainer's"
    assert f"{expected} 2 (the checkpoint" in err, err
    assert listing(out) == before
    write_policy_version(str(tmp_path / "model"), 2)  # at the checkpoint's version: the same weights, it may resume
    capsys.readouterr()
    with pytest.raises(AssertionError, match="Ray was started"):
        run(tiny_recipe(tmp_path, "model", 128), resume="required")


def test_a_resume_with_changed_settings_names_them(tmp_path, caplog):
    """A resume takes the given recipe's settings (README): a flag that changed one went unnoticed, as did an eval of
    another size whose accuracies the report then compared with the earlier ones."""
    import logging

    from driver.preflight import check_run, with_run_defaults

    out = checkpointed_run(tmp_path)
    same = with_run_defaults(tiny_recipe(tmp_path, "model", 128), out)
    with caplog.at_level(logging.WARNING, logger="rl_align"):
        check_run(same, out, out / "checkpoints", "required")
    assert "other than the run's record" not in caplog.text
    changed = with_run_defaults(load_recipe(out / "recipe.resolved.toml", {
        "trainer.optimizer.lr": 3e-4, "run.eval.num_problems": 100,
    }), out)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="rl_align"):
        check_run(changed, out, out / "checkpoints", "required")
    assert "--resume with settings other than the run's record" in caplog.text
    assert "trainer.optimizer.lr: 0.0005 -> 0.0003" in caplog.text
    assert "run.eval.num_problems: 500 -> 100" in caplog.text
    caplog.clear()
    longer = with_run_defaults(load_recipe(out / "recipe.resolved.toml", {
        "run.num_steps": 40, "trainer.pack_row_tokens": 512,
    }), out)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="rl_align"):
        check_run(longer, out, out / "checkpoints", "required")
    assert "trainer.pack_row_tokens: '(unset)' -> 512" in caplog.text  # set where the record has none
    assert "trainer.schedule.num_total_steps stays 11 (the record's)" in caplog.text  # the 4-step run's warmup + 1
    assert "run.num_steps: 4 -> 40" in caplog.text


def test_a_checkpoint_left_half_saved_is_removed_when_the_run_resumes(tmp_path, no_ray, caplog):
    """A kill during a save left a step_ directory without COMPLETE: never resumed from nor pruned, it stayed."""
    out = checkpointed_run(tmp_path)
    partial = out / "checkpoints" / "step_00000003"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 1000)
    with pytest.raises(AssertionError, match="Ray was started"):
        run(load_recipe(out / "recipe.resolved.toml"), resume="required")
    assert not partial.exists() and (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert f"removing {partial}" in caplog.text
