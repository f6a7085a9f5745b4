"""User reward functions given as ``"module:function"``: resolved once at build time, called per sample.

The function is called as ``f(completion: str, problem: Problem)`` and must return a real number. A call that raises
or returns something else is a *user error about one sample*: with ``on_error = "fail"`` it becomes a
:class:`RewardFunctionError` naming the function and the sample; with ``"zero"`` the sample scores 0 for this term
and the error is counted; the first error of each exception type is logged with its traceback and sample, once per
rollout worker (Ray forwards a worker's log to the driver's output).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal

from common.imports import check_import_path, resolve_object
from rollout.rewards.config import FunctionRewardConfig
from rollout.tasks.problem import Problem

__all__ = ["FunctionReward", "RewardFunctionError", "resolve_function"]

RewardFunction = Callable[[str, Problem], float]
log = logging.getLogger("rl_align")


class RewardFunctionError(RuntimeError):
    """A user reward function raised, or returned a non-number, on a sample (which the message names)."""


def resolve_function(spec: str) -> RewardFunction:
    """Import ``"package.module:function"`` and return the callable; ``ValueError`` says which part is missing."""
    check_import_path(spec, "reward function", "my_rewards:length_penalty")
    function = resolve_object(spec, "reward function")
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: {spec.partition(':')[2]!r} is a {type(function).__name__}, not "
                         "a function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a callable Python cannot introspect (a C builtin): called as it is
        return function
    try:
        signature.bind("completion", "problem")
    except TypeError as e:
        raise ValueError(
            f"reward function {spec!r}{signature}: it is called as f(completion, problem) and cannot be ({e})"
        ) from None
    return function


class FunctionReward:
    """A reward term computed by a user function, one call per sample."""

    def __init__(self, config: FunctionRewardConfig, on_error: Literal["fail", "zero"]) -> None:
        self.name = config.term_name
        self.weight = config.weight
        self._spec = config.function
        self._function = resolve_function(config.function)
        self._on_error = on_error
        self._logged: set[str] = set()  # exception types this worker logged: one traceback each, not one per sample

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        scores, num_errors = [], 0
        for completion, problem, label in zip(completions, problems, labels, strict=True):
            try:
                value = _as_reward(self._function(completion, problem))
            except Exception as e:  # noqa: BLE001  (user code: a boundary; re-raised or counted per on_error)
                if self._on_error == "fail":
                    raise RewardFunctionError(
                        f"reward term {self.name!r}: function {self._spec!r} failed on {label}: "
                        f"{type(e).__name__}: {e} (set reward.on_error = 'zero' to score such samples 0 instead)"
                    ) from e
                value, num_errors = 0.0, num_errors + 1
                kind = f"{type(e).__module__}.{type(e).__qualname__}"
                if kind not in self._logged:
                    self._logged.add(kind)
                    log.warning("reward term %r: function %r failed on %s, scored 0 (reward.on_error = 'zero'; "
                                "reward/%s/num_errors counts such samples; this exception type is logged once): "
                                "%s: %s", self.name, self._spec, label, self.name, type(e).__name__, e,
                                exc_info=e)  # fmt: skip
            scores.append(value)
        return scores, num_errors


def _as_reward(value: Any) -> float:
    """``value`` as a reward: a real number, or one a 0-d tensor, a one-element array or a ``Decimal`` holds."""
    if isinstance(value, str | bytes) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise TypeError(f"returned {value!r} of type {type(value).__name__}; a reward function must return a number")
    try:
        # One element of an array or tensor by .item(): numpy deprecates float() of an array with dimensions.
        value = float(value.item() if getattr(value, "size", None) == 1 and hasattr(value, "item") else value)
    except (TypeError, ValueError) as e:  # a tensor of several elements, a complex number
        raise TypeError(f"returned {value!r} of type {type(value).__name__}, which is no single real number ({e}); "
                        "a reward function must return a number") from None
    if not math.isfinite(value):
        raise ValueError(f"returned {value}; a reward must be finite")
    return value
