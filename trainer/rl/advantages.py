"""Advantage estimators: group-relative (GRPO, RLOO) from scalar rewards, and GAE (PPO) from a critic's values.

Group estimators take rewards shaped ``[num_groups, group_size]`` (the samples of one prompt in one row) and return
one advantage per completion; :func:`compute_group_advantages` applies the configured one to a batch's per-sample
rewards and group ids, and :func:`expand_to_tokens` spreads the result over each completion's tokens. GAE works per
token on ``[B, T]`` tensors with a completion mask, so variable lengths and masked holes (e.g. tool output) are
handled; :func:`whiten` normalises advantages with moments that may be summed over micro-batches and ranks first
(:func:`whitening_moments`). The algorithms in ``trainer.rl.algorithms`` compose these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.rl.config import GRPOConfig

__all__ = [
    "compute_group_advantages",
    "expand_to_tokens",
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "whiten",
    "whitening_moments",
]


def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool, eps: float) -> torch.Tensor:
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


def compute_group_advantages(rewards: torch.Tensor, group_ids: Sequence[int], config: GRPOConfig) -> torch.Tensor:
    """Per-sample advantages by ``config.advantage_estimator``, each sample compared with the others of its group.

    rewards: [B] (float64 in the step); ``group_ids[i]`` is sample i's group. The samples of a group need not be
    adjacent, and groups may differ in size (each needs at least 2). Returns [B] in ``rewards``' dtype.
    """
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {rewards.shape[0]} rewards")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    advantages = torch.zeros_like(rewards)
    for indices in members.values():
        idx = torch.tensor(indices, device=rewards.device)
        group = rewards[idx][None, :]  # [1, K]
        if config.advantage_estimator == "rloo":
            advantages[idx] = rloo_advantages(group)[0]
        else:
            advantages[idx] = grpo_advantages(group, config.scale_advantages_by_std, config.advantage_eps)[0]
    return advantages


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
        ``T = 0`` (a micro-batch without completion tokens) gives empty tensors.
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards.detach(), values.detach()
    next_value = values.new_zeros(values.shape[0])  # [B]
    next_adv = values.new_zeros(values.shape[0])  # [B]
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


def whitening_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` (float64) of ``x`` over the masked positions; any shape.

    Moments add up: sum them over micro-batches (and ranks) and pass the total to :func:`whiten`.
    """
    a = (x * mask).double()
    return torch.stack([mask.sum().double(), a.sum(), a.square().sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` on the masked positions, 0 off-mask; any shape.

    ``moments``: :func:`whitening_moments` of the whole population ``x`` belongs to (e.g. summed over every
    micro-batch of every rank); default: those of ``x`` alone. The std is unbiased. Fewer than 2 values have no
    spread to normalise by: 0 everywhere (a PPO step whose batch generated a single token learns nothing from it,
    rather than failing the run after its actors started).
    """
    n, total, sq = (whitening_moments(x, mask) if moments is None else moments).tolist()
    if n < 2:
        return torch.zeros_like(x)
    mean = total / n
    std = max((sq - n * mean * mean) / (n - 1), 0.0) ** 0.5
    return (x - mean) / (std + eps) * mask
