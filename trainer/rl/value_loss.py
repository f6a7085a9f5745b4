"""PPO's clipped value loss for the critic.

``loss_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)``: a new value that moved more than
``c`` from the value at rollout time gets no gradient pushing it further, like the policy's ratio clip.
"""

from __future__ import annotations

from typing import Unpack

import torch

from trainer.metrics import Metrics
from trainer.rl.aggregation import AggregateKwargs, aggregate, masked_mean
from trainer.rl.config import LossAggregation

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    aggregation: LossAggregation = "token_mean",
    **aggregate_kwargs: Unpack[AggregateKwargs],
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss (to minimise).

    Args:
        values: [B, T] critic outputs now (carry the gradient).
        old_values: [B, T] critic outputs when advantages were computed (constants).
        returns: [B, T] value targets (GAE advantages + old values; constants).
        mask: [B, T] 1 for completion tokens.
        clip: how far a value may move from ``old_values`` before its gradient is cut.

    Returns:
        (loss, metrics) with ``value_clip_frac`` (tokens where the clipped term was the larger), ``value_mean`` and
        ``value_error`` (mean squared error of the unclipped values).
    """
    mask = mask.to(values.dtype)
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_err = (values - returns).square()
    clipped_err = (clipped_values - returns).square()
    loss = aggregate(0.5 * torch.maximum(unclipped_err, clipped_err), mask, aggregation, **aggregate_kwargs)
    with torch.no_grad():
        metrics: Metrics = {
            "value_clip_frac": masked_mean((clipped_err > unclipped_err).to(mask.dtype), mask),
            "value_mean": masked_mean(values, mask),
            "value_error": masked_mean(unclipped_err, mask),
        }
    return loss, metrics
