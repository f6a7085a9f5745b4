"""MoE router load-balancing loss against transformers' ``load_balancing_loss_func`` (Qwen3-MoE), per layer and
through a whole model, with and without a padding mask; its gradient, the expert blocks, and the HF config field."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from tests.trainer.models.tiny_hf import TINY_HF
from trainer.models.config import ModelConfig
from trainer.models.hf_config import hf_config_dict, model_config_from_hf, model_config_from_hf_dict
from trainer.models.hf_io import load_hf_checkpoint
from trainer.models.moe import load_balancing_loss, route_tokens, router_aux_loss
from trainer.models.transformer import build_model

MOE = dict(
    family="qwen3_moe", vocab_size=80, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    ffn_hidden_dim=48, qk_norm=True, moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16),
)  # fmt: skip


def _ours(logits: torch.Tensor, top_k: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    top_idx, _, probs = route_tokens(logits, top_k, norm_topk_prob=True)
    return load_balancing_loss(probs, top_idx, mask)


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 1), (8, 2), (16, 4), (6, 6)])
def test_one_layer_matches_transformers(num_experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    logits = 2.0 * torch.randn(37, num_experts, generator=gen)
    expected = load_balancing_loss_func((logits,), num_experts, top_k)
    torch.testing.assert_close(_ours(logits, top_k), expected, rtol=1e-6, atol=1e-6)

    mask = torch.rand(37, generator=gen) > 0.3
    expected = load_balancing_loss_func((logits,), num_experts, top_k, attention_mask=mask[None].long())
    torch.testing.assert_close(_ours(logits, top_k, mask), expected, rtol=1e-6, atol=1e-6)
    # Masked-out tokens do not matter at all: dropping them gives the same value.
    torch.testing.assert_close(_ours(logits[mask], top_k), expected, rtol=1e-6, atol=1e-6)


def test_balanced_routing_gives_top_k_and_no_counted_token_gives_zero() -> None:
    uniform = torch.zeros(8, 4)  # every probability 1/4; topk picks some experts, probs are flat either way
    assert _ours(uniform, 2).item() == pytest.approx(2.0)
    logits = torch.randn(5, 4, requires_grad=True)
    zero = _ours(logits, 2, torch.zeros(5))
    assert zero.item() == 0.0
    zero.backward()  # still part of the graph (every rank runs the same backward)
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    with pytest.raises(ValueError, match="token_mask has 4 elements for 5"):
        _ours(logits, 2, torch.ones(4))


def test_whole_model_is_the_mean_of_per_layer_transformers_values(tmp_path) -> None:
    """Our 2-layer model on HF weights: each layer's term equals HF's function on that layer's router logits."""
    import transformers

    config_cls, kwargs = TINY_HF["qwen3_moe"]
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)  # large router weights: unbalanced routing, so the value is not trivially top_k
    hf.save_pretrained(str(tmp_path))
    ours = build_model(model_config_from_hf(str(tmp_path)), dtype=torch.float32)
    load_hf_checkpoint(ours, str(tmp_path))
    tokens = torch.randint(0, kwargs["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    mask[1, 15:] = 0
    with torch.no_grad():
        router_logits = hf(input_ids=tokens, output_router_logits=True).router_logits
        ours(tokens)
    num_experts, top_k = kwargs["num_experts"], kwargs["num_experts_per_tok"]
    for flat_mask in (None, mask):
        per_layer = [
            load_balancing_loss_func((logits,), num_experts, top_k, attention_mask=flat_mask)
            for logits in router_logits
        ]
        got = router_aux_loss(ours, flat_mask)
        torch.testing.assert_close(got, torch.stack(per_layer).mean(), rtol=1e-5, atol=1e-6)
    assert abs(router_aux_loss(ours).item() - top_k) > 0.05
    assert router_aux_loss(ours, mask).item() != pytest.approx(router_aux_loss(ours).item())


@pytest.mark.parametrize("experts", ["loop", "grouped"])  # gmm_pallas: same routing, see the next test
def test_gradient_reaches_the_router_only(experts: str) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(**MOE, moe_experts=experts))
    model(torch.randint(0, 80, (2, 11)))
    aux = router_aux_loss(model)
    aux.backward()
    for i, block in enumerate(model.layers):
        assert block.moe.router.weight.grad.abs().max() > 0, i
    last = model.layers[-1].moe.experts
    for w in (last.w1, last.w2, last.w3):
        assert w.grad is None  # f_e (the expert counts) is not differentiable; only p_e carries gradient
    assert model.layers[0].moe.experts.w2.grad.abs().max() > 0  # layer 0's output feeds layer 1's router


def test_expert_blocks_give_the_same_value() -> None:
    import trainer.kernels.gmm  # noqa: F401 (registers the gmm_pallas block)

    tokens = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(1))
    values = []
    for experts in ("loop", "grouped", "gmm_pallas"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**MOE, moe_experts=experts))
        with torch.no_grad():
            model(tokens)
        values.append(router_aux_loss(model, tokens != 0))
        assert model.moe_aux_loss() == router_aux_loss(model)  # the model's own unmasked mean agrees
    # Layer 1's router input differs by float rounding between the blocks, so the values agree to that level.
    torch.testing.assert_close(values[1], values[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values[2], values[0], rtol=1e-6, atol=1e-6)


def test_dense_model_has_no_router_loss() -> None:
    cfg = ModelConfig(**{**MOE, "family": "qwen3", "moe": None})
    model = build_model(cfg)
    model(torch.randint(0, 80, (1, 5)))
    assert router_aux_loss(model) is None


def test_loss_before_any_forward_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="run a forward first"):
        router_aux_loss(build_model(ModelConfig(**MOE)))


def test_hf_router_aux_loss_coef_round_trips(tmp_path) -> None:
    cfg = ModelConfig(**{**MOE, "moe": {**MOE["moe"], "aux_loss_coef": 0.02}})
    raw = hf_config_dict(cfg)
    assert raw["router_aux_loss_coef"] == 0.02
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert model_config_from_hf(str(tmp_path)) == cfg
    del raw["router_aux_loss_coef"]  # absent: transformers' Qwen3-MoE default
    assert model_config_from_hf_dict(raw).moe.aux_loss_coef == 0.001
    with pytest.raises(ValueError, match="aux_loss_coef"):
        model_config_from_hf_dict({**raw, "router_aux_loss_coef": -1.0})
