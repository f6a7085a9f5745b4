"""vLLM on CPU with RMSNorm and SwiGLU on its C++ kernels (``rollout.engine.cpu_kernels``, our default) against its
native paths.

Run: ``.venv/bin/python benchmarks/engine_kernels.py [--reps 15] [--threads 2]``. For each shape, three bare
``vllm.LLM`` engines with the production settings (``rollout.engine.vllm_engine.vllm_engine_args``): ``kernels`` (as
served), ``norms`` (SwiGLU set back to native with ``custom_ops = ["-silu_and_mul"]``) and ``native`` (that and
``ir_op_priority`` set back to ``native`` too: vLLM 0.32's CPU defaults), each in a process of its own that stays up;
their batches alternate (kernels, norms, native, kernels, ...), so a drift of the machine hits all three. It prints per
shape the median [range] seconds of a batch on each and the speed-ups over ``native`` (median of the per-round
ratios). Shapes:

- ``demo``: the default recipe (``recipes/grpo_tiny.toml``): its tiny Qwen 3 (float32), 32 of its arithmetic chat
  prompts x 8 samples, at most 8 tokens (the recipe's sampling): one RL step's generation;
- ``prefill``: the same batch, 1 token: the prefill alone (256 prompts of ~25 tokens);
- ``40m``: the rollout benchmark's model (hidden 512, 10 layers, float32), 16 prompts x 4 samples x 128 tokens.

Parity of the kernels with vLLM's native implementations: ``tests/rollout/test_cpu_kernels.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == _REPO / "benchmarks":
    sys.path[0] = str(_REPO)

from benchmarks.machine import load_avg, machine_line, med_range  # noqa: E402
from benchmarks.rollout import BareLLM  # noqa: E402

NATIVE_SWIGLU = {"compilation_config": {"custom_ops": ["-silu_and_mul"]}}
NATIVE = {**NATIVE_SWIGLU, "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}
VARIANTS = {"kernels": None, "norms": NATIVE_SWIGLU, "native": NATIVE}
"""Engine-argument overrides of each variant (None: the production settings)."""


def _shapes(tmp: Path, names: set[str]) -> list[tuple[str, object, list, object, int]]:
    """(name, rollout config, problems, sampling, group size) of each shape in ``names``; the models they need are
    written under ``tmp``."""
    from driver.run import ensure_model
    from recipe import load_recipe
    from rollout.config import SamplingConfig
    from rollout.tasks import build_dataset
    from rollout.tasks.problem import Problem
    from tools.make_tiny_model import make_tiny_model

    shapes: list[tuple[str, object, list, object, int]] = []
    if names & {"demo", "prefill"}:
        recipe = load_recipe(_REPO / "recipes" / "grpo_tiny.toml", {"model.path": str(tmp / "demo")},
                             check_paths=False)  # fmt: skip
        ensure_model(recipe)  # the recipe's own tiny Qwen 3, as a run creates it
        problems = build_dataset(recipe.task).next_batch(recipe.run.num_prompts_per_step)
        group, sampling = recipe.algorithm.group_size, recipe.rollout.sampling
        shapes += [("demo", recipe.rollout, problems, sampling, group),
                   ("prefill", recipe.rollout, problems, sampling.model_copy(update={"max_tokens": 1}), group)]
    if "40m" in names:
        base = load_recipe(_REPO / "recipes" / "grpo_tiny.toml", check_paths=False).rollout
        big_dir = make_tiny_model(tmp / "40m", family="qwen3", hidden_size=512, num_layers=10, num_heads=8,
                                  intermediate_size=2048)  # fmt: skip
        big = base.model_copy(update={"model_path": str(big_dir), "engine": base.engine.model_copy(
            update={"max_model_len": 512, "max_num_seqs": 64})})  # fmt: skip
        big_problems = [Problem(prompt=f"Compute {i} plus {2 * i}, then think.", answer=str(3 * i),
                                problem_id=str(i)) for i in range(16)]  # fmt: skip
        shapes.append(("40m", big, big_problems, SamplingConfig(temperature=1.0, max_tokens=128, ignore_eos=True), 4))
    return [shape for shape in shapes if shape[0] in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="alternating batch pairs per shape")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads per engine")
    parser.add_argument("--shapes", default="demo,prefill,40m", help="comma-separated subset")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(machine_line(), flush=True)
    before = load_avg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as tmp:
        for name, config, problems, sampling, group in _shapes(Path(tmp), set(args.shapes.split(","))):
            engines = {variant: BareLLM(config, config.model_path, problems, sampling, group, args.threads, overrides)
                       for variant, overrides in VARIANTS.items()}  # fmt: skip
            times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            try:
                for _ in range(args.reps):
                    for variant, engine in engines.items():
                        times[variant].append(engine.batch()["bare_seconds"])
            finally:
                for engine in engines.values():
                    engine.close()
            rows.append((name, times))
            print(f"{name}: " + ", ".join(f"{v} {med_range(t, '{:.4f}')} s" for v, t in times.items()), flush=True)
    print(f"\nengine_kernels: {args.reps} alternating rounds per shape, {args.threads} thread(s) per engine; "
          f"load (1/5/15 min) before {before}, after {load_avg()}")  # fmt: skip
    print(f"{'shape':8s} " + " ".join(f"{v + ' s/batch':>22s}" for v in VARIANTS)
          + f" {'native / kernels':>20s} {'native / norms':>20s}")  # fmt: skip
    for name, times in rows:
        over = {v: [n / t for t, n in zip(times[v], times["native"])] for v in ("kernels", "norms")}
        print(f"{name:8s} " + " ".join(f"{med_range(times[v], '{:.4f}'):>22s}" for v in VARIANTS)
              + f" {med_range(over['kernels'], '{:.2f}x'):>20s} {med_range(over['norms'], '{:.2f}x'):>20s}")

if __name__ == "__main__":
    main()
