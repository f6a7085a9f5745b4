"""Held-out evaluation counts problems, not samples: an agent's split episode counts once, a failed one as wrong."""

from __future__ import annotations

import numpy as np
import pytest

from driver.evaluate import evaluate
from rollout.config import SamplingConfig
from rollout.types import RolloutBatch, Sample


def _sample(group_id: int, correct: bool, episode: int | None = None) -> Sample:
    ids = np.array([1, 2], dtype=np.int64)
    return Sample(prompt_ids=ids, completion_ids=ids, rollout_logprobs=np.zeros(2, np.float32),
                  reward=float(correct), group_id=group_id, policy_version=0,
                  reward_terms={"exact_match": float(correct)}, episode=episode)  # fmt: skip


class ReplayPool:
    """Answers the sampled pass, then the greedy pass, with the batches it was given."""

    def __init__(self, *batches: RolloutBatch) -> None:
        self._batches = list(batches)

    def submit(self, problems, group_size, sampling=None, first_group_id=None, min_group_size=1):
        return len(self._batches)

    def collect(self, handle):
        return self._batches.pop(0)


def test_a_split_episode_counts_once_and_a_failed_one_counts_as_wrong():
    sampled = RolloutBatch(
        samples=[_sample(0, True, episode=0), _sample(0, True, episode=0), _sample(1, True), _sample(2, False)],
        metrics={"env/num_failed_episodes": 1.0},  # problem 3's episode failed: no sample
    )
    greedy = RolloutBatch(samples=[_sample(g, True) for g in range(4)])
    metrics = evaluate(ReplayPool(sampled, greedy), ["p0", "p1", "p2", "p3"], SamplingConfig(), "exact_match")
    assert metrics["eval/accuracy"] == 0.5  # 2 of 4 problems, not 3 of 4 samples
    assert metrics["eval/greedy_accuracy"] == 1.0
    assert metrics["eval/reward"] == pytest.approx(2 / 3)  # over the three episodes that ran
    assert metrics["eval/greedy_reward"] == 1.0  # what a reward-model run without an accuracy term reads greedy by
    assert metrics["eval/num_failed_episodes"] == 1.0
    clean = evaluate(ReplayPool(greedy, greedy), ["p0", "p1", "p2", "p3"], SamplingConfig(), "exact_match")
    assert clean["eval/num_failed_episodes"] == 0.0 and clean["eval/accuracy"] == 1.0
    erring = RolloutBatch(samples=greedy.samples, metrics={"reward/num_errors": 2.0})
    assert evaluate(ReplayPool(erring, greedy), ["p0", "p1", "p2", "p3"], SamplingConfig(),
                    "exact_match")["eval/num_reward_errors"] == 2.0  # fmt: skip
