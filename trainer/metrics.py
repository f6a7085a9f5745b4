"""Combining per-micro-batch metrics into one flat dict per step, across micro-batches and ranks.

Each micro-batch reports a flat ``{name: value}`` (see ``trainer.rl.loss``), a value being a float or a 0-dim tensor
still on the device: the accumulator reads a micro-batch's tensors in one transfer when the step reduces, so the
micro-batches never wait on the host (a read per metric is a device round trip on a GPU, and on ``xla`` a graph of
its own). How a name combines follows from what it is, decided by :func:`reduction_of`:

- loss terms (``loss``, ``*_loss``, ``loss/*``) are already divided by the *global* token/sequence count, so they
  **sum** to the full-batch value; so do counts (``num_*``);
- ``*_max`` / ``*_min`` take the max / min;
- everything else is a per-token mean and is averaged weighted by the micro-batch's completion tokens.

One ``all_reduce`` per reduction kind; every rank gets the same result. :class:`PhaseClock` times the phases of a step
on one rank (wall seconds, not reduced: ranks wait for each other inside collectives anyway).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.distributed as dist

from trainer.devices import synchronize

__all__ = ["MetricValue", "Metrics", "MetricsAccumulator", "PhaseClock", "is_timing", "reduction_of"]

Reduction = Literal["sum", "max", "min", "mean"]
MetricValue = float | torch.Tensor
"""A metric of one micro-batch: a float, or a 0-dim tensor on the device that computed it."""
Metrics = dict[str, MetricValue]


def reduction_of(name: str) -> Reduction:
    """How metric ``name`` combines across micro-batches and ranks (see the module docstring)."""
    if name == "loss" or name.endswith("_loss") or name.startswith(("loss/", "num_")):
        return "sum"
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def is_timing(name: str) -> bool:
    """Whether metric ``name`` is a duration or a rate (``*_s`` seconds, ``*_per_s``): the values that differ between
    runs of identical numerics."""
    return name.endswith("_s")


class MetricsAccumulator:
    """Collects micro-batch metrics on one rank; :meth:`reduce` combines them over all ranks (collective)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._weights: dict[str, float] = defaultdict(float)
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._pending: list[tuple[list[str], torch.Tensor, dict[str, float], float]] = []

    def add(self, metrics: Metrics, weight: float) -> None:
        """Add one micro-batch's metrics; ``weight`` is its completion-token count (0 for an empty micro-batch).
        Tensor values are stacked here (one small op on their device) and read when the step reduces."""
        names = [n for n, v in metrics.items() if isinstance(v, torch.Tensor)]
        floats = {n: float(v) for n, v in metrics.items() if not isinstance(v, torch.Tensor)}
        if not names:
            self._add_floats(floats, weight)
            return
        tensors = [metrics[n].detach().reshape(()) for n in names]  # type: ignore[union-attr]
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        self._pending.append((names, torch.stack([t.to(dtype) for t in tensors]), floats, weight))

    def _add_floats(self, metrics: dict[str, float], weight: float) -> None:
        for name, value in metrics.items():
            kind = reduction_of(name)
            if kind == "sum":
                self._sums[name] += value
                self._weights[name] = 1.0
            elif kind == "mean":
                self._sums[name] += value * weight
                self._weights[name] += weight
            elif weight > 0 and kind == "max":
                self._max[name] = max(self._max.get(name, value), value)
            elif weight > 0 and kind == "min":
                self._min[name] = min(self._min.get(name, value), value)

    def _read_pending(self) -> None:
        for names, stacked, floats, weight in self._pending:
            self._add_floats({**floats, **dict(zip(names, stacked.cpu().tolist()))}, weight)
        self._pending.clear()

    def reduce(self, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Combine over the ranks of ``group`` (collective; default: all ranks). Pass the data-parallel group: ranks
        of one tensor-parallel group see the same data and must not be counted twice. ``device``: where the group's
        backend communicates.

        Every rank must have seen the same metric names (true when every rank ran the same number of micro-batches
        under the same config, as ``trainer.packing`` guarantees).
        """
        self._read_pending()
        names = sorted(set(self._sums) | set(self._max) | set(self._min))
        sums = [n for n in names if reduction_of(n) in ("sum", "mean")]
        maxes = [n for n in names if reduction_of(n) == "max"]
        mins = [n for n in names if reduction_of(n) == "min"]
        vec = torch.tensor(
            [self._sums.get(n, 0.0) for n in sums] + [self._weights.get(n, 0.0) for n in sums],
            dtype=torch.float64,
            device=device,
        )
        hi = torch.tensor([self._max.get(n, float("-inf")) for n in maxes], dtype=torch.float64, device=device)
        lo = torch.tensor([self._min.get(n, float("inf")) for n in mins], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(vec, group=group)
            if maxes:
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            if mins:
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        out: dict[str, float] = {}
        for j, n in enumerate(sums):
            total, weight = float(vec[j]), float(vec[len(sums) + j])
            out[n] = total if reduction_of(n) == "sum" else (total / weight if weight > 0 else 0.0)
        out.update({n: float(v) for n, v in zip(maxes, hi.tolist())})
        out.update({n: float(v) for n, v in zip(mins, lo.tolist())})
        return out


class PhaseClock:
    """Wall seconds of named phases on this rank, summed over every time each runs::

        clock = PhaseClock(device)
        with clock.phase("optimizer"):
            ...
        clock.metrics()  # {"optimizer_s": ...}

    On an accelerator, queued work is waited for at each phase boundary (:func:`trainer.devices.synchronize`), so its
    time lands on the phase that queued it (a device round trip per boundary, a few per optimizer step); on CPU ops
    finish when called and nothing waits.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (added to what earlier runs of it took)."""
        self._wait()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self._seconds[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``{"<phase>_s": seconds}`` for every phase that ran."""
        return {f"{name}_s": seconds for name, seconds in self._seconds.items()}

    def _wait(self) -> None:
        synchronize(self._device)
