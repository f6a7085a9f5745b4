"""A small byte-level BPE tokenizer trained locally, with a ChatML chat template (tool calls included).

Digits are always split one per token (so arithmetic is learnable by a tiny model), every byte is encodable, and the
result saves as a standard HF ``tokenizer.json`` directory that transformers and vLLM load without a hub.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "save_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Pad/end-of-text, and the ChatML turn delimiters; ``<|im_end|>`` is the end-of-sequence token."""

CHAT_TEMPLATE = (
    # With tools, one system message lists them by signature (the caller's system text first) and says how to call
    # one; a tool's result comes back as a "tool" turn. Without tools the rendering is plain ChatML.
    "{% set merge_system = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if merge_system %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools:' }}{% for tool in tools %}"
    "{{ ' ' + tool['function']['name'] + '(' }}"
    # A function without parameters (OpenAI allows leaving them out) lists none.
    "{% set parameters = tool['function']['parameters'] if 'parameters' in tool['function'] else {} %}"
    "{{ ((parameters['properties'] if 'properties' in parameters else {}) | list | join(', ')) + ')' }}"
    "{% endfor %}"
    "{{ '. Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if not (merge_system and loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    # An assistant turn's structured calls (OpenAI form) come back as the text the model writes for them.
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] %}"
    "{{ '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ (f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '}</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the answer is what compute solve add subtract multiply sum of and plus minus times equals question think "
    "step result number first second value total please give final a an to of in is it"
).split()


def _corpus(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"{words.capitalize()}. What is {a} {op} {b}? Answer: {a + b}")
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` entries (specials included) on a generated corpus, deterministically."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least 259 entries")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Write the tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) to
    ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return out
