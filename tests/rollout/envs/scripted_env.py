"""Environments for tests: their observations do not depend on what a random tiny model writes."""

from __future__ import annotations

from typing import ClassVar

from rollout.envs import Environment, Message, StepResult
from rollout.envs.builtin import ToolEnvironment
from rollout.envs.config import ToolEnvConfig
from rollout.envs.tools import Tool, build_tool
from rollout.tasks.problem import Problem, chat_messages


class EchoObservations(Environment):
    """Answers every model turn with a tool message naming the turn, until ``turns`` model turns are done; the
    last turn's reward is ``reward``."""

    def __init__(self, turns: int = 3, reward: float = 0.0) -> None:
        self._turns, self._reward, self._turn = turns, reward, 0
        self.closed = False

    async def reset(self, problem: Problem) -> list[Message]:
        return chat_messages(problem.prompt)

    async def step(self, text: str) -> StepResult:
        self._turn += 1
        if self._turn >= self._turns:
            return StepResult(done=True, reward=self._reward)
        return StepResult(observation=[{"role": "tool", "content": f"result {self._turn}: 12 * 34 = 408"}],
                          info={"echoes": 1.0})

    async def close(self) -> None:
        self.closed = True


class FailsSome(EchoObservations):
    """:class:`EchoObservations` whose first ``fail[problem_id]`` episodes of a problem (in the order they reset) raise
    in their first step; ``resets`` counts the resets per problem, shared by the episodes of one batch."""

    def __init__(self, fail: dict[str, int], resets: dict[str, int], turns: int = 2) -> None:
        super().__init__(turns=turns)
        self._fail, self._resets, self._fails = fail, resets, False

    async def reset(self, problem: Problem) -> list[Message]:
        seen = self._resets[problem.problem_id] = self._resets.get(problem.problem_id, 0) + 1
        self._fails = seen <= self._fail.get(problem.problem_id, 0)
        return await super().reset(problem)

    async def step(self, text: str) -> StepResult:
        if self._fails:
            raise ConnectionError("the tool server went away")
        return await super().step(text)


class FailsWhereTold(EchoObservations):
    """:class:`EchoObservations` that raises in ``reset`` for every episode of a problem whose id starts with ``fail``,
    and for the first episode of one whose id starts with ``half`` to reset in this process: which episodes fail is
    decided by the problems alone (not by what the model writes), in any process (a pool's workers)."""

    _seen: ClassVar[set[str]] = set()

    async def reset(self, problem: Problem) -> list[Message]:
        first = problem.problem_id not in self._seen
        self._seen.add(problem.problem_id)
        if problem.problem_id.startswith("fail") or (problem.problem_id.startswith("half") and first):
            raise ConnectionError("the sandbox went away")
        return await super().reset(problem)


class FailsEveryEpisode(EchoObservations):
    """Raises in every ``reset``: a sandbox that is down."""

    async def reset(self, problem: Problem) -> list[Message]:
        raise ConnectionError("the sandbox is down")


class ScriptedToolCalls(ToolEnvironment):
    """The tool environment, but each turn makes the scripted call instead of reading the model's text (turn ``i``
    uses ``script[i]``; past the script, the turn is the final answer)."""

    def __init__(self, config: ToolEnvConfig, script: list[str], tools: list[Tool] | None = None) -> None:
        super().__init__(config, tools)
        self._script, self._turn = script, 0

    async def step(self, text: str) -> StepResult:
        turn, self._turn = self._turn, self._turn + 1
        return await super().step(self._script[turn] if turn < len(self._script) else text)


class Returns(Environment):
    """Answers the first model turn with ``value``, whatever it is (a malformed ``StepResult`` for the checks)."""

    def __init__(self, value: object) -> None:
        self._value = value
        self.closed = False

    async def reset(self, problem: Problem) -> list[Message]:
        return chat_messages(problem.prompt)

    async def step(self, text: str) -> StepResult:
        return self._value  # type: ignore[return-value]

    async def close(self) -> None:
        self.closed = True


class SynchronousStep(EchoObservations):
    """``def step`` where ``async def step`` belongs (refused when the recipe is loaded)."""

    def step(self, text: str) -> StepResult:  # type: ignore[override]
        return StepResult(done=True)


class SynchronousReset(EchoObservations):
    """``def reset`` where ``async def reset`` belongs (refused when the recipe is loaded)."""

    def reset(self, problem: Problem) -> list[Message]:  # type: ignore[override]
        return chat_messages(problem.prompt)


class DescribesToolObjects(EchoObservations):
    """Describes its tools as :class:`Tool` objects, not their JSON schemas (``Tool.schema()``)."""

    tools = [build_tool("calculator")]  # type: ignore[assignment]
