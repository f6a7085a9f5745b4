"""Faults from outside, as in production: a rollout worker process dies mid-run (the run must finish every step), and
the whole job is killed after a checkpoint (``--resume`` must continue the same curve to the end)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from it_helpers import (
    ONE_ENGINE,
    RECIPE,
    descendants,
    kill_tree,
    read_metrics,
    rl_steps,
    run_to_end,
    small_run_args,
    start_run,
    tail,
    wait_for,
)

from common.config import parse_overrides
from driver.placement import num_rollout_workers
from recipe import load_recipe


def _rollout_workers(proc) -> list[psutil.Process]:
    """The embedded Ray's RolloutWorker actor processes below the run (Ray titles them ``ray::RolloutWorker...``)."""
    found = []
    for p in descendants(proc):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::RolloutWorker"):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.mark.parametrize(("recipe", "workers"), [
    # The recipe's engines ('auto': two here, colocated on two cores or more). Slow: a lost worker beside a live one
    # is also what test_multi_node's lost rollout node is, in the default run.
    pytest.param("recipes/grpo_tiny.toml", (), marks=pytest.mark.slow),
    ("recipes/grpo_tiny.toml", ONE_ENGINE),  # the run cannot go on before the replacement
    # One engine on its own reservation. Slow: an async run through a killed worker is also test_agent_runs' in the
    # default run (its episodes in flight on the victim).
    pytest.param("recipes/grpo_tiny_async.toml", (), marks=pytest.mark.slow),
])  # fmt: skip
def test_killed_rollout_worker_is_replaced_and_run_finishes(tmp_path: Path, recipe: str, workers: tuple) -> None:
    num_steps = 12  # long enough that a replacement starts before the others finish the run
    log = tmp_path / "run.log"
    proc = start_run(small_run_args(tmp_path, num_steps, "--run.logging.plot", "false", *workers), log, recipe)
    known: list[psutil.Process] = []
    try:
        wait_for(lambda: len(rl_steps(read_metrics(tmp_path / "out"))) >= 2, 240, proc, "2 RL steps", log)
        known = descendants(proc)
        started = _rollout_workers(proc)
        resolved = load_recipe(recipe, parse_overrides(list(workers)), check_paths=False)
        expected = num_rollout_workers(resolved, len(os.sched_getaffinity(0)))
        assert len(started) == expected, f"expected the recipe's {expected} rollout worker(s), found {started}"
        victim = started[0]
        killed_after = len(rl_steps(read_metrics(tmp_path / "out")))
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        # A replacement comes up while the run goes on.
        pids = {w.pid for w in started}
        replacement = wait_for(lambda: [w for w in _rollout_workers(proc) if w.pid not in pids], 120, proc,
                               "a replacement rollout worker", log)  # fmt: skip
        known += replacement
        assert proc.wait(timeout=300) == 0, tail(log)
    finally:
        if proc.poll() is None:
            kill_tree(proc, known)
    assert killed_after < num_steps, "the run ended before the worker was killed: make it longer"
    records = read_metrics(tmp_path / "out")
    assert rl_steps(records) == list(range(num_steps)), tail(log)
    rl = [r for r in records if r["phase"] == "rl"]
    # Killed mid-generation, its groups were sent again to a live worker; killed between batches, the next push to it
    # failed and the pool held it back, then replaced it when the catch-up push failed too (rollout.fleet). Either way
    # the trainer pushed the committed version to the replacement before it took work: no batch was generated with
    # older weights, none regenerated.
    redispatched = sum(r["rollout/num_redispatched"] for r in rl)
    assert redispatched >= 1 or "failed (a pool worker: it gets no work until" in log.read_text(), tail(log)
    # Every step, the one hit by the kill included, trains on samples of the expected versions: sync, the current
    # policy (the version before this step's update); async, no more than max_staleness versions behind it.
    max_staleness = resolved.run.max_staleness if "async" in recipe else 0
    for r in rl:
        current = r["train/policy_version"] - 1
        assert current - max_staleness <= r["rollout/min_policy_version"], (r["step"], r)
        assert r["rollout/max_policy_version"] <= current, (r["step"], r)
        assert r["rollout/staleness_max"] <= max_staleness, (r["step"], r)
    # Sync runs colocate (generation and training take turns, each with every core); async runs keep each actor on
    # its own reservation: one trainer thread.
    threads = len(os.sched_getaffinity(0)) if "async" not in recipe else 1
    assert {r["train/num_threads"] for r in rl} == {threads}, f"trainer threads, expected {threads}"
    busy = [r["perf/cores_busy"] for r in rl[1:]]  # from the second step: the first laps hold the start-up
    assert "perf/cores_busy" not in rl[0] and all(b > 0 for b in busy), busy
    # Each process's CPU window runs from its previous report, so around the kill one step reads the replacement's
    # first work (catch-up push, first batch) that another step waited for (seen: 0.05, 2.08, 0.02): the run's
    # CPU over its wall time and cores is the figure that must stay within the cores.
    seconds = [r["time/step_s"] for r in rl[1:]]
    assert 0 < sum(b * t for b, t in zip(busy, seconds)) / sum(seconds) <= 1.5, list(zip(busy, seconds))
    logged = set(re.findall(r"\(RolloutWorker pid=(\d+)", log.read_text()))
    assert str(victim.pid) in logged, logged
    if expected == 1:  # with more, the others may carry the run to its end before the replacement takes work
        assert "to catch them up" in log.read_text(), tail(log)
        assert {str(w.pid) for w in replacement} <= logged, logged
    assert "held-out problems" in log.read_text()


