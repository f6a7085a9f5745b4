"""Held-out evaluation through the rollout pool: the policy's own samples (recipe temperature) and greedy decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.config import SamplingConfig

__all__ = ["evaluate"]


def evaluate(pool: Any, problems: Sequence[Any], sampling: SamplingConfig, term: str | None) -> dict[str, float]:
    """Generate one completion per held-out problem at ``sampling`` and at temperature 0; return eval metrics.

    ``eval/accuracy`` is the fraction of held-out problems whose sampled completion's ``term``
    (``RewardConfig.accuracy_term``) scores 1 (``eval/greedy_accuracy`` the same for greedy decoding); ``eval/reward``
    and ``eval/greedy_reward`` are the mean total rewards of the sampled and greedy episodes (with a reward model and
    no accuracy term, what tells how the policy does). A problem whose episode failed (within
    ``environment.max_failed_fraction``) has no completion: it counts as wrong, never as left out (an environment may
    fail more often on harder problems), and ``eval/num_failed_episodes`` counts them over both passes;
    ``eval/num_reward_errors`` counts the reward calls that failed (scored 0) over both passes.
    """
    if not problems:
        return {}
    greedy = sampling.model_copy(update={"temperature": 0.0, "seed": None})
    handles = [pool.submit(problems, 1, sampling), pool.submit(problems, 1, greedy)]
    sampled, greedy_batch = (pool.collect(h) for h in handles)
    metrics = {"eval/reward": _mean_reward(sampled), "eval/greedy_reward": _mean_reward(greedy_batch)}
    # 0 too: a series missing where it is 0 is no series in TensorBoard or Prometheus.
    metrics["eval/num_failed_episodes"] = sum(b.metrics.get("env/num_failed_episodes", 0.0) for b in (sampled,
                                                                                                     greedy_batch))
    # A judge that is down scores 0 (reward.on_error = "zero"): a worse policy to read, unless this says otherwise.
    metrics["eval/num_reward_errors"] = sum(b.metrics.get("reward/num_errors", 0.0) for b in (sampled, greedy_batch))
    if term is not None:
        for name, batch in (("eval/accuracy", sampled), ("eval/greedy_accuracy", greedy_batch)):
            solved = {s.group_id for s in batch.samples if s.reward_terms.get(term, 0.0) >= 1.0}
            metrics[name] = len(solved) / len(problems)
    return metrics


def _mean_reward(batch: Any) -> float:
    """The mean reward of a batch's episodes: one per problem (its group), which an agent may have split into several
    samples of one reward."""
    rewards = {s.group_id: s.reward for s in batch.samples}
    return float(np.mean(list(rewards.values()))) if rewards else 0.0
