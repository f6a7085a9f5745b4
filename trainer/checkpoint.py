"""Full-state checkpoints of the trainer with torch.distributed.checkpoint (DCP), and reading a model's tensors
back from one a few at a time (for export: ``trainer.export``).

One checkpoint is a directory ``<root>/step_<n>`` holding:

- the DCP files of every model and its optimizer (each rank writes its own shards; loads reshard freely, e.g. 2 -> 1);
  a frozen model (the KL reference) is a part without optimizer, saved so that a resume needs no other file;
- ``trainer_state_rank<r>.pt`` per rank: LR scheduler states, the RNG states of this rank (python, numpy, torch, and the
  accelerator's), ``step``, ``policy_version`` and the caller's opaque ``data_cursor`` dict;
- ``COMPLETE``, written by rank 0 after every rank finished: a directory without it is ignored (a crash mid-save
  never becomes the "latest" checkpoint).

Resuming restores all of it, so on CPU the loss trajectory after a resume equals the uninterrupted one bit for bit.
Every rank must call :meth:`CheckpointManager.save` / :meth:`load` together (they are collective).
"""

from __future__ import annotations

import logging
import random
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from common.disk import free_bytes, is_no_space
from trainer.checkpoint_dirs import COMPLETE, checkpoint_dir, complete_checkpoints, latest_checkpoint
from trainer.optim import apply_hyperparameters, configured_hyperparameters

__all__ = [
    "CheckpointManager",
    "CheckpointWriteError",
    "Checkpointable",
    "TrainProgress",
    "read_model_tensors",
    "saved_model_params",
    "saved_data_cursor",
    "saved_parts",
    "saved_policy_params",
    "saved_policy_version",
]

log = logging.getLogger(__name__)


@dataclass
class Checkpointable:
    """A model with its optimizer and LR scheduler (policy, critic), or a frozen model alone (optimizer None)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    trainable_only: bool = False
    """Save and load only the parameters that train (LoRA adapters): the frozen rest is rebuilt from the run's
    initial checkpoint at start and must not be needed from the checkpoint."""

    @property
    def options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)


def _state_dicts(name: str, part: Checkpointable) -> dict[str, Any]:
    """The DCP entries of one part: its model's (and optimizer's) state dict, sharded as the model is."""
    if part.optimizer is None:
        return {f"{name}.model": get_model_state_dict(part.model, options=part.options)}
    model_sd, optim_sd = get_state_dict(part.model, part.optimizer, options=part.options)
    return {f"{name}.model": model_sd, f"{name}.optim": optim_sd}


def saved_parts(path: str | Path) -> set[str]:
    """Names of the parts whose model a DCP checkpoint directory holds (from its metadata: nothing loaded)."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key.split(".", 1)[0] for key in keys if key.split(".", 2)[1:2] == ["model"]}


@dataclass
class TrainProgress:
    """The scalar progress saved with a checkpoint and returned by a load."""

    step: int
    """Optimizer steps taken."""
    policy_version: int
    """Version of the policy weights (pushed to the rollout engines)."""
    data_cursor: dict[str, Any]
    """Opaque position in the caller's data stream (pickled as is)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _no_dist() -> bool:
    """DCP without its collectives: on one rank they only move the save plan through gloo, and gloo copying a large
    message on its own thread starts a second OpenMP team in the process; from then on libgomp counts more threads than
    cores and stops spinning between parallel regions, which left every later training step ~1.8x slower on CPU."""
    return not dist.is_initialized() or dist.get_world_size() == 1


# DCP warns at every save and load without collectives that it assumes one process: that is what _no_dist chose.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


_LOW_SPACE_BYTES = 64 << 20
"""Below this much free space a failed write is taken for a full volume even when its error does not say so."""


def _all_ranks_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective on more than one rank; any backend: objects travel pickled)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ok)
    return all(bool(v) for v in every)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank_state_file(path: Path, rank: int) -> Path:
    """The file of a checkpoint ``path`` holding rank ``rank``'s trainer state (rank 0's: the policy version and
    the data cursor)."""
    return path / f"trainer_state_rank{rank}.pt"


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a volume gone read-only); the message says what is free."""


