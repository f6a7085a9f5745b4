"""Grouped matmul for MoE experts in JAX/Pallas: forward and both backward products, with a ``custom_vjp``.

Tokens arrive sorted by expert: ``x [M, K]`` holds expert 0's rows, then expert 1's, ... with ``group_sizes [E]``
rows each, and ``w [E, K, N]`` holds one matrix per expert (or ``[E, N, K]`` with ``transpose_rhs``: ``x_e @ w[e].T``,
the ``nn.Linear`` layout of stacked expert weights, read in place instead of transposed in memory).

- forward ``out = x_e @ w[e]`` per group, and ``dx = dout_e @ w[e].T``: megablox ``gmm`` (JAX's Pallas TPU kernel;
  ``transpose_rhs`` flipped for ``dx``).
- ``dw[e] = x_e.T @ dout_e`` (``dout_e.T @ x_e`` with ``transpose_rhs``): our own kernel below. Megablox's ``tgmm``
  computes the same product, but in Pallas interpret mode (jax 0.10.2) it never writes its output (NaN everywhere,
  even for one group), so CPU could not check it. Ours walks the same tile schedule (megablox's
  ``make_group_metadata``: each m-tile visited once per group it overlaps, empty groups visited once so their
  gradient is zeroed) over a static grid of the schedule's maximum length, skipping the unused tail, which interpret
  mode and Mosaic both run.

Rows are zero-padded up to the m-tile; padded rows belong to no group. The megablox module is imported with importlib
because ``megablox/__init__.py`` rebinds the name ``gmm`` to the function, shadowing the module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trainer.kernels.tpu_layout import LANES

__all__ = ["GmmTiling", "gmm_backward_jax", "gmm_forward_jax", "gmm_jax"]

_megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
_NN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """Largest tile per dimension; each shrinks to a multiple of 128 dividing the dimension (or the full dimension)."""

    tile_m: int = 512
    tile_k: int = 512
    tile_n: int = 512


def _tile(dim: int, largest: int) -> int:
    return next((t for t in range(largest - largest % LANES, 0, -LANES) if dim % t == 0), dim)


def _m_tile(num_rows: int, largest: int) -> int:
    return min(largest, -(-num_rows // LANES) * LANES)


def _pad_rows(x: jax.Array, tile_m: int) -> jax.Array:
    return jnp.pad(x, ((0, -x.shape[0] % tile_m), (0, 0)))


def _expert_grad_kernel(offsets, group_ids, m_tile_ids, num_visits, x_ref, g_ref, out_ref, acc, *, tile_m):
    t = pl.program_id(2)
    last = pl.num_programs(2) - 1
    group = group_ids[t]

    @pl.when(jnp.logical_or(t == 0, group != group_ids[jnp.maximum(t - 1, 0)]))
    def _zero() -> None:
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    start, end = offsets[group], offsets[group + 1]

    @pl.when(jnp.logical_and(t < num_visits[0], end > start))
    def _accumulate() -> None:
        x, g = x_ref[...], g_ref[...]
        rows = m_tile_ids[t] * tile_m + lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
        in_group = jnp.logical_and(rows >= start, rows < end)
        x = jnp.where(in_group, x, jnp.zeros_like(x))
        g = jnp.where(in_group, g, jnp.zeros_like(g))
        acc[...] += lax.dot_general(x.T, g, _NN, preferred_element_type=jnp.float32)

    @pl.when(jnp.logical_or(t == last, group != group_ids[jnp.minimum(t + 1, last)]))
    def _store() -> None:
        out_ref[...] = acc[...].astype(out_ref.dtype)


def _expert_grads(
    x: jax.Array, grad: jax.Array, group_sizes: jax.Array, num_experts: int, tiles: tuple[int, int, int],
    out_dtype: jnp.dtype, interpret: bool,
) -> jax.Array:  # fmt: skip
    """``dw [E, K, N]`` with ``dw[e] = x_e.T @ grad_e``; ``x [M, K]`` and ``grad [M, N]`` padded to the m-tile."""
    (m, k), n = x.shape, grad.shape[1]
    tm, tk, tn = tiles
    (offsets, group_ids, m_tile_ids), num_visits = _megablox.make_group_metadata(
        group_sizes=group_sizes, m=m, tm=tm, start_group=jnp.int32(0), num_nonzero_groups=num_experts,
        visit_empty_groups=True,
    )  # fmt: skip
    max_visits = group_ids.shape[0]  # m // tm + E - 1: every visit schedule fits
    return pl.pallas_call(
        functools.partial(_expert_grad_kernel, tile_m=tm),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(k // tk, n // tn, max_visits),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda ki, ni, t, offs, gids, mids, nv: (mids[t], ki)),
                pl.BlockSpec((tm, tn), lambda ki, ni, t, offs, gids, mids, nv: (mids[t], ni)),
            ],
            out_specs=pl.BlockSpec((None, tk, tn), lambda ki, ni, t, offs, gids, mids, nv: (gids[t], ki, ni)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_experts, k, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(offsets, group_ids, m_tile_ids, jnp.reshape(num_visits, (1,)).astype(jnp.int32), x, grad)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret", "transpose_rhs"))
def gmm_forward_jax(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tiling: GmmTiling, interpret: bool,
    transpose_rhs: bool = False,
) -> jax.Array:  # fmt: skip
    """``[M, N]`` in ``x``'s dtype (float32 accumulation); ``group_sizes`` int32 summing to ``M``."""
    (num_rows, k), n = x.shape, w.shape[1 if transpose_rhs else 2]
    tm = _m_tile(num_rows, tiling.tile_m)
    tiles = (tm, _tile(k, tiling.tile_k), _tile(n, tiling.tile_n))
    out = _megablox.gmm(
        _pad_rows(x, tm), w, group_sizes, x.dtype, tiles, transpose_rhs=transpose_rhs, interpret=interpret
    )
    return out[:num_rows]


