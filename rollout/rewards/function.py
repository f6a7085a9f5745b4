"""User reward functions given as ``"module:function"``: resolved once at build time, called per sample.

The function is called as ``f(completion: str, problem: Problem)`` and must return a real number; an ``async def``
function is awaited, ``max_concurrency`` calls at a time, each under ``reward.timeout_s`` (a plain function's calls
are timed by the process that runs them, :mod:`rollout.rewards.isolation`). A call that raises, returns something
else or times out is a *user error about one sample*: with ``on_error = "fail"`` it becomes a
:class:`RewardFunctionError` naming the function and the sample; with ``"zero"`` the sample scores 0 for this term
and the error is counted; the first error of each exception type is logged with its traceback and sample, once per
rollout worker (Ray forwards a worker's log to the driver's output).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, cast

from common.imports import check_import_path, resolve_object
from rollout.rewards.config import FunctionRewardConfig
from rollout.tasks.problem import Problem

__all__ = [
    "ON_ERROR_HINT",
    "FunctionReward",
    "RewardFunctionError",
    "failure_message",
    "is_async_function",
    "resolve_function",
]

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

    def __init__(
        self, config: FunctionRewardConfig, on_error: Literal["fail", "zero"], timeout_s: float | None = None
    ) -> None:
        """``timeout_s``: the limit of one call of an ``async def`` function (None: none)."""
        self.name = config.term_name
        self.weight = config.weight
        self._spec = config.function
        self._function = resolve_function(config.function)
        self.is_async = is_async_function(self._function)
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._logged: set[str] = set()  # exception types this worker logged: one traceback each, not one per sample

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        if self.is_async:  # awaited, many at once, by the reward process's event loop
            raise TypeError(f"{self._spec!r} is an async function: :func:`call_async` each sample on an event loop")
        scored = [self.call(c, p, label) for c, p, label in zip(completions, problems, labels, strict=True)]
        return [value for value, _ in scored], sum(errors for _, errors in scored)

    def call(self, completion: str, problem: Problem, label: str) -> tuple[float, int]:
        """One sample's (score, errors) by a plain function (see the module docstring for errors)."""
        try:
            return _as_reward(self._function(completion, problem)), 0
        except Exception as e:  # noqa: BLE001  (user code: a boundary; re-raised or counted per on_error)
            return self.failed(e, label), 1

    async def call_async(self, completion: str, problem: Problem, label: str) -> tuple[float, int]:
        """One sample's (score, errors) by an ``async def`` function, cancelled after ``timeout_s``."""
        function = cast("Callable[[str, Problem], Awaitable[Any]]", self._function)
        try:
            return _as_reward(await asyncio.wait_for(function(completion, problem), self._timeout_s)), 0
        except TimeoutError:
            why = (f"no result within reward.timeout_s = {self._timeout_s:g} s (raise it or make the function "
                   "faster); the call was cancelled")  # fmt: skip
            return self.failed(TimeoutError(why), label), 1
        except Exception as e:  # noqa: BLE001  (user code: a boundary; re-raised or counted per on_error)
            return self.failed(e, label), 1

    def failed(self, error: BaseException, label: str) -> float:
        """The score of a sample the function failed on: raises :class:`RewardFunctionError` under ``on_error =
        "fail"``, else logs the first failure of each exception type with its traceback and returns 0."""
        cause = f"{type(error).__name__}: {error}"
        if self._on_error == "fail":
            raise RewardFunctionError(failure_message(self.name, self._spec, label, cause)) from error
        kind = f"{type(error).__module__}.{type(error).__qualname__}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("reward term %r: function %r failed on %s, scored 0 (reward.on_error = 'zero'; "
                        "reward/%s/num_errors counts such samples; this exception type is logged once): %s",
                        self.name, self._spec, label, self.name, cause, exc_info=error,
                        extra={"once": f"{self.name}:{kind}"})  # fmt: skip
        return 0.0


ON_ERROR_HINT = " (set reward.on_error = 'zero' to score such samples 0 instead)"
"""The end of :func:`failure_message`: what to set instead of stopping."""


def failure_message(term: str, spec: str, label: str, cause: str) -> str:
    """What a run stopped by a user function's failure on a sample says (``reward.on_error = "fail"``)."""
    return f"reward term {term!r}: function {spec!r} failed on {label}: {cause}{ON_ERROR_HINT}"


def is_async_function(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` returns a coroutine to await (an ``async def`` function, or an object whose
    ``__call__`` is one)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(type(function).__call__)


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
