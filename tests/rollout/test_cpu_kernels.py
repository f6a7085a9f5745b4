"""vLLM's C++ RMSNorm kernels as registered by ``rollout.engine.cpu_kernels``: equal to vLLM's native implementation
(and to the formula in plain torch) on every input shape a model gives them, and dispatched to only where they apply."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from rollout.engine.cpu_kernels import PROVIDER, cpu_norm_priority, register_cpu_norms  # noqa: E402

pytestmark = pytest.mark.skipif(not register_cpu_norms(), reason="needs vLLM's CPU build (its C++ RMSNorm kernels)")

EPS = 1e-6


def _reference(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm in float64: the independent reference."""
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    return (y if weight is None else y * weight.double()).to(x.dtype)


def _ops():
    from vllm import ir

    return ir.ops.rms_norm, ir.ops.fused_add_rms_norm


def _qkv_query_heads(num_tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    """The query of a fused QKV projection viewed per head, as Qwen 3 hands it to its query norm: strided rows."""
    qkv = torch.randn(num_tokens, 2 * heads * head_dim)
    q = qkv.split([heads * head_dim, heads * head_dim], dim=-1)[0]
    view = q.view(num_tokens, heads, head_dim)
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("case", ["rows", "strided-heads", "no-weight", "bfloat16"])
def test_rms_norm_equals_vllms_native_and_the_formula(case):
    rms_norm, _ = _ops()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    x = _qkv_query_heads(37, 4, 32) if case == "strided-heads" else torch.randn(37, 128, dtype=dtype)
    weight = None if case == "no-weight" else torch.randn(x.shape[-1], dtype=dtype)
    ours = rms_norm.impls[PROVIDER].impl_fn(x, weight, EPS)
    native = rms_norm.impls["native"].impl_fn(x, weight, EPS)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert ours.shape == x.shape and ours.dtype == x.dtype
    torch.testing.assert_close(ours, native, **tol)
    torch.testing.assert_close(ours, _reference(x, weight), **tol)


@pytest.mark.parametrize("with_weight", [True, False])
def test_fused_add_rms_norm_updates_both_in_place_like_native(with_weight):
    _, fused = _ops()
    torch.manual_seed(1)
    x, residual = torch.randn(29, 128), torch.randn(29, 128)
    weight = torch.randn(128) if with_weight else None
    want_out, want_residual = fused.impls["native"].impl_fn(x.clone(), residual.clone(), weight, EPS)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = fused.impls[PROVIDER].impl_fn(x_in, residual_in, weight, EPS)
    assert out.data_ptr() == x_in.data_ptr() and new_residual.data_ptr() == residual_in.data_ptr()
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, _reference(x + residual, weight), rtol=1e-5, atol=1e-5)


def test_dispatch_runs_the_kernels_where_they_apply_and_native_elsewhere():
    rms_norm, fused = _ops()
    priority = cpu_norm_priority()
    assert priority == {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]}
    torch.manual_seed(2)
    weight = torch.randn(128)
    with rms_norm.set_priority([PROVIDER, "native"]), fused.set_priority([PROVIDER, "native"]):
        x = torch.randn(8, 128)
        assert rms_norm.dispatch(x, weight, EPS).provider == PROVIDER
        # A weight of another dtype, or a normalised width narrower than the row: the kernel cannot, native does.
        assert rms_norm.dispatch(x, weight.double(), EPS).provider == "native"
        assert rms_norm.dispatch(x, weight, EPS, 64).provider == "native"
        # In-place on a strided input would write into a copy: native takes it, with the same result.
        wide = torch.randn(8, 256)
        strided, residual = wide[:, :128], torch.randn(8, 128)
        assert fused.dispatch(strided, residual, weight, EPS).provider == "native"
        out, new_residual = fused(strided, residual, weight, EPS)
        torch.testing.assert_close(out, _reference(wide[:, :128] + residual, weight), rtol=1e-5, atol=1e-5)
