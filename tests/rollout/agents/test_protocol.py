"""The chat-completions wire form and trajectory assembly, without an engine: what is accepted, what is refused by
name, tool calls in replies, and how recorded calls become samples."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from rollout.agents.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ProtocolError,
    assistant_reply,
    cut_at_ending_stop,
    cut_at_stop,
    parse_chat_request,
)
from rollout.agents.streaming import ChoiceStream, IncrementalText
from rollout.agents.trajectory import AgentCall, assemble

USER = [{"role": "user", "content": "hi"}]


def test_a_plain_request_is_read_with_the_clients_limits():
    chat = parse_chat_request({"model": "m", "messages": USER, "max_tokens": 5, "stop": "END", "temperature": 0.3,
                               "user": "someone"})  # fmt: skip
    assert chat.messages == USER and chat.tools is None and not chat.parse_tool_calls
    assert chat.max_tokens == 5 and chat.stop == ["END"] and chat.ignored_sampling_params == ["temperature"]
    assert parse_chat_request({"messages": USER, "max_completion_tokens": 7, "max_tokens": 9}).max_tokens == 7
    assert chat.n == 1 and not chat.stream and not chat.include_usage
    many = parse_chat_request({"messages": USER, "n": 16, "stream": True, "stream_options": {"include_usage": True}})
    assert many.n == 16 and many.stream and many.include_usage and not many.logprobs
    assert parse_chat_request({"messages": USER, "logprobs": True, "top_logprobs": 0}).logprobs


def test_content_parts_tool_calls_and_tool_results_are_normalised_for_the_template():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]  # fmt: skip
    chat = parse_chat_request({"messages": messages, "tools": [{"type": "function", "function": {"name": "calc"}}]})
    assert chat.messages[0] == {"role": "user", "content": "a\nb"}  # vLLM's join of text parts
    # The arguments string an OpenAI client echoes back goes to the template as the object it encodes.
    assert chat.messages[1]["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"x": 1}}
    assert chat.messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"} and chat.parse_tool_calls
    assert not parse_chat_request({"messages": USER, "tools": chat.tools, "tool_choice": "none"}).parse_tool_calls
    for arguments in ("not json", "[1, 2]", {"x": 2}):  # what is no JSON object stays as sent
        call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": arguments}}
        sent = parse_chat_request({"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]})
        assert sent.messages[0]["tool_calls"][0]["function"]["arguments"] == arguments
    developer = parse_chat_request({"messages": [{"role": "developer", "content": "be brief"}, *USER]})
    assert developer.messages[0] == {"role": "system", "content": "be brief"}


def test_a_served_tool_call_sent_back_renders_as_the_model_wrote_it_under_a_tojson_template():
    """Qwen2.5 / Hermes / Llama 3.1 templates write ``arguments | tojson``: a JSON string there would be rendered
    quoted, a form the model never wrote (and the next call's prompt would not extend the recorded ids)."""
    import jinja2

    written = '<tool_call>\n{"name": "calc", "arguments": {"x": "12 * 34"}}\n</tool_call>'
    message, _ = assistant_reply(written, True, "c")
    template = jinja2.Environment().from_string(  # the part of such a template that renders a call
        "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
        " | tojson }}\n</tool_call>{% endfor %}"
    )
    jinja_json = json.dumps  # HF's chat templates' tojson: json.dumps with its default separators
    env = template.environment
    env.policies["json.dumps_function"] = jinja_json
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False}
    chat = parse_chat_request({"messages": [message]})
    assert template.render(m=chat.messages[0]) == written


