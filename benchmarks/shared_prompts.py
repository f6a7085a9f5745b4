"""The GRPO policy update with each group's prompt packed once (``trainer.share_prompts``) against whole sequences.

Run: ``.venv/bin/python benchmarks/shared_prompts.py [--threads 2] [--reps 5]``. One process, one rank (the code path
of a single-rank trainer). For each shape, the same batch goes through ``rl_step`` with sharing off and on,
interleaved (off, on, off, on, ...) after a warm-up of each, and it prints per shape: tokens through the model, step
seconds median [range] of each, and the speed-up (whole / shared, median of the per-pair ratios). Shapes:

- ``demo``: the default recipe's (``recipes/grpo_tiny.toml``): tiny Qwen 3 (dim 128, 4 blocks, vocab 448), 32 prompts
  x 8 samples, prompts of 25 tokens (its arithmetic chat prompts), completions of 2-6 tokens;
- ``long``: the same model and batch with 128-token completions (``benchmarks/e2e_vs_trl.py --completion long``);
- ``40m``: ``benchmarks/trainer.py``'s model (8 x 512 Llama, vocab 16k), 4 prompts of 64-192 tokens x
  8 samples, completions 8-256 tokens.

The two updates are the same computation (``tests/trainer/test_shared_prompts.py`` checks log-probs, gradients and a
whole step against whole sequences); only the number of prompt tokens through the model differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == _REPO / "benchmarks":
    sys.path[0] = str(_REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.machine import init_single_rank_group, load_avg, machine_line, med_range  # noqa: E402
from benchmarks.trainer import MODEL_40M, grpo_batch  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.models.config import ModelConfig  # noqa: E402
from trainer.parallelize import build_mesh  # noqa: E402
from trainer.rl.config import GRPOConfig  # noqa: E402
from trainer.state import build_train_state  # noqa: E402
from trainer.step import rl_step  # noqa: E402

DEMO = ModelConfig(  # what tools.make_tiny_model writes for recipes/grpo_tiny.toml's [model.create_tiny]
    family="qwen3", vocab_size=448, dim=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    ffn_hidden_dim=256, qk_norm=True, tie_embeddings=True,
)  # fmt: skip
SHAPES: dict[str, tuple[ModelConfig, int, int, tuple[int, int], tuple[int, int]]] = {
    # name: (model, prompts, group size, prompt tokens [low, high), completion tokens [low, high))
    "demo": (DEMO, 32, 8, (25, 26), (2, 7)),
    "long": (DEMO, 32, 8, (25, 26), (128, 129)),
    "40m": (MODEL_40M, 4, 8, (64, 193), (8, 257)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--reps", type=int, default=5, help="timed (whole, shared) pairs per shape")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    init_single_rank_group()
    rows = []
    for name in args.shapes:
        model, prompts, group, prompt_len, completion_len = SHAPES[name]
        data = grpo_batch(model.vocab_size, prompts, group, prompt_len=prompt_len, completion_len=completion_len)
        states = {}
        for share in (False, True):
            torch.manual_seed(0)
            cfg = TrainerConfig(optimizer={"lr": 1e-5}, share_prompts=share)
            states[share] = build_train_state(cfg, model, GRPOConfig(group_size=group), torch.device("cpu"),
                                              build_mesh(cfg, "cpu"))  # fmt: skip
            rl_step(states[share], data)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.reps):
            for share in (False, True):
                start = time.perf_counter()
                rl_step(states[share], data)
                times[share].append(time.perf_counter() - start)
        whole_tokens = data.num_tokens
        repeats = sum((group - 1) * len(data.samples[g * group].prompt_ids) for g in range(prompts))
        shared_tokens = whole_tokens - repeats
        ratios = [w / s for w, s in zip(times[False], times[True], strict=True)]
        rows.append((name, f"{whole_tokens} -> {shared_tokens}", med_range(times[False], "{:.3f}"),
                     med_range(times[True], "{:.3f}"), f"{statistics.median(ratios):.2f}x"))  # fmt: skip
        print(f"{name}: done", flush=True)
    dist.destroy_process_group()
    header = ("shape", "tokens through the model", "whole s/step", "shared s/step", "speed-up")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\nGRPO policy update, whole sequences vs shared prompts ({args.threads} thread(s), {args.reps} pairs)")
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
