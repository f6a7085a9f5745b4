"""Configuration of the RL algorithm: what the policy update computes (advantages, policy loss, KL, entropy, IS).

``AlgorithmConfig`` is a tagged union on ``type``: ``[algorithm] type = "grpo"`` or ``"ppo"``; each type's update
(advantages, losses, whether it trains a critic) is an object in ``trainer.rl.algorithms``. How the update is run
(devices, optimizer, micro-batches, epochs, the critic's learning rate) lives in ``trainer.config.TrainerConfig``.
No torch import here, so recipes validate instantly.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

import pydantic

from common.config import Config, changed_settings, setting_warning

__all__ = [
    "AlgorithmConfig",
    "GRPOConfig",
    "ImportanceLevel",
    "ImportanceMode",
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
"""Per-token policy ratios, or GSPO's length-normalised one per sequence."""
ImportanceLevel = Literal["token", "sequence", "geometric"]
"""What one rollout importance weight covers: a token, or a completion (product or geometric mean of its token ratios;
see ``ImportanceSamplingConfig.level``)."""
ImportanceMode = Literal["truncate", "mask"]
"""What happens to an importance weight beyond its bounds: clamped to the bound, or set to 0."""

log = logging.getLogger(__name__)


def _default_kl_estimator(data: dict[str, Any]) -> KLEstimator:
    """k1 when the KL is a detached reward (its score-function gradient is then exact), k3 as a loss term."""
    return "k1" if data.get("where") == "reward" else "k3"


