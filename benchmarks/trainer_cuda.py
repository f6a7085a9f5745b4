"""The policy update at real model sizes on one CUDA GPU: step time, achieved FLOP/s against the GPU's measured bf16
matmul rate, peak memory per activation-checkpointing mode, and the two CUDA attention blocks side by side.

    python -m benchmarks.trainer_cuda [--prompts 16] [--steps 3] [--ac-tokens 4096] [--skip-moe]

One process, one rank (``cpu:gloo,cuda:nccl``): the production update (``trainer.state.build_train_state`` +
``trainer.step.rl_step``) with the GPU recipe's precision (``recipes/qwen3_0p6b_gpu.toml``: bf16 compute through FSDP2
mixed precision, fp32 master weights and AdamW state) on random-initialised models of published shapes
(``common.published``), no hub. It prints, in one run:

- the GPU, torch and CUDA versions, the CPU line, and the bf16 matmul rate (8192^3 ``torch.mm``, mean of 10 after
  warm-up), measured before and after the runs (the higher is the peak);
- Qwen3-0.6B, GRPO (``--prompts`` prompts of 64-256 tokens x 8 completions of 16-1024 tokens, whole sequences so the
  FLOP count holds), ``sdpa`` vs ``varlen`` attention, interleaved: seconds per step (median and range of ``--steps``
  after one warm-up), tokens/s, ``6 x params x tokens`` FLOP/s and the executed matmul FLOPs
  (``benchmarks.trainer.executed_matmul_flops``) as a share of the matmul rate; then the same with the recipe's shared
  prompts (a group's prompt packed once);
- Qwen3-0.6B at one micro-batch of ``--ac-tokens`` tokens: peak GPU memory (``torch.cuda.max_memory_allocated``) of
  forward + backward and of the step, per ``trainer.activation_checkpoint.mode``, and the step time;
- unless ``--skip-moe``: Qwen3-30B-A3B's layer shapes (4 blocks, 32 experts, ``grouped`` experts on
  ``F.grouped_mm``), GRPO step time and ``6 x active params x tokens`` FLOP/s.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.machine import init_single_rank_group, machine_line, med_range
from benchmarks.trainer import executed_matmul_flops, grpo_batch
from common.published import published_fields
from rollout.types import RolloutBatch, Sample
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.models.hf_config import model_config_from_hf_dict
from trainer.parallelize import build_mesh
from trainer.rl.config import GRPOConfig, ImportanceSamplingConfig
from trainer.state import build_train_state
from trainer.step import rl_step

GROUP = 8
CUDA = torch.device("cuda")


def bf16_matmul_flops(n: int = 8192, reps: int = 10) -> float:
    """Mean bf16 ``n x n @ n x n`` rate over ``reps`` products after 3 warm-ups, FLOP per second."""
    a, b = (torch.randn(n, n, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.mm(a, b)
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3)


def trainer_config(**overrides: Any) -> TrainerConfig:
    """The GPU recipe's trainer precision and micro-batch budget, with ``overrides``."""
    fields: dict[str, Any] = {
        "device": "cuda", "mixed_precision": {"param_dtype": "bfloat16"}, "micro_batch_tokens": 16384,
        "optimizer": {"lr": 1e-6},
    }  # fmt: skip
    return TrainerConfig(**{**fields, **overrides})


def build(cfg: TrainerConfig, model_cfg: ModelConfig) -> Any:
    """The trainer's state for ``model_cfg`` on the GPU (seeded by ``cfg.seed``), checked as a recipe would be."""
    cfg.check_model(model_cfg)
    algo = GRPOConfig(group_size=GROUP, importance_sampling=ImportanceSamplingConfig(enabled=True))
    return build_train_state(cfg, model_cfg, algo, CUDA, build_mesh(cfg, "cuda"))


