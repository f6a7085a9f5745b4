"""CPU time a process spends, read in laps: how the run measures how busy its cores are (``perf/cores_busy``)."""

from __future__ import annotations

import threading
import time

__all__ = ["CpuClock"]


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
