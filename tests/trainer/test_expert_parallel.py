"""Expert parallelism on Qwen3-MoE (gloo, spawned processes).

The dispatch alone: on 2 ranks, each expert kernel (loop, grouped, gmm_pallas) run through the all-to-all gives each
rank's tokens the outputs and gradients of the same kernel run on all tokens with all experts, also when a rank's
experts get no tokens. The trainer: 2 ranks with EP = 2 train exactly as one rank does on the same global batches
(losses, router loads, every weight), with activation checkpointing too, 4 ranks with EP = 2 x efsdp = 2 as 4 FSDP
ranks without EP do, with LoRA on attention and every expert (activation checkpointing too) as one rank does, and PPO
(an expert-parallel critic too) in bfloat16 as 2 FSDP ranks do, to bfloat16 precision;
each rank holds only its experts and the pieces it would push reassemble the full model; a checkpoint resumes
bit-identically, and one saved with EP = 2 loads on one rank to the same weights."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import end_rank, full_weights, reassemble, spawn_runs
from trainer_batches import random_batch

from common.net import free_port
from rollout.types import RolloutBatch
from trainer.metrics import is_timing

NUM_STEPS = 3  # checkpoint after step 1, then steps 2-3 twice (uninterrupted, resumed)
NUM_EXPERTS = 4


def _batch(step: int) -> RolloutBatch:
    return random_batch(300 + step, num_groups=4, completion_len=(1, 20), logprob=(-3.8, -3.5))


def _configs(ckpt_dir: str, world: int, ep: int, kernel: str, ac: str, bf16_ppo: bool = False, lora: bool = False):
    """The run's configs; ``bf16_ppo``: PPO (an MoE critic, expert-parallel too) with bfloat16 compute, as the TPU
    recipes run; ``lora``: rank-4 adapters on attention and on every expert (base weights frozen)."""
    from trainer.config import TrainerConfig
    from trainer.models.config import LoRAConfig, ModelConfig, MoEConfig
    from trainer.rl.config import GRPOConfig, KLConfig, PPOConfig

    adapters = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), init="gaussian",
                          target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))  # fmt: skip
    model_cfg = ModelConfig(
        family="qwen3_moe", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=64, qk_norm=True, tie_embeddings=False, output_chunk_size=16, moe_experts=kernel,
        moe=MoEConfig(num_experts=NUM_EXPERTS, top_k=2, expert_ffn_hidden_dim=16, aux_loss_coef=0.01),
        lora=adapters if lora else None,
    )  # fmt: skip
    cfg = TrainerConfig(
        num_ranks=world, parallelism=dict(expert_parallel_degree=ep), micro_batch_tokens=96, num_minibatches=2,
        max_grad_norm=0.5, optimizer=dict(lr=3e-3, weight_decay=0.01),
        checkpoint=dict(dir=ckpt_dir, num_keep=1), activation_checkpoint=dict(mode=ac),
        mixed_precision=dict(param_dtype="bfloat16" if bf16_ppo else "float32"), critic_lr=1e-2,
    )  # fmt: skip
    if bf16_ppo:
        return cfg, model_cfg, PPOConfig(kl=KLConfig(coef=0.05, where="reward"))
    return cfg, model_cfg, GRPOConfig(group_size=4, kl=KLConfig(coef=0.05), clip_high=0.28)


PROBE_ROWS = 4


def _probe(model, rank: int, world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's rows of a fixed batch (rows ``rank::world``) through the model: (hidden states, per layer the
    number of (token, expert) assignments each expert got)."""
    tokens = torch.randint(0, 64, (PROBE_ROWS, 12), generator=torch.Generator().manual_seed(7))[rank::world]
    with torch.no_grad():
        hidden = model(tokens)
    loads = [torch.bincount(m.routing.expert_idx.reshape(-1), minlength=NUM_EXPERTS) for m in model._moe_layers]
    return hidden, loads


