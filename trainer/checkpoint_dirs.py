"""Which checkpoints a directory holds, without torch: the driver asks before any trainer process exists.

A checkpoint is a directory ``<root>/step_<n>`` that counts once it holds ``COMPLETE`` (written by rank 0 after every
rank finished saving; see :mod:`trainer.checkpoint`).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "COMPLETE", "checkpoint_dir", "checkpoint_step", "complete_checkpoints", "incomplete_checkpoints",
    "latest_checkpoint",
]  # fmt: skip

COMPLETE = "COMPLETE"
"""The marker file of a finished checkpoint."""

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of optimizer step ``step`` goes under ``root``."""
    return Path(root) / f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a checkpoint directory :func:`checkpoint_dir` named holds; ``ValueError`` for another name."""
    m = _STEP_DIR.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_<n>)")
    return int(m.group(1))


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first; none when ``root`` does not exist."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        (checkpoint_step(child), child)
        for child in root.iterdir()
        if _STEP_DIR.match(child.name) and (child / COMPLETE).exists()
    )


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def incomplete_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under ``root`` without ``COMPLETE``: a save that a killed run left halfway (never
    resumed from, never pruned: only complete checkpoints count)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(child for child in root.iterdir()
                  if _STEP_DIR.match(child.name) and child.is_dir() and not (child / COMPLETE).exists())  # fmt: skip
