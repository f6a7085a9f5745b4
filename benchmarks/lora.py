"""LoRA against full-parameter training on Qwen3-0.6B's real layer shapes and vocabulary (fewer blocks: ~281M
parameters at the default 8), side by side in one run: trainer memory and policy-update speed, bytes per weight push,
the engine's pause per update, and generation speed per serving mode.

    python -m benchmarks.lora [--rank 16] [--num-layers 8] [--activation-checkpoint full] [--pushes 5] [--threads 2]

What it measures (every configuration in a fresh process of its own, so peak memory is that configuration's alone):
- trainer: the production GRPO policy update (``trainer.state.build_train_state`` + ``trainer.step.rl_step``, one
  rank, the blocks ``recipes/qwen3_0p6b_cpu.toml`` runs this shape with: the chunked output head in 256-token chunks,
  ``--activation-checkpoint`` for both) on a batch of 16 samples (prompts 64-192 tokens, completions 8-256),
  full-parameter vs LoRA (``rank`` on all seven projections): peak RSS of the
  process (``ru_maxrss``; model, gradients, AdamW state, activations, and the ~0.5 GB that torch itself takes; large
  blocks are mmap-ed, ``MALLOC_MMAP_THRESHOLD_``, so freed memory leaves the count), at each
  ``--micro-batch-tokens`` setting (activations grow with it), the bytes of trainable parameters, gradients and
  optimizer state, and tokens per second of the update (median over the timed steps after one warm-up).
- push: the real path a run takes, trainer-side ``WeightSender`` -> gRPC receiver -> ``VLLMWeightSink`` -> the
  engine: the full model into an engine serving full weights, and a LoRA adapter (PEFT names) into an engine serving
  LoRA merged into its base (``lora_serving = "merged"``, the CPU default) and through vLLM's LoRA path
  (``"adapter"``). Per push: payload bytes, push + commit seconds, and the engine's pause (``last_update_s``: the time
  admission was stopped, or the adapter swap); median and range over ``--pushes``.
- generate: tokens/s of each engine sampling 32 x 64 tokens (``ignore_eos``) after its first push, i.e. what serving
  LoRA costs generation.

The CPU model and the load before and after are printed; measure on a quiet machine and repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import init_single_rank_group, load_avg, machine_line, med_range, run_in_child

ARCHITECTURE = "Qwen3-0.6B"
"""Real widths and a real vocabulary (151,936 rows, tied): what sets the adapters' share of the bytes pushed."""
RECIPE = "recipes/qwen3_0p6b_cpu.toml"
"""The project's recipe for this shape: its ``[model]`` block choices (attention, output head and its chunk) are the
trainer's here."""
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _trainer_child(
    model_dir: str, blocks: dict[str, Any], rank: int | None, steps: int, threads: int, micro_batch_tokens: int,
    checkpointing: str, out: str,
) -> None:  # fmt: skip
    """One configuration's policy updates in this (fresh) process, with the model's ``blocks`` (``model_config_from_hf``
    overrides); writes its figures to ``out`` as JSON."""
    import torch
    import torch.distributed as dist

    from benchmarks.trainer import grpo_batch
    from trainer.config import TrainerConfig
    from trainer.models.config import LoRAConfig
    from trainer.models.hf_config import model_config_from_hf
    from trainer.parallelize import build_mesh
    from trainer.rl.config import GRPOConfig
    from trainer.state import build_train_state
    from trainer.step import rl_step

    torch.set_num_threads(threads)
    init_single_rank_group()
    lora = None if rank is None else LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=ALL_PROJECTIONS)
    model_cfg = model_config_from_hf(model_dir, **blocks, lora=lora)
    cfg = TrainerConfig(micro_batch_tokens=micro_batch_tokens, optimizer={"lr": 1e-5},
                        activation_checkpoint={"mode": checkpointing})  # fmt: skip
    state = build_train_state(cfg, model_cfg, GRPOConfig(group_size=4), torch.device("cpu"), build_mesh(cfg, "cpu"),
                              init_path=model_dir)  # fmt: skip
    batch = grpo_batch(model_cfg.vocab_size)
    setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for step in range(steps + 1):
        start = time.perf_counter()
        rl_step(state, batch)
        if step:  # the first step warms allocator and thread pools
            seconds.append(time.perf_counter() - start)
    trainable = [p for p in state.policy.parameters() if p.requires_grad]
    optim_bytes = sum(
        t.numel() * t.element_size()
        for group in state.optimizer.state.values() for t in group.values() if isinstance(t, torch.Tensor)
    )  # fmt: skip
    result = {
        "params": sum(p.numel() for p in state.policy.parameters()), "trainable": sum(p.numel() for p in trainable),
        "optimizer_bytes": optim_bytes, "grad_bytes": 4 * sum(p.numel() for p in trainable),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "setup_peak_rss": setup_peak,
        "step_s": statistics.median(seconds), "tokens_per_s": batch.num_tokens / statistics.median(seconds),
    }  # fmt: skip
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


