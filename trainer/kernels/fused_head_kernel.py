"""Pallas kernels for the fused output head: log-prob of the target token and softmax entropy, never forming logits.

For hidden states ``h [N, D]`` and the output projection ``W [V, D]``, with ``z = h @ W.T`` (never materialized):

- forward: ``logprob = z[t] - lse`` and ``entropy = lse - E`` where ``lse = logsumexp(z)`` and ``E = sum(softmax(z)
  * z)``. One pass over vocabulary blocks keeps a running max ``m``, ``l = sum exp(z - m)``, ``s = sum exp(z - m) * z``
  and the target logit per row (the online log-sum-exp of flash attention).
- backward: with ``p = exp(z - lse)``, ``dz = g_lp * onehot(t) - p * (g_lp - g_lse + g_ent * (z - E))`` (``g_lse``:
  the cotangent of ``lse``, which the forward also returns); ``dh = dz @ W`` and ``dW = dz.T @ h``, each its own
  kernel that recomputes ``z`` block by block from the saved ``lse`` and ``E``.

Peak extra memory is one ``[block_tokens, block_vocab]`` tile per core plus ``O(N)`` row statistics. Per-row statistics
are kept lane-replicated (``[rows, 128]``), the layout TPU vector registers hold natively. Tokens are padded up to
``block_tokens`` (a copy of ``h`` only); the vocabulary is never padded (that would copy ``W``): the last vocabulary
block is masked instead. Matmuls accumulate in float32; outputs are float32, gradients take the input dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trainer.kernels.tpu_layout import LANES

__all__ = ["HeadBlockSizes", "fused_head_backward_jax", "fused_head_forward_jax", "fused_head_jax"]

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_Semantics = Literal["parallel", "arbitrary"]  # Mosaic grid dimension semantics (pltpu.CompilerParams)


@dataclasses.dataclass(frozen=True)
class HeadBlockSizes:
    """Tile sizes: rows of ``h`` per block and vocabulary rows of ``W`` per block (multiples of 128 on TPU)."""

    block_tokens: int = 256
    block_vocab: int = 512


def _logits(h_ref: jax.Ref, w_ref: jax.Ref, vocab_block: jax.Array, vocab_size: int, block_vocab: int) -> tuple:
    """This tile's float32 logits and the mask of its real vocabulary columns (``None`` when all are real)."""
    z = lax.dot_general(h_ref[...], w_ref[...], _NT, preferred_element_type=jnp.float32)
    cols = vocab_block * block_vocab + lax.broadcasted_iota(jnp.int32, z.shape, 1)
    valid = None if vocab_size % block_vocab == 0 else cols < vocab_size
    return z, cols, valid


def _forward_kernel(h_ref, w_ref, tgt_ref, lp_ref, ent_ref, lse_ref, m_sc, l_sc, s_sc, t_sc, *, vocab_size,
                    block_vocab):  # fmt: skip
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
        t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)

    z, cols, valid = _logits(h_ref, w_ref, j, vocab_size, block_vocab)
    z_or_0 = z if valid is None else jnp.where(valid, z, 0.0)
    if valid is not None:
        z = jnp.where(valid, z, -jnp.inf)
    m_prev = m_sc[:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(z - m_new)
    l_new = alpha * l_sc[:, :1] + jnp.sum(p, axis=1, keepdims=True)
    s_new = alpha * s_sc[:, :1] + jnp.sum(p * z_or_0, axis=1, keepdims=True)
    t_new = t_sc[:, :1] + jnp.sum(jnp.where(cols == tgt_ref[:, :1], z_or_0, 0.0), axis=1, keepdims=True)
    m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
    l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)
    s_sc[...] = jnp.broadcast_to(s_new, s_sc.shape)
    t_sc[...] = jnp.broadcast_to(t_new, t_sc.shape)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish() -> None:
        lse = m_new + jnp.log(l_new)
        lp_ref[...] = jnp.broadcast_to(t_new - lse, lp_ref.shape)
        ent_ref[...] = jnp.broadcast_to(lse - s_new / l_new, ent_ref.shape)
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _dlogits(z, cols, valid, tgt, lse, mean_z, g_lp, g_p, g_ent):
    """``d(g_lp . logprob + g_ent . entropy + g_lse . lse) / dz`` for one tile (``g_p = g_lp - g_lse``); zero on
    masked vocabulary columns."""
    p = jnp.exp(z - lse)
    dz = jnp.where(cols == tgt, g_lp, 0.0) - p * (g_p + g_ent * (z - mean_z))
    return dz if valid is None else jnp.where(valid, dz, 0.0)


