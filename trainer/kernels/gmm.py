"""Grouped matmul for MoE experts as the PyTorch op ``rl_align::gmm`` (backward: ``rl_align::gmm_backward``).

The kernels (megablox ``gmm`` forward and ``dx``, our Pallas kernel for ``dw``) are in
:mod:`trainer.kernels.gmm_kernel`. Torch reference: :func:`trainer.kernels.gmm_reference.gmm_reference`.
"""

from __future__ import annotations

import functools

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

__all__ = ["FLAG", "check_supported", "gmm"]

FLAG = 'moe_experts = "gmm_pallas"'
_ALTERNATIVE = 'moe_experts = "torch" (per-expert torch matmuls)'


def check_supported(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless the grouped matmul can run on ``device`` (cpu: interpret mode; tpu: torch-tpu)."""
    check_kernel_device(device, flag=FLAG, alternative=_ALTERNATIVE)


# Interpret mode pays per grid step, so CPU takes the largest tiles; TPU tiles must fit VMEM.
_CPU_TILING = GmmTiling(tile_m=1024, tile_k=4096, tile_n=4096)
_TPU_TILING = GmmTiling()


@torch.library.custom_op("rl_align::gmm", mutates_args=())
def _gmm_op(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    check_supported(x.device)
    args = (torch_to_jax(x), torch_to_jax(w), torch_to_jax(group_sizes))
    return jax_to_torch(gmm_forward_jax(*args, tiling=_CPU_TILING, interpret=True))


@_gmm_op.register_fake
def _gmm_fake(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("rl_align::gmm_backward", mutates_args=())
def _gmm_backward_op(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_supported(x.device)
    args = (torch_to_jax(x), torch_to_jax(w), torch_to_jax(group_sizes), torch_to_jax(grad_out))
    dx, dw = gmm_backward_jax(*args, tiling=_CPU_TILING, interpret=True)
    return jax_to_torch(dx), jax_to_torch(dw)


@_gmm_backward_op.register_fake
def _gmm_backward_fake(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple:
    x, w, group_sizes = ctx.saved_tensors
    dx, dw = _gmm_backward_op(x, w, group_sizes, grad_out.to(x.dtype).contiguous())
    return dx, dw, None


_gmm_op.register_autograd(_backward, setup_context=_setup_context)


def _gmm_tpu(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    op = tpu_jax_op(
        "rl_align_tpu::gmm", lambda: functools.partial(gmm_forward_jax, tiling=_TPU_TILING, interpret=False)
    )
    return op(x, w, group_sizes)


def _gmm_backward_tpu(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    op = tpu_jax_op(
        "rl_align_tpu::gmm_backward",
        lambda: functools.partial(gmm_backward_jax, tiling=_TPU_TILING, interpret=False),
    )
    return op(x, w, group_sizes, grad_out)


register_tpu_kernel(_gmm_op, _gmm_tpu)
register_tpu_kernel(_gmm_backward_op, _gmm_backward_tpu)


def gmm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Grouped matmul: ``out[rows of expert e] = x[rows of expert e] @ w[e]``; differentiable wrt ``x`` and ``w``.

    Shapes: ``x [M, K]`` sorted by expert, ``w [E, K, N]`` (same dtype), ``group_sizes [E]`` integer with
    ``sum(group_sizes) == M`` (not checked here: that would sync the device; rows past the sum come back undefined).
    Returns ``[M, N]`` in ``x``'s dtype. Raises ``ValueError`` on a device without a Pallas path (see
    :func:`check_supported`) or on inconsistent shapes.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, K] and w [E, K, N]; got {tuple(x.shape)}, {tuple(w.shape)}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must be [E] = [{w.shape[0]}]; got {tuple(group_sizes.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype}, {w.dtype}")
    return _gmm_op(x, w, int32_tensor(group_sizes))
