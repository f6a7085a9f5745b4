"""Where a run's metrics go: a JSONL file always, TensorBoard, a live progress line, Prometheus, a PNG at the end.

One :class:`MetricsLogger` per run; ``log(step, metrics)`` fans a flat ``{name: float}`` dict out to every sink the
recipe turned on. Names are slash-separated groups (``reward/mean``, ``time/train_s``) so TensorBoard groups them.
TensorBoard gets two runs under ``<out>/tensorboard``: the RL steps and evaluations at its top, the warm start's SFT
steps in ``sft/`` (their step numbers are their own). The JSONL file is the record: a resumed run cuts it at its
checkpoint and rebuilds the TensorBoard events from what it kept (TensorBoard's own ``purge_step`` is honoured by its
Python loader only, not by the default Rust one).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from common.disk import free_bytes, is_no_space
from common.run_dir import METRICS, TENSORBOARD

__all__ = ["MetricsLogger", "MetricsWriteError", "keep_records", "plot_curves", "prometheus_port_taken", "read_jsonl"]

log = logging.getLogger("rl_align")

_PROGRESS_KEYS = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "acc"),
    ("train/kl", "kl"),
    ("perf/tokens_per_s", "tok/s"),
)


class MetricsWriteError(RuntimeError):
    """The metrics of a step could not be written (the message says why and what is free)."""


def _write_failure(out_dir: Path, error: OSError) -> str:
    free = free_bytes(out_dir)
    space = (f"; {free / 1e6:,.1f} MB are free under {out_dir}: free space or point run.output_dir at a larger volume"
             if free is not None and is_no_space(error) else "")  # fmt: skip
    return f"the metrics could not be written under {out_dir} ({type(error).__name__}: {error}){space}"


def keep_records(path: Path, keep: Callable[[dict[str, Any]], bool]) -> tuple[list[str], int]:
    """Rewrite the JSONL file ``path`` with the lines whose record ``keep`` accepts (atomically: a new file renamed
    over it); a line that is no JSON (cut short when a run was killed) goes too. Returns the kept lines and how many
    lines went."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and keep(record):
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return kept, len(lines) - len(kept)


def prometheus_port_taken(port: int, cause: str) -> str:
    """What to say when ``run.logging.prometheus_port`` cannot be served (``cause``: why the bind failed)."""
    return (f"run.logging.prometheus_port = {port}: cannot serve metrics on 127.0.0.1:{port} ({cause}): another "
            "process (another run on this host?) holds it; give this run another port")


