"""The clipped policy-gradient loss of PPO/GRPO, with DAPO's separate clip bounds, PPO dual-clip and GSPO's sequence
ratio.

Per token: ``loss_t = w_t * max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))``, where ``w_t`` is
an optional detached importance weight (see ``trainer.rl.importance``), then aggregated over the mask. With dual-clip
(``clip_ratio_c = c``), a token with ``A_t < 0`` has ``loss_t = w_t * min(that, -A_t * c)``.

- token level (PPO): ``ratio_t = exp(logp_t - old_t)``.
- sequence level (GSPO, Zheng et al. 2025): ``s_i = exp(mean_t (logp_t - old_t))`` over the completion, written in
  GSPO-token form ``ratio_t = sg(s_i) * exp(logp_t - sg(logp_t))``: every token carries the value ``s_i`` and, with
  ``seq_mean_token_mean`` aggregation, the gradient is exactly GSPO's ``-A_i * grad s_i`` for unclipped sequences.
"""

from __future__ import annotations

from typing import Unpack

import torch

from trainer.metrics import Metrics
from trainer.rl.aggregation import AggregateKwargs, aggregate, masked_extreme, masked_mean, when_any
from trainer.rl.config import LossAggregation, RatioLevel

__all__ = ["MAX_LOG_RATIO", "policy_ratio", "clipped_policy_loss"]

MAX_LOG_RATIO = 20.0
"""Bound on a log-ratio before ``exp`` (policy ratio, k3, IS metrics). ``exp`` overflows float32 and bfloat16 past
about 88.7; bounded at 20 (a ratio of about 4.9e8), a token the policy moved by many nats, or a sequence sum of many
small gaps, cannot turn the loss into inf/NaN. Within the bound values and gradients are untouched; past it the
gradient is 0, where the PPO clip has mostly switched it off already (a negative advantage above the bound is what
dual-clip is for; a ratio below e^-20 has a vanishing gradient anyway)."""


def policy_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: RatioLevel
) -> torch.Tensor:
    """pi / pi_old per token ('token') or GSPO's length-normalised sequence ratio on every token ('sequence').

    logprobs, old_logprobs, mask: [B, T]. Returns [B, T]; off-mask 1 at the token level, the sequence's ratio at the
    sequence level (callers mask the loss there).
    """
    log_ratio = (logprobs - old_logprobs.detach()) * mask  # [B, T]
    if level == "token":
        return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        # Value 0 either way; past the bound the gradient path is cut too (the clamp alone bounds only the value).
        inside = (seq_log_ratio.abs() <= MAX_LOG_RATIO)[:, None]
        grad_path = torch.where(inside, logprobs - logprobs.detach(), torch.zeros_like(logprobs))
        return torch.exp(seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).detach()[:, None] + grad_path)
    raise ValueError(f"unknown ratio level {level!r}; use 'token' or 'sequence'")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    ratio_level: RatioLevel = "token",
    aggregation: LossAggregation = "token_mean",
    weights: torch.Tensor | None = None,
    **aggregate_kwargs: Unpack[AggregateKwargs],
) -> tuple[torch.Tensor, Metrics]:
    """Clipped surrogate loss (to minimise).

    Args:
        logprobs: [B, T] current policy log-probs of the sampled tokens (carries the gradient).
        old_logprobs: [B, T] log-probs under the weights that produced the batch (treated as constants).
        advantages: [B, T] per-token advantages (sequence advantages broadcast over their tokens).
        mask: [B, T] 1 for completion tokens.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        clip_ratio_c: dual-clip bound (> 1): a negative-advantage token's loss is at most ``-A * clip_ratio_c``;
            None: off.
        ratio_level: 'token' (PPO) or 'sequence' (GSPO).
        aggregation: how per-token losses become a scalar; ``aggregate_kwargs`` (norm_length, num_tokens, num_seqs)
            go to :func:`trainer.rl.aggregation.aggregate`.
        weights: optional [B, T] detached per-token importance weights.

    Returns:
        (loss, metrics): ``clip_frac_low`` / ``clip_frac_high`` are the fractions of tokens whose gradient the lower /
        upper bound switched off (ratio below 1 - clip_low with A < 0 / above 1 + clip_high with A > 0);
        ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` are over completion tokens; with dual-clip, ``clip_frac_dual``
        is the fraction of tokens whose loss it bounded (A < 0 and ratio above ``clip_ratio_c``).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = mask.to(logprobs.dtype)
    ratio = policy_ratio(logprobs, old_logprobs, mask, ratio_level)
    advantages = advantages.detach()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = None
    if clip_ratio_c is not None:
        dual = (advantages < 0) & (per_token > -advantages * clip_ratio_c)  # [B, T] where the dual bound binds
        per_token = torch.where(dual, -advantages * clip_ratio_c, per_token)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, aggregation, **aggregate_kwargs)

    with torch.no_grad():
        valid = mask > 0
        low = (ratio < 1 - clip_low) & (advantages < 0)
        high = (ratio > 1 + clip_high) & (advantages > 0)
        metrics: Metrics = {
            "clip_frac_low": masked_mean(low.to(mask.dtype), mask),
            "clip_frac_high": masked_mean(high.to(mask.dtype), mask),
            "ratio_mean": when_any(valid, masked_mean(ratio, mask), empty=1.0),
            "ratio_min": masked_extreme(ratio, valid, "min", empty=1.0),
            "ratio_max": masked_extreme(ratio, valid, "max", empty=1.0),
        }
        if dual is not None:
            metrics["clip_frac_dual"] = masked_mean(dual.to(mask.dtype), mask)
    return loss, metrics