class CheckpointManager:
    """Saves and restores ``step_<n>`` checkpoints under ``root``, keeping the newest ``num_keep``."""

    def __init__(self, root: str | Path, num_keep: int = 2) -> None:
        if num_keep < 1:
            raise ValueError(f"num_keep must be >= 1, got {num_keep}")
        self.root = Path(root)
        self.num_keep = num_keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.root)

    def save(self, parts: dict[str, Checkpointable], progress: TrainProgress) -> Path:
        """Write a checkpoint of ``parts`` (e.g. ``{"policy": ..., "critic": ...}``) and ``progress``; collective."""
        path = checkpoint_dir(self.root, progress.step)
        tensors: dict[str, Any] = {}
        for name, part in parts.items():
            tensors.update(_state_dicts(name, part))
        small = {
            "schedulers": {n: p.scheduler.state_dict() for n, p in parts.items() if p.scheduler is not None},
            "rng": _rng_states(),
            "step": progress.step,
            "policy_version": progress.policy_version,
            "data_cursor": progress.data_cursor,
        }
        existed = (path / COMPLETE).exists()  # a finished run saving its last step again: never delete that one
        self._collectively(path, existed, lambda: dcp.save(tensors, checkpoint_id=str(path), no_dist=_no_dist()))
        self._collectively(path, existed, lambda: torch.save(small, rank_state_file(path, _rank())))
        if _rank() == 0:
            self._collectively(path, existed, lambda: (path / COMPLETE).write_text(f"{progress.step}\n"))
            for _, old in self.checkpoints()[: -self.num_keep]:
                log.info("removing checkpoint %s: trainer.checkpoint.num_keep = %d keeps the newest (raise it to keep "
                         "more)", old, self.num_keep)  # fmt: skip
                shutil.rmtree(old, ignore_errors=True)
        else:
            self._collectively(path, existed, lambda: None)  # rank 0's COMPLETE marker: every rank learns its fate
        _barrier()
        return path

    def _collectively(self, path: Path, existed: bool, write: Callable[[], object]) -> None:
        """Run this rank's ``write`` of the checkpoint at ``path``; when it failed on any rank, every rank raises
        :class:`CheckpointWriteError` together (a rank left waiting in a barrier would hang the run for the process
        group's timeout) and rank 0 removes the partial directory, unless it was complete before this save."""
        from torch.distributed.checkpoint.api import CheckpointException

        error: BaseException | None = None
        try:
            write()
        except (OSError, RuntimeError) as e:  # a full disk reads as DCP's or torch's own error, most naming no space
            error = e
        except CheckpointException as e:  # DCP's wrapping of each rank's error: a BaseException
            error = next((exc for exc, _ in e.failures.values()), e)
        if _all_ranks_ok(error is None):
            return
        if _rank() == 0 and not existed:
            shutil.rmtree(path, ignore_errors=True)  # it would never count (no COMPLETE): give the space back
        raise self._write_failed(path, error) from error

    def _write_failed(self, path: Path, error: BaseException | None) -> CheckpointWriteError:
        """What to say about a checkpoint that could not be written: the error, and the space left when space is what
        likely ran out (an ``ENOSPC``/``EDQUOT`` in the error's chain, or less room than the last checkpoint took)."""
        what = f"{type(error).__name__}: {error}" if error is not None else "another trainer rank failed to write"
        free = free_bytes(self.root)
        saved = latest_checkpoint(self.root)
        size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) if saved is not None else None
        short = free is not None and (free < (size or 0) or free < _LOW_SPACE_BYTES)
        if free is None or not (is_no_space(error) or short):
            return CheckpointWriteError(
                f"checkpoint {path} could not be written ({what}): fix the cause (the directory's permissions, the "
                "volume) or point trainer.checkpoint.dir elsewhere, then resume"
            )
        need = f"; each checkpoint takes ~{size / 1e6:,.1f} MB" if size is not None else ""
        return CheckpointWriteError(
            f"checkpoint {path} could not be written ({what}). {free / 1e6:,.1f} MB are free under {self.root}, "
            f"which must hold trainer.checkpoint.num_keep + 1 = {self.num_keep + 1} checkpoints{need}: free space "
            "or point trainer.checkpoint.dir at a larger volume, then resume"
        )

    def load(
        self, parts: dict[str, Checkpointable], path: str | Path | None = None, missing_ok: tuple[str, ...] = ()
    ) -> TrainProgress:
        """Restore ``parts`` and this rank's RNG from ``path`` (default: the latest); collective.

        The number of ranks may differ from the saving run (DCP reshards); RNG states then come from rank
        ``rank % saved_ranks``, so a resharded resume is valid but not bit-identical. A part named in ``missing_ok``
        that the checkpoint does not hold (one written before that part was saved) keeps its current state, with a
        warning; any other missing part raises ``ValueError``.
        """
        path = Path(path) if path is not None else self.latest()
        if path is None or not (path / COMPLETE).exists():
            raise FileNotFoundError(f"no complete checkpoint at {path or self.root} (missing COMPLETE marker)")
        held = saved_parts(path)
        absent = [name for name in parts if name not in held]
        if [name for name in absent if name not in missing_ok]:
            raise ValueError(f"checkpoint {path} holds no {absent} (it has {sorted(held)}); it was written by "
                             "a run with a different algorithm or model set")
        for name in absent:
            log.warning("checkpoint %s holds no %r: keeping its current weights (rebuilt at startup)", path, name)
        parts = {name: part for name, part in parts.items() if name in held}
        tensors: dict[str, Any] = {}
        for name, part in parts.items():
            tensors.update(_state_dicts(name, part))
        dcp.load(tensors, checkpoint_id=str(path), no_dist=_no_dist())
        configured = {name: configured_hyperparameters(part.optimizer, part.scheduler)
                      for name, part in parts.items() if part.optimizer is not None}  # fmt: skip
        for name, part in parts.items():
            if part.optimizer is None:
                set_model_state_dict(part.model, tensors[f"{name}.model"], options=part.options)
            else:
                set_state_dict(
                    part.model, part.optimizer, options=part.options,
                    model_state_dict=tensors[f"{name}.model"], optim_state_dict=tensors[f"{name}.optim"],
                )  # fmt: skip
        rank_files = sorted(path.glob("trainer_state_rank*.pt"))
        mine = rank_state_file(path, _rank() % len(rank_files))
        small = torch.load(mine, weights_only=False)
        for name, part in parts.items():
            if part.scheduler is not None:
                part.scheduler.load_state_dict(small["schedulers"][name])
            if part.optimizer is not None:  # the recipe's rates, not the saving run's (a resume may change them)
                apply_hyperparameters(part.optimizer, part.scheduler, configured[name])
        _set_rng_states(small["rng"])
        _barrier()
        return TrainProgress(small["step"], small["policy_version"], small["data_cursor"])


