"""GRPO and its critic-free variants (DAPO, Dr. GRPO, GSPO, RLOO): advantages relative to the sample's group.

Each completion's reward (minus ``kl.coef`` x its summed per-token KL when ``kl.where = 'reward'``) is compared with
the other completions of the same prompt (``compute_group_advantages``), and the advantage is given to every token.
The variants differ only in config: the estimator and std scaling, and the policy loss's clipping, ratio level and
aggregation.
"""

from __future__ import annotations

import torch

from trainer.rl.advantages import compute_group_advantages, expand_to_tokens
from trainer.rl.algorithms.base import AdvantageInputs, Algorithm
from trainer.rl.config import GRPOConfig

__all__ = ["GRPO"]


class GRPO(Algorithm[GRPOConfig]):
    """Group-relative advantages, no critic."""

    def compute_advantages(self, inputs: AdvantageInputs) -> None:
        kl = self.config.kl
        rewards = torch.tensor([s.reward for s in inputs.samples], dtype=torch.float64, device=inputs.device)
        if kl.in_reward:
            rewards = rewards - kl.coef * inputs.sample_sums(inputs.token_kl)
        advantages = compute_group_advantages(rewards, [s.group_id for s in inputs.samples], self.config)
        for mb in inputs.micro_batches:
            rows = advantages[torch.tensor(mb.sample_indices, dtype=torch.long, device=inputs.device)]
            mb.advantages = expand_to_tokens(rows.float(), mb.loss_mask)