@functools.partial(jax.jit, static_argnames=("tiling", "interpret", "transpose_rhs"))
def gmm_backward_jax(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, grad_out: jax.Array, *, tiling: GmmTiling, interpret: bool,
    transpose_rhs: bool = False,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(dx [M, K], dw like w)`` for the cotangent ``grad_out [M, N]``; experts without rows get zeros."""
    num_rows, k = x.shape
    num_experts, n = w.shape[0], w.shape[1 if transpose_rhs else 2]
    tm = _m_tile(num_rows, tiling.tile_m)
    tk, tn = _tile(k, tiling.tile_k), _tile(n, tiling.tile_n)
    x_p, grad_p = _pad_rows(x, tm), _pad_rows(grad_out.astype(x.dtype), tm)
    dx = _megablox.gmm(
        grad_p, w, group_sizes, x.dtype, (tm, tn, tk), transpose_rhs=not transpose_rhs, interpret=interpret
    )
    if transpose_rhs:  # dw[e] = grad_e.T @ x_e: the same kernel with the operands swapped, already [E, N, K]
        dw = _expert_grads(grad_p, x_p, group_sizes, num_experts, (tm, tn, tk), w.dtype, interpret)
    else:
        dw = _expert_grads(x_p, grad_p, group_sizes, num_experts, (tm, tk, tn), w.dtype, interpret)
    return dx[:num_rows], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def gmm_jax(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiling: GmmTiling, interpret: bool, transpose_rhs: bool = False
) -> jax.Array:
    """Differentiable JAX entry point (no gradient to ``group_sizes``)."""
    return gmm_forward_jax(x, w, group_sizes, tiling=tiling, interpret=interpret, transpose_rhs=transpose_rhs)


def _gmm_fwd(x, w, group_sizes, tiling, interpret, transpose_rhs=False):
    out = gmm_forward_jax(x, w, group_sizes, tiling=tiling, interpret=interpret, transpose_rhs=transpose_rhs)
    return out, (x, w, group_sizes)


def _gmm_bwd(tiling, interpret, transpose_rhs, residuals, grad_out):
    x, w, group_sizes = residuals
    dx, dw = gmm_backward_jax(
        x, w, group_sizes, grad_out, tiling=tiling, interpret=interpret, transpose_rhs=transpose_rhs
    )
    return dx, dw, None


gmm_jax.defvjp(_gmm_fwd, _gmm_bwd)
