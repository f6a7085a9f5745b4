"""``trainer.compile``: the torch.compile-d elementwise ops equal the plain torch ones, forward and backward, at any
length (dynamic shapes), alone and inside a whole model; the switch leaves parameters and state-dict names alone;
configs that cannot compile are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.config import ConfigError, validate_config
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.models.layers import compiled, rms_norm, swiglu
from trainer.models.rope import apply_rope, rope_cos_sin
from trainer.models.transformer import build_model

TOL = {"rtol": 1e-5, "atol": 1e-5}
CFG = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=48,
    qk_norm=True, tie_embeddings=True,
)  # fmt: skip


def _value_and_grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return (out.detach(), *(leaf.grad for leaf in leaves))


def _rms_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Independent of :func:`rms_norm`: torch's own ``F.rms_norm`` (same float32 math)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-6)


@pytest.mark.parametrize("num_tokens", [7, 130])
def test_compiled_rms_norm_matches_reference(num_tokens):
    torch.manual_seed(num_tokens)
    x, w = torch.randn(1, num_tokens, 32), torch.randn(32)
    got = _value_and_grads(lambda a, b: compiled(rms_norm)(a, b, 1e-6), x, w)
    plain = _value_and_grads(lambda a, b: rms_norm(a, b, 1e-6), x, w)
    want = _value_and_grads(_rms_reference, x, w)
    for g, p, r in zip(got, plain, want, strict=True):
        torch.testing.assert_close(g, r, **TOL)
        torch.testing.assert_close(p, r, **TOL)


@pytest.mark.parametrize("num_tokens", [5, 97])
def test_compiled_swiglu_matches_reference(num_tokens):
    torch.manual_seed(num_tokens)
    gate, up = torch.randn(1, num_tokens, 48), torch.randn(1, num_tokens, 48)
    got = _value_and_grads(compiled(swiglu), gate, up)
    want = _value_and_grads(lambda g, u: g * torch.sigmoid(g) * u, gate, up)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("num_tokens", [6, 41])
def test_compiled_rope_matches_reference(num_tokens):
    torch.manual_seed(num_tokens)
    positions = torch.arange(num_tokens)[None]
    cos, sin = rope_cos_sin(CFG, positions, torch.float32)
    # [B, H, T, Dh] as a transposed view, the layout attention hands over.
    q = torch.randn(1, num_tokens, 4, CFG.head_dim).transpose(1, 2)
    got = _value_and_grads(lambda x: compiled(apply_rope)(x, cos, sin), q)
    half = CFG.head_dim // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:  # the rotation written out per pair (i, i + half)
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[..., :half], sin[..., :half]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    want = _value_and_grads(rotate, q)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_compiled_model_matches_plain_model_forward_and_backward():
    torch.manual_seed(0)
    plain = build_model(CFG)
    fused = build_model(CFG)
    fused.load_state_dict(plain.state_dict())
    fused.compile_elementwise()
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert all(m.use_compiled for m in fused.modules() if hasattr(m, "use_compiled"))
    for lengths in ([5, 9, 3], [17, 4]):  # two packed rows of different lengths: no recompile needed, same results
        tokens = torch.randint(0, CFG.vocab_size, (1, sum(lengths)))
        segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        targets = torch.roll(tokens, -1, dims=1)
        results = []
        for model in (plain, fused):
            model.zero_grad()
            logprobs, _ = model.token_logprobs(model(tokens, segment_ids=segment_ids), targets)
            logprobs.sum().backward()
            results.append((logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        torch.testing.assert_close(results[1][0], results[0][0], **TOL)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(results[1][1][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "data",
    [
        {"compile": True, "num_ranks": 2, "parallelism": {"tensor_parallel_degree": 2}},
        {"compile": True, "device": "tpu"},
    ],
)
def test_compile_is_refused_where_it_cannot_run(data: dict) -> None:
    with pytest.raises(ConfigError, match="compile = true is supported on 'cpu' and 'cuda'"):
        validate_config(TrainerConfig, data)
    assert validate_config(TrainerConfig, {"compile": True}).compile
