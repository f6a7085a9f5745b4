"""GRPO and its critic-free variants (DAPO, Dr. GRPO, GSPO, RLOO): advantages relative to the sample's group.

Each completion's reward (minus ``kl.coef`` x its summed per-token KL when ``kl.where = 'reward'``) is compared with
the other completions of the same prompt (``compute_group_advantages``), and the advantage is given to every token.
An episode that gave several samples (``Sample.episode``) counts once: its reward (less the KL of all its samples)
is compared with the group's other episodes, and each of its samples gets that advantage.
The variants differ only in config: the estimator and std scaling, and the policy loss's clipping, ratio level and
aggregation.
"""

from __future__ import annotations

import torch

from rollout.types import episode_members
from trainer.rl.advantages import compute_group_advantages, expand_to_tokens
from trainer.rl.algorithms.base import AdvantageInputs, Algorithm
from trainer.rl.config import GRPOConfig

__all__ = ["GRPO"]


class GRPO(Algorithm[GRPOConfig]):
    """Group-relative advantages, no critic."""

    def compute_advantages(self, inputs: AdvantageInputs) -> None:
        kl = self.config.kl
        samples = inputs.samples
        episodes = episode_members([s.group_id for s in samples], [s.episode for s in samples])
        for members in episodes:
            if len({samples[i].reward for i in members}) > 1:
                raise ValueError(
                    f"the samples of episode {samples[members[0]].episode} of group {samples[members[0]].group_id} "
                    f"carry different rewards {[samples[i].reward for i in members]}; the parts of one episode share "
                    "its reward"
                )
        rewards = torch.tensor([samples[m[0]].reward for m in episodes], dtype=torch.float64, device=inputs.device)
        if kl.in_reward:
            sums = inputs.sample_sums(inputs.token_kl)
            rewards = rewards - kl.coef * torch.stack([sums[m].sum() for m in episodes])
        per_episode = compute_group_advantages(rewards, [samples[m[0]].group_id for m in episodes], self.config)
        of_sample = torch.empty(len(samples), dtype=torch.long, device=inputs.device)
        for j, members in enumerate(episodes):
            of_sample[members] = j
        advantages = torch.cat([per_episode[of_sample], per_episode.new_zeros(1)])  # + padding rows' 0
        for mb in inputs.micro_batches:
            mb.advantages = expand_to_tokens(advantages[mb.sample_rows].float(), mb.loss_mask)
