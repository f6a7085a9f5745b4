"""Memory of converting a trainer checkpoint into an HF model directory, at a real model shape: ``python -m
trainer.export`` (the checkpoint read and written a group of tensors at a time, no model built) against building the
whole model and exporting it, side by side in one run.

    python -m benchmarks.export_memory [--shape Qwen3-0.6B] [--repeats 2] [--lora]

A random-initialised model of the published architecture ``--shape`` (``common.published``) is created, loaded as the
trainer holds it (float32) and saved as a DCP checkpoint (``trainer.checkpoint``): the whole model, or with ``--lora``
a LoRA run's adapter-only checkpoint (rank 16 on every projection, adapters randomised; the base directory then in
bfloat16, as published checkpoints are, and the run's ``recipe.resolved.toml`` beside the checkpoints). Each conversion
runs in a fresh process of its own, alternating, and reports its peak resident set (``VmHWM``) and seconds:
``streamed`` is ``python -m trainer.export CKPT OUT --model-dir MODEL``; ``whole model`` builds the model, loads the
base and the checkpoint into it and writes it with ``export_policy`` (what the converter did before). Both outputs
must be byte-identical. The CPU model and the load before and after are printed; measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import load_avg, machine_line, med_range

REPO = Path(__file__).resolve().parents[1]

_WHOLE_MODEL = """
import json, sys, torch
from trainer.checkpoint import Checkpointable, CheckpointManager
from trainer.export import export_policy
from trainer.models.hf_config import model_config_from_hf
from trainer.models.hf_io import load_hf_checkpoint
from trainer.models.transformer import build_model
ckpt, out, model_dir, lora = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
model = build_model(model_config_from_hf(model_dir, lora=lora), device=torch.device("cpu"), dtype=torch.float32)
if lora is not None:
    load_hf_checkpoint(model, model_dir)
part = Checkpointable(model, trainable_only=lora is not None)
progress = CheckpointManager(ckpt.rsplit("/", 1)[0]).load({"policy": part}, ckpt)
export_policy(model, out, model_dir, None, progress.policy_version)
"""
_LORA = {"rank": 16, "alpha": 32.0}
_PEAK = "\nprint('peak', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"


def _save_checkpoint(model_dir: Path, root: Path, lora: dict | None) -> Path:
    """The model of ``model_dir`` as the trainer holds it (float32), saved as ``root/step_00000001``; with ``lora``,
    its adapters alone (randomised, as if trained), as a LoRA run saves them."""
    import torch

    from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.lora import is_adapter
    from trainer.models.transformer import build_model

    cfg = model_config_from_hf(str(model_dir), lora=lora)
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    load_hf_checkpoint(model, str(model_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.normal_(0.0, 0.02)
    part = Checkpointable(model, trainable_only=lora is not None)
    return CheckpointManager(root).save({"policy": part}, TrainProgress(1, 1, {}))


def _convert(code: str, args: list[str]) -> tuple[float, float]:
    """Run ``code`` in a fresh process with ``args``; its peak resident GiB and wall seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + _PEAK, *args], cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    kib = int(next(line for line in done.stdout.splitlines() if line.startswith("peak")).split()[1])
    return kib / 2**20, seconds


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**24):
            sha.update(block)
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="Qwen3-0.6B")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="a LoRA run's adapter-only checkpoint over its base")
    args = parser.parse_args()
    import json

    from tools.make_tiny_model import make_published_model

    print(machine_line(), flush=True)
    lora = _LORA if args.lora else None
    streamed = ("import sys; from trainer.export import main; "
                "assert main([*sys.argv[1:3], '--model-dir', sys.argv[3]]) == 0")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        model_dir = make_published_model(Path(tmp) / "model", args.shape, dtype="bfloat16" if lora else "float32")
        ckpt = _save_checkpoint(model_dir, Path(tmp) / "checkpoints", lora)
        if lora is not None:  # what a LoRA run leaves beside its checkpoints: the converter reads the adapters' shape
            fields = "".join(f"{k} = {v}\n" for k, v in lora.items())
            (Path(tmp) / "recipe.resolved.toml").write_text(f'[model]\npath = "{model_dir}"\n\n[model.lora]\n{fields}')
        size = sum(f.stat().st_size for f in ckpt.glob("*.distcp")) / 2**30
        runs: dict[str, list[tuple[float, float]]] = {"streamed": [], "whole model": []}
        digests = set()
        for i in range(args.repeats):
            for name, code in (("streamed", streamed), ("whole model", _WHOLE_MODEL)):
                out = Path(tmp) / f"out-{name.replace(' ', '-')}-{i}"
                runs[name].append(_convert(code, [str(ckpt), str(out), str(model_dir), json.dumps(lora)]))
                digests.add(_digest(out / "model.safetensors"))
    if len(digests) != 1:
        raise SystemExit("the conversions wrote different weights")
    kind = "LoRA adapter-only (r = 16, every projection)" if lora else "float32"
    print(f"{args.shape}: a {size:.3f} GiB {kind} checkpoint to a float32 HF directory, one process a conversion; "
          f"medians of {args.repeats} [range]; outputs byte-identical")  # fmt: skip
    base = statistics.median(peak for peak, _ in runs["whole model"])
    print(f"{'conversion':<14}{'peak GiB':>24}{'x whole':>10}{'seconds':>22}")
    for name, rows in runs.items():
        peaks, secs = [p for p, _ in rows], [s for _, s in rows]
        peak = statistics.median(peaks)
        print(f"{name:<14}{med_range(peaks):>24}{peak / base:>10.2f}{med_range(secs, '{:.1f}'):>22}")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
