"""One episode, token in and token out: model turns generated on the engine, observations rendered as chat-template
continuations, and the trajectory the trainer learns from.

A turn's prompt is the exact token ids of everything before it: the first prompt, then every earlier model turn as
the engine generated it (ids, never re-tokenised text) and every observation as
:func:`rollout.tokenizer.render_continuation` renders it (after the template's end-of-turn token when the turn stopped
on another stop token or string, e.g. ``</tool_call>``: the model did not write it, so it is an observation token).
The trajectory is the first prompt plus one completion: model tokens (loss mask 1, the engine's log-probs) and
observation tokens (mask 0) in order, ending with the last model token.

Limits: ``max_turns`` model turns; per turn ``sampling.max_tokens`` tokens; ``max_total_tokens`` after the first
prompt (by default what the engine's context leaves); ``timeout_s`` of wall clock for the whole episode. Hitting one
ends the episode with finish reason ``length``; a timeout aborts the turn in flight (or the tool call) and keeps the
turns complete before it.

The environment runs on the engine's event loop, between its steps: an ``async`` method that blocks (``time.sleep``,
a synchronous HTTP client, a long computation) stalls generation of every episode on the worker, and the deadline,
which can fire only at an ``await``, cannot cut it. So a call that returns at or past the episode's deadline ends
the episode as a timeout all the same (its result is not taken, as that of a call cut at the deadline is not), and a
call that runs :data:`HOLD_WARNING_S` or longer without awaiting is named in a warning (once per environment class
and method), as the agent runner treats an agent that returns past its time; so are many shorter ones that add up
(:data:`BLOCKING_CALL_S`, :data:`BLOCKING_TOTAL_S`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from rollout.config import SamplingConfig
from rollout.envs.base import (
    Environment,
    EpisodeFailed,
    Message,
    PromptTooLong,
    StepResult,
    environment_name,
    warn_once,
)
from rollout.envs.failures import is_own_base_exception
from rollout.envs.tools import check_tool_descriptions
from rollout.metrics import BUILTIN_EPISODE_FIGURES
from rollout.tasks.problem import Problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout.engine.vllm_engine import VLLMEngine
    from rollout.tokenizer import PromptRenderer, Tools

_T = TypeVar("_T")

__all__ = [
    "BLOCKING_CALL_S", "BLOCKING_TOTAL_S", "HOLD_WARNING_S", "Episode", "EpisodeLimits", "render_transcript",
    "run_episode",
]  # fmt: skip

log = logging.getLogger(__name__)

HOLD_WARNING_S = 1.0
"""An environment call that runs this many seconds without awaiting is named in a warning: ten times asyncio's own
mark of a slow step (``loop.slow_callback_duration``, 0.1 s), so what crosses it is blocking I/O, a sleep or a long
computation, not the ordinary cost of a step (a parse, an import, a sandbox process started), and a stall of a second
per call is already a visible share of a batch's generation time."""


BLOCKING_CALL_S = 0.025
"""A call that holds the event loop this long without awaiting blocked (a step's own work takes well under a
millisecond); once such calls of one environment class and method add up to :data:`BLOCKING_TOTAL_S`, a warning says
so."""
BLOCKING_TOTAL_S = 10.0


@dataclass(frozen=True)
class EpisodeLimits:
    """How far an episode may run (see the module docstring)."""

    max_turns: int = 1
    max_total_tokens: int | None = None
    timeout_s: float | None = None


@dataclass
class Episode:
    """A finished episode: its trajectory and what happened in it."""

    prompt_ids: list[int]
    """The first prompt, chat template applied (tools described)."""
    completion_ids: np.ndarray
    """int64: every token after the first prompt, ending with the last model token (empty if no turn completed)."""
    loss_mask: np.ndarray
    """uint8, like ``completion_ids``: 1 on model tokens, 0 on observation tokens."""
    logprobs: np.ndarray
    """float32, like ``completion_ids``: the engine's log-prob of each model token, 0 on observation tokens."""
    final_text: str
    """The last model turn's text (special tokens dropped), which the reward terms score."""
    final_turn_tokens: int
    """Tokens of the last model turn."""
    env_reward: float
    """Sum of the environment's per-turn rewards."""
    finish_reason: str
    """'stop': the environment ended the episode; 'length': a limit ended it."""
    num_turns: int
    """Model turns in the trajectory."""
    policy_versions: list[int]
    """The weights version of each model turn (a turn is of one version; turns may differ in an async run)."""
    timed_out: bool = False
    info: dict[str, float] = field(default_factory=dict)
    """The environment's per-turn ``info`` numbers, summed."""


