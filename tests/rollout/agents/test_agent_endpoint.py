"""The agent endpoint on the real engine (vLLM on a tiny Qwen 3), driven by the real `openai` client: recorded ids
reproduce the served text, prompts are exactly the template's, trajectories split where a prompt does not extend the
earlier ids, the trainer's log-probs of the model tokens equal the engine's, and limits, timeouts and bad agents end
as the contract says (the HTTP side, refusals and streaming: test_agent_endpoint_http.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rollout.agents import scripted_agents
from tests.rollout.agents.endpoint_helpers import (
    AGENTS,
    PROBLEM,
    SAMPLING,
    episodes_of,
    model_runs,
    one_episode,
    runner_of,
    unfinished_requests,
)  # fmt: skip
from tests.rollout.vllm_helpers import trainer_logprobs

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from common.chat_turns import end_of_turn_id  # noqa: E402
from rollout.agents import AgentRunner  # noqa: E402
from rollout.engine.vllm_engine import Completion  # noqa: E402
from rollout.envs import EpisodeFailed, EpisodeLimits  # noqa: E402
from rollout.envs.config import AgentEnvConfig  # noqa: E402
from rollout.tokenizer import render_prompt  # noqa: E402


def test_user_code_on_a_worker_gets_random_streams_of_its_own(worker):
    """vLLM seeds `random` and `numpy.random` with the engine's seed (0): an environment drawing a secret got the
    same sequence on every worker and after every restart. First in this module: the next draws after the
    worker's start."""
    import random

    seeded = random.Random(0).random(), np.random.RandomState(0).random_sample()
    assert (random.random(), np.random.random_sample()) != seeded


def test_openai_client_episodes_are_recorded_token_exact(worker):
    scripted_agents.RECORDS.clear()
    batch = worker.generate_groups([PROBLEM], [7], 4)
    tok = worker.tokenizer
    episodes = episodes_of(batch.samples)
    assert sorted(episodes) == [0, 1, 2, 3]
    for k, segments in episodes.items():
        records = scripted_agents.RECORDS[(PROBLEM.problem_id, k)]
        assert len(records) == 3
        calls = iter(records)
        expected_segments = 0
        previous_full: list[int] | None = None
        for sample in segments:
            full = sample.prompt_ids.tolist() + sample.completion_ids.tolist()
            mask = np.ones(len(sample.completion_ids), np.uint8) if sample.loss_mask is None else sample.loss_mask
            for start, end in model_runs(mask):
                record = next(calls)
                prompt = render_prompt(tok, record["messages"], True, tools=record["tools"])
                # The prompt the engine saw is exactly the template's rendering of what the agent sent ...
                assert full[: len(sample.prompt_ids) + start] == prompt
                # ... and the served text is exactly the recorded ids, decoded.
                served = record["reply"].content or ""
                assert tok.decode(full[len(sample.prompt_ids) + start : len(sample.prompt_ids) + end],
                                  skip_special_tokens=True) == served  # fmt: skip
                assert record["policy_version"] == 0
                extends = previous_full is not None and prompt[: len(previous_full)] == previous_full
                expected_segments += not extends
                previous_full = full[: len(sample.prompt_ids) + end]
        assert next(calls, None) is None
        assert len(segments) == expected_segments  # split exactly where a prompt does not extend the earlier ids
    assert batch.metrics["env/num_turns"] == 12 and batch.metrics["agent/num_samples"] == len(batch.samples)
    assert batch.metrics["agent/ignored_sampling_params"] == 12  # the agent sent temperature=0.7 on every call
    assert all("environment" in s.reward_terms and "exact_match" in s.reward_terms for s in batch.samples)
    deltas = [np.abs(t - s.rollout_logprobs)[s.loss_mask.astype(bool) if s.loss_mask is not None else slice(None)]
              for t, s in zip(trainer_logprobs(worker.config.served_model_path, batch.samples), batch.samples)]
    assert float(np.mean(np.concatenate(deltas))) <= 1e-5


