"""Grouped matmul for MoE experts: parity with per-expert torch matmuls (fp32: atol 2e-5, rtol 1e-5), empty experts,
weights stored ``[E, K, N]`` or ``[E, N, K]`` (``transpose_rhs``), opcheck, TPU lowering. The op-level tests share
one shape; the kernel-level test uses 128-row tiles so groups straddle tiles and every visit pattern of the
expert-gradient kernel runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from trainer.kernels.gmm import gmm
from trainer.kernels.gmm_kernel import GmmTiling, gmm_jax
from trainer.kernels.gmm_reference import gmm_reference

ATOL, RTOL = 2e-5, 1e-5
GROUP_SIZES = [30, 0, 50, 20]  # expert 1 gets no tokens


def _inputs(group_sizes: list[int], k: int = 64, n: int = 96, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(group_sizes), k, generator=gen, requires_grad=True)
    w = (0.3 * torch.randn(len(group_sizes), k, n, generator=gen)).requires_grad_()
    return x, w, torch.tensor(group_sizes)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w-EKN", "w-ENK"])
def test_forward_and_backward_match_reference(transpose_rhs: bool) -> None:
    x, w, group_sizes = _inputs(GROUP_SIZES)
    if transpose_rhs:  # the same matrices stored [E, N, K] (stacked nn.Linear weights)
        w = w.detach().transpose(1, 2).contiguous().requires_grad_()
    out = gmm(x, w, group_sizes, transpose_rhs=transpose_rhs)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w), grad)
    ref = gmm_reference(x, w.transpose(1, 2) if transpose_rhs else w, group_sizes)
    ref_grads = torch.autograd.grad(ref, (x, w), grad)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert torch.count_nonzero(grads[1][1]) == 0  # the expert without tokens gets an exact zero gradient


@pytest.mark.parametrize(
    ("group_sizes", "transpose_rhs"),
    [
        ([70, 0, 130, 0, 100], False),
        pytest.param([70, 0, 130, 0, 100], True, marks=pytest.mark.slow),
        pytest.param([0, 0, 300, 0, 0], False, marks=pytest.mark.slow),
    ],
    ids=["straddling-and-empty", "straddling-and-empty-w-ENK", "one-expert"],
)
def test_kernels_with_small_tiles_match_reference(group_sizes: list[int], transpose_rhs: bool) -> None:
    x, w, sizes = _inputs(group_sizes)
    grad = torch.randn(x.shape[0], w.shape[2], generator=torch.Generator().manual_seed(1))
    w_in = w.detach().transpose(1, 2).contiguous() if transpose_rhs else w.detach()
    xj, wj, gj, sj = (jnp.asarray(t.detach().numpy()) for t in (x, w_in, grad, sizes.to(torch.int32)))
    out, vjp = jax.vjp(lambda x, w: gmm_jax(x, w, sj, GmmTiling(128, 128, 128), True, transpose_rhs), xj, wj)
    dx, dw = vjp(gj)
    ref = gmm_reference(x, w, sizes)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), grad)
    ref_dw = ref_dw.transpose(1, 2) if transpose_rhs else ref_dw
    for got, want in ((out, ref), (dx, ref_dx), (dw, ref_dw)):
        torch.testing.assert_close(torch.tensor(np.asarray(got)), want.detach(), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_bfloat16_is_close() -> None:
    x, w, group_sizes = (t.detach() for t in _inputs(GROUP_SIZES))
    out = gmm(x.bfloat16(), w.bfloat16(), group_sizes)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), gmm_reference(x, w, group_sizes), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("transpose_rhs", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["EKN", "ENK"])
def test_opcheck(transpose_rhs: bool) -> None:
    x, w, group_sizes = _inputs(GROUP_SIZES)
    w = w.detach().transpose(1, 2).contiguous().requires_grad_() if transpose_rhs else w
    torch.library.opcheck(torch.ops.rl_align.gmm.default, (x, w, group_sizes.to(torch.int32), transpose_rhs))


def test_bad_shapes_are_refused() -> None:
    x, w, group_sizes = _inputs(GROUP_SIZES)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(x, w, group_sizes[:3])
    with pytest.raises(ValueError, match="w \\[E, K, N\\]"):
        gmm(x, w[:, :8], group_sizes)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w-EKN", "w-ENK"])
def test_lowers_for_tpu_forward_and_backward(transpose_rhs: bool) -> None:
    num_tokens, k, n, experts = 4096, 1024, 2048, 8
    x = jax.ShapeDtypeStruct((num_tokens, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((experts, n, k) if transpose_rhs else (experts, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)

    def step(x, w, sizes):
        out, vjp = jax.vjp(lambda x, w: gmm_jax(x, w, sizes, GmmTiling(), False, transpose_rhs), x, w)
        return out, vjp(out)

    lowered = jax.jit(step).trace(x, w, sizes).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") == 3  # forward, dx, dw
