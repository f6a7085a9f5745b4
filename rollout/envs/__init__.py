"""Environments: multi-turn episodes (tool use, feedback, a user's own class) and the single-turn case, all run
token-in-token-out by :func:`rollout.envs.episode.run_episode` on the rollout worker's engine."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.imports import resolve_object
from rollout.envs.base import Environment, EpisodeFailed, Message, PromptTooLong, StepResult
from rollout.envs.episode import Episode, EpisodeLimits, run_episode, unplayed_episode

if TYPE_CHECKING:
    from rollout.envs.config import EnvironmentConfig

__all__ = [
    "Environment", "Episode", "EpisodeFailed", "EpisodeLimits", "Message", "PromptTooLong", "StepResult",
    "build_environment",
    "episode_limits", "run_episode", "unplayed_episode",
]  # fmt: skip


def build_environment(config: EnvironmentConfig) -> Callable[[], Environment]:
    """A factory of fresh per-episode environments for ``config``; a custom class is imported and checked here
    (:func:`_check_class`), so what cannot run fails before any episode does (``ValueError`` naming it). An agent
    (``type = "agent"``) is not an environment: :mod:`rollout.agents` runs it."""
    from rollout.envs.builtin import FeedbackEnvironment, SingleTurnEnvironment, ToolEnvironment
    from rollout.envs.config import CustomEnvConfig, FeedbackEnvConfig, SingleTurnEnvConfig, ToolEnvConfig

    if isinstance(config, SingleTurnEnvConfig):
        return SingleTurnEnvironment
    if isinstance(config, ToolEnvConfig):
        return lambda: ToolEnvironment(config)
    if isinstance(config, FeedbackEnvConfig):
        return lambda: FeedbackEnvironment(config)
    if not isinstance(config, CustomEnvConfig):
        raise ValueError(f"environment.type = {config.type!r} runs through rollout.agents, not as an Environment")
    cls = resolve_object(config.class_path, "environment class")
    if not isinstance(cls, type):
        raise ValueError(f"environment class {config.class_path!r} is a {type(cls).__name__}, not a class")
    _check_class(cls, config.class_path)
    options = dict(config.options)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(
            f"environment class {config.class_path!r} cannot take environment.options {sorted(options)}: {e} "
            f"(its signature: {cls.__name__}{inspect.signature(cls)})"
        ) from None
    except ValueError:  # no signature to read (a class built in C): constructed as it is
        pass
    return lambda: cls(**options)


def episode_limits(config: EnvironmentConfig) -> EpisodeLimits:
    """The episode limits ``config`` sets (one turn, no other limit, for the single-turn environment; chat completions
    of an agent)."""
    return EpisodeLimits(config.max_turns, config.max_total_tokens, config.timeout_s)


_METHODS = {"reset": "async def reset(self, problem)", "step": "async def step(self, text)",
            "close": "async def close(self)"}  # fmt: skip


def _check_class(cls: type, spec: str) -> None:
    """``ValueError`` naming ``cls`` (``spec``) unless the episode runner can run it: ``reset`` and ``step`` (and
    ``close``, when it has one) coroutine functions, none left abstract, and ``tools``, when a class attribute, tool
    descriptions (:func:`rollout.envs.tools.check_tool_descriptions`). Nothing of the class runs here: ``tools`` that a
    property computes or the constructor sets are checked as each episode starts."""
    from rollout.envs.tools import check_tool_descriptions

    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment class {spec!r} has no {' or '.join(missing)} method")
    for name, form in _METHODS.items():
        method = getattr(cls, name, None)
        if method is not None and not _is_async(method):
            raise ValueError(f"environment class {spec!r}: {cls.__name__}.{name} is not an async method: write it "
                             f"`{form}` (every episode of a worker runs on one event loop; run blocking work with "
                             "`await asyncio.to_thread(...)`), or, if it returns an awaitable, annotate it so "
                             "(`-> Awaitable[...]`)")  # fmt: skip
    if inspect.isabstract(cls):
        abstract = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ValueError(f"environment class {spec!r} leaves {abstract} abstract: define them")
    tools = inspect.getattr_static(cls, "tools", None)
    if not hasattr(type(tools), "__get__"):  # a value, not a property or method (whose value only an instance has)
        try:
            check_tool_descriptions(tools)
        except ValueError as e:
            raise ValueError(f"environment class {spec!r}: {e}") from None


_AWAITABLE_RETURNS = ("Awaitable", "Coroutine", "Future", "Task")


def _is_async(method: Callable[..., object]) -> bool:
    """Whether calling ``method`` gives an awaitable: an ``async def`` (or a partial of one), also under a decorator
    that keeps it as ``__wrapped__`` (``functools.wraps``), or a method annotated to return one (``-> Awaitable[X]``,
    ``Coroutine``, ``Future``, ``Task``: a ``def`` that hands on another coroutine)."""
    if inspect.iscoroutinefunction(method) or inspect.iscoroutinefunction(inspect.unwrap(method)):
        return True
    returns = getattr(inspect.unwrap(method), "__annotations__", {}).get("return")
    text = returns if isinstance(returns, str) else getattr(returns, "__name__", repr(returns))
    return any(text.startswith(name) or f".{name}" in text for name in _AWAITABLE_RETURNS)
