"""Rollout throughput against the machine's compute bound, and the generation pause per weight update.

    python -m benchmarks.rollout                     # ~40M Qwen3, 64 sequences x 128 tokens; 8 default-recipe steps
    python -m benchmarks.rollout --dtype float32 --skip-hf --recipe-steps 0

What it measures, in one run on one machine (the pool's engine uses the production ``EngineConfig`` defaults unless a
flag says otherwise):
- bound: decoding needs ~2 x parameters FLOPs per token, so tokens/s <= matmul FLOP/s / (2 x parameters). The FLOP/s
  are those of decode-shaped matmuls (``[num_seqs, hidden] @ [hidden, 4 hidden]``) in float32 and in the engine's dtype,
  counted per CPU-second of one thread (so time-slicing by other processes on a shared host does not lower it), taken
  before and after the pool's batch (the higher counts). The idle-machine bound is that per-core rate times the cores.
- pool: tokens/s of a RolloutPool (one Ray actor, one vLLM engine) sampling ``--num-prompts x --group-size``
  sequences of exactly ``--max-tokens`` new tokens (``ignore_eos``), after a warm-up batch (compilation), against the
  bound of its own dtype; and tokens per CPU-second the engine's process used, against one core's bound (what it
  makes of the CPU it got, whatever other processes take).
- bare vLLM: tokens/s of a bare ``vllm.LLM.generate`` in a process of its own, built from the pool's engine settings
  (``rollout.engine.vllm_engine.vllm_engine_args``) with the pool engine's torch threads, on the same rendered prompts
  with the same sampling, after the same warm-up: what the pool's asynchronous engine (requests stepped by its own
  loop, episodes, scoring, the Ray actor) costs against vLLM's own batch entry point (target >= 0.95x). Both stay up
  and their batches alternate (``--reps`` of each), so a drift of the machine hits both sides alike; the ratio is
  printed per repetition (median and range).
- hf: tokens/s of transformers ``generate`` on the same prompts with the same sampling, one batch.
- update pause (this model): one full push of the model through the real gRPC receiver into the engine (vLLM reload +
  prefix-cache reset): push + commit seconds, and the part of it the engine lock was held.
- update pause (default recipe): runs ``recipes/grpo_tiny.toml`` for ``--recipe-steps`` RL steps (no warm start: a
  random model takes as long per step) and reads the loop's own timings from its metrics: the median of
  ``time/push_s`` (push + commit + reload + reset, during which a synchronous run generates nothing) over the median
  of ``time/step_s``, first step excluded (engine compilation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engine_model import add_model_args, make_model
from benchmarks.machine import machine_line

REPO = Path(__file__).resolve().parents[1]


def measure_matmul_flops(hidden: int, num_rows: int, dtype: str, num_threads: int, seconds: float = 1.0) -> dict:
    """FLOP/s of ``[num_rows, hidden] @ [hidden, 4 hidden]`` on ``num_threads`` threads: per wall second and per
    CPU-second of the process."""
    import torch

    torch.set_num_threads(num_threads)
    dt = getattr(torch, dtype)
    x, w = torch.randn(num_rows, hidden, dtype=dt), torch.randn(hidden, 4 * hidden, dtype=dt)
    for _ in range(10):
        x @ w
    n, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            x @ w
        n += 20
    flops = 2.0 * num_rows * hidden * 4 * hidden * n
    return {"wall": flops / (time.perf_counter() - start), "cpu": flops / (time.process_time() - cpu_start)}


def measure_bound(hidden: int, num_rows: int, dtypes: set[str], num_cores: int) -> dict[str, dict[str, float]]:
    """Per dtype: one thread's FLOP per CPU-second (``per_core``) and all cores' FLOP/s on the wall clock."""
    out = {}
    for dtype in sorted(dtypes):
        one = measure_matmul_flops(hidden, num_rows, dtype, 1)
        every = measure_matmul_flops(hidden, num_rows, dtype, num_cores)
        out[dtype] = {"per_core": one["cpu"], "all_cores_wall": every["wall"]}
    return out


def count_parameters(model_dir: str) -> int:
    from weight_sync.checkpoint import read_checkpoint_manifest

    return sum(spec.numel for spec in read_checkpoint_manifest(model_dir))


def _process_cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_pool(args, model_dir: str, problems, sampling, ray_dir: str) -> dict[str, float]:
    """Pool throughput (wall and per engine CPU-second) and one full weight update's pause."""
    import ray

    from rollout.config import EngineConfig, RolloutConfig
    from rollout.pool import RolloutPool

    ray.init(address="local", _temp_dir=ray_dir, include_dashboard=False,
             num_cpus=max(2, args.num_workers), runtime_env={"env_vars": {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}})
    try:
        num_seqs = len(problems) * args.group_size
        engine = {"dtype": args.dtype, "max_model_len": 512, "max_num_seqs": num_seqs, "kv_cache_gib": 1.0}
        if args.eager is not None:
            engine["enforce_eager"] = args.eager
        if args.threads_bind is not None:
            engine["cpu_threads_bind"] = args.threads_bind
        config = RolloutConfig(model_path=model_dir, num_workers=1, num_cpus_per_worker=1.0,
                               engine=EngineConfig(**engine))  # fmt: skip
        start = time.perf_counter()
        pool = RolloutPool(config)
        pool.collect(pool.submit(problems[:2], args.group_size, sampling))  # warm-up: the first batch compiles
        out = {"pool_start_s": time.perf_counter() - start, "enforce_eager": float(config.engine.enforce_eager)}
        pid, threads = pool.health()[0]["pid"], int(pool.health()[0]["num_threads"])
        bare = BareLLM(config, model_dir, problems, sampling, args.group_size, threads)
        reps: list[dict[str, float]] = []
        try:
            for _ in range(args.reps):  # interleaved: pool, bare, pool, bare, ...
                cpu_before = _process_cpu_s(pid)
                batch = pool.collect(pool.submit(problems, args.group_size, sampling))
                engine_cpu_s = _process_cpu_s(pid) - cpu_before
                tokens = batch.metrics["rollout/num_completion_tokens"]
                reps.append({"pool_tokens_per_s": tokens / batch.metrics["rollout/seconds"],
                             "pool_tokens_per_cpu_s": tokens / engine_cpu_s,
                             "pool_seconds": batch.metrics["rollout/seconds"], **bare.batch()})  # fmt: skip
        finally:
            bare.close()
        for key in reps[0]:
            out[key] = statistics.median(r[key] for r in reps)
        out["ratios"] = [r["pool_tokens_per_s"] / r["bare_tokens_per_s"] for r in reps]
        out["cpu_ratios"] = [r["pool_tokens_per_cpu_s"] / r["bare_tokens_per_cpu_s"] for r in reps]
        out.update(measure_update_pause(pool, model_dir))
        out["pool_num_threads"] = float(threads)
        pool.shutdown()
        return out
    finally:
        ray.shutdown()


