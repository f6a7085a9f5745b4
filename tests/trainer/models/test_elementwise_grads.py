"""RMSNorm and RoPE run as autograd Functions with hand-written backwards (``trainer.models.layers.rms_norm``,
``trainer.models.rope.apply_rope``). Their values and gradients are checked against HF transformers' own modules
(Qwen 3's ``Qwen3RMSNorm`` and ``apply_rotary_pos_emb``, run through plain autograd) in float32 and bfloat16, and
against finite differences in float64 (``torch.autograd.gradcheck``)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from trainer.models.config import ModelConfig
from trainer.models.layers import rms_norm
from trainer.models.rope import apply_rope, rope_cos_sin

EPS = 1e-6
CFG = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_dim=48,
    qk_norm=True,
)  # fmt: skip


def _hf_norm(weight: torch.Tensor) -> Qwen3RMSNorm:
    norm = Qwen3RMSNorm(weight.shape[0], eps=EPS).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, grad_out)


def _norm_ours_and_hf(
    x: torch.Tensor, w: torch.Tensor, g: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(output, d/dx, d/dw) of :func:`rms_norm` and of HF's module on the same ``x`` (a leaf that requires grad),
    scale ``w`` and output gradient ``g``."""
    hf = _hf_norm(w)
    want = hf(x)
    ours_w = w.clone().requires_grad_(True)
    got = rms_norm(x, ours_w, EPS)
    return (got, *_grads(got, [x, ours_w], g)), (want, *_grads(want, [x, hf.weight], g))


@pytest.mark.parametrize("shape", [(2, 7, 32), (1, 9, 4, 16)])  # hidden states; per-head q/k
def test_rms_norm_matches_hf_in_float32(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    (got, got_dx, got_dw), (want, want_dx, want_dw) = _norm_ours_and_hf(x, torch.randn(shape[-1]), torch.randn(shape))
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same float32 ops in the same order
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dw, want_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_hf_in_bfloat16(weight_dtype: torch.dtype) -> None:
    """Computed in float32 and cast back before the scale; the output in the promoted dtype of input and scale (a
    float32 scale on bfloat16 activations gives float32, as HF's), gradients in the inputs' own dtypes."""
    torch.manual_seed(1)
    x = torch.randn(3, 11, 32, dtype=torch.bfloat16, requires_grad=True)
    out_dtype = torch.promote_types(torch.bfloat16, weight_dtype)
    g = torch.randn(3, 11, 32, dtype=out_dtype)
    (got, got_dx, got_dw), (want, want_dx, want_dw) = _norm_ours_and_hf(x, torch.randn(32, dtype=weight_dtype), g)
    assert (got.dtype, got_dx.dtype, got_dw.dtype) == (out_dtype, torch.bfloat16, weight_dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_dx, want_dx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_dw, want_dw, rtol=2e-2, atol=5e-2)


def test_rms_norm_gradients_match_finite_differences() -> None:
    torch.manual_seed(2)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, EPS), (x, w))


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_rms_norm_with_one_input_frozen(frozen: str) -> None:
    """A frozen scale (LoRA) or a constant input gets no gradient; the other one's equals HF's."""
    torch.manual_seed(3)
    x = torch.randn(4, 6, 16, requires_grad=frozen != "input")
    w = torch.randn(16, requires_grad=frozen != "weight")
    g = torch.randn(4, 6, 16)
    (got,) = _grads(rms_norm(x, w, EPS), [w if frozen == "input" else x], g)
    hf = _hf_norm(w.detach())
    hf.weight.requires_grad_(frozen == "input")
    hf_x = x.detach().clone().requires_grad_(frozen == "weight")
    (want,) = _grads(hf(hf_x), [hf.weight if frozen == "input" else hf_x], g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _hf_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(CFG, positions, q.dtype)  # [B, 1, T, Dh]: HF's unsqueeze_dim=1 layout
    return apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_hf_values_and_gradients(dtype: torch.dtype) -> None:
    """q and k in the layout attention hands over: ``[B, T, H, Dh]`` projections viewed as ``[B, H, T, Dh]``."""
    torch.manual_seed(4)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 7, 8]])
    t = positions.shape[1]
    q = torch.randn(1, t, 4, 16, dtype=dtype).transpose(1, 2).requires_grad_(True)
    k = torch.randn(1, t, 2, 16, dtype=dtype).transpose(1, 2).requires_grad_(True)
    gq, gk = torch.randn(1, 4, t, 16, dtype=dtype), torch.randn(1, 2, t, 16, dtype=dtype)
    want_q, want_k = _hf_rope(q, k, positions)
    want = (want_q, want_k, *torch.autograd.grad((want_q, want_k), (q, k), (gq, gk)))
    cos, sin = rope_cos_sin(CFG, positions, dtype)
    got_q, got_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got = (got_q, got_k, *torch.autograd.grad((got_q, got_k), (q, k), (gq, gk)))
    # float32: addcmul rounds a product and a sum once (fused), HF twice: an ulp apart.
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **tol)


def test_rope_gradients_match_finite_differences() -> None:
    torch.manual_seed(5)
    positions = torch.arange(6)[None]
    cos, sin = rope_cos_sin(CFG, positions, torch.float64)
    x = torch.randn(1, 6, 3, 16, dtype=torch.float64).transpose(1, 2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: apply_rope(a, cos, sin), (x,))


def test_rope_refuses_tables_that_require_gradients() -> None:
    cos, sin = rope_cos_sin(CFG, torch.arange(4)[None], torch.float32)
    with pytest.raises(ValueError, match="tables are constants"):
        apply_rope(torch.randn(1, 2, 4, 16), cos.requires_grad_(True), sin)
