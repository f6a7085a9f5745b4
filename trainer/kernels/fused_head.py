"""Fused output head as the PyTorch op ``rl_align::fused_head_logprobs``: target log-probs and entropy, no logits.

The kernels are in :mod:`trainer.kernels.fused_head_kernel`. The forward op also returns the per-row log-sum-exp
(differentiable like the other two outputs), which autograd saves so the backward op
(``rl_align::fused_head_logprobs_backward``) only recomputes logits tile by tile.
Torch reference: :func:`trainer.kernels.head_reference.head_logprobs_reference` (same signature and semantics).
Importing this module registers :func:`fused_head_block` as the model's ``output_head = "fused_pallas"`` block.
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
from trainer.kernels.fused_head_kernel import HeadBlockSizes, fused_head_backward_jax, fused_head_forward_jax
from trainer.models.registry import OUTPUT_HEADS

__all__ = ["check_supported", "fused_head_block", "fused_head_logprobs"]

_TPU_BLOCKS = HeadBlockSizes(block_tokens=256, block_vocab=512)


def _cpu_blocks(num_tokens: int, vocab_size: int) -> HeadBlockSizes:
    # Interpret mode pays per grid step (it carries whole operands through a loop) and pads every operand to whole
    # blocks (a copy of the weight when the vocab tile does not divide V). TPU tile rules do not apply here, so take
    # few, large tiles: all tokens up to 1024, and the divisor of V nearest 2048 (2048 with padding if none is near).
    divisors = [b for b in range(512, 4097) if vocab_size % b == 0]
    block_vocab = min(divisors, key=lambda b: abs(b - 2048)) if divisors else 2048
    return HeadBlockSizes(block_tokens=min(1024, -(-num_tokens // 8) * 8), block_vocab=block_vocab)


def check_supported(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless the fused head can run on ``device`` (cpu: interpret mode; tpu: torch-tpu)."""
    check_kernel_device(device, OUTPUT_HEADS, "fused_pallas")


@torch.library.custom_op("rl_align::fused_head_logprobs", mutates_args=())
def _head_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_supported(hidden.device)
    blocks = _cpu_blocks(hidden.shape[0], weight.shape[0])
    args = (torch_to_jax(hidden), torch_to_jax(weight), torch_to_jax(targets))
    logprobs, entropy, lse = fused_head_forward_jax(*args, blocks=blocks, interpret=True)
    return jax_to_torch(logprobs), jax_to_torch(entropy), jax_to_torch(lse)


@_head_op.register_fake
def _head_fake(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    row = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return row, torch.empty_like(row), torch.empty_like(row)


@torch.library.custom_op("rl_align::fused_head_logprobs_backward", mutates_args=())
def _head_backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, grad_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    check_supported(hidden.device)
    args = [torch_to_jax(t) for t in (hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, grad_lse)]
    dh, dw = fused_head_backward_jax(*args, blocks=_cpu_blocks(hidden.shape[0], weight.shape[0]), interpret=True)
    return jax_to_torch(dh), jax_to_torch(dw)


@_head_backward_op.register_fake
def _head_backward_fake(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, grad_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(hidden), torch.empty_like(weight)


class _HeadCtx(Protocol):
    """The autograd context of ``rl_align::fused_head_logprobs``: what :func:`_setup_context` stores for
    :func:`_backward`."""

    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


def _setup_context(ctx: _HeadCtx, inputs: tuple, output: tuple) -> None:
    hidden, weight, targets = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)


def _backward(
    ctx: _HeadCtx,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
) -> tuple:
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    grads = [
        torch.zeros_like(lse) if g is None else g.float().contiguous() for g in (grad_logprobs, grad_entropy, grad_lse)
    ]
    dh, dw = _head_backward_op(hidden, weight, targets, lse, entropy, *grads)
    return dh, dw, None


_head_op.register_autograd(_backward, setup_context=_setup_context)


def _head_tpu(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = tpu_jax_op(
        "rl_align_tpu::fused_head_logprobs",
        lambda: functools.partial(fused_head_forward_jax, blocks=_TPU_BLOCKS, interpret=False),
    )
    return op(hidden, weight, targets)


def _head_backward_tpu(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor, grad_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    op = tpu_jax_op(
        "rl_align_tpu::fused_head_logprobs_backward",
        lambda: functools.partial(fused_head_backward_jax, blocks=_TPU_BLOCKS, interpret=False),
    )
    return op(hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, grad_lse)


register_tpu_kernel(_head_op, _head_tpu)
register_tpu_kernel(_head_backward_op, _head_backward_tpu)


def fused_head_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the softmax entropy under ``hidden @ weight.T``, without ``[N, V]`` logits.

    Shapes: ``hidden [N, D]``, ``weight [V, D]`` (same dtype), ``targets [N]`` integer in ``[0, V)``. Returns float32
    ``(logprobs [N], entropy [N])``; differentiable wrt ``hidden`` and ``weight``. A target outside ``[0, V)`` is not
    checked (it would cost a device sync) and reads as logit 0. Raises ``ValueError`` on a device without a Pallas path
    (see :func:`check_supported`) or on inconsistent shapes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, D] and weight [V, D]; got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype; got {hidden.dtype}, {weight.dtype}")
    logprobs, entropy, _ = _head_op(hidden, weight, int32_tensor(targets))
    return logprobs, entropy


def fused_head_block(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's output-head contract (``trainer.models.registry``) over :func:`fused_head_logprobs`.

    ``hidden [..., D]``, ``targets [...]``; ``chunk_size`` is ignored (the kernel tiles tokens and vocabulary itself).
    """
    del chunk_size
    logprobs, entropy = fused_head_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1))
    # Fresh tensors in the targets' shape, not views: an FSDP root method must not return views.
    shape = targets.shape
    return logprobs.reshape(shape).clone(), entropy.reshape(shape).clone()


OUTPUT_HEADS.register("fused_pallas", fused_head_block, check_supported=check_supported)
