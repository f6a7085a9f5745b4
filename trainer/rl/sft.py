"""Supervised warm start: masked next-token negative log-likelihood.

A few SFT steps on good completions before RL give the policy non-zero rewards to learn from (from random init,
GRPO rewards stay at 0 and every advantage is 0).
"""

from __future__ import annotations

from typing import Unpack

import torch

from trainer.rl.aggregation import AggregateKwargs, aggregate
from trainer.rl.config import LossAggregation

__all__ = ["sft_loss"]


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    aggregation: LossAggregation = "token_mean",
    **aggregate_kwargs: Unpack[AggregateKwargs],
) -> torch.Tensor:
    """Negative log-likelihood of the target tokens. logprobs: [B, T] log-probs of the targets; mask: [B, T] 1 for
    tokens that are trained on (the completion, not the prompt). Returns a 0-dim tensor (mean NLL per token by
    default)."""
    return -aggregate(logprobs, mask, aggregation, **aggregate_kwargs)