class MetricsLogger:
    """Fan out step metrics to JSONL (``<out>/metrics.jsonl``) and the optional sinks; close() flushes everything and
    stops the Prometheus endpoint (its port is free again once close() returns).

    ``append=False`` starts the JSONL file afresh (a fresh run's driver first moves an earlier run's outputs aside:
    ``common.run_dir.set_aside_earlier_run``).
    """

    def __init__(
        self,
        out_dir: str | Path,
        num_steps: int,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        prometheus_port: int | None = None,
        append: bool = False,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS
        self._http: tuple[Any, threading.Thread] | None = None
        if prometheus_port is not None:  # first: a port another process holds fails before any file is touched
            import prometheus_client

            self._registry = prometheus_client.CollectorRegistry()
            try:
                self._http = prometheus_client.start_http_server(
                    prometheus_port, addr="127.0.0.1", registry=self._registry
                )
            except OSError as e:
                raise OSError(prometheus_port_taken(prometheus_port, str(e))) from None
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", self._http[0].server_port)
        self._fd = self._open(append)
        self._num_steps = num_steps
        self._progress = progress
        self._last_progress: float | None = None
        self._step_seconds: list[float] = []
        self._writer_class: Any = None
        if tensorboard:  # TensorBoard's own writer: torch's would import torch into the driver (~1 s of a busy core)
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._writer_class = EventFileWriter
        self._writers: dict[str, Any] = {}
        """TensorBoard writers by run ("" for RL and eval, "sft"), opened at their first record."""
        self._gauges: dict[str, Any] = {}

    def _open(self, append: bool) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)

    def log(self, step: int, metrics: Mapping[str, float], phase: str = "rl") -> None:
        """Record ``metrics`` for ``step`` in every sink; non-finite values are kept in JSONL as null.
        :class:`MetricsWriteError` when the JSONL file or TensorBoard's cannot be written (a full volume)."""
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        now = time.time()
        line = (json.dumps({"step": step, "phase": phase, "time": now, **clean}) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):  # unbuffered: a record is on disk, or none of it (cut back below)
                written += os.write(self._fd, line[written:])
            self._to_tensorboard(step, phase, now, clean)
        except OSError as e:
            with contextlib.suppress(OSError):  # no half record left for a reader; truncating needs no space
                os.ftruncate(self._fd, start)
            raise MetricsWriteError(_write_failure(self.out_dir, e)) from e
        if self._http is not None:
            self._export_prometheus(clean)
        if self._progress and phase == "rl":
            self._print_progress(step, clean)

    def drop_from(self, step: int) -> int:
        """Remove the RL and eval records of ``step`` and later from the JSONL file; return how many were removed.

        A resumed run calls this with its checkpoint's step: the killed run may have logged steps past its last
        checkpoint, which the resumed run trains again, and the curve must hold each step once. SFT records stay.
        With TensorBoard on, its event files are written anew from the records kept (every loader then shows each
        step once).
        """
        os.close(self._fd)
        kept, num_dropped = keep_records(self.path, lambda r: r.get("phase") == "sft" or r.get("step", -1) < step)
        self._fd = self._open(append=True)
        if self._writer_class is not None:
            for writer in self._writers.values():
                writer.close()
            self._writers = {}
            for stale in (self.out_dir / TENSORBOARD).glob("**/events.out.tfevents.*"):
                stale.unlink()
            for line in kept:
                record = json.loads(line)
                step_of, phase, wall_time = record.pop("step"), record.pop("phase"), record.pop("time", 0.0)
                self._to_tensorboard(step_of, phase, wall_time, record)
        return num_dropped

    def _to_tensorboard(self, step: int, phase: str, wall_time: float, metrics: Mapping[str, float | None]) -> None:
        """One event holding the record's scalars: RL ones under their names in the top run, others as
        ``<phase>/<name>``, SFT in the ``sft`` run."""
        if self._writer_class is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        run = "sft" if phase == "sft" else ""
        writer = self._writers.get(run)
        if writer is None:
            writer = self._writers[run] = self._writer_class(str(self.out_dir / TENSORBOARD / run))
        # An evaluation's "eval/accuracy" is one curve whether it came in an RL step's record or its own.
        tags = {name: name if phase == "rl" or name.startswith(f"{phase}/") else f"{phase}/{name}" for name in metrics}
        values = [Summary.Value(tag=tags[name], simple_value=value) for name, value in metrics.items()
                  if value is not None]  # fmt: skip
        writer.add_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))

    def _export_prometheus(self, metrics: Mapping[str, float | None]) -> None:
        import prometheus_client

        for name, value in metrics.items():
            key = "rl_align_" + "".join(c if c.isalnum() else "_" for c in name)
            if key not in self._gauges:
                self._gauges[key] = prometheus_client.Gauge(key, name, registry=self._registry)
            if value is not None:
                self._gauges[key].set(value)

    def _print_progress(self, step: int, metrics: Mapping[str, float | None]) -> None:
        # A step's seconds: the wall clock since the previous step's line (its evaluation and checkpoint included), or
        # for the first line of this process its own time/step_s (the clock started with the step, not before it).
        now = time.monotonic()
        own = metrics.get("time/step_s")
        seconds = now - self._last_progress if self._last_progress is not None else own
        self._last_progress = now
        if seconds is not None:
            self._step_seconds.append(seconds)
        per_step = sum(self._step_seconds) / len(self._step_seconds) if self._step_seconds else 0.0
        eta = per_step * max(self._num_steps - step - 1, 0)
        parts = [f"step {step + 1}/{self._num_steps}"]
        for key, label in _PROGRESS_KEYS:
            if metrics.get(key) is not None:
                parts.append(f"{label} {metrics[key]:.3g}")
        parts.append(f"{per_step:.1f}s/step ETA {eta:.0f}s")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close every sink; a sink that cannot write what it holds (a full volume) is warned about, not raised: the
        run's own error, if any, is the one to see."""
        for close in (functools.partial(os.close, self._fd), *(writer.close for writer in self._writers.values())):
            try:
                close()
            except OSError as e:
                log.warning("metrics: closing a sink under %s failed: %s", self.out_dir, e)
        self._writers = {}
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join()
            self._http = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file, in order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Plot reward, held-out accuracy (start and end of RL included), KL (or entropy when the recipe has no KL term)
    and throughput of the RL phase from a metrics JSONL file into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_jsonl(metrics_path) if r.get("phase") in ("rl", "eval")]
    has_kl = any(r.get("train/kl") is not None for r in records)
    panels = [
        ("reward/mean", "reward (train samples)"),
        ("eval/accuracy", "held-out accuracy"),
        ("train/kl", "KL to reference") if has_kl else ("train/entropy", "policy entropy (no KL term)"),
        ("perf/tokens_per_s", "tokens/s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        points = [(r["step"] + 1, r[key]) for r in records if r.get(key) is not None]  # x: steps completed
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
