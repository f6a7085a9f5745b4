"""Load any HF tokenizer from a local directory and turn a prompt (chat messages or plain text) into token ids.

Prompts are rendered the way vLLM's own chat entry point does it: the chat template produces text (with
``add_generation_prompt=True``), and that text is encoded without adding special tokens again, since a template writes
its own BOS and turn markers. One difference: a message's ``content`` is text, never markup. Where it holds a
special token's text (``<|im_end|>`` printed by a tool, pasted by a user), that text is encoded as ordinary characters,
so no message content can end its turn early or forge another (as in OpenAI's API). What else the template writes
(an assistant message's structured ``tool_calls``, the tool descriptions) is encoded as the template wrote it: those
come from the model's own parsed calls and the recipe or agent, not from a tool's output.
Nothing is ever downloaded: the directory must hold the tokenizer files.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.chat_turns import after_assistant_turn, end_of_turn_id, has_chat_template, tool_list
from common.tokenizer_dir import check_tokenizer_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Messages", "PromptLike", "PromptRenderer", "load_tokenizer", "check_prompt", "check_tools", "messages_to_text",
    "render_continuation", "render_prompt", "token_bytes", "tool_description_problem",
]  # fmt: skip

Messages = Sequence[Mapping[str, Any]]
"""Chat messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]``; an assistant
message may carry OpenAI-form ``tool_calls`` (its content then may be ``None``), which the template renders."""
Tools = Sequence[Mapping[str, object]]
"""Tool descriptions in the JSON-schema form chat templates take (``{"type": "function", "function": {...}}``);
:func:`check_tools` says what one must hold."""
_TOOL_SHAPE = ("{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {'type': 'object', "
               "'properties': {...}}}}")  # fmt: skip

_CONTENT = "\u2063rl-align content\u2063"  # stands in for a content holding special-token text (to find its place)
PromptLike = str | Messages
"""A prompt is plain text or a list of chat messages."""

def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer stored in the local directory ``path`` (offline; the tokenizer is returned unchanged).

    Raises as :func:`common.tokenizer_dir.check_tokenizer_dir` does, and ``ValueError`` if transformers cannot load
    the files.
    """
    from transformers import AutoTokenizer

    present = check_tokenizer_dir(path)
    directory = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load the tokenizer in {path!r} (files: {', '.join(present)}): {e}") from e


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: PromptLike,
    use_chat_template: bool | None = None,
    tools: Tools | None = None,
) -> list[int]:
    """Token ids of ``prompt`` as the engine should see it.

    ``use_chat_template``: ``None`` applies the tokenizer's chat template when it has one; ``True`` requires one (a
    ``ValueError`` otherwise); ``False`` never applies it. With the template, plain text becomes one user message and a
    generation prompt is appended. Without it, text is encoded as is (with the tokenizer's usual special tokens, such
    as a BOS) and messages are joined by :func:`messages_to_text`. ``tools`` go to the template (which describes them,
    usually in the system message); they need one.
    """
    check_prompt(prompt)
    template = has_chat_template(tokenizer)
    if use_chat_template and not template:
        raise ValueError(
            f"use_chat_template=true but the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat "
            "template; set use_chat_template=false or use a tokenizer with one (chat_template.jinja, or "
            "chat_template in tokenizer_config.json)"
        )
    if template and use_chat_template is not False:
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        return _encode_rendered(tokenizer, chat, tools, add_generation_prompt=True)
    if tools:
        raise ValueError("tools need a chat template to describe them; this prompt is rendered without one")
    text = prompt if isinstance(prompt, str) else messages_to_text(prompt)
    return list(tokenizer.encode(text, add_special_tokens=True))


