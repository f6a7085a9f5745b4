"""The whole service with a tensor-parallel trainer whose vocabulary is split over the TP group: the warm start and
every RL step push the two ranks' pieces (half the heads of each block, half the vocabulary rows of the tied
embedding) into the vLLM engine, which then samples what the trainer computes: the trainer's log-probs of the sampled
tokens equal the engine's (float32 engine) at every step."""

from __future__ import annotations

from pathlib import Path

from it_helpers import ONE_ENGINE, RECIPE, read_metrics, run_to_end, small_run_args, tail

NUM_STEPS = 3


def test_tensor_parallel_ranks_with_the_vocabulary_split_train_through_the_service(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    args = small_run_args(
        tmp_path, NUM_STEPS, "--run.logging.plot", "false", "--trainer.num_ranks", "2", *ONE_ENGINE,
        "--trainer.parallelism.tensor_parallel_degree", "2", "--trainer.parallelism.vocab_parallel", "true",
    )  # fmt: skip
    assert run_to_end(args, log, RECIPE, timeout_s=600) == 0, tail(log)
    rl = [r for r in read_metrics(tmp_path / "out") if r["phase"] == "rl" and "train/step" in r]
    assert [r["train/step"] for r in rl] == [float(s) for s in range(1, NUM_STEPS + 1)]
    for record in rl:
        assert record["push/num_failed_receivers"] == 0
        # A piece pushed to the wrong rows or heads would make the engine sample from another model: gaps of 0.1-1.
        assert record["train/logprob_gap_max"] < 1e-3, record["train/logprob_gap_max"]
    assert (tmp_path / "out" / "final_model" / "config.json").is_file()
