"""Helpers for trainer tests that spawn gloo process groups: a free loopback port for the rendezvous, a model's full
weights on any rank, and whole tensors reassembled from the pieces ranks hold (``trainer.parallelize.local_shards``)."""

from __future__ import annotations

import socket

import torch
from torch import nn


def free_port() -> int:
    """A loopback TCP port free right now (for ``init_process_group``'s ``tcp://`` rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
