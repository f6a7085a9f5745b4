"""LoRA training on the trainer: only the adapters move, the KL reference is the base (adapters off), checkpoints hold
the adapters alone and resume bit for bit, and 2 FSDP ranks, or 2 tensor-parallel ranks, compute the 1-rank update."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import end_rank, full_weights
from trainer_batches import random_batch

from common.net import free_port
from rollout.types import RolloutBatch

NUM_STEPS = 4  # checkpoint after step 2, then steps 3-4 twice (uninterrupted, resumed)


MODELS = ("dense", "moe_experts")
"""A dense Qwen 3 with adapters on attention and MLP projections; a Qwen 3 MoE with adapters on attention and on
every expert's gate/up and down weights."""


def _configs(ckpt_dir: str, world: int, minibatches: int = 2, model: str = "dense", tp: int = 1, ep: int = 1):
    from trainer.config import TrainerConfig
    from trainer.models.config import LoRAConfig, ModelConfig, MoEConfig
    from trainer.rl.config import GRPOConfig, KLConfig
    from weight_sync.peft import EXPERT_TARGETS

    if model == "dense":
        lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
        arch: dict = {"family": "qwen3"}
    else:  # "moe_attention": the attention's adapters alone (what expert parallelism takes)
        experts = EXPERT_TARGETS if model == "moe_experts" else ()
        lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "o_proj"), target_parameters=experts)
        # No load-balancing term: it is taken per micro-batch, and 2 ranks pack other micro-batches than 1, so the
        # 1-rank / 2-rank comparisons below would compare two different losses.
        moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=16, aux_loss_coef=0.0)
        arch = {"family": "qwen3_moe", "moe": moe}
    model_cfg = ModelConfig(
        **arch, vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=64, qk_norm=True, tie_embeddings=True, output_chunk_size=16, lora=lora,
    )  # fmt: skip
    cfg = TrainerConfig(
        num_ranks=world, parallelism={"tensor_parallel_degree": tp, "expert_parallel_degree": ep},
        micro_batch_tokens=96, num_minibatches=minibatches, max_grad_norm=0.5,
        optimizer=dict(lr=3e-2, weight_decay=0.01), checkpoint=dict(dir=ckpt_dir, num_keep=1),
    )  # fmt: skip
    return cfg, model_cfg, GRPOConfig(group_size=4, kl=KLConfig(coef=0.05))


def _batch(step: int) -> RolloutBatch:
    return random_batch(100 + step, num_groups=4, completion_len=(1, 24), logprob=(-3.8, -3.5))



def _worker(rank: int, world: int, port: int, out_dir: str, model: str, tp: int = 1, ep: int = 1) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from trainer.checkpoint import CheckpointManager, TrainProgress
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg, model_cfg, algo = _configs(os.path.join(out_dir, "ckpt"), world, model=model, tp=tp, ep=ep)

    def fresh():
        return build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))

    state = fresh()
    result: dict = {"init": full_weights(state.policy), "has_reference_model": state.reference is not None}
    result["optimizer_params"] = sum(len(g["params"]) for g in state.optimizer.param_groups)
    manager = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.num_keep)
    metrics = []
    for step in range(NUM_STEPS):
        if step == 2:
            result["checkpoint"] = str(
                manager.save(state.checkpointables(), TrainProgress(state.step, state.policy_version, {}))
            )
        metrics.append(rl_step(state, _batch(step)))
    result["metrics"], result["weights"] = metrics, full_weights(state.policy)
    resumed = fresh()
    progress = manager.load(resumed.checkpointables())
    resumed.step, resumed.policy_version = progress.step, progress.policy_version
    result["resumed_metrics"] = [rl_step(resumed, _batch(step)) for step in range(2, NUM_STEPS)]
    result["resumed_weights"] = full_weights(resumed.policy)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    end_rank()


def _warm_start_worker(rank: int, world: int, port: int, out_dir: str, model: str) -> None:
    """A ``TrainerWorker`` rank: a warm start of every weight (adapters frozen and off), then an RL step on the
    adapters (base frozen again)."""
    torch.set_num_threads(1)
    from trainer.worker import TrainerWorker

    cfg, model_cfg, algo = _configs(os.path.join(out_dir, "ckpt"), world, model=model)
    worker = TrainerWorker(rank, cfg, model_cfg, algo)
    worker.setup("127.0.0.1", port)
    assert worker.state is not None
    result: dict = {"init": full_weights(worker.state.policy)}
    worker.begin_warm_start(all_parameters=True)
    for step in range(2):
        worker.sft_step(_batch(step).samples, lr=1e-2)
    result["after_sft"] = full_weights(worker.state.policy)
    result["base_version"] = worker.policy_version()  # receivers below it lack this base
    worker.finish_warm_start()
    result["rl"] = worker.train_step(_batch(2))
    result["after_rl"] = full_weights(worker.state.policy)
    torch.save(result, os.path.join(out_dir, f"warm{rank}.pt"))
    worker.shutdown()
    end_rank()



