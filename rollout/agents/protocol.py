"""The OpenAI chat-completions wire form the agent endpoint speaks: requests read and checked, replies built.

Only what a training endpoint can honour exactly is accepted. Messages (text content, text parts joined by
newlines as vLLM joins them, assistant ``tool_calls``, ``tool`` results; the ``developer`` role is ``system``),
``tools`` with ``tool_choice`` "auto" or "none", ``max_tokens`` / ``max_completion_tokens`` (capped by the recipe),
``stop`` (up to :data:`MAX_STOP_STRINGS` strings of :data:`MAX_STOP_CHARS` characters), vLLM's ``stop_token_ids``,
``n`` (up to :data:`MAX_CHOICES` completions of one prompt, each trained on) and
``logprobs`` (each generated token's log-prob under the sampling distribution, the one the trainer is given; no
``top_logprobs`` alternatives, which the engine does not keep) are honoured. The sampling distribution is the
recipe's, so the trainer computes the log-probs of the distribution the tokens came from: ``temperature``, ``top_p``,
``seed`` and the penalties a client sends are not applied (each request that sends one counts in
``agent/ignored_sampling_params``), though a value outside OpenAI's range is refused as OpenAI refuses it, so a client's
bug shows. ``tools: []`` is no tools, as vLLM takes it. ``model`` may name any model (the policy answers: an agent
written for another server runs unchanged); parameters that leave the reply's tokens as they are (``user``,
``metadata``, ``store``, ``prediction``, ...) are accepted, and a parameter the endpoint does not know is ignored but
reported (``agent/unknown_params`` and a warning per name: a misspelt ``max_token`` shows), since agent frameworks send
fields of their own and a refusal fails the episode. What cannot be served as asked
is refused with status 400 and an OpenAI error body naming the parameter (:data:`_REFUSED`): forced tool choices,
``parallel_tool_calls = false`` (the model may write several calls in a turn), ``top_logprobs``, structured output,
``logit_bias`` and vLLM's constrained decoding, ``min_tokens``, ``ignore_eos``, beam search, audio replies,
``reasoning_effort``, prompt shaping
the endpoint does not apply (``chat_template_kwargs``, ``continue_final_message``, ``add_generation_prompt = false``),
vLLM's reply options (``echo``, ``include_stop_str_in_output``, ...), non-text
content parts. ``stream`` replies come as server-sent ``chat.completion.chunk`` events
(:mod:`rollout.agents.streaming`), with a usage chunk when ``stream_options.include_usage`` is set.

Tool calls in the reply are read from the model's text in the Qwen / Hermes form (``<tool_call>{...}</tool_call>``,
:func:`rollout.envs.tools.parse_tool_calls`) when the request offers tools; the reply's ``content`` is the text
outside the calls. A turn whose calls do not all parse is returned as plain text, so the agent sees what the model
wrote. Arguments are returned as ``json.dumps`` writes them (the spacing of a template's ``tojson``), so a template
renders a call back as the model wrote it when the model wrote standard JSON; a call the client sends back has its
``arguments`` string parsed into an object for the template (as vLLM does), since templates that write ``arguments |
tojson`` would otherwise render the JSON as a quoted string the model never wrote.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.tokenizer import check_tools

__all__ = [
    "MAX_CHOICES", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "ChatRequest", "ProtocolError", "assistant_reply",
    "chat_chunk", "chat_completion", "cut_at_ending_stop", "cut_at_stop", "error_body", "parse_chat_request",
    "token_logprobs",
]  # fmt: skip

MAX_CHOICES = 16
"""The most completions one call may ask for (``n``): each is a training sample."""
MAX_STOP_STRINGS = 16
"""The most ``stop`` strings one call may give (OpenAI's API takes 4)."""
MAX_STOP_CHARS = 256
"""The longest ``stop`` string: a stream checks every step whether its text ends in the start of one."""

_ROLES = ("system", "developer", "user", "assistant", "tool")
_SAMPLING_PARAMS: dict[str, tuple[type, float | None, float | None]] = {
    # name: (type, lowest, highest), OpenAI's and vLLM's ranges; a value outside them is a client's bug, refused
    # though the value itself is not applied
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.0, 1.0),
    "top_k": (int, -1, None),
    "min_p": (float, 0.0, 1.0),
    "seed": (int, None, None),
    "presence_penalty": (float, -2.0, 2.0),
    "frequency_penalty": (float, -2.0, 2.0),
    "repetition_penalty": (float, 1e-9, 1e9),  # vLLM: finite and above 0
}
_CONSTRAINED = "constrained decoding changes the sampled distribution, so the trainer could not reproduce its log-probs"
_NOT_APPLIED = "the endpoint renders every call with the model's chat template as it is, and does not apply it"
_REFUSED: dict[str, tuple[object, str]] = {
    # name: (the one value that is served as asked, why any other is refused)
    "response_format": ({"type": "text"}, _CONSTRAINED),
    "structured_outputs": (None, _CONSTRAINED),
    "guided_json": (None, _CONSTRAINED),
    "guided_regex": (None, _CONSTRAINED),
    "guided_choice": (None, _CONSTRAINED),
    "guided_grammar": (None, _CONSTRAINED),
    "allowed_token_ids": (None, _CONSTRAINED),
    "bad_words": (None, _CONSTRAINED),
    "logit_bias": (None, _CONSTRAINED),
    "min_tokens": (0, "it bans the end of a turn, changing the sampled distribution; rollout.sampling.min_tokens in "
                      "the recipe applies one to every call"),
    "parallel_tool_calls": (True, "the model may write several calls in one turn, and stopping it would change the "
                                  "sampled distribution; handle every call of a reply"),
    "chat_template_kwargs": ({}, _NOT_APPLIED),
    "continue_final_message": (False, _NOT_APPLIED + " (every call ends with a new assistant turn)"),
    "add_generation_prompt": (True, _NOT_APPLIED + " (every call ends with a new assistant turn)"),
    "echo": (False, "replies hold the generated text only"),
    "include_stop_str_in_output": (False, "replies end before the stop string, as OpenAI's do"),
    "skip_special_tokens": (True, "replies drop special tokens"),
    "prompt_logprobs": (None, "the engine does not compute prompt log-probs"),
    "functions": (None, "the legacy 'functions' parameter is not served; pass 'tools' instead"),
    "function_call": (None, "the legacy 'function_call' parameter is not served; pass 'tool_choice' instead"),
    "modalities": (["text"], "replies are text"),
    "audio": (None, "replies are text"),
    "web_search_options": (None, "the endpoint has no search tool; offer one through 'tools'"),
    "reasoning_effort": (None, _NOT_APPLIED),
    "verbosity": (None, _NOT_APPLIED),
    # vLLM's own request fields that change the tokens or the prompt
    "ignore_eos": (False, "it bans the end of a turn, changing the sampled distribution"),
    "use_beam_search": (False, "beam search is not sampling: the trainer could not reproduce its log-probs"),
    "length_penalty": (1.0, "beam search is not sampling: the trainer could not reproduce its log-probs"),
    "chat_template": (None, _NOT_APPLIED + " (the model's own template renders every call)"),
    "add_special_tokens": (False, _NOT_APPLIED + " (the template writes its own special tokens)"),
    "truncate_prompt_tokens": (None, "a prompt is never cut: a call past the context is refused instead"),
}
"""Parameters served only at one value (unset is that value too); any other is refused with 400 naming it."""
_READ = frozenset({
    "messages", "model", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stop", "stop_token_ids", "n",
    "logprobs", "top_logprobs", "stream", "stream_options",
})
"""The parameters :func:`parse_chat_request` reads."""
_NO_EFFECT = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "moderation", "prediction", "request_id", "priority", "cache_salt",
})
"""Parameters (OpenAI's, vLLM's) that do not change a reply's tokens (bookkeeping, caching, scheduling, latency
hints): accepted as they are. Any other name the endpoint does not know is ignored too, but reported
(:attr:`ChatRequest.unknown_params`): clients and agent frameworks send fields of their own, and a 400 would fail the
episode."""
_KNOWN = frozenset({*_READ, *_NO_EFFECT, *_REFUSED, *_SAMPLING_PARAMS})


