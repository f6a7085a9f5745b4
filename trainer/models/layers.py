"""Small building blocks shared by every family: RMSNorm and the dense SwiGLU feed-forward, plus their elementwise
ops as plain functions and, opt-in, ``torch.compile``-d copies of them.

Op by op, eager PyTorch runs RMSNorm and RoPE as chains of elementwise kernels, each a full pass over memory in
forward and more in backward, each keeping its own intermediate for autograd. :func:`rms_norm` and
:func:`trainer.models.rope.apply_rope` are therefore autograd Functions with their backward written out: fewer
passes, buffers reused in place, only the inputs kept (on a small model's CPU step these ops take about as long as the
matmuls). SwiGLU's op-by-op graph is already minimal (``silu``, ``mul``; their two backward kernels).

Inductor fuses each of these ops into one or two loops; ``trainer.compile`` runs their compiled copies. Only these
functions are compiled, not whole blocks: the attention kernel loops over packed segments of data-dependent lengths,
and FSDP2's hooks stay eager. Each compiled op is shared by every layer and compiled once per dtype and grad mode
(``dynamic=True``: any token count, no recompiles); :meth:`trainer.models.transformer.Transformer.compile_elementwise`
switches a model over (every module with a ``use_compiled`` flag: RMSNorm and FeedForward here;
``compiled(apply_rope)`` is parity-tested for attention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["FeedForward", "RMSNorm", "compiled", "rms_norm", "swiglu"]

_Fn = TypeVar("_Fn", bound=Callable[..., torch.Tensor])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in float32 (or ``x``'s dtype if wider) and cast back before the
    scale (as HF does): ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``. Differentiable in ``x`` and ``weight``."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """:func:`rms_norm` with its backward written out: it keeps ``x`` and the per-row ``1 / rms`` only (autograd of the
    plain expression keeps the normed copy too) and makes about half the passes over memory that the op-by-op graph
    makes, reusing its buffers in place."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: ANN001 (autograd signature)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        # HF's ops in HF's order: in float32 the forward equals Qwen3RMSNorm / LlamaRMSNorm bitwise.
        rstd = x32.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
        normed = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        if normed.dtype == torch.promote_types(normed.dtype, weight.dtype):
            return normed.mul_(weight)
        return normed * weight

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable: a double backward gets a clear error
    def backward(ctx, grad_out):  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        need_x, need_weight, _ = ctx.needs_input_grad
        xhat = x.to(rstd.dtype) * rstd
        grad_weight = None
        if need_weight:
            leading = tuple(range(grad_out.dim() - weight.dim()))
            grad_weight = (grad_out * xhat.to(x.dtype)).sum(leading).to(weight.dtype)
        if not need_x:
            return None, grad_weight, None
        # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat)), with g the gradient at the normed value.
        g = (grad_out * weight).to(rstd.dtype)
        coef = (g * xhat).sum(-1, keepdim=True).mul_(rstd).div_(x.shape[-1])
        grad_x = g.mul_(rstd).addcmul_(xhat, coef, value=-1)
        return grad_x.to(x.dtype), grad_weight, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation ``silu(gate) * up``."""
    return F.silu(gate) * up


@functools.cache
def compiled(fn: _Fn) -> _Fn:
    """``fn`` compiled by inductor for any input shape; one shared compiled function per ``fn`` per process.

    Compilation happens on the first call (needs a C++ compiler on CPU) and takes a few seconds per op.
    """
    return torch.compile(fn, dynamic=True)  # type: ignore[return-value]  # stub: a new Callable, same signature as fn


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned scale; ``use_compiled`` picks its compiled copy (same math)."""

    def __init__(self, dim: int, eps: float, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.use_compiled = False
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (compiled(rms_norm) if self.use_compiled else rms_norm)(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (HF gate_proj = w1, up_proj = w3, down_proj = w2); ``use_compiled`` as in
    :class:`RMSNorm`."""

    def __init__(self, dim: int, hidden_dim: int, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.use_compiled = False
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = compiled(swiglu) if self.use_compiled else swiglu
        return self.w2(act(self.w1(x), self.w3(x)))

    def init_weights(self, std: float) -> None:
        for lin in (self.w1, self.w3, self.w2):
            nn.init.normal_(lin.weight, std=std)
