"""Environments the warm-start tests name by ``module:Class`` (the warm start builds its own instances)."""

from __future__ import annotations

from typing import ClassVar

from rollout.envs import Environment, Message, StepResult
from rollout.envs.tools import Tool, ToolOutput
from rollout.tasks.problem import Problem, chat_messages


class CountsCloses(Environment):
    """Counts the instances closed (``closed``), as a user's environment releasing a sandbox would."""

    closed: ClassVar[int] = 0

    async def reset(self, problem: Problem) -> list[Message]:
        return chat_messages(problem.prompt)

    async def step(self, text: str) -> StepResult:
        return StepResult(done=True)

    async def close(self) -> None:
        CountsCloses.closed += 1  # one count for every subclass


class ResetFailsOnTheSecond(CountsCloses):
    """Its reset raises on the problem whose id is "1"."""

    async def reset(self, problem: Problem) -> list[Message]:
        if problem.problem_id == "1":
            raise ConnectionError("the sandbox is down")
        return await super().reset(problem)


class ToolObjects(CountsCloses):
    """Gives its tools as ``Tool`` objects instead of their descriptions (``Tool.schema()``)."""

    def __init__(self) -> None:
        async def run(arguments: dict) -> ToolOutput:
            return ToolOutput("1")

        self.tools = [Tool("one", "Says 1.", {"type": "object", "properties": {}}, run)]


class FailsToConstruct(CountsCloses):
    def __init__(self) -> None:
        raise OSError("no sandbox")
