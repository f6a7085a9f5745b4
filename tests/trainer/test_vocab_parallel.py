"""The vocabulary-parallel embedding and head (``trainer.vocab_parallel``) on 2 gloo ranks: against the whole-matrix
reference (plain ``log_softmax`` and ``F.embedding`` on the full weight), with ranks holding different numbers of
tokens (one none) or the same ones (a tensor-parallel group), an uneven vocabulary split and several chunks; and whole
training runs (GRPO with a KL reference
and tied embeddings, PPO with a critic and untied embeddings, an expert-parallel MoE with LoRA) on 2 split ranks
equal to 1 rank, resuming bit for bit. The split over tensor-parallel groups in whole runs:
``tests/trainer/test_fsdp_parity.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from spawn_helpers import end_rank, full_weights, reassemble
from torch.distributed.device_mesh import DeviceMesh
from trainer_batches import random_batch

from common.net import free_port
from trainer.metrics import is_timing

VOCAB, DIM = 51, 16  # 51 rows over 2 ranks: 26 + 25
CASES = ("grpo", "ppo", "moe_ep_lora")
"""Training runs: GRPO with a KL reference, tied embeddings; PPO with a critic, untied; an MoE with expert parallelism
on the 2 ranks and LoRA on attention (embedding and head frozen, the reference is the policy with adapters off)."""
TOKENS = {"uneven": (7, 3), "one_empty": (5, 0), "both_empty": (0, 0), "shared": (6, 6)}
"""Tokens per rank. 'shared': both ranks hold the same 6 tokens (a tensor-parallel group, ``shared_tokens``)."""


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _math_worker(rank: int, port: int, out_dir: str) -> None:
    """Every (tokens, entropy) case of :func:`test_split_head_and_lookup_equal_the_whole_matrix` in one process group
    (a spawn of two ranks costs more than all the cases): ``<case>-<entropy>-rank<r>.pt`` each."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for case, counts in TOKENS.items():
        for use_entropy in (True, False):
            result = _math_case(rank, mesh, counts, case == "shared", use_entropy)
            torch.save(result, os.path.join(out_dir, f"{case}-{use_entropy}-rank{rank}.pt"))
    end_rank()


def _math_case(rank: int, mesh: DeviceMesh, counts: tuple[int, int], shared: bool, use_entropy: bool) -> dict:
    from trainer.parallelize import local_shard_place
    from trainer.vocab_parallel import VocabParallelEmbedding, VocabParallelHead, shard_vocabulary_rows

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, DIM, generator=gen)
    # Each rank's own tokens; the same draws on both ranks, so every rank can compute every reference.
    hiddens = [torch.randn(n, DIM, generator=gen) for n in counts]
    targets = [torch.randint(0, VOCAB, (n,), generator=gen) for n in counts]
    if shared:  # the same tokens on both ranks, whose (identical) losses are one loss
        hiddens, targets = hiddens[:1] * 2, targets[:1] * 2
    coefs = torch.randn(2, max(counts), generator=gen)

    split = shard_vocabulary_rows(weight.clone().requires_grad_(True), mesh)
    first = local_shard_place(split)[1][0]
    hidden = hiddens[rank].clone().requires_grad_(True)
    logprobs, entropy = VocabParallelHead(first, shared)(hidden, split, targets[rank], chunk_size=4)
    n = counts[rank]
    loss = (logprobs * coefs[0, :n]).sum() + ((entropy * coefs[1, :n]).sum() if use_entropy else 0.0)
    loss.backward()

    embedding = VocabParallelEmbedding(
        shard_vocabulary_rows(weight.clone().requires_grad_(True), mesh), first, torch.float32, shared
    )
    looked_up = embedding(targets[rank].view(1, -1))
    (looked_up * 0.5).sum().backward()

    ref_weight = weight.clone().requires_grad_(True)
    ref_hidden = [h.clone().requires_grad_(True) for h in hiddens]
    losses = 1 if shared else 2
    for r, m in enumerate(counts[:losses]):
        lp, ent = _reference(ref_hidden[r], ref_weight, targets[r])
        ((lp * coefs[0, :m]).sum() + ((ent * coefs[1, :m]).sum() if use_entropy else 0.0)).backward()
    if shared:
        ref_hidden[1] = ref_hidden[0]
    emb_weight = weight.clone().requires_grad_(True)
    for r in range(losses):
        (F.embedding(targets[r], emb_weight) * 0.5).sum().backward()
    rows = slice(first, first + split.to_local().shape[0])
    try:  # one row over two ranks would leave one without rows
        shard_vocabulary_rows(torch.randn(1, DIM), mesh)
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    return {
        "logprobs": logprobs.detach(), "entropy": entropy.detach(),
        "ref": _reference(hiddens[rank], weight, targets[rank]),
        "grad_hidden": hidden.grad, "ref_grad_hidden": ref_hidden[rank].grad,
        "grad_rows": split.grad.to_local() if split.grad is not None else None,
        "ref_grad_rows": ref_weight.grad[rows] if ref_weight.grad is not None else None,
        "looked_up": looked_up.detach(), "ref_looked_up": F.embedding(targets[rank], weight).view(1, -1, DIM),
        "emb_grad_rows": embedding.weight.grad.to_local() if embedding.weight.grad is not None else None,
        "ref_emb_grad_rows": emb_weight.grad[rows] if emb_weight.grad is not None else None,
        "rows": split.to_local().shape[0], "refusal": refusal,
    }  # fmt: skip


