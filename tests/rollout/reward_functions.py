"""Reward functions a user might write, importable by the rollout workers of a test's run (``module:function``)."""

from __future__ import annotations

from rollout.tasks.problem import Problem


def needs_a_field_the_problems_lack(completion: str, problem: Problem) -> float:
    """Reads a metadata key the built-in tasks do not set: raises ``KeyError`` on every sample."""
    return float(completion.strip() == problem.metadata["expected"])