def _row_stats(*refs: jax.Ref) -> tuple:
    return tuple(ref[:, :1] for ref in refs)


def _dhidden_kernel(h_ref, w_ref, *refs, vocab_size, block_vocab):
    *row_refs, dh_ref, acc = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init() -> None:
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    z, cols, valid = _logits(h_ref, w_ref, j, vocab_size, block_vocab)
    dz = _dlogits(z, cols, valid, *_row_stats(*row_refs))
    w = w_ref[...]
    if valid is not None:  # rows past the vocabulary hold whatever was in memory, maybe NaN: 0 * NaN is NaN
        row = j * block_vocab + lax.broadcasted_iota(jnp.int32, w.shape, 0)
        w = jnp.where(row < vocab_size, w, jnp.zeros_like(w))
    acc[...] += lax.dot_general(dz.astype(w.dtype), w, _NN, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish() -> None:
        dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dweight_kernel(h_ref, w_ref, *refs, vocab_size, block_vocab):
    *row_refs, dw_ref, acc = refs
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init() -> None:
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    z, cols, valid = _logits(h_ref, w_ref, j, vocab_size, block_vocab)
    dz = _dlogits(z, cols, valid, *_row_stats(*row_refs))
    h = h_ref[...]
    acc[...] += lax.dot_general(dz.T.astype(h.dtype), h, _NN, preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish() -> None:
        dw_ref[...] = acc[...].astype(dw_ref.dtype)


def _lanes(x: jax.Array) -> jax.Array:
    """``[N]`` -> lane-replicated ``[N, 128]``."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], LANES))


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _params(interpret: bool, semantics: tuple[_Semantics, _Semantics]) -> dict:
    return {"interpret": interpret, "compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def fused_head_forward_jax(
    hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, blocks: HeadBlockSizes, interpret: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Float32 ``(logprobs [N], entropy [N], lse [N])`` for ``hidden [N, D]``, ``weight [V, D]``, int32 ``targets``."""
    (num_tokens, dim), vocab_size = hidden.shape, weight.shape[0]
    bn, bv = blocks.block_tokens, blocks.block_vocab
    padded = pl.cdiv(num_tokens, bn) * bn
    row_spec = pl.BlockSpec((bn, LANES), lambda i, j: (i, 0))
    stat = jax.ShapeDtypeStruct((padded, LANES), jnp.float32)
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, vocab_size=vocab_size, block_vocab=bv),
        grid=(padded // bn, pl.cdiv(vocab_size, bv)),
        in_specs=[
            pl.BlockSpec((bn, dim), lambda i, j: (i, 0)),
            pl.BlockSpec((bv, dim), lambda i, j: (j, 0)),
            row_spec,
        ],
        out_specs=[row_spec, row_spec, row_spec],
        out_shape=[stat, stat, stat],
        scratch_shapes=[pltpu.VMEM((bn, LANES), jnp.float32) for _ in range(4)],
        **_params(interpret, ("parallel", "arbitrary")),
    )(_pad_rows(hidden, padded), weight, _lanes(_pad_rows(targets, padded)))
    return tuple(o[:num_tokens, 0] for o in outs)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def fused_head_backward_jax(
    hidden: jax.Array, weight: jax.Array, targets: jax.Array, lse: jax.Array, entropy: jax.Array,
    grad_logprobs: jax.Array, grad_entropy: jax.Array, grad_lse: jax.Array, *, blocks: HeadBlockSizes, interpret: bool,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(d hidden, d weight)`` of ``sum(grad_logprobs * logprobs + grad_entropy * entropy + grad_lse * lse)``.

    ``lse`` and ``entropy`` are the forward's outputs (saved residuals); all row vectors are float32 ``[N]``.
    """
    (num_tokens, dim), vocab_size = hidden.shape, weight.shape[0]
    bn, bv = blocks.block_tokens, blocks.block_vocab
    padded = pl.cdiv(num_tokens, bn) * bn
    # Padded rows: zero hidden and zero cotangents, so their dz is exactly zero and adds nothing to dW.
    row_stats = (targets, lse, lse - entropy, grad_logprobs, grad_logprobs - grad_lse, grad_entropy)
    rows = [_lanes(_pad_rows(x, padded)) for x in row_stats]
    h = _pad_rows(hidden, padded)
    kernel_args = dict(vocab_size=vocab_size, block_vocab=bv)
    num_row_blocks, num_vocab_blocks = padded // bn, pl.cdiv(vocab_size, bv)

    row_spec = pl.BlockSpec((bn, LANES), lambda i, j: (i, 0))
    dh = pl.pallas_call(
        functools.partial(_dhidden_kernel, **kernel_args),
        grid=(num_row_blocks, num_vocab_blocks),
        in_specs=[pl.BlockSpec((bn, dim), lambda i, j: (i, 0)), pl.BlockSpec((bv, dim), lambda i, j: (j, 0))]
        + [row_spec] * len(rows),
        out_specs=pl.BlockSpec((bn, dim), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, dim), hidden.dtype),
        scratch_shapes=[pltpu.VMEM((bn, dim), jnp.float32)],
        **_params(interpret, ("parallel", "arbitrary")),
    )(h, weight, *rows)

    row_spec_t = pl.BlockSpec((bn, LANES), lambda j, i: (i, 0))
    dw = pl.pallas_call(
        functools.partial(_dweight_kernel, **kernel_args),
        grid=(num_vocab_blocks, num_row_blocks),
        in_specs=[pl.BlockSpec((bn, dim), lambda j, i: (i, 0)), pl.BlockSpec((bv, dim), lambda j, i: (j, 0))]
        + [row_spec_t] * len(rows),
        out_specs=pl.BlockSpec((bv, dim), lambda j, i: (j, 0)),
        out_shape=jax.ShapeDtypeStruct(weight.shape, weight.dtype),
        scratch_shapes=[pltpu.VMEM((bv, dim), jnp.float32)],
        **_params(interpret, ("parallel", "arbitrary")),
    )(h, weight, *rows)
    return dh[:num_tokens], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fused_head_jax(
    hidden: jax.Array, weight: jax.Array, targets: jax.Array, blocks: HeadBlockSizes, interpret: bool
) -> tuple[jax.Array, jax.Array]:
    """Differentiable JAX entry point: ``(logprobs [N], entropy [N])``, float32; no gradient flows to ``targets``."""
    logprobs, entropy, _ = fused_head_forward_jax(hidden, weight, targets, blocks=blocks, interpret=interpret)
    return logprobs, entropy


def _fused_head_fwd(hidden, weight, targets, blocks, interpret):
    logprobs, entropy, lse = fused_head_forward_jax(hidden, weight, targets, blocks=blocks, interpret=interpret)
    return (logprobs, entropy), (hidden, weight, targets, lse, entropy)


def _fused_head_bwd(blocks, interpret, residuals, cotangents):
    hidden, weight, targets, lse, entropy = residuals
    grad_logprobs, grad_entropy = cotangents
    dh, dw = fused_head_backward_jax(
        hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, jnp.zeros_like(lse),
        blocks=blocks, interpret=interpret,
    )
    return dh, dw, None


fused_head_jax.defvjp(_fused_head_fwd, _fused_head_bwd)
