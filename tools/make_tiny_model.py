"""Write a randomly initialised HF model directory (config, safetensors, tokenizer) that transformers and vLLM load:
a tiny one, or one of a published architecture's real sizes (``common.published``; optionally fewer blocks or
experts) for measuring memory and time at size.

Usage::

    python -m tools.make_tiny_model --family qwen3 --out artifacts/tiny-qwen3
    python -m tools.make_tiny_model --family qwen3_moe --out /tmp/m --hidden-size 128 --num-layers 2
    python -m tools.make_tiny_model --published Qwen3-0.6B --out /tmp/qwen3-0.6b

The weights come from transformers' own model classes (an implementation independent of ours), seeded, so the same
arguments always give the same bytes. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from common.config import Family
from common.published import PUBLISHED_CONFIGS, published_fields
from tools.tiny_tokenizer import build_tokenizer, save_tokenizer

__all__ = ["FAMILIES", "make_published_model", "make_tiny_model"]

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

FAMILIES: tuple[str, ...] = get_args(Family)


def _hf_config(family: str, vocab_size: int, eos_id: int, pad_id: int, **arch: Any) -> PreTrainedConfig:
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    def rope(default_theta: float) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": arch.pop("rope_theta", default_theta)}

    hidden = arch.pop("hidden_size", 64)
    num_layers = arch.pop("num_layers", 2)
    num_heads = arch.pop("num_heads", 4)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=arch.pop("intermediate_size", 2 * hidden),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=arch.pop("num_kv_heads", max(1, num_heads // 2)),
        # vLLM's CPU attention rejects head_dim 16; 32 is the smallest size it takes.
        head_dim=arch.pop("head_dim", max(32, hidden // num_heads)),
        max_position_embeddings=arch.pop("max_position_embeddings", 1024),
        rms_norm_eps=1e-6,
        tie_word_embeddings=arch.pop("tie_word_embeddings", True),
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    cfg: PreTrainedConfig
    if family == "qwen3":
        cfg = Qwen3Config(rope_parameters=rope(10000.0), **common)
    elif family == "llama3":
        cfg = LlamaConfig(rope_parameters=rope(500000.0), **common)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            rope_parameters=rope(10000.0),
            num_experts=arch.pop("num_experts", 4),
            num_experts_per_tok=arch.pop("top_k", 2),
            moe_intermediate_size=arch.pop("moe_intermediate_size", hidden),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if arch:
        raise ValueError(f"unknown architecture arguments for {family}: {sorted(arch)}")
    return cfg


def make_tiny_model(
    out_dir: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "float32",
    **arch: Any,
) -> Path:
    """Create ``out_dir`` with a tiny ``family`` model and the project's tiny tokenizer; return the directory.

    ``arch`` takes hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, rope_theta,
    tie_word_embeddings, max_position_embeddings, and for qwen3_moe num_experts, top_k, moe_intermediate_size.
    """
    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    model_vocab = -(-len(tokenizer) // 64) * 64  # round up: padded vocab rows, as real checkpoints have
    config = _hf_config(family, model_vocab, tokenizer.eos_token_id, tokenizer.pad_token_id, **arch)
    return _save_random_model(Path(out_dir), config, tokenizer, seed, dtype)


def make_published_model(
    out_dir: str | Path,
    architecture: str,
    seed: int = 0,
    dtype: str = "bfloat16",
    num_layers: int | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Create ``out_dir`` with a random model of the published ``architecture`` (a key of ``PUBLISHED_CONFIGS``):
    its real widths and vocabulary, ``num_layers`` blocks, (MoE) ``num_experts`` experts and ``vocab_size`` rows
    when given (fewer than published, for a reduced model of the real layer shapes), and the project's tiny tokenizer
    (its ids are the first rows of the vocabulary). Return the directory. Raises ``ValueError`` for an unknown
    architecture, an expert count below the architecture's top-k (``common.published.published_fields``) or a
    vocabulary smaller than the tokenizer's."""
    from transformers import AutoConfig

    fields = published_fields(architecture, num_layers, num_experts, vocab_size)
    tokenizer = build_tokenizer(seed=seed)
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size = {fields['vocab_size']} is below the tokenizer's {len(tokenizer)} tokens")
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    return _save_random_model(Path(out_dir), config, tokenizer, seed, dtype)


def _save_random_model(out: Path, config: PreTrainedConfig, tokenizer: Any, seed: int, dtype: str) -> Path:
    """Initialise transformers' model of ``config`` from ``seed`` and write it with ``tokenizer`` to ``out``.

    The files are written beside ``out`` first and moved in with ``config.json`` last, so a reader that takes a
    ``config.json`` for a model (``driver.preflight.ensure_model``) never finds half of one: two jobs creating the
    same model at once each move in the same bytes."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        save_tokenizer(tokenizer, staging)
        out.mkdir(exist_ok=True)
        for path in sorted(staging.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write (created)")
    parser.add_argument("--family", choices=FAMILIES, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None, help="tiny: tokenizer vocabulary, default 512 (model "
                        "rounds up to 64); --published: fewer vocabulary rows than published")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=None, help="blocks (tiny default: 2)")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--published", choices=sorted(PUBLISHED_CONFIGS), help="a published architecture's real sizes "
                        "instead (--num-layers / --num-experts, when given, reduce it; --seed and --dtype apply)")
    parser.add_argument("--num-experts", type=int, default=None, help="with --published MoE: fewer experts")
    args = parser.parse_args(argv)
    if args.published:
        print(make_published_model(args.out, args.published, args.seed, args.dtype, args.num_layers, args.num_experts,
                                   args.vocab_size))
        return
    out = make_tiny_model(
        args.out, args.family, seed=args.seed, vocab_size=args.vocab_size or 512, dtype=args.dtype,
        hidden_size=args.hidden_size, num_layers=args.num_layers or 2, num_heads=args.num_heads,
    )
    print(out)


if __name__ == "__main__":
    main()