class KLConfig(Config):
    """Penalty on the divergence of the policy from a frozen reference model."""

    coef: float = pydantic.Field(default=0.0, ge=0)
    """Weight of the KL term; 0 turns it off and then no reference model is loaded."""
    where: Literal["loss", "reward"] = "loss"
    """'loss': add ``coef * KL`` to the loss (GRPO style); 'reward': subtract it from the reward before advantages
    (PPO/RLHF style; per token for GAE, summed over the completion for group advantages, where a group's std
    normalisation scales the penalties of a group of equal task rewards to order 1: warned at load)."""
    estimator: KLEstimator = pydantic.Field(default_factory=_default_kl_estimator)
    """Per-token estimate of KL(policy || reference) on sampled tokens; unset, it follows ``where``: 'k1' for 'reward',
    'k3' for 'loss' (the resolved recipe shows the choice). 'k1' (log-ratio: unbiased value, high variance; as a
    detached reward its policy gradient is exactly the KL's, as a loss term its expected gradient is 0), 'k2' (half
    squared log-ratio; as a loss its gradient is that of KL(policy || reference)), 'k3' (``exp(r) - 1 - r``: unbiased,
    non-negative, low variance; the usual loss term, whose expected gradient is that of KL(reference || policy); as a
    detached reward its gradient is not the KL's)."""

    @pydantic.model_validator(mode="after")
    def _warn_k1_in_loss(self) -> KLConfig:
        if self.coef == 0 and (unused := changed_settings(self, ["where"])):
            setting_warning(log, "algorithm.kl.%s: unused, as algorithm.kl.coef = 0 (no KL penalty, no reference "
                            "model); set kl.coef > 0 to apply it", ", ".join(unused))  # fmt: skip
        if self.in_loss and self.estimator == "k1":
            setting_warning(
                log,
                "algorithm.kl.estimator = 'k1' with where = 'loss': the expected gradient of k1 as a loss term is 0, "
                "so the penalty does not pull the policy towards the reference; use 'k3' or 'k2' for the loss, or "
                "where = 'reward' for k1"
            )
        return self

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
    """Importance weights for the gap between the rollout engine's log-probs and the trainer's.

    The raw weight of a unit (a token or a completion) is ``pi_trainer_old / pi_rollout`` of its tokens (detached); it
    multiplies the per-token policy loss after its bounds are applied: truncated (TIS, Yao et al., "Your efficient RL
    framework secretly brings you off-policy RL training") or masked (MIS / IcePop: beyond a bound the unit carries no
    policy loss). The modes are those of TRL's ``vllm_importance_sampling_mode`` and verl's rollout correction
    (``token`` / ``sequence`` / ``geometric`` x ``truncate`` / ``mask``). See ``trainer.rl.importance``.
    """

    enabled: bool = True
    """Apply the correction (needs the rollout log-probs, which every sample carries)."""
    level: ImportanceLevel = "token"
    """'token': one weight per token, ``exp(old_t - rollout_t)``: biased (it ignores how earlier tokens' mismatch
    changed the prefix distribution), low variance, independent of length. 'sequence': one weight per completion, the
    product ``exp(sum_t(old_t - rollout_t))``: the unbiased sequence weight before bounds, but its spread grows with
    length, so bounds bite more on long completions and the truncated weights of long completions collapse towards 0.
    'geometric': one weight per completion, the geometric mean ``exp(mean_t(old_t - rollout_t))`` (length-normalised,
    like GSPO's ratio): biased (it is the product's ``1/length`` power, not an importance weight of the sequence) but
    its spread shrinks with length, so long completions keep their weight. Its bounds belong close to 1 (e.g.
    ``cap = 1.001``): a per-token average rarely leaves ``[0.5, 2]``."""
    mode: ImportanceMode = "truncate"
    """'truncate' (TIS): weights are clamped into ``[lower_bound, cap]``; the bias is that of the clamp, and every unit
    still carries loss. 'mask' (MIS): units whose weight is above ``cap`` or below ``lower_bound`` get weight 0 and
    the others keep their unclamped weight: more bias where many units are masked (their samples carry no policy
    loss; they still count in the loss normaliser), but the units that stay are weighted exactly."""
    cap: float = pydantic.Field(default=2.0, ge=1.0)
    """Upper bound on a weight (C in the TIS paper): larger reduces bias, smaller reduces variance."""
    lower_bound: float | None = pydantic.Field(default=None, gt=0, le=1.0)
    """Lower bound on a weight, or None for none (the default, as in TRL). 'truncate' raises smaller weights to it
    (TRL's ``vllm_importance_sampling_clip_min``); 'mask' drops units below it (IcePop; e.g. ``1 / cap``), which
    removes the tokens the engine found much likelier than the trainer does."""

    @pydantic.model_validator(mode="after")
    def _check_bounds(self) -> ImportanceSamplingConfig:
        unused = changed_settings(self, ["level", "mode", "cap", "lower_bound"])
        if not self.enabled and unused:
            setting_warning(log, "importance_sampling.%s: unused, as importance_sampling.enabled = false",
                            ", ".join(unused))  # fmt: skip
        if self.lower_bound is not None and self.lower_bound >= self.cap:
            raise ValueError(
                f"importance_sampling.lower_bound = {self.lower_bound} must be below cap = {self.cap}; lower it "
                "(e.g. to 1 / cap) or remove it"
            )
        return self