def _run_layout(rank: int, world: int, ep: int, kernel: str, ac: str, bf16_ppo: bool, lora: bool, out_dir: str) -> None:
    """One run of :data:`RUNS` / :data:`SLOW_RUNS` on this rank (:func:`spawn_helpers.spawn_runs`)."""
    from trainer.checkpoint import CheckpointManager, TrainProgress
    from trainer.parallelize import build_mesh, local_shards
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg, model_cfg, algo = _configs(os.path.join(out_dir, "ckpt"), world, ep, kernel, ac, bf16_ppo, lora)

    def fresh():
        return build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))

    state = fresh()
    result: dict = {"init_shards": [(n, t.clone(), s, o) for n, t, s, o in local_shards(state.policy)]}
    manager = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.num_keep)
    metrics, probes = [], []
    for step in range(NUM_STEPS):
        if step == 1:
            manager.save(state.checkpointables(), TrainProgress(state.step, state.policy_version, {"next": step}))
        metrics.append(rl_step(state, _batch(step)))
        probes.append(_probe(state.policy, rank, world))
    result.update(metrics=metrics, probes=probes, weights=full_weights(state.policy), ckpt_dir=cfg.checkpoint.dir)
    result["final_shards"] = [(n, t.clone(), s, o) for n, t, s, o in local_shards(state.policy)]
    resumed = fresh()
    progress = manager.load(resumed.checkpointables())
    resumed.step, resumed.policy_version = progress.step, progress.policy_version
    result["loaded_weights"] = full_weights(resumed.policy)
    result["resumed_metrics"] = [rl_step(resumed, _batch(s)) for s in range(progress.data_cursor["next"], NUM_STEPS)]
    result["resumed_weights"] = full_weights(resumed.policy)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _dispatch_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from trainer.expert_parallel import ExpertParallelExperts
    from trainer.models.registry import MOE_EXPERTS

    num_experts, dim, hidden, tokens_per_rank, top_k = 4, 32, 32, 12, 2
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(num_experts, hidden, dim, generator=g), torch.randn(num_experts, hidden, dim, generator=g),
               torch.randn(num_experts, dim, hidden, generator=g)]  # fmt: skip
    x_all = torch.randn(world * tokens_per_rank, dim, generator=g)
    grad_out = torch.randn(world * tokens_per_rank, dim, generator=g)
    routings = {
        "spread": torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(len(x_all))]),
        "skewed": torch.tensor([[0, 1]] * len(x_all)),  # rank 1's experts get nothing
    }
    mine = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)
    per_rank = num_experts // world
    results = {}
    for kernel_name in ("loop", "grouped", "gmm_pallas"):
        kernel = MOE_EXPERTS.get(kernel_name)
        for routing_name, idx in routings.items():
            route_w = torch.softmax(torch.randn(idx.shape, generator=g), dim=-1)
            # Reference: the plain kernel on every rank's tokens with all experts.
            x_ref = x_all.clone().requires_grad_()
            w_ref = [w.clone().requires_grad_() for w in weights]
            ref = kernel(x_ref, idx, route_w, *w_ref)
            (ref * grad_out).sum().backward()
            # Expert parallel: this rank's tokens, this rank's experts.
            x = x_all[mine].clone().requires_grad_()
            w_mine = [w[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_() for w in weights]
            out = ExpertParallelExperts(kernel, dist.group.WORLD, num_experts)(x, idx[mine], route_w[mine], *w_mine)
            (out * grad_out[mine]).sum().backward()
            results[kernel_name, routing_name] = {
                "out": (out.detach(), ref.detach()[mine]),
                "x_grad": (x.grad, x_ref.grad[mine]),
                "w_grads": [(w.grad, r.grad[rank * per_rank:(rank + 1) * per_rank]) for w, r in zip(w_mine, w_ref)],
            }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_rank()


@pytest.fixture(scope="module")
def dispatch(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dispatch")
    mp.start_processes(_dispatch_worker, args=(2, free_port(), str(out_dir)), nprocs=2, start_method="spawn")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("routing", ["spread", "skewed"])
@pytest.mark.parametrize("kernel", ["loop", "grouped", "gmm_pallas"])
def test_dispatch_equals_the_kernel_on_all_tokens(dispatch, kernel: str, routing: str) -> None:
    for rank_results in dispatch:
        case = rank_results[kernel, routing]
        torch.testing.assert_close(*case["out"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(*case["x_grad"], rtol=1e-5, atol=1e-5)
        for got, want in case["w_grads"]:
            assert got is not None  # a rank whose experts got no tokens still has (zero) gradients for FSDP
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


RUNS = {  # name: (world, ep, expert kernel, activation checkpointing, PPO in bfloat16, LoRA)
    "1": (1, 1, "grouped", "none", False, False),
    "ep2": (2, 2, "grouped", "none", False, False),
    "ep2_loop_ac": (2, 2, "loop", "full", False, False),
    "1_lora": (1, 1, "grouped", "none", False, True),
    "ep2_lora": (2, 2, "grouped", "full", False, True),  # expert adapters under EP, with the recompute
}
SLOW_RUNS = {  # ~1 min more: `make test-slow`
    "4": (4, 1, "grouped", "none", False, False),
    "ep2x2": (4, 2, "grouped", "none", False, False),  # experts over ep = 2, each half FSDP-sharded over efsdp = 2
    "2_bf16_ppo": (2, 1, "grouped", "none", True, False),
    "ep2_bf16_ppo": (2, 2, "grouped", "none", True, False),
}


def _load_worker(rank: int, ckpt_dir: str, port: int, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    from trainer.checkpoint import CheckpointManager
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state

    cfg, model_cfg, algo = _configs(ckpt_dir, 1, 1, "grouped", "none")
    state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    CheckpointManager(ckpt_dir, 1).load(state.checkpointables())
    torch.save(full_weights(state.policy), out_path)
    end_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return spawn_runs(_run_layout, RUNS, tmp_path_factory.mktemp("ep"))


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> dict[str, list[dict]]:
    return spawn_runs(_run_layout, SLOW_RUNS, tmp_path_factory.mktemp("ep_slow"))


def _runs(request: pytest.FixtureRequest, name: str) -> dict[str, list[dict]]:
    """The runs fixture that holds ``name`` and its baseline."""
    return request.getfixturevalue("slow_runs" if name in SLOW_RUNS else "runs")


def _cases(*names: str) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n for n in names]


# Each EP run against the same world size without EP. The router term is a per-micro-batch statistic, so it needs the
# same micro-batches: one rank packs what two ranks do, not what four do.
BASELINE = {"ep2": "1", "ep2_loop_ac": "1", "ep2_lora": "1_lora", "ep2x2": "4", "ep2_bf16_ppo": "2_bf16_ppo"}
# (metrics rel, metrics abs, weights abs). float32: equal up to summation order. bfloat16: each expert's rows are
# multiplied in another grouping (a rank's received rows vs all tokens), which moves bfloat16 roundings; metrics agree
# to ~1e-3, and Adam turns the noise in near-zero gradients into lr-sized steps (6 steps of lr 3e-3 here).
TOLERANCE = {name: (1e-5, 1e-6, 2e-5) for name in BASELINE} | {"ep2_bf16_ppo": (1e-2, 1e-3, 6e-3)}


@pytest.mark.parametrize("name", _cases(*BASELINE))
def test_expert_parallel_matches_no_expert_parallel(request, name: str) -> None:
    runs = _runs(request, name)
    one, many = runs[BASELINE[name]][0], runs[name]
    for step, m1 in enumerate(one["metrics"]):
        m2a = many[0]["metrics"][step]
        for other in many[1:]:
            assert {k: v for k, v in m2a.items() if not is_timing(k)} == {
                k: v for k, v in other["metrics"][step].items() if not is_timing(k)
            }
        rel, abs_, _ = TOLERANCE[name]
        keys = ("loss", "policy_loss", "loss/moe_aux", "kl", "entropy", "grad_norm", "ratio_mean", "critic/value_loss")
        for key in (k for k in keys if k in m1):
            assert m1[key] == pytest.approx(m2a[key], rel=rel, abs=abs_), key
    for key, w in one["weights"].items():
        torch.testing.assert_close(many[0]["weights"][key], w, rtol=0, atol=TOLERANCE[name][2], msg=key)


@pytest.mark.parametrize("name", _cases("ep2", "ep2_loop_ac", "ep2_lora", "ep2x2"))  # float32: bf16 can flip near-ties
def test_router_loads_and_outputs_match(request, name: str) -> None:
    """After every step, a fixed batch split over the ranks routes exactly as without EP (per-expert loads summed over
    ranks, per layer) and gives the same hidden states."""
    runs = _runs(request, name)
    for step in range(NUM_STEPS):
        (hidden, loads), (base_hidden, base_loads) = (_whole_probe(runs[n], step) for n in (name, BASELINE[name]))
        torch.testing.assert_close(hidden, base_hidden, rtol=1e-4, atol=1e-5)
        for layer, load in enumerate(base_loads):
            assert torch.equal(loads[layer], load), (step, layer)
            assert int(load.sum()) == PROBE_ROWS * 12 * 2  # every token went to top_k = 2 experts


def _whole_probe(run: list[dict], step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The probe batch's hidden states (rows back in batch order) and per-layer expert loads over all ranks of a run."""
    parts = [r["probes"][step] for r in run]
    rows = [row for rank in range(len(run)) for row in range(rank, PROBE_ROWS, len(run))]
    hidden = torch.empty(PROBE_ROWS, *parts[0][0].shape[1:], dtype=parts[0][0].dtype)
    hidden[rows] = torch.cat([h for h, _ in parts])
    return hidden, [sum(loads[layer] for _, loads in parts) for layer in range(len(parts[0][1]))]


def test_a_checkpoint_saved_with_expert_parallel_loads_on_one_rank(runs, tmp_path) -> None:
    ckpt_dir = str(tmp_path / "ckpt")
    shutil.copytree(Path(runs["ep2"][0]["ckpt_dir"]), ckpt_dir)
    out = tmp_path / "loaded.pt"
    mp.start_processes(_load_worker, args=(ckpt_dir, free_port(), str(out)), nprocs=1, start_method="spawn")
    loaded = torch.load(out, weights_only=False)
    for key, w in runs["ep2"][0]["loaded_weights"].items():
        assert torch.equal(loaded[key], w), key


def test_each_rank_holds_only_its_experts_and_pieces_reassemble(runs) -> None:
    one, two = runs["1"][0], runs["ep2"]
    init_one = reassemble([one["init_shards"]])
    init_two = reassemble([r["init_shards"] for r in two])
    assert init_two.keys() == init_one.keys()
    for key in init_one:
        assert torch.equal(init_two[key], init_one[key]), key
    for rank, result in enumerate(two):
        experts = {n: (t.shape, o) for n, t, _, o in result["init_shards"] if ".experts." in n}
        assert experts, "no expert weights among the rank's pieces"
        for key, (shape, offsets) in experts.items():
            assert shape[0] == NUM_EXPERTS // 2 and offsets[0] == rank * NUM_EXPERTS // 2, (key, shape, offsets)
    final_two = reassemble([r["final_shards"] for r in two])
    for key, w in two[0]["weights"].items():
        assert torch.equal(final_two[key], w), key


def test_expert_adapters_train_under_expert_parallelism_and_their_pieces_reassemble(runs) -> None:
    """Every expert's adapters moved (lora_B starts at 0), the ranks' pieces (what each would push) cover the whole
    model, and each piece of an expert adapter is a contiguous block of the PEFT-layout tensor."""
    two = runs["ep2_lora"]
    final = reassemble([r["final_shards"] for r in two])
    assert final.keys() == two[0]["weights"].keys()
    for key, w in two[0]["weights"].items():
        assert torch.equal(final[key], w), key
    expert_b = [k for k in final if ".experts." in k and k.endswith("lora_B")]
    assert expert_b, "no expert adapters in the model"
    for key in expert_b:
        per_expert = final[key].view(final[key].shape[0], -1, NUM_EXPERTS)  # PEFT: [out, rank x E], expert minor
        assert (per_expert.abs().sum((0, 1)) > 0).all(), f"{key}: an expert's adapter never trained"


@pytest.mark.parametrize("name", _cases("ep2", "ep2_loop_ac", "ep2_lora", "ep2x2"))
def test_resume_is_bit_identical(request, name: str) -> None:
    for result in _runs(request, name)[name]:
        for a, b in zip(result["metrics"][1:], result["resumed_metrics"], strict=True):
            assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
        for key, w in result["weights"].items():
            assert torch.equal(result["resumed_weights"][key], w), key
