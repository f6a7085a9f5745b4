"""Helpers for trainer tests that spawn gloo process groups: runs of several layouts spawned by world size, a model's
full weights on any rank, whole tensors reassembled from the pieces ranks hold (``trainer.parallelize.local_shards``),
and the end of a spawned rank."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from common.net import free_port


def spawn_runs(run: Callable[..., None], runs: Mapping[str, tuple], root: Path) -> dict[str, list[dict]]:
    """Each run ``name: (world, *spec)`` of ``runs`` as ``run(rank, world, *spec, out_dir)`` on ``world`` spawned gloo
    ranks, where ``run`` writes ``<out_dir>/rank<r>.pt`` (``out_dir`` = ``root/name``); the runs of one world size one
    after another in one process group (spawning the ranks costs more than a run of a tiny model). Returns each run's
    per-rank results. ``run`` must be a module-level function (spawned ranks import it)."""
    by_world: dict[int, list[str]] = {}
    for name, (world, *_) in runs.items():
        by_world.setdefault(world, []).append(name)
        (root / name).mkdir(parents=True)
    for world, names in by_world.items():
        specs = {name: runs[name][1:] for name in names}
        mp.start_processes(_runs_rank, args=(world, run, specs, free_port(), str(root)), nprocs=world,
                           start_method="spawn")  # fmt: skip
    return {name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(runs[name][0])]
            for name in runs}  # fmt: skip


def _runs_rank(rank: int, world: int, run: Callable[..., None], specs: dict[str, tuple], port: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for name, spec in specs.items():
        run(rank, world, *spec, os.path.join(root, name))
    end_rank()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole (DTensors gathered: collective), detached copies."""
    params = model.named_parameters()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params}


def reassemble(pieces: list[list[tuple]]) -> dict[str, torch.Tensor]:
    """Whole tensors from each rank's ``(name, local, global_shape, global_offsets)`` pieces; NaN where none fell."""
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in pieces:
        for name, local, shape, offsets in rank_pieces:
            full = out.setdefault(name, torch.full(shape, float("nan")))
            full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))] = local
    return out


def end_rank() -> NoReturn:
    """Leave the process group and end this spawned rank at once, skipping Python's finalisation: call it last in a
    worker, after its results are written.

    torch's gloo process group can outlive ``destroy_process_group`` (the mesh and DTensors still refer to it) until the
    interpreter's final garbage collection frees it; a gloo worker thread that then takes the GIL to free a tensor is
    cancelled, and the process aborts ("terminate called without an active exception"; about one spawn in 40 on
    this machine, its core dump showing ``ProcessGroupGloo::runLoop`` beside ``Py_FinalizeEx``'s collection). A
    rank whose ``TrainerWorker.shutdown`` already left the group ends here too."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