async def run_episode(
    engine: VLLMEngine,
    render: PromptRenderer,
    env: Environment,
    problem: Problem,
    sampling: SamplingConfig,
    limits: EpisodeLimits,
    seed_of_turn: Callable[[int], int | None],
) -> Episode:
    """Run ``env`` on ``problem`` to the end on ``engine`` (awaited on the engine loop) and return the episode;
    ``render`` turns the environment's first messages into the prompt (its tokenizer renders the rest);
    ``seed_of_turn(t)`` seeds model turn ``t``. The environment is closed whatever happens. Its failures (an
    exception, a ``reset`` that does not return by the deadline, a malformed ``StepResult``, messages or ``tools``)
    raise :class:`EpisodeFailed` naming it; a call that returns past the deadline (it blocked the loop) times the
    episode out, as the deadline does (a ``reset``'s: before the first turn). A prompt the engine's context cannot
    hold raises ``ValueError`` (the dataset's problem, not the episode's), and the engine's own errors propagate as
    they are."""
    try:
        tokenizer = render.tokenizer
        loop = asyncio.get_running_loop()
        deadline = None if limits.timeout_s is None else loop.time() + limits.timeout_s  # reset and turns, together
        what = f"reset of problem {problem.problem_id!r}"
        late = False
        try:
            async with asyncio.timeout_at(deadline):
                messages = await _called(env, "reset", problem, what=what, deadline=deadline)
        except _ReturnedLate as returned:  # its messages make the prompt, and no time is left for a turn
            _say_late(env, returned, limits)
            messages, late = returned.value, True
        except TimeoutError:  # no first messages, so no prompt: nothing to make an episode of
            raise EpisodeFailed(
                f"{environment_name(env)}: {what} did not return within the episode's timeout_s = {limits.timeout_s} s"
            ) from None
        _check_messages(env, "reset()'s messages", messages)
        prompt = render(messages, _tools(env))
        if len(prompt) >= engine.config.max_model_len:
            raise PromptTooLong.of(problem.problem_id, len(prompt), engine.config.max_model_len)
        budget = limits.max_total_tokens or (engine.config.max_model_len - len(prompt))
        trajectory = _Trajectory(prompt)
        try:
            if not late:
                async with asyncio.timeout_at(deadline):
                    await _turns(engine, tokenizer, env, sampling, limits, seed_of_turn, budget, trajectory, deadline,
                                 problem.problem_id)  # fmt: skip
        except _ReturnedLate as returned:
            _say_late(env, returned, limits)
            late = True
        except TimeoutError:
            late = True
        if late:
            trajectory.timed_out, trajectory.finish_reason = True, "length"
        episode = trajectory.episode()
    except BaseException:
        try:
            if hasattr(env, "close"):
                await env.close()
        except Exception as e:  # the episode's own error is the one to report; this one is only said
            log.warning("%s: close raised %s: %s after the episode had failed", environment_name(env),
                        type(e).__name__, e)  # fmt: skip
        raise
    if hasattr(env, "close"):  # optional for a class that does not subclass Environment
        await _called(env, "close")
    return episode


def unplayed_episode(prompt: list[int], timed_out: bool) -> Episode:
    """The episode of ``prompt`` that a limit ended before any model turn (finish reason ``length``): no model
    tokens, so it trains nothing, and its reward counts in its group."""
    trajectory = _Trajectory(prompt)
    trajectory.timed_out, trajectory.finish_reason = timed_out, "length"
    return trajectory.episode()


