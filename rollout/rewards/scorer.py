"""The reward scorer: builds every configured term once, then scores batches of completions next to the engine.

Usage::

    scorer = RewardScorer.from_config(config.reward)   # imports user functions, loads reward models: fails early
    rewards, terms, metrics = scorer.score(completions, problems)
    scorer.close()

Every term but reward models is computed in a process of its own, each call under ``reward.timeout_s``
(:mod:`rollout.rewards.isolation`); reward models run here.

``rewards[i] = sum(term.weight * terms[term.name][i])``. Completions are the decoded text of the generated tokens;
trailing end-of-sequence texts (``reward.strip_suffixes``) are removed before any term sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from rollout.rewards.config import (
    ExactMatchRewardConfig,
    FormatRewardConfig,
    FunctionRewardConfig,
    MathRewardConfig,
    OverlongPenaltyConfig,
    RewardConfig,
    RewardModelConfig,
    RewardTermConfig,
)
from rollout.tasks.problem import Problem

if TYPE_CHECKING:
    from rollout.rewards.isolation import TermProcess

__all__ = ["RewardScorer", "RewardTerm", "build_term", "overlong_penalty"]


def overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment (``reward.overlong``): 0 up to ``max_tokens - cache_tokens`` tokens, then
    linearly down to -1 at ``max_tokens`` (and -1 beyond)."""
    free = max_tokens - cache_tokens
    if num_tokens <= free:
        return 0.0
    return max(-1.0, (free - num_tokens) / cache_tokens)


class RewardTerm(Protocol):
    """One scored quantity; ``score`` returns a value per sample and how many samples errored (scored 0)."""

    name: str
    weight: float

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]: ...


def build_term(
    config: RewardTermConfig, on_error: Literal["fail", "zero"], timeout_s: float | None = None
) -> RewardTerm:
    """Build the term a config describes here (user functions are imported, reward models loaded);
    ``timeout_s``: the limit of one call of an async user function. :meth:`RewardScorer.from_config` builds all but
    reward models in a process of their own (:mod:`rollout.rewards.isolation`) through this."""
    if isinstance(config, MathRewardConfig):
        from rollout.rewards.rules import MathReward

        return MathReward(config)
    if isinstance(config, ExactMatchRewardConfig):
        from rollout.rewards.rules import ExactMatchReward

        return ExactMatchReward(config)
    if isinstance(config, FormatRewardConfig):
        from rollout.rewards.rules import FormatReward

        return FormatReward(config)
    if isinstance(config, FunctionRewardConfig):
        from rollout.rewards.function import FunctionReward

        return FunctionReward(config, on_error=on_error, timeout_s=timeout_s)
    if isinstance(config, RewardModelConfig):
        from rollout.rewards.reward_model import RewardModelReward

        return RewardModelReward(config)
    raise TypeError(f"unknown reward term config {type(config).__name__}")


class RewardScorer:
    """Scores completions with the weighted sum of the configured terms, reporting each term and error counts."""

    def __init__(
        self,
        terms: Sequence[RewardTerm],
        strip_suffixes: Sequence[str] = (),
        overlong: OverlongPenaltyConfig | None = None,
        process: TermProcess | None = None,
    ) -> None:
        """``process``: the one computing the :class:`IsolatedTerm` among ``terms``, closed with the scorer."""
        if not terms:
            raise ValueError("a reward scorer needs at least one term")
        self.terms = list(terms)
        self._suffixes = tuple(s for s in strip_suffixes if s)
        self.overlong = overlong
        self._process = process

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardScorer:
        """Build every term of ``config``: reward models here, the others in a :class:`TermProcess` started and ready
        now. A bad ``module:function`` or reward model path raises ``ValueError`` here."""
        from rollout.rewards.isolation import IsolatedTerm, TermProcess

        isolated = [t for t in config.terms if not isinstance(t, RewardModelConfig)]
        # Built there alone (a module that loads a model at import loads it once), ready before this returns.
        process = TermProcess(isolated, config.on_error, config.timeout_s) if isolated else None
        terms: list[RewardTerm] = []
        try:
            for config_term in config.terms:
                if isinstance(config_term, RewardModelConfig):
                    terms.append(build_term(config_term, config.on_error))
                else:
                    assert process is not None
                    terms.append(IsolatedTerm(process, sum(isinstance(t, IsolatedTerm) for t in terms), config_term))
        except BaseException:
            if process is not None:
                process.close()
            raise
        return cls(terms, strip_suffixes=config.strip_suffixes, overlong=config.overlong, process=process)

    def cpu_lap(self) -> float:
        """CPU seconds the scorer's own process used since the previous lap (0 without one)."""
        return self._process.cpu_lap() if self._process is not None else 0.0

    def close(self) -> None:
        """Stop the scorer's process (idempotent)."""
        if self._process is not None:
            self._process.close()

    @property
    def term_names(self) -> list[str]:
        return [t.name for t in self.terms] + (["overlong"] if self.overlong is not None else [])

    def score(
        self,
        completions: Sequence[str],
        problems: Sequence[Problem],
        num_tokens: Sequence[int] | None = None,
        max_tokens: int | None = None,
    ) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
        """Score ``completions[i]`` against ``problems[i]``.

        ``num_tokens`` (generated tokens per completion) and ``max_tokens`` (the sampling cap) are needed only by the
        overlong penalty, when configured.

        Returns ``(rewards, terms, error_counts)``: the weighted sums, each term's unweighted scores by name, and the
        additive counters ``reward/<name>/num_errors`` and ``reward/num_errors`` (reward means are computed from the
        samples, by ``rollout.metrics.sample_metrics``). A failing user term names the sample by its problem id and
        completion.
        """
        if len(completions) != len(problems):
            raise ValueError(
                f"{len(completions)} completions but {len(problems)} problems; pass one problem per completion"
            )
        texts = [self._strip(c) for c in completions]
        labels = [f"problem {p.problem_id!r} with completion {t[:80]!r}" for t, p in zip(texts, problems)]
        rewards = [0.0] * len(texts)
        terms: dict[str, list[float]] = {}
        metrics: dict[str, float] = {}
        total_errors = 0
        for term in self.terms:
            scores, num_errors = term.score(texts, problems, labels)
            assert len(scores) == len(texts), f"term {term.name} returned {len(scores)} scores for {len(texts)} samples"
            terms[term.name] = scores
            rewards = [r + term.weight * s for r, s in zip(rewards, scores)]
            metrics[f"reward/{term.name}/num_errors"] = float(num_errors)
            total_errors += num_errors
        if self.overlong is not None:
            if num_tokens is None or max_tokens is None or len(num_tokens) != len(texts):
                raise ValueError("reward.overlong needs each completion's token count and the sampling max_tokens")
            penalties = [overlong_penalty(n, max_tokens, self.overlong.cache_tokens) for n in num_tokens]
            terms["overlong"] = penalties
            rewards = [r + self.overlong.weight * p for r, p in zip(rewards, penalties)]
        metrics["reward/num_errors"] = float(total_errors)
        return rewards, terms, metrics

    def _strip(self, completion: str) -> str:
        text = completion.rstrip()
        while self._suffixes:
            for suffix in self._suffixes:
                if text.endswith(suffix):
                    text = text[: -len(suffix)].rstrip()
                    break
            else:
                return text
        return text