def measure_update_pause(pool, model_dir: str) -> dict[str, float]:
    """Push every tensor of ``model_dir`` as version 1 to the pool over gRPC; seconds of push + commit and of the
    engine lock's hold (reload + prefix-cache reset)."""
    from safetensors.torch import load_file

    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import Shard, WeightSender

    state = {}
    for file in Path(model_dir).glob("*.safetensors"):
        state.update(load_file(file))
    with WeightSender(pool.receiver_addresses(), WeightSyncConfig(delta=False)) as sender:
        start = time.perf_counter()
        report = sender.push(1, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in state.items()])
        commit = sender.commit(1)
        seconds = time.perf_counter() - start
    if report.failed or any(commit.values()):
        raise RuntimeError(f"benchmark push failed: {report.failed} {commit}")
    return {"push_commit_s": seconds, "engine_locked_s": max(h["last_update_s"] for h in pool.health()),
            "push_bytes": float(report.payload_bytes)}  # fmt: skip


def _bare_llm_child(
    engine: dict, model_dir: str, prompts: list[list[int]], sampling: dict, n: int, overrides: dict, go, out
) -> None:
    """In a spawned process: after a warm-up batch, time one ``LLM.generate`` of ``prompts`` (n samples each) per item
    put on ``go`` (``None`` ends it). ``overrides`` replace ``vllm.LLM`` arguments of the engine settings."""
    from rollout.config import EngineConfig, SamplingConfig
    from rollout.engine.platform import configure_vllm_environment
    from rollout.engine.vllm_engine import vllm_engine_args
    from rollout.sampling import to_vllm_sampling_params

    config = EngineConfig(**engine)
    configure_vllm_environment(config)
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(**{**vllm_engine_args(config, model_dir), **overrides})
    params = to_vllm_sampling_params(SamplingConfig(**sampling), n)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests[:2], params, use_tqdm=False)
    out.put("ready")
    while go.get() is not None:
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        out.put({"bare_tokens_per_s": tokens / seconds, "bare_tokens_per_cpu_s": tokens / cpu_s,
                 "bare_seconds": seconds})  # fmt: skip


