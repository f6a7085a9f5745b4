"""This host's CPU: the time a process spends, read in laps (how the run measures how busy its cores are,
``perf/cores_busy``), and the feature flags it reports."""

from __future__ import annotations

import threading
import time
from pathlib import Path

__all__ = ["CpuClock", "cpu_flags"]


def cpu_flags() -> set[str] | None:
    """The feature flags this CPU reports in ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``), or None where none
    can be read (not Linux, or no such line)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    line = next((line for line in lines if line.startswith(("flags", "Features"))), None)
    return None if line is None else set(line.partition(":")[2].split())


class CpuClock:
    """CPU seconds (user + system, every thread of this process) between consecutive :meth:`lap` calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.process_time()

    def lap(self) -> float:
        """CPU seconds since the previous lap (or since the clock was made); thread-safe."""
        with self._lock:
            now = time.process_time()
            spent, self._last = now - self._last, now
        return spent
