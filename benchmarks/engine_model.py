"""The model the engine benchmarks generate with: a random-initialised Qwen 3 of a shape set on the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_model_args", "make_model"]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model-shape flags: hidden size, layers, heads, intermediate size, dtype (default: ~40M, bf16)."""
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=10)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")


def make_model(args: argparse.Namespace, out: Path) -> str:
    """Write the model of ``args`` (and a tiny tokenizer) to ``out``; return the directory."""
    from tools.make_tiny_model import make_tiny_model

    return str(make_tiny_model(
        out, family="qwen3", dtype=args.dtype, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, intermediate_size=args.intermediate_size,
    ))  # fmt: skip