def test_a_tool_call_round_trips_through_the_client_into_one_sample(worker, monkeypatch):
    """The model's first turn is a well-formed call (scripted: a random model never writes one); the client gets it
    as `tool_calls`, echoes it back, and the template renders it as the model wrote it, so the episode is one sample
    with the tool result masked out."""
    tok = worker.tokenizer
    eot = end_of_turn_id(tok)
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    scripted = np.asarray([*tok.encode(call_text, add_special_tokens=False), eot], np.int64)
    generate = worker.engine.generate_async
    seen = []

    async def first_call_scripted(prompt, sampling, n=1, seed=None, on_tokens=None):
        seen.append(list(prompt))
        if len(seen) == 1:
            return [Completion(scripted, np.full(len(scripted), -0.5, np.float32), "stop", 0)]
        return await generate(prompt, sampling, n, seed, on_tokens)

    monkeypatch.setattr(worker.engine, "generate_async", first_call_scripted)
    scripted_agents.RECORDS.clear()
    outcome = one_episode(worker, "tool_loop", max_turns=2, options={"turns": 2})
    [first, second] = scripted_agents.RECORDS[(PROBLEM.problem_id, 0)]
    [call] = first["reply"].tool_calls
    assert first["finish_reason"] == "tool_calls" and first["reply"].content is None
    assert call.function.name == "calculator" and call.function.arguments == '{"expression": "12 * 34"}'
    [segment] = outcome.episodes
    assert seen[1][: len(seen[0]) + len(scripted)] == seen[0] + scripted.tolist()
    assert segment.prompt_ids == seen[0] and segment.num_turns == 2
    observation = seen[1][len(seen[0]) + len(scripted):]
    assert tok.decode(observation).startswith("\n<|im_start|>tool\n= 0 (from call_")  # after the end of turn
    assert segment.loss_mask.tolist() == [1] * len(scripted) + [0] * len(observation) + [1] * (
        len(segment.completion_ids) - len(scripted) - len(observation)
    )


def test_a_rewritten_history_splits_the_episode(worker):
    runner = runner_of(worker, "rewriting", max_turns=4)
    try:
        outcomes = runner.run([(PROBLEM, 0, k) for k in range(3)], SAMPLING)
    finally:
        runner.shutdown()
    first = render_prompt(worker.tokenizer, [{"role": "user", "content": PROBLEM.prompt}], True)
    for outcome in outcomes:
        [a, b] = outcome.episodes
        assert a.prompt_ids == first and a.num_turns == 1 and not a.loss_mask.size - a.loss_mask.sum()
        assert b.prompt_ids == render_prompt(worker.tokenizer, [{"role": "user", "content": PROBLEM.prompt},
                                                               {"role": "user", "content": "Again."}], True)
        assert outcome.reward == 0.0 and not outcome.timed_out


def test_limits_refuse_calls_and_end_the_episode_as_length(worker):
    outcome = one_episode(worker, "over_the_limit", max_turns=2)
    assert outcome.num_calls == 2 and outcome.stopped_at_limit and outcome.episodes[-1].finish_reason == "length"
    outcome = one_episode(worker, "over_the_limit", max_turns=50, max_total_tokens=40)
    grown = [len(e.completion_ids) for e in outcome.episodes]
    assert outcome.stopped_at_limit and outcome.num_calls < 50 and sum(grown) <= 40 * len(grown)
    assert outcome.episodes[-1].finish_reason == "length"


def test_a_timeout_keeps_the_calls_finished_before_it(worker):
    outcome = one_episode(worker, "one_call_then_hang", max_turns=4, timeout_s=1.0)
    assert outcome.timed_out and outcome.num_calls == 1 and outcome.reward == 0.0
    assert outcome.episodes[-1].finish_reason == "length"


@pytest.mark.parametrize("function", ["refused_then_wrapped", "refused_then_raised", "refused_in_a_task_group"])
def test_a_refusal_reraised_by_the_agent_is_a_stop_at_the_limit(worker, function):
    outcome = one_episode(worker, function, max_turns=2)
    assert outcome.stopped_at_limit and outcome.num_calls == 2 and outcome.episodes[-1].finish_reason == "length"


@pytest.mark.parametrize("function", ["swallows_the_timeout", "blocks_past_the_timeout"])
def test_an_agent_that_returns_past_its_timeout_timed_out(worker, function):
    """It returned 1.0 as a finished episode (finish reason 'stop', its reward counted) after its timeout."""
    outcome = one_episode(worker, function, max_turns=4, timeout_s=1.0)
    assert outcome.timed_out and outcome.reward == 0.0 and outcome.episodes[-1].finish_reason == "length"


def test_a_numpy_reward_is_a_reward(worker):
    """``np.float32(0.5)`` was refused as "not a finite number"."""
    outcome = one_episode(worker, "numpy_reward")
    assert outcome.reward == 0.5 and type(outcome.reward) is float


