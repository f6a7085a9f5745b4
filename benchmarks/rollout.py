"""Rollout throughput: the pool vs HF transformers ``generate`` vs the machine's compute bound, and the weight-update pause.

    python -m benchmarks.rollout                       # ~40M-parameter Qwen3, 64 concurrent sequences, 128 new tokens
    python -m benchmarks.rollout --dtype float32 --eager --skip-hf

What it measures, in one run on one machine:
- pool: tokens/s of a RolloutPool (Ray actors, vLLM engines) sampling ``--num-prompts x --group-size`` sequences of
  exactly ``--max-tokens`` new tokens each (``ignore_eos``), after a warm-up batch (vLLM compiles on its first batch);
- hf: tokens/s of ``transformers`` ``generate`` on the same prompts with the same sampling, one batch;
- bound: decoding needs ~2 x parameters FLOPs per token, so ``matmul FLOP/s / (2 x parameters)`` tokens/s, with the
  FLOP/s of decode-shaped matmuls (``[num_seqs, hidden] @ [hidden, 4 hidden]``) measured here: the best of float32
  and the engine dtype, and of one core's rate times the cores vs all cores together;
- update pause: seconds an engine stops generating to swap in a full pushed version (the engine lock's hold time),
  and the whole push + commit over gRPC.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def measure_matmul_flops(hidden: int, num_rows: int, dtype: str, num_threads: int, seconds: float = 2.0) -> float:
    """FLOP/s of ``[num_rows, hidden] @ [hidden, 4 hidden]`` matmuls (decode-shaped) on ``num_threads`` threads."""
    import torch

    torch.set_num_threads(num_threads)
    dt = getattr(torch, dtype)
    x, w = torch.randn(num_rows, hidden, dtype=dt), torch.randn(hidden, 4 * hidden, dtype=dt)
    for _ in range(10):
        x @ w
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            x @ w
        n += 20
    return 2.0 * num_rows * hidden * 4 * hidden * n / (time.perf_counter() - start)


def count_parameters(model_dir: str) -> int:
    from rollout.engine.sink import read_checkpoint_manifest

    return sum(spec.numel for spec in read_checkpoint_manifest(model_dir))


def run_pool(args, model_dir: str, problems, sampling) -> dict[str, float]:
    import ray

    from rollout.config import EngineConfig, RolloutConfig
    from rollout.pool import RolloutPool
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import Shard, WeightSender

    ray.init(address="local", _temp_dir=tempfile.mkdtemp(prefix="ray-bench-"), include_dashboard=False,
             num_cpus=max(2, args.num_workers), runtime_env={"env_vars": {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}})
    try:
        num_seqs = len(problems) * args.group_size
        config = RolloutConfig(
            model_path=model_dir, num_workers=args.num_workers, num_cpus_per_worker=1.0,
            engine=EngineConfig(dtype=args.dtype, max_model_len=512, max_num_seqs=num_seqs, kv_cache_gib=1.0,
                                enforce_eager=args.eager, cpu_threads_bind=args.threads_bind),
        )
        pool = RolloutPool(config, weight_sync=WeightSyncConfig())
        pool.collect(pool.submit(problems[:2], args.group_size, sampling))  # warm-up: first batch compiles
        batch = pool.collect(pool.submit(problems, args.group_size, sampling))
        tokens = batch.metrics["rollout/num_completion_tokens"]
        out = {"pool_tokens_per_s": tokens / batch.metrics["rollout/seconds"], "pool_seconds": batch.metrics["rollout/seconds"]}

        from safetensors.torch import load_file
        from pathlib import Path

        state = {}
        for file in Path(model_dir).glob("*.safetensors"):
            state.update(load_file(file))
        with WeightSender(pool.receiver_addresses(), WeightSyncConfig(delta=False)) as sender:
            start = time.perf_counter()
            report = sender.push(1, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in state.items()])
            commit = sender.commit(1)
            out["push_commit_s"] = time.perf_counter() - start
        if report.failed or any(commit.values()):
            raise RuntimeError(f"benchmark push failed: {report.failed} {commit}")
        out["update_pause_s"] = max(h["last_update_s"] for h in pool.health())
        out["num_seqs"] = float(num_seqs)
        pool.shutdown()
        return out
    finally:
        ray.shutdown()


def run_hf(args, model_dir: str, problems, num_threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.tokenizer import load_tokenizer, render_prompt

    torch.set_num_threads(num_threads)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.hf_dtype)).eval()
    prompts = [render_prompt(tokenizer, p.prompt) for p in problems]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for decoder-only generate
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=args.group_size,
                  max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        seconds = time.perf_counter() - start
    return {"hf_tokens_per_s": (out.shape[1] - width) * out.shape[0] / seconds, "hf_seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=10)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the HF baseline (torch's bfloat16 matmuls are slow on many CPUs)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--threads-bind", default="auto", help="EngineConfig.cpu_threads_bind")
    parser.add_argument("--eager", action="store_true", help="no torch.compile in vLLM (enforce_eager=true)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rollout.config import SamplingConfig
    from rollout.tasks.problem import Problem
    from tools.make_tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(
        tempfile.mkdtemp(prefix="bench-model-"), family="qwen3", dtype=args.dtype, hidden_size=args.hidden_size,
        num_layers=args.num_layers, num_heads=args.num_heads, intermediate_size=args.intermediate_size,
    ))
    num_params = count_parameters(model_dir)
    num_threads = os.cpu_count() or 1
    num_seqs = args.num_prompts * args.group_size
    # The bound takes the best rate the machine's matmuls reach: either dtype (the engine may use faster kernels than
    # torch for its dtype), and one core's rate times the cores (threads contend on a shared, busy host, which would
    # lower the bound and flatter the pool).
    rates = {(dt, t): measure_matmul_flops(args.hidden_size, num_seqs, dt, t)
             for dt in {"float32", args.dtype, args.hf_dtype} for t in {1, num_threads}}
    flops = max(rate * (num_threads if t == 1 else 1) for (dt, t), rate in rates.items())
    # HF runs on whichever thread count ran its dtype's matmuls faster here (on a busy host one thread can win).
    hf_threads = max((t for dt, t in rates if dt == args.hf_dtype), key=lambda t: rates[(args.hf_dtype, t)])
    bound = flops / (2 * num_params)
    problems = [Problem(prompt=f"Compute {i} plus {2 * i}, then think.", answer=str(3 * i), problem_id=str(i))
                for i in range(args.num_prompts)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    results = {"parameters": float(num_params), "matmul_gflops": flops / 1e9, "bound_tokens_per_s": bound}
    results.update(run_pool(args, model_dir, problems, sampling))
    if not args.skip_hf:
        results.update(run_hf(args, model_dir, problems, hf_threads))
        results["hf_threads"] = float(hf_threads)
    print(f"model: {num_params / 1e6:.1f}M parameters, {args.dtype}, {num_seqs} sequences x {args.max_tokens} tokens, "
          f"{num_threads} cores")
    print(f"compute bound : {bound:9.0f} tok/s  (matmul {flops / 1e9:.1f} GFLOP/s / 2 x params)")
    print(f"pool (vLLM)   : {results['pool_tokens_per_s']:9.0f} tok/s  = {results['pool_tokens_per_s'] / bound:.0%} of bound")
    if "hf_tokens_per_s" in results:
        print(f"HF generate   : {results['hf_tokens_per_s']:9.0f} tok/s  = {results['hf_tokens_per_s'] / bound:.0%} of bound "
              f"({args.hf_dtype}, {hf_threads} thread(s))")
    print(f"update pause  : {results['update_pause_s'] * 1e3:9.1f} ms engine paused per full update "
          f"({results['update_pause_s'] / results['pool_seconds']:.1%} of this generation batch); "
          f"push+commit {results['push_commit_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
