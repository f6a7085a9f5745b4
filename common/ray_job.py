"""Whether this process is a Ray job's entrypoint running in Ray's copy of the job's working directory (no Ray
import: the recipe's checks ask too)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ray_job_submission_id", "ray_job_working_dir"]

_RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a job's entrypoint
_RAY_WORKING_DIRS = "working_dir_files"  # where a node unpacks jobs' working directories (runtime_resources/...)


def _job_config() -> dict[str, Any]:
    try:
        job = json.loads(os.environ.get(_RAY_JOB_CONFIG, "{}"))
    except ValueError:
        return {}
    return job if isinstance(job, dict) else {}


def ray_job_submission_id() -> str | None:
    """The submission id of the Ray job this process is the entrypoint of (what `ray job stop` takes), else None."""
    metadata = _job_config().get("metadata")
    job_id = metadata.get("job_submission_id") if isinstance(metadata, dict) else None
    return job_id if isinstance(job_id, str) and job_id else None


def ray_job_working_dir() -> Path | None:
    """The directory this process runs in when it is a Ray job's entrypoint running in its ``working_dir`` (Ray's
    copy of the uploaded directory, ``<session>/runtime_resources/working_dir_files/_ray_pkg_<hash of the
    contents>``), else None (also for an entrypoint that changed to another directory first)."""
    runtime_env = _job_config().get("runtime_env")
    if not (isinstance(runtime_env, dict) and runtime_env.get("working_dir")):
        return None
    cwd = Path.cwd()
    return cwd if _RAY_WORKING_DIRS in cwd.parts else None
