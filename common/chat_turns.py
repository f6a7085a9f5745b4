"""What a chat template writes around an assistant turn, read from the template itself: whether a tokenizer has one,
the token that ends a turn, and the text after a turn (what a continuation of the conversation starts with).

Works on any HF tokenizer object passed in; imports nothing of transformers itself (the trainer's export and the
rollout workers both ask).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["after_assistant_turn", "end_of_turn_id", "has_chat_template", "tool_list", "turn_end_id"]

_SENTINEL = "\u2063rl-align turn\u2063"  # an assistant turn's text that no template rewrites or meets elsewhere


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


@functools.lru_cache(maxsize=8)
def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token the chat template writes right after an assistant turn (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in
    Llama 3): a model turn that ends with it can be continued by ``rollout.tokenizer.render_continuation``.
    ``ValueError`` when the template writes none (or no special token there)."""
    after = after_assistant_turn(tokenizer, [], None)
    ids = tokenizer.encode(after, add_special_tokens=False)
    if not ids or not _is_special(tokenizer, ids[0]):
        raise ValueError(
            f"the chat template of {getattr(tokenizer, 'name_or_path', '?')} ends an assistant turn with "
            f"{after[:20]!r}, not a special token: multi-turn episodes need a template with an end-of-turn token"
        )
    return int(ids[0])


def _is_special(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bool:
    """Whether ``token_id`` is a special token: one the tokenizer names (eos, pad, additional ones) or an added token
    marked special (Llama 3 lists ``<|eot_id|>`` only there)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    return token_id in set(tokenizer.all_special_ids) or bool(getattr(added, "special", False))


def turn_end_id(tokenizer: PreTrainedTokenizerBase, use_chat_template: bool | None) -> int | None:
    """The token a model turn ends with: with prompts rendered through the chat template (as
    ``rollout.tokenizer.render_prompt`` renders them) the template's end-of-turn token, where it writes one; else the
    tokenizer's end-of-sequence token (None when it has none). They differ for a base model's tokenizer with a chat
    template (Qwen 3 base: ``<|endoftext|>`` ends a text, ``<|im_end|>`` a turn; Llama 3: ``<|end_of_text|>`` and
    ``<|eot_id|>``): the engines stop at this one too, the warm start ends its targets with it, and an export lists it
    among the end-of-sequence ids of its ``generation_config.json``."""
    if use_chat_template is not False and has_chat_template(tokenizer):
        try:
            return end_of_turn_id(tokenizer)
        except ValueError:  # the template ends a turn with plain text: the end-of-sequence token ends it
            pass
    eos = tokenizer.eos_token_id
    return None if eos is None else int(eos)


_Tools = Sequence[Mapping[str, object]]


def after_assistant_turn(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], tools: _Tools | None
                         ) -> str:  # fmt: skip
    """The template's text after a sentinel assistant turn followed by ``messages`` (and, with messages, the
    generation prompt)."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template: multi-turn episodes render "
            "observations with one"
        )
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}, *map(dict, messages)]
    text = tokenizer.apply_chat_template(
        chat, tools=tool_list(tools), tokenize=False, add_generation_prompt=bool(messages)
    )
    assert isinstance(text, str)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ValueError("the chat template drops assistant turns from the history: episodes cannot be continued")
    return text[at + len(_SENTINEL) :]


def tool_list(tools: _Tools | None) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """Tool descriptions as ``apply_chat_template`` takes them (None for none)."""
    return None if not tools else [dict(t) for t in tools]
