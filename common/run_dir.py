"""A run's output directory (``run.output_dir``): the names of what a run writes there, spelt in this one place, and
what a fresh start does with an earlier run's outputs.

Layout: ``recipe.resolved.toml`` (every setting used), ``metrics.jsonl``, ``tensorboard/`` (with ``sft/``: the warm
start), ``curves.png``, ``checkpoints/step_<n>/`` (unless ``trainer.checkpoint.dir`` says elsewhere),
``warm_start_model/``, ``hf/step_<n>/`` (``run.export.every_num_steps``), ``final_model/``; and
``previous-<time>/``, each holding an earlier run's outputs in the same layout (the driver points its resolved recipe
at it, so that run can be resumed there).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.ray_job import ray_job_submission_id

__all__ = [
    "ADAPTER_DIR", "CHECKPOINTS", "CURVES", "FINAL_MODEL", "HF_EXPORTS", "LOCK", "METRICS", "OUTPUTS",
    "RESOLVED_RECIPE", "SAMPLES", "TENSORBOARD", "WARM_START_MODEL", "RunDirBusy", "RunDirLock", "earlier_runs_kept",
    "lora_base_dir", "read_run_record", "set_aside_earlier_run",
]  # fmt: skip

RESOLVED_RECIPE = "recipe.resolved.toml"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
TENSORBOARD = "tensorboard"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
WARM_START_MODEL = "warm_start_model"
HF_EXPORTS = "hf"
FINAL_MODEL = "final_model"
ADAPTER_DIR = "adapter"
"""Subdirectory of an exported LoRA policy (``final_model/``, ``hf/step_<n>/``) holding its PEFT adapter (the merged
model is the directory itself)."""
OUTPUTS = (
    RESOLVED_RECIPE, METRICS, SAMPLES, TENSORBOARD, CURVES, CHECKPOINTS, WARM_START_MODEL, HF_EXPORTS, FINAL_MODEL,
)  # fmt: skip
"""Everything a run writes in its output directory."""
log = logging.getLogger(__name__)

LOCK = ".rl_align.lock"
"""The run's lock (:class:`RunDirLock`); it stays where it is when an earlier run's outputs are moved aside."""


class RunDirBusy(RuntimeError):
    """Another process holds the run directory (:class:`RunDirLock`)."""


class RunDirLock:
    """``with RunDirLock(out_dir):`` this process alone runs in ``out_dir``. A second run there (a job submitted twice,
    a retry while the first still runs) would move the live run's outputs aside or train into its checkpoints and
    metrics; it gets :class:`RunDirBusy` naming the holder instead. An OS file lock (``flock``) on :data:`LOCK`: the
    kernel releases it when the holder ends, however it ends, so a killed run leaves nothing to clean up. It keeps
    runs apart on one host (and on network filesystems whose locks span hosts, e.g. NFSv4); on a volume whose locks
    are per node (GCS FUSE) runs whose drivers are on different nodes are not kept apart. A filesystem without locks
    gets a warning, and the run goes on unlocked.

    The same lock keeps a checkpoint directory outside the run directory (``trainer.checkpoint.dir``) to one run:
    ``RunDirLock(dir, what="checkpoint directory", field="trainer.checkpoint.dir")``; ``what`` and ``field`` name the
    directory and the setting in the refusal."""

    def __init__(self, out_dir: str | Path, what: str = "run directory", field: str = "run.output_dir") -> None:
        self.path = Path(out_dir) / LOCK
        self.what, self.field = what, field
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the directory, or raise :class:`RunDirBusy` naming the run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirBusy(f"{self.what} {self.path.parent} is in use by another run ({holder}): wait for it to "
                             f"end or stop it, or give this run another {self.field}") from None  # fmt: skip
        except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
            os.close(fd)
            log.warning("%s %s cannot be locked (%s): nothing keeps a second run out of it",
                        self.what, self.path.parent, e)  # fmt: skip
            return
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        job = ray_job_submission_id()
        of_job = f", Ray job {job!r} (`ray job stop {job}` stops it)" if job is not None else ""
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{of_job}, since {stamp}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the directory go (nothing when not held)."""
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it could race a waiting run's open)
            self._fd = None


