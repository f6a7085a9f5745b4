"""Configuration of the RL algorithm: what the policy update computes (advantages, policy loss, KL, entropy, IS).

``AlgorithmConfig`` is a tagged union on ``type``: ``[algorithm] type = "grpo"`` or ``"ppo"``; each type's update
(advantages, losses, whether it trains a critic) is an object in ``trainer.rl.algorithms``. How the update is run
(devices, optimizer, micro-batches, epochs, the critic's learning rate) lives in ``trainer.config.TrainerConfig``.
No torch import here, so recipes validate instantly.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import pydantic

from common.config import Config

__all__ = [
    "AlgorithmConfig",
    "GRPOConfig",
    "ImportanceSamplingConfig",
    "KLConfig",
    "KLEstimator",
    "LossAggregation",
    "PPOConfig",
    "PolicyConfig",
    "RatioLevel",
]

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"]
"""How per-token losses become one scalar (see ``trainer.rl.aggregation.aggregate``)."""
KLEstimator = Literal["k1", "k2", "k3"]
"""Per-token estimator of KL(policy || reference) from sampled tokens (see ``trainer.rl.kl``)."""
RatioLevel = Literal["token", "sequence"]
"""Per-token ratios, or one per sequence (GSPO for the policy ratio; sequence-level truncated IS)."""


class KLConfig(Config):
    """Penalty on the divergence of the policy from a frozen reference model."""

    coef: float = pydantic.Field(default=0.0, ge=0)
    """Weight of the KL term; 0 turns it off and then no reference model is loaded."""
    estimator: KLEstimator = "k3"
    """'k1' (log-ratio, unbiased, high variance), 'k2' (half squared log-ratio) or 'k3' (exp(r) - 1 - r, unbiased and
    non-negative; the usual choice as a loss term)."""
    where: Literal["loss", "reward"] = "loss"
    """'loss': add ``coef * KL`` to the loss (GRPO style); 'reward': subtract it from the reward before advantages
    (PPO/RLHF style; per token for GAE, summed over the completion for group advantages)."""

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must load and run a frozen reference model."""
        return self.coef > 0

    @property
    def in_loss(self) -> bool:
        """Whether ``coef * KL`` is a term of the policy loss."""
        return self.coef > 0 and self.where == "loss"

    @property
    def in_reward(self) -> bool:
        """Whether the KL is subtracted from the reward before advantages."""
        return self.coef > 0 and self.where == "reward"


class ImportanceSamplingConfig(Config):
    """Truncated importance sampling for the gap between the rollout engine's log-probs and the trainer's.

    Weights are ``min(pi_trainer_old / pi_rollout, cap)`` (detached), per token or per sequence, multiplying the
    per-token policy loss; see Yao et al., "Your efficient RL framework secretly brings you off-policy RL training".
    """

    enabled: bool = True
    """Apply the correction (needs the rollout log-probs, which every sample carries)."""
    level: RatioLevel = "token"
    """'token': one weight per token; 'sequence': one weight per completion, the product of its token ratios."""
    cap: float = pydantic.Field(default=2.0, ge=1.0)
    """Upper bound on a weight (C in the paper); larger reduces bias, smaller reduces variance."""


