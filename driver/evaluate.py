"""Held-out evaluation through the rollout pool: the policy's own samples (recipe temperature) and greedy decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.config import SamplingConfig

__all__ = ["evaluate"]


def evaluate(pool: Any, problems: Sequence[Any], sampling: SamplingConfig, term: str | None) -> dict[str, float]:
    """Generate one completion per held-out problem at ``sampling`` and at temperature 0; return eval metrics.

    ``eval/accuracy`` is the fraction of sampled completions whose ``term`` (``RewardConfig.accuracy_term``) scores 1
    (``eval/greedy_accuracy`` the same for greedy decoding); ``eval/reward`` is the mean total reward of the sampled
    completions.
    """
    if not problems:
        return {}
    greedy = sampling.model_copy(update={"temperature": 0.0, "seed": None})
    handles = [pool.submit(problems, 1, sampling), pool.submit(problems, 1, greedy)]
    sampled, greedy_batch = (pool.collect(h) for h in handles)
    metrics = {"eval/reward": float(np.mean([s.reward for s in sampled.samples]))}
    if term is not None:
        metrics["eval/accuracy"] = float(np.mean([s.reward_terms.get(term, 0.0) >= 1.0 for s in sampled.samples]))
        metrics["eval/greedy_accuracy"] = float(
            np.mean([s.reward_terms.get(term, 0.0) >= 1.0 for s in greedy_batch.samples])
        )
    return metrics
