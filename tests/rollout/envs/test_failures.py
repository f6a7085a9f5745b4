"""A request's failed episodes: the budget ``environment.max_failed_fraction`` gives, the groups that stay, and the
other episodes stopped when the budget is spent."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollout.envs import EpisodeFailed
from rollout.envs.failures import FailureBudget, check_request_failures, drop_failed, run_all


def test_the_budget_lets_its_fraction_go_and_the_next_failure_fails_the_request(caplog):
    budget = FailureBudget(10, 0.25)  # floor(2.5): two
    first, second = EpisodeFailed("env A broke on p0"), EpisodeFailed("env A broke on p3")
    with caplog.at_level(logging.WARNING, logger="rollout.envs.failures"):
        assert budget.record(first) is first and budget.record(second) is second
        expected = r"3 of this rollout request's 10 episodes failed, and environment.max_failed_fraction = 0.25 lets "
        with pytest.raises(EpisodeFailed, match=expected + r"floor\(0.25 x 10\) = 2 go; the first: env A broke on p0"):
            budget.record(EpisodeFailed("env A broke on p7"))
    assert [r.exc_info is not None for r in caplog.records] == [True] * 3  # each failure logged as it happened
    assert "env A broke on p7" in caplog.text and "lets 2 be dropped, so the request fails" in caplog.text
    # Episodes failing at the same step all arrive before the others stop: one traceback each flooded the log.
    with caplog.at_level(logging.WARNING, logger="rollout.envs.failures"), pytest.raises(EpisodeFailed):
        budget.record(EpisodeFailed("env A broke on p9"))
    assert len(caplog.records) == 3 and "p9" not in caplog.text
    assert FailureBudget(100, 0.29).allowed == 29  # not floor(28.999...)


def test_a_fraction_too_small_for_the_request_says_so_and_zero_fails_on_the_first_failure():
    error = EpisodeFailed("environment m:Env: step raised KeyError: 'x'")
    with pytest.raises(EpisodeFailed, match=r"lets floor\(0.05 x 8\) = 0 go; the first: environment m:Env") as raised:
        FailureBudget(8, 0.05).record(error)
    assert raised.value.__cause__ is error
    expected = r"^environment m:Env: step raised KeyError: 'x' \(environment\.max_failed_fraction = 0: a failed "
    with pytest.raises(EpisodeFailed, match=expected + r"episode fails the batch\)$"):
        FailureBudget(64, 0.0).record(error)


def test_a_share_of_a_request_spends_the_requests_budget_and_the_sum_is_checked():
    share = FailureBudget(8, 0.05, request_episodes=64)  # floor(0.05 x 64) = 3, where floor(0.05 x 8) was 0
    assert share.allowed == 3
    for k in range(3):
        share.record(EpisodeFailed(f"flaky {k}"))
    over = r"4 of this rollout request's 64 episodes failed"
    with pytest.raises(EpisodeFailed, match=over + r".*= 3 go; the first: flaky 0"):
        share.record(EpisodeFailed("flaky 3"))
    check_request_failures(3, 64, 0.05)
    budget = r", and environment\.max_failed_fraction = 0.05 lets floor\(0.05 x 64\) = 3 go \(each failure's"
    with pytest.raises(EpisodeFailed, match="^" + over + budget):
        check_request_failures(4, 64, 0.05)
    with pytest.raises(ValueError, match="a call of 8 episodes in a request of 4"):
        FailureBudget(8, 0.05, request_episodes=4)


def test_a_group_left_with_fewer_episodes_than_it_needs_is_dropped_whole(caplog):
    groups = [7, 7, 7, 8, 8, 8, 9, 9, 9]
    failed = EpisodeFailed("flaky")
    outcomes = ["a", failed, "b", failed, failed, "c", "d", "e", "f"]
    with caplog.at_level(logging.WARNING, logger="rollout.envs.failures"):
        assert drop_failed(groups, outcomes, min_group_size=2) == [0, 2, 6, 7, 8]  # group 8 has one left
    assert "groups [8] dropped whole" in caplog.text
    assert drop_failed(groups, outcomes, min_group_size=1) == [0, 2, 5, 6, 7, 8]  # PPO: each episode stands alone
    assert drop_failed(groups, ["x"] * 9, min_group_size=2) == list(range(9))
    with pytest.raises(EpisodeFailed, match="no group kept the 2 episodes it needs; the first failure: flaky"):
        drop_failed([0, 0, 1, 1], ["a", failed, failed, "b"], min_group_size=2)


def test_the_failure_past_the_budget_stops_the_other_episodes():
    stopped: list[int] = []

    async def episode(k: int) -> int:
        if k == 0:
            raise EpisodeFailed("flaky tool")
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.append(k)
        return k

    async def fails_at_the_end(k: int) -> int:
        await asyncio.sleep(0.01 * k)
        if k in (1, 2):
            raise EpisodeFailed(f"flaky tool {k}")
        return k

    with pytest.raises(EpisodeFailed, match="flaky tool"):
        asyncio.run(asyncio.wait_for(run_all([episode(k) for k in range(4)], FailureBudget(4, 0.0)), 10))
    assert sorted(stopped) == [1, 2, 3]
    results = asyncio.run(run_all([fails_at_the_end(k) for k in range(4)], FailureBudget(4, 0.5)))
    assert [r if isinstance(r, int) else str(r) for r in results] == [0, "flaky tool 1", "flaky tool 2", 3]