def test_killed_job_resumes_from_checkpoint_and_continues_curve(tmp_path: Path) -> None:
    num_steps = 12  # a step takes ~0.15 s here: room for the kill to land well before the end on a faster machine
    args = small_run_args(tmp_path, num_steps, "--trainer.checkpoint.every_num_steps", "2", *ONE_ENGINE)
    out = tmp_path / "out"
    ckpt_dir = out / "checkpoints"
    log1 = tmp_path / "run1.log"
    proc = start_run(args, log1)
    try:
        # Kill once a step past the first checkpoint is logged, so the resumed run must redo (not repeat) it.
        def past_checkpoint() -> bool:
            return (ckpt_dir / "step_00000002" / "COMPLETE").exists() and 2 in rl_steps(read_metrics(out))

        wait_for(past_checkpoint, 240, proc, "a step past the step-2 checkpoint", log1)
    finally:
        kill_tree(proc)  # SIGKILL the driver and everything it started: nothing gets to clean up
    assert proc.returncode == -signal.SIGKILL, f"the run ended ({proc.returncode}) before it was killed:\n{tail(log1)}"
    first = read_metrics(out)
    first_steps = rl_steps(first)
    assert first_steps and first_steps[-1] < num_steps - 1, first_steps
    complete = sorted(int(p.parent.name[5:]) for p in ckpt_dir.glob("step_*/COMPLETE"))
    resume_step = complete[-1]

    log2 = tmp_path / "run2.log"
    assert run_to_end([*args, "--resume"], log2, RECIPE, timeout_s=300) == 0, tail(log2)
    assert f"resumed at step {resume_step}" in log2.read_text(), tail(log2)
    records = read_metrics(out)
    # One curve: every step once, the steps before the checkpoint are the first run's own records.
    assert rl_steps(records) == list(range(num_steps)), rl_steps(records)
    rl = {r["step"]: r for r in records if r["phase"] == "rl"}
    first_rl = {r["step"]: r for r in first if r["phase"] == "rl"}
    for step in range(resume_step):
        assert rl[step] == first_rl[step]
    # The resumed run did not warm-start again, and its policy versions continue those of the checkpoint.
    assert [r for r in records if r["phase"] == "sft"] == [r for r in first if r["phase"] == "sft"]
    versions = [int(rl[s]["train/policy_version"]) for s in range(num_steps)]
    assert versions == list(range(versions[0], versions[0] + num_steps)), versions
    assert all(rl[s]["time"] > max(r["time"] for r in first) for s in range(resume_step, num_steps))
    assert sorted(int(p.parent.name[5:]) for p in ckpt_dir.glob("step_*/COMPLETE"))[-1] == num_steps