class PromptRenderer:
    """:func:`render_prompt` with one tokenizer and ``use_chat_template``, remembering the last ``max_entries``
    prompts (of at most 16k characters as JSON): the episodes of a group render the same messages, and a chat template
    costs more than the engine's own work on a short prompt. Each call returns a new list."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, use_chat_template: bool | None = None, max_entries: int = 1024
    ) -> None:
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self._max_entries = max_entries
        self._rendered: OrderedDict[str, list[int]] = OrderedDict()

    def __call__(self, prompt: PromptLike, tools: Tools | None = None) -> list[int]:
        key = _prompt_key(prompt, tools)
        if key is None:
            return render_prompt(self.tokenizer, prompt, self.use_chat_template, tools)
        ids = self._rendered.get(key)
        if ids is None:
            ids = self._rendered[key] = render_prompt(self.tokenizer, prompt, self.use_chat_template, tools)
            if len(self._rendered) > self._max_entries:
                self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(key)
        return list(ids)


def _prompt_key(prompt: PromptLike, tools: Tools | None) -> str | None:
    """A canonical text of a prompt and its tools (``None`` if they hold anything but JSON values, or are long)."""

    def plain(value: object) -> object:
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, Sequence) and not isinstance(value, str):
            return [plain(v) for v in value]
        if value is None or isinstance(value, str | int | float | bool):
            return value
        raise TypeError(type(value).__name__)

    try:
        key = json.dumps([plain(prompt), plain(tools)], sort_keys=True)
    except TypeError:
        return None
    return key if len(key) <= 16384 else None


def render_continuation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, tools: Tools | None = None
) -> list[int]:
    """Token ids that follow a model turn ended by :func:`end_of_turn_id`: ``messages`` (tool results, user replies)
    rendered by the chat template as the next turns of the conversation, then the generation prompt of the next
    assistant turn.

    Only the new messages are rendered: the episode's ids so far (prompt and generated tokens) are never re-encoded,
    so the next turn's prompt is exactly what came before plus these ids.
    """
    check_prompt(messages)
    eot = str(tokenizer.decode([end_of_turn_id(tokenizer)]))

    def render(chat: list[dict[str, Any]]) -> str:
        after = after_assistant_turn(tokenizer, chat, tools)
        assert after.startswith(eot)
        return after[len(eot) :]

    return _encode_chat(tokenizer, [dict(m) for m in messages], render)


def _encode_rendered(
    tokenizer: PreTrainedTokenizerBase, chat: list[dict[str, Any]], tools: Tools | None, add_generation_prompt: bool
) -> list[int]:
    def render(chat: list[dict[str, Any]]) -> str:
        text = tokenizer.apply_chat_template(
            chat, tools=tool_list(tools), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(text, str)
        return text

    return _encode_chat(tokenizer, chat, render)


def _encode_chat(
    tokenizer: PreTrainedTokenizerBase, chat: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]
) -> list[int]:
    """Ids of ``render(chat)`` (the template's text for ``chat``), with each message content that holds a special
    token's text encoded as ordinary text (``split_special_tokens``) and the rest as the template wrote it.

    A content's place in the text is found by rendering once more with a stand-in for it: the text before and after
    the stand-in is the template's, and what lies between them in the real rendering is the content as the template
    wrote it (escaped, trimmed). ``ValueError`` when the template's own text depends on the content (its text around
    the stand-in is not around the content), so the content's place cannot be told."""
    text = render(chat)
    specials = _special_pattern(tokenizer)
    spans = []
    for i, message in enumerate(chat):
        content = message.get("content")
        if not (isinstance(content, str) and specials is not None and specials.search(content)):
            continue  # the usual case: no special-token text, encoded as the template wrote it
        stood = render([*chat[:i], {**message, "content": _CONTENT}, *chat[i + 1 :]])
        before, stand_in, after = stood.partition(_CONTENT)
        if not stand_in or _CONTENT in after or not (
            text.startswith(before) and text.endswith(after) and len(before) + len(after) <= len(text)
        ):
            raise ValueError(
                f"the chat template of {getattr(tokenizer, 'name_or_path', '?')} writes a message holding a special "
                f"token's text ({content[:60]!r}) in a way that cannot be told apart from its own markup; remove the "
                "special token's text from the message"
            )
        spans.append((len(before), len(text) - len(after)))
    ids: list[int] = []
    pos = 0
    for start, end in sorted(spans):
        if start < pos:
            raise ValueError("two messages holding special-token text overlap in the rendered chat")
        ids += tokenizer.encode(text[pos:start], add_special_tokens=False)
        ids += tokenizer.encode(text[start:end], add_special_tokens=False, split_special_tokens=True)
        pos = end
    return ids + list(tokenizer.encode(text[pos:], add_special_tokens=False))


