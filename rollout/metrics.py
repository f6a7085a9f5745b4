"""The one place rollout and reward metrics are computed from samples.

:func:`sample_metrics` describes what was sampled: the reward curve (``reward/mean``, ``reward/std``, one
``reward/<term>/mean`` per reward term), completion lengths, the fraction cut at ``max_tokens`` and the policy
versions that generated the samples. The pool reports it for every collected batch; the driver reports it over
everything a step sampled (all dynamic-sampling rounds) and names the figures of the filtered training batch apart.
:func:`episode_metrics` gives the ``env/*`` figures of multi-turn episodes, whether an environment or an agent ran
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rollout.types import RolloutBatch, Sample, episode_members

__all__ = [
    "BUILTIN_EPISODE_FIGURES", "combined_metrics", "episode_metrics", "sample_metrics", "summed_metrics",
]  # fmt: skip

BUILTIN_EPISODE_FIGURES = frozenset({
    "num_episodes", "num_turns", "num_observation_tokens", "num_timeouts", "num_failed_episodes",
    "num_dropped_episodes",
})  # fmt: skip
"""The ``env/<name>`` figures rl-align reports itself; an environment's ``info`` may not use these names."""


def episode_metrics(
    num_turns: Sequence[int],
    observation_tokens: Sequence[int],
    timed_out: Sequence[bool],
    infos: Sequence[Mapping[str, float]] = (),
) -> dict[str, float]:
    """Additive figures of a batch of episodes, one entry per episode in each argument (the pool sums them over
    pieces): ``env/num_episodes``, ``env/num_turns`` (model turns: an agent's calls), ``env/num_observation_tokens``
    (tokens the model was given between its turns), ``env/num_timeouts`` and the sum of each ``env/<name>`` an
    environment reports in its episodes' ``info`` (``env/tool_calls``, ``env/tool_s``, ...)."""
    if not len(num_turns) == len(observation_tokens) == len(timed_out):
        raise ValueError(f"{len(num_turns)} turn counts, {len(observation_tokens)} observation counts and "
                         f"{len(timed_out)} timeouts: give one of each per episode")
    out = {
        "env/num_episodes": float(len(num_turns)),
        "env/num_turns": float(sum(num_turns)),
        "env/num_observation_tokens": float(sum(observation_tokens)),
        "env/num_timeouts": float(sum(timed_out)),
    }
    for info in infos:
        for name, value in info.items():
            out[f"env/{name}"] = out.get(f"env/{name}", 0.0) + value
    return out


def sample_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Reward and rollout figures of ``samples`` (at least one), as a flat ``{name: float}`` dict.

    Names: ``reward/mean``, ``reward/std`` (population std), ``reward/<term>/mean`` for each reward term any sample
    carries (a sample without that term counts 0), each over episodes (the samples of an agent episode that gave
    several share its reward and count once), ``rollout/num_samples``, ``rollout/num_episodes`` (what the rewards
    scored), ``rollout/completion_len_mean`` and ``rollout/completion_len_max`` (model tokens: a multi-turn episode's
    observations count in
    ``env/num_observation_tokens``), ``rollout/truncated_frac`` (finish reason 'length': in a multi-turn episode
    also a limit of the episode's, its turns, tokens or time),
    ``rollout/min_policy_version`` and ``rollout/max_policy_version``.
    """
    if not samples:
        raise ValueError("sample_metrics needs at least one sample")
    episodes = [samples[m[0]] for m in episode_members([s.group_id for s in samples], [s.episode for s in samples])]
    rewards = np.array([s.reward for s in episodes], dtype=np.float64)
    lengths = np.array([s.num_model_tokens for s in samples])  # an episode's observations are env/ figures
    versions = [s.policy_version for s in samples]
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "rollout/num_samples": float(len(samples)),
        "rollout/num_episodes": float(len(episodes)),
        "rollout/completion_len_mean": float(lengths.mean()),
        "rollout/completion_len_max": float(lengths.max()),
        "rollout/truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
        "rollout/min_policy_version": float(min(versions)),
        "rollout/max_policy_version": float(max(versions)),
    }
    for name in sorted({name for s in episodes for name in s.reward_terms}):
        out[f"reward/{name}/mean"] = float(np.mean([s.reward_terms.get(name, 0.0) for s in episodes]))
    return out


def summed_metrics(batches: Sequence[RolloutBatch]) -> dict[str, float]:
    """Every figure of ``batches`` summed by name (the callers replace those that do not add up)."""
    metrics: dict[str, float] = {}
    for batch in batches:
        for key, value in batch.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return metrics


def combined_metrics(batches: Sequence[RolloutBatch]) -> dict[str, float]:
    """The figures of several requests' batches as of one (a step's dynamic-sampling rounds, one after another): their
    counters and seconds summed, :func:`sample_metrics` of all their samples, and tokens per second over the summed
    seconds."""
    metrics = summed_metrics(batches)
    metrics.update(sample_metrics([s for batch in batches for s in batch.samples]))
    seconds = metrics.get("rollout/seconds", 0.0)
    metrics["rollout/tokens_per_s"] = metrics.get("rollout/num_completion_tokens", 0.0) / max(seconds, 1e-9)
    return metrics
