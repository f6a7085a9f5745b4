"""Shared helpers of the integration tests: run ``rl_align.py`` as a subprocess we own, watch it, and kill what it
started (never anything else: no cluster-wide Ray shutdown, no name-based kills)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

from common.net import free_port

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
RECIPE = "recipes/grpo_tiny.toml"
RAY = str(Path(PYTHON).parent / "ray")


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


ONE_ENGINE = ("--rollout.num_workers", "1")
"""For a test whose point is not the engines: one vLLM import at start-up instead of the recipe's two ('auto' on two
cores), ~10 s less on a 2-core machine. The recipe's two colocated engines are run by ``test_threads``, a lost one
beside a live one by ``test_multi_node``."""


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


def run_to_end(args: list[str], log_path: Path, recipe: str, timeout_s: float, **env: str) -> int:
    """Run ``rl_align.py --recipe <recipe> <args>`` (:func:`start_run`, ``env`` added) to its end; its exit code. Past
    ``timeout_s`` the whole process tree is killed and ``subprocess.TimeoutExpired`` raised."""
    proc = start_run(args, log_path, recipe=recipe, **env)
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc)


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


class RayNode:
    """One node of a Ray cluster on this machine, as a ``ray start --block`` process we own: its own temp dir (so its
    sockets are its own) and ports. The head (``address`` None) runs the GCS, and the dashboard when asked; a worker
    node joins ``address``. :meth:`kill` is the node being lost: SIGKILL to its raylet and everything it started."""

    def __init__(self, log: Path, num_cpus: int, address: str | None = None, dashboard: bool = False,
                 system_config: dict | None = None) -> None:  # fmt: skip
        self.temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
        self.log = log
        self.tag = Path(self.temp_dir).name  # a resource only this node has: how to tell it in Ray's node list
        cmd = [RAY, "start", "--block", "--temp-dir", self.temp_dir, "--num-cpus", str(num_cpus),
               "--resources", json.dumps({self.tag: 1}), "--disable-usage-stats"]  # fmt: skip
        ports = {
            "--node-manager-port": free_port(), "--object-manager-port": free_port(),
            "--metrics-export-port": free_port(), "--runtime-env-agent-port": free_port(),
            "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
        }  # fmt: skip
        self.address, self.dashboard_url = address, None
        if address is None:
            port, dashboard_port = free_port(), free_port()
            self.address = f"127.0.0.1:{port}"
            self.dashboard_url = f"http://127.0.0.1:{dashboard_port}" if dashboard else None
            ports.update({"--port": port, "--ray-client-server-port": free_port(), "--dashboard-port": dashboard_port})
            cmd += ["--head", "--include-dashboard", str(dashboard).lower(), "--dashboard-host", "127.0.0.1"]
            if system_config:
                cmd += ["--system-config", json.dumps(system_config)]
        else:
            cmd += ["--address", address]
        for flag, value in ports.items():
            cmd += [flag, str(value)]
        with log.open("w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, env=clean_env(), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip

    def wait_dashboard(self, timeout_s: float = 120) -> None:
        """Block until the head's dashboard answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"ray start exited ({self.proc.returncode}):\n{tail(self.log)}"
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2) as r:
                    json.load(r)
                return
            except OSError:
                assert time.monotonic() < deadline, f"dashboard not up after {timeout_s} s:\n{tail(self.log)}"
                time.sleep(0.5)

    def is_node(self, resources_total: dict) -> bool:
        """Whether the Ray node of these total resources is this one."""
        return self.tag in resources_total

    def wait_joined(self, head: RayNode, timeout_s: float) -> bool:
        """Block until this node is alive in ``head``'s node list (True), or until its ``ray start`` exits or
        ``timeout_s`` passes (False)."""
        from ray.util.state import list_nodes

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            alive = list_nodes(address=head.dashboard_url, filters=[("state", "=", "ALIVE")])
            if any(self.is_node(node.resources_total) for node in alive):
                return True
            time.sleep(0.5)
        return False

    def kill(self) -> None:
        """SIGKILL the node and everything it started (its actors' workers included), as a lost host would go."""
        if self.proc.poll() is None or descendants(self.proc):
            kill_tree(self.proc)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
