"""1 rank vs 2 FSDP ranks, 2 tensor-parallel ranks and 2 x 2 (gloo, spawned processes; with and without activation
checkpointing, with the vocabulary split over the TP group): same losses and weights, and resume from a checkpoint
reproduces the uninterrupted trajectory bit for bit (on each layout)."""

from __future__ import annotations

import os

import pytest
import torch
from spawn_helpers import full_weights, reassemble, spawn_runs
from trainer_batches import random_batch

from rollout.types import RolloutBatch
from trainer.metrics import is_timing

NUM_STEPS = 4  # checkpoint after step 2, then steps 3-4 twice (uninterrupted, resumed)


def _batch(step: int) -> RolloutBatch:
    return random_batch(100 + step, num_groups=4, completion_len=(1, 24), logprob=(-3.8, -3.5))


def _configs(ckpt_dir: str, world: int, tp: int, ac: str, vocab: bool):
    from trainer.config import TrainerConfig
    from trainer.models.config import ModelConfig
    from trainer.rl.config import GRPOConfig, KLConfig

    model_cfg = ModelConfig(
        family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=64, qk_norm=True, tie_embeddings=True, output_chunk_size=16,
    )  # fmt: skip
    cfg = TrainerConfig(
        num_ranks=world, parallelism=dict(tensor_parallel_degree=tp, vocab_parallel=vocab), micro_batch_tokens=96,
        num_minibatches=2,
        max_grad_norm=0.5,
        optimizer=dict(lr=3e-3, weight_decay=0.01),
        schedule=dict(kind="cosine", num_warmup_steps=2, num_total_steps=12, min_lr_ratio=0.1),
        checkpoint=dict(dir=ckpt_dir, num_keep=1), activation_checkpoint=dict(mode=ac),
    )  # fmt: skip
    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.05), clip_high=0.28)
    return cfg, model_cfg, algo



def _run_layout(rank: int, world: int, tp: int, ac: str, vocab: bool, out_dir: str) -> None:
    """One run of :data:`RUNS` on this rank (:func:`spawn_helpers.spawn_runs`)."""
    from trainer.checkpoint import CheckpointManager, TrainProgress
    from trainer.parallelize import build_mesh, local_shards
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg, model_cfg, algo = _configs(os.path.join(out_dir, "ckpt"), world, tp, ac, vocab)

    def fresh():
        return build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))

    state = fresh()
    result: dict = {"init_shards": [(n, t.clone(), s, o) for n, t, s, o in local_shards(state.policy)],
                    "embedding": type(state.policy.tok_embeddings).__name__}
    manager = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.num_keep)
    losses = []
    for step in range(NUM_STEPS):
        if step == 2:
            manager.save(state.checkpointables(), TrainProgress(state.step, state.policy_version, {"next": step}))
        losses.append(rl_step(state, _batch(step)))
    result["metrics"] = losses
    result["weights"] = full_weights(state.policy)
    result["final_shards"] = [(n, t.clone(), s, o) for n, t, s, o in local_shards(state.policy)]
    result["pushed_shards"] = [(n, t.clone(), s, o) for n, t, s, o in local_shards(state.policy, state.mesh)]

    resumed = fresh()
    progress = manager.load(resumed.checkpointables())
    resumed.step, resumed.policy_version = progress.step, progress.policy_version
    first = progress.data_cursor["next"]
    result["resumed_metrics"] = [rl_step(resumed, _batch(step)) for step in range(first, NUM_STEPS)]
    result["resumed_weights"] = full_weights(resumed.policy)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


