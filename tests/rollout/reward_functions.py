"""Reward functions a user might write, importable by the rollout workers of a test's run (``module:function``)."""

from __future__ import annotations

from rollout.tasks.problem import Problem


def needs_a_field_the_problems_lack(completion: str, problem: Problem) -> float:
    """Reads a metadata key the built-in tasks do not set: raises ``KeyError`` on every sample."""
    return float(completion.strip() == problem.metadata["expected"])


def fails_on_what_the_model_writes(completion: str, problem: Problem) -> float:
    """Scores the reference answer (what the run's preflight tries it on) and raises ``KeyError`` on anything else:
    a bug that shows only on generated text, in the run."""
    if completion.strip() == problem.answer:
        return 1.0
    return float(problem.metadata["expected"])
