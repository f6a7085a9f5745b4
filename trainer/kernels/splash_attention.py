"""Splash attention (JAX's block-sparse Pallas TPU flash attention) as the PyTorch op ``rl_align::splash_attention``.

Causal, grouped-query (``Hq % Hkv == 0``) attention over packed sequences: ``segment_ids`` keep each packed sample
attending only to itself. The kernel is ``jax.experimental.pallas.ops.tpu.splash_attention`` (``make_splash_mha``,
vmapped over the batch), whose own ``custom_vjp`` supplies the Pallas backward kernels (dq, dkv). The torch backward
op recomputes the forward inside ``jax.vjp``: one extra forward in exchange for keeping the op's outputs to ``out``.

Splash needs sequence blocks that are multiples of 128, so ``T`` is zero-padded up to one. Padding sits after every
real position, so causality already hides it from real queries; padded queries get their own segment id (-1).

Torch reference: :func:`trainer.kernels.attention_reference.attention_reference` (same signature and semantics).
Importing this module registers :func:`splash_attention_block` as the model's ``attention = "splash"`` block.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import torch
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from trainer.kernels.bridge import (
    check_kernel_device,
    float_tag,
    int32_tensor,
    jax_to_torch,
    register_tpu_kernel,
    torch_to_jax,
    tpu_jax_op,
)
from trainer.kernels.tpu_layout import LANES
from trainer.models.registry import ATTENTION_BLOCKS

__all__ = ["check_supported", "splash_attention", "splash_attention_block", "splash_attention_jax"]

_PAD_SEGMENT = -1


def check_supported(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless splash attention can run on ``device`` (cpu: interpret mode; tpu: torch-tpu)."""
    check_kernel_device(device, ATTENTION_BLOCKS, "splash")


def _block_size(padded_len: int) -> int:
    return next(b for b in (512, 256, LANES) if padded_len % b == 0)


@functools.cache
def _make_kernel(num_q_heads: int, padded_len: int, interpret: bool) -> Any:
    """The splash kernel (a ``SplashAttentionKernel``) for causal masks on every head, cached per shape."""
    block = _block_size(padded_len)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    mask = splash.MultiHeadMask([splash.CausalMask((padded_len, padded_len)) for _ in range(num_q_heads)])
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def splash_attention_jax(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, scale: float, interpret: bool
) -> jax.Array:
    """JAX entry point: same contract as :func:`splash_attention`; differentiable (splash's custom_vjp)."""
    seq_len = q.shape[2]
    pad = -seq_len % LANES
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=_PAD_SEGMENT)
    with jax.ensure_compile_time_eval():  # the cached kernel holds concrete mask arrays, never tracers
        kernel = _make_kernel(q.shape[1], seq_len + pad, interpret)

    def one_sample(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        ids = None if seg is None else splash.SegmentIds(q=seg, kv=seg)
        return kernel((q * scale).astype(q.dtype), k, v, segment_ids=ids)

    return jax.vmap(one_sample)(q, k, v, segment_ids)[:, :, :seq_len]


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _splash_attention_vjp(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, grad_out: jax.Array, *,
    scale: float, interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return splash_attention_jax(q, k, v, segment_ids, scale=scale, interpret=interpret)

    return jax.vjp(forward, q, k, v)[1](grad_out)


def _to_jax(*tensors: torch.Tensor | None) -> list[jax.Array | None]:
    return [None if t is None else torch_to_jax(t) for t in tensors]


@torch.library.custom_op("rl_align::splash_attention", mutates_args=())
def _splash_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, scale: float
) -> torch.Tensor:
    check_supported(q.device)
    return jax_to_torch(splash_attention_jax(*_to_jax(q, k, v, segment_ids), scale=scale, interpret=True))


@_splash_op.register_fake
def _splash_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("rl_align::splash_attention_backward", mutates_args=())
def _splash_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, grad_out: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    check_supported(q.device)
    dq, dk, dv = _splash_attention_vjp(*_to_jax(q, k, v, segment_ids, grad_out), scale=scale, interpret=True)
    return jax_to_torch(dq), jax_to_torch(dk), jax_to_torch(dv)


@_splash_backward_op.register_fake
def _splash_backward_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, grad_out: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _SplashCtx(Protocol):
    """The autograd context of ``rl_align::splash_attention``: what :func:`_setup_context` stores for
    :func:`_backward` (a saved ``None`` comes back as ``None``)."""

    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
    scale: float

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...


def _setup_context(ctx: _SplashCtx, inputs: tuple, output: torch.Tensor) -> None:
    q, k, v, segment_ids, scale = inputs
    ctx.save_for_backward(q, k, v, segment_ids)
    ctx.scale = scale


def _backward(ctx: _SplashCtx, grad_out: torch.Tensor) -> tuple:
    q, k, v, segment_ids = ctx.saved_tensors
    dq, dk, dv = _splash_backward_op(q, k, v, segment_ids, grad_out.contiguous(), ctx.scale)
    return dq, dk, dv, None, None


_splash_op.register_autograd(_backward, setup_context=_setup_context)


def _segments_or_zeros(q: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    # torch-tpu's jax_op takes tensors only; one segment for everything is the same as no segment ids.
    if segment_ids is not None:
        return segment_ids
    return torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32, device=q.device)


def _splash_tpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, scale: float
) -> torch.Tensor:
    op = tpu_jax_op(
        f"rl_align_tpu::splash_attention_s{float_tag(scale)}",
        lambda: functools.partial(splash_attention_jax, scale=scale, interpret=False),
    )
    return op(q, k, v, _segments_or_zeros(q, segment_ids))


def _splash_backward_tpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, grad_out: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    op = tpu_jax_op(
        f"rl_align_tpu::splash_attention_backward_s{float_tag(scale)}",
        lambda: functools.partial(_splash_attention_vjp, scale=scale, interpret=False),
    )
    return op(q, k, v, _segments_or_zeros(q, segment_ids), grad_out)


register_tpu_kernel(_splash_op, _splash_tpu)
register_tpu_kernel(_splash_backward_op, _splash_backward_tpu)


def splash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention over packed segments with the splash Pallas kernel; differentiable wrt ``q``, ``k``, ``v``.

    Shapes: ``q [B, Hq, T, D]``, ``k`` and ``v [B, Hkv, T, D]`` (``Hq % Hkv == 0``; query head ``h`` reads kv head
    ``h // (Hq // Hkv)``), ``segment_ids [B, T]`` (any integer dtype) or ``None``. Position ``i`` attends to ``j <= i``
    within its segment; ``scale`` multiplies the scores. Returns ``[B, Hq, T, D]`` in ``q``'s dtype. Raises
    ``ValueError`` on a device without a Pallas path (see :func:`check_supported`) or on inconsistent shapes.
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, T, D] and k, v [B, Hkv, T, D]; got {q.shape}, {k.shape}, {v.shape}")
    batch, num_q_heads, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim) or num_q_heads % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (need Hq % Hkv == 0, same B, T, D)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None:
        if segment_ids.shape != (batch, seq_len):
            raise ValueError(f"segment_ids must be [B, T] = {(batch, seq_len)}; got {tuple(segment_ids.shape)}")
        segment_ids = int32_tensor(segment_ids)
    return _splash_op(q, k, v, segment_ids, float(scale))


def splash_attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_ids: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The model's attention-block contract (``trainer.models.registry``) over :func:`splash_attention`."""
    return splash_attention(q, k, v, segment_ids, scale)


ATTENTION_BLOCKS.register("splash", splash_attention_block, check_supported=check_supported)