@pytest.fixture(scope="module")
def math_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vocab_math")
    mp.start_processes(_math_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    return out


@pytest.mark.parametrize("use_entropy", [True, False], ids=["entropy", "logprobs_only"])
@pytest.mark.parametrize("case", list(TOKENS))
def test_split_head_and_lookup_equal_the_whole_matrix(math_results: Path, case: str, use_entropy: bool) -> None:
    counts = TOKENS[case]
    results = [torch.load(math_results / f"{case}-{use_entropy}-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["rows"] for r in results] == [26, 25]
    assert all("1 rows split over 2 ranks leaves a rank without rows" in r["refusal"] for r in results)
    for r in results:
        torch.testing.assert_close(r["logprobs"], r["ref"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["entropy"], r["ref"][1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["looked_up"], r["ref_looked_up"])
        if max(counts) == 0:
            continue
        if r["ref_grad_hidden"] is not None and r["ref_grad_hidden"].numel():
            torch.testing.assert_close(r["grad_hidden"], r["ref_grad_hidden"], rtol=1e-5, atol=1e-5)
        # Every rank's rows get the gradient of both ranks' tokens (the reference sums the two losses; shared: of the
        # one loss both ranks compute).
        torch.testing.assert_close(r["grad_rows"], r["ref_grad_rows"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["emb_grad_rows"], r["ref_emb_grad_rows"])


def _training_worker(rank: int, world: int, algo_name: str, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from trainer.checkpoint import CheckpointManager, TrainProgress
    from trainer.config import TrainerConfig
    from trainer.models.config import LoRAConfig, ModelConfig, MoEConfig
    from trainer.models.hf_io import hf_state_dict
    from trainer.parallelize import build_mesh, local_shards
    from trainer.rl.config import GRPOConfig, KLConfig, PPOConfig
    from trainer.state import build_train_state
    from trainer.step import rl_step

    ppo, moe = algo_name == "ppo", algo_name == "moe_ep_lora"
    model_cfg = ModelConfig(
        family="qwen3_moe" if moe else "qwen3", vocab_size=67, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, ffn_hidden_dim=64, qk_norm=True, tie_embeddings=not ppo, output_chunk_size=16,
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=16) if moe else None,
        lora=LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), init="gaussian") if moe else None,
    )  # fmt: skip
    cfg = TrainerConfig(
        num_ranks=world, micro_batch_tokens=96, num_minibatches=2, max_grad_norm=0.5,
        parallelism=dict(vocab_parallel=True, expert_parallel_degree=world if moe else 1),
        activation_checkpoint=dict(mode="full"),
        optimizer=dict(lr=3e-3, weight_decay=0.01), checkpoint=dict(dir=os.path.join(out_dir, "ckpt"), num_keep=1),
    )  # fmt: skip
    algo = PPOConfig() if ppo else GRPOConfig(group_size=4, kl=KLConfig(coef=0.05), entropy_coef=0.01)

    def fresh():
        return build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))

    def batch(step: int):
        return random_batch(200 + step, num_groups=4, completion_len=(1, 24), logprob=(-4.3, -4.0), vocab_size=67)

    state = fresh()
    manager = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.num_keep)
    metrics = []
    for step in range(3):
        if step == 1:
            manager.save(state.checkpointables(), TrainProgress(state.step, state.policy_version, {}))
        metrics.append(rl_step(state, batch(step)))
    resumed = fresh()
    progress = manager.load(resumed.checkpointables())
    resumed.step, resumed.policy_version = progress.step, progress.policy_version
    torch.save({
        "metrics": metrics, "weights": full_weights(state.policy),
        "critic": full_weights(state.critic) if state.critic is not None else {},
        "shards": [(n, t.clone(), s, o) for n, t, s, o in local_shards(state.policy)],
        "resumed_metrics": [rl_step(resumed, batch(step)) for step in (1, 2)],
        "resumed_weights": full_weights(resumed.policy),
        "embedding": type(state.policy.tok_embeddings).__name__,
        "hf": {name: t.clone() for name, t in hf_state_dict(state.policy)},
    }, os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    end_rank()


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> dict[tuple[str, int], list[dict]]:
    root = tmp_path_factory.mktemp("vocab_parallel")
    out = {}
    for algo in CASES:
        for world in (1, 2):
            run_dir = root / f"{algo}{world}"
            run_dir.mkdir()
            mp.start_processes(
                _training_worker, args=(world, algo, free_port(), str(run_dir)), nprocs=world, start_method="spawn"
            )
            out[algo, world] = [torch.load(run_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return out


@pytest.mark.parametrize("algo", CASES)
def test_two_split_ranks_train_like_one_rank(training, algo: str) -> None:
    one, two = training[algo, 1][0], training[algo, 2]
    assert one["embedding"] == "Embedding" and two[0]["embedding"] == "VocabParallelEmbedding"
    keys = ["loss", "policy_loss", "entropy", "grad_norm", "ratio_mean", "logprob_gap"]
    keys += ["critic/value_loss", "critic/grad_norm"] if algo == "ppo" else ["kl"]
    for m1, m2a, m2b in zip(one["metrics"], two[0]["metrics"], two[1]["metrics"]):
        assert {k: v for k, v in m2a.items() if not is_timing(k)} == {k: v for k, v in m2b.items() if not is_timing(k)}
        for key in keys:
            assert m2a[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    for which in ("weights", "critic"):
        assert two[0][which].keys() == one[which].keys()
        for name, w in one[which].items():
            torch.testing.assert_close(two[0][which][name], w, rtol=1e-5, atol=2e-5, msg=f"{which} {name}")
    assert two[0]["hf"].keys() == one["hf"].keys()  # the HF export (tied: no lm_head) gathers the split rows
    for name, w in one["hf"].items():
        torch.testing.assert_close(two[0]["hf"][name], w, rtol=1e-5, atol=2e-5, msg=name)
    whole = reassemble([r["shards"] for r in two])
    for name, w in two[0]["weights"].items():
        assert torch.equal(whole[name], w), name
    rows = {n: t.shape[0] for n, t, _, _ in two[0]["shards"]}
    assert rows["tok_embeddings.weight"] == 34  # the split keeps FSDP's layout: 67 rows as 34 + 33
    if algo == "ppo":
        assert rows["output.weight"] == 34


@pytest.mark.parametrize("algo", CASES)
def test_split_ranks_resume_bit_identical(training, algo: str) -> None:
    for rank_result in training[algo, 2]:
        for a, b in zip(rank_result["metrics"][1:], rank_result["resumed_metrics"]):
            assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
        for name, w in rank_result["weights"].items():
            assert torch.equal(rank_result["resumed_weights"][name], w), name


def _empty_micro_batch_worker(rank: int, vocab_parallel: bool, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from trainer.config import TrainerConfig
    from trainer.models.config import ModelConfig
    from trainer.parallelize import build_mesh
    from trainer.rl.config import GRPOConfig
    from trainer.state import build_train_state
    from trainer.step import plan_rank_micro_batches, rl_step

    model_cfg = ModelConfig(
        family="qwen3", vocab_size=67, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=64, qk_norm=True, tie_embeddings=True, output_chunk_size=16,
    )  # fmt: skip
    cfg = TrainerConfig(num_ranks=2, micro_batch_tokens=64, parallelism=dict(vocab_parallel=vocab_parallel))
    algo = GRPOConfig(group_size=3, entropy_coef=0.01)
    state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    # Three samples over two ranks in 64-token micro-batches: one rank gets two, the other one and an empty one.
    batch = random_batch(5, num_groups=1, group_size=3, completion_len=(30, 50), vocab_size=67, logprob=(-4.3, -4.0))
    loss_tokens = [mb.num_loss_tokens for mb in plan_rank_micro_batches(state, batch.samples, [0, 1, 2])]
    metrics = rl_step(state, batch)
    torch.save({"loss_tokens": loss_tokens, "metrics": metrics}, os.path.join(out_dir, f"rank{rank}.pt"))
    end_rank()


def test_a_rank_with_an_empty_micro_batch_steps_with_the_others(tmp_path: Path) -> None:
    results = {}
    for split in (False, True):
        run_dir = tmp_path / str(split)
        run_dir.mkdir()
        mp.start_processes(
            _empty_micro_batch_worker, args=(split, free_port(), str(run_dir)), nprocs=2, start_method="spawn"
        )
        results[split] = [torch.load(run_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(0 in r["loss_tokens"] for r in results[True]) == [False, True]
    for key in ("loss", "entropy", "grad_norm"):
        assert results[True][0]["metrics"][key] == pytest.approx(results[False][0]["metrics"][key], rel=1e-5), key
