"""The whole service at a real model size, where the time and the memory of every phase go: a recipe of a published
architecture's shape (``recipes/qwen3_0p6b_cpu.toml``: Qwen3-0.6B, random weights created locally) on 1 and on 2
FSDP trainer ranks, side by side in one run; for an MoE recipe (``recipes/qwen3_30b_a3b_reduced_cpu.toml``) also with
and without expert parallelism.

    python -m benchmarks.scale [--recipe recipes/qwen3_0p6b_cpu.toml] [--ranks 1,2] [--steps 3]
    python -m benchmarks.scale --recipe recipes/qwen3_30b_a3b_reduced_cpu.toml --ranks 2 --expert-parallel 1,2
    python -m benchmarks.scale --vocab-parallel 1,0 --live-memory
    python -m benchmarks.scale --release-freed on,off

Each setting runs ``rl_align.py`` as a process of its own (embedded Ray, the recipe's placement), with every process of
its tree sampled every 0.5 s (``psutil``): the peak resident set of each trainer rank, of each rollout worker (the vLLM
engine and its receiver) and of the driver while the run trains, the trainer ranks' peak after its last step
(``export``: the final HF export, each tensor gathered and written in turn), and the machine's used memory. From the
run's ``metrics.jsonl``, the median over the steps after the first (the first compiles, allocates and loads): generation
and its scoring, the policy update and its parts (old / reference log-probs, forward + backward, optimizer), the push
(trainer side) and the engine's reload (``rollout/weight_update_s``, the pause), the whole step, and the push + reload
share of it. The trainer's rate is ``6 x parameters x tokens`` (prompt + completion tokens of the step; for an MoE model
the parameters a token uses, ``ModelConfig.active_params``) per second of its update, against this machine's fp32 matmul
FLOP/s on all cores (``benchmarks.trainer``), measured before and after the runs. The model is created once and shared
by the settings. The CPU model and the load before and after are printed; measure on a quiet machine and repeat.

``--vocab-parallel 1,0`` runs each multi-rank setting with the vocabulary split (``trainer.vocab_parallel``) and
without it (default: as the recipe says). Resident memory counts what glibc keeps of freed memory for reuse; the
trainer ranks return theirs as they train (``trainer.release_freed_memory``, on by default on the CPU; without it 1-3
GB a rank beyond what is live, about the same at every rank count); ``--release-freed on,off`` runs every setting
with the release and without it (each ratio is to 1 rank of the same setting). ``--live-memory`` runs every process
with ``MALLOC_MMAP_THRESHOLD_=131072``, so freed blocks over 128 KiB go back to the system at once and the peak
resident set is close to the live peak (every large allocation then faults its pages in again: slower, so take times
from a run without it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil

from benchmarks.machine import load_avg, machine_line

REPO = Path(__file__).resolve().parents[1]
ROLES = (("trainer rank", "TrainerWorker"), ("rollout worker", "RolloutWorker"))
PHASES = (
    ("generate s", "time/generate_s"), ("score s", "rollout/score_s"), ("policy update s", "train/step_s"),
    ("logprobs s", "train/logprobs_s"), ("fwd+bwd s", "train/forward_backward_s"), ("optimizer s", "train/optimizer_s"),
    ("push s", "push/seconds"), ("reload s", "rollout/weight_update_s"), ("step s", "time/step_s"),
)  # fmt: skip
"""(column, metric): the policy update's parts are the trainer's ``train/logprobs_s`` (old / reference log-probs),
``train/forward_backward_s`` and ``train/optimizer_s``; score is inside generate, reload inside push."""


class _MemorySampler(threading.Thread):
    """Peak resident set per process of ``root``'s tree (by role) while the run trains, the trainer ranks' peak after
    it (``export``), and the machine's peak used memory. Training ends when ``metrics`` (the run's ``metrics.jsonl``)
    holds ``num_steps`` RL step records."""

    def __init__(self, root: int, metrics: Path, num_steps: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s = psutil.Process(root), period_s
        self.metrics, self.num_steps = metrics, num_steps
        self.peaks: dict[int, tuple[str, int]] = {}
        self.export_peak = 0
        self.machine_peak = 0
        self._done = threading.Event()

    def _role(self, proc: psutil.Process) -> str:
        if proc.pid == self.root.pid:
            return "driver"
        title = " ".join(proc.cmdline())
        return next((role for role, marker in ROLES if marker in title), "")

    def _trained(self) -> bool:
        try:
            lines = self.metrics.read_text().splitlines()
        except OSError:
            return False
        records = [json.loads(line) for line in lines if '"train/step_s"' in line and line.endswith("}")]
        return sum(r.get("phase") == "rl" for r in records) >= self.num_steps

    def run(self) -> None:
        trained = False
        while not self._done.wait(self.period_s):
            self.machine_peak = max(self.machine_peak, psutil.virtual_memory().used)
            trained = trained or self._trained()
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                try:
                    role, rss = self._role(proc), proc.memory_info().rss
                except psutil.Error:
                    continue
                if role == "trainer rank" and trained:
                    self.export_peak = max(self.export_peak, rss)
                elif role and not trained:
                    self.peaks[proc.pid] = (role, max(rss, self.peaks.get(proc.pid, (role, 0))[1]))

    def stop(self) -> dict[str, float]:
        """Stop sampling; the peak of each role while training (the largest of its processes), ``export`` (the trainer
        ranks after training) and ``machine``, in GB."""
        self._done.set()
        self.join()
        out = {"machine": self.machine_peak / 1e9, "export": self.export_peak / 1e9}
        for role, rss in self.peaks.values():
            out[role] = max(out.get(role, 0.0), rss / 1e9)
        return out


def _run(
    recipe: str, ranks: int, ep: int, vocab_parallel: bool | None, steps: int, model_dir: Path, out_dir: Path,
    live_memory: bool, release: bool | None,
) -> dict[str, Any]:  # fmt: skip
    """One setting (``ranks`` trainer ranks, expert parallel degree ``ep``, the vocabulary split on, off or None: as
    the recipe says): the run's per-phase medians, trainer tokens per step and peak memory by role."""
    from driver.metrics import read_jsonl

    args = [
        sys.executable, "rl_align.py", "--recipe", recipe, "--trainer.num_ranks", str(ranks),
        "--trainer.parallelism.expert_parallel_degree", str(ep),
        "--run.num_steps", str(steps), "--run.output_dir", str(out_dir), "--model.path", str(model_dir),
        "--run.logging.tensorboard", "false", "--run.logging.progress", "false",
    ]  # fmt: skip
    if vocab_parallel is not None:
        args += ["--trainer.parallelism.vocab_parallel", str(vocab_parallel).lower()]
    if release is not None:
        args += ["--trainer.release_freed_memory", str(release).lower()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if live_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    log = out_dir.with_suffix(".log")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        sampler = _MemorySampler(proc.pid, out_dir / "metrics.jsonl", steps)
        sampler.start()
        rc = proc.wait()
        memory = sampler.stop()
    if rc != 0:
        raise RuntimeError(f"{ranks} rank(s): rl_align.py exited {rc}; log: {log}\n{log.read_text()[-3000:]}")
    records = [r for r in read_jsonl(out_dir / "metrics.jsonl") if r.get("phase") == "rl" and "train/step_s" in r]
    later = records[1:] or records
    medians = {label: statistics.median(r[key] for r in later) for label, key in PHASES}
    tokens = statistics.median(r["train/tokens_per_s"] * r["train/step_s"] for r in later)
    return {"phases": medians, "tokens": tokens, "memory": memory, "steps": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="recipes/qwen3_0p6b_cpu.toml")
    parser.add_argument("--ranks", default="1,2", help="comma-separated trainer rank counts")
    parser.add_argument("--expert-parallel", default="1", help="comma-separated expert parallel degrees (MoE recipes): "
                        "each runs with every rank count it divides")
    parser.add_argument("--vocab-parallel", default="", help="comma-separated 1/0: each multi-rank setting with the "
                        "vocabulary split on / off (default: as the recipe says)")
    parser.add_argument("--release-freed", default="", help="comma-separated on/off: every setting with the "
                        "trainer's release of freed memory on / off (default: as the recipe says)")
    parser.add_argument("--live-memory", action="store_true", help="return freed memory at once (see the docstring)")
    parser.add_argument("--steps", type=int, default=3, help="RL steps per setting (the first is not counted)")
    args = parser.parse_args()
    import torch

    from benchmarks.trainer import matmul_flops
    from recipe import load_recipe
    from trainer.models.hf_config import model_config_from_hf

    print(machine_line(), flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    peaks = [matmul_flops()[0]]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        model_dir = Path(tmp) / "model"  # created by the first run, reused by the others
        failed: dict[str, str] = {}
        splits = [bool(int(v)) for v in args.vocab_parallel.split(",")] if args.vocab_parallel else [None]
        settings = [(int(r), int(ep)) for ep in args.expert_parallel.split(",") for r in args.ranks.split(",")]
        on_off = {"on": True, "off": False}
        releases = [on_off[v] for v in args.release_freed.split(",")] if args.release_freed else [None]
        runs = [(r, ep, vp, rel) for rel in releases for r, ep in settings if r % ep == 0
                for vp in (splits if r > 1 else [None])]  # fmt: skip
        for ranks, ep, vp, rel in runs:
            name = f"{ranks}" + (f" ep{ep}" if ep > 1 else "") + ("" if vp is None else " vp" if vp else " no-vp")
            name += "" if rel is None else " release" if rel else " no-release"
            out_dir = Path(tmp) / name.replace(" ", "-")
            try:
                results[name] = _run(args.recipe, ranks, ep, vp, args.steps, model_dir, out_dir, args.live_memory,
                                     rel)  # fmt: skip
            except RuntimeError as e:  # e.g. out of memory: report it beside the settings that ran
                failed[name] = next((line for line in str(e).splitlines() if "memory" in line), str(e)[:300])
        model = model_config_from_hf(str(model_dir))
    peaks.append(matmul_flops()[0])
    recipe = load_recipe(REPO / args.recipe, check_paths=False)
    peak = max(peaks)
    print(f"{args.recipe}: {model.num_params / 1e9:.2f}B parameters, vocabulary {model.vocab_size}, "
          f"{recipe.run.num_prompts_per_step} x {recipe.algorithm.group_size} samples of <= "
          f"{recipe.rollout.sampling.max_tokens} tokens a step, activation checkpointing "
          f"{recipe.trainer.activation_checkpoint.mode!r}; medians of steps 2-{args.steps}; matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s (fp32, all cores; {min(peaks) / 1e9:.0f}-{peak / 1e9:.0f} before/after)"
          + ("; memory: live (MALLOC_MMAP_THRESHOLD_=131072)" if args.live_memory else "; memory: resident"))
    columns = [label for label, _ in PHASES] + ["push+reload", "6NT/s / peak"]
    columns += ["trainer GB", "rollout GB", "driver GB", "export GB", "machine GB"]
    print(f"{'ranks':<20}" + "".join(f"{c:>16}" for c in columns))
    for ranks, r in results.items():
        p, mem = r["phases"], r["memory"]
        flops = 6 * model.active_params * r["tokens"] / p["policy update s"]
        cells = [f"{p[label]:.2f}" for label, _ in PHASES]
        cells += [f"{(p['push s'] + p['reload s']) / p['step s']:.1%}", f"{flops / peak:.2f}"]
        roles = ("trainer rank", "rollout worker", "driver", "export", "machine")
        cells += [f"{mem.get(role, 0.0):.1f}" for role in roles]
        print(f"{ranks:<20}" + "".join(f"{c:>16}" for c in cells))
    for ranks, why in failed.items():
        print(f"{ranks:<20}failed: {why[:400]}")
    for name in [n for n in results if n.split()[0] == "2" and "ep" not in n]:
        one = " ".join(["1", *[w for w in name.split()[1:] if "release" in w]])  # 1 rank, the same release setting
        if one in results:
            ratio = results[name]["memory"]["trainer rank"] / results[one]["memory"]["trainer rank"]
            print(f"trainer peak per rank, {name} / {one}: {ratio:.2f}x (target <= 0.6x)")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
