"""The policy loss of one micro-batch: clipped policy loss, KL to the reference, entropy bonus and IS correction.

What every algorithm of ``trainer.rl.algorithms`` minimises for the policy (``Algorithm.policy_loss``). Typical use
(``old_logprobs=None`` means the batch is used once, right after it was generated, so the trainer's own detached
log-probs are the old ones)::

    loss, metrics = compute_policy_loss(
        logprobs, advantages, mask, algorithm_config,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropies=entropies,
        num_tokens=batch_tokens, num_seqs=batch_seqs,  # whole optimizer batch, for exact gradient accumulation
    )
    loss.backward()

When policy, old, reference and rollout log-probs are equal, the ratio and IS weights are exactly 1, the KL is exactly
0 (and so is its gradient), and the gradient is that of ``-aggregate(advantages * logprobs)``.
"""

from __future__ import annotations

import torch

from trainer.metrics import Metrics
from trainer.rl.aggregation import AggregateKwargs, aggregate, masked_mean
from trainer.rl.config import PolicyConfig
from trainer.rl.entropy import entropy_bonus
from trainer.rl.importance import importance_weights, rollout_fidelity_metrics
from trainer.rl.kl import kl_estimate
from trainer.rl.policy_loss import clipped_policy_loss

__all__ = ["compute_policy_loss"]


def compute_policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyConfig,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    seq_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Scalar policy loss of a micro-batch and its metrics.

    Args:
        logprobs: [B, T] policy log-probs of the sampled tokens (carries the gradient).
        advantages: [B, T] per-token advantages.
        mask: [B, T] 1 for completion tokens that count.
        config: the algorithm config (clip bounds, ratio level, aggregation, KL, entropy, importance sampling).
        old_logprobs: [B, T] log-probs under the weights that generated the batch; None uses ``logprobs.detach()``.
        ref_logprobs: [B, T] frozen reference log-probs; required when ``config.kl.coef > 0`` with ``where='loss'``,
            and reported as ``kl`` whenever given.
        rollout_logprobs: [B, T] the engine's log-probs; required when importance sampling is enabled.
        entropies: [B, T] per-token entropies of the policy; required when ``config.entropy_coef > 0``.
        num_tokens, num_seqs: the whole optimizer batch's token / sequence counts (see ``trainer.rl.aggregation``).
        seq_tokens: [B] the token count of the episode each row is part of (``MicroBatch.sequence_tokens``).

    Returns:
        (loss, metrics): a 0-dim tensor and a flat dict of metrics (0-dim tensors, ``trainer.metrics``): ``loss``,
        ``policy_loss``, clip fractions, ratio stats, and when applicable ``kl`` (token mean), ``kl_loss``, ``entropy``
        (token mean), the fidelity metrics of ``trainer.rl.importance.rollout_fidelity_metrics`` (``logprob_gap``,
        ``logprob_gap_max``, ``rollout_kl``; whenever ``rollout_logprobs`` are given) and the IS stats of
        ``importance_weights``. With global
        ``num_tokens`` / ``num_seqs``, ``loss``, ``policy_loss`` and ``kl_loss`` are this micro-batch's share of the
        batch value (sum them over micro-batches); ``*_max`` / ``*_min`` are micro-batch extremes; the other metrics
        are micro-batch means. Importance weights multiply the policy term only, not the KL or entropy terms.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    agg: AggregateKwargs = {
        "norm_length": config.loss_norm_length, "num_tokens": num_tokens, "num_seqs": num_seqs,
        "seq_tokens": seq_tokens,
    }  # fmt: skip
    metrics: Metrics = {"num_tokens": mask.detach().sum()}

    weights = None
    is_cfg = config.importance_sampling
    if is_cfg.enabled and rollout_logprobs is None:
        raise ValueError("importance sampling is enabled but no rollout_logprobs were given; pass the engine's "
                         "log-probs or set algorithm.importance_sampling.enabled = false")
    if rollout_logprobs is not None:
        metrics.update(rollout_fidelity_metrics(old, rollout_logprobs, mask))
        if is_cfg.enabled:
            weights, is_metrics = importance_weights(
                old, rollout_logprobs, mask, is_cfg.level, is_cfg.cap, mode=is_cfg.mode, lower_bound=is_cfg.lower_bound
            )
            metrics.update(is_metrics)

    loss, pg_metrics = clipped_policy_loss(
        logprobs, old, advantages, mask,
        clip_low=config.clip_low, clip_high=config.clip_high, clip_ratio_c=config.clip_ratio_c,
        ratio_level=config.ratio_level, aggregation=config.loss_aggregation, weights=weights, **agg,
    )  # fmt: skip
    metrics["policy_loss"] = loss.detach()
    metrics.update(pg_metrics)

    if config.kl.in_loss and ref_logprobs is None:
        raise ValueError("algorithm.kl.coef > 0 with where = 'loss' needs ref_logprobs from the reference model")
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, config.kl.estimator)  # [B, T]
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if config.kl.in_loss:
            kl_loss = aggregate(kl, mask, config.loss_aggregation, **agg)
            metrics["kl_loss"] = kl_loss.detach()
            loss = loss + config.kl.coef * kl_loss

    if config.entropy_coef > 0 and entropies is None:
        raise ValueError("algorithm.entropy_coef > 0 needs the per-token entropies of the policy")
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies.detach(), mask)
        if config.entropy_coef > 0:
            loss = loss - entropy_bonus(entropies, mask, config.entropy_coef, config.loss_aggregation, **agg)

    metrics["loss"] = loss.detach()
    return loss, metrics
