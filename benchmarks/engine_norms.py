"""vLLM on CPU with RMSNorm on its C++ kernels (``rollout.engine.cpu_kernels``, our default) against its native path.

Run: ``.venv/bin/python benchmarks/engine_norms.py [--reps 15] [--threads 2]``. For each shape, two bare ``vllm.LLM``
engines with the production settings (``rollout.engine.vllm_engine.vllm_engine_args``), one of them with
``ir_op_priority`` set back to ``native`` (vLLM 0.32's CPU default), each in a process of its own that stays up; their
batches alternate (kernels, native, kernels, ...), so a drift of the machine hits both. It prints per shape the median
[range] seconds of a batch on each and the speed-up (native / kernels, median of the per-pair ratios). Shapes:

- ``demo``: the default recipe (``recipes/grpo_tiny.toml``): its tiny Qwen 3 (float32), 32 of its arithmetic chat
  prompts x 8 samples, at most 8 tokens (the recipe's sampling): one RL step's generation;
- ``prefill``: the same batch, 1 token: the prefill alone (256 prompts of ~25 tokens);
- ``40m``: the rollout benchmark's model (hidden 512, 10 layers, float32), 16 prompts x 4 samples x 128 tokens.

Parity of the kernels with vLLM's native implementation: ``tests/rollout/test_cpu_kernels.py``.
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

NATIVE = {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}}


def _shapes(tmp: Path, names: set[str]) -> list[tuple[str, object, list, object, int]]:
    """(name, rollout config, problems, sampling, group size) of each shape in ``names``; the models they need are
    written under ``tmp``."""
    from driver.preflight import ensure_model
    from recipe import load_recipe
    from rollout.config import SamplingConfig
    from rollout.tasks import build_dataset
    from rollout.tasks.problem import Problem
    from tools.make_tiny_model import make_tiny_model

    recipe = load_recipe(_REPO / "recipes" / "grpo_tiny.toml", {"model.path": str(tmp / "demo")}, check_paths=False)
    base = recipe.rollout
    shapes: list[tuple[str, object, list, object, int]] = []
    if names & {"demo", "prefill"}:
        ensure_model(recipe)  # the recipe's own tiny Qwen 3, as a run creates it
        problems = build_dataset(recipe.task).next_batch(recipe.run.num_prompts_per_step)
        group, sampling = recipe.algorithm.group_size, base.sampling
        shapes += [("demo", base, problems, sampling, group),
                   ("prefill", base, problems, sampling.model_copy(update={"max_tokens": 1}), group)]
    if "40m" in names:
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
    with tempfile.TemporaryDirectory(prefix="bench-norms-") as tmp:
        for name, config, problems, sampling, group in _shapes(Path(tmp), set(args.shapes.split(","))):
            engines = {"kernels": BareLLM(config, config.model_path, problems, sampling, group, args.threads),
                       "native": BareLLM(config, config.model_path, problems, sampling, group, args.threads, NATIVE)}
            times: dict[str, list[float]] = {"kernels": [], "native": []}
            try:
                for _ in range(args.reps):
                    for side, engine in engines.items():
                        times[side].append(engine.batch()["bare_seconds"])
            finally:
                for engine in engines.values():
                    engine.close()
            ratios = [n / k for k, n in zip(times["kernels"], times["native"])]
            rows.append((name, times, ratios))
            print(f"{name}: kernels {med_range(times['kernels'], '{:.4f}')} s, native "
                  f"{med_range(times['native'], '{:.4f}')} s", flush=True)  # fmt: skip
    print(f"\nengine_norms: {args.reps} alternating batch pairs per shape, {args.threads} thread(s) per engine; "
          f"load (1/5/15 min) before {before}, after {load_avg()}")  # fmt: skip
    print(f"{'shape':10s} {'kernels s/batch':>22s} {'native s/batch':>22s} {'native / kernels':>22s}")
    for name, times, ratios in rows:
        print(f"{name:10s} {med_range(times['kernels'], '{:.4f}'):>22s} {med_range(times['native'], '{:.4f}'):>22s} "
              f"{med_range(ratios, '{:.2f}x'):>22s}")  # fmt: skip


if __name__ == "__main__":
    main()
