"""GRPO with TRL's ``GRPOTrainer`` from a warm-started model: the TRL half of ``benchmarks/e2e_vs_trl.py``.

Runs inside TRL's own venv (``benchmarks/trl_venv.sh``) and imports nothing from this repository. Usage::

    .venv-trl/bin/python benchmarks/trl_e2e_side.py --model-dir DIR --train train.jsonl --output-dir OUT \\
        --steps 300 --save-steps 25 [--threads 2] [--max-completion-tokens 8] [--min-completion-tokens 0]
    .venv-trl/bin/python benchmarks/trl_e2e_side.py --model-dir DIR --train train.jsonl --check-prompts

``DIR`` is a ``from_pretrained``-ready HF directory with its tokenizer (and chat template). ``train.jsonl`` holds one
problem per line, ``{"prompt": [{"role": "user", "content": ...}], "answer": "12"}``, in the order the steps consume
them: step k trains on lines ``k * num_prompts`` to ``(k + 1) * num_prompts - 1`` (``shuffle_dataset=False``), each
sampled ``--group-size`` times. The reward is exact match after stripping, collapsing whitespace and lower-casing.

The run is TRL's own path end to end: transformers ``generate`` (TRL's default backend), group-normalised advantages,
the clipped loss with ``--loss-type`` (default "dapo": token-level, normalised by the tokens of the whole generation
batch), grad clipping, AdamW and a cosine schedule to ``--min-lr-ratio`` of the peak; HF checkpoints (weights,
config, tokenizer) every ``--save-steps`` steps to ``OUT/checkpoint-<step>``.

Timing (``OUT/timings.json``, read by the driver): per optimizer step the wall clock at its begin and end
(``time.time()``, so a driver can relate it to when it started this process), the seconds spent in
``generate`` (``GRPOTrainer._generate_single_turn``) and in the whole generation phase (prompt tokenisation,
generation, decoding, rewards, advantages: ``_generate_and_score_completions``), token counts, the mean reward and
TRL's own logged metrics. The two phases are measured by wrapping those two (private) methods of this TRL version
(1.16); another version that renames them fails at start with a clear error. The step-1 prompt ids TRL generated from
are saved too, so the driver can check them against its own rendering.

``--check-prompts`` prints ``TRL_E2E {"prompt_ids": [...]}``: every prompt of ``train.jsonl`` rendered by TRL's own
prompt path (``_tokenize_prompts``: the tokenizer's chat template with ``add_generation_prompt=True``) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
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

MARK = "TRL_E2E "
_WRAPPED = ("_generate_single_turn", "_generate_and_score_completions", "_tokenize_prompts")


def _emit(obj: dict[str, Any]) -> None:
    # stdout carries TRL's own prints too; the marker lets the driver find our line.
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def normalize_answer(text: str) -> str:
    """Strip, collapse runs of whitespace to one space, lower-case (the rule of the driver's exact-match reward)."""
    return " ".join(text.split()).lower()


class StepRecorder(TrainerCallback):
    """Per optimizer step: wall clock at begin/end and the generation-phase figures the trainer wrapper adds."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.logs: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {}
        self.train_begin = 0.0
        self.train_end = 0.0
        self.train_end_cpu = 0.0
        self.first_prompt_ids: list[list[int]] | None = None

    def add(self, key: str, value: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + value

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_begin = time.time()

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = {"step": state.global_step + 1, "t_begin": time.time(), "cpu_begin": time.process_time()}

    def on_step_end(self, args, state, control, **kwargs):
        self.current["t_end"] = time.time()
        self.current["cpu_end"] = time.process_time()
        self.steps.append(self.current)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.logs.append({"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, float)}})

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end = time.time()
        self.train_end_cpu = time.process_time()


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose generation phase is timed into a :class:`StepRecorder` (behaviour unchanged)."""

    recorder: StepRecorder

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.recorder.add("generate_total_s", time.perf_counter() - start)
        return out

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self.recorder.add("generate_s", time.perf_counter() - start)
        self.recorder.add("num_prompt_tokens", float(sum(len(p) for p in prompt_ids)))
        self.recorder.add("num_completion_tokens", float(sum(len(c) for c in completion_ids)))
        self.recorder.add("num_samples", float(len(completion_ids)))
        if self.recorder.first_prompt_ids is None:
            self.recorder.first_prompt_ids = [list(map(int, p)) for p in prompt_ids]
        return completion_ids, logprobs


def exact_match_reward(recorder: StepRecorder):
    """TRL reward function: 1.0 when the completion's text equals the row's ``answer`` after normalisation."""

    def exact_match(completions: list, answer: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(normalize_answer(t) == normalize_answer(a)) for t, a in zip(texts, answer, strict=True)]
        recorder.add("reward_sum", sum(scores))
        return scores

    return exact_match


def micro_batch_rows(num_samples: int, longest: int, micro_batch_tokens: int) -> int:
    """Rows per TRL micro-batch: as many padded rows of ``longest`` tokens as fit ``micro_batch_tokens``, rounded down
    to a divisor of ``num_samples`` (TRL accumulates whole micro-batches)."""
    rows = max(1, min(num_samples, micro_batch_tokens // longest))
    while num_samples % rows:
        rows -= 1
    return rows


def build_trainer(args: argparse.Namespace, rows: list[dict[str, Any]], recorder: StepRecorder) -> TimedGRPOTrainer:
    missing = [name for name in _WRAPPED if not hasattr(GRPOTrainer, name)]
    if missing:
        raise RuntimeError(f"this TRL version has no GRPOTrainer.{', .'.join(missing)}: the phase timers need them")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{args.model_dir}: the tokenizer has no chat template (TRL renders conversational prompts)")
    longest_prompt = args.max_prompt_tokens or max(
        len(tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"]) for r in rows
    )  # fmt: skip
    num_samples = args.num_prompts * args.group_size
    rows_per_mb = micro_batch_rows(num_samples, longest_prompt + args.max_completion_tokens, args.micro_batch_tokens)
    generation_kwargs = {"min_new_tokens": args.min_completion_tokens} if args.min_completion_tokens else None
    saving = args.save_steps > 0
    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", disable_tqdm=True,
        seed=args.seed, max_steps=args.steps, logging_steps=1, dataloader_num_workers=0,
        save_strategy="steps" if saving else "no", save_steps=args.save_steps if saving else 500,
        save_only_model=True,
        learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio}, warmup_steps=args.warmup_steps,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,
        beta=0.0, loss_type=args.loss_type, scale_rewards="group", epsilon=args.clip_low,
        epsilon_high=args.clip_high, num_iterations=1, mask_truncated_completions=False,
        num_generations=args.group_size, per_device_train_batch_size=rows_per_mb,
        gradient_accumulation_steps=num_samples // rows_per_mb, shuffle_dataset=False,
        max_completion_length=args.max_completion_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        generation_kwargs=generation_kwargs, activation_checkpointing=False, log_completions=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows])
    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=exact_match_reward(recorder), args=config, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[recorder],
    )  # fmt: skip
    trainer.recorder = recorder
    return trainer


