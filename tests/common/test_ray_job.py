"""Whether a process is a Ray job's entrypoint, as the job supervisor tells it (`RAY_JOB_CONFIG_JSON_ENV_VAR`), and
what a run directory's lock then says about its holder."""

from __future__ import annotations

import json

import pytest

from common.ray_job import ray_job_submission_id, ray_job_working_dir
from common.run_dir import RunDirBusy, RunDirLock

CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def test_a_jobs_submission_id_and_working_dir(tmp_path, monkeypatch):
    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    monkeypatch.delenv(CONFIG, raising=False)
    assert ray_job_submission_id() is None and ray_job_working_dir() is None
    monkeypatch.setenv(CONFIG, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"},
                                           "metadata": {"job_submission_id": "s5c", "job_name": "s5c"}}))  # fmt: skip
    assert ray_job_submission_id() == "s5c" and ray_job_working_dir() == package
    monkeypatch.chdir(tmp_path)  # an entrypoint that changed directory first
    assert ray_job_working_dir() is None and ray_job_submission_id() == "s5c"
    monkeypatch.setenv(CONFIG, "not json")
    assert ray_job_submission_id() is None and ray_job_working_dir() is None


def test_a_run_directory_held_by_a_job_names_the_job_to_stop(tmp_path, monkeypatch):
    """An operator refused a run directory was told a pid on the head node, not the job to `ray job stop`."""
    monkeypatch.setenv(CONFIG, json.dumps({"metadata": {"job_submission_id": "raysubmit_42"}}))
    holder = RunDirLock(tmp_path, what="run directory", field="run.output_dir")
    holder.acquire()
    try:
        with pytest.raises(RunDirBusy, match=r"Ray job 'raysubmit_42' \(`ray job stop raysubmit_42` stops it\)"):
            RunDirLock(tmp_path, what="run directory", field="run.output_dir").acquire()
    finally:
        holder.release()