@pytest.fixture(scope="module", params=MODELS)
def runs(request, tmp_path_factory) -> dict[int, list[dict]]:
    out = {}
    for world in (1, 2):
        out_dir = tmp_path_factory.mktemp(f"lora{world}")
        args = (world, free_port(), str(out_dir), request.param)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        args = (world, free_port(), str(out_dir), request.param)
        mp.start_processes(_warm_start_worker, args=args, nprocs=world, start_method="spawn")
        out[world] = [
            {**torch.load(out_dir / f"rank{r}.pt", weights_only=False),
             "warm": torch.load(out_dir / f"warm{r}.pt", weights_only=False)}
            for r in range(world)
        ]  # fmt: skip
    if request.param == "dense":  # 2 tensor-parallel ranks (adapters split with their projections), no warm start
        out_dir = tmp_path_factory.mktemp("lora_tp")
        mp.start_processes(_worker, args=(2, free_port(), str(out_dir), "dense", 2), nprocs=2, start_method="spawn")
        out["tp"] = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return out


def test_only_adapters_move_and_no_reference_copy_is_built(runs) -> None:
    from trainer.models.lora import is_adapter

    run = runs[1][0]
    assert not run["has_reference_model"]
    adapters = [n for n in run["init"] if is_adapter(n)]
    assert run["optimizer_params"] == len(adapters)
    for name, w in run["weights"].items():
        if not is_adapter(name):
            assert torch.equal(w, run["init"][name]), f"frozen base weight {name} changed"
    moved = [n for n in adapters if n.endswith("lora_B") and not torch.equal(run["weights"][n], run["init"][n])]
    assert moved == [n for n in adapters if n.endswith("lora_B")]  # every adapter, expert ones included, trains
    assert all(m["kl"] > 0 for m in run["metrics"][1:])  # the adapters moved the policy away from the base


def test_two_fsdp_ranks_match_one_rank(runs) -> None:
    one, two = runs[1][0], runs[2]
    for m1, m2 in zip(one["metrics"], two[0]["metrics"]):
        for key in ("loss", "policy_loss", "kl", "grad_norm", "ratio_mean"):
            assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    for name, w in one["weights"].items():
        torch.testing.assert_close(two[0]["weights"][name], w, rtol=1e-5, atol=2e-5)