def _recipe_blocks() -> dict[str, Any]:
    """The block choices of :data:`RECIPE`'s ``[model]`` section (``model_config_from_hf`` overrides)."""
    from recipe import load_recipe

    return load_recipe(RECIPE, check_paths=False).model.block_overrides()


def _engine_child(model_dir: str, mode: str, rank: int, pushes: int, out: str) -> None:
    """One serving mode: an engine with its sink and receiver, ``pushes`` pushes, then a timed batch."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from rollout.config import EngineConfig, SamplingConfig
    from rollout.engine.sink import VLLMWeightSink
    from rollout.engine.vllm_engine import VLLMEngine
    from weight_sync.checkpoint import checkpoint_shards
    from weight_sync.config import WeightSyncConfig
    from weight_sync.peft import AdapterSpec
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sender import Shard, WeightSender

    spec = AdapterSpec(rank=rank, alpha=2.0 * rank, target_modules=ALL_PROJECTIONS)
    lora = None if mode == "full" else spec
    config = EngineConfig(max_model_len=512, max_num_seqs=32, kv_cache_gib=0.5, enforce_eager=True,
                          cpu_threads_bind="nobind", lora=lora, lora_serving="auto" if lora is None else mode)
    engine = VLLMEngine(model_dir, config)
    sink = VLLMWeightSink(engine)
    receiver = WeightReceiver(sink, WeightSyncConfig())
    receiver.start()
    base = {s.name: s.tensor for s in checkpoint_shards(model_dir)}
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        with WeightSender([receiver.address], WeightSyncConfig()) as sender:
            for version in range(1, pushes + 1):
                if lora is None:  # a new full version: every tensor changed a little
                    tensors = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
                else:
                    tensors = {s.name: 0.01 * torch.randn(s.shape, generator=gen)
                               for s in sink.manifest() if s.name.startswith("base_model.")}  # fmt: skip
                shards = [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in tensors.items()]
                start = time.perf_counter()
                report = sender.push(version, shards)
                failed = {a: e for a, e in sender.commit(version).items() if e}
                if report.failed or failed:
                    raise RuntimeError(f"push {version} failed: {report.failed or failed}")
                rows.append({"bytes": report.payload_bytes, "push_s": time.perf_counter() - start,
                             "pause_s": engine.last_update_s})  # fmt: skip
        sampling = SamplingConfig(temperature=1.0, max_tokens=64, ignore_eos=True, seed=0)
        prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(32)]
        engine.generate(prompts[:4], sampling, n=1)  # warm-up
        start = time.perf_counter()
        engine.generate(prompts, sampling, n=1, seeds=list(range(32)))
        tokens_per_s = 32 * 64 / (time.perf_counter() - start)
    finally:
        receiver.stop()
        engine.shutdown()
    Path(out).write_text(json.dumps({"pushes": rows, "generate_tokens_per_s": tokens_per_s}))


def _state_bytes(result: dict[str, Any]) -> float:
    """Bytes of the trainable parameters (float32), their gradients and their AdamW state."""
    return 4 * result["trainable"] + result["grad_bytes"] + result["optimizer_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank), on all seven projections")
    parser.add_argument("--steps", type=int, default=3, help="timed policy updates per trainer configuration")
    parser.add_argument("--pushes", type=int, default=5, help="pushes per serving mode")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the trainer processes")
    parser.add_argument("--num-layers", type=int, default=8, help=f"blocks of {ARCHITECTURE} (it has 28)")
    parser.add_argument("--activation-checkpoint", choices=("none", "full", "selective"), default="full",
                        help="trainer.activation_checkpoint.mode of both trainer configurations")
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[4096, 1024],
                        help="trainer.micro_batch_tokens settings to compare at (activations scale with it)")
    parser.add_argument("--skip-engines", action="store_true", help="trainer rows only")
    args = parser.parse_args()
    from tools.make_tiny_model import make_published_model

    # glibc serves large blocks through mmap, returned when freed, so peak RSS counts live memory rather than heap
    # fragmentation (which put LoRA's peak above full training's: 4.8 vs 4.5 GiB without it). Read at each spawned
    # child's start.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    print(machine_line(), flush=True)
    blocks = _recipe_blocks()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_published_model(Path(tmp) / "model", ARCHITECTURE, dtype="float32",
                                             num_layers=args.num_layers))  # fmt: skip
        trainer = {(name, tokens): run_in_child(_trainer_child, model_dir, blocks, rank, args.steps, args.threads,
                                                tokens, args.activation_checkpoint)  # fmt: skip
                   for tokens in args.micro_batch_tokens
                   for name, rank in (("full", None), ("lora", args.rank))}  # fmt: skip
        engines = {} if args.skip_engines else {
            mode: run_in_child(_engine_child, model_dir, mode, args.rank, args.pushes)
            for mode in ("full", "merged", "adapter")
        }  # fmt: skip
    gib, width = 2**30, 44
    some = next(iter(trainer.values()))
    lora_params = trainer[("lora", args.micro_batch_tokens[0])]["trainable"]
    print(f"\nmodel: {ARCHITECTURE} shapes, {args.num_layers} blocks, {some['params'] / 1e6:.1f}M parameters, float32; "
          f"LoRA rank {args.rank}, alpha {2 * args.rank}, all projections ({lora_params / 1e6:.2f}M trainable); "
          f"activation checkpointing {args.activation_checkpoint}; trainer threads {args.threads}; blocks of "
          f"{RECIPE}: {blocks}\n")  # fmt: skip
    print(f"{'':{width}} {'full':>12} {'LoRA':>12} {'LoRA/full':>10}  target")
    for tokens in args.micro_batch_tokens:
        full, lora = trainer[("full", tokens)], trainer[("lora", tokens)]
        rows = [
            (f"trainer peak RSS (GiB), {tokens}-token micro-batches", full["peak_rss"] / gib, lora["peak_rss"] / gib,
             "<= 0.5x"),
            ("  trainable params + grads + AdamW (GiB)", _state_bytes(full) / gib, _state_bytes(lora) / gib, ""),
            ("  policy update tokens/s", full["tokens_per_s"], lora["tokens_per_s"], ""),
        ]  # fmt: skip
        for name, a, b, target in rows:
            print(f"{name:{width}} {a:>12.3f} {b:>12.3f} {b / a:>9.3f}x  {target}")
    print()
    if not engines:
        print(f"load after: {load_avg()}")
        return
    print(f"{'push into the engine':{width}} {'bytes/push':>12} {'push+commit s':>20} {'engine pause s':>20}")
    full_bytes = statistics.median(r["bytes"] for r in engines["full"]["pushes"])
    for mode, label in (("full", "full weights"), ("merged", "LoRA merged (CPU default)"),
                        ("adapter", "LoRA through vLLM's LoRA path")):  # fmt: skip
        pushes = engines[mode]["pushes"]
        size = statistics.median(r["bytes"] for r in pushes)
        push_s, pause_s = (med_range([r[key] for r in pushes], "{:.3f}") for key in ("push_s", "pause_s"))
        print(f"{label:{width}} {size / 2**20:>9.1f}MiB {push_s:>20} {pause_s:>20}   "
              f"({size / full_bytes:.2%} of full; target <= 2%)")
    print()
    for mode, label in (("full", "generate tokens/s, full-weight engine"), ("merged", "... LoRA merged"),
                        ("adapter", "... LoRA through vLLM's LoRA path")):  # fmt: skip
        rate = engines[mode]["generate_tokens_per_s"]
        print(f"{label:{width}} {rate:>12.0f} {rate / engines['full']['generate_tokens_per_s']:>9.3f}x")
    print(f"\nload after: {load_avg()}")


if __name__ == "__main__":
    main()
