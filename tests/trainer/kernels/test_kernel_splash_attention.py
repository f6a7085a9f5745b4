"""Splash attention: parity with the torch reference (fp32: atol 2e-5, rtol 1e-5), opcheck, and TPU lowering.

Interpret mode compiles each new shape for seconds on CPU, so the default tests share one shape (B=2, Hq=4, Hkv=2,
T=100, D=32) and the other shapes and dtypes are ``slow``.
"""

import jax
import jax.numpy as jnp
import pytest
import torch

from trainer.kernels.attention_reference import attention_reference
from trainer.kernels.splash_attention import splash_attention, splash_attention_jax

ATOL, RTOL = 2e-5, 1e-5


def _inputs(batch: int, q_heads: int, kv_heads: int, seq_len: int, dim: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, seq_len, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_len, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_len, dim, generator=gen, requires_grad=True)
    return q, k, v


def _packed_segments(batch: int, seq_len: int) -> torch.Tensor:
    # Row 0: three packed samples; row 1: one sample then padding-like tail segment.
    cuts = [[0] * 30 + [1] * 45 + [2] * (seq_len - 75), [5] * (seq_len - 10) + [9] * 10]
    return torch.tensor(cuts[:batch], dtype=torch.int64)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "seq_len", "packed"),
    [
        (4, 2, 100, True),
        pytest.param(4, 1, 128, False, marks=pytest.mark.slow),
        pytest.param(2, 2, 130, True, marks=pytest.mark.slow),
    ],
    ids=["gqa-packed-T100", "mqa-causal-T128", "mha-packed-T130"],
)
def test_forward_and_backward_match_reference(q_heads: int, kv_heads: int, seq_len: int, packed: bool) -> None:
    q, k, v = _inputs(2, q_heads, kv_heads, seq_len, 32)
    segments = _packed_segments(2, seq_len) if packed else None
    scale = 32**-0.5
    out = splash_attention(q, k, v, segments, scale)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = attention_reference(q, k, v, segments, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_segments_isolate_packed_samples() -> None:
    q, k, v = _inputs(1, 2, 2, 100, 16)
    segments = torch.tensor([[0] * 40 + [1] * 60])
    out = splash_attention(q, k, v, segments, 0.25)
    # The second sample alone gives the same outputs as inside the pack.
    alone = splash_attention(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:], None, 0.25)
    torch.testing.assert_close(out[:, :, 40:], alone, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_bfloat16_forward_is_close() -> None:
    q, k, v = (x.detach().to(torch.bfloat16) for x in _inputs(1, 4, 2, 128, 32))
    out = splash_attention(q, k, v, None, 0.2)
    ref = attention_reference(q.float(), k.float(), v.float(), None, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


def test_opcheck() -> None:
    q, k, v = _inputs(2, 4, 2, 100, 32)
    segments = _packed_segments(2, 100).to(torch.int32)
    torch.library.opcheck(torch.ops.rl_align.splash_attention.default, (q, k, v, segments, 32**-0.5))


@pytest.mark.slow
def test_opcheck_without_segments() -> None:
    q, k, v = _inputs(1, 2, 1, 128, 16)
    torch.library.opcheck(torch.ops.rl_align.splash_attention.default, (q, k, v, None, 0.25))


def test_bad_shapes_are_refused() -> None:
    q, k, v = _inputs(1, 3, 2, 16, 8)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        splash_attention(q, k, v, None, 1.0)
    q, k, v = _inputs(1, 2, 2, 16, 8)
    with pytest.raises(ValueError, match="segment_ids"):
        splash_attention(q, k, v, torch.zeros(1, 15, dtype=torch.int32), 1.0)


def test_lowers_for_tpu_forward_and_backward() -> None:
    batch, q_heads, kv_heads, seq_len, dim = 2, 8, 2, 2048, 128
    q = jax.ShapeDtypeStruct((batch, q_heads, seq_len, dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, kv_heads, seq_len, dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def step(q, k, v, seg):
        out, vjp = jax.vjp(lambda q, k, v: splash_attention_jax(q, k, v, seg, scale=0.088, interpret=False), q, k, v)
        return out, vjp(out)

    lowered = jax.jit(step).trace(q, kv, kv, seg).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") >= 3  # forward, dq, dkv kernels
