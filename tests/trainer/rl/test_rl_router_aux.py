"""The MoE router term of the policy loss: which packed tokens count, the micro-batch weighting (checked against
transformers' ``load_balancing_loss_func`` on the captured router logits), and the coefficient's resolution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from common.config import ConfigError, validate_config
from rollout.types import Sample
from trainer.models.config import ModelConfig
from trainer.models.transformer import build_model
from trainer.packing import plan_micro_batches
from trainer.rl.config import GRPOConfig, PPOConfig
from trainer.rl.router_aux import (
    METRIC,
    add_router_aux_loss,
    count_router_tokens,
    moe_aux_coef,
    router_token_mask,
)

MOE = ModelConfig(
    family="qwen3_moe", vocab_size=96, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    ffn_hidden_dim=48, qk_norm=True, moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16, aux_loss_coef=0.01),
)  # fmt: skip
EMPTY_COMPLETION_TOKENS = (80, 96)  # prompt ids of samples without a completion: nothing else uses them


def _samples(seed: int, num: int = 10, num_empty: int = 0) -> list[Sample]:
    """Token ids >= 1 everywhere (packing pads with 0); samples without a completion use ids 80-95."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        empty = i < num_empty
        p, c = int(rng.integers(2, 9)), 0 if empty else int(rng.integers(1, 14))
        prompt = rng.integers(*EMPTY_COMPLETION_TOKENS, p) if empty else rng.integers(1, 80, p)
        out.append(Sample(prompt_ids=prompt, completion_ids=rng.integers(1, 80, c),
                          rollout_logprobs=np.zeros(c, np.float32), reward=0.0, group_id=i // 2, policy_version=0))
    return out  # fmt: skip


def test_token_mask_is_exactly_the_tokens_of_sequences_with_a_completion() -> None:
    samples = _samples(0, num=12, num_empty=3)
    mbs = plan_micro_batches(samples, range(12), 0, 1, token_budget=40, row_tokens=20)
    assert len(mbs) > 1 and any((mb.tokens == 0).any() for mb in mbs)  # several micro-batches, some padding
    total = 0
    for mb in mbs:
        mask = router_token_mask(mb)
        assert torch.equal(mask, (mb.tokens != 0) & (mb.tokens < EMPTY_COMPLETION_TOKENS[0]))
        total += int(mask.sum())
    assert total == count_router_tokens(samples, range(12))
    empty = plan_micro_batches(samples, range(2), 1, 2, token_budget=40)[-1]  # rank 1's padding-only micro-batch
    assert not router_token_mask(empty).any()


def _router_logits_capture(model: torch.nn.Module) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    for block in model.layers:
        block.moe.router.register_forward_hook(lambda mod, inp, out: captured.append(out))
    return captured


def test_micro_batches_are_weighted_by_their_share_of_the_batch() -> None:
    """Accumulated over micro-batches, the gradient is coef x the token-weighted mean of per-micro-batch terms, each
    the mean over layers of transformers' function on that layer's router logits with padding masked out."""
    samples = _samples(1, num=12, num_empty=2)
    mbs = plan_micro_batches(samples, range(12), 0, 1, token_budget=48, row_tokens=24)
    assert len(mbs) >= 3
    num_tokens = count_router_tokens(samples, range(12))
    coef = 0.5
    torch.manual_seed(0)
    ours = build_model(MOE)
    reference = build_model(MOE)
    reference.load_state_dict(ours.state_dict())
    logits = _router_logits_capture(reference)

    total_metric = 0.0
    for mb in mbs:
        ours(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids)
        loss, metrics = add_router_aux_loss(torch.zeros(()), {"loss": 0.0}, ours, mb, coef, num_tokens)
        loss.backward()
        total_metric += metrics[METRIC]
        assert metrics["loss"] == pytest.approx(coef * metrics[METRIC])

    expected_value = torch.zeros(())
    for mb in mbs:
        logits.clear()
        reference(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids)
        mask = ((mb.tokens != 0) & (mb.tokens < EMPTY_COMPLETION_TOKENS[0])).reshape(1, -1).long()
        per_layer = [load_balancing_loss_func((lg,), 4, 2, attention_mask=mask) for lg in logits]
        expected_value = expected_value + torch.stack(per_layer).mean() * (mask.sum() / num_tokens)
    (coef * expected_value).backward()

    assert total_metric == pytest.approx(expected_value.item(), rel=1e-6)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6 * q.grad.abs().max().item(), msg=name)
    assert ours.layers[0].moe.router.weight.grad.abs().max() > 0


def test_zero_coef_reports_the_term_and_leaves_the_loss_alone() -> None:
    samples = _samples(2)
    mb = plan_micro_batches(samples, range(10), 0, 1, token_budget=10_000)[0]
    model = build_model(MOE)
    model(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids)
    loss = torch.tensor(1.5, requires_grad=True)
    same, metrics = add_router_aux_loss(loss, {"loss": 1.5}, model, mb, 0.0, count_router_tokens(samples, range(10)))
    assert same is loss and metrics["loss"] == 1.5 and metrics[METRIC] > 0
    assert add_router_aux_loss(loss, {"loss": 1.5}, model, mb, None, 1.0) == (loss, {"loss": 1.5})  # dense model
    with pytest.raises(ValueError, match="whole optimizer batch"):
        add_router_aux_loss(loss, {"loss": 1.5}, model, mb, 0.1, 3.0)


def test_coefficient_comes_from_the_algorithm_else_the_model() -> None:
    dense = MOE.model_copy(update={"family": "qwen3", "moe": None})
    assert moe_aux_coef(GRPOConfig(), MOE) == 0.01
    assert moe_aux_coef(GRPOConfig(moe_aux_loss_coef=0.0), MOE) == 0.0
    assert moe_aux_coef(PPOConfig(moe_aux_loss_coef=0.2), MOE) == 0.2
    assert moe_aux_coef(GRPOConfig(moe_aux_loss_coef=0.2), dense) is None
    with pytest.raises(ConfigError, match="moe_aux_loss_coef"):
        validate_config(GRPOConfig, {"moe_aux_loss_coef": -0.1})