@functools.lru_cache(maxsize=8)
def _special_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern[str] | None:
    """Matches the text of any special token (what an encode turns into that token wherever the text occurs)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    texts = [t.content for t in added.values() if getattr(t, "special", False)] or list(tokenizer.all_special_tokens)
    texts = sorted({t for t in texts if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def token_bytes(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[bytes]:
    """The bytes each of ``ids`` stands for: a token inside a multi-byte character has only its own bytes, which no
    decode of it alone shows (it decodes to U+FFFD). Byte-level BPE pieces (Qwen, Llama 3, GPT-2) map character by
    character to bytes; byte-fallback pieces (``<0xE9>``, SentencePiece) are that byte; tiktoken-style pieces are bytes
    already; special tokens and any other piece are their text's UTF-8."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = {int(i) for i in tokenizer.added_tokens_decoder}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
    out: list[bytes] = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids)), strict=True):
        if isinstance(piece, bytes):  # tiktoken-style tokenizers: the piece is its bytes
            out.append(piece)
        elif int(i) in special or not isinstance(piece, str):
            out.append(str(tokenizer.decode([int(i)])).encode())
        elif byte_level and all(c in byte_of for c in piece):
            out.append(bytes(byte_of[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out


def messages_to_text(messages: Messages) -> str:
    """Plain-text rendering of chat messages for tokenizers without a template: contents joined by blank lines."""
    return "\n\n".join(m["content"] or "" for m in messages)


def check_prompt(prompt: PromptLike) -> None:
    """Raise ``ValueError`` unless ``prompt`` is text or a non-empty list of well-formed chat messages."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, Sequence) or not prompt:
        raise ValueError(f"a prompt must be text or a non-empty list of chat messages, got {type(prompt).__name__}")
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"chat message {i} must be a mapping with a string 'role', got {message!r}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(
                f"chat message {i} must have a string 'content' (or none, with 'tool_calls'), got {message!r}"
            )


def tool_description_problem(tool: object) -> str | None:
    """What makes ``tool`` no tool description a chat template takes, as the rest of a sentence about it (``" is a
    str, not a mapping: ..."``, ``"['function']['name'] is None, ..."``), or ``None`` when it is one: a mapping
    ``{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}`` (OpenAI's form, which
    transformers' ``get_json_schema`` writes and templates read) with a non-empty string name, text for a description
    and a JSON-schema object for parameters when given (a function without parameters is valid)."""
    if not isinstance(tool, Mapping):
        return f" is a {_type_name(tool)}, not a mapping: give a tool description, {_TOOL_SHAPE}"
    if tool.get("type") != "function":
        return f"['type'] is {tool.get('type')!r}, not 'function': a tool description is {_TOOL_SHAPE}"
    function = tool.get("function")
    if not isinstance(function, Mapping):
        return f"['function'] is a {_type_name(function)}, not a mapping: a tool description is {_TOOL_SHAPE}"
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return f"['function']['name'] is {name!r}, not a non-empty string: the name the model calls the tool by"
    if function.get("description") is not None and not isinstance(function["description"], str):
        return f"['function']['description'] is a {_type_name(function['description'])}, not text"
    parameters = function.get("parameters", {})
    schema = "a JSON schema object ({'type': 'object', 'properties': {...}, 'required': [...]})"
    if not isinstance(parameters, Mapping):
        return f"['function']['parameters'] is a {_type_name(parameters)}, not {schema}"
    if parameters.get("type", "object") != "object" or not isinstance(parameters.get("properties", {}), Mapping):
        return (f"['function']['parameters'] has type {parameters.get('type')!r} and properties of type "
                f"{_type_name(parameters.get('properties', {}))}: the arguments are {schema}")  # fmt: skip
    return None


def check_tools(tools: object) -> None:
    """Raise ``ValueError`` naming the entry and what is wrong unless ``tools`` is ``None`` or a list of tool
    descriptions (:func:`tool_description_problem`), each of its own name and all JSON (templates write them with
    ``tojson``)."""
    if tools is None:
        return
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise ValueError(f"tools is a {_type_name(tools)}, not a list: give a list of tool descriptions, each "
                         f"{_TOOL_SHAPE}")  # fmt: skip
    names: set[str] = set()
    for j, tool in enumerate(tools):
        problem = tool_description_problem(tool)
        if problem is not None:
            raise ValueError(f"tools[{j}]{problem}")
        name = tool["function"]["name"]
        if name in names:
            raise ValueError(f"tools[{j}] is a second tool named {name!r}: describe each tool once")
        names.add(name)
        try:
            json.dumps(tool, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tools[{j}] is not JSON ({e}): a tool description holds JSON values only") from None


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
