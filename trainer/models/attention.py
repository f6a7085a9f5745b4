"""Grouped-query self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3), plus the built-in kernels.

The projection weights keep the HF layout (``wq`` = ``q_proj`` etc.), so checkpoints and weight pushes need no
permutation. The attention product itself is a registered function picked by ``ModelConfig.attention`` (see
``trainer.models.registry`` for the contract); built in:

- ``sdpa``: ``scaled_dot_product_attention`` with ``is_causal=True`` per packed segment (one batched call per
  segment length), so no ``[T, T]`` mask is built and the cost is the sum of the segments' squared lengths, however
  long the packed row (an arbitrary mask would also force SDPA off its fused causal kernels). Segment-local: rows
  may be as long as the token budget. A segment that continues a shared prompt (``prefix_ids``) reads the prompt's
  keys and values before its own, under a bottom-right causal mask, batched per (prompt length, length).
- ``eager``: matmul-softmax-matmul over a dense mask, the plain reference.

Both take ``prefix_ids`` (registered ``shared_prefix=True``): ``[B, T]``, for each token the segment id of the shared
prompt its segment continues, or -1; a token then also attends to every token of that segment (which precedes it in
the row). See ``trainer.packing`` for the layout.

:func:`masked_sdpa_attention` (SDPA over the dense ``[B, 1, T, T]`` mask, not registered) is the parity reference of
the per-segment path.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from trainer.devices import needs_static_shapes
from trainer.models.config import ModelConfig
from trainer.models.layers import RMSNorm, compiled
from trainer.models.registry import ATTENTION_BLOCKS
from trainer.models.rope import apply_rope

__all__ = [
    "Attention",
    "PackedSegment",
    "attention_mask",
    "eager_attention",
    "masked_sdpa_attention",
    "packed_segments",
    "per_forward",
    "sdpa_attention",
    "segment_spans",
]


def attention_mask(
    seq_len: int, segment_ids: torch.Tensor | None, device: torch.device, prefix_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean keep-mask ``[B or 1, 1, T, T]``: causal, and within equal segment ids when they are given (and into the
    segment ``prefix_ids`` names for each token, when given)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if segment_ids is None:
        return causal[None, None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        same = same | (prefix_ids[:, :, None] == segment_ids[:, None, :])
    return (causal & same)[:, None]


def segment_spans(segment_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``segment_ids [B, T]``, the ``(start, end)`` of each run of equal ids, in order.

    Raises ``ValueError`` if an id comes back after another one in the same row (``[0, 0, 1, 0]``): such a row says
    that separated runs form one sequence, which per-run attention cannot honour; pack each sequence contiguously.
    """
    ids = segment_ids.detach().cpu()
    t = ids.shape[1]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    spans = []
    for r, row_starts in enumerate(starts.tolist()):
        bounds = [i for i, is_start in enumerate(row_starts) if is_start] + [t]
        if len(bounds) - 1 != int(ids[r].unique().numel()):
            raise ValueError(
                f"segment_ids row {r} repeats an id after a different one ({ids[r].tolist()}): each packed "
                "sequence must occupy one contiguous run of its row"
            )
        spans.append(list(zip(bounds[:-1], bounds[1:])))
    return spans


@dataclass(frozen=True)
class _LengthGroups:
    """The packed segments of one ``segment_ids`` tensor, grouped by (shared prompt length, length). ``order`` lists the
    flat query positions (into ``B * T``) group by group, segment by segment; group ``i`` holds ``shapes[i] =
    (segments, prompt length, length)``, and ``inverse`` puts tokens in group order back into packed order.
    ``key_order`` (only with shared prompts) lists each segment's key positions the same way: its prompt's, then its
    own."""

    shapes: list[tuple[int, int, int]]
    order: torch.Tensor
    inverse: torch.Tensor
    key_order: torch.Tensor | None
    row_lengths: list[list[int]]
    """Per row, the lengths of its segments in order."""


LayoutT = TypeVar("LayoutT")


