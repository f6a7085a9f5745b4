"""Shared helpers of the integration tests: run ``rl_align.py`` as a subprocess we own, watch it, and kill what it
started (never anything else: no cluster-wide Ray shutdown, no name-based kills)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
RECIPE = "recipes/grpo_tiny.toml"


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment minus anything that would join another Ray cluster, plus the test settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(
        OMP_NUM_THREADS="1",
        RAY_AUTH_MODE="disabled",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}",
    )
    env.update(extra)
    return env


def small_run_args(tmp: Path, num_steps: int, *extra: str) -> list[str]:
    """Overrides for a quick run of the default recipe whose outputs (and tiny model) live under ``tmp``."""
    return [
        "--run.num_steps", str(num_steps),
        "--run.num_prompts_per_step", "8",
        "--run.warm_start.num_steps", "5",
        "--run.eval.num_problems", "16",
        "--run.eval.every_num_steps", "0",
        "--run.logging.tensorboard", "false",
        "--run.output_dir", str(tmp / "out"),
        "--model.path", str(tmp / "model"),
        *extra,
    ]  # fmt: skip


def start_run(args: list[str], log_path: Path, recipe: str = RECIPE, **env: str) -> subprocess.Popen:
    """Start ``rl_align.py --recipe <recipe> <args>`` in its own session, output to ``log_path``."""
    log = log_path.open("w")
    return subprocess.Popen(
        [PYTHON, "rl_align.py", "--recipe", recipe, *args],
        cwd=REPO, env=clean_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def descendants(proc: subprocess.Popen | int) -> list[psutil.Process]:
    """Every live process below ``proc`` (Ray's GCS, raylet and workers of an embedded instance included)."""
    try:
        return psutil.Process(proc if isinstance(proc, int) else proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen, known: list[psutil.Process] = ()) -> None:
    """SIGKILL ``proc``, its process group and every descendant (plus ``known`` ones that may have been reparented)."""
    victims = [*descendants(proc), *known]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(victims, timeout=10)


def wait_for(cond: Callable[[], object], timeout_s: float, proc: subprocess.Popen | None, what: str, log: Path):
    """Poll ``cond`` until truthy (returned); fail with the log tail on timeout or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n{tail(log)}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}:\n{tail(log)}")


def tail(path: Path, num_chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except FileNotFoundError:
        return "<no log>"


def read_metrics(out_dir: Path) -> list[dict]:
    """Records of ``<out_dir>/metrics.jsonl``; a line cut by a kill is ignored."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def rl_steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if r.get("phase") == "rl"]