def test_a_run_killed_before_its_first_rl_checkpoint_resumes_after_its_warm_start(tmp_path: Path) -> None:
    """A stop before the first RL checkpoint said "start the run again", and the warm start (minutes on real tasks)
    was redone: a checkpoint at step 0, right after it, is what the resume starts from."""
    num_steps = 40
    args = small_run_args(tmp_path, num_steps, "--trainer.checkpoint.every_num_steps", "100", *ONE_ENGINE)
    out = tmp_path / "out"
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    proc = start_run(args, log1)
    try:
        wait_for((out / "checkpoints" / "step_00000000" / "COMPLETE").exists, 240, proc, "the step-0 checkpoint", log1)
    finally:
        kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL, f"the run ended ({proc.returncode}) before it was killed:\n{tail(log1)}"
    first = read_metrics(out)
    assert "warm start:" in log1.read_text()
    assert run_to_end([*args, "--resume"], log2, RECIPE, timeout_s=300) == 0, tail(log2)
    text = log2.read_text()
    assert "resumed at step 0" in text and "warm start:" not in text, tail(log2)
    records = read_metrics(out)
    assert rl_steps(records) == list(range(num_steps))
    assert [r for r in records if r["phase"] == "sft"] == [r for r in first if r["phase"] == "sft"]