def timed_steps(state: Any, batch: RolloutBatch, steps: int) -> list[float]:
    """One warm-up step, then ``steps`` timed ones (seconds each; ``rl_step`` reads its metrics, so it syncs)."""
    rl_step(state, batch)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rl_step(state, batch)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="GRPO groups per step (x 8 completions)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up)")
    parser.add_argument("--ac-tokens", type=int, default=4096, help="tokens of the checkpointing micro-batch")
    parser.add_argument("--skip-moe", action="store_true", help="leave out the Qwen3-30B-A3B-shaped model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    print(machine_line())
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA device here (torch {torch.__version__}; a CUDA build and a GPU are needed): nothing done")
    print(f"gpu: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB); "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)  # fmt: skip
    init_single_rank_group("cpu:gloo,cuda:nccl")
    torch.cuda.set_device(0)
    peaks = [bf16_matmul_flops()]

    dense = {a: model_config_from_hf_dict(published_fields("Qwen3-0.6B"), source="Qwen3-0.6B", attention=a,
                                          output_head="chunked") for a in ("sdpa", "varlen")}  # fmt: skip
    batch = grpo_batch(dense["sdpa"].vocab_size, args.prompts, GROUP, prompt_len=(64, 257), completion_len=(16, 1025))
    tokens, completion = batch.num_tokens, sum(len(s.completion_ids) for s in batch.samples)
    print(f"\nQwen3-0.6B ({dense['sdpa'].num_params / 1e9:.2f}B params), GRPO {len(batch.samples)} samples, {tokens} "
          f"tokens ({completion} completion), micro-batch 16384 tokens, bf16 compute", flush=True)  # fmt: skip
    rows: dict[str, list[float]] = {}
    for shared in (False, True):
        for attention in ("sdpa", "varlen"):
            state = build(trainer_config(share_prompts=shared), dense[attention])
            rows[f"{attention}{' shared' if shared else ''}"] = timed_steps(state, batch, args.steps)
            del state  # the last reference (and FSDP's cycles collected): the next setting must not hold this model
            gc.collect()
            torch.cuda.empty_cache()
    peaks.append(bf16_matmul_flops())
    peak = max(peaks)
    six_n = 6 * dense["sdpa"].num_params * tokens
    executed = executed_matmul_flops(batch, dense["sdpa"])
    print(f"bf16 matmul rate: {peaks[0] / 1e12:.0f} / {peaks[1] / 1e12:.0f} TFLOP/s before / after")
    print(f"{'attention':<16}{'s / step':>22}{'tokens/s':>12}{'6N TFLOP/s':>12}{'6N / peak':>11}{'exec / peak':>13}")
    for name, times in rows.items():
        best = min(times)
        print(
            f"{name:<16}{med_range(times, '{:.3f}'):>22}{tokens / best:>12.0f}{six_n / best / 1e12:>12.0f}"
            f"{six_n / best / peak:>11.2f}{executed / best / peak:>13.2f}"
        )
    print(
        "(shared: a group's prompt packed once, fewer tokens through the model for the same batch; its FLOP "
        "columns still count whole sequences)"
    )

    print(f"\nactivation checkpointing, Qwen3-0.6B, one micro-batch of {args.ac_tokens} tokens (8 sequences), "
          "sdpa, GiB of GPU memory", flush=True)  # fmt: skip
    half = args.ac_tokens // 16
    rng = np.random.default_rng(0)
    ac_batch = RolloutBatch([
        Sample(prompt_ids=rng.integers(1, 1000, half), completion_ids=rng.integers(1, 1000, half),
               rollout_logprobs=np.full(half, -12.0, dtype=np.float32), reward=float(i % 2), group_id=0,
               policy_version=0)
        for i in range(8)
    ])  # fmt: skip
    print(f"{'mode':<12}{'rest':>8}{'fwd+bwd':>10}{'activations':>13}{'step peak':>11}{'s / step':>10}")
    activations = {}
    for mode in ("none", "selective", "full"):
        state = build(trainer_config(micro_batch_tokens=args.ac_tokens, share_prompts=False,
                                     activation_checkpoint={"mode": mode}), dense["sdpa"])  # fmt: skip
        marks: dict[str, int] = {}

        def before_optimizer_step(*_: object, marks: dict[str, int] = marks) -> None:
            marks.setdefault("fwd_bwd", torch.cuda.max_memory_allocated())

        state.optimizer.register_step_pre_hook(before_optimizer_step)
        torch.cuda.synchronize()
        rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        rl_step(state, ac_batch)
        seconds = time.perf_counter() - start
        step_peak = torch.cuda.max_memory_allocated()
        grads = sum(p.numel() * 4 for p in state.policy.parameters())
        activations[mode] = marks["fwd_bwd"] - rest - grads
        later = timed_steps(state, ac_batch, 2)
        gib = 2**30
        print(
            f"{mode:<12}{rest / gib:>8.2f}{marks['fwd_bwd'] / gib:>10.2f}{activations[mode] / gib:>13.2f}"
            f"{step_peak / gib:>11.2f}{statistics.median(later):>10.3f}   (first step {seconds:.2f} s)"
        )
        del state
        gc.collect()
        torch.cuda.empty_cache()
    print(
        f"activations none / full: {activations['none'] / activations['full']:.1f}x, none / selective: "
        f"{activations['none'] / activations['selective']:.1f}x"
    )

    if not args.skip_moe:
        fields = published_fields("Qwen3-30B-A3B", num_layers=4, num_experts=32)
        moe = model_config_from_hf_dict(fields, source="Qwen3-30B-A3B", attention="varlen", output_head="chunked")
        moe_batch = grpo_batch(
            moe.vocab_size, max(1, args.prompts // 4), GROUP, prompt_len=(64, 257), completion_len=(16, 513)
        )
        state = build(trainer_config(share_prompts=False), moe)
        times = timed_steps(state, moe_batch, args.steps)
        active = 6 * moe.active_params * moe_batch.num_tokens
        print(f"\nQwen3-30B-A3B layers ({moe.num_layers} blocks, {moe.moe.num_experts} experts, top-{moe.moe.top_k}; "
              f"{moe.num_params / 1e9:.2f}B params, "
              f"{moe.active_params / 1e9:.2f}B active), grouped experts, varlen, {len(moe_batch.samples)} samples, "
              f"{moe_batch.num_tokens} tokens: {med_range(times, '{:.3f}')} s / step, "
              f"{active / min(times) / 1e12:.0f} TFLOP/s (6 x active x tokens) = {active / min(times) / peak:.2f} "
              "of the matmul rate")  # fmt: skip
        del state
        gc.collect()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
