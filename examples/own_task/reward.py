"""The worked example's own reward term: a shorter answer is better (a python reward function).

Referenced from the recipe as ``function = "examples.own_task.reward:brevity"``; it must be importable where the
driver and the rollout workers run (here: from the repository root).
"""

from __future__ import annotations

from rollout.tasks.problem import Problem


def brevity(completion: str, problem: Problem) -> float:
    """1 for an answer no longer than the reference, falling to 0 at three times its length."""
    extra = max(0, len(completion.strip()) - len(problem.answer))
    return max(0.0, 1.0 - extra / (2 * max(1, len(problem.answer))))