def test_dead_trainer_fails_job_with_resume_hint(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    num_steps = 8
    args = small_run_args(tmp_path, num_steps, "--trainer.checkpoint.every_num_steps", "2",
                          "--run.logging.plot", "false", *ONE_ENGINE)  # fmt: skip
    proc = start_run(args, log)
    known: list[psutil.Process] = []
    try:
        ckpt = tmp_path / "out" / "checkpoints" / "step_00000002" / "COMPLETE"
        wait_for(ckpt.exists, 240, proc, "the step-2 checkpoint", log)
        known = descendants(proc)
        trainers = [p for p in known if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::TrainerWorker")]
        assert len(trainers) == 1, [p.cmdline()[:1] for p in known]
        trainers[0].send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc, known)
    text = log.read_text()
    assert rc == 1, tail(log)
    assert "--resume" in text and "error:" in text, tail(log)
    assert len(rl_steps(read_metrics(tmp_path / "out"))) < num_steps
    # Nothing the run started outlives it.
    _, alive = psutil.wait_procs(known, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def _failed_run(tmp_path: Path, *overrides: str) -> tuple[str, Path]:
    """The output of a short run (no warm start) with ``overrides`` that must fail with exit 1, and its log's path."""
    log = tmp_path / "run.log"
    args = small_run_args(tmp_path, 2, "--run.warm_start.num_steps", "0", "--run.logging.plot", "false", *overrides,
                          *ONE_ENGINE)  # fmt: skip
    rc = run_to_end(args, log, RECIPE, timeout_s=300)
    assert rc == 1, tail(log)
    return log.read_text(), log


def test_an_environment_that_fails_past_its_budget_fails_the_run_with_what_to_do(tmp_path: Path) -> None:
    """A failed batch ended the driver in a traceback: it now says which environment failed, what to change and how to
    continue, and exits 1."""
    text, log = _failed_run(tmp_path, "--environment.type", "custom", "--environment.max_turns", "2",
                            "--environment.class_path", "tests.rollout.envs.scripted_env:FailsEveryEpisode")
    expected = ("error: a rollout batch failed: environment tests.rollout.envs.scripted_env:FailsEveryEpisode: reset "
                "of problem")  # fmt: skip
    assert expected in text and "ConnectionError: the sandbox is down" in text, tail(log)
    assert "environment.max_failed_fraction = 0: a failed episode fails the batch" in text, tail(log)
    assert "let environment.max_failed_fraction drop more of its episodes; no checkpoint was saved" in text, tail(log)


def test_a_reward_function_that_raises_fails_the_run_with_what_to_do(tmp_path: Path) -> None:
    """A user reward function's error (here at the evaluation before the first step, on generated text: the preflight
    tries it on the reference answer alone) ended the driver in a traceback naming an internal group id: it now names
    the term, the problem and the completion, what to set, and how to continue, and exits 1."""
    terms = '[{type = "function", function = "tests.rollout.reward_functions:fails_on_what_the_model_writes"}]'
    text, log = _failed_run(tmp_path, "--reward.terms", terms)
    expected = ("error: reward term 'function': function 'tests.rollout.reward_functions:"
                "fails_on_what_the_model_writes' failed on problem 'arith-eval-0' with completion '")  # fmt: skip
    assert expected in text and "KeyError: 'expected' (set reward.on_error = 'zero'" in text, tail(log)
    assert "Traceback" not in text.split("error: reward term")[1] and "group" not in text.split("error:")[1], tail(log)
    assert "no checkpoint was saved" in text, tail(log)


def test_a_prompt_longer_than_the_engine_holds_fails_the_run_with_what_to_do(tmp_path: Path) -> None:
    """A user's prompt above rollout.engine.max_model_len ended the driver in an 80-line traceback, no resume hint;
    then it ended the run when first rendered, which could be hours in, where a resume on the fixed data is refused:
    every prompt of the task is measured before anything trains, and the first few are named."""
    text, log = _failed_run(tmp_path, "--rollout.engine.max_model_len", "20")  # the task's prompts are 23-25 tokens
    # 2,000 training problems and the 16 held-out ones the run evaluates (the other held-out rows are never rendered)
    assert re.search(r"error: 2016 problem\(s\) of the task have prompts that leave no room for a completion in "
                     r"rollout.engine.max_model_len = 20 tokens \(prompt and completion\): 'arith-\w+-\d+' "
                     r"\(2\d tokens\), ", text), tail(log)  # fmt: skip
    assert "'arith-train-0' (25 tokens), " in text and "and 2011 more; raise max_model_len" in text, tail(log)
    assert "Traceback" not in text.split("error: ")[1] and "no checkpoint was saved" in text, tail(log)


@pytest.mark.slow
def test_sigterm_stops_the_run_its_actors_and_says_how_to_continue(tmp_path: Path) -> None:
    """``ray job stop`` and ``kill`` (SIGTERM) ended the driver with exit 15 past a native stack dump (Ray's handler):
    the run now stops as on Ctrl-C, its actors shut down, and the way to continue is printed."""
    log = tmp_path / "run.log"
    proc = start_run(small_run_args(tmp_path, 40, "--run.logging.plot", "false", *ONE_ENGINE), log)
    known: list[psutil.Process] = []
    try:
        wait_for(lambda: len(rl_steps(read_metrics(tmp_path / "out"))) >= 2, 240, proc, "2 RL steps", log)
        known = descendants(proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc, known)
    assert rc == 143, tail(log)
    lines = log.read_text().splitlines()
    stopped = next(line for line in lines if line.startswith("stopped (SIGTERM): actors stopped; "))
    saved = any((tmp_path / "out" / "checkpoints").glob("step_*/COMPLETE"))
    assert stopped.endswith("--resume" if saved else "yet: to go on, start the run again"), tail(log)
    _, alive = psutil.wait_procs(known, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


@pytest.mark.slow
def test_sigterm_while_the_actors_start_stops_the_run_without_waiting_for_them(tmp_path: Path) -> None:
    """A `ray job stop` during the actors' start waited for the engines and the trainer to come up (41 s in an
    operator's run) before it stopped them, and a job's short stop wait SIGKILLed the driver first, no hint printed."""
    log = tmp_path / "run.log"
    proc = start_run(small_run_args(tmp_path, 4, "--run.logging.plot", "false", *ONE_ENGINE), log)
    known: list[psutil.Process] = []
    try:
        wait_for(lambda: " trainer placed (" in log.read_text(), 240, proc, "the actors' placement", log)
        known = descendants(proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            kill_tree(proc, known)
    text = log.read_text()
    assert rc == 143 and "stopped (SIGTERM): actors stopped; " in text, tail(log)
    assert "rank(s)) ready in" not in text and took < 15, (took, tail(log))  # an engine starts in ~10-20 s here
    _, alive = psutil.wait_procs(known, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
