"""Rule-based reward terms: verifiable math answers (math-verify), normalised exact match, and a format regex.

Every term scores a batch: ``score(completions, problems, labels) -> (scores, num_errors)``, where ``labels`` name
the samples for error messages. Rule terms never count errors: a completion they cannot read scores 0.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence

from rollout.rewards.config import ExactMatchRewardConfig, FormatRewardConfig, MathRewardConfig
from rollout.tasks.problem import Problem

__all__ = ["ExactMatchReward", "FormatReward", "MathReward", "normalize_answer"]


class MathReward:
    """1.0 if the completion's final answer is mathematically equal to the reference (math-verify), else 0.0."""

    def __init__(self, config: MathRewardConfig) -> None:
        import math_verify  # noqa: F401  (fail at build time if the library is missing)

        self.name = config.term_name
        self.weight = config.weight
        self._timeout_s = config.timeout_s

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        from math_verify import parse, verify

        # math-verify enforces its timeout with SIGALRM, which only the main thread may install.
        timeout = self._timeout_s if threading.current_thread() is threading.main_thread() else None
        scores = []
        for completion, problem in zip(completions, problems, strict=True):
            gold = _parse_gold(problem.answer, timeout)
            if not gold:
                raise ValueError(
                    f"reward term {self.name!r}: math-verify cannot read the reference answer {problem.answer!r} of "
                    f"problem {problem.problem_id!r}; fix the task data or use an exact_match term"
                )
            predicted = parse(completion, parsing_timeout=timeout)
            scores.append(1.0 if predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0)
        return scores, 0


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> list:
    """Parsed reference, or ``[]`` when math-verify finds no mathematical object in it."""
    from math_verify import parse

    # A bare reference ("2\sqrt{2}", "(1, 2)") is read as one LaTeX expression; read unwrapped, the plain-expression
    # extractor would keep only a number inside it.
    wrapped = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    parsed = parse(wrapped, parsing_timeout=timeout) or parse(answer, parsing_timeout=timeout)
    return parsed if any(not isinstance(item, str) for item in parsed) else []


class ExactMatchReward:
    """1.0 if the (optionally extracted) completion equals the reference answer after :func:`normalize_answer`."""

    def __init__(self, config: ExactMatchRewardConfig) -> None:
        self.name = config.term_name
        self.weight = config.weight
        self._extract = re.compile(config.extract_pattern) if config.extract_pattern is not None else None
        self._case_sensitive = config.case_sensitive

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        scores = []
        for completion, problem in zip(completions, problems, strict=True):
            text = self._extracted(completion)
            if text is None:
                scores.append(0.0)
                continue
            reference = normalize_answer(problem.answer, self._case_sensitive)
            scores.append(1.0 if normalize_answer(text, self._case_sensitive) == reference else 0.0)
        return scores, 0

    def _extracted(self, completion: str) -> str | None:
        if self._extract is None:
            return completion
        matches = list(self._extract.finditer(completion))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if self._extract.groups else last.group(0)


def normalize_answer(text: str, case_sensitive: bool = False) -> str:
    """Strip, collapse runs of whitespace to one space, and lower-case unless ``case_sensitive``."""
    text = " ".join(text.split())
    return text if case_sensitive else text.lower()


class FormatReward:
    """1.0 if the completion matches the configured regex (whole stripped text, or anywhere), else 0.0."""

    def __init__(self, config: FormatRewardConfig) -> None:
        self.name = config.term_name
        self.weight = config.weight
        self._pattern = re.compile(config.pattern, re.DOTALL)
        self._fullmatch = config.mode == "fullmatch"

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        scores = []
        for completion in completions:
            match = self._pattern.fullmatch(completion.strip()) if self._fullmatch else self._pattern.search(completion)
            scores.append(1.0 if match else 0.0)
        return scores, 0