class PolicyConfig(Config):
    """Fields shared by every algorithm (the base of GRPO's and PPO's configs): the clipped policy loss and its extra
    terms."""

    group_relative: ClassVar[bool] = False
    """Whether advantages compare the samples of one group with each other (GRPO and its variants): a step then
    needs at least 2 samples, and a group of equal rewards carries no signal (dynamic sampling may drop it)."""
    trains_critic: ClassVar[bool] = False
    """Whether the algorithm learns a value function: the train state builds a critic (``trainer.critic``), the step
    trains it, checkpoints hold it, and ``trainer.critic_lr`` applies."""
    group_size: int = pydantic.Field(default=1, ge=1)
    """Completions sampled per prompt (rollout ``n``); samples of one prompt form one group."""
    clip_low: float = pydantic.Field(default=0.2, gt=0, lt=1)
    """Ratios below ``1 - clip_low`` stop pushing a negative-advantage token down."""
    clip_high: float = pydantic.Field(default=0.2, gt=0)
    """Ratios above ``1 + clip_high`` stop pushing a positive-advantage token up; DAPO's clip-higher raises it
    (e.g. 0.28) to keep exploration. GSPO uses much smaller ranges (about 3e-4 / 4e-4) on its sequence ratio."""
    clip_ratio_c: float | None = pydantic.Field(default=None, gt=1.0)
    """PPO dual-clip (Ye et al. 2020, "Mastering complex control in MOBA games with deep RL"): with a negative
    advantage the per-token loss is at most ``-A * clip_ratio_c``, so a token whose ratio ran far above 1 is not pushed
    down in proportion to it (reported as ``clip_frac_dual``); typically 3. None turns it off."""
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
    overlong_filter: bool = False
    """DAPO overlong filtering: completions cut at the rollout's max_tokens (finish reason 'length') carry no loss;
    their group statistics still count them (with their KL penalty when it is in the reward). An agent episode cut
    by its own limits (``max_turns``, a timeout, its context) also ends with 'length' and is filtered alike."""
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
    TYPE_ALIASES: ClassVar[dict[str, str]] = {
        name: f"{label} is type = 'grpo' with its settings{where}" for name, label, where in (
            ("dapo", "DAPO", " (clip_high, token_mean, dynamic sampling, overlong filter): recipes/dapo_tiny.toml"),
            ("gspo", "GSPO", " (ratio_level = 'sequence'): recipes/gspo_tiny.toml"),
            ("dr_grpo", "Dr. GRPO", " (scale_advantages_by_std = false, loss_aggregation = 'token_sum_norm')"),
            ("rloo", "RLOO", " (advantage_estimator = 'rloo', scale_advantages_by_std = false)"),
        )
    }  # fmt: skip
    """What a recipe's ``type`` naming a variant of GRPO is told (``common.config``'s error for an unknown type)."""
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
        if self.kl.in_reward and self.scale_advantages_by_std:
            setting_warning(
                log,
                "algorithm.kl.where = 'reward' with scale_advantages_by_std: in a group whose task rewards are equal, "
                "the rewards then differ only by their KL penalties, and dividing by the group's std scales those "
                "differences up to advantages of order 1, whatever kl.coef is; use where = 'loss' (GRPO's own "
                "penalty) or scale_advantages_by_std = false"
            )
        return self


class PPOConfig(PolicyConfig):
    """PPO with a learned critic: per-token advantages from GAE, a clipped value loss for the critic."""

    trains_critic: ClassVar[bool] = True
    type: Literal["ppo"] = "ppo"
    """Selects this algorithm in a recipe."""
    advantage_estimator: Literal["gae"] = "gae"
    """Generalised advantage estimation from the critic's per-token values."""
    gamma: float = pydantic.Field(default=1.0, gt=0, le=1)
    """Discount per token (1.0 is usual for LLM completions: only the final reward matters; below 1 it discounts within
    each sample, not across the samples of one split agent episode: ``trainer.rl.algorithms.ppo``)."""
    lam: float = pydantic.Field(default=0.95, ge=0, le=1)
    """GAE lambda: 0 is one-step TD (low variance, critic bias), 1 is Monte Carlo returns minus the value."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the batch's completion tokens."""
    value_clip: float | None = pydantic.Field(default=0.2, gt=0)
    """New values are kept within ``old_value +- value_clip`` in the clipped value loss; None (``false`` in a recipe)
    trains the critic on the plain squared error."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _drop_vf_coef(cls, data: object) -> object:
        # Every earlier PPO run's recipe.resolved.toml holds it: still read (a run resumes from its record), ignored.
        if isinstance(data, dict) and "vf_coef" in data:
            data = {k: v for k, v in data.items() if k != "vf_coef"}
            setting_warning(log, "algorithm.vf_coef is ignored and will be refused in a later release: the critic has "
                                 "an optimizer of its own (AdamW), which undoes a constant weight on its loss (400x "
                                 "changed its update by 3%); set the critic's step size with trainer.critic_lr")
        return data


AlgorithmConfig = Annotated[GRPOConfig | PPOConfig, pydantic.Field(discriminator="type")]
"""The RL algorithm of a recipe, chosen by ``type``: 'grpo' or 'ppo'."""
