"""Where a run's start-up goes: each part of it timed in a fresh process of its own, beside what TRL's process does
before its first step.

Run: ``.venv/bin/python -m benchmarks.startup [--reps 3] [--recipe recipes/grpo_tiny.toml]``

A run reaches its first RL step after, in order: the driver's imports, Ray's embedded start
(``driver.session.ray_session``: the GCS, the raylet and its runtime-env and dashboard agents), then, in the rollout
actor, the import of vLLM and the engine's build (``rollout.engine.vllm_engine.VLLMEngine`` on the recipe's model and
``[rollout.engine]``; the trainer's start runs beside it on the other cores). The engine's chain is the longest path.
Each part is timed here alone in a fresh process (``benchmarks.machine.run_in_child``), ``--reps`` times, the parts
interleaved; the engine process gets what a colocated engine gets (the actors' environment,
``driver.session.worker_env_vars``, with one thread per core). For comparison, TRL's start on the same model: importing
torch and transformers and ``AutoModelForCausalLM.from_pretrained`` (what ``benchmarks/trl_e2e_side.py`` does before its
first step, TRL's own import aside). Printed: the CPU model, the load before and after, and median [min-max] seconds per
part.

Alone, the parts sum to less than a run's start-up: in a run they share the cores with each other and with the
trainer's start (``benchmarks/e2e_vs_trl.py`` prints a run's start-up as a whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.machine import load_avg, machine_line, med_range, run_in_child


def _driver_part(recipe_path: str, model: str, env: dict[str, str], out: str) -> None:
    """The driver's imports up to Ray, then Ray's embedded start (in a fresh process: :func:`run_in_child`)."""
    os.environ.update(env)
    t0 = time.perf_counter()
    import rl_align  # noqa: F401  (the driver's entry point and what it imports before Ray starts)
    from driver.session import ray_session
    from recipe import load_recipe

    recipe = load_recipe(recipe_path, {"model.path": model})
    t1 = time.perf_counter()
    with ray_session(None, recipe.trainer.device):
        t2 = time.perf_counter()
    Path(out).write_text(json.dumps({"driver imports": t1 - t0, "Ray's embedded start": t2 - t1}))


def _engine_part(recipe_path: str, model: str, env: dict[str, str], out: str) -> None:
    """The rollout actor's import of vLLM, then the engine's build on the recipe's ``[rollout.engine]``."""
    os.environ.update(env)  # before torch is imported: its thread pool is sized then
    t0 = time.perf_counter()
    import vllm  # noqa: F401
    from vllm import LLM  # noqa: F401

    from rollout.engine.vllm_engine import VLLMEngine

    t1 = time.perf_counter()
    from recipe import load_recipe

    recipe = load_recipe(recipe_path, {"model.path": model})
    t2 = time.perf_counter()
    engine = VLLMEngine(model, recipe.rollout.engine)
    t3 = time.perf_counter()
    engine.shutdown()
    Path(out).write_text(json.dumps({"engine: import vLLM": t1 - t0, "engine: build": t3 - t2}))


def _hf_part(recipe_path: str, model: str, env: dict[str, str], out: str) -> None:
    """What TRL's process does before its first step on the same model: import torch and transformers, load it."""
    os.environ.update(env)
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    t1 = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(model)
    t2 = time.perf_counter()
    Path(out).write_text(json.dumps({"HF: import torch + transformers": t1 - t0, "HF: from_pretrained": t2 - t1}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--recipe", default="recipes/grpo_tiny.toml")
    args = parser.parse_args()
    print(machine_line(), flush=True)

    from driver.placement import threads_env
    from driver.preflight import ensure_model
    from driver.session import worker_env_vars
    from recipe import load_recipe

    threads = threads_env(len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        model = str(Path(tmp) / "model")
        recipe = load_recipe(args.recipe, {"model.path": model}, check_paths=False)
        ensure_model(recipe)
        base = {"RAY_AUTH_MODE": "disabled", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        actor_env = {**base, **worker_env_vars(recipe.trainer.device), **threads}
        hf_env = {**base, **threads, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        parts: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for part, env in ((_driver_part, base), (_engine_part, actor_env), (_hf_part, hf_env)):
                for name, seconds in run_in_child(part, args.recipe, model, env).items():
                    parts.setdefault(name, []).append(seconds)
    print(f"{args.recipe}, {args.reps} rep(s) of each part, each in a fresh process, interleaved")
    print(f"{'part':<36}{'seconds: median [min-max]':>28}")
    for name, values in parts.items():
        print(f"{name:<36}{med_range(values):>28}")
    ours = sum(statistics.median(v) for k, v in parts.items() if not k.startswith("HF"))
    theirs = sum(statistics.median(v) for k, v in parts.items() if k.startswith("HF"))
    print(f"sum of medians: ours {ours:.1f} s (driver, Ray, engine chain), HF's {theirs:.1f} s")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
