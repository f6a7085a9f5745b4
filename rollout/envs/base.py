"""The environment interface: what turns a problem into an episode of model turns and observations.

An environment instance lives for one episode. The episode runner (:mod:`rollout.envs.episode`) calls :meth:`reset`
once, then, after every model turn, :meth:`step` with that turn's text, until ``done`` or a limit; :meth:`close` always
runs at the end. Environments see and return text (chat messages); the runner owns the token ids, so what the model
generated is never re-tokenised.

A user environment is a class with these methods, named in the recipe as ``[environment] type = "custom"``,
``class_path = "my_pkg.envs:MyEnv"``; it is constructed with the recipe's ``options`` table as keyword arguments, once
per episode, on the rollout worker. Its methods are coroutine functions (``async def``; a plain ``def`` not
annotated to return an awaitable is refused when the recipe is loaded), run on the engine's event loop: one that
blocks it (``time.sleep``, a synchronous HTTP client) stalls generation of every episode on the worker, so blocking
work belongs in ``await asyncio.to_thread(...)``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.tasks.problem import Problem

__all__ = [
    "Environment", "EpisodeFailed", "Message", "StepResult", "environment_name", "said_once", "warn_once",
]  # fmt: skip

_warned: set[Hashable] = set()


def environment_name(env: object) -> str:
    """How errors and warnings name an environment instance: ``environment <module>:<Class>``."""
    return f"environment {type(env).__module__}:{type(env).__qualname__}"


def said_once(key: Hashable) -> bool:
    """Whether :func:`warn_once` has said its warning of ``key`` in this process."""
    return key in _warned


def warn_once(
    logger: logging.Logger, key: Hashable, message: str, *args: object, exc_info: BaseException | None = None
) -> None:
    """Log ``message`` (``%``-formatted with ``args``) as a warning the first time this process sees ``key``: an
    environment's recurring fault is said once (keyed by its class and what failed), not once per episode."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args, exc_info=exc_info)


class PromptTooLong(ValueError):
    """A problem's prompt leaves the engine no room for a completion: a data or setting problem, not an episode's
    failure, so it stops the batch whatever ``max_failed_fraction`` allows. Built by :meth:`of`."""

    @classmethod
    def of(cls, problem_id: str, num_tokens: int, max_model_len: int) -> PromptTooLong:
        return cls(f"problem {problem_id!r}: its prompt is {num_tokens} tokens, and the engine holds "
                   f"rollout.engine.max_model_len = {max_model_len} (prompt and completion); raise max_model_len (a "
                   "resumed run may), or shorten such prompts (a run resumes only on the task data it started "
                   "with)")  # fmt: skip


class EpisodeFailed(RuntimeError):
    """An episode's own code failed (the environment's or the agent function's: an exception, a malformed
    ``StepResult``, a hung ``reset``), so the episode has no trajectory. The message names whose code and the problem.
    Whether the batch goes on without the episode is ``environment.max_failed_fraction``'s decision
    (:func:`rollout.envs.failures.drop_failed`); an engine's failure is never one of these."""


Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": ...}``."""


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: list[Message] = field(default_factory=list)
    """Messages the model sees before its next turn (tool results as role ``"tool"``, feedback as ``"user"``); empty
    when ``done``."""
    reward: float = 0.0
    """This turn's reward; an episode's reward is the sum over its turns plus the recipe's reward terms, which score
    the final model turn."""
    done: bool = False
    """The episode ends here (no further model turn)."""
    info: dict[str, float] = field(default_factory=dict)
    """Numbers summed over the episodes of a batch into ``env/<name>`` metrics (e.g. ``tool_calls``)."""


class Environment(ABC):
    """One episode's environment; see the module docstring."""

    tools: Sequence[Mapping[str, Any]] | None = None
    """Tools the chat template describes to the model, or ``None``: JSON-schema descriptions ``{"type": "function",
    "function": {"name": ..., "description": ..., "parameters": {...}}}`` (``Tool.schema()`` of a
    :class:`rollout.envs.tools.Tool`), as :func:`rollout.tokenizer.check_tools` checks them when an episode starts and
    at each turn."""

    @abstractmethod
    async def reset(self, problem: Problem) -> list[Message]:
        """The episode's first messages (system and user) for ``problem``."""

    @abstractmethod
    async def step(self, text: str) -> StepResult:
        """React to the model's turn ``text`` (its decoded tokens, special tokens dropped)."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the episode held (processes, files); called once, also after errors and timeouts."""
