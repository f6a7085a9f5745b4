"""The built-in environments: a single turn (the default), tool use, and "fix your answer" feedback."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.envs.base import Environment, Message, StepResult, warn_once
from rollout.envs.config import FeedbackEnvConfig, ToolEnvConfig
from rollout.envs.sandbox import SandboxUnavailableError
from rollout.envs.tools import Tool, ToolOutput, build_tool, parse_tool_calls
from rollout.tasks.problem import Problem, chat_messages

__all__ = ["FeedbackEnvironment", "SingleTurnEnvironment", "ToolEnvironment"]

log = logging.getLogger(__name__)


class SingleTurnEnvironment(Environment):
    """The task's prompt, one model turn, done: what a single-turn recipe runs (the reward terms score the turn)."""

    async def reset(self, problem: Problem) -> list[Message]:
        return chat_messages(problem.prompt)

    async def step(self, text: str) -> StepResult:
        return StepResult(done=True)


class ToolEnvironment(Environment):
    """Tool use (see :class:`rollout.envs.config.ToolEnvConfig`): each ``<tool_call>`` of a turn runs, its result is
    a ``tool`` message; a turn without calls ends the episode. Malformed or unknown calls, and tool failures, come
    back as error observations; the episode goes on. A tool's failure is its :class:`~rollout.envs.tools.ToolOutput`
    with ``error`` set, and also a tool that raises or does not return a ``ToolOutput`` (a bug in the tool, not the
    model's mistake): the observation names the tool and what it did, and the first of each kind is logged with its
    traceback.

    ``info``: ``tool_calls``, ``tool_errors`` (malformed, unknown, or failed), ``tool_calls/<name>``, ``tool_s``
    (seconds the tools ran).
    """

    def __init__(self, config: ToolEnvConfig, tools: Sequence[Tool] | None = None) -> None:
        self._config = config
        built = list(tools) if tools is not None else [build_tool(n, config.python) for n in config.tools]
        self._tools = {t.name: t for t in built}
        self.tools = [t.schema() for t in built]

    async def reset(self, problem: Problem) -> list[Message]:
        return chat_messages(problem.prompt, self._config.system_prompt)

    async def step(self, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult(done=True)
        info: dict[str, float] = {"tool_calls": float(len(calls)), "tool_errors": 0.0}
        observation = []
        for i, call in enumerate(calls):
            if i >= self._config.max_calls_per_turn:
                content, error = f"not run: at most {self._config.max_calls_per_turn} tool calls per turn", True
            elif call.error is not None:
                content, error = f"error: {call.error}", True
            elif call.name not in self._tools:
                content, error = f"error: no tool named {call.name!r}; tools: {', '.join(self._tools)}", True
            else:
                start = time.perf_counter()
                content, error = await self._run(self._tools[call.name], call.arguments)
                info["tool_s"] = info.get("tool_s", 0.0) + time.perf_counter() - start
                info[f"tool_calls/{call.name}"] = info.get(f"tool_calls/{call.name}", 0.0) + 1.0
            info["tool_errors"] += float(error)
            observation.append({"role": "tool", "content": _cut(content, self._config.max_observation_chars)})
        return StepResult(observation=observation, info=info)

    async def _run(self, tool: Tool, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        """(text, error) of ``tool`` run on ``arguments``; a tool that raises, or returns anything but a
        :class:`ToolOutput` of text, is an error naming it."""
        try:
            pending = tool.run(arguments)
            if not inspect.isawaitable(pending):
                return self._failed(tool, "sync", f"it returned {type(pending).__name__}, not an awaitable: its run "
                                                  "must be an async function")  # fmt: skip
            start = time.perf_counter()
            try:
                output = await pending
            except asyncio.CancelledError:  # the episode's timeout_s cut it: which tool held the episode is said
                warn_once(log, (type(self), tool.name, "cut"), "%s: the tool %r was still running after %.1f s when "
                          "the episode's timeout_s cut it (env/num_timeouts; said once per tool)",
                          type(self).__qualname__, tool.name, time.perf_counter() - start)  # fmt: skip
                raise
        except SandboxUnavailableError:  # the host's, not the tool's: the episode fails, naming it (nothing ran)
            raise
        except Exception as e:  # the episode's deadline arrives as CancelledError (no Exception): it passes
            return self._failed(tool, type(e).__name__, f"{type(e).__name__}: {e}", e)
        if not isinstance(output, ToolOutput):
            return self._failed(tool, "type", f"it returned {type(output).__name__}, not a "
                                              "rollout.envs.tools.ToolOutput")  # fmt: skip
        if not isinstance(output.text, str):
            return self._failed(tool, "text", f"it returned a ToolOutput whose text is {type(output.text).__name__}, "
                                              "not str")  # fmt: skip
        return output.text, bool(output.error)

    def _failed(self, tool: Tool, kind: str, what: str, error: Exception | None = None) -> tuple[str, bool]:
        """The error observation of ``tool``'s failure ``what``; the first failure of each ``kind`` of this
        environment class's tool is logged (with ``error``'s traceback)."""
        text = f"error: the tool {tool.name!r} failed ({what})"
        warn_once(log, (type(self), tool.name, kind), "%s: %s (the model sees it as an error observation; said once "
                  "per tool and kind of failure)", type(self).__qualname__, text.removeprefix("error: "),
                  exc_info=error)  # fmt: skip
        return text, True


class FeedbackEnvironment(Environment):
    """"Fix your answer" (see :class:`rollout.envs.config.FeedbackEnvConfig`): a wrong answer gets feedback that
    depends on it (for numbers: higher or lower), and another try.

    ``info``: ``wrong_answers``.
    """

    def __init__(self, config: FeedbackEnvConfig) -> None:
        self._config = config
        self._pattern = re.compile(config.extract_pattern) if config.extract_pattern else None
        self._answer = ""
        self._turn = 0

    async def reset(self, problem: Problem) -> list[Message]:
        self._answer = problem.answer.strip()
        return chat_messages(problem.prompt)

    async def step(self, text: str) -> StepResult:
        from rollout.rewards.rules import normalize_answer

        self._turn += 1
        guess = self._extract(text)
        if normalize_answer(guess) == normalize_answer(self._answer) or self._turn >= self._config.max_turns:
            return StepResult(done=True)
        return StepResult(
            observation=[{"role": "user", "content": _feedback(guess, self._answer)}],
            reward=self._config.turn_penalty, info={"wrong_answers": 1.0},
        )  # fmt: skip

    def _extract(self, text: str) -> str:
        if self._pattern is None:
            return text.strip()
        found = self._pattern.findall(text)
        if not found:
            return ""
        last: Any = found[-1]
        return (last if isinstance(last, str) else last[0]).strip()


def _feedback(guess: str, answer: str) -> str:
    try:
        g, a = float(guess), float(answer)
    except ValueError:
        return "That is not right. Try again."
    return f"{guess} is not right: the answer is {'higher' if a > g else 'lower'}. Try again."


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[cut: {len(text) - limit} more characters]"
