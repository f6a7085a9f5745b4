"""Activation checkpointing on a real model shape: trainer memory and step time of one GRPO policy update per mode
(``trainer.activation_checkpoint.mode``: none, selective, full), side by side in one run.

    python -m benchmarks.activation_checkpoint [--shape Qwen3-0.6B] [--tokens 4096] [--threads 2] [--lora-rank 0]
                                               [--steps 1] [--repeats 1] [--modes none,selective,full]

Each mode runs in a fresh process of its own (peak memory is that mode's alone): the production update
(``trainer.state.build_train_state`` + ``trainer.step.rl_step``, one rank, float32) of a random-initialised model of
the published architecture ``--shape`` (``common.published``: Qwen3-0.6B is 28 blocks, vocabulary 151,936,
tied embeddings) on one micro-batch of ``--tokens`` tokens (8 samples, half prompt, half completion, packed into one
row; ``sdpa`` attention, ``chunked`` head). Memory is the resident set (``/proc/self/status``; large blocks are
mmap-ed, ``MALLOC_MMAP_THRESHOLD_``, so freed memory leaves it):

- ``rest``: before the step (parameters and torch itself);
- ``fwd+bwd``: the peak from the start of the step until the optimizer steps: ``rest`` + gradients + activations
  (what activation checkpointing shrinks) + the head's buffers;
- ``activations``: ``fwd+bwd - rest - gradient bytes``;
- ``peak``: the whole first step's peak (the optimizer's AdamW state, created by the first step, can set it).

``step s`` is the first step, whose every allocation is fresh memory the kernel must fault in; ``--steps N`` times
``N - 1`` more steps (``later s``, median), the cost of recomputing once memory is warm; ``--default-malloc`` leaves
glibc's allocator as it is (it then reuses freed memory, as a run does; the resident set also counts what it keeps).
Full training at 4,096 tokens without checkpointing needs ~18 GiB for forward and backward, so a second step (AdamW
state, +4.8 GiB) does not fit in 24 GiB: time later steps at fewer tokens.

``--lora-rank R`` trains rank-R adapters on all seven projections instead of every parameter (no base gradients or
optimizer state, so activations are most of the memory). The CPU model and the load before and after are printed;
measure on a quiet machine and repeat. Last, 4 blocks of the shape alone (no head, no optimizer, memory warm) time
forward + backward without and with checkpointing: what the recompute itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.machine import (
    init_single_rank_group,
    load_avg,
    machine_line,
    med_range,
    reset_peak_rss,
    rss_bytes,
    run_in_child,
)

MODES = ("none", "selective", "full")
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _child(shape: str, mode: str, tokens: int, threads: int, lora_rank: int, steps: int, out: str) -> None:
    """One mode's policy update in this (fresh) process; writes its figures to ``out`` as JSON."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from common.published import PUBLISHED_CONFIGS
    from rollout.types import RolloutBatch, Sample
    from trainer.config import TrainerConfig
    from trainer.models.config import LoRAConfig
    from trainer.models.hf_config import model_config_from_hf_dict
    from trainer.parallelize import build_mesh
    from trainer.rl.config import GRPOConfig
    from trainer.state import build_train_state
    from trainer.step import rl_step

    torch.set_num_threads(threads)
    init_single_rank_group()
    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, target_modules=ALL_PROJECTIONS) if lora_rank else None
    model_cfg = model_config_from_hf_dict(
        PUBLISHED_CONFIGS[shape], source=shape, lora=lora, attention="sdpa", output_head="chunked"
    )
    cfg = TrainerConfig(micro_batch_tokens=tokens, optimizer={"lr": 1e-6}, activation_checkpoint={"mode": mode})
    state = build_train_state(cfg, model_cfg, GRPOConfig(group_size=8), torch.device("cpu"), build_mesh(cfg, "cpu"))
    rng = np.random.default_rng(0)
    half, vocab = tokens // 16, model_cfg.vocab_size
    samples = [
        Sample(
            prompt_ids=rng.integers(1, vocab, half), completion_ids=rng.integers(1, vocab, half),
            rollout_logprobs=np.full(half, -12.0, dtype=np.float32), reward=float(i % 2), group_id=0, policy_version=0,
        )
        for i in range(8)
    ]  # fmt: skip
    grad_bytes = sum(4 * p.numel() for p in state.policy.parameters() if p.requires_grad)
    marks: dict[str, int] = {}

    def before_optimizer_step(*_: object) -> None:
        marks.setdefault("fwd_bwd", rss_bytes("VmHWM"))

    state.optimizer.register_step_pre_hook(before_optimizer_step)
    rest = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    rl_step(state, RolloutBatch(samples))
    seconds = time.perf_counter() - start
    peak = rss_bytes("VmHWM")
    later = []
    for _ in range(steps - 1):
        start = time.perf_counter()
        rl_step(state, RolloutBatch(samples))
        later.append(time.perf_counter() - start)
    result = {
        "rest": rest, "fwd_bwd": marks["fwd_bwd"], "peak": peak, "grad_bytes": grad_bytes,
        "step_s": seconds, "later_s": statistics.median(later) if later else None, "tokens": 8 * 2 * half,
        "params": model_cfg.num_params,
        "checkpointed": sum(block.checkpointed for block in state.policy.layers), "blocks": len(state.policy.layers),
    }  # fmt: skip
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _blocks_child(shape: str, mode: str, tokens: int, threads: int, out: str) -> None:
    """Forward + backward of 4 blocks of ``shape`` alone (no head, no optimizer, memory warm): the recompute's own
    cost. Median seconds of 3 passes after one warm-up, to ``out`` as JSON."""
    import torch

    from common.published import PUBLISHED_CONFIGS
    from trainer.models.hf_config import model_config_from_hf_dict
    from trainer.models.transformer import build_model

    torch.set_num_threads(threads)
    fields = {**PUBLISHED_CONFIGS[shape], "num_hidden_layers": 4, "vocab_size": 1024}
    model = build_model(model_config_from_hf_dict(fields, source=shape))
    model.checkpoint_blocks(range(4) if mode == "full" else [])
    tokens_in = torch.randint(0, 1024, (1, tokens))
    segment_ids = (torch.arange(tokens) >= tokens // 2).long()[None]  # two sequences
    seconds = []
    for _ in range(4):
        start = time.perf_counter()
        model(tokens_in, segment_ids=segment_ids).square().mean().backward()
        seconds.append(time.perf_counter() - start)
    Path(out).write_text(json.dumps({"fwd_bwd_s": statistics.median(seconds[1:])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="Qwen3-0.6B", help="a model of common.published")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the one micro-batch")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each child")
    parser.add_argument("--lora-rank", type=int, default=0, help="train adapters of this rank (0: every parameter)")
    parser.add_argument("--steps", type=int, default=1, help="policy updates per child; all after the first are timed")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per mode (median and range)")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's allocator as it is (timing)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()
    # Large blocks mmap-ed: freed activations leave the resident set, so the peak counts live memory only. Read at
    # each spawned child's start.
    if not args.default_malloc:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    modes = args.modes.split(",")
    print(machine_line(), flush=True)
    runs = {
        mode: [run_in_child(_child, args.shape, mode, args.tokens, args.threads, args.lora_rank, args.steps)
               for _ in range(args.repeats)]
        for mode in modes
    }  # fmt: skip
    first = runs[modes[0]][0]
    trained = f"LoRA rank {args.lora_rank}" if args.lora_rank else "every parameter trained"
    print(f"{args.shape}: {first['params'] / 1e9:.2f}B parameters, {first['blocks']} blocks, {first['tokens']} tokens "
          f"per micro-batch, {trained}, {args.threads} threads; GiB, median [range] of {args.repeats}")  # fmt: skip
    gib = 2**30
    columns = ("rest", "fwd+bwd", "activations", "peak", "step s") + (("later s",) if args.steps > 1 else ())
    print(f"{'mode':<22}" + "".join(f"{c:>20}" for c in columns))
    figures: dict[str, dict[str, list[float]]] = {}
    for mode, reps in runs.items():
        figures[mode] = {
            "rest": [r["rest"] / gib for r in reps],
            "fwd+bwd": [r["fwd_bwd"] / gib for r in reps],
            "activations": [(r["fwd_bwd"] - r["rest"] - r["grad_bytes"]) / gib for r in reps],
            "peak": [r["peak"] / gib for r in reps],
            "step s": [r["step_s"] for r in reps],
            "later s": [r["later_s"] for r in reps if r["later_s"] is not None],
        }
        label = f"{mode} ({reps[0]['checkpointed']}/{reps[0]['blocks']} blocks)"
        print(f"{label:<22}" + "".join(f"{med_range(figures[mode][c]):>20}" for c in columns))
    if "none" in figures:
        base = {c: statistics.median(figures["none"][c]) for c in columns}
        for mode in modes:
            if mode == "none":
                continue
            med = {c: statistics.median(figures[mode][c]) for c in columns}
            less = {c: base[c] / med[c] for c in ("fwd+bwd", "activations", "peak")}
            print(f"none / {mode}: fwd+bwd {less['fwd+bwd']:.2f}x, activations {less['activations']:.2f}x, "
                  f"peak {less['peak']:.2f}x less memory; first step time {med['step s'] / base['step s']:.2f}x"
                  + (f", later steps {med['later s'] / base['later s']:.2f}x" if args.steps > 1 else ""))  # fmt: skip
    blocks = {mode: run_in_child(_blocks_child, args.shape, mode, args.tokens, args.threads)["fwd_bwd_s"]
              for mode in ("none", "full")}  # fmt: skip
    print(f"4 blocks alone, forward + backward of {args.tokens} tokens: none {blocks['none']:.2f} s, full "
          f"{blocks['full']:.2f} s ({blocks['full'] / blocks['none']:.2f}x: the recompute)")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
