"""The ``env/*`` figures of a batch of episodes: one function for environments and agents alike."""

import pytest

from rollout.metrics import episode_metrics


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
