"""Per-token entropy of the policy and the entropy bonus that keeps it from collapsing.

The bonus is subtracted from the loss: ``loss -= coef * aggregate(entropy)``. Entropies come from the full next-token
distribution, so they are computed from logits (in chunks by the output head for large vocabularies).
"""

from __future__ import annotations

from typing import Unpack

import torch

from trainer.rl.aggregation import AggregateKwargs, aggregate
from trainer.rl.config import LossAggregation

__all__ = ["entropy_bonus"]


def entropy_bonus(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    aggregation: LossAggregation = "token_mean",
    **aggregate_kwargs: Unpack[AggregateKwargs],
) -> torch.Tensor:
    """``coef * aggregate(entropies)``, the amount to subtract from the loss. entropies, mask: [B, T]; 0-dim out."""
    return coef * aggregate(entropies, mask, aggregation, **aggregate_kwargs)
