"""What a rollout request does with episodes whose own code failed: ``environment.max_failed_fraction`` of them may be
dropped (each logged with its traceback when it fails, and counted), and the one failure too many fails the request at
once, stopping its other episodes.

A dropped episode leaves its group smaller. Group-relative advantages need two episodes of a group, so the caller
names the least a group must keep (``min_group_size``) and a group left with fewer is dropped whole; a request left
with no group fails. The episodes an environment fails on are not a random subset (a tool may fail more often on
harder problems), which is why the default drops none: a failure is a bug to fix unless the recipe says the
environment is known to fail now and then.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from rollout.envs.base import EpisodeFailed

__all__ = [
    "FailureBudget", "check_request_failures", "check_request_kept", "drop_failed", "failures_allowed",
    "is_own_base_exception", "run_all",
]  # fmt: skip

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def is_own_base_exception(error: BaseException) -> bool:
    """Whether ``error``, a ``BaseException`` that is no ``Exception``, caught in a task running user code (an
    environment's call, an agent function), is that code's own failure: ``SystemExit`` (a CLI parser in an agent), a
    library's ``CancelledError``, a ``KeyboardInterrupt`` it raised (the process's own arrives in the main thread,
    never in these tasks). Not so for a cancellation of the task itself (its batch or deadline cancelled it), nor
    ``GeneratorExit`` (a coroutine being closed): those go on up. Raised on, the user's own ended the worker's event
    loop, and every later batch waited on it for good."""
    if isinstance(error, GeneratorExit):
        return False
    task = asyncio.current_task()
    return not (isinstance(error, asyncio.CancelledError) and task is not None and task.cancelling())


def failures_allowed(num_episodes: int, max_failed_fraction: float) -> int:
    """The failed episodes a rollout request of ``num_episodes`` may drop: ``floor(max_failed_fraction *
    num_episodes)``."""
    return math.floor(max_failed_fraction * num_episodes + 1e-9)  # 0.29 * 100 is 28.999...: the user wrote 29


def check_request_failures(num_failed: int, num_episodes: int, max_failed_fraction: float) -> None:
    """Raise :class:`EpisodeFailed` when ``num_failed`` of a request's ``num_episodes`` episodes are more than
    :func:`failures_allowed`: the pool's check of a request it split over workers, whose shares each kept within the
    request's budget alone. Each failure's traceback was logged by its worker as it happened."""
    allowed = failures_allowed(num_episodes, max_failed_fraction)
    if num_failed > allowed:
        raise EpisodeFailed(f"{_over_budget(num_failed, num_episodes, max_failed_fraction, allowed)} (each failure's "
                            "traceback is in the rollout workers' log)")  # fmt: skip


def check_request_kept(num_kept: int, num_failed: int, num_episodes: int, min_group_size: int) -> None:
    """Raise :class:`EpisodeFailed` when a request whose shares all came back kept no episode because
    ``num_failed`` of them failed: the pool's check of a request it split over workers, whose shares may each keep
    none."""
    if num_kept == 0 and num_failed > 0:
        raise EpisodeFailed(f"{_none_kept(num_failed, num_episodes, min_group_size)} (each failure's traceback is in "
                            "the rollout workers' log)")  # fmt: skip


def _none_kept(num_failed: int, num_episodes: int, min_group_size: int) -> str:
    return (f"{num_failed} of this rollout request's {num_episodes} episodes failed, and no group kept the "
            f"{min_group_size} episodes it needs")  # fmt: skip


def _over_budget(num_failed: int, num_episodes: int, max_failed_fraction: float, allowed: int) -> str:
    return (f"{num_failed} of this rollout request's {num_episodes} episodes failed, and "
            f"environment.max_failed_fraction = {max_failed_fraction} lets floor({max_failed_fraction} x "
            f"{num_episodes}) = {allowed} go")  # fmt: skip


class FailureBudget:
    """The failed episodes one call of ``num_episodes`` may drop: :func:`failures_allowed` of the whole request's
    ``request_episodes`` (default: the call is the whole request). A call that is one worker's share of a request
    spends at most the request's budget alone; the pool checks the shares' sum (:func:`check_request_failures`), so a
    batch cut into small shares keeps its fraction (each share's floor would have let fewer go, none at all for a
    share smaller than ``1 / max_failed_fraction``)."""

    def __init__(self, num_episodes: int, max_failed_fraction: float, request_episodes: int | None = None) -> None:
        self.num_episodes = request_episodes if request_episodes is not None else num_episodes
        if self.num_episodes < num_episodes:
            raise ValueError(f"a call of {num_episodes} episodes in a request of {request_episodes}")
        self.max_failed_fraction = max_failed_fraction
        self.allowed = failures_allowed(self.num_episodes, max_failed_fraction)
        self.failures: list[EpisodeFailed] = []

    def record(self, error: EpisodeFailed) -> EpisodeFailed:
        """Count ``error`` and log it with its traceback; within the budget return it (the episode is dropped), else
        raise :class:`EpisodeFailed` (chained to the first failure), so the caller stops the request's other episodes.
        Only the first failure past the budget is logged: episodes failing at the same step all arrive before the
        others stop, and a traceback each flooded the log."""
        self.failures.append(error)
        if len(self.failures) <= self.allowed + 1:
            dropped = len(self.failures) <= self.allowed
            log.warning("episode failed (%d of this request's; environment.max_failed_fraction lets %d be dropped%s): "
                        "%s", len(self.failures), self.allowed, "" if dropped else ", so the request fails", error,
                        exc_info=error)  # fmt: skip
        if len(self.failures) <= self.allowed:
            return error
        first = self.failures[0]
        if self.max_failed_fraction == 0:
            raise EpisodeFailed(
                f"{first} (environment.max_failed_fraction = 0: a failed episode fails the batch)"
            ) from first
        over = _over_budget(len(self.failures), self.num_episodes, self.max_failed_fraction, self.allowed)
        raise EpisodeFailed(f"{over}; the first: {first}") from first


async def run_all(coroutines: Sequence[Coroutine[Any, Any, _T]], budget: FailureBudget) -> list[_T | EpisodeFailed]:
    """Await every episode at once; results in order, an :class:`EpisodeFailed` in place of each episode that failed
    within ``budget``. The failure past the budget, or any other error (an engine's), raises after cancelling the
    other episodes (each closes its environment and aborts its engine requests as it unwinds)."""

    async def one(coroutine: Coroutine[Any, Any, _T]) -> _T | EpisodeFailed:
        try:
            return await coroutine
        except EpisodeFailed as e:
            return budget.record(e)

    tasks = [asyncio.ensure_future(one(c)) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def drop_failed(
    groups: Sequence[int], outcomes: Sequence[_T | EpisodeFailed], min_group_size: int, whole_request: bool = True
) -> list[int]:
    """The positions of ``outcomes`` to keep: every episode that did not fail (``outcomes[j]`` is not an
    :class:`EpisodeFailed`), of a group (``groups[j]``) that keeps at least ``min_group_size`` of them. Raises
    :class:`EpisodeFailed` when no group is left of a ``whole_request``; one share of a request may keep none (the
    pool's :func:`check_request_kept` decides for the request)."""
    if len(groups) != len(outcomes):
        raise ValueError(f"{len(groups)} group ids for {len(outcomes)} outcomes")
    failed = {j: outcome for j, outcome in enumerate(outcomes) if isinstance(outcome, EpisodeFailed)}
    if not failed:
        return list(range(len(outcomes)))
    survivors: dict[int, int] = {}
    for j, group in enumerate(groups):
        if j not in failed:
            survivors[group] = survivors.get(group, 0) + 1
    keep = [j for j, group in enumerate(groups) if j not in failed and survivors[group] >= min_group_size]
    if not keep and whole_request:
        first = failed[min(failed)]
        none_kept = _none_kept(len(failed), len(outcomes), min_group_size)
        raise EpisodeFailed(f"{none_kept}; the first failure: {first}") from first
    if len(keep) + len(failed) < len(outcomes):
        short = sorted({g for g, n in survivors.items() if n < min_group_size})
        log.warning("groups %s dropped whole: fewer than %d of their episodes did not fail", short, min_group_size)
    return keep
