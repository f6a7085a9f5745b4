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

__all__ = ["clipped_value_loss", "explained_variance"]

_MOMENTS = ("return_sq_mean", "residual_mean", "residual_sq_mean")
"""Token means :func:`clipped_value_loss` reports for :func:`explained_variance` (with ``return_mean``)."""


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    aggregation: LossAggregation = "token_mean",
    **aggregate_kwargs: Unpack[AggregateKwargs],
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss (to minimise).

    Args:
        values: [B, T] critic outputs now (carry the gradient).
        old_values: [B, T] critic outputs when advantages were computed (constants).
        returns: [B, T] value targets (GAE advantages + old values; constants).
        mask: [B, T] 1 for completion tokens.
        clip: how far a value may move from ``old_values`` before its gradient is cut; None: no clipping.

    Returns:
        (loss, metrics) with ``value_clip_frac`` (tokens where the clipped term was the larger), ``value_mean`` and
        ``value_error`` (mean squared error of the unclipped values), ``return_mean`` and the token means
        :func:`explained_variance` turns into the critic's explained variance.
    """
    mask = mask.to(values.dtype)
    old_values, returns = old_values.detach(), returns.detach()
    unclipped_err = (values - returns).square()
    if clip is None:
        clipped_err = unclipped_err
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_err = (clipped_values - returns).square()
    loss = aggregate(0.5 * torch.maximum(unclipped_err, clipped_err), mask, aggregation, **aggregate_kwargs)
    with torch.no_grad():
        residual = returns - old_values  # of the values the advantages were computed with
        metrics: Metrics = {
            "value_clip_frac": masked_mean((clipped_err > unclipped_err).to(mask.dtype), mask),
            "value_mean": masked_mean(values, mask),
            "value_error": masked_mean(unclipped_err, mask),
            "return_mean": masked_mean(returns, mask),
            "return_sq_mean": masked_mean(returns.square(), mask),
            "residual_mean": masked_mean(residual, mask),
            "residual_sq_mean": masked_mean(residual.square(), mask),
        }
    return loss, metrics


def explained_variance(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` (the token means of :func:`clipped_value_loss`, reduced over a step) with its moments replaced by
    ``explained_variance``: ``1 - Var(R - V) / Var(R)`` over the step's completion tokens, of the values the
    advantages were computed with (1: the critic predicts every return; 0: no better than the mean return; below 0:
    worse). Left out when the returns do not vary (every reward of the step equal and the critic at zero: GAE returns
    bootstrap from the values, so once the critic predicts anything they vary even where the rewards do not)."""
    out = {k: v for k, v in metrics.items() if k not in _MOMENTS}
    if not all(k in metrics for k in (*_MOMENTS, "return_mean")):
        return out
    var_returns = metrics["return_sq_mean"] - metrics["return_mean"] ** 2
    var_residual = metrics["residual_sq_mean"] - metrics["residual_mean"] ** 2
    if var_returns > 1e-12:
        out["explained_variance"] = 1.0 - var_residual / var_returns
    return out
