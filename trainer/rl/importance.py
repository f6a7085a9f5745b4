"""Truncated importance sampling (TIS) for the mismatch between the rollout engine and the trainer.

The engine samples with its own kernels (and, in async mode, older weights), so its log-probs differ from the
trainer's for the same weights. Following Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training", the policy loss of each token is weighted by ``min(pi_old / pi_rollout, cap)``, where ``pi_old`` is the
trainer's log-prob of the weights that generated the batch. The weight is detached: it corrects the sampling
distribution and is not optimised.

- token level: one weight per token, ``exp(old_t - rollout_t)``.
- sequence level: one weight per completion, the product of its token ratios ``exp(sum_t (old_t - rollout_t))``.
"""

from __future__ import annotations

import math

import torch

from trainer.rl.aggregation import masked_mean
from trainer.rl.config import RatioLevel

__all__ = ["truncated_importance_weights"]

_METRIC_MAX_LOG_RATIO = 20.0  # ratios in metrics saturate at e^20 so a runaway sequence cannot print inf


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: RatioLevel,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Capped importance weights of trainer over rollout log-probs.

    Args:
        old_logprobs: [B, T] trainer log-probs of the sampled tokens (both inputs are detached here).
        rollout_logprobs: [B, T] the engine's log-probs of the same tokens.
        mask: [B, T] 1 for completion tokens.
        level: 'token' or 'sequence'.
        cap: upper bound on a weight (>= 1).

    Returns:
        weights [B, T] (detached; broadcast over the tokens of a sequence at sequence level, 0 off-mask) and metrics:
        ``is_ratio_mean`` / ``is_ratio_max`` of the uncapped ratios and ``is_frac_capped`` (over tokens, or over
        sequences at sequence level), and ``logprob_gap``, the mean |trainer - rollout| log-prob over tokens.
    """
    if cap < 1:
        raise ValueError(f"importance-sampling cap must be >= 1, got {cap}")
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask  # [B, T]
    if level == "token":
        unit_log_ratio, unit_mask = log_ratio, mask  # one unit per token
    elif level == "sequence":
        unit_log_ratio, unit_mask = log_ratio.sum(dim=-1), (mask.sum(dim=-1) > 0).to(mask.dtype)  # [B]
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; use 'token' or 'sequence'")
    # Capping the log-ratio before exp keeps a huge sequence ratio from overflowing to inf.
    weights = torch.exp(unit_log_ratio.clamp(max=math.log(cap)))
    if level == "sequence":
        weights = weights[:, None].expand_as(mask)
    weights = weights * mask

    shown = torch.exp(unit_log_ratio.clamp(max=_METRIC_MAX_LOG_RATIO))
    valid = unit_mask > 0
    metrics = {
        "is_ratio_mean": masked_mean(shown, unit_mask).item(),
        "is_ratio_max": shown[valid].max().item() if valid.any() else 1.0,
        "is_frac_capped": masked_mean((unit_log_ratio > math.log(cap)).to(mask.dtype), unit_mask).item(),
        "logprob_gap": masked_mean(log_ratio.abs(), mask).item(),
    }
    return weights, metrics
