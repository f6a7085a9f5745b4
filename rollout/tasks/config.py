"""Configuration of the prompt source: the built-in arithmetic task or a JSONL file of prompts and reference answers.

``TaskConfig`` is a tagged union on ``type``: ``[task] type = "arithmetic"`` or ``"jsonl"``. No torch import here, so
recipes validate instantly; ``rollout.tasks.build_dataset`` turns a config into a ``PromptDataset``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from common.config import Config, Seed

__all__ = ["ArithmeticTaskConfig", "JsonlTaskConfig", "Operator", "TaskConfig", "arithmetic_capacity"]

Operator = Literal["+", "-", "*"]
"""Arithmetic operators the built-in task can ask about."""


def _default_operators() -> list[Operator]:
    return ["+", "-"]


class ArithmeticTaskConfig(Config):
    """Multi-digit integer arithmetic with exact, verifiable answers (the task of the embedded default recipe).

    A problem is ``a OP b`` with each operand drawn with a uniformly chosen number of digits in
    ``[min_digits, max_digits]``. The ideal completion is the bare result (``"579"``), which a tiny model learns from a
    short supervised warm start and the ``math`` or ``exact_match`` reward checks. Held-out problems are drawn first
    and never appear in the train set.
    """

    type: Literal["arithmetic"] = "arithmetic"
    """Selects this task in a recipe."""
    min_digits: int = pydantic.Field(default=1, ge=1, le=18)
    """Fewest digits of an operand (1 includes 0-9)."""
    max_digits: int = pydantic.Field(default=2, ge=1, le=18)
    """Most digits of an operand."""
    operators: list[Operator] = pydantic.Field(default_factory=_default_operators, min_length=1)
    """Operators to draw from, uniformly; e.g. ["+", "-", "*"]."""
    allow_negative: bool = False
    """If false, subtraction puts the larger operand first so every result is >= 0."""
    num_train_problems: int = pydantic.Field(default=2000, ge=1)
    """Distinct problems in the training set (one epoch)."""
    num_eval_problems: int = pydantic.Field(default=200, ge=0)
    """Distinct held-out problems, disjoint from the training set."""
    prompt_template: str = "What is {a} {op} {b}?"
    """Text of the user message; ``{a}``, ``{op}`` and ``{b}`` are replaced."""
    system_prompt: str | None = None
    """Optional system message placed before the user message."""
    solution_format: Literal["answer", "calculator"] = "answer"
    """The ideal solution a warm start trains on: the bare result, or a transcript that calls the ``calculator`` tool
    on the problem and answers with its result (for ``[environment] type = "tools"``)."""
    seed: Seed = 0
    """Seed of problem generation and of the per-epoch shuffle."""

    @pydantic.field_validator("prompt_template")
    @classmethod
    def _check_template(cls, template: str) -> str:
        try:
            template.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt_template {template!r} is not a valid template ({e!r}); use only the fields {{a}}, {{op}}, "
                "{b} and write literal braces as {{ and }}"
            ) from None
        return template

    @pydantic.model_validator(mode="after")
    def _check_capacity(self) -> ArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits = {self.min_digits} is larger than max_digits = {self.max_digits}")
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators {self.operators} has duplicates; list each operator once")
        wanted = self.num_train_problems + self.num_eval_problems
        capacity = arithmetic_capacity(self)
        # Drawing without replacement by rejection stays fast while at most half of the space is taken.
        if 2 * wanted > capacity:
            raise ValueError(
                f"num_train_problems + num_eval_problems = {wanted} needs at least {2 * wanted} possible problems, but "
                f"digits {self.min_digits}-{self.max_digits} with operators {self.operators} give only {capacity}; "
                "raise max_digits, add operators or ask for fewer problems"
            )
        return self


def arithmetic_capacity(config: ArithmeticTaskConfig) -> int:
    """Number of distinct problems ``config`` can generate."""
    total = 0
    for op in config.operators:
        for da in range(config.min_digits, config.max_digits + 1):
            for db in range(config.min_digits, config.max_digits + 1):
                num_a, num_b = _count_with_digits(da), _count_with_digits(db)
                if op == "-" and not config.allow_negative:
                    # a - b with a < b is asked as b - a, so only pairs with a >= b are distinct problems.
                    if da < db:
                        continue
                    if da == db:
                        total += num_a * (num_a + 1) // 2
                        continue
                total += num_a * num_b
    return total


def _count_with_digits(digits: int) -> int:
    return 10 if digits == 1 else 9 * 10 ** (digits - 1)


class JsonlTaskConfig(Config):
    """Prompts and reference answers read from a JSON-lines file, one problem per line.

    The prompt field holds text (sent as one user message, after ``system_prompt`` if set) or a list of chat messages
    (``[{"role": ..., "content": ...}]``). The held-out set is either a second file (``eval_path``) or the last
    ``num_eval_problems`` lines picked by a shuffle with ``seed``.
    """

    type: Literal["jsonl"] = "jsonl"
    """Selects this task in a recipe."""
    path: str
    """The training file (``.jsonl``): one JSON object per line. Relative paths, here and in every path of a recipe,
    resolve against the directory ``rl_align.py`` runs in (the ``--working-dir`` of ``ray job submit``)."""
    prompt_field: str = "prompt"
    """Key of the prompt (text or a list of chat messages)."""
    answer_field: str = "answer"
    """Key of the reference answer (a string or number) the rewards compare against."""
    id_field: str | None = None
    """Optional key of a stable problem id; by default the id is ``<file name>:<line number>``."""
    solution_field: str | None = None
    """Optional key of an ideal completion for a supervised warm start (text, or a transcript: chat messages from the
    first assistant turn to the last, tool turns between); by default the answer is used."""
    system_prompt: str | None = None
    """Optional system message put before text prompts (ignored for prompts that already are message lists)."""
    eval_path: str | None = None
    """Optional held-out file with the same fields; exclusive with ``num_eval_problems`` (``false`` drops a base
    recipe's, so a ``num_eval_problems`` split can replace it)."""
    num_eval_problems: int = pydantic.Field(default=0, ge=0)
    """Lines of ``path`` set aside (after a seeded shuffle) as the held-out set when there is no ``eval_path``."""
    seed: Seed = 0
    """Seed of the held-out split and of the per-epoch shuffle."""


    @pydantic.model_validator(mode="after")
    def _check_split(self) -> JsonlTaskConfig:
        if self.eval_path is not None and self.num_eval_problems > 0:
            raise ValueError(
                "set either eval_path (a separate held-out file) or num_eval_problems (split from path), not both "
                "(eval_path = false drops one a base recipe set)"
            )
        return self


TaskConfig = Annotated[ArithmeticTaskConfig | JsonlTaskConfig, pydantic.Field(discriminator="type")]
"""The prompt source of a recipe, chosen by ``type``: 'arithmetic' or 'jsonl'."""