class ProtocolError(ValueError):
    """A request the endpoint refuses; :func:`error_body` is its OpenAI-form answer."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request."""

    messages: list[dict[str, Any]]
    """The conversation, content parts joined into text; passed to the chat template as is."""
    tools: list[dict[str, Any]] | None
    """Tool descriptions (``{"type": "function", "function": {...}}``) for the template, or ``None``."""
    parse_tool_calls: bool
    """Read tool calls out of the reply (tools offered, ``tool_choice`` not "none")."""
    max_tokens: int | None
    """The client's cap on generated tokens (the recipe's applies too)."""
    stop: list[str]
    """The client's stop strings (added to the recipe's)."""
    stop_token_ids: list[int]
    """The client's stop token ids (vLLM's parameter; added to the recipe's)."""
    ignored_sampling_params: list[str]
    """Sampling parameters the client sent that the recipe's settings override."""
    unknown_params: list[str]
    """Parameters the endpoint does not know, which it ignores (``agent/unknown_params``, a warning per name)."""
    n: int = 1
    """Completions to sample (``choices``)."""
    logprobs: bool = False
    """Return each generated token's log-prob (``choices[i].logprobs.content``)."""
    stream: bool = False
    """Reply as server-sent chunks."""
    include_usage: bool = False
    """A streamed reply ends with a usage chunk (``stream_options.include_usage``)."""