RUNS = {  # name: (ranks, tensor-parallel degree, activation checkpointing, vocabulary split)
    "1": (1, 1, "none", False), "2": (2, 1, "none", False), "tp2": (2, 2, "none", False),
    "2ac": (2, 1, "selective", False), "tp2v": (2, 2, "none", True), "dp2tp2v": (4, 2, "none", True),
}  # fmt: skip
"""'1': one rank; '2': two FSDP ranks; 'tp2': two tensor-parallel ranks (FSDP over a data-parallel mesh of 1); '2ac':
two FSDP ranks, the first of the two blocks activation-checkpointed (recomputed inside its FSDP unit); 'tp2v': 'tp2'
with the vocabulary split over the TP group; 'dp2tp2v': 2 data-parallel x 2 tensor-parallel ranks, the vocabulary split
over each TP group and each TP rank's rows sharded by FSDP over the data-parallel ranks."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return spawn_runs(_run_layout, RUNS, tmp_path_factory.mktemp("fsdp"))



def test_first_step_is_exactly_on_policy(runs) -> None:
    first = runs["1"][0]["metrics"][0]
    # Trainer == reference weights at step 0: the KL is exactly 0 (the first mini-batch; the second one follows an
    # update). With two mini-batches the old log-probs come from a no-grad pass, and the first ratio is exactly 1.
    assert first["ratio_min"] <= 1.0 <= first["ratio_max"]
    assert first["kl"] >= 0


@pytest.mark.parametrize("name", ["2", "tp2", "2ac", "tp2v", "dp2tp2v"])
def test_two_ranks_match_one_rank(runs, name: str) -> None:
    one, many = runs["1"][0], runs[name]
    for step, m1 in enumerate(one["metrics"]):
        m2a = many[0]["metrics"][step]
        for other in many[1:]:
            m2b = other["metrics"][step]
            assert {k: v for k, v in m2a.items() if not is_timing(k)} == {
                k: v for k, v in m2b.items() if not is_timing(k)
            }
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "lr", "ratio_mean", "clip_frac_high"):
            assert m1[key] == pytest.approx(m2a[key], rel=1e-5, abs=1e-6), key
    for name, w in one["weights"].items():
        # Adam turns fp32 reduction-order noise in near-zero gradients into up to ~1e-3 of an lr-sized step.
        torch.testing.assert_close(many[0]["weights"][name], w, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["tp2v", "dp2tp2v"])
def test_the_vocabulary_split_over_tensor_parallel_ranks(runs, name: str) -> None:
    """Each rank holds ``vocab / ranks`` rows of the (tied) matrix: the TP group splits it, FSDP splits each TP rank's
    rows again; every rank's pieces reassemble the weights exactly, as a push sends them."""
    many = runs[name]
    assert {r["embedding"] for r in many} == {"VocabParallelEmbedding"}
    assert runs["tp2"][0]["embedding"] == "Embedding"  # without the flag TP keeps the matrix whole on each rank
    rows = [{n: t.shape[0] for n, t, _, _ in r["init_shards"]}["tok_embeddings.weight"] for r in many]
    assert rows == [64 // len(many)] * len(many)
    for key in ("init_shards", "final_shards"):
        whole = reassemble([r[key] for r in many])
        expected = reassemble([runs["1"][0]["init_shards"]]) if key == "init_shards" else many[0]["weights"]
        assert whole.keys() == expected.keys()
        for n, w in expected.items():
            assert torch.equal(whole[n], w), (key, n)


def test_local_shards_reassemble_exactly(runs) -> None:
    one, two = runs["1"][0], runs["2"]
    init_two = reassemble([r["init_shards"] for r in two])
    init_one = reassemble([one["init_shards"]])
    assert init_two.keys() == init_one.keys()
    for name in init_one:
        assert torch.equal(init_two[name], init_one[name]), name
    final_two = reassemble([r["final_shards"] for r in two])
    for name, w in two[0]["weights"].items():
        assert torch.equal(final_two[name], w), name
    # FSDP really shards: each rank holds part of every 2-D parameter.
    sizes = {n: t.numel() for n, t, _, _ in two[0]["init_shards"]}
    assert sizes["tok_embeddings.weight"] < init_one["tok_embeddings.weight"].numel()


@pytest.mark.parametrize("name", ["2", "tp2", "tp2v", "dp2tp2v"])
def test_the_ranks_push_every_piece_exactly_once(runs, name: str) -> None:
    """What a push sends (``local_shards`` given the mesh): a piece the TP group's ranks all hold (the norms; the whole
    embedding without the vocabulary split) comes from one of them, as the receiver refuses a piece pushed twice, and
    the pieces of all ranks still make up every parameter."""
    many = runs[name]
    keys = [(n, o) for r in many for n, _, _, o in r["pushed_shards"]]
    assert len(keys) == len(set(keys))
    held = [(n, o) for r in many for n, _, _, o in r["final_shards"]]
    assert (len(held) > len(keys)) == name.startswith(("tp", "dp2tp")), "TP groups hold replicated pieces"
    whole = reassemble([r["pushed_shards"] for r in many])
    assert whole.keys() == many[0]["weights"].keys()
    for n, w in many[0]["weights"].items():
        assert torch.equal(whole[n], w), n


@pytest.mark.parametrize("name", list(RUNS))
def test_resume_is_bit_identical(runs, name: str) -> None:
    for rank_result in runs[name]:
        tail = rank_result["metrics"][2:]
        resumed = rank_result["resumed_metrics"]
        assert len(resumed) == len(tail)
        for a, b in zip(tail, resumed):
            for key in a:
                if not is_timing(key):
                    assert a[key] == b[key], key
        for name, w in rank_result["weights"].items():
            assert torch.equal(rank_result["resumed_weights"][name], w), name
