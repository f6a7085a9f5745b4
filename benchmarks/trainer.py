"""Achieved FLOP/s of our GRPO policy update on a ~40M-parameter model against this machine's measured matmul FLOP/s.

Run: ``.venv/bin/python benchmarks/trainer.py [--threads N] [--steps 5] [--compile]`` (one process, one rank: exactly
the code path of a single-rank trainer, which skips FSDP; ``--compile`` sets ``trainer.compile``). It prints, in one
run:

- the matmul peak: best-of-several fp32 ``torch.mm`` of square matrices of the model's size class;
- the policy update: a realistic GRPO batch (16 prompts of 64-192 tokens, completion lengths uniform in 8-256) packed
  into micro-batches, forward + output head + loss + backward + AdamW; achieved FLOP/s counted as
  ``6 x params x useful tokens`` (non-padding prompt + completion tokens; attention FLOPs not counted). The model's
  blocks (printed) are the per-segment ``sdpa`` attention and the ``cached`` output head, which the trainer runs at
  completion positions only, as it does the last block's output projection and feed-forward (nothing after them
  reaches another position), so the step does less work than the ``6 x params`` count credits;
- useful tokens per second and the ratio achieved / peak (target >= 0.9 on an otherwise idle machine).

Shared machines give noisy numbers: the matmul peak and the steps are measured interleaved, the best is kept, and
both wall-clock and CPU-time (``time.process_time``) rates are printed; under contention the CPU-time ratio is the one
that measures our code rather than the neighbours.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

# This file is named like the `trainer` package: run as a script, its own folder would shadow the package.
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == _REPO / "benchmarks":
    sys.path[0] = str(_REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.machine import init_single_rank_group, machine_line  # noqa: E402
from rollout.types import RolloutBatch, Sample  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.models.config import ModelConfig  # noqa: E402
from trainer.parallelize import build_mesh, uses_fsdp  # noqa: E402
from trainer.rl.config import GRPOConfig, ImportanceSamplingConfig  # noqa: E402
from trainer.state import build_train_state  # noqa: E402
from trainer.step import rl_step  # noqa: E402

MODEL_40M = ModelConfig(
    family="llama3", vocab_size=16384, dim=512, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64,
    ffn_hidden_dim=1536, tie_embeddings=True, output_chunk_size=1024, max_seq_len=4096, output_head="cached",
)  # fmt: skip


def matmul_flops(n: int = 1536, reps: int = 5) -> tuple[float, float]:
    """Best fp32 ``n x n @ n x n`` matmul rate over ``reps`` runs: (FLOP per wall second, FLOP per CPU second)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        best_wall, best_cpu = min(best_wall, time.perf_counter() - wall), min(best_cpu, time.process_time() - cpu)
    return 2 * n**3 / best_wall, 2 * n**3 / best_cpu


