"""The README's cluster path: start a local Ray cluster (own temp dir and ports), ``ray job submit --working-dir .``
the default recipe with small overrides, and check that the job succeeded and wrote its metrics."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from it_helpers import ONE_ENGINE, RAY, RECIPE, REPO, RayNode, clean_env, read_metrics, rl_steps, small_run_args

# Never upload the venv, run outputs, caches or git objects (most are in .gitignore too, which Ray also honours).
EXCLUDES = [".git", ".venv", "/runs", "/artifacts", ".hypothesis", ".pytest_cache", "__pycache__", "*.egg-info"]


@pytest.fixture
def ray_cluster(tmp_path: Path):
    """A one-node Ray cluster with the dashboard, as a `ray start --block` subprocess we own; yields the job API URL."""
    head = RayNode(tmp_path / "ray_start.log", num_cpus=4, dashboard=True)
    try:
        head.wait_dashboard()
        yield head.dashboard_url, Path(head.temp_dir)
    finally:
        head.stop()


def test_ray_job_submit_runs_recipe_to_success(ray_cluster: tuple[str, Path], tmp_path: Path) -> None:
    url, ray_temp_dir = ray_cluster
    submission_id = f"rl-align-it-{int(time.time())}"
    overrides = small_run_args(tmp_path, 2, "--run.logging.plot", "false", *ONE_ENGINE)
    cmd = [RAY, "job", "submit", "--address", url, "--submission-id", submission_id, "--working-dir", ".",
           # An env var rl_align sets for its actors too: Ray refused the driver's runtime env over it.
           "--runtime-env-json", json.dumps({"excludes": EXCLUDES, "env_vars": {"OMP_NUM_THREADS": "1"}}),
           "--", "python", "rl_align.py", "--recipe", RECIPE, *overrides]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=420)
    output = done.stdout + done.stderr

    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(url)
    status = client.get_job_status(submission_id)
    assert status == JobStatus.SUCCEEDED, f"job {status}; submit exit {done.returncode}:\n{output[-6000:]}"
    assert done.returncode == 0, output[-6000:]
    logs = client.get_job_logs(submission_id)
    assert "held-out problems" in logs and "start of RL" in logs, logs[-4000:]
    assert "Ray: embedded" not in logs, "the job started an embedded Ray instead of joining the cluster"
    # What each engine start and checkpoint used to print into an operator's log, saying nothing to them.
    for noise in ("reduce_op", "Triton not available", "Loading safetensors", "torch.distributed is disabled"):
        assert noise not in logs, f"{noise!r} in the job's log:\n{logs[-4000:]}"

    records = read_metrics(tmp_path / "out")
    assert rl_steps(records) == [0, 1]
    assert all(r["reward/mean"] is not None for r in records if r["phase"] == "rl")
    assert [r["step"] for r in records if r["phase"] == "eval"] == [-1, 1]
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [0, 0, 1, 1]  # run.logging.samples_per_step = 2
    assert all(r["prompt"].startswith("<|im_start|>") and r["completion"] for r in samples), samples[0]
    # The job ran from the uploaded copy of the working directory, which left the venv and run outputs behind.
    pkgs = ray_temp_dir.glob("session_latest/runtime_resources/working_dir_files/_ray_pkg_*")
    unpacked = [p for p in pkgs if p.is_dir()]
    assert len(unpacked) == 1, unpacked
    assert (unpacked[0] / "rl_align.py").is_file() and (unpacked[0] / "recipes" / "grpo_tiny.toml").is_file()
    for excluded in (".venv", ".git", "runs", "artifacts"):
        assert not (unpacked[0] / excluded).exists(), f"{excluded} was uploaded with the working dir"
