"""Configuration of the environment episodes run in: a tagged union on ``type``, like tasks and rewards.

In a recipe::

    [environment]
    type = "tools"                 # "single_turn" (the default), "tools", "feedback", "custom" or "agent"
    tools = ["calculator"]
    max_turns = 3

No torch import here, so recipes validate instantly; :func:`rollout.envs.build_environment` turns a config into a
factory of per-episode environments.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

from common.config import Config
from common.imports import check_import_path

__all__ = [
    "BUILTIN_TOOLS", "ENVIRONMENT_TERM", "AgentEnvConfig", "CustomEnvConfig", "EnvironmentConfig", "FeedbackEnvConfig",
    "PythonToolConfig", "SingleTurnEnvConfig", "ToolEnvConfig", "ToolName",
]  # fmt: skip

ENVIRONMENT_TERM = "environment"
"""The reward term a multi-turn episode's own reward goes under (an environment's rewards, an agent's returned
number), beside the ``[reward.terms]``: ``reward/environment/mean``, a dynamic-sampling filter term."""

BUILTIN_TOOLS = ("calculator", "python")
"""Built-in tools: ``calculator`` (arithmetic on numbers, evaluated in process without ``eval``: pure and bounded) and
``python`` (a program run in the out-of-process sandbox, :mod:`rollout.envs.sandbox`)."""


def _check_tool(name: str) -> str:
    if name in BUILTIN_TOOLS:
        return name
    if ":" not in name:
        raise ValueError(f"tool {name!r}: name a built-in tool ({', '.join(BUILTIN_TOOLS)}) or your own as "
                         "'package.module:name' of a rollout.envs.tools.Tool")  # fmt: skip
    return check_import_path(name, "tool", "my_tools:convert")


ToolName = Annotated[str, pydantic.AfterValidator(_check_tool)]
"""A tool of a recipe: a built-in one (:data:`BUILTIN_TOOLS`) or ``"package.module:name"`` of a
``rollout.envs.tools.Tool`` (or a function returning one) of the user's, importable on the rollout workers and the
driver (``rollout.envs.tools.build_tool``)."""


class SingleTurnEnvConfig(Config):
    """One model turn per episode: the task's prompt, one completion, scored by the reward terms (the default)."""

    type: Literal["single_turn"] = "single_turn"
    """Selects this environment."""

    @property
    def max_turns(self) -> int:
        return 1

    @property
    def max_total_tokens(self) -> int | None:
        return None

    @property
    def timeout_s(self) -> float | None:
        return None

    @property
    def max_failed_fraction(self) -> float:
        return 0.0