def main() -> None:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True, help="warm-started HF model directory with its tokenizer")
    parser.add_argument("--train", required=True, help="JSONL of training problems, in consumption order")
    parser.add_argument("--output-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trl_e2e_out"))
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (one generation batch each)")
    parser.add_argument("--save-steps", type=int, default=25, help="HF checkpoint every k steps; 0: none")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch intra-op threads")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-tokens", type=int, default=8)
    parser.add_argument("--min-completion-tokens", type=int, default=0, help="generate at least this many (EOS banned)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of the peak")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps before the cosine")
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--loss-type", default="dapo", help="TRL loss_type; 'dapo' is a token mean over the batch")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="padded tokens per micro-batch, at most")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (sizes micro-batches); "
                        "default: measured over --train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-prompts", action="store_true", help="print TRL's prompt ids of every line and exit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines() if line.strip()]
    if not args.check_prompts and len(rows) < args.steps * args.num_prompts:
        raise ValueError(f"{args.train}: {len(rows)} problems; {args.steps} steps x {args.num_prompts} prompts need "
                         "more")

    recorder = StepRecorder()
    trainer = build_trainer(args, rows, recorder)
    if args.check_prompts:
        prompt_ids, _, _ = trainer._tokenize_prompts([r["prompt"] for r in rows])
        _emit({"prompt_ids": [list(map(int, p)) for p in prompt_ids]})
        return
    ready = time.time()
    trainer.train()
    num_steps = len(recorder.steps)
    if num_steps != args.steps:
        raise RuntimeError(f"expected {args.steps} optimizer steps, recorded {num_steps}")
    timings = {
        "process_start": started, "trainer_ready": ready, "train_begin": recorder.train_begin,
        "train_end": recorder.train_end, "train_end_cpu": recorder.train_end_cpu, "steps": recorder.steps,
        "logs": recorder.logs,
        "first_prompt_ids": recorder.first_prompt_ids, "threads": torch.get_num_threads(),
        "micro_batch_rows": trainer.args.per_device_train_batch_size,
        "num_micro_batches": trainer.args.gradient_accumulation_steps,
        "activation_checkpointing": bool(trainer.args.activation_checkpointing),
        "trl_version": __import__("trl").__version__, "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
    }  # fmt: skip
    Path(args.output_dir, "timings.json").write_text(json.dumps(timings))
    _emit({"timings": str(Path(args.output_dir, "timings.json")), "num_steps": num_steps})


if __name__ == "__main__":
    main()
