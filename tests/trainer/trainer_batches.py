"""Random rollout data for trainer tests: groups of samples with varied prompt and completion lengths."""

from __future__ import annotations

import numpy as np

from rollout.types import RolloutBatch, Sample


def random_samples(
    seed: int,
    *,
    num_groups: int = 3,
    group_size: int = 4,
    prompt_len: tuple[int, int] = (2, 9),
    completion_len: tuple[int, int] = (1, 20),
    vocab_size: int = 64,
    logprob: float | tuple[float, float] = 0.0,
    policy_version: int = 0,
    shared_prompts: bool = False,
) -> list[Sample]:
    """``num_groups x group_size`` samples, group ids ``0..num_groups-1``; lengths drawn from ``[low, high)``.
    ``shared_prompts``: the samples of a group have the same prompt (as GRPO draws them), else each its own.

    ``logprob``: the rollout log-prob of every completion token, or a ``(low, high)`` range drawn uniformly per token.
    Token ids avoid 0 (padding); rewards are uniform in [0, 1).
    """
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        # Drawn only when used: the random stream of unshared batches stays what other tests were written against.
        group_prompt = rng.integers(1, vocab_size, int(rng.integers(*prompt_len))) if shared_prompts else None
        for _ in range(group_size):
            p, c = int(rng.integers(*prompt_len)), int(rng.integers(*completion_len))
            prompt = rng.integers(1, vocab_size, p) if group_prompt is None else group_prompt.copy()
            if isinstance(logprob, tuple):
                lps = rng.uniform(*logprob, c).astype(np.float32)
            else:
                lps = np.full(c, logprob, np.float32)
            out.append(Sample(
                prompt_ids=prompt, completion_ids=rng.integers(1, vocab_size, c),
                rollout_logprobs=lps, reward=float(rng.random()), group_id=g, policy_version=policy_version,
            ))  # fmt: skip
    return out


def random_batch(seed: int, **kwargs) -> RolloutBatch:
    """A :class:`RolloutBatch` of :func:`random_samples`."""
    return RolloutBatch(random_samples(seed, **kwargs))