@pytest.mark.parametrize(("body", "param"), [
    ([], None),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": True}, "n"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": USER, "stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    # parameters a chat template cannot read as a schema: the check the environments' tools go through too
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0]"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": 7, "properties": "x"}}}]}, "tools[0]"),  # fmt: skip
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1]"),  # as a recipe's
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "stop": ["", "x"]}, "stop"),
    ({"messages": USER, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"messages": USER, "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),  # no tools offered
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),  # not streamed
    ({"messages": USER, "stop": ["\ud800"]}, "stop"),  # a lone surrogate: valid JSON, no text; was a 500
    ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": USER, "structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ({"messages": USER, "guided_choice": ["a", "b"]}, "guided_choice"),
    ({"messages": USER, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"messages": USER, "bad_words": ["x"]}, "bad_words"),
    ({"messages": USER, "min_tokens": 4}, "min_tokens"),
    ({"messages": USER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
    ({"messages": USER, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": USER, "echo": True}, "echo"),
    ({"messages": USER, "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    # Not applied, but a value OpenAI refuses is refused: the client has a bug to see.
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "temperature": "0.7"}, "temperature"),
    ({"messages": USER, "temperature": float("nan")}, "temperature"),
    ({"messages": USER, "top_p": 1.5}, "top_p"),
    ({"messages": USER, "presence_penalty": -3}, "presence_penalty"),
    ({"messages": USER, "seed": 1.5}, "seed"),
    ({"messages": USER, "top_k": True}, "top_k"),
    ({"messages": USER, "logit_bias": {"5": -100}}, "logit_bias"),  # a ban, as bad_words: it was silently ignored
    ({"messages": USER, "reasoning_effort": "low"}, "reasoning_effort"),
    ({"messages": USER, "ignore_eos": True}, "ignore_eos"),  # vLLM's: it was silently ignored
    ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": USER, "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"messages": USER, "repetition_penalty": float("inf")}, "repetition_penalty"),
])  # fmt: skip
def test_requests_that_cannot_be_served_exactly_are_refused_naming_the_parameter(body, param):
    with pytest.raises(ProtocolError) as error:
        parse_chat_request(body)
    assert error.value.param == param and error.value.status == 400


def test_replies_carry_well_formed_tool_calls_and_the_text_outside_them():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>'
    message, calls = assistant_reply(f"Let me compute.{call}", True, "call_x")
    assert calls and message["content"] == "Let me compute."
    assert message["tool_calls"] == [{"id": "call_x_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "2 * 3"})}}]  # fmt: skip
    assert assistant_reply(call, True, "c")[0]["content"] is None
    # Without tools offered, or with a malformed call, the model's text comes back untouched.
    assert assistant_reply(call, False, "c") == ({"role": "assistant", "content": call}, False)
    broken = call + "<tool_call>{not json</tool_call>"
    assert assistant_reply(broken, True, "c") == ({"role": "assistant", "content": broken}, False)


def test_the_most_and_longest_stop_strings_served_are_accepted():
    stops = ["x" * MAX_STOP_CHARS] + [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)]
    assert parse_chat_request({"messages": USER, "stop": stops}).stop == stops


def test_parameters_at_the_values_served_as_asked_are_accepted():
    served = {"response_format": {"type": "text"}, "parallel_tool_calls": True, "min_tokens": 0,
              "chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False, "echo": False,
              "functions": [], "bad_words": [], "allowed_token_ids": [], "structured_outputs": None,
              "tool_choice": "none", "stream_options": {}, "logit_bias": {}, "modalities": ["text"],
              "model": "gpt-4o", "user": "u1", "metadata": {"k": "v"}, "store": False,
              "prediction": {"type": "content", "content": "x"}, "prompt_cache_retention": "24h", "request_id": "r",
              "ignore_eos": False}  # nothing asked that is not served
    assert parse_chat_request({"messages": USER, **served}).unknown_params == []
    # Names it does not know are ignored and reported (a 400 failed the episode of any agent framework sending one)
    unknown = {"messages": USER, "max_token": 8, "return_token_ids": True, "x": None}
    assert parse_chat_request(unknown).unknown_params == ["max_token", "return_token_ids"]
    assert parse_chat_request({"messages": USER, "stop_token_ids": [7, 9]}).stop_token_ids == [7, 9]
    assert parse_chat_request({"messages": USER, "tools": []}).tools is None  # no tools, as vLLM takes it
    edges = {"temperature": 2, "top_p": 0.0, "top_k": -1, "seed": 10**400, "frequency_penalty": -2.0}
    # a seed past float's range was an OverflowError: a 500
    assert parse_chat_request({"messages": USER, **edges}).ignored_sampling_params == [
        "temperature", "top_p", "top_k", "seed", "frequency_penalty"]  # fmt: skip


def _call(index, prompt, completion, version=0, choice=0, text=""):
    return AgentCall(index, list(prompt), np.asarray(completion, np.int64), np.full(len(completion), -1.0, np.float32),
                     version, "stop", text, choice)  # fmt: skip


def test_calls_whose_prompts_extend_the_trajectory_make_one_sample_with_observations_masked():
    calls = [_call(0, [1, 2], [3, 4]), _call(1, [1, 2, 3, 4, 9, 9], [5], version=1),
             _call(2, [1, 2, 3, 4, 9, 9, 5, 8], [6])]
    [episode], num_splits = assemble(list(reversed(calls)))  # arrival order, not completion order, decides
    assert num_splits == 0
    assert episode.prompt_ids == [1, 2] and episode.completion_ids.tolist() == [3, 4, 9, 9, 5, 8, 6]
    assert episode.loss_mask.tolist() == [1, 1, 0, 0, 1, 0, 1]
    assert episode.logprobs.tolist() == [-1, -1, 0, 0, -1, 0, -1]
    assert episode.num_turns == 3 and episode.policy_versions == [0, 1, 0]


def test_a_prompt_that_does_not_extend_starts_a_new_sample_and_branches_extend_their_own(caplog, monkeypatch):
    monkeypatch.setattr("rollout.envs.base._warned", set())
    calls = [
        _call(0, [1, 2], [3]),
        _call(1, [1, 2, 7], [4]),            # rewrote the reply: new segment
        _call(2, [1, 2, 3, 5], [6]),         # extends the first
        _call(3, [1, 2, 7, 4, 0], [8]),      # extends the second
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        (a, b), num_splits = assemble(calls)
    assert a.prompt_ids == [1, 2] and a.completion_ids.tolist() == [3, 5, 6] and a.loss_mask.tolist() == [1, 0, 1]
    assert b.prompt_ids == [1, 2, 7] and b.completion_ids.tolist() == [4, 0, 8] and b.loss_mask.tolist() == [1, 0, 1]
    assert num_splits == 1 and assemble([]) == ([], 0)
    # Where the prompt left the conversation is said (once), for an agent author to find the cause.
    assert "call 1 does not extend its conversation so far: its prompt departs at token 2" in caplog.text


def test_the_choices_of_one_call_become_samples_and_the_agent_continues_the_one_it_chose():
    calls = [
        _call(0, [1, 2], [3]),
        _call(1, [1, 2, 3, 9], [4], choice=1),  # choice 1 of call 1 arrives first; choice order decides
        _call(1, [1, 2, 3, 9], [5], choice=0),
        _call(2, [1, 2, 3, 9, 4, 8], [6]),      # the agent went on with choice 1
    ]  # fmt: skip
    (first, other), num_splits = assemble(calls)
    assert num_splits == 0  # another choice is a sample of its own, not a prompt that failed to extend
    assert first.prompt_ids == [1, 2] and first.completion_ids.tolist() == [3, 9, 5] and first.num_turns == 2
    assert first.loss_mask.tolist() == [1, 0, 1]
    # The other choice's prompt is the whole conversation: the earlier turns are trained once, in the first sample.
    assert other.prompt_ids == [1, 2, 3, 9] and other.completion_ids.tolist() == [4, 8, 6]
    assert other.loss_mask.tolist() == [1, 0, 1] and other.num_turns == 2


@pytest.mark.parametrize("calls", [
    [  # two choices, the agent goes on with the first: the other choice's segment begins later
        _call(0, [1, 2], [3], text="first reply"),
        _call(1, [1, 2, 3, 9], [4], text="chosen"), _call(1, [1, 2, 3, 9], [5], choice=1, text="dropped"),
        _call(2, [1, 2, 3, 9, 4, 8], [6], text="final answer"),
    ],
    [  # a side call (another prompt) before the last turn
        _call(0, [1, 2], [3], text="first reply"), _call(1, [7, 7], [8], text="a summary"),
        _call(2, [1, 2, 3, 9], [6], text="final answer"),
    ],
])  # fmt: skip
def test_the_last_sample_is_the_conversation_the_agent_finished(calls):
    *others, final = assemble(calls).episodes
    assert final.final_text == "final answer" and final.prompt_ids == [1, 2] and len(others) == 1


def test_a_stream_sends_growing_text_and_never_what_the_reply_would_contradict():
    plain = ChoiceStream(parse_tool_calls=False)
    assert [plain.update(t) for t in ["He", "Hello", "Hello\ufffd", "Hello w\u00e9", "Hello w\u00e9"]] == [
        "He", "llo", "", " w\u00e9", ""]  # an unfinished character waits until it is whole
    assert plain.finish({"role": "assistant", "content": "Hello w\u00e9!"}) == {"content": "!"}
    assert plain.sent == "Hello w\u00e9!"

    call = '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    tools = ChoiceStream(parse_tool_calls=True)
    sent = [tools.update(t) for t in ["\n", "\nLet me <tool", "\nLet me " + call[:15], "\nLet me " + call]]
    assert sent == ["", "\nLet me ", "", ""]  # whitespace alone and anything that may be a call wait
    message, parsed = assistant_reply("\nLet me " + call + " ok", True, "c")
    assert parsed
    last = tools.finish(message)
    assert last["content"] == " ok" and tools.sent == message["content"]
    assert last["tool_calls"] == [{"index": 0, **message["tool_calls"][0]}]

    only_calls = ChoiceStream(parse_tool_calls=True)
    assert only_calls.update("  " + call) == ""
    message, _ = assistant_reply("  " + call, True, "c")
    assert message["content"] is None and "content" not in only_calls.finish(message)

    broken = ChoiceStream(parse_tool_calls=True)
    assert broken.update("ok <tool_call>{not json") == "ok "
    message, parsed = assistant_reply("ok <tool_call>{not json</tool_call>", True, "c")
    assert not parsed and broken.finish(message) == {"content": "<tool_call>{not json</tool_call>"}


def test_a_reply_ends_before_its_stop_string_and_a_stream_never_sends_one():
    assert cut_at_stop("Subtractue", ["e"]) == "Subtractu"  # the rest of the token it ended in goes too
    assert cut_at_stop("x Observation: 4", ["Obs", "Observation:"]) == "x "
    assert cut_at_stop("no stop here", ["STOP", ""]) == "no stop here"
    # A finished reply: the first occurrence ended generation (a last token "\n\n\n" holds two), except within the
    # min_tokens' text, where the engine checks none.
    assert cut_at_ending_stop("42\n\n\n", "\n\n") == "42"
    assert cut_at_ending_stop("a. b. c", ". ", checked_from=3) == "a. b"
    assert cut_at_ending_stop("a. b. c", ". ", checked_from=2) == "a"  # it ends past the min_tokens' text
    assert cut_at_ending_stop("abc", "x") == "abc"
    react = ChoiceStream(parse_tool_calls=False, stop=["Observation:"])
    sent = [react.update(t) for t in ["Thought: add\nObs", "Thought: add\nObject", "Thought: add\nObject\nObser",
                                       "Thought: add\nObject\nObservation: 4"]]
    assert sent == ["Thought: add\n", "Object", "\n", ""]  # a tail that may become the stop string waits
    assert react.finish({"role": "assistant", "content": "Thought: add\nObject\n"}) == {}


def test_incremental_text_decodes_only_new_ids_and_ends_as_the_whole_decode():
    """A byte-level decode (ids are UTF-8 bytes) of text with 2-4 byte characters, grown 1-3 ids a step: every
    intermediate text is a prefix of the whole decode, never ends inside a character, and the last one equals it;
    each step decodes a window of a few ids, not the whole completion."""
    import random

    rng = random.Random(0)
    text = "".join(rng.choice(["a", " b", "\u00e9", "\u20ac", "\U0001F600", "\n"]) for _ in range(300))
    ids = list(text.encode())
    windows = []

    def decode(part):
        windows.append(len(part))
        return bytes(part).decode("utf-8", errors="replace")

    incremental, end = IncrementalText(decode), 0
    while end < len(ids):
        end = min(len(ids), end + rng.randint(1, 3))
        partial = incremental.update(ids[:end])
        assert text.startswith(partial) and "\ufffd" not in partial
    assert incremental.text == text and max(windows) <= 24 < len(ids) // 20  # a few characters, not the whole