class _MultiTurnConfig(Config):
    max_turns: int = pydantic.Field(default=4, ge=1)
    """Most model turns of an episode; the episode ends after the last (finish reason ``length`` if the environment
    wanted more)."""
    max_total_tokens: int | None = pydantic.Field(default=None, ge=1)
    """Most tokens after the first prompt (model turns and observations); a turn is cut to what is left and the
    episode ends with finish reason ``length``. ``None``: the engine's ``max_model_len`` minus the prompt."""
    timeout_s: float | None = pydantic.Field(default=None, gt=0)
    """Wall-clock limit of one episode: when it passes, the turn in flight is aborted, the episode keeps what was
    complete before it and ends with finish reason ``length``. ``None``: no limit."""
    max_failed_fraction: float = pydantic.Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of a rollout request's episodes (a training batch, an evaluation; a dynamic-sampling refill has its
    step batch's budget) whose own code may fail (the environment or agent raised, hung in ``reset``, returned
    malformed results or messages, failed to close) and be dropped, each logged with its traceback and counted in
    ``env/num_failed_episodes``. One more fails the batch: at once, stopping the other episodes, when one worker's
    share of the batch alone has that many, else when the share that brings the sum over it finishes. A group left
    with too few episodes to compare (two for group-relative advantages) is dropped whole
    (:mod:`rollout.envs.failures`). 0: any failure fails the batch (a bug to fix); set it for environments that fail
    now and then (a remote sandbox, a flaky tool server), knowing the episodes they fail on may not be a random
    subset."""


class PythonToolConfig(Config):
    """Limits of one call of the ``python`` tool (the sandbox's)."""

    wall_s: float = pydantic.Field(default=5.0, gt=0)
    """Wall-clock seconds before the program (and all it started) is killed."""
    cpu_s: float = pydantic.Field(default=5.0, gt=0)
    """CPU seconds (``RLIMIT_CPU``)."""
    memory_mib: int = pydantic.Field(default=512, ge=16)
    """Address space of each process (``RLIMIT_AS``), MiB."""
    max_output_bytes: int = pydantic.Field(default=16 << 10, ge=64)
    """stdout + stderr kept for the observation; beyond it the output is cut."""
    max_processes: int = pydantic.Field(default=16, ge=1)
    """Processes the program may have at once (``RLIMIT_NPROC``)."""
    max_concurrent: int = pydantic.Field(default=4, ge=1)
    """Programs one rollout worker runs at once; more calls wait for a slot (the wait is not part of ``wall_s``, but is
    of the episode's ``timeout_s``), so a batch of episodes calling together cannot start more processes (and memory)
    than this many calls' limits."""


class ToolEnvConfig(_MultiTurnConfig):
    """Tool use in the Qwen / Hermes format: the model writes ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>``, each call's result comes back as a ``tool`` message, and a turn without a call is the final answer
    (which the reward terms score). The tools are described to the model by the tokenizer's chat template."""

    type: Literal["tools"] = "tools"
    """Selects this environment."""
    tools: list[ToolName] = pydantic.Field(default_factory=lambda: ["calculator"], min_length=1)
    """Tools the model may call: built-in ones by name, your own by ``"package.module:name"`` (:data:`ToolName`)."""
    system_prompt: str | None = None
    """System message before the task's prompt (the template adds the tool descriptions)."""
    max_calls_per_turn: int = pydantic.Field(default=4, ge=1)
    """Calls one turn may make; more are answered with an error observation and not run."""
    max_observation_chars: int = pydantic.Field(default=2000, ge=16)
    """A tool result longer than this is cut (the observation says so)."""
    python: PythonToolConfig = PythonToolConfig()
    """Limits of the ``python`` tool."""

    @pydantic.field_validator("tools")
    @classmethod
    def _unique(cls, tools: list[ToolName]) -> list[ToolName]:
        if len(set(tools)) != len(tools):
            raise ValueError(f"tools {tools} has duplicates; list each tool once")
        return tools


class FeedbackEnvConfig(_MultiTurnConfig):
    """"Fix your answer": after a wrong answer the model is told so (for numbers: whether the answer is higher or lower
    than its guess) and tries again, until it is right or ``max_turns`` is spent. The feedback depends on the previous
    answer, so a policy can learn to use it."""

    type: Literal["feedback"] = "feedback"
    """Selects this environment."""
    max_turns: int = pydantic.Field(default=3, ge=1)
    """Most answers the model may give."""
    turn_penalty: float = pydantic.Field(default=0.0, le=0.0)
    """Reward added for every wrong answer before the last turn (<= 0), so fewer tries score higher."""
    extract_pattern: str | None = None
    """Optional regex picking the answer out of a turn (group 1 if it has one); by default the whole turn."""


class CustomEnvConfig(_MultiTurnConfig):
    """A user environment: a subclass of ``rollout.envs.Environment`` (or any class with its methods)."""

    type: Literal["custom"] = "custom"
    """Selects this environment."""
    class_path: str
    """``"package.module:Class"``, importable on the rollout workers (put its directory on ``PYTHONPATH`` or ship it
    with ``ray job submit --working-dir``)."""
    options: dict[str, Any] = {}
    """Keyword arguments of the class, given to every episode's instance."""

    @pydantic.field_validator("class_path")
    @classmethod
    def _check_path(cls, path: str) -> str:
        return check_import_path(path, "class_path", "my_envs:GuessNumber")


class AgentEnvConfig(_MultiTurnConfig):
    """A user's agent (any program that talks to an OpenAI-compatible server) trained as it runs: an async function
    ``module:function`` gets an :class:`rollout.agents.AgentContext` (a ``base_url`` served by the rollout worker on
    its engine, the problem) and the ``options`` table as keyword arguments, makes chat-completion calls (tool calls
    included), and returns a number added to the reward terms (or ``None``). The worker records the exact ids and
    log-probs of every call and builds the trajectory from them (:mod:`rollout.agents`).

    ``max_turns`` bounds the chat completions of one episode; ``max_total_tokens`` how far the conversation may grow
    after the first call's prompt; ``timeout_s`` the whole agent call (the episode keeps the calls finished by then)."""

    type: Literal["agent"] = "agent"
    """Selects this environment."""
    function: str
    """``"package.module:function"``: an ``async def f(context, **options) -> float | None``, importable on the
    rollout workers."""
    options: dict[str, Any] = {}
    """Keyword arguments of the function, the same for every episode."""
    model_name: str = "policy"
    """The model name the endpoint lists and answers as (requests may name any model: there is one)."""
    warm_start_tools: list[ToolName] = []
    """The agent's own prompts are not known before it runs, so a supervised warm start renders the task's prompts
    as the ``tools`` environment does with these tools described (built-in ones by name, your own by
    ``"package.module:name"``: :data:`ToolName`; ``[]``: as the single-turn environment does). An agent that sends
    the task's messages with the same tool schemas (``rollout.envs.tools.build_tool(name).schema()``) then starts
    from the prompts it was warm-started on."""

    @pydantic.field_validator("function")
    @classmethod
    def _check_path(cls, path: str) -> str:
        return check_import_path(path, "function", "my_agents:solve")


EnvironmentConfig = Annotated[
    SingleTurnEnvConfig | ToolEnvConfig | FeedbackEnvConfig | CustomEnvConfig | AgentEnvConfig,
    pydantic.Field(discriminator="type"),
]
"""The environment of a recipe, chosen by ``type``: 'single_turn', 'tools', 'feedback', 'custom' or 'agent'."""
