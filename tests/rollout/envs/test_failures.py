"""A batch's failed episodes: the budget ``environment.max_failed_fraction`` gives, and the groups that stay."""

from __future__ import annotations

import logging

import pytest

from rollout.envs import EpisodeFailed
from rollout.envs.failures import FailureBudget, drop_failed


def test_the_budget_lets_its_fraction_go_and_the_next_failure_fails_the_batch():
    budget = FailureBudget(10, 0.25)  # floor(2.5): two
    first, second = EpisodeFailed("env A broke on p0"), EpisodeFailed("env A broke on p3")
    assert budget.record(first) is first and budget.record(second) is second
    with pytest.raises(EpisodeFailed, match=r"3 of 10 episodes .*max_failed_fraction = 0.25 lets 2 go; the first: "
                                            r"env A broke on p0") as raised:  # fmt: skip
        budget.record(EpisodeFailed("env A broke on p7"))
    assert raised.value.__cause__ is first


def test_no_budget_fails_on_the_first_failure_with_its_own_message():
    error = EpisodeFailed("environment m:Env: step raised KeyError: 'x'")
    expected = r"^environment m:Env: step raised KeyError: 'x' \(environment\.max_failed_fraction = 0.0: a failed "
    with pytest.raises(EpisodeFailed, match=expected + r"episode fails the batch\)$"):
        FailureBudget(64, 0.0).record(error)
    with pytest.raises(EpisodeFailed):
        FailureBudget(3, 0.3).record(error)  # floor(0.9) = 0: a fraction too small for the batch lets nothing go


def test_a_group_left_with_one_episode_is_dropped_whole(caplog):
    groups = [7, 7, 7, 8, 8, 8, 9, 9, 9]
    failed = EpisodeFailed("flaky")
    outcomes = ["a", failed, "b", failed, failed, "c", "d", "e", "f"]
    with caplog.at_level(logging.WARNING, logger="rollout.envs.failures"):
        keep = drop_failed(groups, outcomes, group_size=3)
    assert keep == [0, 2, 6, 7, 8]  # group 8 kept one episode: nothing to compare it with
    assert sum("episode dropped" in r.message for r in caplog.records) == 3
    assert all(r.exc_info is not None for r in caplog.records)
    assert drop_failed(groups, ["x"] * 9, group_size=3) == list(range(9))


def test_one_episode_groups_keep_every_success_and_a_batch_of_none_fails():
    failed = EpisodeFailed("flaky")
    assert drop_failed([0, 1, 2], ["a", failed, "b"], group_size=1) == [0, 2]  # PPO: a group is one episode
    with pytest.raises(EpisodeFailed, match="no group kept 2 episodes to compare; the first failure: flaky"):
        drop_failed([0, 0, 1, 1], ["a", failed, failed, "b"], group_size=2)
