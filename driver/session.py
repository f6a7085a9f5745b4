"""Ray for one run: join the cluster of ``ray job submit`` (or ``--address``), else start a private embedded instance.

An embedded instance gets its own temp dir and ports (shared machines: never touch another run's Ray) and is shut
down when the run ends. Worker processes get the thread and engine settings the run needs through ``env_vars``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ray_job_working_dir", "ray_session", "worker_env_vars"]

_RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a job's entrypoint
_RAY_WORKING_DIRS = "working_dir_files"  # where a node unpacks jobs' working directories (runtime_resources/...)

# Settings every actor process inherits. vLLM on CPU: in-process engine (fast start), a small KV cache unless the
# recipe says otherwise, no CPU reserved for a (non-existent) separate front-end process.
_DEFAULT_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_OFFLINE": "1",
}


def worker_env_vars(device: str = "cpu") -> dict[str, str]:
    """Environment for actor processes: the defaults above, overridden by this process's own values of those keys.

    On ``device == "tpu"`` torch-tpu must register its device at ``import torch``, so its autoload stays on.
    """
    env = {key: os.environ.get(key, value) for key, value in _DEFAULT_ENV.items()}
    # torch built with MKL sizes its OpenMP pool from MKL's thread count at import: OMP_NUM_THREADS is the one knob.
    env["MKL_NUM_THREADS"] = env["OMP_NUM_THREADS"]
    if device == "tpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1"
    return env


def ray_job_working_dir() -> Path | None:
    """The directory this process runs in when it is a Ray job's entrypoint running in its ``working_dir`` (Ray's
    copy of the uploaded directory, ``<session>/runtime_resources/working_dir_files/_ray_pkg_<hash of the
    contents>``), else None (also for an entrypoint that changed to another directory first)."""
    try:
        job = json.loads(os.environ.get(_RAY_JOB_CONFIG, "{}"))
    except ValueError:
        return None
    runtime_env = job.get("runtime_env") if isinstance(job, dict) else None
    if not (isinstance(runtime_env, dict) and runtime_env.get("working_dir")):
        return None
    cwd = Path.cwd()
    return cwd if _RAY_WORKING_DIRS in cwd.parts else None


@contextlib.contextmanager
def ray_session(address: str | None, device: str = "cpu") -> Iterator[str]:
    """Yield ``"embedded"`` or the joined address while Ray is initialised; shut an embedded instance down after.

    ``address`` None: join ``RAY_ADDRESS`` when set (``ray job submit`` sets it for the driver), else embed.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": worker_env_vars(device)}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        try:
            yield address
        finally:
            ray.shutdown()
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a stray ~/.ray/auth_token would silently turn auth on
    temp_dir = tempfile.mkdtemp(prefix="rlray_", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    ray.init(
        address="local",
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        _temp_dir=temp_dir,
        runtime_env=runtime_env,
        log_to_driver=True,
        # Ray would start a worker process per CPU for this driver's plain tasks while the actors start; every actor
        # of a run brings its own runtime environment (its threads), so none could use them: CPU taken from start-up.
        _system_config={"prestart_worker_first_driver": False},
    )
    try:
        yield "embedded"
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
