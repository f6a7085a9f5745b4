"""Per-token estimators of KL(policy || reference) from tokens sampled by the policy, and two ways to use them.

With ``r = log pi_ref(y_t) - log pi(y_t)`` on a token sampled from pi (J. Schulman, "Approximating KL divergence"):

- ``k1 = -r``: unbiased value, high variance, can be negative; as a loss its expected gradient is 0.
- ``k2 = r^2 / 2``: biased value, non-negative; as a loss its gradient is an unbiased estimate of the gradient of
  KL(pi || ref).
- ``k3 = exp(r) - 1 - r``: unbiased value, non-negative, low variance; as a loss (GRPO's choice) its expected
  gradient is that of the forward KL(ref || pi). ``r`` is bounded at +-20 before ``exp`` (``MAX_LOG_RATIO``).

As a detached reward (``where = 'reward'``) only k1 gives the KL's policy gradient: ``E[grad log pi * k1]`` is
``grad KL(pi || ref)``, ``E[grad log pi * k3]`` is not; hence the default estimator follows ``where``
(``trainer.rl.config.KLConfig``).

All three are exactly 0 where policy and reference agree. The estimate is used either as a loss term (aggregated
like the policy loss, ``trainer.rl.loss``) or folded into the reward before advantages, detached: per token for GAE
(:func:`kl_penalized_token_rewards`), summed over the completion for group advantages (``trainer.rl.algorithms.grpo``).
"""

from __future__ import annotations

import torch

from trainer.rl.config import KLEstimator
from trainer.rl.policy_loss import MAX_LOG_RATIO

__all__ = ["kl_estimate", "kl_penalized_token_rewards"]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL estimate. logprobs, ref_logprobs: [B, T] log-probs of the sampled tokens. Returns [B, T]."""
    log_ratio = ref_logprobs - logprobs  # r = log(pi_ref / pi)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # verl bounds r at +-20 and then k3's value at +-10; the value bound also zeroes the gradient from a
        # probability ratio of about 14 on, on exactly the tokens the penalty is for. Bounding r alone keeps exp finite
        # (and r once, for both terms: past the bound the gradient is 0 rather than the wrong-signed one of -r).
        r = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.exp(r) - 1 - r
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")


def kl_penalized_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """Per-token rewards for GAE: ``-coef * kl_t`` on every completion token, plus the score on the last one.

    scores: [B] sequence rewards; kl: [B, T] per-token estimates; mask: [B, T]. Returns [B, T] (detached), 0 off-mask.
    """
    mask = mask.to(kl.dtype)
    rewards = -coef * kl.detach() * mask
    if mask.shape[1] == 0:  # no completion tokens in the micro-batch: nothing to put the score on
        return rewards
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * (positions + 1)).argmax(dim=-1)  # [B] index of the last completion token
    has_tokens = mask.sum(dim=-1) > 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += torch.where(has_tokens, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards
