"""Useful tokens per second of our GRPO policy update against TRL's ``GRPOTrainer``, same model, same batch.

Run (once: ``benchmarks/trl_venv.sh`` creates ``.venv-trl``, TRL's own venv)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_vs_trl.py [--threads 1] [--reps 3]
        [--num-prompts 16 --group-size 8]

What is measured: one optimizer step on a realistic GRPO batch (``--num-prompts`` prompts of 64-192 tokens, each
with ``--group-size`` completions of uniform 8-256 tokens, random ids; ``benchmarks.trainer.grpo_batch``) of the
~40M-parameter llama-style ``benchmarks.trainer.MODEL_40M``, fp32, AdamW, grad-norm clipping at 1.0, no reference
model (beta/KL 0), no activation checkpointing. Both sides start from the same weights: our randomly initialised
model is exported as an HF checkpoint directory that TRL loads.

- ours: ``trainer.step.rl_step`` exactly as ``benchmarks/trainer.py`` runs it (a 1-rank gloo group, whose float32
  rank runs the plain module without FSDP; sequences packed into micro-batches of ``--micro-batch-tokens``; the
  model's ``cached`` output head and last block's feed-forward at completion positions only; token-mean loss, IS
  correction);
- TRL: ``benchmarks/trl_side.py`` in ``.venv-trl``; generation is replaced by TRL's ``rollout_func`` hook returning the
  fixed completions, so the timed step is TRL's own padding, advantages, forward/backward per micro-batch ("dapo"
  loss), clipping and AdamW. Its micro-batches hold as many padded rows as fit the same token budget.

Steps alternate between the two sides (A/B, then B/A, ...) after one warm-up each, so the noise of a shared machine
hits both; one side idles while the other is timed. "Useful" tokens are prompt + completion tokens, no padding. Both
wall-clock and CPU-time (``time.process_time``) rates are reported; on a busy machine the CPU-time rate is the fairer.
Target: ours >= 1.5x TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Run as a script, this folder would shadow the `trainer` package (see benchmarks/trainer.py).
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == _REPO / "benchmarks":
    sys.path[0] = str(_REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.machine import init_single_rank_group, machine_line  # noqa: E402
from benchmarks.trainer import MODEL_40M, grpo_batch  # noqa: E402
from rollout.types import RolloutBatch  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.models.hf_io import save_hf_checkpoint  # noqa: E402
from trainer.parallelize import build_mesh  # noqa: E402
from trainer.rl.config import GRPOConfig, ImportanceSamplingConfig  # noqa: E402
from trainer.state import TrainState, build_train_state  # noqa: E402
from trainer.step import rl_step  # noqa: E402

TARGET = 1.5
TRL_PYTHON = _REPO / ".venv-trl" / "bin" / "python"
MARK = "TRL_SIDE "


def write_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A word-level tokenizer with exactly one entry per model id (TRL decodes completions for its reward functions)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(out_dir)


def write_batch_json(batch: RolloutBatch, path: Path) -> None:
    """The batch as ``benchmarks/trl_side.py`` reads it: groups in order, each with its completions."""
    groups: dict[int, dict] = {}
    for s in batch.samples:
        g = groups.setdefault(s.group_id, {"prompt_ids": s.prompt_ids.tolist(), "completions": []})
        assert g["prompt_ids"] == s.prompt_ids.tolist(), "samples of one group share their prompt"
        g["completions"].append(
            {"completion_ids": s.completion_ids.tolist(), "logprobs": s.rollout_logprobs.tolist(), "reward": s.reward}
        )
    path.write_text(json.dumps({"groups": [groups[k] for k in sorted(groups)]}))


def build_our_engine(micro_batch_tokens: int, group_size: int) -> TrainState:
    """Our trainer rank on a 1-rank gloo group, configured as in ``benchmarks/trainer.py``."""
    init_single_rank_group()
    cfg = TrainerConfig(micro_batch_tokens=micro_batch_tokens, optimizer={"lr": 1e-5})
    algo = GRPOConfig(group_size=group_size, importance_sampling=ImportanceSamplingConfig(enabled=True))
    return build_train_state(cfg, MODEL_40M, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))


class TrlSide:
    """``trl_side.py --gated`` as a child process: one TRL optimizer step per :meth:`step`."""

    def __init__(self, model_dir: Path, batch_json: Path, args: argparse.Namespace, log_path: Path):
        if not TRL_PYTHON.exists():
            raise FileNotFoundError(f"{TRL_PYTHON} is missing: run benchmarks/trl_venv.sh first")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "TRL_EXPERIMENTAL_SILENCE": "1", "TMPDIR": str(log_path.parent)}  # fmt: skip
        cmd = [
            str(TRL_PYTHON), str(_REPO / "benchmarks" / "trl_side.py"), "--model-dir", str(model_dir),
            "--batch", str(batch_json), "--steps", str(args.reps), "--warmup", "1", "--threads", str(args.threads),
            "--micro-batch-tokens", str(args.micro_batch_tokens), "--gated",
        ]  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env)  # fmt: skip

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"trl_side.py exited (rc {self.proc.wait()}); see {self.log_path}")

    def step(self) -> tuple[float, float]:
        """Run one TRL optimizer step; (wall seconds, CPU seconds) as the child measured them."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["wall_s"], out["cpu_s"]

    def finish(self) -> dict:
        """The child's summary line (versions, micro-batch shape, per-step times); waits for it to exit."""
        summary = self._read()
        if self.proc.wait() != 0:
            raise RuntimeError(f"trl_side.py failed; see {self.log_path}")
        self._log.close()
        return summary


def time_ours(state: TrainState, batch: RolloutBatch) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    rl_step(state, batch)
    return time.perf_counter() - wall, time.process_time() - cpu


def print_table(tokens: int, ours: list[tuple[float, float]], trl: list[tuple[float, float]]) -> None:
    rows = {}
    for name, times in (("ours", ours), ("TRL GRPOTrainer", trl)):
        walls, cpus = [t[0] for t in times], [t[1] for t in times]
        rows[name] = (min(walls), float(np.median(walls)), min(cpus), tokens / min(walls), tokens / min(cpus))
    print(f"{'':17s} {'best s':>8s} {'median s':>9s} {'best CPU-s':>11s} {'tokens/s':>9s} {'tokens/CPU-s':>13s}")
    for name, (best, med, cpu, rate, cpu_rate) in rows.items():
        print(f"{name:17s} {best:8.2f} {med:9.2f} {cpu:11.2f} {rate:9.0f} {cpu_rate:13.0f}")
    wall_ratio = rows["ours"][3] / rows["TRL GRPOTrainer"][3]
    cpu_ratio = rows["ours"][4] / rows["TRL GRPOTrainer"][4]
    verdict = "met" if min(wall_ratio, cpu_ratio) >= TARGET else "NOT met"
    print(f"{'ours / TRL':17s} {'':8s} {'':9s} {'':11s} {wall_ratio:8.2f}x {cpu_ratio:12.2f}x   "
          f"target >= {TARGET}x: {verdict}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on both sides")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per side (after one warm-up each)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="micro-batch token budget, both sides")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)

    batch = grpo_batch(MODEL_40M.vocab_size, num_groups=args.num_prompts, group_size=args.group_size)
    tokens = batch.num_tokens
    state = build_our_engine(args.micro_batch_tokens, args.group_size)
    num_params = sum(p.numel() for p in state.policy.parameters())
    with tempfile.TemporaryDirectory(prefix="trainer_vs_trl_") as tmp:
        work = Path(tmp)
        save_hf_checkpoint(state.policy, str(work / "model"))
        write_tokenizer(MODEL_40M.vocab_size, work / "model")
        write_batch_json(batch, work / "batch.json")
        trl = TrlSide(work / "model", work / "batch.json", args, work / "trl_side.log")
        try:
            time_ours(state, batch)  # warm-up (allocator, thread pools)
            trl.step()
            ours_t, trl_t = [], []
            for rep in range(args.reps):
                if rep % 2 == 0:
                    ours_t.append(time_ours(state, batch))
                    trl_t.append(trl.step())
                else:
                    trl_t.append(trl.step())
                    ours_t.append(time_ours(state, batch))
            summary = trl.finish()
        except BaseException:
            trl.proc.kill()
            print(Path(trl.log_path).read_text()[-4000:], file=sys.stderr)
            raise
    dist.destroy_process_group()

    if summary["useful_tokens"] != tokens:
        raise RuntimeError(f"TRL trained on {summary['useful_tokens']} useful tokens, ours on {tokens}")
    lengths = [len(s.completion_ids) for s in batch.samples]
    print(f"model: {num_params / 1e6:.1f}M params ({MODEL_40M.family}, dim {MODEL_40M.dim}, {MODEL_40M.num_layers} "
          f"layers, vocab {MODEL_40M.vocab_size}), fp32, AdamW, clip 1.0, no ref model, no activation checkpointing")
    print(f"batch: {args.num_prompts} prompts x {args.group_size} completions = {len(batch.samples)} samples, "
          f"completions {min(lengths)}-{max(lengths)} tokens, {tokens} useful tokens")
    print(f"micro-batches: ours packed to {args.micro_batch_tokens} tokens; TRL {summary['micro_batch_rows']} padded "
          f"rows x {summary['num_micro_batches']} (trl {summary['trl_version']}, torch {summary['torch_version']})")
    print(f"threads: {args.threads} torch intra-op thread(s) per side (OMP_NUM_THREADS={args.threads}); "
          f"{args.reps} interleaved steps per side after 1 warm-up; machine: {os.cpu_count()} CPUs, shared")
    print_table(tokens, ours_t, trl_t)


if __name__ == "__main__":
    main()