def read_run_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The resolved recipe a run recorded in ``run_dir`` (its ``recipe.resolved.toml``, as TOML tables: the record
    may predate today's schema, so it is not validated), or None where there is none; ``ValueError`` naming the file
    when it is not TOML."""
    import tomllib

    path = Path(run_dir) / RESOLVED_RECIPE
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a TOML file ({e}): the run's record of its recipe is damaged") from None


def lora_base_dir(resolved: Mapping[str, Any], run_dir: str | Path) -> Path | None:
    """The HF model directory whose weights a LoRA run's adapters apply to, from the run's resolved recipe (its
    ``recipe.resolved.toml`` record, or ``Recipe.model_dump()``) and its output directory ``run_dir``: the run's
    warm-start export when a warm start fine-tuned the base first (``run.warm_start.parameters = "all"`` with
    warm-start steps), else ``[model] path``. None for a run without ``[model.lora]``, whose checkpoints and exports
    hold every weight. A LoRA run's checkpoints hold the adapters alone, so a resume, an export and a served adapter
    all build on this directory."""
    model, warm_start = resolved.get("model", {}), resolved.get("run", {}).get("warm_start", {})
    if not model.get("lora"):
        return None
    if warm_start.get("num_steps", 0) > 0 and warm_start.get("parameters") == "all":
        return Path(run_dir) / WARM_START_MODEL
    return Path(model["path"])


def earlier_runs_kept(out_dir: Path, checkpoint_dir: Path) -> tuple[int, int]:
    """How many earlier runs' outputs :func:`set_aside_earlier_run` has kept for ``out_dir`` (its ``previous-<time>/``
    directories) and their bytes, with the checkpoint directories it moved beside ``checkpoint_dir`` when that is
    outside ``out_dir``: nothing prunes them, so the driver says what they hold."""
    kept = sorted(out_dir.glob("previous-*"))
    if not checkpoint_dir.resolve().is_relative_to(out_dir.resolve()):
        kept += sorted(checkpoint_dir.parent.glob(f"{checkpoint_dir.name}.previous-*"))
    size = sum(f.stat().st_size for path in kept for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return sum(p.name.startswith("previous-") for p in kept), size


def set_aside_earlier_run(
    out_dir: Path, checkpoint_dir: Path, keep: Sequence[str | Path] = ()
) -> dict[Path, Path]:
    """Move what an earlier run left in ``out_dir`` into ``out_dir/previous-<time>/`` (nothing is deleted), so a fresh
    start neither mixes it into its own outputs nor takes it for its own on a later resume; return each moved path
    (absolute) with its new one.

    The moved outputs keep their layout (a moved checkpoint still finds its run's ``recipe.resolved.toml`` two levels
    up). ``checkpoint_dir`` moves its contents, all but its :data:`LOCK` (which stays, as the run directory's does):
    into ``previous-<time>/checkpoints`` when it lies inside ``out_dir``, else beside itself, to
    ``<name>.previous-<time>/``. An output that holds one of ``keep`` (the recipe's model or tokenizer directory) stays
    where it is; empty directories stay.
    """
    out, ckpt = out_dir.resolve(), checkpoint_dir.resolve()
    kept = [Path(p).resolve() for p in keep]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = out / f"previous-{stamp}"
    for n in range(1, 1000):  # two fresh starts within a second
        if not aside.exists():
            break
        aside = out / f"previous-{stamp}-{n}"
    inside = ckpt.is_relative_to(out)
    moved: dict[Path, Path] = {}
    for path in [out / name for name in OUTPUTS if name != CHECKPOINTS] + [ckpt]:
        if not path.exists() or (path.is_dir() and not any(p.name != LOCK for p in path.iterdir())):
            continue
        if any(p.is_relative_to(path) for p in kept):
            continue
        if path == ckpt:
            target = aside / path.relative_to(out) if inside else ckpt.with_name(f"{ckpt.name}.{aside.name}")
            target.mkdir(parents=True)
            for child in ckpt.iterdir():
                if child.name != LOCK:
                    child.rename(target / child.name)
        else:
            target = aside / path.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
        moved[path] = target
    return moved
