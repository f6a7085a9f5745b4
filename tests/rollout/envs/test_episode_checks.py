"""The environment's side of an episode on a scripted engine (no vLLM): an environment that blocks the event loop
times out and is named, and tool descriptions that no chat template can render fail the episode naming the
environment."""

from __future__ import annotations

import logging
import time

import pytest

from rollout.envs import EpisodeFailed, EpisodeLimits, StepResult
from rollout.envs.tools import build_tool
from rollout.metrics import episode_metrics
from tests.rollout.envs.scripted_engine import ScriptedEngine, play
from tests.rollout.envs.scripted_env import EchoObservations


@pytest.fixture
def quick_hold_warning(monkeypatch):
    """The warning for a call that holds the loop from 0.05 s (1 s in production), so the tests sleep little; each
    test hears the warnings said once per process."""
    monkeypatch.setattr("rollout.envs.episode.HOLD_WARNING_S", 0.05)
    monkeypatch.setattr("rollout.envs.base._warned", set())


class SleepsInStep(EchoObservations):
    """Blocks the event loop for ``sleep_s`` in each step (``time.sleep``, as a synchronous HTTP client would)."""

    def __init__(self, sleep_s: float, turns: int = 2, reward: float = 1.0) -> None:
        super().__init__(turns=turns, reward=reward)
        self._sleep_s = sleep_s

    async def step(self, text):
        time.sleep(self._sleep_s)
        return await super().step(text)


def test_a_step_that_blocks_the_loop_past_the_deadline_times_out(quick_hold_warning, caplog):
    # Each episode ran well past timeout_s and env/num_timeouts stayed 0: the deadline fires only at an await, and a
    # last step that blocked had none after it.
    env = SleepsInStep(0.3, turns=1, reward=1.0)
    episode = play(env, EpisodeLimits(max_turns=3, timeout_s=0.2))
    assert episode.timed_out and episode.finish_reason == "length" and episode.num_turns == 1 and env.closed
    assert episode.env_reward == 0.0  # the late step's result is not taken, as a step cut at its deadline gives none
    assert episode_metrics([1], [0], [episode.timed_out])["env/num_timeouts"] == 1.0
    text = caplog.text
    assert "SleepsInStep: step of problem 'p0' (turn 1) returned past the episode's timeout_s = 0.2 s" in text
    assert "blocked the event loop" in text and "asyncio.to_thread" in text


def test_a_reset_that_blocks_the_loop_past_the_deadline_times_out_before_any_turn(quick_hold_warning, caplog):
    class SleepsInReset(EchoObservations):
        async def reset(self, problem):
            time.sleep(0.3)
            return await super().reset(problem)

    engine = ScriptedEngine()
    env = SleepsInReset()
    episode = play(env, EpisodeLimits(max_turns=3, timeout_s=0.2), engine)
    assert episode.timed_out and episode.num_turns == 0 and len(episode.completion_ids) == 0 and env.closed
    assert episode.prompt_ids and not engine.prompts  # the prompt is there; no turn was generated
    assert "SleepsInReset: reset of problem 'p0' returned past the episode's timeout_s = 0.2 s" in caplog.text


def test_a_call_that_holds_the_loop_long_is_named_once(quick_hold_warning, caplog):
    with caplog.at_level(logging.WARNING, logger="rollout.envs.episode"):
        episode = play(SleepsInStep(0.1, turns=3))
        play(SleepsInStep(0.1, turns=3))
    assert episode.num_turns == 3 and not episode.timed_out and episode.env_reward == 1.0  # no deadline: it goes on
    said = [r.getMessage() for r in caplog.records if "held the event loop" in r.getMessage()]
    assert len(said) == 1, said
    assert "SleepsInStep: step held the event loop for 0.1" in said[0]
    assert "stalls generation of every episode on this worker" in said[0] and "asyncio.to_thread" in said[0]


def test_many_short_blocking_calls_are_named_once_they_add_up(quick_hold_warning, monkeypatch, caplog):
    # time.sleep(0.05) in each step made generation 10x slower, and each call stayed under the per-call warning.
    monkeypatch.setattr("rollout.envs.episode.BLOCKING_TOTAL_S", 0.25)
    monkeypatch.setattr("rollout.envs.episode._blocking", {})
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            play(SleepsInStep(0.04, turns=3), EpisodeLimits(max_turns=3))
    assert "SleepsInStep: " in caplog.text and "calls of step each held the event loop 25 ms or more" in caplog.text
    assert caplog.text.count("calls of step each held") == 1


def test_a_step_that_awaits_is_not_holding_the_loop(quick_hold_warning, caplog):
    import asyncio

    class AwaitsInStep(EchoObservations):
        async def step(self, text):
            await asyncio.sleep(0.1)  # a slow tool server, awaited: the other episodes go on meanwhile
            return await super().step(text)

    episode = play(AwaitsInStep(turns=2), EpisodeLimits(max_turns=3, timeout_s=5.0))
    assert episode.num_turns == 2 and not episode.timed_out and "held the event loop" not in caplog.text