def test_a_call_in_flight_at_the_timeout_is_aborted(worker, monkeypatch):
    import time

    engine = worker.engine._engine
    step = engine.step

    def slow_step():  # 450 tokens then take >= 22 s, the first call's 2 tokens 0.15 s
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    long = SAMPLING.model_copy(update={"max_tokens": 450, "ignore_eos": True, "stop_token_ids": []})
    runner = runner_of(worker, "hang_in_call", max_turns=4, timeout_s=1.5)
    try:
        [outcome] = runner.run([(PROBLEM, 0, 0)], long)
        assert outcome.timed_out and outcome.num_calls == 1
        assert worker.engine.run(unfinished_requests(worker.engine)) == 0  # the second call's request was aborted
    finally:
        runner.shutdown()


def test_a_call_whose_client_went_away_is_aborted_and_not_recorded(worker, monkeypatch):
    import time

    engine = worker.engine._engine
    step = engine.step

    def slow_step():  # a 450-token completion then takes >= 22 s
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    runner = runner_of(worker, "no_call")
    long = SAMPLING.model_copy(update={"max_tokens": 450, "ignore_eos": True, "stop_token_ids": []})
    episode = worker.engine.run(runner.endpoint.open(long, EpisodeLimits(max_turns=4), lambda t, n: None))
    try:
        client = openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0, timeout=1.0)
        messages = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            if stream:  # the client reads a few chunks and hangs up
                chunks = client.chat.completions.create(model="policy", messages=messages, stream=True)
                for _, _ in zip(range(3), chunks, strict=False):
                    pass
                chunks.close()
            else:  # the client's timeout passes first
                with pytest.raises(openai.APITimeoutError):
                    client.chat.completions.create(model="policy", messages=messages)
            deadline = time.monotonic() + 5
            while worker.engine.run(unfinished_requests(worker.engine)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert worker.engine.run(unfinished_requests(worker.engine)) == 0 and episode.calls == []
    finally:
        worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()


@pytest.mark.parametrize(("function", "match"), [
    ("broken", r"agent function '.*:broken' raised KeyError.*on problem 'p0'"),
    ("bad_return", r"returned '1.0'; return a finite number"),
    ("no_call", r"returned without a chat completion"),
    # A bug after a caught refusal was taken for the limit's stop: the run went on, the reward silently dropped.
    ("bug_after_the_limit", r"raised KeyError\('reward'\) after the endpoint refused a call for an episode limit"),
    ("exits", r"agent function '.*:exits' raised SystemExit\(3\)"),  # ended the agents' loop: the run hung
    ("own_cancelled_error", r"raised CancelledError"),  # crashed the worker with a raw traceback
])  # fmt: skip
def test_a_failing_agent_fails_the_batch_naming_it(worker, function, match):
    runner = runner_of(worker, function)
    try:
        with pytest.raises(RuntimeError, match=match):
            runner.run([(PROBLEM, 0, 0)], SAMPLING)
    finally:
        runner.shutdown()


@pytest.mark.parametrize(("function", "limits"), [
    ("too_long_first_call", {}),  # failed the run ("made no chat completion") before
    ("sleeps_before_its_call", {"timeout_s": 0.5}),
])  # fmt: skip
def test_an_episode_a_limit_ends_before_any_call_is_a_sample_without_model_tokens(worker, function, limits):
    outcome = one_episode(worker, function, max_turns=4, **limits)
    [episode] = outcome.episodes
    assert outcome.num_calls == 0 and outcome.reward == 0.0 and episode.finish_reason == "length"
    assert outcome.timed_out == ("timeout_s" in limits) and outcome.stopped_at_limit == ("timeout_s" not in limits)
    assert len(episode.completion_ids) == 0 and episode.policy_versions == []
    assert episode.prompt_ids == render_prompt(worker.tokenizer, PROBLEM.prompt, True)


def test_failed_agent_episodes_within_the_budget_are_dropped(worker, monkeypatch):
    runner = runner_of(worker, "fails_odd_samples")
    monkeypatch.setattr(worker, "_agents", runner)
    monkeypatch.setattr(worker, "_env_config", AgentEnvConfig(function=f"{AGENTS}:fails_odd_samples",
                                                              max_failed_fraction=0.5))  # fmt: skip
    try:
        batch = worker.generate_groups([PROBLEM], [3], 4)
        assert sorted(episodes_of(batch.samples)) == [0, 2]
        assert {s.reward_terms["environment"] for s in batch.samples} == {1.0}
        assert batch.metrics["env/num_failed_episodes"] == 2
        assert batch.metrics["agent/num_samples"] == len(batch.samples)
        monkeypatch.setattr(worker, "_env_config", worker._env_config.model_copy(update={"max_failed_fraction": 0.3}))
        with pytest.raises(EpisodeFailed, match=r"2 of this rollout request's 4 episodes .* = 1 go; the first: agent "
                                                r"function '.*:fails_odd_samples' raised ConnectionError"):  # fmt: skip
            worker.generate_groups([PROBLEM], [3], 4)
    finally:
        runner.shutdown()


@pytest.mark.parametrize("function", ["tool_loop", "swallows_errors"])
def test_an_engine_that_cannot_serve_reaches_the_pool_as_a_broken_engine(worker, monkeypatch, function):
    from rollout.engine.errors import EngineBrokenError

    async def broken(*args, **kwargs):
        raise EngineBrokenError("a generation step failed")

    monkeypatch.setattr(worker.engine, "generate_async", broken)
    runner = runner_of(worker, function)
    try:  # the client sees 503 (and retries); the pool must see the engine's error to replace the worker
        with pytest.raises(EngineBrokenError, match="a generation step failed"):
            runner.run([(PROBLEM, 0, 0)], SAMPLING)
    finally:
        runner.shutdown()


def test_when_one_agent_fails_the_others_stop(worker, monkeypatch):
    import time

    calls = []
    generate = worker.engine.generate_async

    def counted(*args, **kwargs):
        calls.append(time.monotonic())
        return generate(*args, **kwargs)

    monkeypatch.setattr(worker.engine, "generate_async", counted)
    runner = runner_of(worker, "fail_first_else_keep_calling", max_turns=1000)
    try:
        with pytest.raises(RuntimeError, match="the agent's own bug"):
            runner.run([(PROBLEM, 0, 0), (PROBLEM, 0, 1)], SAMPLING)
        made = len(calls)
        time.sleep(0.5)
        assert len(calls) == made  # the other agent was stopped, not left calling the engine
    finally:
        runner.shutdown()


def test_an_agent_that_goes_on_with_its_first_choice_is_scored_on_it(worker):
    outcome = one_episode(worker, "best_of_two_first")
    # The unused choice is a sample of its own; the last, which rewards score, ends with the agent's last reply (the
    # segment logic itself: tests/rollout/agents/test_protocol.py).
    assert len(outcome.episodes) >= 2 and outcome.episodes[-1].final_text == scripted_agents.LAST_REPLY[0]


def test_choices_of_one_call_are_all_trained_on_and_count_as_one_episode(worker, monkeypatch):
    """An agent asks for 2 choices and goes on with the second: its episode gives a sample per choice (the chosen one
    with the rest of the conversation where its text re-encodes to its ids), all marked as one episode."""
    runner = runner_of(worker, "best_of_two")
    monkeypatch.setattr(worker, "_agents", runner)
    try:
        batch = worker.generate_groups([PROBLEM], [3], 2)
    finally:
        runner.shutdown()
    first = render_prompt(worker.tokenizer, [{"role": "user", "content": PROBLEM.prompt}], True)
    episodes = episodes_of(batch.samples)
    assert sorted(episodes) == [0, 1]
    for k, segments in episodes.items():
        assert {s.episode for s in segments} == {k} and len({s.reward for s in segments}) == 1
        unchosen, chosen, *rest = segments
        assert unchosen.prompt_ids.tolist() == chosen.prompt_ids.tolist() == first and unchosen.loss_mask is None
        # A random model's text may not re-encode to its ids: then the second call is a sample of its own.
        assert chosen.metadata["num_turns"] == (1 if rest else 2)
        assert all(r.prompt_ids.tolist()[: len(first)] == first for r in rest) and len(rest) <= 1
    assert batch.metrics["env/num_turns"] == 4 and batch.metrics["agent/num_samples"] == len(batch.samples)


def test_the_example_agent_starts_from_the_prompt_its_warm_start_trains_on(worker):
    from driver.warm_start import sft_samples
    from rollout.tasks.arithmetic import calculator_transcript

    config = AgentEnvConfig(function="examples.agents.calculator:solve", warm_start_tools=["calculator"])
    runner = AgentRunner(config, worker.engine, worker.tokenizer)
    try:
        outcomes = runner.run([(PROBLEM, 0, k) for k in range(2)], SAMPLING)
    finally:
        runner.shutdown()
    [warm] = sft_samples(worker.tokenizer, [(PROBLEM, calculator_transcript("12 * 34"))], None, config)
    for outcome in outcomes:
        assert outcome.episodes[0].prompt_ids == warm.prompt_ids.tolist() and outcome.num_calls >= 1
