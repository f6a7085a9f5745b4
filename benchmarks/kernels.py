"""Pallas kernels against their torch references: the fused head's peak memory, and forward+backward times.

Run: ``.venv/bin/python benchmarks/kernels.py [--tokens 1024] [--dim 128] [--reps 3]``. It prints one table, measured
in this one run:

- fused output head vs the full-logits torch reference at vocab 32k and 152k: peak extra resident memory of one
  forward + backward (target: fused under 1/8 of the reference), and the median time of it;
- splash attention and the grouped MoE matmul vs their torch references: median forward + backward time.

Each row is measured in its own subprocess: peak memory is the kernel's high-water mark of resident memory (Linux
``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up call that also compiles) minus the resident memory
before the call, with glibc's mmap threshold pinned so freed large buffers go back to the OS between measurements.
Inputs and the parameter gradient are in both paths' numbers. On CPU the kernels run in Pallas interpret mode, an
exactness tool, so their times here say nothing about TPU speed; on a TPU host the same ops run Mosaic-compiled.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on the path; the repository root is what the imports need.
_REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == _REPO / "benchmarks":
    sys.path[0] = str(_REPO)

from benchmarks.machine import machine_line, reset_peak_rss, rss_bytes  # noqa: E402

CASES = ("head-32k", "head-152k", "attention", "gmm")
_VOCAB = {"head-32k": 32_000, "head-152k": 151_936}


def _measure(step: Callable[[], None], reps: int) -> dict[str, float]:
    """Peak extra resident MiB of one ``step()`` after a warm-up call, and its median time over ``reps`` calls."""
    step()  # compiles (JAX) and fills caches; not measured
    gc.collect()
    reset_peak_rss()
    before = rss_bytes()
    step()
    peak_mib = (rss_bytes("VmHWM") - before) / 2**20
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mib": peak_mib, "ms": 1e3 * statistics.median(times)}


def _head_steps(vocab: int, tokens: int, dim: int) -> tuple[Callable[[], None], Callable[[], None], str]:
    import torch

    from trainer.kernels.fused_head import fused_head_logprobs
    from trainer.kernels.head_reference import head_logprobs_reference

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen, requires_grad=True)
    weight = (0.05 * torch.randn(vocab, dim, generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)

    def run(head: Callable) -> Callable[[], None]:
        def step() -> None:
            hidden.grad = weight.grad = None
            logprobs, entropy = head(hidden, weight, targets)
            (logprobs.sum() + 0.01 * entropy.sum()).backward()

        return step

    return run(fused_head_logprobs), run(head_logprobs_reference), f"N={tokens} D={dim} V={vocab} fp32"


def _attention_steps(reps: int) -> tuple[Callable[[], None], Callable[[], None], str]:
    import torch

    from trainer.kernels.attention_reference import attention_reference
    from trainer.kernels.splash_attention import splash_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 512, 64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 512, 64, generator=gen, requires_grad=True) for _ in range(2))
    segments = torch.cat([torch.zeros(1, 200), torch.ones(1, 312)], dim=1).int()

    def run(attention: Callable) -> Callable[[], None]:
        return lambda: attention(q, k, v, segments, 0.125).sum().backward()

    return run(splash_attention), run(attention_reference), "B=1 Hq=8 Hkv=2 T=512 D=64 packed, fp32"


def _gmm_steps(reps: int) -> tuple[Callable[[], None], Callable[[], None], str]:
    import torch

    from trainer.kernels.gmm import gmm
    from trainer.kernels.gmm_reference import gmm_reference

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=gen, requires_grad=True)
    w = torch.randn(8, 256, 512, generator=gen, requires_grad=True)
    sizes = torch.tensor([300, 0, 500, 200, 248, 400, 100, 300])

    def run(matmul: Callable) -> Callable[[], None]:
        return lambda: matmul(x, w, sizes).sum().backward()

    return run(gmm), run(gmm_reference), "M=2048 K=256 N=512 E=8 (one empty), fp32"


def run_case(case: str, tokens: int, dim: int, reps: int) -> dict:
    """Measure one table row in this process: kernel first, then the reference."""
    if case in _VOCAB:
        kernel, reference, shape = _head_steps(_VOCAB[case], tokens, dim)
    elif case == "attention":
        kernel, reference, shape = _attention_steps(reps)
    else:
        kernel, reference, shape = _gmm_steps(reps)
    measured_kernel = _measure(kernel, reps)
    gc.collect()
    measured_reference = _measure(reference, reps)
    return {"case": case, "shape": shape, "kernel": measured_kernel, "reference": measured_reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens N in the output-head rows")
    parser.add_argument("--dim", type=int, default=128, help="hidden size D in the output-head rows")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median)")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # internal: one row, JSON on stdout
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens, args.dim, args.reps)))
        return
    print(machine_line(), flush=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for case in CASES:
        cmd = [sys.executable, __file__, "--case", case, "--tokens", str(args.tokens), "--dim", str(args.dim)]
        done = subprocess.run(cmd + ["--reps", str(args.reps)], env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    threads = env["OMP_NUM_THREADS"]
    print(f"Pallas kernels (CPU: interpret mode) vs torch references, forward + backward, OMP_NUM_THREADS={threads}")
    print(
        "| case | shape | kernel peak MiB | reference peak MiB | kernel/reference memory | kernel ms | reference ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        kernel, reference = row["kernel"], row["reference"]
        is_head = row["case"] in _VOCAB
        ratio = f"{kernel['peak_mib'] / reference['peak_mib']:.3f}" if is_head else "-"
        mem = (f"{kernel['peak_mib']:.0f}", f"{reference['peak_mib']:.0f}") if is_head else ("-", "-")
        print(
            f"| {row['case']} | {row['shape']} | {mem[0]} | {mem[1]} | {ratio} | {kernel['ms']:.1f} | "
            f"{reference['ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
