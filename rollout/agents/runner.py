"""Running a user's agent function once per episode against the worker's endpoint, and what each run leaves.

The agent functions run on an event loop of their own (the "agents" thread), not the engine's: an agent that blocks
(a slow tool, synchronous code) stalls other agents, never generation. Each episode gets a fresh base URL
(:class:`~rollout.agents.server.AgentEndpoint`); when the function returns, times out or fails, the URL is closed and
the recorded calls become the episode's samples (:func:`rollout.agents.trajectory.assemble`).

An agent's returned number is the episode's environment reward (added to the recipe's reward terms, which score the
last call's text, as for any environment); ``None`` adds nothing. A timeout (``environment.timeout_s``) keeps the calls
finished by then, adds nothing, and ends the episode with finish reason ``length`` (also when the agent returns past
its time: it caught the cancellation, or blocked the loop), as does an agent that ended on the error of a call the
endpoint refused for an episode limit (its client's 400, an error raised from it or while handling it, a task group's
error holding it). Such an episode without a finished call (its first call refused for the context, or still in
flight at the timeout) is a sample with no model tokens (the problem's prompt, rendered as the endpoint renders calls;
:func:`rollout.envs.unplayed_episode`) whose reward (the agent's number, if it returned one, and the reward terms of
an empty text) counts in its group, as a built-in environment's episode that timed out before its first turn. Any
other error of the agent (one in its own code after it caught a refusal included) fails the episode
(:class:`~rollout.envs.EpisodeFailed`, naming the function and the problem), as does an agent that returns without a
call or returns something other than a number or ``None``; the batch then fails, unless
``environment.max_failed_fraction`` lets it go on without the episode (:mod:`rollout.envs.failures`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.imports import resolve_object
from rollout.agents.server import LIMIT_CODES, AgentEndpoint, EpisodeCalls
from rollout.agents.trajectory import assemble
from rollout.envs import Episode, EpisodeFailed, episode_limits, unplayed_episode
from rollout.envs.failures import FailureBudget, is_own_base_exception, run_all
from rollout.metrics import episode_metrics
from rollout.sampling import turn_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout.config import SamplingConfig
    from rollout.engine.vllm_engine import VLLMEngine
    from rollout.envs.config import AgentEnvConfig
    from rollout.tasks.problem import Problem

__all__ = ["AgentContext", "AgentOutcome", "AgentRunner", "agent_metrics", "load_agent_function"]

AgentFunction = Callable[..., Awaitable[float | None]]


@dataclass(frozen=True)
class AgentContext:
    """What an agent function gets for one episode."""

    base_url: str
    """OpenAI-compatible base URL of this episode, e.g. ``openai.AsyncOpenAI(base_url=ctx.base_url,
    api_key=ctx.api_key)``; it answers while the episode runs."""
    api_key: str
    """Any key works (the server is on loopback and the URL is the episode's secret); clients insist on one."""
    model: str
    """The model name to ask for."""
    problem: Problem
    """The task's problem: ``prompt`` (text or messages), ``answer``, ``metadata``."""
    sample_index: int
    """Which sample of its group this episode is (0 .. group_size - 1)."""


@dataclass
class AgentOutcome:
    """One finished agent episode."""

    episodes: list[Episode]
    """Its segments (one per training sample), in order; the last one's text is the episode's final answer."""
    reward: float
    """The agent's returned number (0 when it returned ``None``, timed out or stopped at a limit)."""
    timed_out: bool
    stopped_at_limit: bool
    """The endpoint refused a call for an episode limit."""
    num_calls: int
    num_ignored_sampling: int
    num_unknown_params: int = 0
    num_splits: int = 0
    """Calls whose prompt did not extend the conversation so far (``rollout.agents.trajectory.Assembled``)."""


def load_agent_function(spec: str, options: Mapping[str, Any] | None = None) -> AgentFunction:
    """Import the agent function ``spec`` (``module:function``); ``ValueError`` unless it is an ``async def`` that
    takes ``(context, **options)`` (``environment.options``; none when ``options`` is ``None``)."""
    function = resolve_object(spec, "agent function")
    target = function.func if isinstance(function, functools.partial) else function
    if not inspect.iscoroutinefunction(target):
        raise ValueError(
            f"agent function {spec!r} is not an async function (`async def f(context, **options)`); the worker runs "
            "many episodes at once on one event loop"
        )
    try:
        signature = inspect.signature(function)
    except ValueError:  # no signature to read: called as it is
        return function
    given = dict(options or {})
    try:
        signature.bind(None, **given)
    except TypeError as e:
        raise ValueError(
            f"agent function {spec!r} cannot be called as f(context, **environment.options) with options "
            f"{sorted(given)}: {e} (its signature: {getattr(target, '__name__', spec)}{signature}); change "
            "environment.options or the function's parameters"
        ) from None
    return function


class AgentRunner:
    """Runs episodes of the agent ``config`` names on ``engine``; see the module docstring."""

    def __init__(self, config: AgentEnvConfig, engine: VLLMEngine, tokenizer: PreTrainedTokenizerBase) -> None:
        self._spec = config.function
        self._function = load_agent_function(config.function, config.options)
        self._options = dict(config.options)
        self._limits = episode_limits(config)
        self.engine = engine
        self.endpoint = AgentEndpoint(engine, tokenizer, config.model_name)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agents", daemon=True)
        self._thread.start()

    def run(
        self, jobs: Sequence[tuple[Problem, int, int]], sampling: SamplingConfig, budget: FailureBudget | None = None
    ) -> list[AgentOutcome | EpisodeFailed]:
        """One episode per ``(problem, group_id, sample_index)``, all at once; outcomes in job order, with the episodes
        the agent failed (:class:`~rollout.envs.EpisodeFailed`) that ``budget`` (default: none) lets go. The failure
        beyond it, or an engine's error, raises and stops the other episodes."""
        if budget is None:
            budget = FailureBudget(len(jobs), 0.0)
        episodes = [self._episode(p, g, k, sampling) for p, g, k in jobs]
        return asyncio.run_coroutine_threadsafe(run_all(episodes, budget), self._loop).result()

    async def _episode(
        self, problem: Problem, group_id: int, sample_index: int, sampling: SamplingConfig
    ) -> AgentOutcome:
        seed_of_call = functools.partial(turn_seed, sampling, group_id, sample_index)
        # Shielded: a batch cancelled meanwhile must not leave an episode registered (its URL answering) unclosed.
        episode = await asyncio.shield(self._on_engine(self.endpoint.open(sampling, self._limits, seed_of_call)))
        context = AgentContext(episode.base_url, "rl-align", self.endpoint.model_name, problem, sample_index)
        value: object = None
        timed_out = False
        loop = asyncio.get_running_loop()
        returned_at = None
        try:
            async with asyncio.timeout(self._limits.timeout_s) as deadline:
                value = await self._function(context, **self._options)
                returned_at = loop.time()
        except TimeoutError:
            if not deadline.expired() and episode.engine_error is None:
                raise self._failed(problem, "raised TimeoutError") from None
            timed_out = True
        except Exception as e:
            if episode.engine_error is None and not (episode.num_limit_refusals and _from_refusal(e)):
                after = (" after the endpoint refused a call for an episode limit (let the refusal's error propagate, "
                         "or return)") if episode.num_limit_refusals else ""  # fmt: skip
                raise self._failed(problem, f"raised {e!r}{after}") from e
        except BaseException as e:
            if not is_own_base_exception(e):
                raise
            if episode.engine_error is None:
                raise self._failed(problem, f"raised {e!r}") from e
        finally:
            await asyncio.shield(self._on_engine(self.endpoint.close(episode)))
        if episode.engine_error is not None:  # however the agent ended, the engine failed it: the worker is replaced
            raise episode.engine_error
        when = deadline.when()
        late = when is not None and returned_at is not None and returned_at >= when
        if not timed_out and (deadline.expired() or late):
            # It returned past its time: it swallowed the cancellation, or blocked the loop in synchronous code.
            timed_out, value = True, None
        stopped = bool(episode.num_limit_refusals)
        empty = None
        if not episode.calls and (timed_out or stopped):
            empty = unplayed_episode(await self.endpoint.render(problem.prompt), timed_out)
        return self._outcome(problem, episode, value, timed_out, empty)

    def _outcome(
        self, problem: Problem, episode: EpisodeCalls, value: object, timed_out: bool, empty: Episode | None
    ) -> AgentOutcome:
        number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if value is not None and not number:
            raise self._failed(problem, f"returned {value!r}; return a finite number (the reward) or None")
        num_splits = 0
        if episode.calls:
            segments, num_splits = assemble(episode.calls)
        elif empty is not None:
            segments = [empty]
        else:
            raise self._failed(problem, "returned without a chat completion; every episode must call the model at "
                                        "least once")  # fmt: skip
        stopped = bool(episode.num_limit_refusals)
        if timed_out or stopped:
            segments[-1].finish_reason = "length"
        reward = float(value) if number else 0.0  # type: ignore[arg-type]
        return AgentOutcome(segments, reward, timed_out, stopped, len({c.index for c in episode.calls}),
                            episode.num_ignored_sampling, episode.num_unknown_params, num_splits)  # fmt: skip

    def _failed(self, problem: Problem, what: str) -> EpisodeFailed:
        return EpisodeFailed(f"agent function {self._spec!r} {what} on problem {problem.problem_id!r}")

    async def _on_engine(self, coroutine: Any) -> Any:
        return await asyncio.wrap_future(self.engine.submit(coroutine))

    def shutdown(self) -> None:
        """Stop the endpoint and the agents' loop (no episode may be running)."""
        self.endpoint.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _from_refusal(error: BaseException) -> bool:
    """Whether the agent's ``error`` is a client's error for a refused call (status 400, or naming a limit's code),
    was raised while handling one or from one, or groups one (``asyncio.TaskGroup``): how an agent ends that the
    endpoint stopped at a limit. An error of the agent's own code once it has handled a refusal is not: it is the
    agent's bug."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        cause = pending.pop()
        if id(cause) in seen:
            continue
        seen.add(id(cause))
        response = getattr(cause, "response", None)
        status = getattr(cause, "status_code", None) or getattr(cause, "status", None)
        if status == 400 or getattr(response, "status_code", None) == 400 or getattr(response, "status", None) == 400:
            return True
        if any(code in str(cause) for code in LIMIT_CODES):
            return True
        if isinstance(cause, BaseExceptionGroup):
            pending.extend(cause.exceptions)
        pending.extend(c for c in (cause.__cause__, cause.__context__) if c is not None)
    return False


def agent_metrics(outcomes: Sequence[AgentOutcome]) -> dict[str, float]:
    """Additive figures of a batch of agent episodes (the pool sums them over pieces): the ``env/*`` ones of
    :func:`rollout.metrics.episode_metrics` (a turn being a call) and the agents' own."""
    observation_tokens = [sum(int((e.loss_mask == 0).sum()) for e in o.episodes) for o in outcomes]
    return episode_metrics([o.num_calls for o in outcomes], observation_tokens, [o.timed_out for o in outcomes]) | {
        "agent/num_samples": float(sum(len(o.episodes) for o in outcomes)),
        "agent/num_split_episodes": float(sum(o.num_splits > 0 for o in outcomes)),
        "agent/num_limit_stops": float(sum(o.stopped_at_limit for o in outcomes)),
        "agent/ignored_sampling_params": float(sum(o.num_ignored_sampling for o in outcomes)),
        "agent/unknown_params": float(sum(o.num_unknown_params for o in outcomes)),
    }