class _Trajectory:
    """The episode being built: committed model turns (each with the observation that led to it)."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.final_text, self.final_turn_tokens, self.env_reward = "", 0, 0.0
        self.finish_reason, self.timed_out = "stop", False
        self.info: dict[str, float] = {}

    def add_turn(self, observation: list[int], ids: np.ndarray, logprobs: np.ndarray, version: int) -> None:
        self.ids += observation + ids.tolist()
        self.mask += [0] * len(observation) + [1] * len(ids)
        self.logprobs += [0.0] * len(observation) + logprobs.tolist()
        self.versions.append(version)
        self.final_turn_tokens = len(ids)

    def episode(self) -> Episode:
        return Episode(
            prompt_ids=self.prompt, completion_ids=np.asarray(self.ids, np.int64),
            loss_mask=np.asarray(self.mask, np.uint8), logprobs=np.asarray(self.logprobs, np.float32),
            final_text=self.final_text, final_turn_tokens=self.final_turn_tokens, env_reward=self.env_reward,
            finish_reason=self.finish_reason, num_turns=len(self.versions), policy_versions=self.versions,
            timed_out=self.timed_out, info=self.info,
        )  # fmt: skip


async def _turns(
    engine: VLLMEngine,
    tokenizer: PreTrainedTokenizerBase,
    env: Environment,
    sampling: SamplingConfig,
    limits: EpisodeLimits,
    seed_of_turn: Callable[[int], int | None],
    budget: int,
    trajectory: _Trajectory,
    deadline: float | None,
    problem_id: str,
) -> None:
    from common.chat_turns import end_of_turn_id
    from rollout.tokenizer import render_continuation

    observation: list[int] = []  # ids of the observation before the next turn, committed with it
    for turn in range(limits.max_turns):
        left = budget - len(trajectory.ids) - len(observation)
        if left <= 0:
            trajectory.finish_reason = "length"
            if observation:  # a turn's worth of tokens would say nothing: the observation itself ran past
                warn_once(log, (type(env), "observation past the context"),
                          "%s: an observation of %d tokens left no room for another model turn (the episode held %d "
                          "of its %d tokens after the first prompt: environment.max_total_tokens, else what "
                          "rollout.engine.max_model_len leaves); such episodes end as 'length' after their last "
                          "complete turn: shorten the observations or raise the limit", environment_name(env),
                          len(observation), len(trajectory.ids), budget)  # fmt: skip
            return
        turn_sampling = sampling if sampling.max_tokens <= left else sampling.model_copy(update={"max_tokens": left})
        [completion] = await engine.generate_async(
            trajectory.prompt + trajectory.ids + observation, turn_sampling, 1, seed_of_turn(turn)
        )
        trajectory.add_turn(observation, completion.token_ids, completion.logprobs, completion.policy_version)
        trajectory.final_text = str(tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True))
        if completion.finish_reason == "length":
            trajectory.finish_reason = "length"
            return
        what = f"step of problem {problem_id!r} (turn {turn + 1})"
        result = _checked(env, await _called(env, "step", trajectory.final_text, what=what, deadline=deadline))
        trajectory.env_reward += result.reward
        for name, value in result.info.items():
            trajectory.info[name] = trajectory.info.get(name, 0.0) + value
        if result.done:
            return
        if turn == limits.max_turns - 1:
            trajectory.finish_reason = "length"  # the environment wanted another turn
            return
        observation = render_continuation(tokenizer, result.observation, _tools(env))
        eot = end_of_turn_id(tokenizer)
        if len(completion.token_ids) == 0 or int(completion.token_ids[-1]) != eot:
            observation = [eot, *observation]  # stopped on another stop token: the template closes the turn


class _ReturnedLate(Exception):
    """An environment call (``what``, of ``method``) returned ``value`` at or past the episode's deadline, which could
    not cut it: the event loop was held (the call ran ``held_s`` at most without awaiting)."""

    def __init__(self, method: str, what: str, value: Any, held_s: float) -> None:
        super().__init__(what)
        self.method, self.what, self.value, self.held_s = method, what, value, held_s


class _LoopHold(Generic[_T]):
    """Awaits ``awaitable`` as ``await`` does, timing each of its runs between two awaits: ``longest_s`` is how long
    it held the event loop at once (no other episode generated then, and no deadline could fire), ``total_s`` all its
    runs together."""

    def __init__(self, awaitable: Awaitable[_T]) -> None:
        self._awaitable = awaitable
        self.longest_s = 0.0
        self.total_s = 0.0

    def __await__(self) -> Generator[Any, Any, _T]:
        inner = self._awaitable.__await__()
        resume: Callable[[Any], Any] = inner.send
        value: Any = None
        while True:
            start = time.perf_counter()
            try:
                yielded = resume(value)
            except StopIteration as stop:
                return stop.value
            finally:
                held = time.perf_counter() - start
                self.longest_s, self.total_s = max(self.longest_s, held), self.total_s + held
            try:
                value, resume = (yield yielded), inner.send
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as e:  # thrown in by the loop (a cancellation at the deadline): the call's to handle
                value, resume = e, inner.throw


async def _called(
    env: Environment, method: str, *args: object, what: str | None = None, deadline: float | None = None
) -> Any:
    """``await env.<method>(*args)`` (``what``, by default the method's name), which must be a coroutine. An exception
    of the environment's own code, or a method that is not ``async``, is re-raised as :class:`EpisodeFailed` naming
    the environment and the call, so the run's error says whose code failed. A call that returns at or past
    ``deadline`` (the loop's clock) raises :class:`_ReturnedLate` with its value; one that held the event loop for
    :data:`HOLD_WARNING_S` or longer is named in a warning."""
    what = what or method
    hold: _LoopHold[Any] | None = None
    try:
        call = getattr(env, method)(*args)
        if not inspect.isawaitable(call):
            raise TypeError(f"{method} returned {type(call).__name__}, not an awaitable: write it `async def "
                            f"{method}`")  # fmt: skip
        hold = _LoopHold(call)
        value = await hold
    except BaseException as e:  # the episode's deadline arrives as a cancellation of its task: it passes
        if not isinstance(e, Exception) and not is_own_base_exception(e):
            raise
        raise EpisodeFailed(f"{environment_name(env)}: {what} raised {type(e).__name__}: {e}") from e
    finally:
        if hold is not None:
            _add_blocking(env, method, hold.total_s)  # a call that blocks in several pieces counts them all
            if hold.longest_s >= HOLD_WARNING_S:
                _say_once(env, method, "held", "%s: %s held the event loop for %.1f s without awaiting: an "
                          "environment that blocks (time.sleep, a synchronous HTTP client, a long computation) stalls "
                          "generation of every episode on this worker, and no timeout_s can cut it; use async I/O, or "
                          "run the blocking part with `await asyncio.to_thread(...)` (said once per environment class "
                          "and method)", environment_name(env), method, hold.longest_s)  # fmt: skip
    if deadline is not None and asyncio.get_running_loop().time() >= deadline:
        raise _ReturnedLate(method, what, value, hold.longest_s)
    return value


_blocking: dict[tuple[type, str], list[float]] = {}  # (class, method) -> [seconds held in calls that blocked, calls]


def _add_blocking(env: Environment, method: str, held_s: float) -> None:
    """Count a call that held the loop :data:`BLOCKING_CALL_S` or more in all; once such calls of one environment
    class and method add up to :data:`BLOCKING_TOTAL_S`, say so: many short blocking calls (a ``time.sleep(0.05)``
    per step) stall generation as one long one does, each staying under the per-call warning."""
    if held_s < BLOCKING_CALL_S:
        return
    tally = _blocking.setdefault((type(env), method), [0.0, 0])
    tally[0] += held_s
    tally[1] += 1
    if tally[0] >= BLOCKING_TOTAL_S:
        _say_once(env, method, "blocking", "%s: %d calls of %s each held the event loop %.0f ms or more without "
                  "awaiting, %.1f s in all: every episode on this worker stops generating meanwhile; use async I/O, "
                  "or `await asyncio.to_thread(...)` for blocking work (said once per environment class and method)",
                  environment_name(env), tally[1], method, BLOCKING_CALL_S * 1e3, tally[0])  # fmt: skip


def _say_late(env: Environment, returned: _ReturnedLate, limits: EpisodeLimits) -> None:
    _say_once(env, returned.method, "late", "%s: %s returned past the episode's timeout_s = %s s (it ran up to %.1f s "
              "without awaiting): the episode ends as timed out (env/num_timeouts). A deadline fires only at an "
              "await, so an environment that blocked the event loop (this one or another episode's) is not cut at "
              "it, and stalls generation of every episode on this worker: use async I/O, or `await "
              "asyncio.to_thread(...)` for blocking work (said once per environment class and method)",
              environment_name(env), returned.what, limits.timeout_s, returned.held_s)  # fmt: skip


def _say_once(env: Environment, method: str, kind: str, message: str, *args: object) -> None:
    warn_once(log, (type(env), method, kind), message, *args)


def _tools(env: Environment) -> Tools | None:
    """``env.tools`` if it is ``None`` or a list of tool descriptions a chat template takes, else
    :class:`EpisodeFailed` naming the environment and saying what is wrong and what to give. A class that does not
    subclass :class:`Environment` may have no ``tools``: it has none."""
    tools = getattr(env, "tools", None)
    try:
        check_tool_descriptions(tools)
    except ValueError as e:
        raise EpisodeFailed(f"{environment_name(env)}: {e}") from None
    return tools


def _checked(env: Environment, result: object) -> StepResult:
    """``result`` if it is a well-formed :class:`StepResult` (a finite number reward, a mapping of finite info
    numbers, and unless ``done`` a non-empty list of chat messages), else :class:`EpisodeFailed` naming the
    environment: a NaN reward would otherwise reach the loss and turn every weight into NaN."""
    name = environment_name(env)
    if not isinstance(result, StepResult):
        raise EpisodeFailed(f"{name}: step() returned {type(result).__name__}; it must return rollout.envs.StepResult")
    if not isinstance(result.reward, numbers.Real) or isinstance(result.reward, bool):
        raise EpisodeFailed(f"{name}: StepResult.reward is {result.reward!r}; it must be a number")
    if not math.isfinite(result.reward):
        raise EpisodeFailed(f"{name}: StepResult.reward is {result.reward}; a reward must be finite")
    if not isinstance(result.info, Mapping):
        raise EpisodeFailed(f"{name}: StepResult.info is {type(result.info).__name__}; it must map names to numbers")
    for key, value in result.info.items():
        if key in BUILTIN_EPISODE_FIGURES:
            raise EpisodeFailed(f"{name}: StepResult.info[{key!r}] would be reported as env/{key}, one of rl-align's "
                                f"own episode figures ({', '.join(sorted(BUILTIN_EPISODE_FIGURES))}): name it "
                                "otherwise")  # fmt: skip
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise EpisodeFailed(f"{name}: StepResult.info[{key!r}] is {value!r}; info values must be finite numbers")
    if not result.done and (isinstance(result.observation, str) or not isinstance(result.observation, Sequence)):
        raise EpisodeFailed(f"{name}: StepResult.observation is {type(result.observation).__name__}; it must be a "
                            "list of chat messages")  # fmt: skip
    if not result.done and not result.observation:
        raise EpisodeFailed(f"{name}: StepResult has done = False and no observation: give the messages the model "
                            "answers next, or done = True")  # fmt: skip
    if not result.done:
        _check_messages(env, "StepResult.observation", result.observation)
    result.reward = float(result.reward)
    return result


def _check_messages(env: Environment, what: str, messages: object) -> None:
    """:class:`EpisodeFailed` naming the environment unless ``messages`` are well-formed chat messages
    (:func:`rollout.tokenizer.check_prompt`), e.g. ``{'role': 'user', 'content': 'too low'}``."""
    from rollout.tokenizer import check_prompt

    if isinstance(messages, str):
        raise EpisodeFailed(f"{environment_name(env)}: {what} is text; it must be a list of chat messages")
    try:
        check_prompt(messages)  # type: ignore[arg-type]  # what is checked here
    except ValueError as e:
        raise EpisodeFailed(f"{environment_name(env)}: {what}: {e}") from None


def render_transcript(
    tokenizer: PreTrainedTokenizerBase, turns: list[Message], tools: Tools | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(completion ids, loss mask) of an ideal transcript after an episode's first prompt (a supervised warm start),
    laid out exactly as :func:`run_episode` lays out an episode: each ``assistant`` turn is its encoded text plus the
    end-of-turn token (mask 1), the messages between turns are their chat-template continuation (mask 0).
    ``ValueError`` unless the transcript starts and ends with an assistant turn."""
    from common.chat_turns import end_of_turn_id
    from rollout.tokenizer import render_continuation

    if not turns or turns[0].get("role") != "assistant" or turns[-1].get("role") != "assistant":
        raise ValueError("a transcript solution must start and end with an assistant message")
    eot = end_of_turn_id(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    pending: list[Message] = []
    for message in turns:
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        if pending:
            observation = render_continuation(tokenizer, pending, tools)
            ids += observation
            mask += [0] * len(observation)
            pending = []
        turn = list(tokenizer.encode(message["content"], add_special_tokens=False)) + [eot]
        ids += turn
        mask += [1] * len(turn)
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)
