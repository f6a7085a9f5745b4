"""Helpers for trainer tests that spawn gloo process groups: a free loopback port for the rendezvous, a model's full
weights on any rank, whole tensors reassembled from the pieces ranks hold (``trainer.parallelize.local_shards``), and
the end of a spawned rank."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn


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
