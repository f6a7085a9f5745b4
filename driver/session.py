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
from typing import Any

__all__ = ["ray_job_working_dir", "ray_session", "remove_killed_sessions", "worker_env_vars"]

_RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a job's entrypoint
_RAY_WORKING_DIRS = "working_dir_files"  # where a node unpacks jobs' working directories (runtime_resources/...)
_TEMP_ROOT, _PREFIX = "/tmp", "rlray_"  # an embedded instance's directory
_OWNER = "driver"  # in it: the driver process's tag (_process_tag)

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


def remove_killed_sessions(root: Path | None = None) -> list[Path]:
    """Clear what embedded Ray instances of this user's killed runs left (a run that ends clears its own), and return
    their directories (``<root>/rlray_*``, default ``/tmp``). A killed driver takes most of Ray's processes with it,
    but Ray 2.60's dashboard and runtime-env agents outlive it (~230 MB, still running minutes later); those of this
    user that hold files in the directory are stopped, then the directory is removed. An instance counts as killed
    only when its owner file names a process that no longer runs (the same pid with another start time is another
    process); a directory without that file (a run of older code, or one starting this instant) is left."""
    removed = []
    for candidate in sorted((root or Path(_TEMP_ROOT)).glob(f"{_PREFIX}*")):
        try:
            if candidate.stat().st_uid != os.getuid():
                continue
            pid, _, tag = (candidate / _OWNER).read_text().partition(" ")
            alive = _process_tag(int(pid)) == f"{pid} {tag}"
        except (OSError, ValueError):
            continue
        if not alive:
            _stop(_holding_files_in(candidate))
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def _holding_files_in(directory: Path) -> list[Any]:
    """This user's processes with a file open under ``directory``."""
    import psutil

    found = []
    for process in psutil.process_iter(["uids"]):
        try:
            if process.info["uids"] is None or process.info["uids"].real != os.getuid():
                continue
            if any(Path(f.path).is_relative_to(directory) for f in process.open_files()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _stop(processes: list[Any], grace_s: float = 10.0) -> None:
    """SIGTERM ``processes`` (psutil), then SIGKILL those still running after ``grace_s``."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _process_tag(pid: int) -> str:
    """``"<pid> <start time>"`` of a running process, which a later process with the same pid does not share; ``""``
    when none runs."""
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time()}"
    except psutil.Error:
        return ""


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
    remove_killed_sessions()
    temp_dir = tempfile.mkdtemp(prefix=_PREFIX, dir=_TEMP_ROOT)  # short: Ray's socket paths must stay < 108 bytes
    (Path(temp_dir) / _OWNER).write_text(_process_tag(os.getpid()))
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
