"""Which files of a local directory make an HF tokenizer: the check a run starts with (before anything imports
transformers) and what an export copies."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "check_tokenizer_dir", "has_chat_template_file", "tokenizer_num_ids"]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "qwen.tiktoken", "tiktoken.model",
)  # fmt: skip
"""Files of an HF model or tokenizer directory that make up its tokenizer (an export copies those present)."""
_VOCABULARY_FILES = (
    "tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
    "qwen.tiktoken", "tiktoken.model",
)  # fmt: skip
"""A tokenizer's vocabulary is in one of these (fast, SentencePiece, byte-level BPE, WordPiece, tiktoken): a directory
without any holds no tokenizer, whatever else it has (a ``tokenizer_config.json`` alone)."""


def check_tokenizer_dir(path: str | Path) -> list[str]:
    """The :data:`TOKENIZER_FILES` in the local directory ``path`` (checked without importing transformers, so a run
    can refuse a directory before it starts anything, and an export copies them). Raises ``FileNotFoundError`` if
    ``path`` is not a directory and ``ValueError`` if it holds no vocabulary file."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {str(path)!r} does not exist (give a local HF model or tokenizer directory; "
            "`python -m tools.make_tiny_model --out DIR` writes a tiny one)"
        )
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not set(_VOCABULARY_FILES) & set(present):
        raise ValueError(
            f"tokenizer directory {str(path)!r} has no tokenizer files (expected one of "
            f"{', '.join(_VOCABULARY_FILES)}); save the tokenizer there with tokenizer.save_pretrained(DIR), or point "
            "rollout.tokenizer_path at the directory that holds it"
        )
    return present


def has_chat_template_file(path: str | Path) -> bool:
    """Whether the tokenizer directory ``path`` carries a chat template (``chat_template.jinja``,
    ``chat_template.json``, or ``chat_template`` in ``tokenizer_config.json``), read from its files."""
    directory = Path(path)
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def tokenizer_num_ids(path: str | Path) -> int | None:
    """One more than the largest token id the tokenizer in ``path`` can produce (its vocabulary and added tokens),
    read from ``tokenizer.json``; None when the directory has none (another format) or it cannot be read."""
    try:
        data = json.loads((Path(path) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    if isinstance(vocab, dict):
        largest = max((i for i in vocab.values() if isinstance(i, int)), default=-1)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the place
        largest = len(vocab) - 1
    else:
        return None
    added = [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    return max([largest, *(i for i in added if isinstance(i, int))]) + 1
