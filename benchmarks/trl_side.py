"""Time TRL's ``GRPOTrainer`` policy update on one fixed GRPO batch (the TRL half of ``benchmarks/trainer_vs_trl.py``).

Runs inside TRL's own venv (``benchmarks/trl_venv.sh``) and imports nothing from this repository. Usage::

    .venv-trl/bin/python benchmarks/trl_side.py --model-dir DIR --batch batch.json [--steps 3] [--threads 1]

``DIR`` is an HF checkpoint directory (config, safetensors, tokenizer); ``batch.json`` holds the exact batch::

    {"groups": [{"prompt_ids": [...], "completions": [{"completion_ids": [...], "logprobs": [...], "reward": r}]}]}

Generation is taken out of the measurement through TRL's own ``rollout_func`` hook: it returns the fixed prompt and
completion ids of the group each prompt names (no model call), and the fixed rewards travel as an extra field to a
reward function that returns them. Everything after that is TRL's own path, timed from ``on_step_begin`` to
``on_step_end`` of one optimizer step: padding, group-normalised advantages, forward/backward per micro-batch with its
default "dapo" loss, grad clipping, AdamW, LR scheduler. Every step trains on the whole batch (one generation batch =
all prompts x all completions).

With ``--gated`` the process waits for a line on stdin before each step and writes one ``TRL_SIDE {json}`` line per
step, so a driver can interleave its own steps with these. Finally it writes ``TRL_SIDE {summary json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder is sys.path[0]: its kernels.py and trainer.py would shadow the packages of those
# names (transformers imports `kernels` wherever it finds one).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

MARK = "TRL_SIDE "


def _emit(obj: dict[str, Any]) -> None:
    # stdout carries TRL's own prints too; the marker lets the driver find our lines.
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class FixedRollout:
    """``rollout_func`` returning the stored completions: the k-th occurrence of a group's prompt gets its k-th one."""

    def __init__(self, groups: list[dict[str, Any]]):
        self.groups = groups
        self.num_calls = 0

    def __call__(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        seen: dict[int, int] = {}
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "reward": []}
        for prompt in prompts:
            g = int(prompt.removeprefix("group-"))
            k = seen.get(g, 0)
            seen[g] = k + 1
            c = self.groups[g]["completions"][k]
            out["prompt_ids"].append(self.groups[g]["prompt_ids"])
            out["completion_ids"].append(c["completion_ids"])
            out["logprobs"].append(c["logprobs"])
            out["reward"].append(c["reward"])
        expected = {g: len(grp["completions"]) for g, grp in enumerate(self.groups)}
        if seen != expected:
            raise RuntimeError(f"a TRL generation batch must be the whole fixed batch, got prompt counts {seen}")
        self.num_calls += 1
        return out


def fixed_reward(prompts: list, completions: list, completion_ids: list, reward: list[float], **_: Any) -> list[float]:
    """The reward stored with each completion (delivered by ``FixedRollout`` as an extra field)."""
    return reward


class StepTimer(TrainerCallback):
    """Wall and CPU seconds of each optimizer step; optionally waits for a stdin line before each step."""

    def __init__(self, gated: bool):
        self.gated = gated
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self._start = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.gated and not sys.stdin.readline():
            raise SystemExit("trl_side: stdin closed by the driver")
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
        self.walls.append(wall)
        self.cpus.append(cpu)
        if self.gated:
            _emit({"step": len(self.walls), "wall_s": wall, "cpu_s": cpu})


def build_trainer(args: argparse.Namespace, groups: list[dict[str, Any]], timer: StepTimer) -> GRPOTrainer:
    group_size = len(groups[0]["completions"])
    num_samples = len(groups) * group_size
    longest = max(len(g["prompt_ids"]) for g in groups) + max(
        len(c["completion_ids"]) for g in groups for c in g["completions"]
    )
    # TRL pads every micro-batch to its longest row: take as many rows as the longest sequence fits in our token
    # budget, rounded down to a divisor of the batch (TRL requires whole micro-batches).
    rows = max(1, args.micro_batch_tokens // longest)
    while num_samples % rows:
        rows -= 1
    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", logging_steps=10**6, seed=0, num_train_epochs=10**6, max_steps=args.warmup + args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0, weight_decay=0.0,
        beta=0.0, num_generations=group_size, per_device_train_batch_size=rows,
        gradient_accumulation_steps=num_samples // rows, num_iterations=1,
        activation_checkpointing=args.activation_checkpointing, max_completion_length=longest,
        dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = Dataset.from_dict({"prompt": [f"group-{g}" for g in range(len(groups))]})
    return GRPOTrainer(
        model=model, reward_funcs=fixed_reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        rollout_func=FixedRollout(groups), callbacks=[timer],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True, help="HF checkpoint directory with a tokenizer")
    parser.add_argument("--batch", required=True, help="JSON file of the fixed batch (see the module docstring)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="padded tokens per micro-batch, at most")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--activation-checkpointing", action="store_true", help="TRL's default; off here as in ours")
    parser.add_argument("--gated", action="store_true", help="wait for a stdin line before each step")
    parser.add_argument("--output-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trl_side_out"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.batch) as f:
        groups = json.load(f)["groups"]
    if len({len(g["completions"]) for g in groups}) != 1:
        raise ValueError(f"{args.batch}: every group needs the same number of completions (TRL's num_generations)")

    timer = StepTimer(args.gated)
    trainer = build_trainer(args, groups, timer)
    trainer.train()
    if trainer.rollout_func.num_calls != args.warmup + args.steps:
        raise RuntimeError(f"expected one generation per step, got {trainer.rollout_func.num_calls}")

    walls, cpus = timer.walls[args.warmup :], timer.cpus[args.warmup :]
    tokens = sum(len(g["prompt_ids"]) + len(c["completion_ids"]) for g in groups for c in g["completions"])
    _emit({
        "trl_version": __import__("trl").__version__, "torch_version": torch.__version__,
        "threads": torch.get_num_threads(), "useful_tokens": tokens,
        "micro_batch_rows": trainer.args.per_device_train_batch_size,
        "num_micro_batches": trainer.args.gradient_accumulation_steps,
        "best_wall_s": min(walls), "median_wall_s": statistics.median(walls),
        "best_cpu_s": min(cpus), "median_cpu_s": statistics.median(cpus), "walls": walls, "cpus": cpus,
    })  # fmt: skip


if __name__ == "__main__":
    main()
