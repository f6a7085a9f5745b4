"""What a batch does with episodes whose own code failed: ``environment.max_failed_fraction`` of them may be dropped
(each logged with its traceback and counted), and the one failure too many fails the batch at once.

A dropped episode leaves its group smaller. Group-relative advantages need two episodes of a group (one, when the
group has one: PPO), so a group left with fewer is dropped whole; a batch left with no group fails. The episodes an
environment fails on are not a random subset of the batch (a tool may fail more often on harder problems), which is why
the default drops none: a failure is a bug to fix unless the recipe says the environment is known to fail now and then.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TypeVar

from rollout.envs.base import EpisodeFailed

__all__ = ["FailureBudget", "drop_failed"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class FailureBudget:
    """The failed episodes one batch of ``num_episodes`` may drop: ``floor(max_failed_fraction * num_episodes)``."""

    def __init__(self, num_episodes: int, max_failed_fraction: float) -> None:
        self.num_episodes = num_episodes
        self.max_failed_fraction = max_failed_fraction
        self.allowed = math.floor(max_failed_fraction * num_episodes)
        self.failures: list[EpisodeFailed] = []

    def record(self, error: EpisodeFailed) -> EpisodeFailed:
        """Count ``error`` and return it; raise :class:`EpisodeFailed` (chained to the first failure) when it is one
        more than the budget allows, so the caller stops the batch's other episodes."""
        self.failures.append(error)
        if len(self.failures) <= self.allowed:
            return error
        first = self.failures[0]
        if self.allowed == 0:
            raise EpisodeFailed(
                f"{first} (environment.max_failed_fraction = {self.max_failed_fraction}: a failed episode fails the "
                "batch)"
            ) from first
        raise EpisodeFailed(
            f"{len(self.failures)} of {self.num_episodes} episodes of this batch failed, and "
            f"environment.max_failed_fraction = {self.max_failed_fraction} lets {self.allowed} go; the first: {first}"
        ) from first


def drop_failed(groups: Sequence[int], outcomes: Sequence[_T | EpisodeFailed], group_size: int) -> list[int]:
    """The positions of ``outcomes`` to keep: every episode that did not fail (``outcomes[j]`` is not an
    :class:`EpisodeFailed`), of a group (``groups[j]``) that keeps at least ``min(2, group_size)`` of them. Each
    failure is logged with its traceback. Raises :class:`EpisodeFailed` when no group is left."""
    if len(groups) != len(outcomes):
        raise ValueError(f"{len(groups)} group ids for {len(outcomes)} outcomes")
    failures = {j: outcome for j, outcome in enumerate(outcomes) if isinstance(outcome, EpisodeFailed)}
    if not failures:
        return list(range(len(outcomes)))
    for error in failures.values():
        log.warning("episode dropped (environment.max_failed_fraction): %s", error, exc_info=error)
    survivors: dict[int, int] = {}
    for j, group in enumerate(groups):
        if j not in failures:
            survivors[group] = survivors.get(group, 0) + 1
    need = min(2, group_size)
    keep = [j for j, group in enumerate(groups) if j not in failures and survivors[group] >= need]
    if not keep:
        first = next(iter(failures.values()))
        raise EpisodeFailed(
            f"{len(failures)} of {len(outcomes)} episodes of this batch failed and no group kept {need} episodes to "
            f"compare; the first failure: {first}"
        ) from first
    return keep
