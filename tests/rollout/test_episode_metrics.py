"""The ``env/*`` figures of a batch of episodes (one function for environments and agents alike), and the reward
figures, which count an episode once however many samples it gave."""

import numpy as np
import pytest

from rollout.metrics import episode_metrics, sample_metrics
from rollout.types import Sample


def test_episode_figures_add_up_and_infos_sum_by_name():
    m = episode_metrics([3, 1], [10, 0], [False, True], [{"tool_calls": 2.0}, {"tool_calls": 1.0, "tool_s": 0.5}])
    assert m == {
        "env/num_episodes": 2.0, "env/num_turns": 4.0, "env/num_observation_tokens": 10.0, "env/num_timeouts": 1.0,
        "env/tool_calls": 3.0, "env/tool_s": 0.5,
    }  # fmt: skip
    assert episode_metrics([], [], []) == {
        "env/num_episodes": 0.0, "env/num_turns": 0.0, "env/num_observation_tokens": 0.0, "env/num_timeouts": 0.0,
    }  # fmt: skip


def test_one_count_per_episode_is_required():
    with pytest.raises(ValueError, match="one of each per episode"):
        episode_metrics([1, 2], [0], [False, False])


def _sample(group: int, episode: int | None, reward: float) -> Sample:
    return Sample(prompt_ids=np.arange(3), completion_ids=np.arange(2), rollout_logprobs=np.zeros(2, np.float32),
                  reward=reward, group_id=group, policy_version=0, episode=episode,
                  reward_terms={"correct": reward})  # fmt: skip


def test_reward_figures_count_an_episode_of_several_samples_once():
    # Group 0: an episode of three samples (reward 1) and one of one sample (reward 0); group 1: two plain samples.
    samples = [_sample(0, 0, 1.0), _sample(0, 0, 1.0), _sample(0, 0, 1.0), _sample(0, 1, 0.0),
               _sample(1, None, 0.0), _sample(1, None, 1.0)]  # fmt: skip
    m = sample_metrics(samples)
    assert m["reward/mean"] == m["reward/correct/mean"] == pytest.approx(0.5)  # 2 of 4 episodes, not 4 of 6 samples
    assert m["reward/std"] == pytest.approx(0.5) and m["rollout/num_samples"] == 6.0 and m["rollout/num_episodes"] == 4