def parse_chat_request(body: object) -> ChatRequest:
    """Check a decoded JSON request body; ``ProtocolError`` names the first thing wrong."""
    if not isinstance(body, Mapping):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, (served, why) in _REFUSED.items():
        value = body.get(name)
        if value is not None and value != served and not (served is None and value in ([], {})):  # empty: unset
            raise ProtocolError(f"{name} = {_shown(value)}: {why}", param=name, code="unsupported_parameter")
    n = body.get("n")
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ProtocolError(
            f"n = {n!r} must be an integer from 1 to {MAX_CHOICES} (every choice is a sample the trainer learns from)",
            param="n",
        )  # fmt: skip
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "none") and not tools:  # "none" without tools says nothing wrong (vLLM takes it)
        raise ProtocolError("tool_choice is set but no tools are offered: pass tools, or leave tool_choice unset",
                            param="tool_choice")  # fmt: skip
    if choice not in (None, "auto", "none"):
        raise ProtocolError(
            f"tool_choice = {choice!r}: the engine cannot force a call without changing the sampled distribution; "
            "use 'auto' (the model decides) or 'none'",
            param="tool_choice", code="unsupported_parameter",
        )  # fmt: skip
    return ChatRequest(
        messages=messages,
        tools=tools,
        parse_tool_calls=bool(tools) and choice != "none",
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        ignored_sampling_params=_ignored_sampling_params(body),
        unknown_params=sorted(str(k) for k in body if body[k] is not None and k not in _KNOWN),
        n=n,
        logprobs=_logprobs(body),
        stream=_flag(body, "stream"),
        include_usage=_stream_options(body),
    )


def _ignored_sampling_params(body: Mapping[str, Any]) -> list[str]:
    """The sampling parameters the client sent (each checked against its type and range, as OpenAI and vLLM check
    them), which the recipe's settings override."""
    sent = []
    for name, (kind, low, high) in _SAMPLING_PARAMS.items():
        value = body.get(name)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if kind is dict:
            ok = isinstance(value, Mapping)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool) or (number and value.is_integer())
        else:
            ok = number and value == value  # not NaN
        ok = ok and (low is None or value >= low) and (high is None or value <= high)
        if not ok:
            kind_name = {dict: "an object", int: "an integer", float: "a number"}[kind]
            bounds = "" if low is None else f" of at least {low:g}" if high is None else f" from {low:g} to {high:g}"
            raise ProtocolError(f"{name} = {_shown(value)} must be {kind_name}{bounds}", param=name)
        sent.append(name)
    return sent


