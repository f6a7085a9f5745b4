"""What a benchmark prints about the machine it ran on: the CPU model and the load averages."""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_model", "load_avg"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_avg() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