class PolicyConfig(Config):
    """Fields shared by every algorithm (the base of GRPO's and PPO's configs): the clipped policy loss and its extra
    terms."""

    group_relative: ClassVar[bool] = False
    """Whether advantages compare the samples of one group with each other (GRPO and its variants): a step then
    needs at least 2 samples, and a group of equal rewards carries no signal (dynamic sampling may drop it)."""
    group_size: int = pydantic.Field(default=1, ge=1)
    """Completions sampled per prompt (rollout ``n``); samples of one prompt form one group."""
    clip_low: float = pydantic.Field(default=0.2, gt=0, lt=1)
    """Ratios below ``1 - clip_low`` stop pushing a negative-advantage token down."""
    clip_high: float = pydantic.Field(default=0.2, gt=0)
    """Ratios above ``1 + clip_high`` stop pushing a positive-advantage token up; DAPO's clip-higher raises it
    (e.g. 0.28) to keep exploration. GSPO uses much smaller ranges (about 3e-4 / 4e-4) on its sequence ratio."""
    ratio_level: RatioLevel = "token"
    """'token': PPO per-token ratio; 'sequence': GSPO's length-normalised sequence ratio
    ``exp(mean_t(log pi - log pi_old))``, clipped once per completion."""
    loss_aggregation: LossAggregation = "token_mean"
    """'token_mean': mean over every completion token of the batch (DAPO); 'seq_mean_token_mean': mean over completions
    of each completion's token mean (original GRPO, GSPO); 'token_sum_norm': token sum divided by
    ``num_sequences * loss_norm_length`` (Dr. GRPO, no length bias)."""
    loss_norm_length: int | None = pydantic.Field(default=None, ge=1)
    """Constant per-sequence divisor of 'token_sum_norm', usually the rollout's max completion tokens; required by that
    mode and only by it."""
    kl: KLConfig = KLConfig()
    """KL penalty to a frozen reference model."""
    entropy_coef: float = pydantic.Field(default=0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss); 0 turns it off."""
    importance_sampling: ImportanceSamplingConfig = ImportanceSamplingConfig()
    """Correction for the rollout/trainer log-prob mismatch."""
    moe_aux_loss_coef: float | None = pydantic.Field(default=None, ge=0)
    """Weight of the MoE router load-balancing loss added to the policy loss (mean over MoE layers, reported as
    ``loss/moe_aux``); None takes the model's own (``model.moe.aux_loss_coef``, from the checkpoint's HF
    ``router_aux_loss_coef``), 0 turns the term off. Dense models have no router: the setting does not apply."""

    @pydantic.model_validator(mode="after")
    def _check_policy(self) -> PolicyConfig:
        if self.loss_aggregation == "token_sum_norm" and self.loss_norm_length is None:
            raise ValueError(
                "loss_aggregation = 'token_sum_norm' divides by a constant length; set loss_norm_length "
                "(usually the rollout's max completion tokens)"
            )
        if self.loss_aggregation != "token_sum_norm" and self.loss_norm_length is not None:
            raise ValueError(
                f"loss_norm_length is only used by loss_aggregation = 'token_sum_norm' (got "
                f"{self.loss_aggregation!r}); remove it or switch the aggregation"
            )
        if self.ratio_level == "sequence" and self.loss_aggregation != "seq_mean_token_mean":
            raise ValueError(
                "ratio_level = 'sequence' (GSPO) averages per completion; set loss_aggregation = 'seq_mean_token_mean'"
            )
        return self


class GRPOConfig(PolicyConfig):
    """GRPO and its variants (DAPO, Dr. GRPO, GSPO, RLOO): critic-free, advantages from rewards within a group."""

    type: Literal["grpo"] = "grpo"
    """Selects this algorithm in a recipe."""
    group_relative: ClassVar[bool] = True
    group_size: int = 8
    """Completions sampled per prompt; advantages compare the samples of one prompt, so at least 2."""
    advantage_estimator: Literal["grpo", "rloo"] = "grpo"
    """'grpo': reward minus the group mean (optionally over the group std); 'rloo': reward minus the mean of the
    *other* samples of the group (leave-one-out)."""
    scale_advantages_by_std: bool = True
    """Divide GRPO advantages by the group's std (unbiased); Dr. GRPO turns this off to remove the difficulty bias."""
    advantage_eps: float = pydantic.Field(default=1e-6, gt=0)
    """Added to the group std before dividing, so groups of equal rewards get advantage 0, not NaN."""

    @pydantic.field_validator("group_size")
    @classmethod
    def _check_group_size(cls, group_size: int) -> int:
        if group_size < 2:
            raise ValueError(
                f"group_size = {group_size}: GRPO compares completions of the same prompt, so it needs "
                "group_size >= 2 (typically 4-16); use type = 'ppo' for one completion per prompt"
            )
        return group_size

    @pydantic.model_validator(mode="after")
    def _check_grpo(self) -> GRPOConfig:
        if self.advantage_estimator == "rloo" and self.scale_advantages_by_std:
            raise ValueError(
                "advantage_estimator = 'rloo' uses the leave-one-out baseline unscaled; "
                "set scale_advantages_by_std = false"
            )
        return self


class PPOConfig(PolicyConfig):
    """PPO with a learned critic: per-token advantages from GAE, a clipped value loss for the critic."""

    type: Literal["ppo"] = "ppo"
    """Selects this algorithm in a recipe."""
    advantage_estimator: Literal["gae"] = "gae"
    """Generalised advantage estimation from the critic's per-token values."""
    gamma: float = pydantic.Field(default=1.0, gt=0, le=1)
    """Discount per token (1.0 is usual for LLM completions: only the final reward matters)."""
    lam: float = pydantic.Field(default=0.95, ge=0, le=1)
    """GAE lambda: 0 is one-step TD (low variance, critic bias), 1 is Monte Carlo returns minus the value."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the batch's completion tokens."""
    value_clip: float = pydantic.Field(default=0.2, gt=0)
    """New values are kept within ``old_value +- value_clip`` in the clipped value loss."""
    vf_coef: float = pydantic.Field(default=1.0, gt=0)
    """Weight of the critic's value loss (the critic's learning rate is ``trainer.critic_lr``)."""


AlgorithmConfig = Annotated[GRPOConfig | PPOConfig, pydantic.Field(discriminator="type")]
"""The RL algorithm of a recipe, chosen by ``type``: 'grpo' or 'ppo'."""
