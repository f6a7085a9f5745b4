"""The one place rollout and reward metrics are computed from samples.

:func:`sample_metrics` describes what was sampled: the reward curve (``reward/mean``, ``reward/std``, one
``reward/<term>/mean`` per reward term), completion lengths, the fraction cut at ``max_tokens`` and the policy
versions that generated the samples. The pool reports it for every collected batch; the driver reports it over
everything a step sampled (all dynamic-sampling rounds) and names the figures of the filtered training batch apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollout.types import Sample

__all__ = ["sample_metrics"]


def sample_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Reward and rollout figures of ``samples`` (at least one), as a flat ``{name: float}`` dict.

    Names: ``reward/mean``, ``reward/std`` (population std), ``reward/<term>/mean`` for each reward term any sample
    carries (a sample without that term counts 0), ``rollout/num_samples``, ``rollout/completion_len_mean``,
    ``rollout/completion_len_max``, ``rollout/truncated_frac`` (finish reason 'length'),
    ``rollout/min_policy_version`` and ``rollout/max_policy_version``.
    """
    if not samples:
        raise ValueError("sample_metrics needs at least one sample")
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([len(s.completion_ids) for s in samples])
    versions = [s.policy_version for s in samples]
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "rollout/num_samples": float(len(samples)),
        "rollout/completion_len_mean": float(lengths.mean()),
        "rollout/completion_len_max": float(lengths.max()),
        "rollout/truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
        "rollout/min_policy_version": float(min(versions)),
        "rollout/max_policy_version": float(max(versions)),
    }
    for name in sorted({name for s in samples for name in s.reward_terms}):
        out[f"reward/{name}/mean"] = float(np.mean([s.reward_terms.get(name, 0.0) for s in samples]))
    return out