class BareLLM:
    """A bare ``vllm.LLM`` with the pool's engine settings and threads on the same prompts (see the docstring), in a
    process of its own that stays up so its batches interleave with the pool's (or another bare engine's).
    ``overrides``: ``vllm.LLM`` arguments that replace those of the engine settings."""

    def __init__(
        self, config, model_dir: str, problems, sampling, group_size: int, num_threads: int,
        overrides: dict | None = None,
    ) -> None:  # fmt: skip
        import multiprocessing

        from rollout.tokenizer import load_tokenizer, render_prompt

        tokenizer = load_tokenizer(model_dir)
        prompts = [render_prompt(tokenizer, p.prompt, config.use_chat_template) for p in problems]
        context = multiprocessing.get_context("spawn")
        self._go, self._out = context.Queue(), context.Queue()
        os.environ["OMP_NUM_THREADS"] = str(num_threads)  # inherited by the child, read before torch starts there
        self._child = context.Process(target=_bare_llm_child, args=(
            config.engine.model_dump(), model_dir, prompts, sampling.model_dump(), group_size, overrides or {},
            self._go, self._out,
        ))  # fmt: skip
        self._child.start()
        if self._out.get(timeout=900) != "ready":
            raise RuntimeError("the bare vLLM process did not start")

    def batch(self) -> dict[str, float]:
        self._go.put(1)
        return self._out.get(timeout=900)

    def close(self) -> None:
        self._go.put(None)
        self._child.join(timeout=60)


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


