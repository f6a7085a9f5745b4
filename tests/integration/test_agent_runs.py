"""A user's agent trained end to end through the endpoint, in async mode, while its rollout worker is killed with
episodes in flight: the replacement serves a new endpoint, the run finishes every step on fresh enough weights, and
the trained model is exported."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest
from it_helpers import descendants, kill_tree, read_metrics, rl_steps, small_run_args, start_run, tail, wait_for
from test_faults import _rollout_workers

RECIPE = "recipes/agent_openai_tiny.toml"


def test_an_agent_recipe_trains_async_through_a_killed_worker(tmp_path: Path) -> None:
    num_steps = 6
    args = small_run_args(tmp_path, num_steps, "--run.logging.plot", "false", "--run.mode", "async",
                          "--run.max_staleness", "1", "--algorithm.importance_sampling.enabled", "true")  # fmt: skip
    log = tmp_path / "run.log"
    proc = start_run(args, log, RECIPE)
    known: list[psutil.Process] = []
    try:
        wait_for(lambda: len(rl_steps(read_metrics(tmp_path / "out"))) >= 2, 300, proc, "2 RL steps", log)
        known = descendants(proc)
        [victim] = _rollout_workers(proc)
        victim.send_signal(signal.SIGKILL)  # async mode: the next batch's episodes are in flight on it
        victim.wait(timeout=30)
        known += wait_for(lambda: [w for w in _rollout_workers(proc) if w.pid != victim.pid], 120, proc,
                          "a replacement rollout worker", log)  # fmt: skip
        assert proc.wait(timeout=400) == 0, tail(log)
    finally:
        if proc.poll() is None:
            kill_tree(proc, known)
    records = read_metrics(tmp_path / "out")
    assert rl_steps(records) == list(range(num_steps)), tail(log)
    rl = [r for r in records if r["phase"] == "rl"]
    for r in rl:
        assert r["train/policy_version"] - 1 - r["rollout/min_policy_version"] <= 1, (r["step"], r)
        assert r["env/num_turns"] >= r["env/num_episodes"] > 0 and r["agent/num_samples"] >= r["env/num_episodes"]
    assert (tmp_path / "out" / "final_model" / "config.json").is_file(), tail(log)
    assert "held-out problems" in log.read_text()


@pytest.mark.slow
def test_dapo_dynamic_sampling_trains_agent_episodes_and_checkpoints(tmp_path: Path) -> None:
    """DAPO's dynamic sampling over agent episodes (groups drawn again until they differ), token-level loss over
    the masked trajectories, checkpoints on the way."""
    num_steps = 4
    args = small_run_args(tmp_path, num_steps, "--run.logging.plot", "false",
                          "--trainer.checkpoint.every_num_steps", "2")  # fmt: skip
    args += ["--environment.type", "agent", "--environment.function", "examples.agents.calculator:solve",
             "--environment.max_turns", "3"]  # fmt: skip
    log = tmp_path / "run.log"
    proc = start_run(args, log, "recipes/dapo_tiny.toml")
    try:
        assert proc.wait(timeout=600) == 0, tail(log)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    records = read_metrics(tmp_path / "out")
    rl = [r for r in records if r["phase"] == "rl"]
    assert rl_steps(records) == list(range(num_steps)), tail(log)
    assert all(r["agent/num_samples"] >= r["env/num_episodes"] > 0 for r in rl)
    assert all("train/loss" in r for r in rl) and all(r["rollout/dynamic_sampling_rounds"] >= 1 for r in rl), rl[0]
    assert (tmp_path / "out" / "checkpoints" / "step_00000004" / "COMPLETE").exists()