class HasTools(EchoObservations):
    """Describes ``tools`` to the model (set per instance, as a constructor would)."""

    def __init__(self, tools: object, turns: int = 2) -> None:
        super().__init__(turns=turns)
        self.tools = tools  # type: ignore[assignment]


CALC = build_tool("calculator").schema()


@pytest.mark.parametrize("tools, error", [
    # 'Tool' object is not iterable, in a RayTaskError naming no environment
    ([build_tool("calculator")], r"tools\[0\] is a rollout.envs.tools.Tool, not a mapping: give a tool description, "
                                 r"\{'type': 'function', .*\(a Tool's description is Tool.schema\(\)"),
    (CALC, r"tools is a dict, not a list: give a list of tool descriptions"),
    ([{"name": "calc", "parameters": {}}],
     r"tools\[0\]\['type'\] is None, not 'function': a tool description is \{'type': 'function'"),
    # a jinja UndefinedError from the chat template
    ([{"type": "function", "function": {"parameters": {}}}], r"tools\[0\]\['function'\]\['name'\] is None, not a "
                                                             r"non-empty string"),
    ([{"type": "function", "function": {"name": "calc", "parameters": "x"}}],
     r"tools\[0\]\['function'\]\['parameters'\] is a str, not a JSON schema object"),
    ([CALC, CALC], r"tools\[1\] is a second tool named 'calculator'"),
    ([{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"x": {int}}}}}],
     r"tools\[0\] is not JSON"),
])  # fmt: skip
def test_tools_no_template_can_describe_fail_the_episode_naming_the_environment(tools, error):
    env = HasTools(tools)
    with pytest.raises(EpisodeFailed, match=r"test_episode_checks:HasTools: " + error) as e:
        play(env)
    assert "HasTools: " in str(e.value) and env.closed


def test_tools_changed_to_what_cannot_be_described_fail_the_turn_naming_the_environment():
    class BreaksItsTools(HasTools):
        async def step(self, text):
            self.tools = [build_tool("calculator")]
            return StepResult(observation=[{"role": "tool", "content": "408"}])

    with pytest.raises(EpisodeFailed, match=r"BreaksItsTools: tools\[0\] is a rollout.envs.tools.Tool"):
        play(BreaksItsTools([CALC]))


def test_well_formed_tools_are_described_to_the_model():
    now = {"type": "function", "function": {"name": "now"}}  # no parameters: valid in OpenAI's API
    engine = ScriptedEngine()
    episode = play(HasTools((CALC, now)), engine=engine)
    assert episode.num_turns == 2
    from tests.rollout.envs.scripted_engine import tiny_tokenizer

    assert "Tools: calculator(expression) now()." in tiny_tokenizer().decode(engine.prompts[0])


def test_info_that_would_overwrite_an_own_figure_fails_the_episode_naming_it():
    # info={"num_turns": 5} reported env/num_turns 384 for 64 one-turn episodes, silently.
    class Collides(EchoObservations):
        async def step(self, text):
            return StepResult(done=True, reward=1.0, info={"num_turns": 5.0})

    with pytest.raises(EpisodeFailed, match=r"Collides: StepResult.info\['num_turns'\] would be reported as "
                                            r"env/num_turns, one of rl-align's own episode figures"):  # fmt: skip
        play(Collides())


@pytest.mark.parametrize("error", [SystemExit(2), KeyboardInterrupt()])
def test_an_environment_that_raises_a_base_exception_fails_its_episode_naming_it(error):
    """Raised on, SystemExit ended the worker's event loop, and every later batch waited on it for good."""
    class Exits(EchoObservations):
        async def step(self, text):
            raise error

    with pytest.raises(EpisodeFailed, match=rf"Exits: step of problem .* raised {type(error).__name__}"):
        play(Exits())


def test_an_observation_past_the_context_ends_the_episode_and_says_so(quick_hold_warning, caplog):
    # Every episode ended after its first turn, with nothing said: nothing trained, exit code 0.
    class Floods(EchoObservations):
        async def step(self, text):
            return StepResult(observation=[{"role": "user", "content": "word " * 2000}])

    with caplog.at_level(logging.WARNING):
        episode = play(Floods(), EpisodeLimits(max_turns=3), ScriptedEngine(max_model_len=512))
    assert episode.num_turns == 1 and episode.finish_reason == "length"
    assert "Floods: an observation of " in caplog.text and "left no room for another model turn" in caplog.text


def test_completion_lengths_count_model_tokens_only():
    """rollout/completion_len_mean of multi-turn episodes counted their observations (~60 tokens against ~7)."""
    import numpy as np

    from rollout.metrics import sample_metrics
    from rollout.types import Sample

    episode = play(EchoObservations(turns=3))
    sample = Sample(prompt_ids=np.asarray(episode.prompt_ids, np.int64), completion_ids=episode.completion_ids,
                    rollout_logprobs=episode.logprobs, reward=0.0, group_id=0, policy_version=0,
                    loss_mask=episode.loss_mask)  # fmt: skip
    assert int(episode.loss_mask.sum()) < len(episode.completion_ids)
    metrics = sample_metrics([sample])
    assert metrics["rollout/completion_len_mean"] == metrics["rollout/completion_len_max"] == episode.loss_mask.sum()