def run_default_recipe(num_steps: int, out_dir: Path) -> dict[str, float]:
    """Run ``recipes/grpo_tiny.toml`` for ``num_steps`` RL steps in a subprocess; medians of its step timings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # fmt: skip
    cmd = [sys.executable, "rl_align.py", "--recipe", "recipes/grpo_tiny.toml", "--run.num_steps", str(num_steps),
           "--run.warm_start.num_steps", "0", "--run.eval.num_problems", "8", "--run.eval.every_num_steps", "0",
           "--run.logging.tensorboard", "false", "--run.logging.plot", "false", "--run.logging.progress", "false",
           "--trainer.checkpoint.every_num_steps", "0", "--run.output_dir", str(out_dir / "out"),
           "--model.path", str(out_dir / "model")]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"default recipe run failed ({result.returncode}):\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (out_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "rl"][1:]  # the first step compiles the engine's graphs
    median = {key: statistics.median(r[key] for r in steps) for key in
              ("time/step_s", "time/push_s", "time/generate_s", "time/train_s", "push/bytes")}  # fmt: skip
    return {"recipe_num_steps": float(len(steps)), **{f"recipe_{k.replace('/', '_')}": v for k, v in median.items()}}


def report(args, results: dict[str, float], bound: dict[str, dict[str, float]], num_cores: int) -> str:
    """The measured table, as printed."""
    per_token = 2 * results["parameters"]
    own = bound[args.dtype]["per_core"] / per_token  # one core's bound in the engine's dtype, tokens/s
    mode = "eager" if results["enforce_eager"] else "compiled"
    idle = [b["per_core"] * num_cores / per_token for b in bound.values()]
    rows = [
        ("matmul GFLOP per CPU-second, one thread", [b["per_core"] / 1e9 for b in bound.values()], ".1f"),
        ("matmul GFLOP/s, all cores, wall clock", [b["all_cores_wall"] / 1e9 for b in bound.values()], ".1f"),
        ("bound, idle machine (per core x cores) tok/s", idle, ".0f"),
    ]  # fmt: skip
    lines = [
        f"model: {results['parameters'] / 1e6:.1f}M parameters, engine {args.dtype} ({mode}), "
        f"{results['num_seqs']:.0f} sequences x {args.max_tokens} tokens, {num_cores} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        f"{'':<46}" + "".join(f"{dt:>12}" for dt in bound),
        *(f"{name:<46}" + "".join(f"{v:>12{fmt}}" for v in values) for name, values, fmt in rows),
        f"pool (vLLM)   : {results['pool_tokens_per_s']:7.0f} tok/s = "
        f"{results['pool_tokens_per_s'] / (own * num_cores):.0%} of the idle-machine {args.dtype} bound",
        f"pool per CPU-s: {results['pool_tokens_per_cpu_s']:7.0f} tok per engine CPU-second = "
        f"{results['pool_tokens_per_cpu_s'] / own:.0%} of one core's {args.dtype} bound ({own:.0f})",
    ]
    ratios, cpu_ratios = results["ratios"], results["cpu_ratios"]
    lines.append(
        f"bare vLLM     : {results['bare_tokens_per_s']:7.0f} tok/s (LLM.generate, same settings and prompts, "
        f"{results['pool_num_threads']:.0f} threads); per CPU-second {results['bare_tokens_per_cpu_s']:.0f}"
    )
    lines.append(
        f"pool / bare   : {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}], per CPU-second "
        f"{statistics.median(cpu_ratios):.2f}x [{min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}] ({len(ratios)} "
        "interleaved repetitions, median [range]; target >= 0.95x)"
    )
    if "hf_tokens_per_s" in results:
        lines.append(f"HF generate   : {results['hf_tokens_per_s']:7.0f} tok/s ({args.hf_dtype}, 1 thread)")
    pause = results["push_commit_s"]
    lines.append(
        f"update pause  : {pause * 1e3:7.0f} ms push + commit of {results['push_bytes'] / 1e6:.0f} MB (engine locked "
        f"{results['engine_locked_s'] * 1e3:.0f} ms) = {pause / results['pool_seconds']:.1%} of this batch's "
        f"{results['pool_seconds']:.1f} s"
    )
    if "recipe_time_step_s" in results:
        push, step = results["recipe_time_push_s"], results["recipe_time_step_s"]
        lines.append(
            f"default recipe: push {push * 1e3:.0f} ms ({results['recipe_push_bytes'] / 1e6:.1f} MB) / step "
            f"{step:.2f} s = {push / step:.1%} paused (medians of {results['recipe_num_steps']:.0f} steps; generate "
            f"{results['recipe_time_generate_s']:.2f} s, train {results['recipe_time_train_s']:.2f} s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the HF baseline (torch's bfloat16 matmuls are slow on many CPUs)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--threads-bind", default=None, help="EngineConfig.cpu_threads_bind (default: its default)")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                        help="EngineConfig.enforce_eager (default: its default)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--reps", type=int, default=3, help="interleaved pool / bare batches")
    parser.add_argument("--recipe-steps", type=int, default=8, help="default-recipe RL steps to time (0: skip)")
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a stray ~/.ray/auth_token must not turn token auth on
    num_cores = os.cpu_count() or 1
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        results, bound = measure(args, Path(tmp), num_cores)
    print(report(args, results, bound, num_cores))


def measure(args, tmp: Path, num_cores: int) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Every measurement of one run (see the module docstring), its files under ``tmp``: results and bound table."""
    from rollout.config import SamplingConfig
    from rollout.tasks.problem import Problem
    model_dir = make_model(args, tmp / "model")
    num_seqs = args.num_prompts * args.group_size
    dtypes = {"float32", args.dtype}
    before = measure_bound(args.hidden_size, num_seqs, dtypes, num_cores)
    problems = [Problem(prompt=f"Compute {i} plus {2 * i}, then think.", answer=str(3 * i), problem_id=str(i))
                for i in range(args.num_prompts)]  # fmt: skip
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {"parameters": float(count_parameters(model_dir)), "num_seqs": float(num_seqs)}
    results.update(run_pool(args, model_dir, problems, sampling, str(tmp / "ray")))
    after = measure_bound(args.hidden_size, num_seqs, dtypes, num_cores)
    bound = {dt: {k: max(before[dt][k], after[dt][k]) for k in before[dt]} for dt in sorted(dtypes)}
    if not args.skip_hf:
        results.update(run_hf(args, model_dir, problems, 1))  # 1 thread: 2 contend badly on a shared host
    if args.recipe_steps > 0:
        results.update(run_default_recipe(args.recipe_steps + 1, tmp / "recipe"))
    return results, bound


if __name__ == "__main__":
    main()