def grpo_batch(
    vocab: int,
    num_groups: int = 4,
    group_size: int = 4,
    seed: int = 0,
    prompt_len: tuple[int, int] = (64, 193),
    completion_len: tuple[int, int] = (8, 257),
) -> RolloutBatch:
    """A GRPO batch whose lengths vary as in practice: each group's prompt length uniform in ``prompt_len`` and each
    completion's in ``completion_len`` (``[low, high)``; by default 64-192 and 8-256 tokens)."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(num_groups):
        prompt = rng.integers(1, vocab, int(rng.integers(*prompt_len)))
        for _ in range(group_size):
            c = int(rng.integers(*completion_len))
            samples.append(
                Sample(
                    prompt_ids=prompt, completion_ids=rng.integers(1, vocab, c),
                    rollout_logprobs=np.full(c, -np.log(vocab), dtype=np.float32), reward=float(rng.random()),
                    group_id=g, policy_version=0,
                )
            )  # fmt: skip
    return RolloutBatch(samples)


def executed_matmul_flops(batch: RolloutBatch, cfg: ModelConfig = MODEL_40M) -> float:
    """Matmul FLOPs one policy update really performs (fwd + bwd = 3 x forward): the blocks' projections on every
    token, except the last block's output projection and feed-forward, which run on completion-predicting positions
    only, as does the output head (``cached``: 3 matmuls of ``2 x V x D``; ``chunked`` recomputes one more); causal
    attention per sequence. The embedding lookup is not a matmul."""
    embed = cfg.vocab_size * cfg.dim
    block_params = (cfg.num_params - embed * (1 if cfg.tie_embeddings else 2)) // cfg.num_layers
    trimmed = cfg.num_heads * cfg.head_dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden_dim  # wo + SwiGLU
    head_matmuls = 4 if cfg.output_head == "chunked" else 3
    completion = sum(len(s.completion_ids) for s in batch.samples)
    attention = 3 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(
        (len(s.prompt_ids) + len(s.completion_ids)) ** 2 for s in batch.samples
    )
    blocks = cfg.num_layers * block_params * batch.num_tokens - trimmed * (batch.num_tokens - completion)
    return 6 * blocks + 2 * head_matmuls * embed * completion + attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noisy when shared)")
    parser.add_argument("--steps", type=int, default=3, help="timed policy updates (after one warm-up)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--compile", action="store_true", help="trainer.compile = true (fused elementwise ops)")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)

    init_single_rank_group()
    # Whole sequences: this measures the kernels against the matmul peak, and the FLOP counts below assume every
    # sample's prompt goes through the model (shared prompts: benchmarks/shared_prompts.py).
    cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, optimizer={"lr": 1e-5}, compile=args.compile,
                        share_prompts=False)  # fmt: skip
    algo = GRPOConfig(group_size=4, importance_sampling=ImportanceSamplingConfig(enabled=True))
    state = build_train_state(cfg, MODEL_40M, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    num_params = sum(p.numel() for p in state.policy.parameters())
    batch = grpo_batch(MODEL_40M.vocab_size)
    tokens = batch.num_tokens

    compile_s = time.perf_counter()
    rl_step(state, batch)  # warm-up (allocator, thread pools, compilation)
    compile_s = time.perf_counter() - compile_s
    walls, cpus, peaks = [], [], []
    for _ in range(args.steps):
        peaks.append(matmul_flops())
        wall, cpu = time.perf_counter(), time.process_time()
        rl_step(state, batch)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    peaks.append(matmul_flops())
    dist.destroy_process_group()

    flops = 6 * num_params * tokens
    peak_wall, peak_cpu = max(p[0] for p in peaks), max(p[1] for p in peaks)
    print(f"model: {num_params / 1e6:.1f}M params ({MODEL_40M.family}, dim {MODEL_40M.dim}, {MODEL_40M.num_layers} "
          f"layers, vocab {MODEL_40M.vocab_size}); threads: {args.threads}")
    print(f"blocks: attention {MODEL_40M.attention!r}, output head {MODEL_40M.output_head!r}, AdamW "
          f"{'fused' if state.optimizer.defaults.get('fused') else 'foreach'}, FSDP {uses_fsdp(state.mesh, cfg)}, "
          f"compile {cfg.compile} (first step {compile_s:.1f} s)")
    print(f"batch: {len(batch.samples)} samples, {tokens} useful tokens (completions 8-256), micro-batch budget "
          f"{args.micro_batch_tokens}")
    print(f"matmul peak (fp32 mm): {peak_wall / 1e9:.1f} GFLOP/s wall, {peak_cpu / 1e9:.1f} GFLOP per CPU-second")
    print(f"policy update: best {min(walls):.2f} s wall ({min(cpus):.2f} CPU-s) per step, median "
          f"{np.median(walls):.2f} s; {tokens / min(walls):.0f} useful tokens/s")
    print(f"achieved (6 x params x tokens): {flops / min(walls) / 1e9:.1f} GFLOP/s wall = "
          f"{flops / min(walls) / peak_wall:.2f} of the matmul peak")
    print(f"per CPU-second (robust on a shared machine): {flops / min(cpus) / 1e9:.1f} GFLOP/CPU-s = "
          f"{flops / min(cpus) / peak_cpu:.2f} of the matmul peak")
    executed = executed_matmul_flops(batch)
    print(f"executed matmul FLOPs (blocks on every token but the last one's wo/FFN and the head on completion "
          f"positions only, causal attention): "
          f"{executed / 1e9:.0f} GFLOP = {executed / min(cpus) / peak_cpu:.2f} of the matmul peak per CPU-second")


if __name__ == "__main__":
    main()
