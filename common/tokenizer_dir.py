"""Which files of a local directory make an HF tokenizer: the check a run starts with (before anything imports
transformers) and what an export copies."""

from __future__ import annotations

from pathlib import Path

__all__ = ["TOKENIZER_FILES", "check_tokenizer_dir"]

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
            f"{', '.join(_VOCABULARY_FILES)}); save the tokenizer there with tokenizer.save_pretrained(DIR)"
        )
    return present
