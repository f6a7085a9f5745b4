"""The agent endpoint's HTTP side on the real engine, driven by the real `openai` client and raw requests: requests
it cannot serve exactly are refused by name, replies end before their stop strings, the engine loop goes on while a
request is read, and streamed replies add up to the recorded completions or end with an error event."""

from __future__ import annotations

import pytest

from tests.rollout.agents import scripted_agents
from tests.rollout.agents.endpoint_helpers import AGENTS, PROBLEM, SAMPLING, runner_of, unfinished_requests

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from rollout.agents import load_agent_function  # noqa: E402
from rollout.envs import EpisodeLimits  # noqa: E402


def test_agent_functions_are_checked_when_loaded():
    with pytest.raises(ValueError, match="not an async function"):
        load_agent_function(f"{AGENTS}:not_async")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_agent_function(f"{AGENTS}:missing")


def test_a_message_too_long_for_any_tokenisation_is_refused_unrendered_as_past_the_context(worker, monkeypatch):
    """4 MB of a tool's output was rendered and tokenised first (4.5 s on the one reader thread, other episodes'
    calls waiting) to be refused then: the refusal comes from the contents' length alone, counted as a limit's."""
    runner = runner_of(worker, "no_call")
    episode = worker.engine.run(runner.endpoint.open(SAMPLING, EpisodeLimits(max_turns=4), lambda t, n: None))
    client = openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0)

    def unrendered(*args, **kwargs):
        raise AssertionError("rendered")

    monkeypatch.setattr(type(runner.endpoint._prompts), "__call__", unrendered)
    try:
        with pytest.raises(openai.BadRequestError, match="the prompt has at least .* tokens: no room left") as e:
            client.chat.completions.create(model="policy", messages=[{"role": "tool", "content": "x" * (4 << 20)}])
        assert e.value.code == "context_length_exceeded" and episode.num_limit_refusals == 1 and not episode.calls
        # A tool call's arguments and the tools count towards no bound (a template may leave them out), yet 14 MB of
        # them took 38 s to render on the reader thread.
        call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "x" * (4 << 20)}}
        with pytest.raises(openai.BadRequestError, match=r"characters of messages, tool calls and tools: over 4x"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}, {
                "role": "assistant", "content": None, "tool_calls": [call]}])  # fmt: skip
    finally:
        worker.engine.run(runner.endpoint.close(episode))
        runner.shutdown()


def test_requests_the_endpoint_cannot_serve_exactly_are_refused_by_name(worker):
    runner = runner_of(worker, "no_call")
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
    runner = runner_of(worker, "no_call")
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

    runner = runner_of(worker, "no_call")
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
    runner = runner_of(worker, "no_call")
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
    runner = runner_of(worker, "no_call")
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
        assert worker.engine.run(unfinished_requests(worker.engine)) == 0
    finally:
        runner.shutdown()


def test_a_streamed_call_that_fails_after_it_began_ends_with_an_error_event(worker, monkeypatch):
    """Not a second HTTP response written into the stream (the client saw a cut reply end as if complete)."""
    runner = runner_of(worker, "no_call")
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
