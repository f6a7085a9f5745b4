"""The agent endpoint on the real engine (vLLM on a tiny Qwen 3), driven by the real `openai` client: recorded ids
reproduce the served text, prompts are exactly the template's, trajectories split where a prompt does not extend the
earlier ids, the trainer's log-probs of the model tokens equal the engine's, and limits, timeouts and bad agents end
as the contract says."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rollout.agents import scripted_agents
from tests.rollout.vllm_helpers import tiny_rollout_config, trainer_logprobs

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from common.chat_turns import end_of_turn_id  # noqa: E402
from rollout.agents import AgentRunner, load_agent_function  # noqa: E402
from rollout.config import SamplingConfig  # noqa: E402
from rollout.engine.vllm_engine import Completion  # noqa: E402
from rollout.envs import EpisodeFailed, EpisodeLimits  # noqa: E402
from rollout.envs.config import AgentEnvConfig  # noqa: E402
from rollout.rewards.config import ExactMatchRewardConfig, RewardConfig  # noqa: E402
from rollout.tasks.problem import Problem  # noqa: E402
from rollout.tokenizer import render_prompt  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402

# A random tiny model rarely writes the end-of-turn token; stopping on 80 of its 512 ids ends turns after a few tokens.
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=24, stop_token_ids=list(range(100, 180)), seed=5)
PROBLEM = Problem(prompt="What is 12 * 34?", answer="408", problem_id="p0")
AGENTS = "tests.rollout.agents.scripted_agents"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    config = tiny_rollout_config(tmp_path_factory, SAMPLING, max_model_len=512)
    env = AgentEnvConfig(function=f"{AGENTS}:tool_loop", max_turns=4, options={"turns": 3})
    worker = RolloutWorker(config, reward=RewardConfig(terms=[ExactMatchRewardConfig()]), environment=env)
    worker.engine.generate([[5, 6, 7]], SAMPLING, 1)  # warm: a cold engine's first call outlasted 1 s timeouts alone
    yield worker
    worker.shutdown()


def _runner(worker, function: str, **limits) -> AgentRunner:
    return AgentRunner(AgentEnvConfig(function=f"{AGENTS}:{function}", **limits), worker.engine, worker.tokenizer)


def _one_episode(worker, function: str, **limits):
    """The outcome of one episode of ``function`` on :data:`PROBLEM` (its runner shut down after)."""
    runner = _runner(worker, function, **limits)
    try:
        [outcome] = runner.run([(PROBLEM, 0, 0)], SAMPLING)
    finally:
        runner.shutdown()
    return outcome


def _episodes(samples):
    """Samples of one batch grouped into episodes (by sample index), segments in order."""
    out: dict[int, list] = {}
    for s in samples:
        out.setdefault(s.metadata["sample_index"], []).append(s)
    for segments in out.values():
        assert [s.metadata["segment"] for s in segments] == list(range(len(segments)))
        assert {s.metadata["num_segments"] for s in segments} == {len(segments)}
    return out


def _model_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_openai_client_episodes_are_recorded_token_exact(worker):
    scripted_agents.RECORDS.clear()
    batch = worker.generate_groups([PROBLEM], [7], 4)
    tok = worker.tokenizer
    episodes = _episodes(batch.samples)
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
            for start, end in _model_runs(mask):
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
    outcome = _one_episode(worker, "tool_loop", max_turns=2, options={"turns": 2})
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
    runner = _runner(worker, "rewriting", max_turns=4)
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
    outcome = _one_episode(worker, "over_the_limit", max_turns=2)
    assert outcome.num_calls == 2 and outcome.stopped_at_limit and outcome.episodes[-1].finish_reason == "length"
    outcome = _one_episode(worker, "over_the_limit", max_turns=50, max_total_tokens=40)
    grown = [len(e.completion_ids) for e in outcome.episodes]
    assert outcome.stopped_at_limit and outcome.num_calls < 50 and sum(grown) <= 40 * len(grown)
    assert outcome.episodes[-1].finish_reason == "length"


def test_a_timeout_keeps_the_calls_finished_before_it(worker):
    outcome = _one_episode(worker, "one_call_then_hang", max_turns=4, timeout_s=1.0)
    assert outcome.timed_out and outcome.num_calls == 1 and outcome.reward == 0.0
    assert outcome.episodes[-1].finish_reason == "length"


@pytest.mark.parametrize("function", ["refused_then_wrapped", "refused_then_raised", "refused_in_a_task_group"])
def test_a_refusal_reraised_by_the_agent_is_a_stop_at_the_limit(worker, function):
    outcome = _one_episode(worker, function, max_turns=2)
    assert outcome.stopped_at_limit and outcome.num_calls == 2 and outcome.episodes[-1].finish_reason == "length"


@pytest.mark.parametrize("function", ["swallows_the_timeout", "blocks_past_the_timeout"])
def test_an_agent_that_returns_past_its_timeout_timed_out(worker, function):
    """It returned 1.0 as a finished episode (finish reason 'stop', its reward counted) after its timeout."""
    outcome = _one_episode(worker, function, max_turns=4, timeout_s=1.0)
    assert outcome.timed_out and outcome.reward == 0.0 and outcome.episodes[-1].finish_reason == "length"


def test_a_numpy_reward_is_a_reward(worker):
    """``np.float32(0.5)`` was refused as "not a finite number"."""
    outcome = _one_episode(worker, "numpy_reward")
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
    runner = _runner(worker, "hang_in_call", max_turns=4, timeout_s=1.5)
    try:
        [outcome] = runner.run([(PROBLEM, 0, 0)], long)
        assert outcome.timed_out and outcome.num_calls == 1
        assert worker.engine.run(_unfinished(worker.engine)) == 0  # the second call's request was aborted
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
    runner = _runner(worker, "no_call")
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
            while worker.engine.run(_unfinished(worker.engine)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert worker.engine.run(_unfinished(worker.engine)) == 0 and episode.calls == []
    finally:
        worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()


async def _unfinished(engine) -> int:
    return engine._engine.get_num_unfinished_requests()


@pytest.mark.parametrize(("function", "match"), [
    ("broken", r"agent function '.*:broken' raised KeyError.*on problem 'p0'"),
    ("bad_return", r"returned '1.0'; return a finite number"),
    ("no_call", r"returned without a chat completion"),
    # A bug after a caught refusal was taken for the limit's stop: the run went on, the reward silently dropped.
    ("bug_after_the_limit", r"raised KeyError\('reward'\) after the endpoint refused a call for an episode limit"),
])  # fmt: skip
def test_a_failing_agent_fails_the_batch_naming_it(worker, function, match):
    runner = _runner(worker, function)
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
    outcome = _one_episode(worker, function, max_turns=4, **limits)
    [episode] = outcome.episodes
    assert outcome.num_calls == 0 and outcome.reward == 0.0 and episode.finish_reason == "length"
    assert outcome.timed_out == ("timeout_s" in limits) and outcome.stopped_at_limit == ("timeout_s" not in limits)
    assert len(episode.completion_ids) == 0 and episode.policy_versions == []
    assert episode.prompt_ids == render_prompt(worker.tokenizer, PROBLEM.prompt, True)


def test_failed_agent_episodes_within_the_budget_are_dropped(worker, monkeypatch):
    runner = _runner(worker, "fails_odd_samples")
    monkeypatch.setattr(worker, "_agents", runner)
    monkeypatch.setattr(worker, "_env_config", AgentEnvConfig(function=f"{AGENTS}:fails_odd_samples",
                                                              max_failed_fraction=0.5))  # fmt: skip
    try:
        batch = worker.generate_groups([PROBLEM], [3], 4)
        assert sorted(_episodes(batch.samples)) == [0, 2]
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
    runner = _runner(worker, function)
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
    runner = _runner(worker, "fail_first_else_keep_calling", max_turns=1000)
    try:
        with pytest.raises(RuntimeError, match="the agent's own bug"):
            runner.run([(PROBLEM, 0, 0), (PROBLEM, 0, 1)], SAMPLING)
        made = len(calls)
        time.sleep(0.5)
        assert len(calls) == made  # the other agent was stopped, not left calling the engine
    finally:
        runner.shutdown()


def test_an_agent_that_goes_on_with_its_first_choice_is_scored_on_it(worker):
    outcome = _one_episode(worker, "best_of_two_first")
    # The unused choice is a sample of its own; the last, which rewards score, ends with the agent's last reply (the
    # segment logic itself: tests/rollout/agents/test_protocol.py).
    assert len(outcome.episodes) >= 2 and outcome.episodes[-1].final_text == scripted_agents.LAST_REPLY[0]


def test_agent_functions_are_checked_when_loaded():
    with pytest.raises(ValueError, match="not an async function"):
        load_agent_function(f"{AGENTS}:not_async")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_agent_function(f"{AGENTS}:missing")


def test_requests_the_endpoint_cannot_serve_exactly_are_refused_by_name(worker):
    runner = _runner(worker, "no_call")
    endpoint = runner.endpoint
    episode = worker.engine.run(endpoint.open(SAMPLING, EpisodeLimits(max_turns=4), lambda t, n: None))
    client = openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        assert [m.id for m in client.models.list()] == ["policy"]
        assert client.models.retrieve("policy").id == "policy"  # the SDK's models.retrieve was a 404
        for kwargs, name in [({"n": 17}, "n"), ({"tool_choice": "required", "tools": [scripted_agents.CALCULATOR]},
                                                 "tool_choice"), ({"response_format": {"type": "json_object"}},
                                                                  "response_format")]:  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=name):
                client.chat.completions.create(model="policy", messages=messages, **kwargs)
        with pytest.raises(openai.BadRequestError, match="stream"):
            client.chat.completions.create(model="policy", messages=messages, stream=True,
                                           stream_options={"include_usage": "yes"})  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="stop_token_ids"):  # past the vocabulary: the engine broke
            client.chat.completions.create(model="policy", messages=messages, extra_body={"stop_token_ids": [1 << 40]})
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
            client.chat.completions.create(model="policy", messages=[{"role": "robot", "content": "hi"}])
        for body in ('{"n": ' + "1" * 5000 + "}", '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}"):
            assert _post(f"{episode.base_url}/chat/completions", body) == 400  # JSON Python cannot read: was a 500
        reply = client.chat.completions.create(model="any", messages=messages, max_tokens=3)
        assert reply.usage.completion_tokens <= 3 and reply.model == "policy"
        assert episode.episode_id not in reply.id  # the id is the URL's secret; reply ids get logged
        assert len(episode.calls) == 1  # refusals record nothing
        # A parameter it does not know (misspelt, or a framework's own) is ignored and counted: a 400 failed the episode
        client.chat.completions.create(model="policy", messages=messages, max_tokens=2, extra_body={"max_token": 2})
        assert episode.num_unknown_params == 1 and len(episode.calls) == 2
        # aiohttp's own answers (a route or method not served, a body over the limit) in OpenAI's error form too
        for method, path, body, status in [("POST", "/completions", b"{}", 404), ("GET", "/chat/completions", b"", 405),
                                           ("POST", "/chat/completions", b" " * (16 << 20) + b"{}", 413)]:  # fmt: skip
            got, answer = _request(method, f"{episode.base_url}{path}", body)
            assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}, answer
        gone = openai.OpenAI(base_url=episode.base_url.replace(episode.episode_id, "nope"), api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            gone.chat.completions.create(model="policy", messages=messages)
    finally:
        worker.engine.run(endpoint.close(episode))
        runner.shutdown()
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="policy", messages=messages)


def test_replies_end_before_the_stop_string_streamed_or_not(worker):
    runner = _runner(worker, "no_call")
    endless = SAMPLING.model_copy(update={"stop_token_ids": [], "max_tokens": 24})
    episode = worker.engine.run(runner.endpoint.open(endless, EpisodeLimits(max_turns=8), lambda t, n: 11))
    client = openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        whole = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        stop = whole.strip()[len(whole.strip()) // 2 :][:2]  # two characters from its middle: the same seed meets them
        cut = client.chat.completions.create(model="policy", messages=messages, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == whole[: whole.find(stop)], (whole, stop)
        chunks = client.chat.completions.create(model="policy", messages=messages, stop=[stop], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut.message.content
        # Rewards score the whole text, stop string included, as they do an environment's turn.
        assert all(c.text.startswith(cut.message.content + stop) for c in episode.calls[1:])
    finally:
        worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()


def _status_of_a_call_held_in_reading(worker, monkeypatch, body: str, meanwhile) -> int:
    """Post ``body`` to a fresh episode with the endpoint's request reading held (as a long body's would take its
    time), run ``meanwhile(runner, episode)`` while it is held, release it, and return the call's status."""
    import threading

    runner = _runner(worker, "no_call")
    release, started = threading.Event(), threading.Event()
    read = runner.endpoint._read

    def held(raw):
        started.set()
        assert release.wait(30)
        return read(raw)

    monkeypatch.setattr(runner.endpoint, "_read", held)
    episode = worker.engine.run(runner.endpoint.open(SAMPLING, EpisodeLimits(max_turns=4), lambda t, n: None))
    done: list[int] = []
    call = threading.Thread(target=lambda: done.append(_post(f"{episode.base_url}/chat/completions", body)))
    try:
        call.start()
        assert started.wait(30)
        meanwhile(runner, episode)
        release.set()
        call.join()
    finally:
        release.set()
        worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()
    return done[0]


