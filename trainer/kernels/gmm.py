"""Grouped matmul for MoE experts as the PyTorch op ``rl_align::gmm`` (backward: ``rl_align::gmm_backward``).

The kernels (megablox ``gmm`` forward and ``dx``, our Pallas kernel for ``dw``) are in
:mod:`trainer.kernels.gmm_kernel`. Torch reference: :func:`trainer.kernels.gmm_reference.gmm_reference`.
Importing this module registers :func:`gmm_experts` as the model's ``moe_experts = "gmm_pallas"`` block.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from trainer.kernels.bridge import (
    check_kernel_device,
    int32_tensor,
    jax_to_torch,
    register_tpu_kernel,
    torch_to_jax,
    tpu_jax_op,
)
from trainer.kernels.gmm_kernel import GmmTiling, gmm_backward_jax, gmm_forward_jax
from trainer.models.moe import sort_by_expert
from trainer.models.registry import MOE_EXPERTS

__all__ = ["check_supported", "gmm", "gmm_experts"]


def check_supported(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless the grouped matmul can run on ``device`` (cpu: interpret mode; tpu: torch-tpu)."""
    check_kernel_device(device, MOE_EXPERTS, "gmm_pallas")


# Interpret mode pays per grid step, so CPU takes the largest tiles; TPU tiles must fit VMEM.
_CPU_TILING = GmmTiling(tile_m=1024, tile_k=4096, tile_n=4096)
_TPU_TILING = GmmTiling()


@torch.library.custom_op("rl_align::gmm", mutates_args=())
def _gmm_op(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool) -> torch.Tensor:
    check_supported(x.device)
    args = (torch_to_jax(x), torch_to_jax(w), torch_to_jax(group_sizes))
    return jax_to_torch(gmm_forward_jax(*args, tiling=_CPU_TILING, interpret=True, transpose_rhs=transpose_rhs))


@_gmm_op.register_fake
def _gmm_fake(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1 if transpose_rhs else 2])


@torch.library.custom_op("rl_align::gmm_backward", mutates_args=())
def _gmm_backward_op(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, grad_out: torch.Tensor, transpose_rhs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    check_supported(x.device)
    args = (torch_to_jax(x), torch_to_jax(w), torch_to_jax(group_sizes), torch_to_jax(grad_out))
    dx, dw = gmm_backward_jax(*args, tiling=_CPU_TILING, interpret=True, transpose_rhs=transpose_rhs)
    return jax_to_torch(dx), jax_to_torch(dw)


@_gmm_backward_op.register_fake
def _gmm_backward_fake(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, grad_out: torch.Tensor, transpose_rhs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


class _GmmCtx(Protocol):
    """The autograd context of ``rl_align::gmm``: what :func:`_setup_context` stores for :func:`_backward`."""

    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    transpose_rhs: bool

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


def _setup_context(ctx: _GmmCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, w, group_sizes, transpose_rhs = inputs
    ctx.save_for_backward(x, w, group_sizes)
    ctx.transpose_rhs = transpose_rhs


def _backward(ctx: _GmmCtx, grad_out: torch.Tensor) -> tuple:
    x, w, group_sizes = ctx.saved_tensors
    dx, dw = _gmm_backward_op(x, w, group_sizes, grad_out.to(x.dtype).contiguous(), ctx.transpose_rhs)
    return dx, dw, None, None


_gmm_op.register_autograd(_backward, setup_context=_setup_context)


def _gmm_tpu(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool) -> torch.Tensor:
    op = tpu_jax_op(
        f"rl_align_tpu::gmm{'_t' if transpose_rhs else ''}",
        lambda: functools.partial(gmm_forward_jax, tiling=_TPU_TILING, interpret=False, transpose_rhs=transpose_rhs),
    )
    return op(x, w, group_sizes)


def _gmm_backward_tpu(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, grad_out: torch.Tensor, transpose_rhs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    op = tpu_jax_op(
        f"rl_align_tpu::gmm_backward{'_t' if transpose_rhs else ''}",
        lambda: functools.partial(gmm_backward_jax, tiling=_TPU_TILING, interpret=False, transpose_rhs=transpose_rhs),
    )
    return op(x, w, group_sizes, grad_out)


register_tpu_kernel(_gmm_op, _gmm_tpu)
register_tpu_kernel(_gmm_backward_op, _gmm_backward_tpu)


def gmm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, transpose_rhs: bool = False) -> torch.Tensor:
    """Grouped matmul: ``out[rows of expert e] = x[rows of expert e] @ w[e]``; differentiable wrt ``x`` and ``w``.

    Shapes: ``x [M, K]`` sorted by expert, ``w [E, K, N]`` (same dtype), ``group_sizes [E]`` integer with
    ``sum(group_sizes) == M`` (not checked here: that would sync the device; rows past the sum come back undefined).
    With ``transpose_rhs``, ``w`` is ``[E, N, K]`` and the product is ``x_e @ w[e].T`` (stacked ``nn.Linear``
    weights, read without a transposed copy). Returns ``[M, N]`` in ``x``'s dtype. Raises ``ValueError`` on a device
    without a Pallas path (see :func:`check_supported`) or on inconsistent shapes.
    """
    k_dim = 2 if transpose_rhs else 1
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[k_dim]:
        layout = "[E, N, K] (transpose_rhs)" if transpose_rhs else "[E, K, N]"
        raise ValueError(f"expected x [M, K] and w {layout}; got {tuple(x.shape)}, {tuple(w.shape)}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must be [E] = [{w.shape[0]}]; got {tuple(group_sizes.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype}, {w.dtype}")
    return _gmm_op(x, w, int32_tensor(group_sizes), transpose_rhs)


def gmm_experts(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_weight: torch.Tensor,
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The model's MoE-experts contract (``trainer.models.registry``): SwiGLU experts as three :func:`gmm` calls.

    The (token, expert) pairs are sorted by expert exactly as the torch ``grouped`` block sorts them; the stacked
    weights keep the model's ``[E, out, in]`` layout, which the kernel reads as is (``transpose_rhs``).
    """
    pairs = sort_by_expert(expert_idx, w1.shape[0])
    xs = x[pairs.token]
    gate = gmm(xs, w1, pairs.counts, transpose_rhs=True)
    h = torch.nn.functional.silu(gate) * gmm(xs, w3, pairs.counts, transpose_rhs=True)
    return pairs.combine(x, gmm(h, w2, pairs.counts, transpose_rhs=True), expert_weight)


MOE_EXPERTS.register("gmm_pallas", gmm_experts, check_supported=check_supported)
