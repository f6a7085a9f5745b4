"""The README's cluster path: start a local Ray cluster (own temp dir and ports), ``ray job submit --working-dir .``
the default recipe with small overrides, and check that the job succeeded and wrote its metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from it_helpers import PYTHON, RECIPE, REPO, clean_env, free_port, kill_tree, read_metrics, rl_steps, small_run_args

RAY = str(Path(PYTHON).parent / "ray")
# Never upload the venv, run outputs, caches or git objects (most are in .gitignore too, which Ray also honours).
EXCLUDES = [".git", ".venv", "/runs", "/artifacts", ".hypothesis", ".pytest_cache", "__pycache__", "*.egg-info"]


@pytest.fixture
def ray_cluster(tmp_path: Path):
    """A one-node Ray cluster with the dashboard, as a `ray start --block` subprocess we own; yields the job API URL."""
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    dashboard_port = free_port()
    ports = {
        "--port": free_port(), "--dashboard-port": dashboard_port, "--ray-client-server-port": free_port(),
        "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(), "--metrics-export-port": free_port(),
        "--node-manager-port": free_port(), "--object-manager-port": free_port(),
    }  # fmt: skip
    cmd = [RAY, "start", "--head", "--block", "--temp-dir", temp_dir, "--num-cpus", "4", "--include-dashboard", "true",
           "--dashboard-host", "127.0.0.1", "--disable-usage-stats"]  # fmt: skip
    for flag, port in ports.items():
        cmd += [flag, str(port)]
    log = tmp_path / "ray_start.log"
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"ray start exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2) as r:
                    json.load(r)
                break
            except OSError:
                assert time.monotonic() < deadline, f"dashboard not up after 120 s:\n{log.read_text()[-4000:]}"
                time.sleep(0.5)
        yield url, Path(temp_dir)
    finally:
        kill_tree(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_recipe_to_success(ray_cluster: tuple[str, Path], tmp_path: Path) -> None:
    url, ray_temp_dir = ray_cluster
    submission_id = f"rl-align-it-{int(time.time())}"
    overrides = small_run_args(tmp_path, 2, "--run.logging.plot", "false")
    cmd = [RAY, "job", "submit", "--address", url, "--submission-id", submission_id, "--working-dir", ".",
           "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
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

    records = read_metrics(tmp_path / "out")
    assert rl_steps(records) == [0, 1]
    assert all(r["reward/mean"] is not None for r in records if r["phase"] == "rl")
    assert [r["step"] for r in records if r["phase"] == "eval"] == [-1, 1]
    # The job ran from the uploaded copy of the working directory, which left the venv and run outputs behind.
    pkgs = ray_temp_dir.glob("session_latest/runtime_resources/working_dir_files/_ray_pkg_*")
    unpacked = [p for p in pkgs if p.is_dir()]
    assert len(unpacked) == 1, unpacked
    assert (unpacked[0] / "rl_align.py").is_file() and (unpacked[0] / "recipes" / "grpo_tiny.toml").is_file()
    for excluded in (".venv", ".git", "runs", "artifacts"):
        assert not (unpacked[0] / excluded).exists(), f"{excluded} was uploaded with the working dir"