def _stream_options(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage``; the options belong to a streamed reply only (OpenAI and vLLM refuse them
    otherwise)."""
    options = body.get("stream_options")
    if options and not _flag(body, "stream"):
        raise ProtocolError("stream_options is set for a reply that is not streamed: set stream = true, or leave "
                            "stream_options unset", param="stream_options")  # fmt: skip
    return _flag(options or {}, "include_usage", "stream_options.")


def _logprobs(body: Mapping[str, Any]) -> bool:
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise ProtocolError(
            f"top_logprobs = {top!r}: the engine keeps the sampled token's log-prob only; ask for logprobs = true "
            "with top_logprobs = 0 (or unset)",
            param="top_logprobs", code="unsupported_parameter",
        )  # fmt: skip
    return _flag(body, "logprobs")


def _flag(body: object, name: str, where: str = "") -> bool:
    if not isinstance(body, Mapping):
        raise ProtocolError(f"{where.rstrip('.')} must be an object", param=where.rstrip("."))
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(f"{where}{name} = {value!r} must be true or false", param=where + name)
    return bool(value)


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ProtocolError("messages must be a non-empty list of chat messages", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ProtocolError(f"{where} must be an object, got {type(message).__name__}", param=where)
        role = message.get("role")
        if role not in _ROLES:
            raise ProtocolError(f"{where}.role = {_shown(role)}: expected one of {', '.join(_ROLES)}",
                                param=f"{where}.role")  # fmt: skip
        role = "system" if role == "developer" else role  # OpenAI's newer name for system instructions
        checked: dict[str, Any] = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
        if role == "assistant" and message.get("tool_calls"):
            checked["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        elif checked["content"] is None:
            raise ProtocolError(f"{where} has no content", param=f"{where}.content")
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                checked[key] = message[key]
        out.append(checked)
    return out


def _content(value: object, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError(
                    f"{where}[{j}]: only text content parts ({{'type': 'text', 'text': ...}}) are served",
                    param=f"{where}[{j}]", code="unsupported_parameter",
                )  # fmt: skip
            texts.append(part["text"])
        return "\n".join(texts)
    raise ProtocolError(f"{where} must be text or a list of text parts, got {type(value).__name__}", param=where)


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ProtocolError(f"{where} must be a list", param=where)
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not isinstance(
            function.get("arguments"), str | Mapping
        ):
            raise ProtocolError(
                f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                param=f"{where}[{j}]",
            )  # fmt: skip
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": _arguments(function["arguments"])}})
    return calls


def _arguments(value: str | Mapping[str, Any]) -> object:
    """A call's arguments as the chat template gets them: a JSON object string (what OpenAI clients echo back) parsed,
    anything else as sent."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _tools(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ProtocolError("tools must be a list of {'type': 'function', 'function': {...}}", param="tools")
    try:
        check_tools(value)  # as a recipe's tools are: each a description, of a name of its own
    except ValueError as e:
        entry = re.match(r"tools\[\d+\]", str(e))
        raise ProtocolError(str(e), param=entry.group(0) if entry else "tools") from None
    return [dict(t) for t in value] or None


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ProtocolError(f"{name} = {value!r} must be a positive integer", param=name)
        return value
    return None


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError("stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ProtocolError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are served", param="stop")
    if too_long := [s for s in stops if len(s) > MAX_STOP_CHARS]:
        raise ProtocolError(
            f"a stop string has {len(too_long[0])} characters; at most {MAX_STOP_CHARS} are served", param="stop"
        )
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\\ud800" in the JSON): no generated text can hold it
            raise ProtocolError(f"stop string {_shown(s)} is not valid Unicode text", param="stop") from None
    return list(stops)


def _stop_token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):  # fmt: skip
        raise ProtocolError("stop_token_ids must be a list of token ids (non-negative integers)",
                            param="stop_token_ids")  # fmt: skip
    if len(value) > MAX_STOP_STRINGS * 16:
        raise ProtocolError(f"stop_token_ids has {len(value)} ids; at most {MAX_STOP_STRINGS * 16} are served",
                            param="stop_token_ids")  # fmt: skip
    return list(value)


