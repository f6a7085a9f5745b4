"""Importance weights and fidelity metrics for the mismatch between the rollout engine and the trainer.

The engine samples with its own kernels (and, in async mode, older weights), so its log-probs differ from the
trainer's for the same weights. The policy loss of each token is weighted by ``pi_old / pi_rollout`` of its unit,
where ``pi_old`` is the trainer's log-prob under the weights it holds when the batch's update starts (in sync mode the
weights that generated the batch; in async mode up to ``run.max_staleness`` versions newer, so the weight also
corrects for the policy's change since sampling, as decoupled PPO does), after bounds (Yao et al.,
"Your efficient RL framework secretly brings you off-policy RL training"; TRL's ``vllm_importance_sampling_mode``,
verl's rollout correction). The weight is detached: it corrects the sampling distribution and is not optimised.

Units (``level``), with ``d_t = old_t - rollout_t`` over a completion's tokens:

- ``token``: one weight per token, ``exp(d_t)``.
- ``sequence``: one weight per completion, the product of its token ratios ``exp(sum_t d_t)``. Its log has a spread
  that grows like ``sqrt(length)``: with a per-token gap of sd 0.05, a 3,000-token completion's weight is mostly far
  below 1, and the truncated weights of long completions collapse towards 0.
- ``geometric``: one weight per completion, the geometric mean ``exp(mean_t d_t)``, whose spread shrinks with length.

Bounds (``mode``): ``truncate`` clamps a weight into ``[lower_bound, cap]``; ``mask`` sets it to 0 outside that range.
:func:`rollout_fidelity_metrics` reports how far the two engines are apart, whether or not the weights are applied.
"""

from __future__ import annotations

import math

import torch

from trainer.metrics import Metrics
from trainer.rl.aggregation import masked_extreme, masked_mean, when_any
from trainer.rl.config import ImportanceLevel, ImportanceMode
from trainer.rl.policy_loss import MAX_LOG_RATIO

__all__ = ["importance_weights", "rollout_fidelity_metrics"]


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: ImportanceLevel,
    cap: float,
    *,
    mode: ImportanceMode = "truncate",
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Bounded importance weights of trainer over rollout log-probs.

    Args:
        old_logprobs: [B, T] trainer log-probs of the sampled tokens (both inputs are detached here).
        rollout_logprobs: [B, T] the engine's log-probs of the same tokens.
        mask: [B, T] 1 for completion tokens.
        level: 'token', 'sequence' (product of the token ratios) or 'geometric' (their geometric mean).
        cap: upper bound on a weight (>= 1).
        mode: 'truncate' (clamp into ``[lower_bound, cap]``) or 'mask' (weight 0 outside it).
        lower_bound: lower bound (0 < lower_bound < cap), or None for none.

    Returns:
        weights [B, T] (detached; broadcast over the tokens of a sequence at the per-sequence levels, 0 off-mask) and
        metrics over units (tokens, or completions with at least one token): ``is_ratio_mean`` / ``is_ratio_min`` /
        ``is_ratio_max`` of the unbounded ratios (saturated at ``e^20``), ``is_weight_mean`` of the weights applied,
        and ``is_frac_capped`` ('truncate': units a bound changed) or ``is_frac_masked`` ('mask': units set to 0).
    """
    if cap < 1:
        raise ValueError(f"importance-sampling cap must be >= 1, got {cap}")
    if lower_bound is not None and not 0 < lower_bound < cap:
        raise ValueError(f"importance-sampling lower_bound must be in (0, cap = {cap}), got {lower_bound}")
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask  # [B, T]
    if level == "token":
        unit_log_ratio, unit_mask = log_ratio, mask  # one unit per token
    elif level in ("sequence", "geometric"):
        num_tokens = mask.sum(dim=-1)  # [B]
        unit_log_ratio, unit_mask = log_ratio.sum(dim=-1), (num_tokens > 0).to(mask.dtype)  # [B]
        if level == "geometric":
            unit_log_ratio = unit_log_ratio / num_tokens.clamp(min=1)
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; use 'token', 'sequence' or 'geometric'")

    log_cap = math.log(cap)
    log_low = -math.inf if lower_bound is None else math.log(lower_bound)
    beyond = (unit_log_ratio > log_cap) | (unit_log_ratio < log_low)
    # Bounding the log-ratio before exp keeps a huge sequence ratio from overflowing to inf.
    if mode == "truncate":
        weights = torch.exp(unit_log_ratio.clamp(min=None if lower_bound is None else log_low, max=log_cap))
    elif mode == "mask":
        weights = torch.where(beyond, 0.0, torch.exp(unit_log_ratio.clamp(max=log_cap)))
    else:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; use 'truncate' or 'mask'")

    shown = torch.exp(unit_log_ratio.clamp(max=MAX_LOG_RATIO))
    valid = unit_mask > 0
    metrics: Metrics = {
        "is_ratio_mean": masked_mean(shown, unit_mask),
        "is_ratio_min": masked_extreme(shown, valid, "min", empty=1.0),
        "is_ratio_max": masked_extreme(shown, valid, "max", empty=1.0),
        "is_weight_mean": when_any(valid, masked_mean(weights, unit_mask), empty=1.0),
        f"is_frac_{'capped' if mode == 'truncate' else 'masked'}": masked_mean(beyond.to(mask.dtype), unit_mask),
    }
    if level != "token":
        weights = weights[:, None].expand_as(mask)
    return weights * mask, metrics


def rollout_fidelity_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> Metrics:
    """How far the trainer's log-probs of the sampled tokens are from the engine's, over completion tokens.

    old_logprobs, rollout_logprobs, mask: [B, T] (trainer log-probs under the weights the update starts from: in async
    mode newer than those that generated the batch, whose drift the figures then include; the engine's; 1 for
    completion tokens). Returns ``logprob_gap`` / ``logprob_gap_max``, the mean / max of
    ``|old - rollout|``, and ``rollout_kl``, a per-token estimate of KL(rollout || trainer): the mean of k3 of
    ``r = old - rollout``, ``exp(r) - 1 - r``, unbiased for tokens the rollout sampled, non-negative and of lower
    variance than k1's ``-r``; it reads about ``var(r) / 2`` for small gaps. Under truncated sampling (top-p/top-k)
    the trainer's mass outside the engine's support is not seen, so the estimate is then low.
    """
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask  # [B, T]
    r = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    valid = mask > 0
    return {
        "logprob_gap": masked_mean(log_ratio.abs(), mask),
        "logprob_gap_max": masked_extreme(log_ratio.abs(), valid, "max", empty=0.0),
        "rollout_kl": masked_mean(torch.exp(r) - 1 - r, mask),
    }