def test_the_engine_loop_goes_on_while_a_request_is_read(worker, monkeypatch):
    import urllib.request

    def models(runner, episode):  # the loop answers (here its model list) while the call is read; it was held before
        for _ in range(3):
            with urllib.request.urlopen(f"{episode.base_url}/models", timeout=10) as response:
                assert response.status == 200

    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    assert _status_of_a_call_held_in_reading(worker, monkeypatch, body, models) == 200


def test_a_call_read_while_its_episode_ends_starts_nothing(worker, monkeypatch):
    ended = []

    def end(runner, episode):  # the episode's timeout, while the call is read
        worker.engine.run(runner.endpoint.close(episode))
        ended.append(episode)

    body = '{"messages": [{"role": "user", "content": "hi"}]}'
    assert _status_of_a_call_held_in_reading(worker, monkeypatch, body, end) == 409 and ended[0].calls == []


def _request(method: str, url: str, body: bytes) -> tuple[int, dict]:
    """Status and decoded JSON answer of a raw request."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, body or None, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_streamed_reply_arrives_in_pieces_and_adds_up_to_the_recorded_completions(worker):
    """Streamed with n = 3 and tools offered: each choice's content grows over several chunks, the chunks add up to
    the reply the same seeded call gets unstreamed, every completion is recorded, and usage closes the stream."""
    runner = _runner(worker, "no_call")
    long = SAMPLING.model_copy(update={"stop_token_ids": [], "ignore_eos": True, "max_tokens": 16})
    streamed_episode = worker.engine.run(runner.endpoint.open(long, EpisodeLimits(max_turns=8), lambda t, n: 3))
    whole_episode = worker.engine.run(runner.endpoint.open(long, EpisodeLimits(max_turns=8), lambda t, n: 3))
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    try:
        client = openai.OpenAI(base_url=streamed_episode.base_url, api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="policy", messages=messages, n=3, stream=True, stream_options={"include_usage": True},
            tools=[scripted_agents.CALCULATOR], logprobs=True,
        ))  # fmt: skip
        whole = openai.OpenAI(base_url=whole_episode.base_url, api_key="x", max_retries=0).chat.completions.create(
            model="policy", messages=messages, n=3, tools=[scripted_agents.CALCULATOR], logprobs=True)
    finally:
        for episode in (streamed_episode, whole_episode):
            worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finish, streamed_logprobs = {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces[choice.index].append(choice.delta.content)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
                streamed_logprobs[choice.index] = [t.logprob for t in choice.logprobs.content]
    recorded = sorted(streamed_episode.calls, key=lambda c: c.choice)
    assert [c.choice for c in recorded] == [0, 1, 2] and all(c.index == 0 for c in recorded)
    for j in range(3):
        assert "".join(pieces[j]) == (whole.choices[j].message.content or "") == recorded[j].text
        assert finish[j] == whole.choices[j].finish_reason == "length"
        assert recorded[j].completion_ids.tolist() == whole_episode.calls[j].completion_ids.tolist()
        # The log-probs served are the ones recorded for training, token by token.
        served = whole.choices[j].logprobs.content
        assert [t.logprob for t in served] == pytest.approx(whole_episode.calls[j].logprobs.tolist(), abs=1e-6)
        assert streamed_logprobs[j] == pytest.approx(recorded[j].logprobs.tolist(), abs=1e-6)
        ids = whole_episode.calls[j].completion_ids.tolist()
        assert [t.token for t in served] == [worker.tokenizer.decode([i]) for i in ids]
        # Each token's bytes are its own (a part of a character too): together they decode as the whole completion.
        assert bytes(b for t in served for b in t.bytes).decode("utf-8", "replace") == worker.tokenizer.decode(ids)
    assert max(len(p) for p in pieces.values()) > 3  # sent while generated, not at the end
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48 == whole.usage.completion_tokens


def test_an_episode_that_ends_mid_stream_ends_the_stream_with_an_error_event(worker):
    runner = _runner(worker, "no_call")
    long = SAMPLING.model_copy(update={"stop_token_ids": [], "ignore_eos": True, "max_tokens": 450})
    episode = worker.engine.run(runner.endpoint.open(long, EpisodeLimits(max_turns=8), lambda t, n: None))
    client = openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], stream=True)
        received = []
        with pytest.raises(openai.APIError, match="the episode ended"):
            for chunk in stream:
                received.append(chunk)
                if len(received) == 2:
                    worker.engine.run(runner.endpoint.close(episode))
        assert len(received) < 100 and not episode.calls  # an aborted call is not recorded
        assert worker.engine.run(_unfinished(worker.engine)) == 0
    finally:
        runner.shutdown()


def test_a_streamed_call_that_fails_after_it_began_ends_with_an_error_event(worker, monkeypatch):
    """Not a second HTTP response written into the stream (the client saw a cut reply end as if complete)."""
    runner = _runner(worker, "no_call")
    episode = worker.engine.run(runner.endpoint.open(SAMPLING, EpisodeLimits(max_turns=4), lambda t, n: None))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of the endpoint")

    monkeypatch.setattr(runner.endpoint, "_record", broken)
    client = openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0)
    try:
        stream = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                stream=True)  # fmt: skip
        with pytest.raises(openai.APIError, match="internal error"):
            for _ in stream:
                pass
    finally:
        worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()


def test_choices_of_one_call_are_all_trained_on_and_count_as_one_episode(worker, monkeypatch):
    """An agent asks for 2 choices and goes on with the second: its episode gives a sample per choice (the chosen one
    with the rest of the conversation where its text re-encodes to its ids), all marked as one episode."""
    runner = _runner(worker, "best_of_two")
    monkeypatch.setattr(worker, "_agents", runner)
    try:
        batch = worker.generate_groups([PROBLEM], [3], 2)
    finally:
        runner.shutdown()
    first = render_prompt(worker.tokenizer, [{"role": "user", "content": PROBLEM.prompt}], True)
    episodes = _episodes(batch.samples)
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