def _assert_matches_one_rank(one: dict, ranks: list[dict], metric_rel: float = 1e-5) -> None:
    """A sharded run (``ranks``: each rank's results) took the 1-rank run's steps (metrics, final weights), and each
    rank's resumed steps ended on the uninterrupted run's weights bit for bit."""
    for m1, m2 in zip(one["metrics"], ranks[0]["metrics"]):
        for key in ("loss", "policy_loss", "kl", "grad_norm", "ratio_mean"):
            assert m1[key] == pytest.approx(m2[key], rel=metric_rel, abs=1e-6), key
    for name, w in one["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], w, rtol=1e-5, atol=2e-5)
    for rank_result in ranks:
        for name, w in rank_result["weights"].items():
            assert torch.equal(rank_result["resumed_weights"][name], w), name


def test_tensor_parallel_ranks_match_one_rank_and_resume_bit_identical(runs) -> None:
    """Adapters split along with their projections over 2 TP ranks: the 1-rank steps and weights, and an
    adapter-only checkpoint that resumes bit for bit."""
    if "tp" not in runs:
        pytest.skip("tensor parallelism splits dense blocks only")
    # lr 3e-2 on AdamW: the split matmuls' other summation order moves the 4th step's gradient norm by ~1e-5
    _assert_matches_one_rank(runs[1][0], runs["tp"], metric_rel=5e-5)


def test_attention_adapters_on_an_expert_parallel_moe_match_one_rank(tmp_path: Path) -> None:
    """Experts split over 2 ranks (EP = 2), adapters on attention only: the 1-rank steps, and a resume bit for bit."""
    out = {}
    for world, ep in ((1, 1), (2, 2)):
        out_dir = tmp_path / f"ep{ep}"
        out_dir.mkdir()
        args = (world, free_port(), str(out_dir), "moe_attention", 1, ep)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        out[ep] = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    _assert_matches_one_rank(out[1][0], out[2])


@pytest.mark.parametrize("world", [1, 2])
def test_adapter_only_checkpoint_resumes_bit_identical(runs, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    from trainer.models.lora import is_adapter

    for rank_result in runs[world]:
        keys = dcp.FileSystemReader(rank_result["checkpoint"]).read_metadata().state_dict_metadata
        model_keys = [k.removeprefix("policy.model.") for k in keys if k.startswith("policy.model.")]
        assert model_keys and all(is_adapter(k) for k in model_keys), model_keys
        for a, b in zip(rank_result["metrics"][2:], rank_result["resumed_metrics"]):
            assert {k: v for k, v in a.items() if not k.endswith("_s")} == {
                k: v for k, v in b.items() if not k.endswith("_s")
            }
        for name, w in rank_result["weights"].items():
            assert torch.equal(rank_result["resumed_weights"][name], w), name


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("model", MODELS)
def test_reference_is_the_base_model_and_the_first_kl_is_zero(tmp_path: Path, model: str) -> None:
    """The reference log-probs equal those of a separately built model without adapters on the same base weights."""
    from trainer.models.lora import is_adapter
    from trainer.models.transformer import build_model
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import _reference_logprobs, forward_logprobs, plan_rank_micro_batches, rl_step

    cfg, model_cfg, algo = _configs(str(tmp_path), 1, minibatches=1, model=model)
    state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    first = rl_step(state, _batch(0))
    assert first["kl"] == 0.0  # fresh adapters (B = 0): the policy is the base
    rl_step(state, _batch(1))
    base = build_model(model_cfg.model_copy(update={"lora": None}))
    base.load_state_dict({n: p for n, p in state.policy.state_dict().items() if not is_adapter(n)})
    samples = _batch(2).samples
    mb = plan_rank_micro_batches(state, samples, range(len(samples)))[0]
    with torch.no_grad():
        expected = forward_logprobs(base, mb)[0]
        got = _reference_logprobs(state, mb)
        policy = forward_logprobs(state.policy, mb)[0]
    assert torch.equal(got, expected)
    assert (policy - expected).abs().max() > 1e-4


@pytest.mark.parametrize("world", [1, 2])
def test_a_warm_start_of_every_weight_trains_the_base_then_rl_trains_only_the_adapters(runs, world: int) -> None:
    from trainer.models.lora import is_adapter

    warm = runs[world][0]["warm"]
    assert warm["base_version"] == 2  # two SFT steps
    for name, w in warm["after_sft"].items():
        changed = not torch.equal(w, warm["init"][name])
        assert changed != is_adapter(name), f"{name}: changed={changed} in the warm start"
    for name, w in warm["after_rl"].items():
        if not is_adapter(name):
            assert torch.equal(w, warm["after_sft"][name]), f"frozen base weight {name} changed in RL"
    assert any(not torch.equal(warm["after_rl"][n], warm["after_sft"][n]) for n in warm["init"] if is_adapter(n))
    if world == 2:  # sharded, the same as one rank
        one = runs[1][0]["warm"]
        for name, w in one["after_rl"].items():
            # Two SFT steps at lr 1e-2 over every weight, then AdamW's first RL step: fp32 summation-order noise
            # grows to ~2e-5 on the MoE model's weights (a sharding bug moves them by ~1e-2).
            torch.testing.assert_close(warm["after_rl"][name], w, rtol=1e-5, atol=5e-5)


@pytest.mark.usefixtures("single_rank_group")
def test_a_ppo_critic_trains_its_own_adapters_and_value_head(tmp_path: Path) -> None:
    from trainer.models.lora import is_adapter
    from trainer.parallelize import build_mesh
    from trainer.rl.config import PPOConfig
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg, model_cfg, _ = _configs(str(tmp_path), 1, minibatches=1)
    state = build_train_state(cfg, model_cfg, PPOConfig(), torch.device("cpu"), build_mesh(cfg, "cpu"))
    assert state.critic is not None and state.critic_optimizer is not None
    trainable = {n for n, p in state.critic.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if is_adapter(n) or n.startswith("value_head.")}
    assert {"value_head.weight", "value_head.bias"} <= trainable and any(is_adapter(n) for n in trainable)
    before = {n: p.detach().clone() for n, p in state.critic.named_parameters()}
    metrics = rl_step(state, _batch(0))
    assert metrics["critic/grad_norm"] > 0
    rl_step(state, _batch(1))  # the zero value head passes no gradient to the body on the first step
    after = dict(state.critic.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trainable), "a frozen critic weight moved"
    assert not torch.equal(after["value_head.weight"], before["value_head.weight"])
    # B starts at 0, so B is what moves first (A's gradient goes through B)
    assert any(not torch.equal(after[n], before[n]) for n in trainable if n.endswith("lora_B"))
