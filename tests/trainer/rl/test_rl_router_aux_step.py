"""The router load-balancing term inside ``rl_step`` (one rank): reported as ``loss/moe_aux``,
added with the configured weight, off at 0, absent for dense models, a mean per optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from trainer_batches import random_samples

from rollout.types import RolloutBatch, Sample
from trainer.config import TrainerConfig
from trainer.metrics import is_timing
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig

MOE = ModelConfig(
    family="qwen3_moe", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    ffn_hidden_dim=48, qk_norm=True, output_chunk_size=16,
    moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16, aux_loss_coef=0.3),
)  # fmt: skip
DENSE = MOE.model_copy(update={"family": "qwen3", "moe": None})


pytestmark = pytest.mark.usefixtures("single_rank_group")


def _samples(seed: int = 0) -> list[Sample]:
    return random_samples(seed, completion_len=(1, 16), logprob=-4.0)


def _step(model_cfg: ModelConfig, algo: GRPOConfig, **overrides) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg = TrainerConfig(**{"optimizer": {"lr": 1e-2}, "micro_batch_tokens": 48, **overrides})
    state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    metrics = rl_step(state, RolloutBatch(_samples()))
    # One float32 rank runs the plain module (no FSDP DTensors); full_tensor() covers the sharded layout.
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in state.policy.named_parameters()
    }
    return metrics, weights


def test_the_term_is_added_with_its_weight_and_reported() -> None:
    off, w_off = _step(MOE, GRPOConfig(group_size=4, moe_aux_loss_coef=0.0))
    on, w_on = _step(MOE, GRPOConfig(group_size=4, moe_aux_loss_coef=0.3))
    default, w_default = _step(MOE, GRPOConfig(group_size=4))  # the model's own coefficient, 0.3
    assert off["loss"] == off["policy_loss"]  # coef 0: the optimized loss is the policy loss alone
    assert off["loss/moe_aux"] == on["loss/moe_aux"] > 1.0  # about top_k = 2 near balance
    assert on["policy_loss"] == off["policy_loss"]
    assert on["loss"] == pytest.approx(on["policy_loss"] + 0.3 * on["loss/moe_aux"], rel=1e-6)
    assert {k: v for k, v in default.items() if not is_timing(k)} == pytest.approx(
        {k: v for k, v in on.items() if not is_timing(k)}
    )
    router = "layers.0.moe.router.weight"
    assert not torch.equal(w_on[router], w_off[router])
    assert torch.equal(w_on[router], w_default[router])


def test_dense_models_report_nothing() -> None:
    metrics, _ = _step(DENSE, GRPOConfig(group_size=4, moe_aux_loss_coef=0.3))
    assert "loss/moe_aux" not in metrics and metrics["loss"] == metrics["policy_loss"]


def test_metric_is_a_mean_per_optimizer_step() -> None:
    one, _ = _step(MOE, GRPOConfig(group_size=4), num_minibatches=1)
    four, _ = _step(MOE, GRPOConfig(group_size=4), num_minibatches=2, num_epochs=2)
    assert one["loss/moe_aux"] == pytest.approx(four["loss/moe_aux"], rel=0.1)  # not summed over the 4 updates


def _engine(model_cfg: ModelConfig, algo):
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state

    cfg = TrainerConfig(optimizer={"lr": 1e-2}, micro_batch_tokens=48)
    return build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))


def test_sft_warm_start_minimises_the_term_too() -> None:
    from trainer.step import sft_step

    runs = {}
    for coef in (0.0, 0.3):
        state = _engine(MOE, GRPOConfig(group_size=4, moe_aux_loss_coef=coef))
        runs[coef] = (sft_step(state, _samples()), state.policy.get_parameter("layers.0.moe.router.weight"))
    (off, router_off), (on, router_on) = runs[0.0], runs[0.3]
    assert off["loss"] == off["sft_loss"] == on["sft_loss"]
    assert on["loss/moe_aux"] == off["loss/moe_aux"] > 1.0
    assert on["loss"] == pytest.approx(on["sft_loss"] + 0.3 * on["loss/moe_aux"], rel=1e-6)
    assert not torch.equal(router_on, router_off)
    dense = sft_step(_engine(DENSE, GRPOConfig(group_size=4)), _samples())
    assert "loss/moe_aux" not in dense and dense["loss"] == dense["sft_loss"]


def test_ppo_critic_routers_get_the_term() -> None:
    from trainer.rl.config import PPOConfig
    from trainer.step import rl_step

    runs = {}
    for coef in (0.0, 0.3):
        state = _engine(MOE, PPOConfig(moe_aux_loss_coef=coef))
        metrics = rl_step(state, RolloutBatch(_samples()))
        runs[coef] = (metrics, state.critic.get_parameter("body.layers.0.moe.router.weight").detach().clone())
    (off, router_off), (on, router_on) = runs[0.0], runs[0.3]
    assert off["critic/loss"] == off["critic/value_loss"] == on["critic/value_loss"]
    assert on["critic/loss/moe_aux"] == off["critic/loss/moe_aux"] > 1.0
    assert on["critic/loss"] == pytest.approx(on["critic/value_loss"] + 0.3 * on["critic/loss/moe_aux"], rel=1e-6)
    assert not torch.equal(router_on, router_off)
