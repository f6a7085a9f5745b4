"""What every benchmark shares: the machine it ran on (CPU model, the ISA extensions matmuls run on, load averages),
``median [min-max]`` of repeated figures, this process's resident memory and its peak, and a measurement in a fresh
process of its own (so its peak memory is its alone)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.cpu import cpu_flags
from common.net import free_port

__all__ = [
    "cpu_isa", "cpu_model", "init_single_rank_group", "load_avg", "machine_line", "med_range",
    "reset_peak_rss", "rss_bytes", "run_in_child",
]  # fmt: skip

_MATMUL_ISA = (
    "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip
"""The ``/proc/cpuinfo`` flags that decide which kernels oneDNN / OpenBLAS / vLLM's CPU ops pick (x86 and Arm)."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_isa() -> str:
    """The matmul-relevant ISA extensions this CPU reports (space-separated, in a fixed order), or ``unknown``."""
    flags = cpu_flags()
    if flags is None:
        return "unknown"
    return " ".join(f for f in _MATMUL_ISA if f in flags) or "none of " + " ".join(_MATMUL_ISA)


def machine_line() -> str:
    """One line a benchmark prints first: CPU model, cores, ISA extensions and the load averages now."""
    return f"cpu: {cpu_model()} ({os.cpu_count()} cores; {cpu_isa()}); load: {load_avg()}"


def init_single_rank_group(backend: str = "gloo") -> None:
    """A one-rank process group (``backend``, e.g. ``cpu:gloo,cuda:nccl`` on a GPU) on a free loopback port: what a
    single-rank trainer runs under."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def load_avg() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def med_range(values: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min-max]`` of repeated figures (just the value for one, ``-`` for none)."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak since start or the last :func:`reset_peak_rss` (``VmHWM``),
    in bytes (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> None:
    """Start the peak (``VmHWM``) again from the current resident set (Linux ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def run_in_child(target: Callable[..., None], *args: Any) -> dict[str, Any]:
    """Run ``target(*args, out)`` in a fresh spawned process and return the JSON object it wrote to the path ``out``.

    Raises ``RuntimeError`` naming the target and the exit code when the child fails (``-9``: killed, usually by the
    kernel for memory)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        proc = mp.get_context("spawn").Process(target=target, args=(*args, out))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{target.__name__}{args} failed with exit code {proc.exitcode}")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
