"""The embedded Ray session: a private instance that spends no start-up CPU on worker processes no actor can use."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from driver.session import ray_session


def _idle_workers() -> list[psutil.Process]:
    """Ray worker processes below this one that hold no task or actor (Ray titles them ``ray::IDLE``)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "ray::IDLE" in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_an_embedded_session_prestarts_no_workers(monkeypatch):
    """Every actor of a run brings its own runtime environment, so workers Ray prestarts for the driver would only
    take CPU from the actors' start (two of them, ~0.3 CPU-s each, on a 2-core host)."""
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with ray_session(None) as where:
        assert where == "embedded"
        time.sleep(3)  # Ray prestarts them right after the driver connects
        assert _idle_workers() == []


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, reaped by nobody here, are not running)."""
    return any(p.info["status"] != psutil.STATUS_ZOMBIE for p in psutil.process_iter(["status"])
               if _pgid(p.pid) == pgid)  # fmt: skip


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_a_killed_drivers_ray_directory_is_removed_by_the_next_embedded_run(tmp_path):
    """A run ended by SIGKILL leaves its embedded Ray's directory in /tmp (a run that ends removes its own); the next
    embedded run removes it, and never one whose driver still runs."""
    import os
    import signal
    import subprocess
    import sys

    pytest.importorskip("ray")
    from driver.session import remove_killed_sessions

    code = ("import time\nfrom driver.session import ray_session\nwith ray_session(None):\n"
            "    print('up', flush=True)\n    time.sleep(600)\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)  # fmt: skip
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "up\n"
        owned = [d for d in Path("/tmp").glob("rlray_*") if (d / ".rl_align.lock").is_file()
                 and f"pid {driver.pid} " in (d / ".rl_align.lock").read_text()]  # fmt: skip
        assert len(owned) == 1
        assert owned[0] not in remove_killed_sessions()  # its driver runs
        driver.kill()  # the driver alone, as `kill -9` does
        driver.wait(timeout=30)
        time.sleep(5)  # most of Ray's processes die with their driver meanwhile
        assert owned[0].is_dir()
        assert owned[0] in remove_killed_sessions() and not owned[0].exists()
        deadline = time.monotonic() + 10  # a process the sweep stopped may take a moment to go on a loaded machine
        while _group_alive(driver.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(driver.pid), "Ray's processes outlived their driver's clean-up"
    finally:
        if _group_alive(driver.pid):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()

    # A directory whose driver holds its lock, one without a lock file (older code) and one where Ray never started
    # (a run creating it this instant) are left alone.
    from common.run_dir import RunDirLock

    dead, live, unowned, fresh = (tmp_path / f"rlray_{name}" for name in ("dead", "live", "unowned", "fresh"))
    for d in (dead, live, unowned, fresh):
        d.mkdir()
        if d is not fresh:
            (d / "session_2026").mkdir()
        if d is not unowned:
            (d / ".rl_align.lock").write_text("pid 1 on elsewhere\n")
    with RunDirLock(live):
        assert remove_killed_sessions(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and unowned.is_dir() and fresh.is_dir()


def test_a_sigterm_to_the_drivers_whole_process_group_ends_it_at_once():
    """``timeout``, service managers and batch schedulers signal the whole group, which holds an embedded Ray's GCS
    and raylet too: the driver waited out Ray's 60 s for the GCS, then died with exit 1 and no word on resuming."""
    import os
    import signal
    import subprocess
    import sys

    pytest.importorskip("ray")
    code = (
        "import signal, time\n"
        "from driver.run import _sigterm_stops_the_run\n"
        "from driver.session import exit_process, ray_session\n"
        "import threading\n"
        "try:\n"
        "    with ray_session(None), _sigterm_stops_the_run(threading.Event()):\n"
        "        import ray\n"
        "        busy = ray.remote(lambda: time.sleep(600)).remote()\n"
        "        print('up', flush=True)\n"
        "        ray.get(busy)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped', flush=True)\n"
        "    exit_process(143)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)  # fmt: skip
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "up\n"
        time.sleep(2)  # the task's worker is up
        start = time.monotonic()
        os.killpg(driver.pid, signal.SIGTERM)
        out, err = driver.communicate(timeout=40)
        assert driver.returncode == 143 and out == "stopped\n", (driver.returncode, out, err[-2000:])
        assert time.monotonic() - start < 20, "it waited for Ray's processes"
        assert "stopped with the driver" in err, err[-2000:]
        deadline = time.monotonic() + 10
        while _group_alive(driver.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(driver.pid)
    finally:
        if _group_alive(driver.pid):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


def test_only_a_sigterm_makes_the_driver_ask_whether_ray_answers():
    """A slow but live cluster must never be taken for a dead one (its actors left running): without a SIGTERM, or
    before Ray started, nothing is asked."""
    import subprocess
    import sys

    code = ("import time\nfrom driver.session import note_sigterm, ray_reachable\nstart = time.monotonic()\n"
            "assert ray_reachable()\nnote_sigterm()\nassert ray_reachable()  # Ray never started\n"
            "assert time.monotonic() - start < 1\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
