"""Ray for one run: join the cluster of ``ray job submit`` (or ``--address``), else start a private embedded instance.

An embedded instance gets its own temp dir and ports (shared machines: never touch another run's Ray) and is shut
down when the run ends. Worker processes get the thread and engine settings the run needs through ``env_vars``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.run_dir import LOCK, RunDirBusy, RunDirLock

__all__ = [
    "exit_process", "ray_reachable", "ray_session", "remove_killed_sessions", "worker_env_vars",
]

_TEMP_ROOT, _PREFIX = "/tmp", "rlray_"  # an embedded instance's directory
_PROBE_S = 5.0  # a live GCS answers in milliseconds, a loaded host's within a second or two

log = logging.getLogger("rl_align")
_gone = threading.Event()  # set once Ray was found gone: it does not come back
_terminated = threading.Event()  # the driver received SIGTERM (note_sigterm): only then can Ray have gone with it

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


def job_env_vars() -> dict[str, str]:
    """The environment variables this Ray job's runtime env sets (empty outside a job Ray's job manager started)."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # ray._private.runtime_env.constants: how Ray hands it over
    if not raw:
        return {}
    env = (json.loads(raw).get("runtime_env") or {}).get("env_vars") or {}
    return {str(k): str(v) for k, v in env.items()}


def remove_killed_sessions(root: Path | None = None) -> list[Path]:
    """Clear what embedded Ray instances of this user's killed runs left (a run that ends clears its own), and return
    their directories (``<root>/rlray_*``, default ``/tmp``). A killed driver takes most of Ray's processes with it,
    but Ray 2.60's dashboard and runtime-env agents outlive it (~230 MB, still running minutes later); this user's Ray
    processes that hold files in the directory are stopped, then the directory is removed.

    An instance counts as killed only when its driver's lock on the directory (``common.run_dir.RunDirLock``, held for
    the whole session; the kernel drops it when the driver ends, however it ends) is free, and Ray had started in it (a
    ``session_*`` directory): a run that has just created its directory, or a directory of older code (no lock file),
    is left alone."""
    removed = []
    for candidate in sorted((root or Path(_TEMP_ROOT)).glob(f"{_PREFIX}*")):
        try:
            if candidate.stat().st_uid != os.getuid() or not (candidate / LOCK).is_file():
                continue
            with RunDirLock(candidate, what="embedded Ray directory", field="-"):
                if not any(candidate.glob("session_*")):
                    continue
                _stop(_ray_processes_in(candidate))
                shutil.rmtree(candidate, ignore_errors=True)
        except (OSError, RunDirBusy):
            continue  # its driver runs (or it is not ours to read)
        removed.append(candidate)
    return removed


def _hold(directory: Path) -> RunDirLock:
    """Lock this run's new embedded Ray directory for the session (released when the process ends, however it ends:
    :func:`remove_killed_sessions` reads it). Another run's sweep may hold it for an instant, seeing an empty one."""
    lock = RunDirLock(directory, what="embedded Ray directory", field="-")
    for _ in range(100):
        try:
            lock.acquire()
            return lock
        except RunDirBusy:
            time.sleep(0.01)
    lock.acquire()
    return lock


def _ray_processes_in(directory: Path) -> list[Any]:
    """This user's Ray processes (named ``ray::...`` or naming ``directory`` on their command line) with a file open
    under ``directory``: never, say, a ``tail -f`` of one of its logs."""
    import psutil

    found = []
    for process in psutil.process_iter(["uids", "cmdline"]):
        try:
            if process.info["uids"] is None or process.info["uids"].real != os.getuid():
                continue
            command = " ".join(process.info["cmdline"] or [])
            if not (command.startswith("ray::") or str(directory) in command):
                continue
            if any(Path(f.path).is_relative_to(directory) for f in process.open_files()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _stop(processes: list[Any], grace_s: float = 10.0) -> None:
    """SIGTERM ``processes`` (psutil), then SIGKILL those still running after ``grace_s``; returns once they are gone
    (or ``grace_s`` more has passed)."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def note_sigterm() -> None:
    """Record that the driver received SIGTERM (``driver.run``'s handler): :func:`ray_reachable` then asks Ray."""
    _terminated.set()


def ray_reachable() -> bool:
    """Whether this process's Ray cluster still answers: True unless the driver received SIGTERM (:func:`note_sigterm`)
    and Ray's GCS then gave no answer within a few seconds (once not, never again).

    A SIGTERM to the driver's whole process group (``timeout``, a service manager, a batch scheduler) also reaches an
    embedded Ray's GCS and raylet, which share that group (Ctrl-C's SIGINT spares them: Ray blocks it in its
    processes). Every Ray call would then wait out Ray's own 60 s before the process is terminated, so the driver's
    way out asks first. Any other exit, or a Ray never started, does not ask: a slow but live cluster is never taken
    for a dead one there."""
    if _gone.is_set():
        return False
    import ray

    if not _terminated.is_set() or not ray.is_initialized():
        return True

    answered = threading.Event()

    def probe() -> None:
        with contextlib.suppress(Exception):
            ray.cluster_resources()
            answered.set()

    threading.Thread(target=probe, name="ray-probe", daemon=True).start()
    if not answered.wait(_PROBE_S):
        _gone.set()
    return not _gone.is_set()


def exit_process(code: int) -> None:
    """End the driver process with ``code``: ``sys.exit``, or, when its Ray was found gone (:func:`ray_reachable`),
    ``os._exit`` after flushing output, since the interpreter's teardown would crash in Ray's orphaned client."""
    if _gone.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


@contextlib.contextmanager
def ray_session(address: str | None, device: str = "cpu") -> Iterator[str]:
    """Yield ``"embedded"`` or the joined address while Ray is initialised; shut an embedded instance down after.

    ``address`` None: join ``RAY_ADDRESS`` when set (``ray job submit`` sets it for the driver), else embed.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    # Keys the job's own runtime env sets (`ray job submit --runtime-env-json`) are left to it: Ray refuses a driver
    # that sets them again, and this process holds the job's values, which worker_env_vars would pass on anyway.
    job_env = job_env_vars()
    runtime_env = {"env_vars": {k: v for k, v in worker_env_vars(device).items() if k not in job_env}}
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
    held = _hold(Path(temp_dir))
    try:
        ray.init(
            address="local",
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            _temp_dir=temp_dir,
            runtime_env=runtime_env,
            log_to_driver=True,
            # Ray would start a worker process per CPU for this driver's plain tasks while the actors start; every
            # actor of a run brings its own runtime environment (its threads), so none could use them.
            _system_config={"prestart_worker_first_driver": False},
        )
        yield "embedded"
    finally:
        if sys.exc_info()[0] is None or ray_reachable():
            ray.shutdown()
        else:  # its processes were stopped with this one (see ray_reachable): Ray's exit hook would wait for them
            log.warning("Ray's own processes were stopped with the driver (a signal to its whole process group)")
            atexit.unregister(ray.shutdown)
        shutil.rmtree(temp_dir, ignore_errors=True)
        held.release()
