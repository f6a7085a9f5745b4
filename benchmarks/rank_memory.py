"""Trainer memory per rank on a real model shape: 1 rank against 2 FSDP ranks, with and without the vocabulary split
(``trainer.parallelism.vocab_parallel``), side by side in one run, and where in the step each peak falls.

    python -m benchmarks.rank_memory [--shape Qwen3-0.6B] [--tokens 4096] [--steps 2] [--release-freed on,off]
                                     [--live-memory] [--export] [--tensor-parallel]

``--tensor-parallel`` adds 2 tensor-parallel ranks (one TP group; FSDP over a data-parallel mesh of 1), without and
with the vocabulary split, which then splits the matrices over the TP group: each TP rank holds and computes the head
on half of the vocabulary instead of all of it.

Each setting is a fresh process group of its own (gloo, one thread a rank): the production update
(``trainer.state.build_train_state`` + ``trainer.step.rl_step``, float32, GRPO, ``full`` activation checkpointing,
``chunked`` head in 256-token chunks, 2,048-token micro-batches) of a random-initialised model of the published
architecture ``--shape`` (``common.published``) on the same batch: ``--tokens`` tokens a step in samples of 192 prompt
+ 64 completion tokens, split over the ranks. Every rank samples its resident set (``/proc/self/status``) every 5 ms
and labels it with the part of the step it is in (a block's forward or backward, the optimizer), so the table says
where the peak is. ``--steps`` must be >= 2: the AdamW state is created by the first step, so later steps peak higher.

``--export`` then writes the trained policy as an HF directory twice, with each write's own peak: the run's export
(``trainer.models.hf_io.save_hf_checkpoint``: every tensor gathered and written in turn) and, for comparison, the
whole-model gather the export did before it streamed (all tensors gathered on rank 0, then one ``save_file``).

Resident memory counts what glibc keeps of freed memory for reuse (1-3 GB a rank here without the release, about the
same at every rank count). ``--release-freed`` runs each setting with the trainer's release of freed memory
(``trainer.release_freed_memory``, on by default on the CPU: ``malloc_trim`` as the backward reaches the first block
and after each optimizer step, when the allocator holds at least 1 GiB freed) on, off, or both side by side
(``on,off``; each ratio is to 1 rank of the same release setting).
``--live-memory`` runs the ranks with ``MALLOC_MMAP_THRESHOLD_=1048576``, so freed blocks over 1 MiB return to the
system at once and the resident peak is close to the live one (slower: every large allocation faults its pages in
again). The CPU model and the load before and after are printed; measure on a quiet machine and repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch.multiprocessing as mp

from benchmarks.machine import load_avg, machine_line, rss_bytes
from common.net import free_port

SAMPLE_S = 0.005
PROMPT, COMPLETION = 192, 64


def _rank(
    rank: int, world: int, port: int, shape: str, tokens: int, steps: int, vocab_parallel: bool, release: bool,
    export: bool, out: str, tensor_parallel: int = 1,
) -> None:
    """One rank of one setting; writes its training peak, the label of the peak, its step times and (``export``) the
    peak of each export to ``out.<rank>``."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from common.published import PUBLISHED_CONFIGS
    from rollout.types import RolloutBatch, Sample
    from trainer.config import TrainerConfig
    from trainer.models.hf_config import model_config_from_hf_dict
    from trainer.parallelize import build_mesh
    from trainer.rl.config import GRPOConfig
    from trainer.state import build_train_state
    from trainer.step import rl_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    where = ["build"]
    peak = [0, "build"]
    export_peaks: dict[str, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            rss, at = rss_bytes(), where[0]
            if at.startswith("export"):
                export_peaks[at] = max(export_peaks.get(at, 0), rss)
            elif at != "between exports" and rss > peak[0]:
                peak[:] = [rss, at]

    threading.Thread(target=sample, daemon=True).start()
    model_cfg = model_config_from_hf_dict(
        PUBLISHED_CONFIGS[shape], source=shape, attention="sdpa", output_head="chunked", output_chunk_size=256
    )
    cfg = TrainerConfig(
        num_ranks=world, micro_batch_tokens=2048, optimizer={"lr": 1e-6}, activation_checkpoint={"mode": "full"},
        parallelism={"vocab_parallel": vocab_parallel, "tensor_parallel_degree": tensor_parallel},
        release_freed_memory=release,
    )  # fmt: skip
    state = build_train_state(cfg, model_cfg, GRPOConfig(group_size=4), torch.device("cpu"), build_mesh(cfg, "cpu"))
    for i, block in enumerate(state.policy.layers):
        block.register_forward_pre_hook(lambda *_, i=i: where.__setitem__(0, f"block {i} forward"))
        block.register_full_backward_pre_hook(lambda *_, i=i: where.__setitem__(0, f"block {i} backward"))
    state.optimizer.register_step_pre_hook(lambda *_: where.__setitem__(0, "optimizer"))
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_ids=rng.integers(1, model_cfg.vocab_size, PROMPT),
            completion_ids=rng.integers(1, model_cfg.vocab_size, COMPLETION),
            rollout_logprobs=np.full(COMPLETION, -12.0, dtype=np.float32), reward=float(i % 2), group_id=i // 4,
            policy_version=0,
        )
        for i in range(tokens // (PROMPT + COMPLETION))
    ]  # fmt: skip
    seconds = []
    for step in range(steps):
        where[0] = f"step {step + 1} start"
        start = time.perf_counter()
        rl_step(state, RolloutBatch(samples))
        seconds.append(time.perf_counter() - start)
    rest = _export_both(state.policy, where, out) if export else {}
    done.set()
    result = {"peak": peak[0], "at": peak[1], "step_s": seconds, "export": export_peaks, "rest": rest}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def _export_both(policy: object, where: list[str], out: str) -> dict[str, int]:
    """The run's streamed HF export, then the whole-model gather it replaced; ``where`` labels each for the sampler.
    Returns the resident set at rest before each."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import save_file

    from trainer.models.hf_io import hf_state_dict, save_hf_checkpoint

    rest = {}
    _settle()
    rest["export streamed"] = rss_bytes()
    where[0] = "export streamed"
    save_hf_checkpoint(policy, f"{out}.hf")  # type: ignore[arg-type]
    where[0] = "between exports"
    _settle()
    rest["export whole"] = rss_bytes()
    where[0] = "export whole"
    whole = {name: tensor.contiguous().clone() for name, tensor in hf_state_dict(policy)}  # type: ignore[arg-type]
    if dist.get_rank() == 0:
        save_file(whole, f"{out}.whole.safetensors", metadata={"format": "pt"})
    del whole
    _settle()
    dist.barrier()  # every rank is past both exports: rank 0 removes what they wrote
    if dist.get_rank() == 0:
        shutil.rmtree(f"{out}.hf", ignore_errors=True)
        Path(f"{out}.whole.safetensors").unlink(missing_ok=True)
    return rest


def _settle() -> None:
    """Collect garbage and give the 5 ms sampler time to see the memory at rest."""
    import gc

    gc.collect()
    time.sleep(0.05)


def _export_cell(peak: int, rest: int) -> str:
    return f"{peak / 2**30:.2f} (+{(peak - rest) / 2**30:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="Qwen3-0.6B")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a step (all ranks)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--release-freed", default="on", help="on, off or on,off: the trainer's release of freed "
                        "memory (see the docstring)")  # fmt: skip
    parser.add_argument("--live-memory", action="store_true", help="return freed memory at once (see the docstring)")
    parser.add_argument("--export", action="store_true", help="measure the HF export after training (docstring)")
    parser.add_argument("--tensor-parallel", action="store_true", help="add 2 TP ranks without and with the split")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the optimizer state appears in the first step)")
    print(machine_line(), flush=True)
    if args.live_memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"  # read by each spawned rank's glibc at start
    releases = [{"on": True, "off": False}[v] for v in args.release_freed.split(",")]
    layouts = [(1, 1, False), (2, 1, False), (2, 1, True)]  # (ranks, tensor-parallel degree, vocabulary split)
    layouts += [(2, 2, False), (2, 2, True)] if args.tensor_parallel else []
    settings = [(world, tp, split, release) for release in releases for world, tp, split in layouts]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-rank-memory-") as tmp:
        for world, tp, split, release in settings:
            out = os.path.join(tmp, f"{world}-{tp}-{split}-{release}")
            port = free_port()
            args_ = (world, port, args.shape, args.tokens, args.steps, split, release, args.export, out, tp)
            mp.start_processes(_rank, args=args_, nprocs=world, start_method="spawn")
            rows[world, tp, split, release] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    memory = "live (MALLOC_MMAP_THRESHOLD_=1048576)" if args.live_memory else "resident"
    print(f"{args.shape}, {args.tokens} tokens a step ({PROMPT} + {COMPLETION} a sample), 2,048-token micro-batches, "
          f"full checkpointing, float32, 1 thread a rank; peak {memory} memory of steps 1-{args.steps}")  # fmt: skip
    exports = ("export streamed", "export whole") if args.export else ()
    if exports:
        print("export columns: the export's peak GiB (+ its rise over the resident set at rest just before it)")
    print(f"{'setting':<52}{'peak GiB a rank':>18}{'x 1 rank':>10}{'step s':>10}"
          + "".join(f"{name:>22}" for name in exports) + "   peak at")  # fmt: skip
    for (world, tp, split, release), ranks in rows.items():
        base = max(r["peak"] for r in rows[1, 1, False, release])
        name = f"{world} rank{'s' if world > 1 else ''}" + (" TP" if tp > 1 else " FSDP" * (world > 1))
        name += " vocabulary split" if split else ""
        name += ", release " + ("on" if release else "off")
        for rank, r in enumerate(ranks):
            label = f"{name} (rank {rank})" if world > 1 else name
            step_s = r["step_s"][-1]
            export_cols = "".join(f"{_export_cell(r['export'][e], r['rest'][e]):>22}" for e in exports)
            print(f"{label:<52}{r['peak'] / 2**30:>18.2f}{r['peak'] / base:>10.2f}{step_s:>10.1f}{export_cols}"
                  f"   {r['at']}")  # fmt: skip
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
