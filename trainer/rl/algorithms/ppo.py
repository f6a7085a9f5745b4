"""PPO with a learned critic: per-token GAE advantages, whitened over the whole batch, and a clipped value loss.

Per micro-batch, the score sits on the last completion token (minus ``kl.coef`` x the per-token KL on every token
when ``kl.where = 'reward'``) and GAE runs back from it over the critic's values at rollout time; the returns are the
critic's targets. Whitening uses the moments of every completion token of the batch, summed over ranks.

An agent episode stored as several samples (split where its context did not re-tokenise) is scored per sample: each
part gets the episode's score at its own last token and GAE runs within the part, so the returns are exact with
``gamma = 1`` and no KL in the reward; otherwise an earlier part is neither discounted by nor penalised for the later
parts' tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.metrics import Metrics
from trainer.rl.advantages import gae_advantages, whiten, whitening_moments
from trainer.rl.algorithms.base import AdvantageInputs, Algorithm
from trainer.rl.config import PPOConfig
from trainer.rl.kl import kl_penalized_token_rewards
from trainer.rl.value_loss import clipped_value_loss

if TYPE_CHECKING:
    from trainer.packing import MicroBatch

__all__ = ["PPO"]


class PPO(Algorithm[PPOConfig]):
    """GAE advantages from a critic, trained by :meth:`value_loss`."""

    def compute_advantages(self, inputs: AdvantageInputs) -> None:
        cfg = self.config
        sample_scores = torch.tensor([s.reward for s in inputs.samples] + [0.0], device=inputs.device)  # + padding's
        for mb in inputs.micro_batches:
            scores = sample_scores[mb.sample_rows]
            kl = inputs.token_kl(mb) if cfg.kl.in_reward else torch.zeros_like(mb.loss_mask)
            rewards = kl_penalized_token_rewards(scores, kl, mb.loss_mask, cfg.kl.coef if cfg.kl.in_reward else 0.0)
            mb.advantages, mb.extra["returns"] = gae_advantages(
                rewards, mb.extra["values"], mb.loss_mask, cfg.gamma, cfg.lam
            )
        if cfg.whiten_advantages:
            moments = torch.zeros(3, dtype=torch.float64, device=inputs.device)
            for mb in inputs.micro_batches:
                moments += whitening_moments(mb.advantages, mb.loss_mask)
            moments = inputs.all_reduce_sum(moments)
            for mb in inputs.micro_batches:
                mb.advantages = whiten(mb.advantages, mb.loss_mask, moments)

    def value_loss(
        self, mb: MicroBatch, values: torch.Tensor, num_tokens: float, num_seqs: float
    ) -> tuple[torch.Tensor, Metrics]:
        """The clipped value loss against ``extra['returns']``, aggregated like the policy loss; the metrics of
        ``clipped_value_loss`` plus ``value_loss``."""
        cfg = self.config
        loss, metrics = clipped_value_loss(
            values, mb.extra["values"], mb.extra["returns"], mb.loss_mask, cfg.value_clip, cfg.loss_aggregation,
            norm_length=cfg.loss_norm_length, num_tokens=num_tokens, num_seqs=num_seqs, seq_tokens=mb.sequence_tokens,
        )  # fmt: skip
        metrics["value_loss"] = loss.detach()
        return loss, metrics