def saved_data_cursor(path: str | Path) -> dict[str, Any]:
    """The caller's ``data_cursor`` a checkpoint was saved with (from its rank-0 trainer state)."""
    return dict(torch.load(rank_state_file(Path(path), 0), weights_only=False)["data_cursor"])


def saved_policy_version(path: str | Path) -> int:
    """The policy version a checkpoint was saved at (from its rank-0 trainer state)."""
    return int(torch.load(rank_state_file(Path(path), 0), weights_only=False)["policy_version"])


def saved_model_params(
    path: str | Path, part: str, params: Sequence[tuple[str, tuple[int, ...]]]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype as saved)`` of each of ``params`` (``(parameter name, shape)``) of ``part``'s model in the
    checkpoint at ``path``, from its metadata (nothing loaded). ``params`` must be every parameter the checkpoint
    holds for that model (a LoRA run's: its adapters). Raises ``ValueError`` when the checkpoint lacks a parameter,
    holds it in another shape or holds one not in ``params``: it was written for another model."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = f"{part}.model."
    extra = sorted(set(k for k in saved if k.startswith(prefix)) - {prefix + name for name, _ in params})
    if extra:
        raise ValueError(f"checkpoint {path} holds tensors this model has not ({', '.join(extra[:3])}; {len(extra)} in "
                         "all): it was written for another model")  # fmt: skip
    out = []
    for name, shape in params:
        key = f"{part}.model.{name}"
        meta = saved.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"checkpoint {path} holds no tensor {key}: it was written for another model")
        if tuple(meta.size) != tuple(shape):
            raise ValueError(f"checkpoint {path}: {key} has shape {tuple(meta.size)}, the model {tuple(shape)}")
        out.append((name, tuple(shape), meta.properties.dtype))
    return out


def saved_policy_params(path: str | Path, model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What the checkpoint at ``path`` holds of the policy ``model`` (built on any device, ``meta`` included), as
    :func:`saved_model_params` returns it: every parameter, or with LoRA adapters in ``model`` the adapters alone (a
    LoRA run checkpoints those only). Raises ``ValueError`` naming the first difference when it was written for
    another model."""
    from trainer.models.lora import is_adapter

    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    lora = any(is_adapter(name) for name, _ in shapes)
    if lora:
        shapes = [(name, shape) for name, shape in shapes if is_adapter(name)]
    saved = [k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("policy.")]
    saved_lora = any(is_adapter(k) for k in saved)
    if lora and saved and not saved_lora:
        raise ValueError(
            f"checkpoint {path} holds the whole model's weights and no LoRA adapters: it was written by a run without "
            "[model.lora] (to train adapters over the model it trained, export it with `python -m trainer.export "
            "CHECKPOINT OUT` and start a new run with model.path = OUT)"
        )
    if not lora and saved_lora:
        raise ValueError(f"checkpoint {path} holds LoRA adapters only: it was written by a run with [model.lora] "
                         "(its rank and targets are in that run's recipe.resolved.toml)")  # fmt: skip
    return saved_model_params(path, "policy", shapes)


def read_model_tensors(
    path: str | Path, part: str, params: Sequence[tuple[str, tuple[int, ...], torch.dtype]], group_bytes: int = 2**29
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole CPU tensor)`` of each of ``params`` (as :func:`saved_model_params` returns them) of ``part``'s
    model in the checkpoint at ``path``, in order, read in this process a group of about ``group_bytes`` at a time
    (DCP reads only those tensors' bytes, however many ranks saved them): a checkpoint of any size converts with one
    group in memory."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, shape, dtype in params:
        group[name] = torch.empty(shape, dtype=dtype)
        size += group[name].nbytes
        if size >= group_bytes:
            yield from _read_group(path, part, group)
            group, size = {}, 0
    yield from _read_group(path, part, group)


def _read_group(path: str | Path, part: str, group: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    if group:
        dcp.load({f"{part}.model": group}, checkpoint_id=str(path), no_dist=True)
    yield from group.items()
