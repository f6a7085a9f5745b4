"""The embedded Ray session: a private instance that spends no start-up CPU on worker processes no actor can use."""

from __future__ import annotations

import time

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