def _shown(value: object) -> str:
    """A client's value as an error message quotes it: its repr, at most 200 characters."""
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first of the ``stop`` strings (all of it when none occurs): what a stream may send so far,
    since a reply does not include the stop sequence that ended it, nor the rest of its token (OpenAI's API). The
    finished reply is cut where generation did stop (``Completion.stop_string``), which ``min_tokens`` may put
    past an earlier occurrence."""
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[: min(found)] if found else text


def cut_at_ending_stop(text: str, stop: str, checked_from: int = 0) -> str:
    """A finished reply's text: ``text`` before the occurrence of ``stop`` that ended generation, which is the first
    one to end past ``checked_from`` characters (the text of the ``min_tokens`` tokens, where the engine checks no stop
    string, as vLLM does); all of ``text`` when there is none."""
    i = text.find(stop, max(0, checked_from - len(stop) + 1))
    return text[:i] if i >= 0 else text


def assistant_reply(text: str, parse_tool_calls: bool, call_id: str) -> tuple[dict[str, Any], bool]:
    """The reply message for the model's ``text`` and whether it calls tools; calls get ids ``{call_id}_{k}``."""
    from rollout.envs.tools import parse_tool_calls as parse
    from rollout.envs.tools import strip_tool_calls

    calls = parse(text) if parse_tool_calls else []
    if not calls or any(c.error is not None for c in calls):
        return {"role": "assistant", "content": text}, False
    content = strip_tool_calls(text)
    return {
        "role": "assistant",
        "content": content if content.strip() else None,
        "tool_calls": [
            {"id": f"{call_id}_{k}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for k, c in enumerate(calls)
        ],  # fmt: skip
    }, True


def token_logprobs(tokens: Sequence[bytes], logprobs: Sequence[float]) -> dict[str, Any]:
    """A choice's ``logprobs`` object: one entry per generated token, given as its bytes (``rollout.tokenizer.
    token_bytes``): its text (U+FFFD for a part of a character), log-prob and bytes."""
    return {"content": [
        {"token": t.decode("utf-8", errors="replace"), "logprob": float(lp), "bytes": list(t), "top_logprobs": []}
        for t, lp in zip(tokens, logprobs, strict=True)
    ]}  # fmt: skip


def chat_completion(
    completion_id: str,
    model: str,
    choices: list[tuple[dict[str, Any], str, dict[str, Any] | None]],
    prompt_tokens: int,
    completion_tokens: int,
    policy_version: int,
) -> dict[str, Any]:
    """The ``chat.completion`` object of one reply: ``choices`` are (message, finish reason, logprobs or ``None``) in
    index order, the reason "stop", "length" or "tool_calls"; ``completion_tokens`` counts all of them. The weights
    version that sampled them rides along as ``policy_version`` (OpenAI clients keep unknown fields)."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}
                    for i, (message, finish, logprobs) in enumerate(choices)],  # fmt: skip
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},  # fmt: skip
        "policy_version": policy_version,
    }


def chat_chunk(
    completion_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: tuple[int, int] | None = None,
    policy_version: int | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a streamed reply: ``choices`` are ``{"index", "delta", "finish_reason"}``
    entries; ``usage`` (prompt tokens, completion tokens) for the closing usage chunk (no choices). A chunk that
    ends a choice carries ``policy_version``."""
    chunk: dict[str, Any] = {
        "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"logprobs": None, "finish_reason": None, **c} for c in choices],
    }  # fmt: skip
    if usage is not None:
        chunk["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    if policy_version is not None:
        chunk["policy_version"] = policy_version
    return chunk


def error_body(message: str, param: str | None = None, code: str = "invalid_request") -> dict[str, Any]:
    """OpenAI's error object (what its clients raise from)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
