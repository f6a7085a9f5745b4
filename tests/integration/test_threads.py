"""Each actor runs the threads its placement gives it, whatever thread settings the user's shell carries."""

from __future__ import annotations

import os
from pathlib import Path

from it_helpers import RECIPE, read_metrics, run_to_end, small_run_args, tail


def test_colocated_engines_split_the_cores_whatever_mkl_says(tmp_path: Path) -> None:
    """Two colocated engines on this host's cores get a share each, the trainer all of them. torch sizes its OpenMP
    pool from ``MKL_NUM_THREADS`` at import, so a value inherited from the shell once gave each engine that many
    threads (two engines ran 2 threads each on 2 cores and generated 7-8x slower)."""
    cores = len(os.sched_getaffinity(0))
    log = tmp_path / "run.log"
    args = small_run_args(tmp_path, 2, "--run.logging.plot", "false", "--rollout.num_workers", "2")
    assert run_to_end(args, log, RECIPE, timeout_s=600, MKL_NUM_THREADS=str(cores + 1)) == 0, tail(log)
    per_engine = max(1, cores // 2)
    assert f"torch threads [{per_engine}, {per_engine}]" in log.read_text(), tail(log)
    rl = [r for r in read_metrics(tmp_path / "out") if r["phase"] == "rl"]
    assert {r["train/num_threads"] for r in rl} == {cores}