def per_forward(build: Callable[[torch.Tensor, torch.Tensor | None], LayoutT]) -> Callable[..., LayoutT]:
    """Cache ``build(segment_ids, prefix_ids)`` for the last tensors it was given: every layer of a forward gets the
    same tensors, and reading them back to the host per layer would cost a device sync each time. A tensor changed in
    place (its version) or a different tensor builds afresh; the cache holds weak references only."""
    last: list[tuple[weakref.ref, int, weakref.ref | None, LayoutT]] = []

    @functools.wraps(build)
    def cached(segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> LayoutT:
        if last:
            ids_ref, version, prefix_ref, layout = last[0]
            same_prefix = (prefix_ref() if prefix_ref is not None else None) is prefix_ids
            if ids_ref() is segment_ids and version == segment_ids._version and same_prefix:
                return layout
        layout = build(segment_ids, prefix_ids)
        last[:] = [(weakref.ref(segment_ids), segment_ids._version, _weak(prefix_ids), layout)]
        return layout

    return cached


def _weak(tensor: torch.Tensor | None) -> weakref.ref | None:
    return None if tensor is None else weakref.ref(tensor)


@dataclass(frozen=True)
class PackedSegment:
    """One packed segment in flat ``[B * T]`` positions: its tokens ``[start, end)`` and those of the shared prompt
    it continues, ``[prompt_start, prompt_end)`` (empty when it continues none)."""

    start: int
    end: int
    prompt_start: int
    prompt_end: int


def packed_segments(segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> list[PackedSegment]:
    """Every run of :func:`segment_spans` in packed order (row by row), with the shared prompt ``prefix_ids`` names
    for its first token (``trainer.packing``'s layout)."""
    t = segment_ids.shape[1]
    ids = segment_ids.detach().cpu().tolist()
    prefixes = None if prefix_ids is None else prefix_ids.detach().cpu().tolist()
    out = []
    for r, row in enumerate(segment_spans(segment_ids)):
        span_of = {ids[r][a]: (a, b) for a, b in row}
        for a, b in row:
            prompt = -1 if prefixes is None else prefixes[r][a]
            pa, pb = span_of[prompt] if prompt >= 0 else (0, 0)
            out.append(PackedSegment(r * t + a, r * t + b, r * t + pa, r * t + pb))
    return out


@per_forward
def _length_groups(segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> _LengthGroups:
    """:func:`segment_spans` grouped by (prompt length, length), computed once per forward (:func:`per_forward`)."""
    members: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (prompt len, len) -> (start, prompt start)
    segments = packed_segments(segment_ids, prefix_ids)
    row_lengths: list[list[int]] = [[] for _ in range(segment_ids.shape[0])]
    for seg in segments:
        row_lengths[seg.start // segment_ids.shape[1]].append(seg.end - seg.start)
        members.setdefault((seg.prompt_end - seg.prompt_start, seg.end - seg.start), []).append(
            (seg.start, seg.prompt_start)
        )
    keys = sorted(members)

    def positions(with_prompt: bool) -> torch.Tensor:
        out = []
        for plen, n in keys:
            base = torch.tensor(members[(plen, n)])
            own = base[:, :1] + torch.arange(n)
            out.append((torch.cat([base[:, 1:] + torch.arange(plen), own], 1) if with_prompt else own).flatten())
        return torch.cat(out)

    order = positions(with_prompt=False)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    device = segment_ids.device
    key_order = positions(with_prompt=True).to(device) if prefix_ids is not None else None
    shapes = [(len(members[k]), k[0], k[1]) for k in keys]
    return _LengthGroups(shapes, order.to(device), inverse.to(device), key_order, row_lengths)


@ATTENTION_BLOCKS.register("sdpa", segment_local=True, shared_prefix=True)
def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None,
    scale: float,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal SDPA (fused CPU/GPU kernels, native GQA) applied to each packed segment separately.

    Equal to :func:`masked_sdpa_attention` (a token attends to earlier tokens of its own run of equal segment ids, and
    to the shared prompt ``prefix_ids`` names) without materialising any ``[T, T]`` mask; segments must be contiguous
    runs (see :func:`segment_spans`). Segments of equal length (and prompt length) go through one batched call (GRPO
    packs many short completions of a few lengths), so the number of kernel calls per layer is the number of distinct
    lengths, not of segments.

    On a device that compiles per shape (``xla``) the segment lengths would make every batch a new graph, so there it
    is :func:`masked_sdpa_attention`: the same numbers, at the cost of the dense mask.
    """
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if needs_static_shapes(q.device):
        return masked_sdpa_attention(q, k, v, segment_ids=segment_ids, scale=scale, prefix_ids=prefix_ids)
    b, h, t, d = q.shape
    layout = _length_groups(segment_ids, prefix_ids)
    if prefix_ids is None and 2 * len(layout.shapes) > sum(n for n, _, _ in layout.shapes):
        return _per_segment(q, k, v, segment_ids, scale, gqa)  # lengths mostly distinct: batching would only copy
    # Token-major [B * T, heads, Dh] in group order: one gather per input (its backward one index_add), then every
    # group is a view. With shared prompts the keys and values are gathered prompt first, so a prompt read by several
    # segments is copied once per segment (and its gradient summed back by the gather's backward).
    def token_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    key_order = layout.order if layout.key_order is None else layout.key_order
    qs_all = token_major(q).index_select(0, layout.order).split([n * length for n, _, length in layout.shapes])
    key_sizes = [n * (plen + length) for n, plen, length in layout.shapes]
    ks_all, vs_all = (token_major(x).index_select(0, key_order).split(key_sizes) for x in (k, v))
    outs = []
    for (n, plen, length), qs, ks, vs in zip(layout.shapes, qs_all, ks_all, vs_all, strict=True):
        qs = qs.view(n, length, h, d).transpose(1, 2)
        ks, vs = (x.view(n, plen + length, x.shape[1], d).transpose(1, 2) for x in (ks, vs))
        if plen == 0:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # bottom-right causal: every prompt key, then the segment's own keys up to the query
            mask = torch.ones(length, plen + length, dtype=torch.bool, device=q.device).tril(plen)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(n * length, h, d))
    # Returned as [B, T, H, Dh] transposed, so the caller's transpose back to [B, T, H * Dh] is a free view.
    return torch.cat(outs).index_select(0, layout.inverse).view(b, t, h, d).transpose(1, 2)


def _per_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    """One SDPA call per segment on views of the inputs (no copies): the better way when few lengths repeat."""
    pieces = []
    # split (not slicing) so backward concatenates the pieces' gradients once instead of zero-filling a full-size
    # gradient per piece.
    layout = _length_groups(segment_ids)
    for lengths, qr, kr, vr in zip(layout.row_lengths, q.split(1), k.split(1), v.split(1), strict=True):
        for qs, ks, vs in zip(qr.split(lengths, 2), kr.split(lengths, 2), vr.split(lengths, 2), strict=True):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            pieces.append(out.transpose(1, 2))
    b, t = segment_ids.shape
    return torch.cat(pieces, dim=1).view(b, t, q.shape[1], q.shape[3]).transpose(1, 2)


def masked_sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None,
    scale: float,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over the dense ``[B, 1, T, T]`` causal-and-same-segment mask: the parity reference of ``sdpa``."""
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = attention_mask(q.shape[2], segment_ids, q.device, prefix_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@ATTENTION_BLOCKS.register("eager", shared_prefix=True)
def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None,
    scale: float,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain matmul-softmax-matmul reference (softmax in float32); materialises the [T, T] scores."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~attention_mask(q.shape[2], segment_ids, q.device, prefix_ids), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    """Self-attention block: q/k/v projections, optional q/k RMSNorm, RoPE, a registered kernel, output projection."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.use_compiled = False  # RoPE through its torch.compile-d copy (Transformer.compile_elementwise)
        self.kernel = ATTENTION_BLOCKS.get(cfg.attention)
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_dim, bias=False, device=device, dtype=dtype)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False, device=device, dtype=dtype)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False, device=device, dtype=dtype)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False, device=device, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, dtype) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segment_ids: torch.Tensor | None,
        keep: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; ``rope`` = (cos, sin) from :func:`rope_cos_sin`. With ``keep`` (int64 flat
        positions ``b * T + t``): ``[N, D]``, the output projection applied to those positions only. ``prefix_ids``:
        shared prompts (only for a kernel registered ``shared_prefix=True``)."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rotate = compiled(apply_rope) if self.use_compiled else apply_rope
        q, k = rotate(q, *rope), rotate(k, *rope)
        shared = {} if prefix_ids is None else {"prefix_ids": prefix_ids}
        out = self.kernel(q, k, v, segment_ids=segment_ids, scale=self.scale, **shared)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.wo(out if keep is None else out.reshape(b * t, -1).index_select(0, keep))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.normal_(lin.weight, std=std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
