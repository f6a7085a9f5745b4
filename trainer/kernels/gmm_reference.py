"""Torch reference for the grouped matmul of MoE experts (the parity target of the megablox Pallas ``gmm``)."""

from __future__ import annotations

import torch

__all__ = ["gmm_reference"]


def gmm_reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ w[e]``: one matmul per expert over its contiguous rows.

    Shapes: ``x [M, K]`` with rows sorted by expert, ``w [E, K, N]``, ``group_sizes [E]`` integer with
    ``sum(group_sizes) == M``. Returns ``[M, N]`` in ``x``'s dtype. Differentiable wrt ``x`` and ``w``.
    """
    if int(group_sizes.sum()) != x.shape[0]:
        raise ValueError(f"sum(group_sizes) = {int(group_sizes.sum())} must equal the number of rows {x.shape[0]}")
    pieces = torch.split(x, group_sizes.tolist())
    return torch.cat([piece @ w[e] for e, piece in enumerate(pieces)]).to(x.dtype)
