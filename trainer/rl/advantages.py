"""Advantage estimators: group-relative (GRPO, RLOO) from scalar rewards, and GAE (PPO) from a critic's values.

Group estimators take rewards shaped ``[num_groups, group_size]`` (the samples of one prompt in one row) and return
one advantage per completion; :func:`expand_to_tokens` spreads them over the completion's tokens. GAE works per token on
``[B, T]`` tensors with a completion mask, so variable lengths and masked holes (e.g. tool output) are handled.
"""

from __future__ import annotations

import torch

from trainer.rl.config import GRPOConfig, PPOConfig
from trainer.rl.kl import kl_penalized_sequence_rewards, kl_penalized_token_rewards

__all__ = [
    "compute_advantages",
    "compute_group_advantages",
    "expand_to_tokens",
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "whiten",
]


def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``, or just ``r - mean_group`` without std scaling (Dr. GRPO).

    rewards: [N, K] (N groups of K >= 2 samples). The std is the unbiased sample std of the group. Returns [N, K].
    """
    if rewards.shape[-1] < 2:
        raise ValueError(f"group advantages need at least 2 samples per group, got rewards of shape {rewards.shape}")
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: each reward minus the mean of the *other* rewards of its group.

    rewards: [N, K] with K >= 2. Returns [N, K]; equals ``K / (K - 1) * (r - mean_group)``.
    """
    k = rewards.shape[-1]
    if k < 2:
        raise ValueError(f"RLOO needs at least 2 samples per group, got rewards of shape {rewards.shape}")
    others_mean = (rewards.sum(dim=-1, keepdim=True) - rewards) / (k - 1)
    return rewards - others_mean


def compute_group_advantages(rewards: torch.Tensor, config: GRPOConfig) -> torch.Tensor:
    """Advantages of ``rewards`` [N, K] by ``config.advantage_estimator``; returns [N, K]."""
    if config.advantage_estimator == "rloo":
        return rloo_advantages(rewards)
    return grpo_advantages(rewards, scale_by_std=config.scale_advantages_by_std, eps=config.advantage_eps)


def expand_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every completion token its sequence's value. seq_values: [B]; mask: [B, T]. Returns [B, T], 0 off-mask."""
    return seq_values[:, None].to(torch.promote_types(seq_values.dtype, torch.float32)) * mask


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the completion tokens.

    Args:
        rewards: [B, T] per-token rewards (the score at the last completion token, plus any per-token KL penalty).
        values: [B, T] critic value of the state in which token t was generated.
        mask: [B, T] 1 for completion tokens. Masked positions are skipped: the recursion links each token to the
            next *masked-in* token, and the value after the last one is 0 (the episode ends).
        gamma: discount per token; lam: GAE lambda.

    Returns:
        (advantages, returns), both [B, T] and 0 off-mask; ``returns = advantages + values`` are the critic's targets.
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards.detach(), values.detach()
    next_value = torch.zeros_like(values[:, 0])  # [B]
    next_adv = torch.zeros_like(values[:, 0])  # [B]
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale ``x`` to mean 0 and std 1 (unbiased) over the masked positions; 0 off-mask. Any shape."""
    mask = mask.to(x.dtype)
    n = mask.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 masked-in values, got {int(n)}")
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def compute_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig | PPOConfig,
    *,
    kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages of a whole rollout batch, as the algorithm config says.

    Args:
        scores: [B] sequence rewards; for GRPO the B samples are ordered group by group (B = num_groups * group_size).
        mask: [B, T] 1 for completion tokens.
        config: GRPO (group advantages spread over tokens) or PPO (GAE from ``values``, optionally whitened).
        kl: [B, T] per-token KL estimates to the reference; required when ``config.kl.where == 'reward'`` and
            ``config.kl.coef > 0``, ignored otherwise.
        values: [B, T] critic values at rollout time; required by PPO.

    Returns:
        (advantages [B, T], returns [B, T] for PPO's critic or None for GRPO), 0 off-mask.
    """
    kl_in_reward = config.kl.coef > 0 and config.kl.where == "reward"
    if kl_in_reward and kl is None:
        raise ValueError("algorithm.kl.where = 'reward' with coef > 0 needs the per-token KL to the reference")
    if isinstance(config, GRPOConfig):
        if scores.shape[0] % config.group_size != 0:
            raise ValueError(
                f"{scores.shape[0]} samples do not split into groups of group_size = {config.group_size}; "
                "pass whole groups, ordered group by group"
            )
        if kl_in_reward:
            scores = kl_penalized_sequence_rewards(scores, kl, mask, config.kl.coef)
        grouped = compute_group_advantages(scores.reshape(-1, config.group_size), config)
        return expand_to_tokens(grouped.reshape(-1), mask), None
    if values is None:
        raise ValueError("PPO advantages (GAE) need the critic's per-token values")
    kl_term = kl if kl_in_reward else torch.zeros_like(values)
    rewards = kl_penalized_token_rewards(scores, kl_term, mask, config.kl.coef)
    advantages, returns = gae_advantages(rewards, values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = whiten(advantages, mask)
    return advantages, returns
