"""Memory a trainer rank takes to start: the models built on the meta device and each rank's pieces read from the HF
checkpoint (``trainer.state.build_train_state``) against building the whole model on every rank first (what it did
before), side by side in one run, on 1 and 2 FSDP ranks.

    python -m benchmarks.startup_memory [--shape Qwen3-0.6B] [--ranks 1,2] [--repeats 2] [--resume]

A random-initialised model of the published architecture ``--shape`` (``common.published``) is saved as an HF
directory in bfloat16, as published checkpoints are. Each setting is a fresh process group of its own (gloo, one
thread a rank) that builds GRPO's state with a KL reference (the policy and a frozen copy, float32) from that directory:
``meta`` is the production path; ``whole`` builds the policy whole on the CPU, loads the checkpoint into it, copies it
for the reference and shards both (the code before, kept here for the comparison only). Every rank samples its
anonymous resident memory (``RssAnon``: the file pages safetensors maps are the page cache's, not the process's)
every 5 ms; the table gives the highest rank's peak, its rise over the rank's memory before the build, and the seconds
the build took. Both paths must give the same weights (checked on every rank). The CPU model and the load before and
after are printed; measure on a quiet machine.

``--resume`` compares the start of a resumed run instead: a checkpoint of that state is saved once (DCP, 1 rank), then
each setting builds the state and loads the checkpoint into it, ``read`` filling the models from the HF directory
first (what a resume did before), ``skip`` building with ``restored`` = the parts the checkpoint holds (what
``TrainerWorker.setup(resume=True)`` does): the build's seconds, the build and load's, and the peak. Both must end on
the checkpoint's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.machine import load_avg, machine_line, med_range, rss_bytes
from common.net import free_port

SAMPLE_S = 0.005


def _whole_build(cfg: Any, model_cfg: Any, mesh: Any, init_path: str) -> tuple[Any, Any]:
    """The policy and the KL reference as ``build_train_state`` built them before it built on the meta device."""
    import copy

    import torch

    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.transformer import build_model
    from trainer.parallelize import parallelize_model

    torch.manual_seed(cfg.seed)
    policy = build_model(model_cfg, device=torch.device("cpu"), dtype=torch.float32)
    load_hf_checkpoint(policy, init_path)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    return parallelize_model(policy, mesh, cfg), parallelize_model(reference, mesh, cfg)


def _rank(rank: int, world: int, port: int, how: str, model_dir: str, out: str) -> None:
    """One rank of one setting; writes its peak, its memory before the build, the build's seconds (and with a resume
    the build and load's) and a checksum of its pieces of the policy to ``out.<rank>``."""
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import CheckpointManager, TrainProgress
    from trainer.config import TrainerConfig
    from trainer.models.hf_config import model_config_from_hf
    from trainer.parallelize import build_mesh, local_shards
    from trainer.rl.config import GRPOConfig, KLConfig
    from trainer.state import build_train_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model_cfg = model_config_from_hf(model_dir)
    cfg = TrainerConfig(num_ranks=world, micro_batch_tokens=2048)
    mesh = build_mesh(cfg, "cpu")
    dist.barrier()
    before = rss_bytes("RssAnon")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            peak[0] = max(peak[0], rss_bytes("RssAnon"))

    checkpoints = CheckpointManager(Path(model_dir).parent / "checkpoint", num_keep=1)
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    loaded_s = None
    if how == "whole":
        policy, reference = _whole_build(cfg, model_cfg, mesh, model_dir)
        seconds = time.perf_counter() - start
    else:
        algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.05))
        restored = ("policy", "reference") if how == "skip" else ()
        state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), mesh, init_path=model_dir,
                                  restored=restored)  # fmt: skip
        seconds = time.perf_counter() - start
        if how == "save":
            checkpoints.save(state.checkpointables(), TrainProgress(1, 1, {}))
        elif how in ("read", "skip"):
            checkpoints.load(state.checkpointables())
            loaded_s = time.perf_counter() - start
        policy, reference = state.policy, state.reference
    time.sleep(0.05)
    done.set()
    checksum = sum(float(local.double().sum()) for _, local, _, _ in local_shards(policy))
    assert reference is not None
    same = all(torch.equal(a, b) for (_, a, _, _), (_, b, _, _) in zip(local_shards(policy), local_shards(reference)))
    Path(f"{out}.{rank}").write_text(json.dumps({
        "peak": peak[0], "before": before, "seconds": seconds, "loaded_s": loaded_s, "checksum": checksum,
        "reference_equal": same,
    }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _setting(world: int, how: str, model_dir: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"{how}-{world}")
    mp.spawn(_rank, args=(world, free_port(), how, model_dir, out), nprocs=world, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="Qwen3-0.6B")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="compare resumed starts (see the docstring)")
    args = parser.parse_args()
    from tools.make_tiny_model import make_published_model

    print(machine_line(), flush=True)
    ranks = [int(r) for r in args.ranks.split(",")]
    hows = ("read", "skip") if args.resume else ("whole", "meta")
    runs: dict[tuple[int, str], list[list[dict]]] = {(w, h): [] for w in ranks for h in hows}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        model_dir = str(make_published_model(Path(tmp) / "model", args.shape, dtype="bfloat16"))
        if args.resume:
            _setting(1, "save", model_dir, tmp)
        for _ in range(args.repeats):
            for world, how in runs:
                runs[(world, how)].append(_setting(world, how, model_dir, tmp))
    for world in ranks:
        sums = {round(r["checksum"], 3) for how in hows for run in runs[(world, how)] for r in run[:1]}
        if len(sums) != 1 or not all(r["reference_equal"] for how in hows
                                     for run in runs[(world, how)] for r in run):  # fmt: skip
            raise SystemExit(f"{world} ranks: the two builds gave different weights")
    what = "resumed from a DCP checkpoint of it" if args.resume else "from a bfloat16 HF directory"
    print(f"{args.shape}: GRPO with a KL reference, float32, {what}; the highest rank's anonymous resident memory, "
          f"medians of {args.repeats} [range]; weights equal")  # fmt: skip
    loads = f"{'build+load s':>20}" if args.resume else ""
    print(f"{'ranks':<7}{'build':<8}{'peak GiB':>22}{'rise GiB':>22}{'x ' + hows[0]:>9}{'seconds':>20}{loads}")
    for world in ranks:
        rises = {}
        for how in hows:
            peaks = [max(r["peak"] for r in run) / 2**30 for run in runs[(world, how)]]
            rise = [max(r["peak"] - r["before"] for r in run) / 2**30 for run in runs[(world, how)]]
            secs = [max(r["seconds"] for r in run) for run in runs[(world, how)]]
            rises[how] = statistics.median(rise)
            loaded = [max(r["loaded_s"] for r in run) for run in runs[(world, how)]] if args.resume else []
            print(f"{world:<7}{how:<8}{med_range(peaks):>22}{med_range(rise):>22}{rises[how] / rises[hows[0]]:>9.2f}"
                  f"{med_range(secs, '{:.1f}'):>20}{med_range(loaded, '{:.1f}') if loaded else '':>20}")  # fmt: skip
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
